# Shell helpers for the gRPC loopback runs on the GPU machine, sourced by device_suite.sh,
# ab_compare.sh, attend_spin.sh and attend_transports.sh. The caller sets $bin (carry/bin), $tmp
# (scratch), $grpc (the results file) and $status (0), or has bench_setup set them, and keeps
# $server (the server's pid) for stop_server. $server_cpus / $cli_cpus, when set, pin the server /
# the kvpool tool to those CPUs (a taskset list).

source tests/bench/carry_env.sh

bench_setup() {  # results file name: $out, $tmp, $bin (carry_setup), $grpc, $status
  carry_setup
  grpc=$out/$1
  status=0
}

start_server() {  # extra kvpool-server flags; sets $server (AttendSocket: TCP 50052, $tmp/attend.sock)
  # 1 x 32K tokens x 32 layers of fp16 is 4.3 GB in one Put stream: raise the 4 GiB default.
  ${server_cpus:+taskset -c "$server_cpus"} "$bin/kvpool-server" --backend=cuda --port=50051 --metrics_port=9464 --attend_socket_port=50052 \
    --attend_unix_socket="$tmp/attend.sock" --max_put_stream_bytes=17179869184 "$@" \
    >> "$tmp/server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null && break; sleep 0.1; done
}

stop_server() {
  kill -TERM "$server"
  wait "$server"
  echo "server exit: $?"
}

cli() {  # the kvpool tool against the server; its output and, when it fails, its exit status
  timeout 120 ${cli_cpus:+taskset -c "$cli_cpus"} "$bin/kvpool" --target=127.0.0.1:50051 "$@" 2>&1 | tee -a "$grpc"
  local rc=${PIPESTATUS[0]}
  ((rc == 0)) || { echo "kvpool $*: exit status $rc" | tee -a "$grpc"; status=1; }
}

# Each Attend run also reports the server's mean time per unary call, or per AttendStream or
# AttendSocket step (kvpool_rpc_duration_seconds{method="Attend", "AttendStream.step" or
# "AttendSocket.step"}) over the run.
duration_sum() {  # method -> "sum count" of its kvpool_rpc_duration_seconds series
  curl -s 127.0.0.1:9464/metrics | awk -v m="$1" '
    index($1, "kvpool_rpc_duration_seconds_sum{method=\"" m "\"") == 1 { s += $2 }
    index($1, "kvpool_rpc_duration_seconds_count{method=\"" m "\"") == 1 { c += $2 }
    END { print s + 0, c + 0 }'
}

timed_attend() {  # method, label, then the bench attend flags
  local method=$1 label=$2 s0 c0 s1 c1
  shift 2
  read -r s0 c0 < <(duration_sum "$method")
  cli bench attend "$@"
  read -r s1 c1 < <(duration_sum "$method")
  awk -v a="$s0" -v b="$s1" -v n0="$c0" -v n1="$c1" -v what="$label" 'BEGIN { if (n1 > n0)
    printf "server time: mean %.0f us over %d %s\n", (b - a) / (n1 - n0) * 1e6, n1 - n0, what }' \
    | tee -a "$grpc"
}
