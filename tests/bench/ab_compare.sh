#!/usr/bin/env bash
# Measures a change against the build before it in one call on the GPU machine: the quantize
# kernel benchmark and the in-process Attend timings (each once, when both builds carry them),
# then, on a fresh server per side, AttendStream steps and in-place AttendSocket region decode
# steps with appends over loopback, for the binaries in carry/bin named <name>_base (the build
# before) and <name> (the change), the sides alternated for $AB_ROUNDS rounds (default 1; the
# kvpool client tool is the change's for both). Pack the change with
# tests/gpu/package_for_device.sh, copy the base build's kvpool-server and, when they changed,
# attend_latency_bench and quantize_bench into carry/bin with the _base suffix, and pack
# carry.tar.xz again.
#   [AB_ROUNDS=n] tests/bench/ab_compare.sh <base commit> <commit>
#   (writes ab_*.json and ab_grpc.txt under $OUT)
set -uo pipefail
base_commit=${1:-base}
commit=${2:-change}
source tests/bench/grpc_bench_lib.sh
bench_setup ab_grpc.txt

# Links side $1's binaries into a fresh folder and sets $bin and $label.
side_bin() {
  local suffix
  suffix=$([[ $1 == base ]] && echo _base || echo "")
  label=$([[ $1 == base ]] && echo "$base_commit" || echo "$commit")
  bin=$(mktemp -d)
  for name in kvpool-server quantize_bench attend_latency_bench; do
    [[ -e carry/bin/$name$suffix ]] && ln -s "$PWD/carry/bin/$name$suffix" "$bin/$name"
  done
  ln -s "$PWD/carry/bin/kvpool" "$bin/kvpool"
}

for side in base change; do
  side_bin "$side"
  if [[ -e carry/bin/quantize_bench_base && -e carry/bin/quantize_bench ]]; then
    "$bin/quantize_bench" --commit="$label" --out="$out/ab_quantize_$side.json" || status=1
  fi
  if [[ -e carry/bin/attend_latency_bench_base && -e carry/bin/attend_latency_bench ]]; then
    "$bin/attend_latency_bench" --commit="$label" --out="$out/ab_attend_latency_$side.json" \
      || status=1
  fi
done

for round in $(seq "${AB_ROUNDS:-1}"); do
  for side in base change; do
    side_bin "$side"
    echo "== round $round, $side ($label)" | tee -a "$grpc"
    start_server
    for shape in "1 32768" "1 16" "32 4096"; do
      read -r batch context <<< "$shape"
      timed_attend AttendStream.step "AttendStream steps" --batch=$batch --context=$context \
        --iters=300 --stream
    done
    for shape in "1 32768" "32 4096"; do
      read -r batch context <<< "$shape"
      timed_attend AttendSocket.step "AttendSocket in-place region decode steps with appends" \
        --batch=$batch --context=$context --iters=300 --stream \
        --attend_unix_socket="$tmp/attend.sock" --in_place --append
    done
    stop_server
  done
done
cat "$tmp/server.log"
exit $status
