// The streams in progress whose client could hold them open for good by stalling (or through a
// connection that died without a close), so that the server's sweep can cancel those that went
// idle: a Put pins every block of its sequence from its header on; a Get whose client stops
// reading keeps its --max_get_streams slot and a message of up to --get_chunk_bytes. Each stream
// records when it last made progress (a Put's message arrived, a Get's message was taken).
#ifndef KVPOOL_SERVICE_IDLE_STREAMS_H_
#define KVPOOL_SERVICE_IDLE_STREAMS_H_

#include <cstddef>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_callback.h"
#include "service/store/clock.h"

namespace kvpool {

class IdleStreams {
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
    friend class IdleStreams;
    grpc::CallbackServerContext* const ctx_;
    mutable absl::Mutex mu_;
    absl::Time last_progress_ ABSL_GUARDED_BY(mu_);
    bool cancelled_idle_ ABSL_GUARDED_BY(mu_) = false;
  };

  // `clock` (null: SystemClock()) must outlive this.
  explicit IdleStreams(Clock* clock);

  // Registers a stream that has just opened; until Remove, the sweep may cancel it. Returns the
  // streams open with it (it included).
  size_t Add(Stream* stream);
  // The stream made progress.
  void Touch(Stream* stream);
  // Before the stream's reactor is deleted.
  void Remove(Stream* stream);
  // Streams open now.
  size_t size();
  // Cancels every stream without progress for longer than `idle` (TryCancel: the reactor's
  // pending read or write then fails, and it ends the call; a Put commits nothing). Returns how
  // many.
  int CancelIdle(absl::Duration idle);

 private:
  Clock* const clock_;
  absl::Mutex mu_;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_IDLE_STREAMS_H_
