#include "service/store/clock.h"

#include "absl/time/clock.h"

namespace kvpool {
namespace {

class SystemClockImpl final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace

Clock* SystemClock() {
  static SystemClockImpl* const clock = new SystemClockImpl();
  return clock;
}

}  // namespace kvpool
