#!/usr/bin/env bash
# End to end with a real Prometheus: starts kvpool-server and prometheus (scraping the server's
# /metrics every second), drives puts and matches with the kvpool CLI, waits (bounded) until
# Prometheus' query API returns kvpool_tokens_stored and kvpool_rpc_duration_seconds_count, and
# lints a scrape with `promtool check metrics`.
# usage: prometheus_scrape_test.sh <kvpool-server binary> <kvpool CLI binary>
set -euo pipefail
server_bin=${1:?kvpool-server binary}
cli_bin=${2:?kvpool CLI binary}
for tool in prometheus promtool curl python3; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool not installed" >&2; exit 1; }
done

work=$(mktemp -d)
server_pid=""
prom_pid=""
cleanup() {
  [[ -n $prom_pid ]] && kill "$prom_pid" 2>/dev/null && wait "$prom_pid" 2>/dev/null
  [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  echo "--- server log" >&2; cat "$work/server.log" >&2 || true
  echo "--- prometheus log (tail)" >&2; tail -20 "$work/prometheus.log" >&2 || true
  exit 1
}
# Waits up to $1 seconds for command "${@:2}" to succeed.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The server picks its own ports and names them in its start-up line.
"$server_bin" --port=0 --metrics_port=0 --attend_socket_port=0 --backend=cpu --pool_bytes=268435456 \
  >"$work/server.log" 2>&1 &
server_pid=$!
wait_for 30 grep -q "listening:" "$work/server.log" || fail "server did not start"
grpc_port=$(sed -n 's/.*grpc port \([0-9]*\),.*/\1/p' "$work/server.log")
metrics_port=$(sed -n 's/.*metrics port \([0-9]*\),.*/\1/p' "$work/server.log")

prom_port=$(free_port)
cat >"$work/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvpool
    static_configs:
      - targets: ["127.0.0.1:${metrics_port}"]
YAML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:${prom_port}" >"$work/prometheus.log" 2>&1 &
prom_pid=$!

for seed in 1 2 3; do
  "$cli_bin" --target="127.0.0.1:${grpc_port}" --tokens=96 --seed=$seed put >>"$work/cli.log" 2>&1 ||
    fail "kvpool put (seed $seed): $(cat "$work/cli.log")"
done
"$cli_bin" --target="127.0.0.1:${grpc_port}" --tokens=96 --seed=1 match >>"$work/cli.log" 2>&1 ||
  fail "kvpool match: $(cat "$work/cli.log")"

# True when Prometheus returns a sample > 0 for the query $1.
has_sample() {
  curl -sf --get "http://127.0.0.1:${prom_port}/api/v1/query" --data-urlencode "query=$1" |
    python3 -c 'import json, sys
r = json.load(sys.stdin)["data"]["result"]
sys.exit(0 if r and all(float(x["value"][1]) > 0 for x in r) else 1)'
}
wait_for 30 has_sample 'kvpool_tokens_stored{namespace="default"}' ||
  fail "kvpool_tokens_stored never reached Prometheus"
wait_for 30 has_sample 'kvpool_rpc_duration_seconds_count{method="Put",code="OK"}' ||
  fail "kvpool_rpc_duration_seconds_count never reached Prometheus"

curl -sf "http://127.0.0.1:${metrics_port}/metrics" >"$work/scrape.txt" || fail "scrape failed"
if ! promtool check metrics <"$work/scrape.txt" >"$work/promtool.log" 2>&1 || [[ -s $work/promtool.log ]]; then
  fail "promtool check metrics: $(cat "$work/promtool.log")"
fi

kill -TERM "$server_pid"
wait "$server_pid" || fail "server exited with status $?"
server_pid=""
echo "PASS: Prometheus scraped kvpool (grpc :$grpc_port, metrics :$metrics_port)"
