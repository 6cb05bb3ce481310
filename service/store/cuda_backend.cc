// The CUDA backend: arenas in device memory, kernels from kvpool::cuda. The class is in
// cuda_backend_impl.h; this file holds its arenas, appends and attention, and
// cuda_backend_transfer.cc its transfer paths.
//
// Work is spread over a few "lanes", each a CUDA stream with two staging slots (pinned host
// buffer + device buffer + an event marking the slot free again). QuantizeAppend copies the
// caller's inputs into a free slot, enqueues the upload and the fused kernel on its lane and
// returns, so the host copy of the next chunk overlaps the kernel of this one, and the lanes'
// uploads overlap each other on the GPU; the kernels run in the order the appends were queued
// (each waits for the one before it, whatever its lane), so a block freed and handed out again
// never receives an older append's write after a newer one's. Synchronous calls (Dequantize,
// PagedDecodeAttention, ReadArena, ReadRuns and the four transfer paths) first make their lane's
// stream wait, on the GPU, for every append queued so far on every lane (RunSynchronous).
// PagedDecodeAttention's own append (a decode step's new tokens) rides in its upload and runs on
// its stream just before the attention.
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "service/store/compute_backend.h"

#if defined(KVPOOL_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/kv_kernels.h"
#include "service/store/cuda_backend_impl.h"
#include "service/store/cuda_backend_staging.h"
#include "service/store/cuda_lanes.h"
#endif

namespace kvpool {

#if defined(KVPOOL_WITH_CUDA)
namespace cuda_backend_internal {

absl::Status KernelResult(KernelStatus s, const char* what) {
  if (s == KernelStatus::kCudaError) {
    return absl::InternalError(absl::StrFormat("%s: %s", what, cuda::LastErrorMessage()));
  }
  return FromKernelStatus(s, what);
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  for (Lane& lane : lanes_) {
    if (lane.stream != nullptr) cudaStreamSynchronize(lane.stream);
    for (StagingSlot& slot : lane.slots) slot.Release();
    if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
  }
  for (uint8_t* arena : arenas_.TakeAll()) cudaFree(arena);
}

absl::Status CudaBackend::Init(const CudaBackendOptions& options) {
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

absl::Status CudaBackend::CheckLayout(const PageLayout& layout) const {
  if (cuda::ServesLayout(layout) == KernelStatus::kOk) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "the cuda backend's kernels serve head_dim 64, 128 or 256, block_tokens 16, 32 or 64, "
      "rotation blocks of 16 to 128 channels (at most head_dim) or none, quantization groups "
      "of a multiple of 16 channels, and layer pages under 4 GiB");
}

absl::Status CudaBackend::CheckAttentionShape(size_t num_seqs, size_t num_q_heads) const {
  return CheckCudaAttentionShape(num_seqs, num_q_heads);
}

absl::StatusOr<uint8_t*> CudaBackend::AllocateArena(size_t bytes) {
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

void CudaBackend::FreeArena(uint8_t* arena) {
  if (!arenas_.Remove(arena)) return;
  cudaSetDevice(device_);
  // cudaFree waits for queued work on the device, so no kernel still reads the arena.
  cudaFree(arena);
}

absl::Status CudaBackend::QuantizeAppend(const QuantizeAppendParams& p) {
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

absl::Status CudaBackend::Dequantize(const DequantizeParams& p) {
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

absl::Status CudaBackend::PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                               const QuantizeAppendParams* append) {
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
    KVPOOL_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(slot.device, slot.host, inputs_bytes, cudaMemcpyHostToDevice, lane.stream));
    if (q_pinned && !q_on_host) {
      KVPOOL_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(slot.device + q_off, p.q, q_bytes, cudaMemcpyHostToDevice, lane.stream));
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

absl::Status CudaBackend::RegisterHostMemory(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("RegisterHostMemory: empty range");
  }
  KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  KVPOOL_RETURN_IF_CUDA_ERROR(cudaHostRegister(data, bytes, cudaHostRegisterDefault));
  absl::MutexLock l(&registered_mu_);
  registered_.push_back({static_cast<const uint8_t*>(data), bytes});
  return absl::OkStatus();
}

void CudaBackend::UnregisterHostMemory(void* data) {
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

absl::Status CudaBackend::Synchronize() {
  KVPOOL_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  for (Lane& lane : lanes_) {
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream));
  }
  return absl::OkStatus();
}

ComputeBackendStats CudaBackend::Stats() const {
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

bool CudaBackend::Registered(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  absl::MutexLock l(&registered_mu_);
  return std::any_of(registered_.begin(), registered_.end(), [&](const ArenaRun& r) {
    return p >= r.src && bytes <= r.bytes && static_cast<size_t>(p - r.src) <= r.bytes - bytes;
  });
}

}  // namespace cuda_backend_internal

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int device,
                                                               const CudaBackendOptions& options) {
  if (!cuda::Available()) return absl::UnavailableError("no CUDA device is visible");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CUDA device %d does not exist (%d visible)", device, count));
  }
  auto backend = std::make_unique<cuda_backend_internal::CudaBackend>(device);
  if (absl::Status s = backend->Init(options); !s.ok()) return s;
  return backend;
}

#else  // !KVPOOL_WITH_CUDA

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int, const CudaBackendOptions&) {
  return absl::UnavailableError("built without CUDA");
}

#endif  // KVPOOL_WITH_CUDA

}  // namespace kvpool
