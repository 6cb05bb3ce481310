#!/usr/bin/env bash
# Installs the build tree into a temporary prefix and builds tests/client/install_consumer against
# it with find_package(kvpool): the C++ client is an installable CMake package.
# usage: client_install_test.sh <build-dir> <source-dir>
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
cmake -S "$src/tests/client/install_consumer" -B "$tmp/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/consumer" > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/consumer/consumer"
