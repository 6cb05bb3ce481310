#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/transfer_kernels.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned long long kNone = ULLONG_MAX;

// Grid: min(ceil(n / 8 / kThreads), 8 per SM) blocks of kThreads, grid-striding over 16-byte
// vectors of 8 values when x is 16-byte aligned, then over the remaining values one by one. A
// thread stops at its first value past the bound (its smallest index); warps reduce to their
// minimum and lane 0 folds it into *first_bad with atomicMin.
__global__ void __launch_bounds__(kThreads)
    FindFirstHalfOutOfRangeKernel(const uint16_t* x, uint64_t n, uint32_t max_abs_bits,
                                  unsigned long long* first_bad) {
  // Magnitude bits order like magnitudes, NaN and Inf above every finite value.
  auto out_of_range = [max_abs_bits](uint32_t h) { return (h & 0x7fffu) > max_abs_bits; };
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const uint64_t vectors = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? n / 8 : 0;
  unsigned long long bad = kNone;
  for (uint64_t i = tid; i < vectors && bad == kNone; i += stride) {
    const uint4 v = LoadStreaming16(x + 8 * i);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 7; j >= 0; --j) {
      if (out_of_range((w[j / 2] >> (16 * (j & 1))) & 0xffffu)) bad = 8 * i + j;
    }
  }
  for (uint64_t i = 8 * vectors + tid; i < n && bad == kNone; i += stride) {
    if (out_of_range(x[i])) bad = i;
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, bad, m);
    bad = other < bad ? other : bad;
  }
  if ((threadIdx.x & 31) == 0 && bad != kNone) atomicMin(first_bad, bad);
}

}  // namespace

KernelStatus FindFirstHalfOutOfRange(const uint16_t* x, size_t n, uint16_t max_abs_bits,
                                     unsigned long long* first_bad, void* stream) {
  if (first_bad == nullptr || (reinterpret_cast<uintptr_t>(first_bad) & 7) != 0 ||
      (n > 0 && x == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  KVPOOL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(first_bad, 0xff, sizeof(*first_bad), s));
  if (n == 0) return KernelStatus::kOk;
  int sms = 0;
  KVPOOL_CUDA_RETURN_IF_ERROR(CurrentDeviceSms(&sms));
  const int64_t items = std::max<int64_t>(static_cast<int64_t>(n / 8), 1);
  const int64_t blocks = std::min<int64_t>(CeilDiv(items, kThreads), int64_t{8} * sms);
  FindFirstHalfOutOfRangeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
      x, n, max_abs_bits, first_bad);
  return CheckLaunch("FindFirstHalfOutOfRangeKernel");
}

}  // namespace kvpool::cuda
