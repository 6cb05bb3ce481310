#include <vector>

#include "gtest/gtest.h"
#include "tests/common/bench_output.h"

namespace kvpool::bench {
namespace {

std::vector<double> OneTo(int n) {
  std::vector<double> v;
  for (int i = n; i >= 1; --i) v.push_back(i);  // unsorted on purpose
  return v;
}

TEST(Percentile, IsTheNearestRank) {
  EXPECT_EQ(Percentile(OneTo(100), 0.5), 50);
  EXPECT_EQ(Percentile(OneTo(100), 0.99), 99);
  EXPECT_EQ(Percentile(OneTo(200), 0.5), 100);
  EXPECT_EQ(Percentile(OneTo(200), 0.99), 198);
  EXPECT_EQ(Percentile(OneTo(300), 0.99), 297);
  EXPECT_EQ(Percentile(OneTo(101), 0.5), 51);
  EXPECT_EQ(Percentile(OneTo(100), 1.0), 100);
  EXPECT_EQ(Percentile(OneTo(1), 0.5), 1);
  EXPECT_EQ(Percentile(OneTo(3), 0.01), 1);
}

}  // namespace
}  // namespace kvpool::bench
