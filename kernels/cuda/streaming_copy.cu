#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/streaming_copy.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;

// Grid-stride copy of n 16-byte elements. Grid: up to 8 blocks of kThreads per SM worth (capped
// by the element count); each thread moves several elements.
__global__ void __launch_bounds__(kThreads)
    StreamingCopyKernel(uint4* dst, const uint4* src, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    __stcs(dst + i, LoadStreaming16(src + i));
  }
}

}  // namespace

KernelStatus StreamingCopy(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes % 16 != 0 || (reinterpret_cast<uintptr_t>(dst) & 15) != 0 ||
      (reinterpret_cast<uintptr_t>(src) & 15) != 0 || (bytes > 0 && (!dst || !src))) {
    return KernelStatus::kInvalidArgument;
  }
  if (bytes == 0) return KernelStatus::kOk;
  int sms = 0;
  KVPOOL_CUDA_RETURN_IF_ERROR(CurrentDeviceSms(&sms));
  const size_t n = bytes / 16;
  const int64_t blocks = std::min<int64_t>(CeilDiv(n, kThreads), int64_t{8} * sms);
  StreamingCopyKernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                        static_cast<cudaStream_t>(stream)>>>(static_cast<uint4*>(dst),
                                                             static_cast<const uint4*>(src), n);
  return CheckLaunch("StreamingCopyKernel");
}

}  // namespace kvpool::cuda
