// The CUDA backend's lanes (cuda_backend.cc): a CUDA stream each, with two staging slots of a
// pinned host buffer, a device buffer and an event that marks the slot free again. Internal to
// the backend; included only where CUDA is.
#ifndef KVPOOL_SERVICE_STORE_CUDA_LANES_H_
#define KVPOOL_SERVICE_STORE_CUDA_LANES_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace kvpool::cuda_backend_internal {

inline constexpr int kNumLanes = 4;
inline constexpr int kSlotsPerLane = 2;
inline constexpr size_t kMinStagingBytes = size_t{1} << 20;

inline absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrFormat("%s: %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err)));
}

#define KVPOOL_RETURN_IF_CUDA_ERROR(expr)                          \
  do {                                                             \
    const absl::Status kvpool_cuda_status_ =                       \
        ::kvpool::cuda_backend_internal::CudaError((expr), #expr); \
    if (!kvpool_cuda_status_.ok()) return kvpool_cuda_status_;     \
  } while (0)

struct StagingSlot {
  uint8_t* host = nullptr;  // pinned
  uint8_t* device = nullptr;
  size_t capacity = 0;
  // Buffers outgrown, freed with the backend: freeing them at once (cudaFreeHost, cudaFree)
  // would wait for every kernel on the device, an NCCL transfer stalled on its worker included.
  // Capacities double, so they hold less than `capacity` together.
  std::vector<std::pair<uint8_t*, uint8_t*>> retired;  // {host, device}
  cudaEvent_t free = nullptr;  // recorded after the last work using the buffers
  // Records of `free` so far, bumped after each record: a lane that has waited on record n of
  // this slot need not wait again until n changes.
  std::atomic<uint64_t> records{0};

  // Waits until the slot's previous work is done and grows its buffers to hold `bytes`. The
  // caller holds the mutex of the slot's lane.
  absl::Status Ready(size_t bytes) {
    KVPOOL_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(free));
    if (capacity >= bytes) return absl::OkStatus();
    size_t grown = kMinStagingBytes;
    while (grown < bytes) grown *= 2;
    // The new pair replaces the old only once both are allocated: a failure keeps the slot as it
    // was (and clears the error, which the next launch check would report).
    uint8_t* new_host = nullptr;
    uint8_t* new_device = nullptr;
    cudaError_t err = cudaMallocHost(&new_host, grown);
    if (err == cudaSuccess) err = cudaMalloc(&new_device, grown);
    if (err != cudaSuccess) {
      cudaFreeHost(new_host);
      cudaGetLastError();
      return CudaError(err, "staging allocation");
    }
    if (capacity > 0) retired.emplace_back(host, device);
    host = new_host;
    device = new_device;
    capacity = grown;
    return absl::OkStatus();
  }

  // Frees every buffer and the event; no work may still use them.
  void Release() {
    retired.emplace_back(host, device);
    for (auto [h, d] : retired) {
      cudaFreeHost(h);
      cudaFree(d);
    }
    retired.clear();
    if (free != nullptr) cudaEventDestroy(free);
  }
};

struct Lane {
  absl::Mutex mu;
  cudaStream_t stream = nullptr;     // created once, never changes
  StagingSlot slots[kSlotsPerLane];  // events created once; buffers guarded by mu
  int next ABSL_GUARDED_BY(mu) = 0;
  // records of every lane's slots ([lane][slot]) this lane's stream last waited for.
  uint64_t waited[kNumLanes][kSlotsPerLane] ABSL_GUARDED_BY(mu) = {};
};

}  // namespace kvpool::cuda_backend_internal

#endif  // KVPOOL_SERVICE_STORE_CUDA_LANES_H_
