#!/usr/bin/env bash
# Nsight Compute on the GPU machine, one call: issue, stall, occupancy and memory sections of the
# quantize kernel (the first 40 launches of quantize_bench after 3 warm-up ones: its INT4 and
# INT8 cases, each warm-up and timed launch) and of the first attention
# launches of attention_bench (batch 1 x 32K: split kernel and merge). Expects
# binaries packed by tests/gpu/package_for_device.sh; writes the reports under $OUT (or ./out).
#   tests/bench/profile_suite.sh [quantize|attention|all]   (default all)
set -uo pipefail
which=${1:-all}
source tests/bench/carry_env.sh
carry_setup
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
sections=(--section SpeedOfLight --section SchedulerStats --section WarpStateStats
          --section Occupancy --section LaunchStats --section InstructionStats
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
[[ $which == attention ]] || timeout 250 "$ncu" "${sections[@]}" -k regex:QuantizeAppendKernel --launch-skip 3 \
  --launch-count 40 "$bin/quantize_bench" --runs=1 > "$out/ncu_quantize.txt" 2>&1
echo "ncu quantize: $?"
[[ $which == quantize ]] || timeout 200 "$ncu" "${sections[@]}" -k regex:'AttentionSplit|MergeSplits|RotateQuery' \
  --launch-count 6 "$bin/attention_bench" --iters=1 > "$out/ncu_attention.txt" 2>&1
echo "ncu attention: $?"
