#include "service/store/clock.h"

#include <chrono>

#include "absl/time/clock.h"

namespace kvpool {
namespace {

class SystemClockImpl final : public Clock {
 public:
  absl::Time Now() const override {
    return wall_start_ + absl::FromChrono(std::chrono::steady_clock::now() - steady_start_);
  }

 private:
  const absl::Time wall_start_ = absl::Now();
  const std::chrono::steady_clock::time_point steady_start_ = std::chrono::steady_clock::now();
};

}  // namespace

Clock* SystemClock() {
  static SystemClockImpl* const clock = new SystemClockImpl();
  return clock;
}

}  // namespace kvpool
