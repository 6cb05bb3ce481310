#!/usr/bin/env bash
# The CPU backend builds without CUDA (DESIGN.md: "CUDA optional"): configures the tree with
# KVPOOL_ENABLE_CUDA=OFF and, ahead of every system include directory, CUDA and NCCL headers that
# fail when included, then builds the server and the CLI. A source that includes a CUDA header
# outside its KVPOOL_WITH_CUDA / KVPOOL_WITH_NCCL guard fails here even on a machine that has CUDA
# installed.
# usage: no_cuda_build_test.sh <source-dir>
set -euo pipefail
src=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/poison"
for h in cuda.h cuda_runtime.h cuda_runtime_api.h cuda_fp16.h cuda_bf16.h cuda_fp8.h nccl.h; do
  echo "#error \"$h included in a build without CUDA\"" > "$tmp/poison/$h"
done
cmake -S "$src" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKVPOOL_ENABLE_CUDA=OFF \
  -DKVPOOL_BUILD_TESTS=OFF -DCMAKE_CXX_FLAGS="-I$tmp/poison -O0 -g0" > "$tmp/configure.log" \
  || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" -j"$(nproc)" --target kvpool-server kvpool > "$tmp/build.log" \
  || { grep -B2 -A4 'error' "$tmp/build.log" | head -60; exit 1; }
"$tmp/build/kvpool-server" --helpfull > "$tmp/help.txt" 2>&1 || true  # --helpfull exits 1
grep -q -- '--backend' "$tmp/help.txt" \
  || { echo "kvpool-server built without CUDA does not run:"; head "$tmp/help.txt"; exit 1; }
echo "built kvpool-server and kvpool without CUDA"
