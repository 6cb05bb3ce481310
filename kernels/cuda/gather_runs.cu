#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/transfer_kernels.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// Grid: min(ceil(num_runs / kWarpsPerBlock), 8 per SM) blocks of kThreads. Warp w of the grid
// copies runs w, w + (warps in the grid), ...; its 32 lanes stride over the run's 16-byte
// elements (bytes, for an unaligned run).
__global__ void __launch_bounds__(kThreads)
    GatherRunsKernel(const GatherRun* runs, int64_t num_runs, uint8_t* dst) {
  const int lane = threadIdx.x & 31;
  const int64_t grid_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       r < num_runs; r += grid_warps) {
    const GatherRun run = runs[r];
    uint8_t* out = dst + run.dst_offset;
    const bool zeros = run.src == nullptr;
    const uintptr_t misaligned =
        (reinterpret_cast<uintptr_t>(run.src) | reinterpret_cast<uintptr_t>(out) | run.bytes) & 15;
    if (misaligned == 0) {
      const auto* src16 = reinterpret_cast<const uint4*>(run.src);
      auto* out16 = reinterpret_cast<uint4*>(out);
      const uint64_t n = run.bytes / 16;
#pragma unroll 4
      for (uint64_t i = lane; i < n; i += 32) {
        out16[i] = zeros ? make_uint4(0, 0, 0, 0) : LoadStreaming16(src16 + i);
      }
    } else {
      for (uint64_t i = lane; i < run.bytes; i += 32) out[i] = zeros ? 0 : run.src[i];
    }
  }
}

}  // namespace

KernelStatus GatherRuns(const GatherRun* runs, int64_t num_runs, uint8_t* dst, void* stream) {
  if (num_runs < 0 || (num_runs > 0 && (runs == nullptr || dst == nullptr))) {
    return KernelStatus::kInvalidArgument;
  }
  if (num_runs == 0) return KernelStatus::kOk;
  int sms = 0;
  KVPOOL_CUDA_RETURN_IF_ERROR(CurrentDeviceSms(&sms));
  const int64_t blocks = std::min<int64_t>(CeilDiv(num_runs, kWarpsPerBlock), int64_t{8} * sms);
  GatherRunsKernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(runs, num_runs, dst);
  return CheckLaunch("GatherRunsKernel");
}

}  // namespace kvpool::cuda
