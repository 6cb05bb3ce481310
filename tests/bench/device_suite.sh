#!/usr/bin/env bash
# The whole GPU job in one call on the GPU machine (DEVICE.md): GPU tests, the kernel benchmarks
# with the PyTorch SDPA anchor, the NCCL tests and benchmark when two GPUs are visible, the
# service over gRPC loopback, then the Python client tests when packed (CARRY_PYTHON=1). Expects
# binaries packed by tests/gpu/package_for_device.sh (carry/ or carry.tar.xz); writes at most 8
# result files under $OUT (or ./out).
#   tests/bench/device_suite.sh <commit>
set -uo pipefail
commit=${1:-unknown}
source tests/bench/carry_env.sh
# NCCL is not carried: PyTorch's wheel ships it on the GPU machine.
carry_setup "$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0] + '/lib')" \
  2>/dev/null)"
exec > >(tee -a "$out/suite.log") 2>&1
gpus=$(nvidia-smi -L | wc -l)
echo "device suite: commit $commit, $(date -u +%FT%TZ), $gpus x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

status=0
run_test() {  # name: runs carry/bin/<name> if present, full output to gpu_tests.log
  [[ -x $bin/$1 ]] || return 0
  if "$bin/$1" >> "$out/gpu_tests.log" 2>&1; then echo "$1: PASSED"; else echo "$1: FAILED"; status=1; fi
}

echo "== GPU tests"
for t in quantize_gpu_test quantize_layers_gpu_test cuda_backend_test cuda_store_stress_test \
  attention_gpu_test transfer_backend_test half_range_arena_test; do
  run_test "$t"
done

echo "== quantize kernel benchmark"
"$bin/quantize_bench" --commit="$commit" --out="$out/quantize_h200.json" || status=1

echo "== attention kernel benchmark and SDPA anchor"
"$bin/attention_bench" --commit="$commit" --out="$tmp/attention_kvpool.json" || status=1
python3 tests/bench/attention_peer.py run --out="$tmp/attention_peer.json" || status=1
# FlashInfer's decode kernel, when packed (built with -DKVPOOL_FLASHINFER_INCLUDE).
fi_args=()
if [[ -x $bin/flashinfer_decode_bench ]]; then
  "$bin/flashinfer_decode_bench" --commit="$commit" --out="$tmp/flashinfer.json" \
    && fi_args=(--flashinfer "$tmp/flashinfer.json") || status=1
fi
python3 tests/bench/attention_peer.py merge --kvpool "$tmp/attention_kvpool.json" \
  --peer "$tmp/attention_peer.json" "${fi_args[@]}" --out "$out/attention.json" || status=1

if ((gpus >= 2)); then
  echo "== NCCL transfer test and benchmark (GPU 0 server, GPU 1 worker)"
  run_test nccl_transfer_test
  timeout 300 "$bin/nccl_bench" --commit="$commit" --out="$out/nccl.json" || status=1
fi

echo "== Attend server time in process: runner, store, backend, bare kernel"
"$bin/attend_latency_bench" --commit="$commit" --out="$out/attend_latency.json" || status=1

echo "== service over gRPC loopback (CUDA backend)"
grpc=$out/grpc_bench.txt
source tests/bench/grpc_bench_lib.sh
start_server
for streams in 1 4 8 16; do
  for chunk in 64 256; do
    cli bench put --streams=$streams --chunk_tokens=$chunk --tokens=1024 --seconds=3
  done
done
# 16-token contexts give the floor of a call whose kernel costs next to nothing.
for shape in "1 32768" "32 4096" "1 16" "32 16"; do
  read -r batch context <<< "$shape"
  timed_attend Attend "unary Attend calls" --batch=$batch --context=$context --iters=300 --nostream
  timed_attend AttendStream.step "AttendStream steps" --batch=$batch --context=$context --iters=300 \
    --stream
  timed_attend AttendSocket.step "AttendSocket steps" --batch=$batch --context=$context --iters=300 \
    --stream --attend_socket_port=50052
  timed_attend AttendSocket.step "AttendSocket region steps" --batch=$batch --context=$context \
    --iters=300 --stream --attend_unix_socket="$tmp/attend.sock"
  timed_attend AttendSocket.step "AttendSocket in-place region steps" --batch=$batch \
    --context=$context --iters=300 --stream --attend_unix_socket="$tmp/attend.sock" --in_place
done
# Decode steps that append the new token's K/V (the fused quantize ahead of the attention).
for shape in "1 32768" "32 4096"; do
  read -r batch context <<< "$shape"
  timed_attend AttendSocket.step "AttendSocket in-place region decode steps with appends" \
    --batch=$batch --context=$context --iters=300 --stream --attend_unix_socket="$tmp/attend.sock" \
    --in_place --append
done
# The demo's progress line (stderr, redrawn with \r) stays out of the results; its errors do not.
timeout 120 "$bin/kvpool" --target=127.0.0.1:50051 --attend_unix_socket="$tmp/attend.sock" demo \
  2> "$tmp/demo.err" | tee -a "$grpc" \
  || status=1
tr '\r' '\n' < "$tmp/demo.err" | grep -v '^\[demo\]' | grep . | tee -a "$grpc"
curl -s 127.0.0.1:9464/metrics | grep -E '^kvpool_(device_memory|compression_ratio|quantization_rel)' \
  | tee -a "$grpc"
stop_server
cat "$tmp/server.log"

if [[ -d carry/python ]]; then  # packed with CARRY_PYTHON=1
  echo "== Python client tests (tests/python) against a CUDA-backend server"
  mkdir -p client/python/kvpool_client/v1 && cp carry/python/stubs/* client/python/kvpool_client/v1/
  # test_package builds the client's wheel, which generates its stubs with grpcio-tools: not on
  # the GPU machine, and not about the server (CI runs it).
  if python3 -m pip install -q --no-index --no-deps --target "$tmp/py" carry/python/wheels/*.whl \
    && PYTHONPATH=$tmp/py KVPOOL_TEST_BACKEND=cuda KVPOOL_SERVER_BIN=$bin/kvpool-server \
      python3 -m pytest -q -p no:cacheprovider --ignore=tests/python/test_package.py \
      tests/python >> "$out/gpu_tests.log" 2>&1; then
    echo "python client tests: PASSED"
  else
    echo "python client tests: FAILED"; status=1
  fi
fi
echo "suite status: $status"
exit $status
