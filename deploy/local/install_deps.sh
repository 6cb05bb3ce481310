#!/usr/bin/env bash
# Installs everything kvpool needs to build, test and run on a fresh Debian 12 machine.
# Idempotent: a second run only checks. Needs root (or sudo) for apt-get.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libcivetweb-dev
  prometheus curl python3-venv
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  # Only the packages' programs are used: their daemons (Debian's prometheus starts one on :9090)
  # are not started during the install (policy-rc.d, where none is set) nor enabled after it.
  policy=/usr/sbin/policy-rc.d
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    trap '$SUDO rm -f "$policy"' EXIT
  fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [[ -d /run/systemd/system ]]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

# The Python packages go into a virtual environment, $KVPOOL_VENV (by default .venv at the
# repository root, made with $PYTHON or python3): Debian's own Python refuses pip installs
# (PEP 668). The other scripts put its bin/ first on PATH. deploy/constraints.txt pins their
# versions.
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${KVPOOL_VENV:-$root/.venv}
[[ -x $venv/bin/python ]] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q -r "$root/client/python/requirements.txt" \
  -r "$root/deploy/requirements-dev.txt" -c "$root/deploy/constraints.txt"
