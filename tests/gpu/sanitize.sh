#!/usr/bin/env bash
# Runs GPU tests under NVIDIA's compute-sanitizer on the GPU machine (its CUDA toolkit's, or
# $COMPUTE_SANITIZER), the tests packed by tests/gpu/package_for_device.sh. Each argument
# TOOL:TEST[:GTEST_FILTER] runs carry/bin/TEST under `compute-sanitizer --tool TOOL`:
#   memcheck   device accesses out of bounds (with padding after every allocation) or misaligned,
#              device memory leaked at exit, CUDA API errors
#   racecheck  shared-memory hazards between the threads of a CTA
#   synccheck  barriers and warp-synchronous calls used wrongly
#   initcheck  device global memory read before anything wrote it
# Writes TOOL_TEST.N.log for the Nth run and sanitize.txt (one line per run) under $OUT (or ./out); exits
# non-zero when a run reported an error, failed a test or passed SANITIZE_TIMEOUT_S (300).
#   tests/gpu/sanitize.sh memcheck:attention_gpu_test 'racecheck:quantize_gpu_test:QuantizeGpu.*'
set -uo pipefail
source tests/bench/carry_env.sh
carry_setup
tool_bin=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
[[ -x $tool_bin ]] || { echo "no $tool_bin" >&2; exit 2; }
limit=${SANITIZE_TIMEOUT_S:-300}
summary=$out/sanitize.txt
echo "compute-sanitizer $("$tool_bin" --version | sed -n 's/.*Version //p' | head -1)," \
  "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
  "$(date -u +%FT%TZ)" | tee "$summary"

status=0
n=0
for run in "$@"; do
  n=$((n + 1))
  IFS=: read -r tool test filter <<< "$run"
  case $tool in
    memcheck) options=(--leak-check full --padding 256) ;;
    racecheck | synccheck | initcheck) options=() ;;
    *) echo "unknown tool $tool in $run" >&2; exit 2 ;;
  esac
  [[ -x $bin/$test ]] || { echo "no $bin/$test" >&2; exit 2; }
  log=$out/${tool}_$test.$n.log  # the same test may run twice, filtered
  start=$SECONDS
  timeout "$limit" "$tool_bin" --tool "$tool" "${options[@]}" --error-exitcode 99 \
    "$bin/$test" ${filter:+--gtest_filter="$filter"} > "$log" 2>&1
  rc=$?
  case $rc in
    0) verdict=clean ;;
    99) verdict="SANITIZER ERRORS" ;;
    124) verdict="TIMED OUT after ${limit}s" ;;
    *) verdict="TEST FAILED (exit $rc)" ;;
  esac
  ((rc == 0)) || status=1
  # The sanitizer's own summary line, e.g. "ERROR SUMMARY: 0 errors" or racecheck's hazards.
  found=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY' "$log" | tail -2 | tr '\n' ' ')
  tests=$(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')
  echo "$tool $test${filter:+ ($filter)}: $verdict, $((SECONDS - start)) s; $found$tests" \
    | tee -a "$summary"
done
exit "$status"
