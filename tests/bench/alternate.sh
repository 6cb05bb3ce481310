#!/usr/bin/env bash
# Measures builds against each other in one call on the GPU machine: runs each LABEL=BINARY in turn,
# the whole round --rounds times (default 2), with the same arguments, so that the machine's drift
# falls on every build alike. Binaries are paths (e.g. carry/bin/quantize_bench_base, packed by
# tests/gpu/package_for_device.sh); each run writes --out=$OUT/LABEL.ROUND.json and its stdout to
# $OUT/LABEL.ROUND.txt. The benchmark must take --commit and --out (quantize_bench,
# attention_bench, attend_latency_bench).
#   tests/bench/alternate.sh [--rounds=N] LABEL=BINARY... -- [benchmark arguments]
set -uo pipefail
source tests/bench/carry_env.sh
carry_setup
parse_builds 2 "$@"
status=0
for ((r = 1; r <= rounds; ++r)); do
  for build in "${builds[@]}"; do
    label=${build%%=*}
    "${build#*=}" --commit="$label" --out="$out/$label.$r.json" "${bench_args[@]}" > "$out/$label.$r.txt" 2>&1 \
      || { echo "$label round $r failed" >&2; status=1; }
    echo "== $label round $r"
    tail -n 40 "$out/$label.$r.txt"
  done
done
exit $status
