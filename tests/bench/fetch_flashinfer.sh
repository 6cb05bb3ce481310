#!/usr/bin/env bash
# Fetches FlashInfer's header-only C++ library (the include/ tree of the flashinfer-python sdist
# on PyPI, plus its LICENSE) for tests/bench/flashinfer_decode_bench.cu; nothing of it is
# committed. The decode kernels need only include/ (no cutlass, no spdlog). Idempotent: does
# nothing when DIR already holds the headers. Prints DIR/include, the value for
#   cmake -DKVPOOL_FLASHINFER_INCLUDE=<DIR/include>
# usage: tests/bench/fetch_flashinfer.sh [DIR]   (default: third_party_fetch/flashinfer, git-ignored)
set -euo pipefail
version=0.2.14.post1
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/third_party_fetch/flashinfer}
if [[ ! -f $dir/include/flashinfer/attention/decode.cuh ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "${PYTHON:-python3}" -m pip download --no-deps --no-binary=:all: --no-build-isolation \
    "flashinfer-python==$version" -d "$tmp" >&2
  top=flashinfer_python-$version
  tar -xzf "$tmp/$top.tar.gz" -C "$tmp" "$top/include" "$top/LICENSE"
  # Assembled beside DIR and moved into place whole, so a failed run leaves no partial tree.
  mkdir -p "$(dirname "$dir")"
  stage=$(mktemp -d "$dir.partial.XXXXXX")
  mv "$tmp/$top/include" "$tmp/$top/LICENSE" "$stage/"
  echo "$version" > "$stage/VERSION"
  rm -rf "$dir"
  mv "$stage" "$dir"
fi
echo "$(cd "$dir/include" && pwd)"
