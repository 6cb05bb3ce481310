// An in-process PeerTransportFactory for tests: both ends of a channel live in this process and
// move host memory (the CPU backend's arenas). Time comes from a FakeClock: each operation
// "takes" op_latency on it (a QueueSend or a Recv; WaitSends takes none), so tests exercise
// deadlines without sleeping, and a worker end can die (Abort) at any point to play a killed
// worker.
//
// Sends are buffered (QueueSend copies the segments onto the wire, and WaitSends only reports a
// broken channel: nothing waits for the Recv); a Recv waits until the
// peer sent its segment or either end broke the channel. A Recv whose size differs from the
// segment sent breaks the channel (INTERNAL), as a mismatched NCCL pair would.
//
// Thread safety: all methods are thread-safe. Lock order: FakePeerNetwork::mu_, then a wire's.
#ifndef KVPOOL_SERVICE_TRANSPORT_FAKE_PEER_TRANSPORT_H_
#define KVPOOL_SERVICE_TRANSPORT_FAKE_PEER_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/store/clock.h"
#include "service/transport/peer_transport.h"

namespace kvpool {

class FakePeerNetwork final : public PeerTransportFactory {
 public:
  // `clock` is not owned and must outlive the network and every transport it made.
  explicit FakePeerNetwork(FakeClock* clock) : clock_(clock) {}

  absl::StatusOr<OpenedTransport> Open(absl::Time join_deadline) override;

  // The worker's end of the channel opened with `join_id`. NOT_FOUND for an unknown id or one
  // already joined.
  absl::StatusOr<std::unique_ptr<PeerTransport>> Join(const std::string& join_id);

  // Every later QueueSend or Recv first advances the clock by `latency`; one that would end after
  // its deadline fails with DEADLINE_EXCEEDED (breaking the channel) without moving data.
  void set_op_latency(absl::Duration latency) {
    absl::MutexLock l(&mu_);
    op_latency_ = latency;
  }
  absl::Duration op_latency() const {
    absl::MutexLock l(&mu_);
    return op_latency_;
  }
  FakeClock* clock() const { return clock_; }

  // Shared state of one channel (defined in the .cc).
  struct Wire;

 private:
  FakeClock* const clock_;
  mutable absl::Mutex mu_;
  absl::Duration op_latency_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Worker ends not yet joined, by join id.
  absl::flat_hash_map<std::string, std::unique_ptr<PeerTransport>> unjoined_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_TRANSPORT_FAKE_PEER_TRANSPORT_H_
