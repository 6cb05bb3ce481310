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

// One range check of FindFirstHalfOutOfRange.
struct HalfRangeSpan {
  const uint16_t* x = nullptr;  // device [n]; may be null when n is 0
  uint64_t n = 0;
  uint32_t max_abs_bits = 0;  // the largest magnitude bits (sign cleared) allowed
};

// For every span i of device `spans` [num_spans], leaves in device first_bad[i] the index of the
// first fp16 value of spans[i].x whose magnitude bits pass spans[i].max_abs_bits (NaN and Inf pass
// any finite bound); first_bad[i] must hold UINT64_MAX on entry (the caller sets it, e.g. in the
// upload that carries the spans) and keeps it when no value passes. ONE launch for every span;
// max_span_values is the largest spans[i].n (it sizes the grid). spans and first_bad must be
// 8-byte aligned.
[[nodiscard]] KernelStatus FindFirstHalfOutOfRange(const HalfRangeSpan* spans, int64_t num_spans,
                                                   uint64_t max_span_values,
                                                   unsigned long long* first_bad, void* stream);

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_TRANSFER_KERNELS_H_
