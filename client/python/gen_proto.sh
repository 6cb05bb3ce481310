#!/usr/bin/env bash
# Generates the kvpool.v1 Python stubs (kvpool_pb2, kvpool_pb2_grpc) from proto/ into
# client/python/kvpool_client/v1/ (git-ignored) with grpc_tools.protoc. Run at install or test
# time; idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
proto_root=${KVPOOL_PROTO_ROOT:-$here/../../proto}
out=$here/kvpool_client/v1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
${PYTHON:-python3} -m grpc_tools.protoc --proto_path="$proto_root" --python_out="$tmp" \
  --grpc_python_out="$tmp" "$proto_root/kvpool/v1/kvpool.proto"
mkdir -p "$out"
# The stubs import each other as the top-level package kvpool.v1; inside kvpool_client.v1
# they are siblings.
sed -e 's/^from kvpool\.v1 import kvpool_pb2/from . import kvpool_pb2/' \
  "$tmp/kvpool/v1/kvpool_pb2_grpc.py" > "$out/kvpool_pb2_grpc.py"
cp "$tmp/kvpool/v1/kvpool_pb2.py" "$out/kvpool_pb2.py"
echo '"""Generated kvpool.v1 stubs (client/python/gen_proto.sh)."""' > "$out/__init__.py"
