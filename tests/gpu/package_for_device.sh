#!/usr/bin/env bash
# Packs binaries built here for the GPU machine: copies them (stripped) and every shared library
# they need that the GPU machine lacks (everything but glibc, libstdc++, libgcc_s, the CUDA
# driver and NCCL, which PyTorch ships there) into carry/ (git-ignored), and packs that folder as
# carry.tar.xz (git-ignored; the tree may carry 64 MiB). Run there with:
#   tar -xJf carry.tar.xz && LD_LIBRARY_PATH=carry/lib carry/bin/<name>
# With CARRY_PYTHON=1 it also adds what the Python client tests need there (device_suite.sh runs
# them against the CUDA backend): the generated stubs and wheels of the client's dependencies
# that the GPU machine lacks or has at other versions (downloaded here from PyPI).
# usage: [CARRY_PYTHON=1] tests/gpu/package_for_device.sh <binary>...
set -euo pipefail
out=${CARRY_DIR:-carry}
mkdir -p "$out/bin" "$out/lib"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libcuda\.so|libnccl\.so)'
for bin in "$@"; do
  cp "$bin" "$out/bin/" && strip "$out/bin/$(basename "$bin")"
  ldd "$bin" | awk '/=> \//{print $1" "$3}' | while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [[ -e $out/lib/$name ]] || { cp -L "$path" "$out/lib/$name"; strip "$out/lib/$name"; }
  done
done
if [[ ${CARRY_PYTHON:-0} == 1 ]]; then
  root=$(cd "$(dirname "$0")/../.." && pwd)
  stubs=$root/client/python/kvpool_client/v1
  [[ -f $stubs/kvpool_pb2.py ]] || bash "$root/client/python/gen_proto.sh"
  rm -rf "$out/python" && mkdir -p "$out/python/wheels"
  cp -r "$stubs" "$out/python/stubs"
  # The stubs check the runtime versions of protobuf and grpcio they were generated with.
  versions=$(python3 -c 'import google.protobuf as p, grpc; print(p.__version__, grpc.__version__)')
  read -r protobuf_version grpc_version <<< "$versions"
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$out/python/wheels" \
    "protobuf==$protobuf_version" "grpcio==$grpc_version" pytest pluggy iniconfig packaging
fi
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"  # relative names
du -sh "$out" "$out.tar.xz"
