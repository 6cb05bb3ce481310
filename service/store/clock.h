// Time source for leases and LRU order, injectable so tests never sleep.
#ifndef KVPOOL_SERVICE_STORE_CLOCK_H_
#define KVPOOL_SERVICE_STORE_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvpool {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// Wall time at the first call, advanced by the steady (monotonic) clock since: a step of the
// system clock (NTP, a VM resumed) moves no lease's expiry, and expiry times still read as wall
// time (a lease's expires_unix_ms).
Clock* SystemClock();

// A clock that moves only when told. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock l(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock l(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_CLOCK_H_
