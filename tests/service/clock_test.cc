#include "service/store/clock.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvpool {
namespace {

// SystemClock reads as wall time and advances with the time that passes, never backwards (it
// follows the steady clock, so a step of the system clock cannot move it; no test steps it).
TEST(SystemClock, ReadsAsWallTimeAndAdvancesWithElapsedTime) {
  const absl::Time first = SystemClock()->Now();
  EXPECT_LT(absl::AbsDuration(first - absl::Now()), absl::Seconds(1));
  absl::Time last = first;
  for (int i = 0; i < 10000; ++i) {
    const absl::Time now = SystemClock()->Now();
    ASSERT_GE(now, last);
    last = now;
  }
  absl::SleepFor(absl::Milliseconds(20));
  const absl::Duration passed = SystemClock()->Now() - first;
  EXPECT_GE(passed, absl::Milliseconds(20));
  EXPECT_LT(passed, absl::Seconds(5));
}

}  // namespace
}  // namespace kvpool
