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
// Blocks per SM that the whole launch aims at (spread over its spans).
constexpr int64_t kBlocksPerSm = 8;

// Grid (blocks_per_span, min(num_spans, 65535)) of kThreads: the blocks of row y take spans y,
// y + gridDim.y, ..., and grid-stride over a span's 16-byte vectors of 8 values when its x is
// 16-byte aligned, then over its remaining values one by one. A thread stops at its first value
// past the bound (its smallest index); warps reduce to their minimum and lane 0 folds it into
// first_bad[span] with atomicMin.
//   spans      [num_spans]
//   first_bad  [num_spans], UINT64_MAX on entry
__global__ void __launch_bounds__(kThreads)
    FindFirstHalfOutOfRangeKernel(const HalfRangeSpan* spans, int64_t num_spans,
                                  unsigned long long* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t s = blockIdx.y; s < num_spans; s += gridDim.y) {
    const HalfRangeSpan span = spans[s];
    const uint16_t* x = span.x;
    const uint64_t n = span.n;
    // Magnitude bits order like magnitudes, NaN and Inf above every finite value.
    const uint32_t max_abs_bits = span.max_abs_bits;
    auto out_of_range = [max_abs_bits](uint32_t h) { return (h & 0x7fffu) > max_abs_bits; };
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
    if ((threadIdx.x & 31) == 0 && bad != kNone) atomicMin(first_bad + s, bad);
  }
}

}  // namespace

KernelStatus FindFirstHalfOutOfRange(const HalfRangeSpan* spans, int64_t num_spans,
                                     uint64_t max_span_values, unsigned long long* first_bad,
                                     void* stream) {
  if (num_spans < 0 || (num_spans > 0 && (spans == nullptr || first_bad == nullptr)) ||
      (reinterpret_cast<uintptr_t>(spans) & 7) != 0 ||
      (reinterpret_cast<uintptr_t>(first_bad) & 7) != 0) {
    return KernelStatus::kInvalidArgument;
  }
  if (num_spans == 0 || max_span_values == 0) return KernelStatus::kOk;
  int sms = 0;
  KVPOOL_CUDA_RETURN_IF_ERROR(CurrentDeviceSms(&sms));
  const int64_t rows = std::min<int64_t>(num_spans, 65535);
  const int64_t items = std::max<int64_t>(static_cast<int64_t>(max_span_values / 8), 1);
  const int64_t per_span =
      std::clamp<int64_t>(kBlocksPerSm * sms / rows, 1, CeilDiv(items, kThreads));
  FindFirstHalfOutOfRangeKernel<<<dim3(static_cast<unsigned>(per_span),
                                       static_cast<unsigned>(rows)),
                                  kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      spans, num_spans, first_bad);
  return CheckLaunch("FindFirstHalfOutOfRangeKernel");
}

}  // namespace kvpool::cuda
