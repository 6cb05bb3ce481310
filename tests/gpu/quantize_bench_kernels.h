// Device helper of the quantize benchmark (quantize_bench_kernels.cu): an SM clock probe.
#ifndef KVPOOL_TESTS_GPU_QUANTIZE_BENCH_KERNELS_H_
#define KVPOOL_TESTS_GPU_QUANTIZE_BENCH_KERNELS_H_

#include <cuda_runtime.h>

namespace kvpool::bench {

// Enqueues a one-thread kernel that counts SM cycles (clock64) over `window_ns` of the global
// timer (%globaltimer, from one tick of it to the first tick at least window_ns later, so the
// timer's resolution does not enter) and stores the SM clock in MHz at *mhz (device memory).
// The rotated quantize kernel is bound by its instructions and slows when the SM clock drops;
// the memory-bound kernels do not: a probe beside each timing says which clock it ran at.
cudaError_t ProbeSmClock(float* mhz, int window_ns, cudaStream_t stream);

}  // namespace kvpool::bench

#endif  // KVPOOL_TESTS_GPU_QUANTIZE_BENCH_KERNELS_H_
