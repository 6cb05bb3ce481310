#include "service/idle_streams.h"

#include "grpcpp/server_context.h"

namespace kvpool {

IdleStreams::IdleStreams(Clock* clock) : clock_(clock != nullptr ? clock : SystemClock()) {}

size_t IdleStreams::Add(Stream* stream) {
  Touch(stream);
  absl::MutexLock l(&mu_);
  streams_.insert(stream);
  return streams_.size();
}

void IdleStreams::Touch(Stream* stream) {
  const absl::Time now = clock_->Now();
  absl::MutexLock l(&stream->mu_);
  stream->last_progress_ = now;
}

void IdleStreams::Remove(Stream* stream) {
  absl::MutexLock l(&mu_);
  streams_.erase(stream);
}

size_t IdleStreams::size() {
  absl::MutexLock l(&mu_);
  return streams_.size();
}

int IdleStreams::CancelIdle(absl::Duration idle) {
  const absl::Time now = clock_->Now();
  int cancelled = 0;
  // Under mu_, so that no reactor is deleted (its OnDone calls Remove first) while its context is
  // cancelled. TryCancel does not run the Put or Get reactor's reactions on this thread: they are
  // not inlineable, and gRPC hands them to its executor, which then waits in Remove for mu_.
  absl::MutexLock l(&mu_);
  for (Stream* stream : streams_) {
    {
      absl::MutexLock sl(&stream->mu_);
      if (stream->cancelled_idle_ || now - stream->last_progress_ <= idle) continue;
      stream->cancelled_idle_ = true;
    }
    stream->ctx_->TryCancel();
    ++cancelled;
  }
  return cancelled;
}

}  // namespace kvpool
