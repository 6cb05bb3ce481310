// The CUDA backend's transfer paths (the class is in cuda_backend_impl.h). Their bulk inputs and
// outputs stay in device memory; only their small host-side tables (run list, block ids, slot
// mapping, positions) and results go through a staging slot. GatherArena is one kernel over the
// whole run list, and ReadRuns the same kernel into the slot, then one copy to the host.
#if defined(KVPOOL_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "kernels/cuda/transfer_kernels.h"
#include "kernels/kv_kernels.h"
#include "service/store/compute_backend.h"
#include "service/store/cuda_backend_impl.h"
#include "service/store/cuda_backend_staging.h"
#include "service/store/cuda_lanes.h"
#include "service/store/kv_store_impl.h"
#include "service/store/quantize_layer_runs.h"

namespace kvpool::cuda_backend_internal {

absl::Status CudaBackend::ReadArena(const uint8_t* src, size_t bytes, void* dst) {
  if (bytes == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) {
    return absl::InvalidArgumentError("ReadArena: null pointer");
  }
  return RunSynchronous(0, [&](Lane& lane, StagingSlot&) -> absl::Status {
    KVPOOL_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, lane.stream));
    return CudaError(cudaStreamSynchronize(lane.stream), "ReadArena");
  });
}

absl::Status CudaBackend::ReadRuns(absl::Span<const ArenaRun> runs, void* dst) {
  if (runs.empty()) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("ReadRuns: null destination");
  return Gather(runs, nullptr, static_cast<uint8_t*>(dst));
}

absl::Status CudaBackend::GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) {
  if (runs.empty()) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("GatherArena: null destination");
  return Gather(runs, dst, nullptr);
}

// Every element's block ids in one staging copy, a kernel per element, one synchronization.
absl::Status CudaBackend::DequantizeToArena(absl::Span<const DequantizeParams> ps) {
  StagingLayout layout;
  std::vector<size_t> ids_off(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    if (absl::Status s = ValidateDequantize(ps[i]); !s.ok()) return s;
    ids_off[i] = layout.Add(static_cast<size_t>(ps[i].num_out_blocks) * sizeof(int32_t));
  }
  if (layout.size() == 0) return absl::OkStatus();
  return RunSynchronous(layout.size(), [&](Lane& lane, StagingSlot& slot) -> absl::Status {
    for (size_t i = 0; i < ps.size(); ++i) {
      std::memcpy(slot.host + ids_off[i], ps[i].block_ids,
                  static_cast<size_t>(ps[i].num_out_blocks) * sizeof(int32_t));
    }
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device, slot.host, layout.size(),
                                                cudaMemcpyHostToDevice, lane.stream));
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].num_out_blocks == 0) continue;
      DequantizeParams d = ps[i];
      d.block_ids = reinterpret_cast<const int32_t*>(slot.device + ids_off[i]);
      if (absl::Status s = KernelResult(cuda::Dequantize(d, lane.stream), "DequantizeToArena");
          !s.ok()) {
        return s;
      }
    }
    return CudaError(cudaStreamSynchronize(lane.stream), "DequantizeToArena");
  });
}

// One launch per run of elements that QuantizeAppendLayers takes together (QuantizeLayerRuns:
// a transfer round's layers), each run's slot mapping and positions in one staging copy, one
// synchronization.
absl::Status CudaBackend::QuantizeAppendFromArena(absl::Span<const QuantizeAppendParams> ps) {
  for (const QuantizeAppendParams& p : ps) {
    if (absl::Status s = ValidateQuantizeAppend(p); !s.ok()) return s;
  }
  const std::vector<store_internal::QuantizeLayerRun> runs = store_internal::QuantizeLayerRuns(ps);
  StagingLayout layout;
  std::vector<size_t> slot_off(runs.size()), pos_off(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    const QuantizeAppendParams& p = ps[runs[r].first];
    const size_t n = static_cast<size_t>(p.num_tokens);
    slot_off[r] = layout.Add(n * sizeof(int64_t));
    pos_off[r] = layout.Add(p.layout.sink_tokens > 0 ? n * sizeof(int32_t) : 0);
  }
  if (layout.size() == 0) return absl::OkStatus();
  return RunSynchronous(layout.size(), [&](Lane& lane, StagingSlot& slot) -> absl::Status {
    for (size_t r = 0; r < runs.size(); ++r) {
      const QuantizeAppendParams& p = ps[runs[r].first];
      const size_t n = static_cast<size_t>(p.num_tokens);
      std::memcpy(slot.host + slot_off[r], p.slot_mapping, n * sizeof(int64_t));
      if (p.layout.sink_tokens > 0) {
        std::memcpy(slot.host + pos_off[r], p.positions, n * sizeof(int32_t));
      }
    }
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device, slot.host, layout.size(),
                                                cudaMemcpyHostToDevice, lane.stream));
    for (size_t r = 0; r < runs.size(); ++r) {
      QuantizeAppendParams d = ps[runs[r].first];
      if (d.num_tokens == 0) continue;
      d.slot_mapping = reinterpret_cast<const int64_t*>(slot.device + slot_off[r]);
      d.positions = d.layout.sink_tokens > 0
                        ? reinterpret_cast<const int32_t*>(slot.device + pos_off[r])
                        : nullptr;
      uint64_t seeds[cuda::kMaxQuantizeLayers];
      for (int i = 0; i < runs[r].count; ++i) seeds[i] = ps[runs[r].first + i].layout.sign_seed;
      if (absl::Status s = KernelResult(
              cuda::QuantizeAppendLayers(d, runs[r].count, runs[r].stride, seeds, lane.stream),
              "QuantizeAppendFromArena");
          !s.ok()) {
        return s;
      }
    }
    return CudaError(cudaStreamSynchronize(lane.stream), "QuantizeAppendFromArena");
  });
}

// Every check in one launch: the spans and their results (UINT64_MAX) in one upload, one copy
// of the results back, one synchronization.
absl::Status CudaBackend::CheckHalfRangeArena(absl::Span<const HalfRangeCheck> checks) {
  if (checks.empty()) return absl::OkStatus();
  uint64_t max_n = 0;
  for (const HalfRangeCheck& c : checks) {
    if (c.n > 0 && c.x == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("CheckHalfRangeArena: %s: %d values at null", c.what, c.n));
    }
    max_n = std::max<uint64_t>(max_n, c.n);
  }
  std::vector<unsigned long long> first_bad(checks.size());
  const size_t results_bytes = first_bad.size() * sizeof(first_bad[0]);
  StagingLayout layout;
  const size_t results_off = layout.Add(results_bytes);
  const size_t spans_off = layout.Add(checks.size() * sizeof(cuda::HalfRangeSpan));
  absl::Status s =
      RunSynchronous(layout.size(), [&](Lane& lane, StagingSlot& slot) -> absl::Status {
        auto* spans = reinterpret_cast<cuda::HalfRangeSpan*>(slot.host + spans_off);
        for (size_t i = 0; i < checks.size(); ++i) {
          spans[i] = {checks[i].x, checks[i].n, checks[i].max_abs_bits};
        }
        std::memset(slot.host + results_off, 0xff, results_bytes);
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device, slot.host, layout.size(),
                                                    cudaMemcpyHostToDevice, lane.stream));
        auto* results = reinterpret_cast<unsigned long long*>(slot.device + results_off);
        if (absl::Status k = KernelResult(
                cuda::FindFirstHalfOutOfRange(
                    reinterpret_cast<const cuda::HalfRangeSpan*>(slot.device + spans_off),
                    static_cast<int64_t>(checks.size()), max_n, results, lane.stream),
                "CheckHalfRangeArena");
            !k.ok()) {
          return k;
        }
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.host + results_off, results, results_bytes,
                                                    cudaMemcpyDeviceToHost, lane.stream));
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream));
        std::memcpy(first_bad.data(), slot.host + results_off, results_bytes);
        return absl::OkStatus();
      });
  if (!s.ok()) return s;
  for (size_t i = 0; i < checks.size(); ++i) {
    if (first_bad[i] != ULLONG_MAX) {
      return store_internal::HalfRangeError(checks[i].what, first_bad[i], checks[i].max_abs_bits);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Gather(absl::Span<const ArenaRun> runs, uint8_t* device_dst,
                                 uint8_t* host_dst) {
  uint64_t total = 0;
  for (const ArenaRun& run : runs) total += run.bytes;
  StagingLayout layout;
  const size_t table_bytes = runs.size() * sizeof(cuda::GatherRun);
  layout.Add(table_bytes);
  const size_t out_off = layout.Add(device_dst == nullptr ? total : 0);
  return RunSynchronous(layout.size(), [&](Lane& lane, StagingSlot& slot) -> absl::Status {
    auto* table = reinterpret_cast<cuda::GatherRun*>(slot.host);
    uint64_t offset = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      table[i] = {runs[i].src, offset, runs[i].bytes};
      offset += runs[i].bytes;
    }
    KVPOOL_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(slot.device, slot.host, table_bytes, cudaMemcpyHostToDevice, lane.stream));
    uint8_t* dst = device_dst != nullptr ? device_dst : slot.device + out_off;
    const KernelStatus ks = cuda::GatherRuns(reinterpret_cast<const cuda::GatherRun*>(slot.device),
                                             static_cast<int64_t>(runs.size()), dst, lane.stream);
    if (absl::Status s = KernelResult(ks, "GatherRuns"); !s.ok()) return s;
    if (device_dst == nullptr) {
      KVPOOL_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(slot.host + out_off, dst, total, cudaMemcpyDeviceToHost, lane.stream));
    }
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream));
    if (device_dst == nullptr) std::memcpy(host_dst, slot.host + out_off, total);
    return absl::OkStatus();
  });
}

}  // namespace kvpool::cuda_backend_internal
#endif  // KVPOOL_WITH_CUDA
