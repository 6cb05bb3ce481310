#!/usr/bin/env bash
# AttendStream (gRPC) against the AttendSocket over TCP and over its Unix socket with a
# shared-memory region (filled by the session's copies, and in place: `bench attend --in_place`),
# on one CUDA server on the GPU machine: for batch 1 x 32K, 1 x 16, 32 x 4K
# and 32 x 16, `kvpool bench attend --stream` over each transport in turn, twice, with the server's
# mean step time. Extra arguments go to every bench run (e.g. --append for
# decode steps that append a token per item). Binaries packed by tests/gpu/package_for_device.sh.
#   tests/bench/attend_transports.sh [bench flags]   (writes attend_transports.txt under $OUT)
set -uo pipefail
source tests/bench/grpc_bench_lib.sh
bench_setup attend_transports.txt
start_server
for shape in "1 32768" "1 16" "32 4096" "32 16"; do
  read -r batch context <<< "$shape"
  for round in 1 2; do
    timed_attend AttendStream.step "AttendStream steps" --batch=$batch --context=$context \
      --iters=300 --stream "$@"
    timed_attend AttendSocket.step "AttendSocket steps" --batch=$batch --context=$context \
      --iters=300 --stream --attend_socket_port=50052 "$@"
    timed_attend AttendSocket.step "AttendSocket region steps" --batch=$batch --context=$context \
      --iters=300 --stream --attend_unix_socket="$tmp/attend.sock" "$@"
    timed_attend AttendSocket.step "AttendSocket in-place region steps" --batch=$batch \
      --context=$context --iters=300 --stream --attend_unix_socket="$tmp/attend.sock" --in_place "$@"
  done
done
stop_server
cat "$tmp/server.log"
exit $status
