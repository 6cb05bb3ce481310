// The CUDA backend: arenas in device memory, kernels from kvpool::cuda.
//
// Work is spread over a few "lanes", each a CUDA stream with two staging slots (pinned host
// buffer + device buffer + an event marking the slot free again). QuantizeAppend copies the
// caller's inputs into a free slot, enqueues the upload and the fused kernel on its lane and
// returns, so the host copy of the next chunk overlaps the kernel of this one, and the lanes'
// uploads overlap each other on the GPU; the kernels run in the order the appends were queued
// (each waits for the one before it, whatever its lane), so a block freed and handed out again
// never receives an older append's write after a newer one's. Synchronous calls (Dequantize,
// PagedDecodeAttention, ReadArena, ReadRuns and the four transfer paths) first make their lane's
// stream wait, on the GPU, for every append queued so far on every lane. PagedDecodeAttention's
// own append (a decode step's new tokens) rides in its upload and runs on its stream just before
// the attention.
//
// The transfer paths (NCCL data plane) keep their bulk inputs and outputs in device memory; only
// their small host-side tables (run list, block ids, slot mapping, positions) and results go
// through a staging slot. GatherArena is one kernel over the whole run list, and ReadRuns the
// same kernel into the slot, then one copy to the host.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/cuda/transfer_kernels.h"
#include "kernels/kv_kernels.h"
#include "service/store/arena_registry.h"
#include "service/store/compute_backend.h"
#include "service/store/cuda_backend_staging.h"
#include "service/store/cuda_lanes.h"
#include "service/store/kv_store_impl.h"
#include "service/store/quantize_layer_runs.h"

namespace kvpool {

#if defined(KVPOOL_WITH_CUDA)
namespace {

using cuda_backend_internal::AppendStaging;
using cuda_backend_internal::CheckCudaAttentionShape;
using cuda_backend_internal::CudaError;
using cuda_backend_internal::kNumLanes;
using cuda_backend_internal::kSlotsPerLane;
using cuda_backend_internal::Lane;
using cuda_backend_internal::StagingLayout;
using cuda_backend_internal::StagingSlot;
using cuda_backend_internal::ValidateDequantize;
using cuda_backend_internal::ValidatePagedDecodeAttention;

// FromKernelStatus, plus the CUDA error text for kCudaError.
absl::Status KernelResult(KernelStatus s, const char* what) {
  if (s == KernelStatus::kCudaError) {
    return absl::InternalError(absl::StrFormat("%s: %s", what, cuda::LastErrorMessage()));
  }
  return FromKernelStatus(s, what);
}

class CudaBackend final : public ComputeBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    for (Lane& lane : lanes_) {
      if (lane.stream != nullptr) cudaStreamSynchronize(lane.stream);
      for (StagingSlot& slot : lane.slots) slot.Release();
      if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
    }
    for (uint8_t* arena : arenas_.TakeAll()) cudaFree(arena);
  }

  // Creates the lanes' streams and events.
  absl::Status Init(const CudaBackendOptions& options) {
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    // With unified addressing, pinned allocations (the staging slots) are mapped at their host
    // address; this attribute extends that to registered ranges.
    int unified = 0, registered = 0;
    KVPOOL_RETURN_IF_CUDA_ERROR(
        cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device_));
    KVPOOL_RETURN_IF_CUDA_ERROR(
        cudaDeviceGetAttribute(&registered, cudaDevAttrCanUseHostPointerForRegisteredMem, device_));
    host_pointers_usable_ = options.kernel_host_io && unified != 0 && registered != 0;
    for (Lane& lane : lanes_) {
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
      for (StagingSlot& slot : lane.slots) {
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&slot.free, cudaEventDisableTiming));
      }
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }

  absl::Status CheckLayout(const PageLayout& layout) const override {
    if (cuda::ServesLayout(layout) == KernelStatus::kOk) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "the cuda backend's kernels serve head_dim 64, 128 or 256, block_tokens 16, 32 or 64, "
        "rotation blocks of 16 to 128 channels (at most head_dim) or none, quantization groups "
        "of a multiple of 16 channels, and layer pages under 4 GiB");
  }

  absl::Status CheckAttentionShape(size_t num_seqs, size_t num_q_heads) const override {
    return CheckCudaAttentionShape(num_seqs, num_q_heads);
  }

  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("arena of 0 bytes");
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    void* arena = nullptr;
    const cudaError_t err = cudaMalloc(&arena, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrFormat(
          "cannot allocate a device arena of %d bytes: %s", bytes, cudaGetErrorString(err)));
    }
    // The fill runs on the legacy stream, which the lanes' and NCCL's non-blocking streams do not
    // wait for: it must be done before the arena is handed out.
    cudaError_t fill = cudaMemsetAsync(arena, 0, bytes, cudaStreamLegacy);
    if (fill == cudaSuccess) fill = cudaStreamSynchronize(cudaStreamLegacy);
    if (fill != cudaSuccess) {
      cudaFree(arena);
      return CudaError(fill, "cudaMemset(arena)");
    }
    arenas_.Add(static_cast<uint8_t*>(arena), bytes);
    return static_cast<uint8_t*>(arena);
  }

  void FreeArena(uint8_t* arena) override {
    if (!arenas_.Remove(arena)) return;
    cudaSetDevice(device_);
    // cudaFree waits for queued work on the device, so no kernel still reads the arena.
    cudaFree(arena);
  }

  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override {
    if (absl::Status s = ValidateQuantizeAppend(p); !s.ok() || p.num_tokens == 0) return s;
    StagingLayout layout;
    const AppendStaging staging(p, layout);

    KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    Lane& lane = lanes_[next_lane_.fetch_add(1, std::memory_order_relaxed) % kNumLanes];
    absl::MutexLock lock(&lane.mu);
    StagingSlot& slot = lane.slots[lane.next];
    lane.next ^= 1;
    if (absl::Status s = slot.Ready(layout.size()); !s.ok()) return s;
    staging.Fill(slot.host);
    const absl::Status s = [&]() -> absl::Status {
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device, slot.host, layout.size(),
                                                  cudaMemcpyHostToDevice, lane.stream));
      KernelStatus ks;
      {
        absl::MutexLock order(&append_order_mu_);
        if (last_append_ != nullptr) {
          KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(lane.stream, last_append_, 0));
        }
        ks = cuda::QuantizeAppend(staging.DeviceParams(slot.device), lane.stream);
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaEventRecord(slot.free, lane.stream));
        last_append_ = slot.free;
      }
      slot.records.fetch_add(1, std::memory_order_release);
      return KernelResult(ks, "QuantizeAppend");
    }();
    // A failure may leave the upload queued but `free` not recorded after it: the lane's stream
    // must be done before the slot is filled again.
    if (!s.ok()) cudaStreamSynchronize(lane.stream);
    return s;
  }

  absl::Status Dequantize(const DequantizeParams& p) override {
    const PageLayout& l = p.layout;
    if (absl::Status s = ValidateDequantize(p); !s.ok() || p.num_out_blocks == 0) return s;
    const size_t ids_bytes = static_cast<size_t>(p.num_out_blocks) * sizeof(int32_t);
    const size_t out_bytes = static_cast<size_t>(p.num_out_blocks) * l.block_tokens *
                             (p.head_end - p.head_begin) * l.head_dim * sizeof(uint16_t);
    StagingLayout layout;
    const size_t ids_off = layout.Add(ids_bytes);
    const size_t k_off = layout.Add(out_bytes);
    const size_t v_off = layout.Add(out_bytes);

    return RunSynchronous(layout.size(), [&](Lane& lane, StagingSlot& slot) -> absl::Status {
      std::memcpy(slot.host + ids_off, p.block_ids, ids_bytes);
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device + ids_off, slot.host + ids_off,
                                                  ids_bytes, cudaMemcpyHostToDevice, lane.stream));
      DequantizeParams d = p;
      d.block_ids = reinterpret_cast<const int32_t*>(slot.device + ids_off);
      d.k_out = reinterpret_cast<uint16_t*>(slot.device + k_off);
      d.v_out = reinterpret_cast<uint16_t*>(slot.device + v_off);
      if (absl::Status s = KernelResult(cuda::Dequantize(d, lane.stream), "Dequantize"); !s.ok()) {
        return s;
      }
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.host + k_off, slot.device + k_off,
                                                  2 * (v_off - k_off), cudaMemcpyDeviceToHost,
                                                  lane.stream));
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream));
      std::memcpy(p.k_out, slot.host + k_off, out_bytes);
      std::memcpy(p.v_out, slot.host + v_off, out_bytes);
      return absl::OkStatus();
    });
  }

  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override {
    const PageLayout& l = p.layout;
    if (absl::Status s = ValidatePagedDecodeAttention(p, append); !s.ok()) return s;
    if (p.num_seqs == 0) return append != nullptr ? QuantizeAppend(*append) : absl::OkStatus();
    const size_t rows = static_cast<size_t>(p.num_seqs) * p.num_q_heads;
    const size_t q_bytes = rows * l.head_dim * sizeof(uint16_t);
    const size_t table_bytes =
        static_cast<size_t>(p.num_seqs) * p.max_blocks_per_seq * sizeof(int32_t);
    const size_t lens_bytes = static_cast<size_t>(p.num_seqs) * sizeof(int32_t);
    const size_t out_bytes =
        rows * l.head_dim * (p.out_fp16 != nullptr ? sizeof(uint16_t) : sizeof(float));
    const size_t lse_bytes = p.lse != nullptr ? rows * sizeof(float) : 0;
    void* const out_host = p.out_fp16 != nullptr ? static_cast<void*>(p.out_fp16) : p.out;
    // q and out inside registered (pinned) host memory skip the staging copies. Where the device
    // can use host pointers into pinned memory (registered ranges and the staging slots), the
    // kernels write out and lse there (no download), and read q there when one split reads it
    // once (no upload; more splits would each fetch it again over PCIe). The kernels need
    // 16-byte aligned q and out.
    // The split count, planned once (the automatic count costs microseconds at batch 1): the
    // workspace, q's placement and the kernels take it as given.
    const int splits =
        cuda::PlanAttention(l, p.num_seqs, p.num_q_heads, p.max_blocks_per_seq, p.num_splits)
            .num_splits;
    const bool q_pinned = Registered(p.q, q_bytes);
    const bool out_pinned = Registered(out_host, out_bytes);
    const bool q_on_host = host_pointers_usable_ && (!q_pinned || Aligned16(p.q)) && splits == 1;
    const bool out_direct = host_pointers_usable_ && out_pinned && Aligned16(out_host);
    // Copied from the staging slot to out after the kernels.
    const bool out_staged = host_pointers_usable_ ? !out_direct : !out_pinned;
    const size_t workspace_bytes =
        cuda::AttentionWorkspaceBytes(l, p.num_seqs, p.num_q_heads, p.max_blocks_per_seq, splits);
    StagingLayout layout;
    const size_t table_off = layout.Add(table_bytes);
    const size_t lens_off = layout.Add(lens_bytes);
    // The new tokens travel in the same upload and run first on the same stream.
    std::optional<AppendStaging> staging;
    if (append != nullptr && append->num_tokens > 0) staging.emplace(*append, layout);
    // q last among the inputs: uploaded with them when staged and read on the device, uploaded
    // from the caller's memory when pinned and read on the device, not uploaded otherwise.
    const size_t q_off = layout.Add(q_pinned && q_on_host ? 0 : q_bytes);
    const size_t inputs_bytes = q_pinned || q_on_host ? q_off : layout.size();
    const size_t out_off = layout.Add(out_direct ? 0 : out_bytes);
    const size_t lse_off = layout.Add(lse_bytes);
    const size_t ws_off = layout.Add(workspace_bytes);

    return RunSynchronous(layout.size(), [&](Lane& lane, StagingSlot& slot) -> absl::Status {
      std::memcpy(slot.host + table_off, p.block_tables, table_bytes);
      std::memcpy(slot.host + lens_off, p.seq_lens, lens_bytes);
      if (staging) staging->Fill(slot.host);
      if (!q_pinned) std::memcpy(slot.host + q_off, p.q, q_bytes);
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device, slot.host, inputs_bytes,
                                                  cudaMemcpyHostToDevice, lane.stream));
      if (q_pinned && !q_on_host) {
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device + q_off, p.q, q_bytes,
                                                    cudaMemcpyHostToDevice, lane.stream));
      }
      if (staging) {
        if (absl::Status s =
                KernelResult(cuda::QuantizeAppend(staging->DeviceParams(slot.device), lane.stream),
                             "QuantizeAppend");
            !s.ok()) {
          return s;
        }
      }
      // Where the kernels write their outputs: pinned host memory, or the slot's device side.
      uint8_t* const outputs = host_pointers_usable_ ? slot.host : slot.device;
      PagedDecodeAttentionParams d = p;
      d.q = !q_on_host ? reinterpret_cast<const uint16_t*>(slot.device + q_off)
            : q_pinned ? p.q
                       : reinterpret_cast<const uint16_t*>(slot.host + q_off);
      d.block_tables = reinterpret_cast<const int32_t*>(slot.device + table_off);
      d.seq_lens = reinterpret_cast<const int32_t*>(slot.device + lens_off);
      uint8_t* const out = out_direct ? static_cast<uint8_t*>(out_host) : outputs + out_off;
      if (p.out_fp16 != nullptr) {
        d.out_fp16 = reinterpret_cast<uint16_t*>(out);
      } else {
        d.out = reinterpret_cast<float*>(out);
      }
      d.lse = p.lse != nullptr ? reinterpret_cast<float*>(outputs + lse_off) : nullptr;
      d.workspace = workspace_bytes > 0 ? slot.device + ws_off : nullptr;
      d.workspace_bytes = workspace_bytes;
      d.num_splits = splits;
      if (absl::Status s =
              KernelResult(cuda::PagedDecodeAttention(d, lane.stream), "PagedDecodeAttention");
          !s.ok()) {
        return s;
      }
      if (!host_pointers_usable_) {  // download out (to the caller's pinned out) and lse
        if (out_pinned) {
          KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(out_host, slot.device + out_off, out_bytes,
                                                      cudaMemcpyDeviceToHost, lane.stream));
        }
        const size_t from = out_pinned ? lse_off : out_off;
        if (ws_off > from) {
          KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.host + from, slot.device + from,
                                                      ws_off - from, cudaMemcpyDeviceToHost,
                                                      lane.stream));
        }
      }
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream));
      if (out_staged) std::memcpy(out_host, slot.host + out_off, out_bytes);
      if (p.lse != nullptr) std::memcpy(p.lse, slot.host + lse_off, lse_bytes);
      return absl::OkStatus();
    });
  }

  absl::Status RegisterHostMemory(void* data, size_t bytes) override {
    if (data == nullptr || bytes == 0) {
      return absl::InvalidArgumentError("RegisterHostMemory: empty range");
    }
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaHostRegister(data, bytes, cudaHostRegisterDefault));
    absl::MutexLock l(&registered_mu_);
    registered_.push_back({static_cast<const uint8_t*>(data), bytes});
    return absl::OkStatus();
  }

  void UnregisterHostMemory(void* data) override {
    {
      absl::MutexLock l(&registered_mu_);
      auto it = std::find_if(registered_.begin(), registered_.end(),
                             [data](const ArenaRun& r) { return r.src == data; });
      if (it == registered_.end()) return;
      registered_.erase(it);
    }
    cudaSetDevice(device_);
    if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
  }

  absl::Status ReadArena(const uint8_t* src, size_t bytes, void* dst) override {
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

  absl::Status ReadRuns(absl::Span<const ArenaRun> runs, void* dst) override {
    if (runs.empty()) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("ReadRuns: null destination");
    return Gather(runs, nullptr, static_cast<uint8_t*>(dst));
  }

  absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) override {
    if (runs.empty()) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("GatherArena: null destination");
    return Gather(runs, dst, nullptr);
  }

  // Every element's block ids in one staging copy, a kernel per element, one synchronization.
  absl::Status DequantizeToArena(absl::Span<const DequantizeParams> ps) override {
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
  absl::Status QuantizeAppendFromArena(absl::Span<const QuantizeAppendParams> ps) override {
    for (const QuantizeAppendParams& p : ps) {
      if (absl::Status s = ValidateQuantizeAppend(p); !s.ok()) return s;
    }
    const std::vector<store_internal::QuantizeLayerRun> runs =
        store_internal::QuantizeLayerRuns(ps);
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
  absl::Status CheckHalfRangeArena(absl::Span<const HalfRangeCheck> checks) override {
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
          KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.host + results_off, results,
                                                      results_bytes, cudaMemcpyDeviceToHost,
                                                      lane.stream));
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

  absl::Status Synchronize() override {
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    for (Lane& lane : lanes_) {
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream));
    }
    return absl::OkStatus();
  }

  ComputeBackendStats Stats() const override {
    ComputeBackendStats s;
    s.arena_bytes = arenas_.bytes();
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device_) == cudaSuccess &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      s.device_free_bytes = free_bytes;
      s.device_total_bytes = total_bytes;
    } else {
      cudaGetLastError();
    }
    return s;
  }

 private:
  // Runs `body(lane, slot)` on a lane whose stream first waits for every append queued so far,
  // with a staging slot of at least `staging_bytes`. body must finish its GPU work
  // (synchronize the stream) before returning.
  template <typename Body>
  absl::Status RunSynchronous(size_t staging_bytes, Body&& body) {
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    const int index =
        static_cast<int>(next_lane_.fetch_add(1, std::memory_order_relaxed) % kNumLanes);
    Lane& lane = lanes_[index];
    absl::MutexLock lock(&lane.mu);
    // Event handles never change, so other lanes' events are read without their locks; a wait
    // covers the last record made before this call. Records this lane already waited for are
    // skipped (a decode loop queues one append per step, not one per lane).
    for (int other = 0; other < kNumLanes; ++other) {
      if (other == index) continue;
      for (int k = 0; k < kSlotsPerLane; ++k) {
        const StagingSlot& s = lanes_[other].slots[k];
        const uint64_t records = s.records.load(std::memory_order_acquire);
        if (records == lane.waited[other][k]) continue;
        KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(lane.stream, s.free, 0));
        lane.waited[other][k] = records;
      }
    }
    StagingSlot& slot = lane.slots[lane.next];
    if (absl::Status s = slot.Ready(staging_bytes); !s.ok()) return s;
    absl::Status s = body(lane, slot);
    if (!s.ok()) cudaStreamSynchronize(lane.stream);  // leave the slot idle for its next user
    return s;
  }

  // The runs gathered in one kernel into device memory `device_dst`, or, when it is null, into
  // the staging slot and from there to host `host_dst` in one copy. Synchronous.
  absl::Status Gather(absl::Span<const ArenaRun> runs, uint8_t* device_dst, uint8_t* host_dst) {
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
      KVPOOL_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slot.device, slot.host, table_bytes,
                                                  cudaMemcpyHostToDevice, lane.stream));
      uint8_t* dst = device_dst != nullptr ? device_dst : slot.device + out_off;
      const KernelStatus ks =
          cuda::GatherRuns(reinterpret_cast<const cuda::GatherRun*>(slot.device),
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

  // Whether [data, data + bytes) lies inside one RegisterHostMemory range.
  bool Registered(const void* data, size_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    absl::MutexLock l(&registered_mu_);
    return std::any_of(registered_.begin(), registered_.end(), [&](const ArenaRun& r) {
      return p >= r.src && bytes <= r.bytes && static_cast<size_t>(p - r.src) <= r.bytes - bytes;
    });
  }

  const int device_;
  // Kernels may use host pointers into pinned memory as they are (set by Init).
  bool host_pointers_usable_ = false;
  absl::Mutex registered_mu_;
  std::vector<ArenaRun> registered_ ABSL_GUARDED_BY(registered_mu_);  // host ranges
  Lane lanes_[kNumLanes];
  std::atomic<uint32_t> next_lane_{0};
  // The event recorded after the last append's kernel, which the next one waits for. Lock order:
  // a lane's mu, then this.
  absl::Mutex append_order_mu_;
  cudaEvent_t last_append_ ABSL_GUARDED_BY(append_order_mu_) = nullptr;
  ArenaRegistry arenas_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int device,
                                                               const CudaBackendOptions& options) {
  if (!cuda::Available()) return absl::UnavailableError("no CUDA device is visible");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CUDA device %d does not exist (%d visible)", device, count));
  }
  auto backend = std::make_unique<CudaBackend>(device);
  if (absl::Status s = backend->Init(options); !s.ok()) return s;
  return backend;
}

#else  // !KVPOOL_WITH_CUDA

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int, const CudaBackendOptions&) {
  return absl::UnavailableError("built without CUDA");
}

#endif  // KVPOOL_WITH_CUDA

}  // namespace kvpool
