// Device helpers of the attention benchmarks (attention_bench_kernels.cu): synthetic K/V with
// outlier channels generated on the device, the L2 flush, and the streaming-read ceiling.
#ifndef KVPOOL_TESTS_GPU_ATTENTION_BENCH_KERNELS_H_
#define KVPOOL_TESTS_GPU_ATTENTION_BENCH_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/gpu/attention_test_util.h"

namespace kvpool::bench {

// Fills k and v [num_tokens][num_heads][head_dim] fp16 with hash-based N(0,1)-like values
// (Irwin-Hall of 4 uniforms, rescaled) for tokens first_token .. first_token + num_tokens - 1,
// plus the outliers real caches show: K channel 5 += 12 * sign, K channels (9, 9 + head_dim/2)
// += 12 (cos, sin)(t * theta), K channel 17 *= 10, V channels 5 and 9 *= 5. Deterministic in
// (seed, token, head, channel).
cudaError_t FillSyntheticKv(uint16_t* k, uint16_t* v, int first_token, int num_tokens,
                            int num_heads, int head_dim, uint64_t seed, cudaStream_t stream);

// The L2 flush before every timed run of the attention benchmarks (--l2_flush), on the default
// stream: a 256 MiB buffer read with loads that keep its lines in L2 ("read": the L2 is left full
// of clean lines) or zeroed ("write": up to an L2 of dirty lines is left, whose write-back to
// DRAM then falls inside the timed run).
class L2Flush {
 public:
  // `mode`: "read" or "write" (the --l2_flush value); any other exits the benchmark with a
  // message on stderr.
  explicit L2Flush(const std::string& mode);
  void operator()();

 private:
  bool write_;
  testing::DeviceBuffer buffer_, sink_;
  int round_ = 0;
};

// The streaming-read ceiling in TB/s: a 2 GiB buffer read with 16-byte loads, timed as the
// benchmarks time their cases (the median of `iters` runs, each after `flush`).
double StreamingReadTbps(int iters, L2Flush& flush);

// The floor of any one launch timed this way: an empty kernel of 256 CTAs of 128 threads (the
// split kernel's grid at 1 x 32K), the median of `iters` runs after `flush`, in ms.
double LaunchFloorMs(int iters, L2Flush& flush);

}  // namespace kvpool::bench

#endif  // KVPOOL_TESTS_GPU_ATTENTION_BENCH_KERNELS_H_
