#!/usr/bin/env bash
# Attend over gRPC with the server and the kvpool tool pinned to CPUs, on the GPU machine
# (binaries packed by tests/gpu/package_for_device.sh): unary calls and AttendStream steps at
# 1 x 16 and 1 x 32K, and in-place AttendSocket decode steps with appends at 32 x 4K, two rounds
# per placement: unpinned; server on 4 CPUs and the tool on 2 others; both on the same 4 CPUs;
# the server with one Attend thread on 2 CPUs and the tool on 1 other. Prints the CPUs, their
# idle states and the GPU's CPU affinity first.
#   tests/bench/attend_affinity.sh   (writes attend_affinity.txt under $OUT, or ./out)
set -uo pipefail
source tests/bench/grpc_bench_lib.sh
bench_setup attend_affinity.txt

{
  echo "== CPUs allowed: $(taskset -pc $$ | sed 's/.*: //'), nproc $(nproc)"
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node)'
  echo "cpuidle: $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null)"
  for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do
    [[ -d $s ]] && echo "  $(cat "$s/name"): exit latency $(cat "$s/latency") us"
  done
  echo "governor: $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null)"
  nvidia-smi topo -m
} 2>&1 | tee -a "$grpc"

# The first CPUs this process may use, as taskset lists.
mapfile -t allowed < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
list() { local IFS=,; echo "${allowed[*]:$1:$2}"; }

rounds() {  # label, then extra server flags
  local label=$1 round shape batch context
  shift
  for round in 1 2; do
    start_server "$@"
    echo "[$label, round $round: server CPUs ${server_cpus:-any}, tool CPUs ${cli_cpus:-any}]" \
      | tee -a "$grpc"
    for shape in "1 16" "1 32768"; do
      read -r batch context <<< "$shape"
      timed_attend Attend "unary Attend calls" --batch=$batch --context=$context --iters=300 \
        --nostream
      timed_attend AttendStream.step "AttendStream steps" --batch=$batch --context=$context \
        --iters=300 --stream
    done
    timed_attend AttendSocket.step "AttendSocket in-place region decode steps with appends" \
      --batch=32 --context=4096 --iters=300 --stream --attend_unix_socket="$tmp/attend.sock" \
      --in_place --append
    stop_server
  done
}

server_cpus="" cli_cpus="" rounds "unpinned"
server_cpus=$(list 0 4) cli_cpus=$(list 4 2) rounds "server on 4 CPUs, tool on 2 others"
server_cpus=$(list 0 4) cli_cpus=$(list 0 4) rounds "server and tool on the same 4 CPUs"
server_cpus=$(list 0 2) cli_cpus=$(list 2 1) rounds "server (1 Attend thread) on 2 CPUs, tool on 1" \
  --attend_threads=1
cat "$tmp/server.log" >> "$grpc"
exit $status
