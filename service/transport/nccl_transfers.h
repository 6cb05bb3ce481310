// NcclTransfers: the server's side of NcclGet and NcclPut (proto/kvpool/v1/kvpool.proto,
// KvPoolTransport), independent of gRPC: each call validates, emits the descriptor or plan,
// moves the payload through the channel's PeerTransport in rounds that fit a staging buffer in
// backend memory, and emits the outcome. The gRPC service only adapts `emit` to a stream.
//
// Failure handling: an error before the first byte moves leaves the channel usable; a transport
// error (or a store error once the worker is waiting for data) aborts and forgets the channel.
// Staging buffers go back to the pool and an uncommitted Put's blocks are freed either way.
//
// Thread safety: thread-safe; transfers on different channels run concurrently.
#ifndef KVPOOL_SERVICE_TRANSPORT_NCCL_TRANSFERS_H_
#define KVPOOL_SERVICE_TRANSPORT_NCCL_TRANSFERS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/v1/kvpool.pb.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/transport/channel_manager.h"

namespace kvpool {

struct TransportOptions {
  ChannelOptions channels;
  absl::Duration default_transfer_timeout = absl::Seconds(30);
  absl::Duration max_transfer_timeout = absl::Minutes(5);
  // Bytes of one staging buffer (backend memory); a round moves as many whole layers as fit
  // (at least one: a layer larger than this gets a buffer of its own size), a Get's first round
  // as many as fit an eighth of it (gathered before any byte moves). A Get whose payload fits
  // one buffer lays its rounds side by side in it; a larger Get, and a Put of more than one
  // round, take two, to gather (Get) or store (Put) one round while another moves.
  uint64_t staging_bytes = uint64_t{256} << 20;
  size_t max_idle_staging = 4;  // staging buffers kept for reuse
  // Device memory all staging buffers may take together (idle ones and those not yet freed
  // included); a transfer that would pass it gets RESOURCE_EXHAUSTED.
  uint64_t max_staging_total_bytes = uint64_t{8} << 30;
};

// INVALID_ARGUMENT unless every limit and timeout of `options` is positive.
absl::Status CheckTransportOptions(const TransportOptions& options);

// Lets the RPC layer abort a transfer's transport when the call is cancelled (the worker went
// away), so a dead worker is noticed at once rather than at the deadline. Thread-safe.
class TransferCancel {
 public:
  // Runs `abort` on Cancel (at once if already cancelled) until Clear.
  void Set(std::function<void()> abort);
  void Clear();
  void Cancel();

 private:
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> abort_ ABSL_GUARDED_BY(mu_);
};

class NcclTransfers {
 public:
  // Not owned; all must outlive this object. `backend` is the store's backend.
  NcclTransfers(KvStore* store, ComputeBackend* backend, ChannelManager* channels, Clock* clock,
                const TransportOptions& options);
  ~NcclTransfers();

  template <typename Response>
  using Emit = std::function<absl::Status(const Response&)>;

  // Emits the descriptor, sends every segment, emits done. `cancel` may be null.
  absl::Status Get(const v1::NcclGetRequest& request, const Emit<v1::NcclGetResponse>& emit,
                   TransferCancel* cancel);
  // Emits the plan, receives and stores every segment, commits, emits the result.
  absl::Status Put(const v1::NcclPutRequest& request, const Emit<v1::NcclPutResponse>& emit,
                   TransferCancel* cancel);

  // Staging buffers allocated now (idle, in use, or waiting to be freed).
  size_t staging_buffers() const;

 private:
  class Staging;
  // A staging buffer of at least `bytes`.
  absl::StatusOr<Staging> TakeStaging(uint64_t bytes);
  // `rounds` buffers, at most two, each of at least `bytes`: one when every round fits it, two
  // (filled and drained in turn) otherwise.
  absl::StatusOr<std::vector<Staging>> TakeBuffers(size_t rounds, uint64_t bytes);
  // Keeps `buffer` for reuse when `reusable` and there is room, else hands it to FreeLoop.
  void ReturnStaging(uint8_t* buffer, uint64_t bytes, bool reusable);
  // The freeing thread: a device free (cudaFree) waits for every kernel on the device, another
  // channel's transfer stalled on its worker included, so no transfer frees a buffer itself.
  void FreeLoop();
  absl::Time Deadline(uint32_t timeout_ms) const;

  KvStore* const store_;
  ComputeBackend* const backend_;
  ChannelManager* const channels_;
  Clock* const clock_;
  const TransportOptions options_;
  mutable absl::Mutex mu_;
  std::vector<uint8_t*> idle_staging_ ABSL_GUARDED_BY(mu_);  // each options_.staging_bytes
  std::vector<std::pair<uint8_t*, uint64_t>> to_free_ ABSL_GUARDED_BY(mu_);  // for FreeLoop
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t staging_allocated_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t staging_total_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the staging_allocated_ buffers
  std::thread freer_;  // last: starts once the members above exist
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_TRANSPORT_NCCL_TRANSFERS_H_
