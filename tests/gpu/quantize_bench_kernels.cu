// Device helper of the quantize benchmark; see quantize_bench_kernels.h.
#include <cstdint>

#include "tests/gpu/quantize_bench_kernels.h"

namespace kvpool::bench {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void ProbeSmClockKernel(float* mhz, int window_ns) {
  // Start on a tick of the timer, stop on the first tick past the window.
  const uint64_t seen = GlobalTimerNs();
  uint64_t t0 = GlobalTimerNs();
  while (t0 == seen) t0 = GlobalTimerNs();
  const long long c0 = clock64();
  uint64_t t1 = t0;
  while (t1 < t0 + static_cast<uint64_t>(window_ns)) t1 = GlobalTimerNs();
  const long long c1 = clock64();
  *mhz = static_cast<float>(1e3 * static_cast<double>(c1 - c0) / static_cast<double>(t1 - t0));
}

}  // namespace

cudaError_t ProbeSmClock(float* mhz, int window_ns, cudaStream_t stream) {
  ProbeSmClockKernel<<<1, 1, 0, stream>>>(mhz, window_ns);
  return cudaGetLastError();
}

}  // namespace kvpool::bench
