#!/usr/bin/env bash
# What busy polling buys an AttendStream step, on the GPU machine (binaries packed by
# tests/gpu/package_for_device.sh): batch 1 x 32K and 1 x 16 steps with the server's threads and
# the client's session polling (the defaults), the client blocking at once (--attend_spin_us=0),
# and both blocking (the server restarted with --attend_spin_us=0). Kept out of
# device_suite.sh, which it would push past the machine's 10-minute limit per call.
#   tests/bench/attend_spin.sh   (writes attend_spin.txt under $OUT, or ./out)
set -uo pipefail
source tests/bench/grpc_bench_lib.sh
bench_setup attend_spin.txt

steps() {  # label, then extra bench flags
  local label=$1 context
  shift
  for context in 32768 16; do
    echo "[$label]" | tee -a "$grpc"
    timed_attend AttendStream.step "AttendStream steps" --batch=1 --context=$context --iters=300 \
      --stream "$@"
  done
}
start_server
steps "server and client polling"
steps "server polling, client blocking" --attend_spin_us=0
stop_server
start_server --attend_spin_us=0
steps "server and client blocking" --attend_spin_us=0
stop_server
cat "$tmp/server.log"
exit $status
