// Where the pool's bytes live and where its kernels run: host memory and the CPU reference, or
// device memory and the CUDA kernels. The store talks only to this interface, with host-side
// inputs and outputs; a backend owns whatever staging and streams it needs.
//
// Thread safety: every method may be called from several threads at once.
#ifndef KVPOOL_SERVICE_STORE_COMPUTE_BACKEND_H_
#define KVPOOL_SERVICE_STORE_COMPUTE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kv_kernels.h"

namespace kvpool {

struct ComputeBackendStats {
  uint64_t arena_bytes = 0;          // bytes allocated for arenas (pools and NCCL staging)
  uint64_t device_total_bytes = 0;   // device memory, 0 for the CPU backend
  uint64_t device_free_bytes = 0;
};

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;

  virtual std::string name() const = 0;  // "cpu" or "cuda"

  // OK when the backend's kernels serve every call on pages of `layout` (a valid one); else why
  // not. CreateNamespace refuses a namespace with a layer this fails. The default (a backend
  // over the CPU reference) serves every valid layout.
  [[nodiscard]] virtual absl::Status CheckLayout(const PageLayout& layout) const;
  // OK when PagedDecodeAttention serves a call of `num_seqs` sequences of `num_q_heads` query
  // heads; else why not. The store checks it before an Attend appends or evicts anything. The
  // default serves every shape.
  [[nodiscard]] virtual absl::Status CheckAttentionShape(size_t num_seqs, size_t num_q_heads) const;

  // Arena memory (host or device), zero-filled. Freed with FreeArena.
  [[nodiscard]] virtual absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) = 0;
  virtual void FreeArena(uint8_t* arena) = 0;

  // The params' pointer fields name HOST memory for k, v, slot_mapping and positions, and
  // arena memory for pages and sink_pages. May return before the work completes (the inputs are
  // copied first), but appends land in the order they were queued, from any thread (a block
  // freed and allocated again never gets an older write after a newer one); Synchronize() waits
  // for everything queued, and every synchronous call below starts after the appends queued
  // before it (it sees their writes).
  [[nodiscard]] virtual absl::Status QuantizeAppend(const QuantizeAppendParams& p) = 0;
  // block_ids and k_out/v_out are host memory; pages are arena memory. Synchronous.
  [[nodiscard]] virtual absl::Status Dequantize(const DequantizeParams& p) = 0;
  // q, block_tables, seq_lens, out and lse are host memory; pages are arena memory. Synchronous.
  // When `append` is not null (host memory as for QuantizeAppend), its tokens are appended first,
  // in the same call: a decode step's new K/V is part of the context it attends to. A bad append
  // fails the call before anything runs.
  [[nodiscard]] virtual absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                                          const QuantizeAppendParams* append) = 0;
  // Copies `bytes` of arena memory at `src` to host `dst`. Synchronous.
  [[nodiscard]] virtual absl::Status ReadArena(const uint8_t* src, size_t bytes, void* dst) = 0;
  // One contiguous run of arena bytes, or of `bytes` zeros when src is null.
  struct ArenaRun {
    const uint8_t* src = nullptr;
    size_t bytes = 0;
  };
  // Copies the runs, in order and back to back, to host `dst`. Synchronous. The default reads
  // run by run; a device backend does it in one launch and one copy.
  [[nodiscard]] virtual absl::Status ReadRuns(absl::Span<const ArenaRun> runs, void* dst);
  // Waits for all work queued so far.
  [[nodiscard]] virtual absl::Status Synchronize() = 0;

  // Pins host memory [data, data + bytes) for direct device copies until UnregisterHostMemory:
  // PagedDecodeAttention then copies a q or out that lies inside it without a staging copy. The
  // default (a backend over host memory) does nothing.
  [[nodiscard]] virtual absl::Status RegisterHostMemory(void* data, size_t bytes);
  // Undoes RegisterHostMemory(data, ...); no call using the memory may be running.
  virtual void UnregisterHostMemory(void* data);

  // ---- Transfer paths (NCCL data plane): inputs and outputs in ARENA memory ---------------------
  // Staging buffers for these are arenas too (AllocateArena). The defaults return UNIMPLEMENTED;
  // a backend that serves NCCL transfers overrides all four. All are synchronous: they return
  // after the work finished, so the caller may reuse or send the buffers at once.

  // Copies the runs, in order and back to back, to arena memory at `dst`. Runs are many and
  // small (one per block and K|V half), so a device backend must do this in one launch.
  [[nodiscard]] virtual absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst);
  // Dequantize of each element (layers, typically) with k_out and v_out in arena memory
  // (block_ids stay host memory), synchronized once at the end.
  [[nodiscard]] virtual absl::Status DequantizeToArena(absl::Span<const DequantizeParams> ps);
  // QuantizeAppend of each element (layers, typically) with k and v in arena memory
  // (slot_mapping and positions stay host memory), synchronized once at the end, the elements
  // applied in order. A bad element (ValidateQuantizeAppend) fails the call before any element is
  // written; what only a device backend requires (16-byte alignment, a layout it serves:
  // CheckLayout) may fail a later element after earlier ones were written.
  [[nodiscard]] virtual absl::Status QuantizeAppendFromArena(
      absl::Span<const QuantizeAppendParams> ps);
  // store_internal::CheckHalfRange over n fp16 values at arena `x`.
  struct HalfRangeCheck {
    const uint16_t* x = nullptr;
    size_t n = 0;
    uint16_t max_abs_bits = 0;
    const char* what = "";
  };
  // Every check, synchronized once: INVALID_ARGUMENT naming the `what` of the first check (in
  // order) that finds a value NaN, Inf or of a magnitude whose bits pass its max_abs_bits.
  [[nodiscard]] virtual absl::Status CheckHalfRangeArena(absl::Span<const HalfRangeCheck> checks);

  virtual ComputeBackendStats Stats() const = 0;
};

// The CPU reference backend over host memory.
std::unique_ptr<ComputeBackend> NewCpuBackend();

struct CudaBackendOptions {
  // Where the device can use host pointers into pinned memory (registered ranges and the staging
  // slots), the attention kernels read q and write their outputs there instead of the backend
  // copying them over DMA. false keeps the copies (the path of devices without that support).
  bool kernel_host_io = true;
};

// The CUDA backend on `device`, or an error when CUDA is not built in or no device is present.
absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(
    int device, const CudaBackendOptions& options = {});

// Converts a kernel status to an absl::Status with `what` as context.
absl::Status FromKernelStatus(KernelStatus s, const char* what);

// Host-side checks of QuantizeAppend's arguments (slot_mapping and positions are host memory),
// which a backend runs before it writes anything: a valid layout (ValidatePageLayout), counts,
// the pointers the layout needs, and every slot (the kernels must never see one out of range).
absl::Status ValidateQuantizeAppend(const QuantizeAppendParams& p);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_COMPUTE_BACKEND_H_
