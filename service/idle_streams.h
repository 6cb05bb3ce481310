// The Put streams in progress, so that the server's sweep can cancel those that went idle: a Put
// pins every block of its sequence from its header on, and a client that stalls (or a connection
// that died without a close) would otherwise hold them for good.
#ifndef KVPOOL_SERVICE_PUT_STREAMS_H_
#define KVPOOL_SERVICE_PUT_STREAMS_H_

#include <cstddef>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_callback.h"
#include "service/store/clock.h"

namespace kvpool {

class PutStreams {
 public:
  // One stream's record, owned by its reactor: registered while the stream is open.
  class Stream {
   public:
    explicit Stream(grpc::CallbackServerContext* ctx) : ctx_(ctx) {}
    // Whether the sweep cancelled the stream for its idleness.
    bool cancelled_idle() const {
      absl::MutexLock l(&mu_);
      return cancelled_idle_;
    }

   private:
    friend class PutStreams;
    grpc::CallbackServerContext* const ctx_;
    mutable absl::Mutex mu_;
    absl::Time last_message_ ABSL_GUARDED_BY(mu_);
    bool cancelled_idle_ ABSL_GUARDED_BY(mu_) = false;
  };

  // `clock` (null: SystemClock()) must outlive this.
  explicit PutStreams(Clock* clock);

  // Registers a stream that has just opened; until Remove, the sweep may cancel it.
  void Add(Stream* stream);
  // A message arrived on the stream.
  void Touch(Stream* stream);
  // Before the stream's reactor is deleted.
  void Remove(Stream* stream);
  // Streams open now.
  size_t size();
  // Cancels every stream with no message for longer than `idle` (TryCancel: the reactor's pending
  // read then fails and it ends the call without committing). Returns how many.
  int CancelIdle(absl::Duration idle);

 private:
  Clock* const clock_;
  absl::Mutex mu_;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_PUT_STREAMS_H_
