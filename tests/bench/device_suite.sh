#!/usr/bin/env bash
# The whole GPU job in one call on the H200 machine (DEVICE.md): GPU tests, then the kernel
# benchmarks, then the service over gRPC loopback. Expects binaries packed into carry/ by
# tests/gpu/package_for_device.sh; writes results under $OUT (or ./out).
#   tests/bench/device_suite.sh <commit>
set -uo pipefail
commit=${1:-unknown}
out=${OUT:-out}
mkdir -p "$out"
[[ -d carry ]] || tar -xJf carry.tar.xz
# NCCL is not carried: PyTorch's wheel ships it on the GPU machine.
nccl_lib=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0] + '/lib')" 2>/dev/null)
export LD_LIBRARY_PATH=$PWD/carry/lib${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/carry/bin
log=$out/suite.log
exec > >(tee -a "$log") 2>&1
echo "device suite: commit $commit, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

status=0
echo "== GPU tests"
for t in quantize_gpu_test cuda_backend_test attention_gpu_test transfer_backend_test; do
  [[ -x $bin/$t ]] || continue
  "$bin/$t" --gtest_brief=1 > "$out/gpu_tests.log.$t" 2>&1 && echo "$t: PASSED" || { echo "$t: FAILED"; status=1; }
done
cat "$out"/gpu_tests.log.* > "$out/gpu_tests.log" && rm -f "$out"/gpu_tests.log.*

echo "== quantize kernel benchmark"
"$bin/quantize_bench" --commit="$commit" --out="$out/quantize_h200.json" || status=1

echo "== attention kernel benchmark and SDPA anchor"
"$bin/attention_bench" --commit="$commit" --out="$out/attention_kvpool.json" || status=1
python3 tests/bench/attention_peer.py run --out="$out/attention_peer.json" || status=1
python3 tests/bench/attention_peer.py merge --kvpool "$out/attention_kvpool.json" \
  --peer "$out/attention_peer.json" --out "$out/attention.json" || status=1

echo "== service over gRPC loopback (CUDA backend)"
"$bin/kvpool-server" --backend=cuda --port=50051 --metrics_port=9464 > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null && break; sleep 0.1; done
grpc=$out/grpc_bench.txt
for streams in 1 4 8 16; do
  for chunk in 64 256; do
    timeout 60 "$bin/kvpool" --target=127.0.0.1:50051 bench put --streams=$streams \
      --chunk_tokens=$chunk --tokens=1024 --seconds=3 | tee -a "$grpc" || status=1
  done
done
timeout 120 "$bin/kvpool" --target=127.0.0.1:50051 bench attend --batch=1 --context=32768 \
  --iters=200 | tee -a "$grpc" || status=1
timeout 120 "$bin/kvpool" --target=127.0.0.1:50051 bench attend --batch=32 --context=4096 \
  --iters=200 | tee -a "$grpc" || status=1
timeout 120 "$bin/kvpool" --target=127.0.0.1:50051 demo | tee -a "$grpc" || status=1
curl -s 127.0.0.1:9464/metrics | grep -E '^kvpool_(device_memory|compression_ratio|quantization_rel)' | tee -a "$grpc"
kill -TERM "$server"; wait "$server"; echo "server exit: $?"
echo "suite status: $status"
exit $status
