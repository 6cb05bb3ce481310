#include "kernels/hadamard.h"

#include <bitset>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"

namespace kvpool {
namespace {

constexpr int kHeadDim = 128;
constexpr uint64_t kSeed = 0x5A1Dull;

std::vector<double> RandomHead(uint64_t seed) {
  const testing::KvData d = testing::MakeKv(1, 1, kHeadDim, testing::Outliers::kOffset, seed);
  return std::vector<double>(d.k.begin(), d.k.end());
}

double Norm(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s);
}

class HadamardBlockTest : public ::testing::TestWithParam<int> {};

TEST_P(HadamardBlockTest, InverseUndoesForwardAndKeepsTheNorm) {
  const BlockHadamard rotation(kHeadDim, GetParam(), kSeed);
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const std::vector<double> x = RandomHead(seed);
    std::vector<double> y = x;
    rotation.Forward(y.data());
    EXPECT_NEAR(Norm(y), Norm(x), 1e-12 * Norm(x));
    double moved = 0;
    for (int c = 0; c < kHeadDim; ++c) moved += std::fabs(y[c] - x[c]);
    EXPECT_GT(moved, 1.0);
    rotation.Inverse(y.data());
    for (int c = 0; c < kHeadDim; ++c) EXPECT_NEAR(y[c], x[c], 1e-12) << c;
  }
}

// Forward equals the explicit matrix: x'_i = sum_j H_B[i][j] s_j x_j within each block, with
// H_B[i][j] = (-1)^popcount(i & j) / sqrt(B).
TEST_P(HadamardBlockTest, ForwardMatchesTheExplicitSignedHadamardMatrix) {
  const int b = GetParam();
  const BlockHadamard rotation(kHeadDim, b, kSeed);
  const std::vector<double> x = RandomHead(7);
  std::vector<double> y = x;
  rotation.Forward(y.data());
  for (int i = 0; i < kHeadDim; ++i) {
    const int base = i / b * b;
    double want = 0;
    for (int j = base; j < base + b; ++j) {
      const double h = (std::bitset<32>((i - base) & (j - base)).count() % 2) ? -1.0 : 1.0;
      want += h * RotationSign(kSeed, j) * x[j];
    }
    EXPECT_NEAR(y[i], want / std::sqrt(static_cast<double>(b)), 1e-12) << i;
  }
}

// An outlier channel spreads evenly over its block and stays inside it.
TEST_P(HadamardBlockTest, SpreadsAnOutlierChannelOverItsBlock) {
  const int b = GetParam();
  const BlockHadamard rotation(kHeadDim, b, kSeed);
  std::vector<double> x(kHeadDim, 0.0);
  const int spike = 37;
  x[spike] = 64.0;
  rotation.Forward(x.data());
  for (int c = 0; c < kHeadDim; ++c) {
    const bool in_block = c / b == spike / b;
    EXPECT_NEAR(std::fabs(x[c]), in_block ? 64.0 / std::sqrt(static_cast<double>(b)) : 0.0, 1e-12)
        << c;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBlockSizes, HadamardBlockTest, ::testing::Values(16, 32, 64, 128));

TEST(BlockHadamard, SeedZeroAppliesNoSigns) {
  const BlockHadamard plain(16, 16, 0);
  std::vector<double> x(16, 0.0);
  x[0] = 4.0;
  plain.Forward(x.data());
  for (double e : x) EXPECT_DOUBLE_EQ(e, 1.0);
}

}  // namespace
}  // namespace kvpool
