#!/usr/bin/env bash
# The README's test command. Installs dependencies (and, where nvcc exists, fetches FlashInfer's
# headers for the peer benchmark), builds everything into build/, runs ctest
# (GPU-labelled tests only when a GPU is visible; they are always built) and the Python client
# tests against the real kvpool-server. Exits non-zero if any step fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${KVPOOL_BUILD_DIR:-$root/build}

"$root/deploy/local/install_deps.sh"
export PATH="${KVPOOL_VENV:-$root/.venv}/bin:$PATH"  # its Python packages (install_deps.sh)
# FlashInfer's headers (PyPI sdist, git-ignored) so that the peer benchmark builds here too, only
# where nvcc is found the way CMake's check_language(CUDA) looks for it ($CUDACXX, PATH,
# $CUDA_PATH/bin): CMake uses them only when it builds the CUDA targets.
flashinfer_include=
if [[ -n ${CUDACXX:-} ]] || command -v nvcc >/dev/null \
  || [[ -n ${CUDA_PATH:-} && -x $CUDA_PATH/bin/nvcc ]]; then
  flashinfer_include=$("$root/tests/bench/fetch_flashinfer.sh")
fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVPOOL_FLASHINFER_INCLUDE="$flashinfer_include"
cmake --build "$build" -j"$(nproc)"

status=0
ctest_args=(--output-on-failure)
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU visible: skipping ctest label gpu"
  ctest_args+=(-LE gpu)
fi
(cd "$build" && ctest "${ctest_args[@]}") || status=1

KVPOOL_SERVER_BIN="$build/kvpool-server" python3 -m pytest -q "$root/tests/python" \
  || status=1
exit "$status"
