// The CUDA backend's class, internal to it: cuda_backend.cc holds its arenas, appends and
// attention, cuda_backend_transfer.cc its transfer paths (ReadArena, ReadRuns, GatherArena and the
// NCCL data plane's DequantizeToArena, QuantizeAppendFromArena and CheckHalfRangeArena). Included
// only where CUDA is.
#ifndef KVPOOL_SERVICE_STORE_CUDA_BACKEND_IMPL_H_
#define KVPOOL_SERVICE_STORE_CUDA_BACKEND_IMPL_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/kv_kernels.h"
#include "service/store/arena_registry.h"
#include "service/store/compute_backend.h"
#include "service/store/cuda_lanes.h"

namespace kvpool::cuda_backend_internal {

// FromKernelStatus, plus the CUDA error text for kCudaError.
absl::Status KernelResult(KernelStatus s, const char* what);

class CudaBackend final : public ComputeBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override;

  // Creates the lanes' streams and events.
  absl::Status Init(const CudaBackendOptions& options);

  std::string name() const override { return "cuda"; }
  absl::Status CheckLayout(const PageLayout& layout) const override;
  absl::Status CheckAttentionShape(size_t num_seqs, size_t num_q_heads) const override;
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override;
  void FreeArena(uint8_t* arena) override;
  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override;
  absl::Status Dequantize(const DequantizeParams& p) override;
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override;
  absl::Status RegisterHostMemory(void* data, size_t bytes) override;
  void UnregisterHostMemory(void* data) override;
  absl::Status Synchronize() override;
  ComputeBackendStats Stats() const override;

  // cuda_backend_transfer.cc
  absl::Status ReadArena(const uint8_t* src, size_t bytes, void* dst) override;
  absl::Status ReadRuns(absl::Span<const ArenaRun> runs, void* dst) override;
  absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) override;
  absl::Status DequantizeToArena(absl::Span<const DequantizeParams> ps) override;
  absl::Status QuantizeAppendFromArena(absl::Span<const QuantizeAppendParams> ps) override;
  absl::Status CheckHalfRangeArena(absl::Span<const HalfRangeCheck> checks) override;

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
  absl::Status Gather(absl::Span<const ArenaRun> runs, uint8_t* device_dst, uint8_t* host_dst);

  // Whether [data, data + bytes) lies inside one RegisterHostMemory range.
  bool Registered(const void* data, size_t bytes);

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

}  // namespace kvpool::cuda_backend_internal

#endif  // KVPOOL_SERVICE_STORE_CUDA_BACKEND_IMPL_H_
