#!/usr/bin/env bash
# Installs everything kvpool needs to build, test and run on a fresh Debian 12 machine.
# Idempotent: a second run only checks. Needs root (or sudo) for apt-get.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libcivetweb-dev
  prometheus curl
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
$PY -m pip install -q -r "$(dirname "$0")/../../client/python/requirements.txt" \
  -r "$(dirname "$0")/../requirements-dev.txt"
