// Kernels behind the CUDA backend's transfer paths (ComputeBackend::GatherArena and
// CheckHalfRangeArena, used by the NCCL data plane). Host-callable; every pointer named "device" is
// device memory; work is enqueued on `stream` (a cudaStream_t) and every launch is checked.
#ifndef KVPOOL_KERNELS_CUDA_TRANSFER_KERNELS_H_
#define KVPOOL_KERNELS_CUDA_TRANSFER_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/kv_kernels.h"

namespace kvpool::cuda {

// One contiguous run of device bytes and where it lands in the destination.
struct GatherRun {
  const uint8_t* src = nullptr;  // device; null: the run's bytes are written as zeros
  uint64_t dst_offset = 0;       // bytes from the destination base
  uint64_t bytes = 0;
};

// Copies every run (zeros for a null src) to dst + run.dst_offset in ONE launch (a grid-stride over
// runs, one warp per run). A run whose src, destination and size are all 16-byte aligned moves in
// 16-byte loads and stores; any other run moves byte by byte. Runs must not overlap each other's
// destination. `runs` is a device array [num_runs]; it and the sources must stay valid until the
// copy ran.
[[nodiscard]] KernelStatus GatherRuns(const GatherRun* runs, int64_t num_runs, uint8_t* dst,
                                      void* stream);

// Writes to device `*first_bad` the index of the first fp16 value in device x[0, n) whose
// magnitude bits (sign cleared) pass max_abs_bits (NaN and Inf pass any finite bound), or
// UINT64_MAX when none does. `first_bad` must be 8-byte aligned.
[[nodiscard]] KernelStatus FindFirstHalfOutOfRange(const uint16_t* x, size_t n,
                                                   uint16_t max_abs_bits,
                                                   unsigned long long* first_bad, void* stream);

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_TRANSFER_KERNELS_H_
