// PeerTransport: point-to-point moves of backend-memory buffers between the pool (rank 0) and
// one worker (rank 1) of a channel — NCCL send/recv in production, an in-process fake in tests.
// A factory creates the server's end of a new channel and the id the worker joins with.
//
// Ordering: both ends issue their operations in the same order, and every Send of n segments
// is matched by Recvs of the same segment sizes in the same order.
//
// Failure: an operation that fails (deadline passed, peer gone, communicator error) leaves the
// transport broken: it has torn down or will tear down its communicator, and every later
// operation fails. Callers drop a broken transport; they never retry on it.
#ifndef KVPOOL_SERVICE_TRANSPORT_PEER_TRANSPORT_H_
#define KVPOOL_SERVICE_TRANSPORT_PEER_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "service/store/clock.h"

namespace kvpool {

// A buffer in the memory of the transport's device (the compute backend's arena memory).
struct SendSegment {
  const void* data = nullptr;
  size_t bytes = 0;
};
struct RecvSegment {
  void* data = nullptr;
  size_t bytes = 0;
};

class PeerTransport {
 public:
  virtual ~PeerTransport() = default;

  // Queues sends of the segments, in order, after every send queued before, and returns without
  // waiting for them: their buffers must stay unchanged until WaitSends reports them delivered.
  // A caller that queues the next sends before the earlier ones are delivered keeps the link
  // busy between them. UNAVAILABLE when the peer or the link failed or Abort was called, and
  // DEADLINE_EXCEEDED when the peer has not joined by `deadline`; either way the transport is
  // broken.
  [[nodiscard]] virtual absl::Status QueueSend(absl::Span<const SendSegment> segments,
                                               absl::Time deadline) = 0;
  // Returns once at most `pending` of the queued QueueSend calls are not yet delivered (0: all
  // delivered, their buffers free). DEADLINE_EXCEEDED when they are not by `deadline`;
  // UNAVAILABLE as QueueSend.
  [[nodiscard]] virtual absl::Status WaitSends(size_t pending, absl::Time deadline) = 0;
  // Sends the segments and returns once they are delivered: QueueSend, then WaitSends(0).
  [[nodiscard]] absl::Status Send(absl::Span<const SendSegment> segments, absl::Time deadline) {
    if (absl::Status s = QueueSend(segments, deadline); !s.ok()) return s;
    return WaitSends(0, deadline);
  }
  // Receives the segments, in order, from the peer and returns once they arrived; errors as
  // QueueSend and WaitSends.
  [[nodiscard]] virtual absl::Status Recv(absl::Span<const RecvSegment> segments,
                                          absl::Time deadline) = 0;
  // Breaks the transport: an operation in flight and every later one fail promptly with
  // UNAVAILABLE, and the communicator is torn down without waiting on the peer. Thread-safe,
  // idempotent; may be called while another thread is in an operation.
  virtual void Abort() = 0;
};

// The server's end of a new channel and the opaque id (an ncclUniqueId for NCCL) the worker
// joins with.
struct OpenedTransport {
  std::unique_ptr<PeerTransport> transport;
  std::string join_id;
};

class PeerTransportFactory {
 public:
  virtual ~PeerTransportFactory() = default;
  // Starts a new 2-rank channel as rank 0 and returns without waiting for the worker. The
  // worker must join by `join_deadline`; until it has, operations wait for it (within their
  // own deadline and the join deadline) and fail when it never comes. Thread-safe.
  [[nodiscard]] virtual absl::StatusOr<OpenedTransport> Open(absl::Time join_deadline) = 0;
};

// NCCL channels on CUDA device `device`, whose buffers are that device's memory (the CUDA
// backend's arenas). Deadlines are on `clock` (not owned; the transport service's, which
// computes them). UNIMPLEMENTED when the server was built without NCCL (KVPOOL_ENABLE_NCCL off).
absl::StatusOr<std::unique_ptr<PeerTransportFactory>> NewNcclTransportFactory(int device,
                                                                              Clock* clock);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_TRANSPORT_PEER_TRANSPORT_H_
