#!/usr/bin/env bash
# Measures a change against the build before it in one call on the GPU machine: the quantize
# kernel benchmark, the in-process Attend timings and AttendStream steps over gRPC loopback, for
# the binaries in carry/bin named <name>_base (the build before) and <name> (the change), one
# after the other (the kvpool client tool is the change's for both). Pack the change with
# tests/gpu/package_for_device.sh, copy the base build's kvpool-server, attend_latency_bench and,
# when the kernel changed, quantize_bench into carry/bin with the _base suffix, and pack
# carry.tar.xz again. The quantize benchmark runs only when both builds carry it.
#   tests/bench/ab_compare.sh <base commit> <commit>   (writes ab_*.json and ab_grpc.txt under $OUT)
set -uo pipefail
base_commit=${1:-base}
commit=${2:-change}
source tests/bench/grpc_bench_lib.sh
bench_setup ab_grpc.txt

for side in base change; do
  suffix=$([[ $side == base ]] && echo _base || echo "")
  label=$([[ $side == base ]] && echo "$base_commit" || echo "$commit")
  bin=$(mktemp -d)
  for name in kvpool-server quantize_bench attend_latency_bench; do
    [[ -e carry/bin/$name$suffix ]] && ln -s "$PWD/carry/bin/$name$suffix" "$bin/$name"
  done
  ln -s "$PWD/carry/bin/kvpool" "$bin/kvpool"
  echo "== $side ($label)" | tee -a "$grpc"
  if [[ -e carry/bin/quantize_bench_base && -e carry/bin/quantize_bench ]]; then
    "$bin/quantize_bench" --commit="$label" --out="$out/ab_quantize_$side.json" || status=1
  fi
  "$bin/attend_latency_bench" --commit="$label" --out="$out/ab_attend_latency_$side.json" || status=1
  start_server
  for shape in "1 32768" "1 16" "32 4096"; do
    read -r batch context <<< "$shape"
    timed_attend AttendStream.step "AttendStream steps" --batch=$batch --context=$context \
      --iters=300 --stream
  done
  stop_server
done
cat "$tmp/server.log"
exit $status
