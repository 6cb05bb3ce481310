#!/usr/bin/env bash
# Where the time goes, in one call on the GPU machine: the quantize benchmark, Nsight Compute on
# the first split-attention launches of attention_bench (batch 1 x 32K, INT4) and on the merge and
# query-rotation kernels, and the Attend RPC split into client latency, server handler time
# (kvpool_rpc_duration_seconds) and a 16-token floor. Expects binaries packed by
# tests/gpu/package_for_device.sh. Writes under $OUT (or ./out).
#   tests/bench/profile_suite.sh [gpu tests...]
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
[[ -d carry ]] || tar -xJf carry.tar.xz
export LD_LIBRARY_PATH=$PWD/carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/carry/bin
exec > >(tee -a "$out/profile.log") 2>&1
for t in "$@"; do
  if "$bin/$t" > "$out/$t.log" 2>&1; then echo "$t: PASSED"; else echo "$t: FAILED"; tail -30 "$out/$t.log"; fi
done
[[ -x $bin/quantize_bench ]] && "$bin/quantize_bench" --out="$out/quantize.json"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [[ -x $bin/attention_bench && -x $ncu ]]; then
  timeout 150 "$ncu" --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats --section InstructionStats \
    -k regex:'AttentionSplitMma|MergeSplits|RotateQuery' --launch-count 6 \
    "$bin/attention_bench" --iters=1 > "$out/ncu_attention.txt" 2>&1
  echo "ncu attention: $?"
fi
if [[ -x $bin/kvpool-server ]]; then
  "$bin/kvpool-server" --backend=cuda --port=50051 --metrics_port=9464 \
    --max_put_stream_bytes=17179869184 > "$out/server.log" 2>&1 &
  for _ in $(seq 300); do (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null && break; sleep 0.1; done
  server_ms() {  # mean server handler time of unary Attend since the last call, in microseconds
    local s c
    read -r s c < <(curl -s 127.0.0.1:9464/metrics | awk '/^kvpool_rpc_duration_seconds_sum\{method="Attend"/{s=$2} /^kvpool_rpc_duration_seconds_count\{method="Attend"/{c=$2} END{print s+0, c+0}')
    awk -v s="$s" -v c="$c" -v ps="${prev_s:-0}" -v pc="${prev_c:-0}" \
      'BEGIN{ if (c > pc) printf "server handler mean %.0f us over %d calls\n", (s-ps)/(c-pc)*1e6, c-pc }'
    prev_s=$s; prev_c=$c
  }
  server_ms > /dev/null
  for shape in "1 32768" "32 4096" "1 16" "32 16"; do
    set -- $shape
    for mode in --nostream --stream; do
      timeout 120 "$bin/kvpool" --target=127.0.0.1:50051 bench attend --batch=$1 --context=$2 \
        --iters=300 $mode
      [[ $mode == --nostream ]] && server_ms
    done
  done
  kill -TERM %1; wait
fi
