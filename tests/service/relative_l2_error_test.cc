// store_internal::RelativeL2Error, the quality sample's error (the Put path's
// kvpool_quantization_relative_error): blocks of 1,024 values are summed in eight independent
// double sums, the rest one by one, so every length must give the plain double sum's result.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "service/store/kv_store_impl.h"

namespace kvpool::store_internal {
namespace {

// ||a - x|| / ||x|| (or ||a|| when x is all zeros) by one long double sum per term.
double DirectRelativeL2Error(const std::vector<uint16_t>& a, const std::vector<uint16_t>& x) {
  long double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const long double e = HalfToFloat(x[i]);
    const long double d = HalfToFloat(a[i]) - e;
    err += d * d;
    norm += e * e;
  }
  return static_cast<double>(norm > 0 ? std::sqrt(err / norm) : std::sqrt(err));
}

TEST(RelativeL2Error, MatchesADirectSumAtEveryLength) {
  std::mt19937_64 rng(71);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t n : {size_t{1}, size_t{7}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{3000},
                   size_t{32768}, size_t{32773}}) {
    std::vector<float> exact(n), approx(n);
    for (size_t i = 0; i < n; ++i) {
      exact[i] = normal(rng) * (i % 128 < 3 ? 40.f : 1.f);  // outlier channels
      approx[i] = exact[i] + 0.05f * normal(rng);
    }
    std::vector<uint16_t> x(n), a(n);
    FloatsToHalves(exact.data(), x.data(), n);
    FloatsToHalves(approx.data(), a.data(), n);
    const double want = DirectRelativeL2Error(a, x);
    ASSERT_GT(want, 0.0);
    EXPECT_NEAR(RelativeL2Error(a, x), want, 1e-12 * want) << n;
    EXPECT_EQ(RelativeL2Error(x, x), 0.0) << n;
  }
}

TEST(RelativeL2Error, IsTheAbsoluteErrorAgainstZeros) {
  const std::vector<uint16_t> zeros(2050, 0);
  std::vector<uint16_t> a(zeros.size(), FloatToHalf(0.5f));
  a[2049] = FloatToHalf(-3.0f);
  EXPECT_NEAR(RelativeL2Error(a, zeros), std::sqrt(2049 * 0.25 + 9.0), 1e-12);
  EXPECT_EQ(RelativeL2Error({}, {}), 0.0);
}

}  // namespace
}  // namespace kvpool::store_internal
