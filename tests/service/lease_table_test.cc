#include "service/store/lease_table.h"

#include <cstdint>
#include <memory>
#include <set>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/store/clock.h"

namespace kvpool {
namespace {

std::shared_ptr<Lease> NewLease(absl::Duration ttl) {
  auto lease = std::make_shared<Lease>();
  lease->ttl = ttl;
  return lease;
}

TEST(LeaseTable, ExpiresAfterTtl) {
  FakeClock clock;
  LeaseTable table(10);
  auto a = table.Add(NewLease(absl::Seconds(5)), clock.Now());
  auto b = table.Add(NewLease(absl::Seconds(20)), clock.Now());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->id, (*b)->id);
  clock.Advance(absl::Seconds(4));
  EXPECT_TRUE(table.Expire(clock.Now()).empty());
  clock.Advance(absl::Seconds(1));
  auto expired = table.Expire(clock.Now());
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0]->id, (*a)->id);
  EXPECT_EQ(table.Find((*a)->id, clock.Now()), nullptr);
  EXPECT_NE(table.Find((*b)->id, clock.Now()), nullptr);
  EXPECT_EQ(table.size(), 1u);
}

TEST(LeaseTable, RenewExtendsAndFindDoesNot) {
  FakeClock clock;
  LeaseTable table(10);
  auto a = table.Add(NewLease(absl::Seconds(10)), clock.Now());
  ASSERT_TRUE(a.ok());
  for (int i = 0; i < 5; ++i) {
    clock.Advance(absl::Seconds(8));
    std::shared_ptr<Lease> found = table.Find((*a)->id, clock.Now());
    ASSERT_NE(found, nullptr) << "round " << i;
    table.Renew(*found, clock.Now());
    EXPECT_TRUE(table.Expire(clock.Now()).empty());
  }
  EXPECT_EQ((*a)->expires, clock.Now() + absl::Seconds(10));
  clock.Advance(absl::Seconds(8));
  EXPECT_NE(table.Find((*a)->id, clock.Now()), nullptr);
  clock.Advance(absl::Seconds(2));
  EXPECT_EQ(table.Find((*a)->id, clock.Now()), nullptr);
  EXPECT_EQ(table.Expire(clock.Now()).size(), 1u);
}

TEST(LeaseTable, LimitEnforced) {
  FakeClock clock;
  LeaseTable table(2);
  auto a = table.Add(NewLease(absl::Seconds(1)), clock.Now());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(table.Add(NewLease(absl::Seconds(1)), clock.Now()).ok());
  const absl::Status refused = table.Add(NewLease(absl::Seconds(1)), clock.Now()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max_leases"), absl::string_view::npos) << refused;
  EXPECT_EQ(table.size(), 2u);
  EXPECT_NE(table.Remove((*a)->id), nullptr);
  EXPECT_TRUE(table.Add(NewLease(absl::Seconds(1)), clock.Now()).ok());
}

// Ids are random 64-bit numbers, not a sequence a client could walk from its own lease's id:
// consecutive ids lie far apart (two within 2^32 of each other: chance ~2^-31 per pair).
TEST(LeaseTable, IdsAreNotASequence) {
  FakeClock clock;
  LeaseTable table(1000);
  std::set<uint64_t> ids;
  uint64_t previous = 0;
  int close = 0;
  for (int i = 0; i < 1000; ++i) {
    auto lease = table.Add(NewLease(absl::Seconds(1)), clock.Now());
    ASSERT_TRUE(lease.ok());
    const uint64_t id = (*lease)->id;
    EXPECT_NE(id, 0u);
    ids.insert(id);
    const uint64_t gap = id > previous ? id - previous : previous - id;
    if (i > 0 && gap < (uint64_t{1} << 32)) ++close;
    previous = id;
  }
  EXPECT_EQ(ids.size(), 1000u);
  EXPECT_EQ(close, 0);
}

TEST(LeaseTable, RemoveUnknownReturnsNull) {
  LeaseTable table(2);
  EXPECT_EQ(table.Remove(12345), nullptr);
}

}  // namespace
}  // namespace kvpool
