// A plain streaming copy kernel: the bandwidth ceiling that the quantize benchmark
// (tests/gpu/quantize_bench.cc) measures its kernels against. Host-callable, device pointers.
#ifndef KVPOOL_KERNELS_CUDA_STREAMING_COPY_H_
#define KVPOOL_KERNELS_CUDA_STREAMING_COPY_H_

#include <cstddef>

#include "kernels/kv_kernels.h"

namespace kvpool::cuda {

// Copies `bytes` (a multiple of 16; both pointers 16-byte aligned) from src to dst with one
// 16-byte load and one 16-byte store per element, enqueued on `stream` (a cudaStream_t).
[[nodiscard]] KernelStatus StreamingCopy(void* dst, const void* src, size_t bytes, void* stream);

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_STREAMING_COPY_H_
