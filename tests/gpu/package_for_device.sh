#!/usr/bin/env bash
# Packs binaries built here for the GPU machine: copies them (stripped) and every shared library
# they need that the GPU machine lacks (everything but glibc, libstdc++, libgcc_s, the CUDA
# driver and NCCL, which PyTorch ships there) into carry/ (git-ignored), and packs that folder as
# carry.tar.xz (git-ignored; the tree may carry 64 MiB). Run there with:
#   tar -xJf carry.tar.xz && LD_LIBRARY_PATH=carry/lib carry/bin/<name>
# usage: tests/gpu/package_for_device.sh <binary>...
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
tar -cJf "$out.tar.xz" "$out"
du -sh "$out" "$out.tar.xz"
