// store_internal::CheckHalfRange, the screen of every K, V and q that enters the store (NaN, Inf,
// and for K and V magnitudes a layer's rotation would carry past fp16): it screens blocks of 256
// values at a time (vectorized), so the first bad element must be found at any length, offset
// and alignment, for each kind of bad value.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/page_layout.h"
#include "service/store/kv_store_impl.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::store_internal {
namespace {

std::vector<uint16_t> FiniteHalves(size_t n) {
  std::vector<uint16_t> x(n);
  // Every finite exponent and both signs, including the largest finite value 0x7BFF / 0xFBFF.
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<uint16_t>((i * 40503u) & 0xFBFF);
  return x;
}

TEST(CheckHalfRange, AcceptsEveryFiniteValue) {
  std::vector<uint16_t> all;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00u) != 0x7C00u) all.push_back(static_cast<uint16_t>(h));
  }
  EXPECT_TRUE(CheckHalfRange(all.data(), all.size(), kHalfMaxFiniteBits, "x").ok());
  EXPECT_TRUE(CheckHalfRange(all.data(), 0, kHalfMaxFiniteBits, "x").ok());
}

TEST(CheckHalfRange, ReportsTheFirstNonFiniteAtAnyLengthAndOffset) {
  const uint16_t bad_values[] = {0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01};  // +-Inf, NaNs
  for (size_t n : {1u, 3u, 4u, 5u, 255u, 256u, 257u, 1000u}) {
    for (size_t offset : {0u, 1u, 2u, 3u}) {
      const std::vector<uint16_t> finite = FiniteHalves(n + offset);
      std::vector<uint16_t> x = finite;
      const uint16_t* data = x.data() + offset;
      ASSERT_TRUE(CheckHalfRange(data, n, kHalfMaxFiniteBits, "x").ok()) << n << " " << offset;
      for (size_t pos : {size_t{0}, n / 2, n - 1}) {
        for (uint16_t bad : bad_values) {
          x[offset + pos] = bad;
          if (pos + 1 < n) x[offset + n - 1] = 0x7C00;  // a later one must not be reported
          const absl::Status s = CheckHalfRange(data, n, kHalfMaxFiniteBits, "x");
          ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n << " " << pos;
          EXPECT_NE(std::string(s.message()).find("element " + std::to_string(pos)),
                    std::string::npos)
              << s.message();
          std::copy(finite.begin(), finite.end(), x.begin());
        }
      }
    }
  }
}

// With a rotation's bound, the first value past it is named, finite or not, and the bound itself
// passes: rot_block 16 keeps 16376 (65504 / 4), and a block of sixteen 16376s rotates to at most
// 65504.
TEST(CheckHalfRange, NamesTheFirstValuePastARotationsBound) {
  PageLayout l = testing::MakeLayout(KvDtype::kInt4, 16, 64);
  const uint16_t bound = MaxInputHalfBits(l);
  EXPECT_EQ(HalfToFloat(bound), 16376.0f);
  l.rot_block = 128;
  EXPECT_LE(HalfToFloat(MaxInputHalfBits(l)), 65504.0f / std::sqrt(128.0f));
  EXPECT_GT(HalfToFloat(MaxInputHalfBits(l) + 1), 65504.0f / std::sqrt(128.0f));
  l.rot_block = 0;
  EXPECT_EQ(HalfToFloat(MaxInputHalfBits(l)), 65440.0f);  // headroom for the scale's rounding
  EXPECT_EQ(MaxInputHalfBits(testing::MakeLayout(KvDtype::kFp16, 0, 64)), kHalfMaxFiniteBits);
  // Queries: the rotation's gain times sm_scale log2(e) (fp16 steps of 8 between 8192 and 16384).
  EXPECT_EQ(MaxQueryHalfBits(l, 0.1f), kHalfMaxFiniteBits);
  EXPECT_EQ(MaxQueryHalfBits(l, 0.0f), kHalfMaxFiniteBits);
  EXPECT_EQ(MaxQueryHalfBits(l, 1e30f), 0);  // only zeros pass
  l.rot_block = 16;
  EXPECT_EQ(HalfToFloat(MaxQueryHalfBits(l, 1.0f)), 11344.0f);  // 65504 / (4 x 1.4427) = 11350.8

  for (size_t n : {5u, 256u, 300u}) {
    std::vector<uint16_t> x = FiniteHalves(n);
    for (uint16_t& h : x) h = std::min<uint16_t>(h & 0x7FFF, bound) | (h & 0x8000);
    EXPECT_TRUE(CheckHalfRange(x.data(), n, bound, "k").ok());
    x[n - 1] = FloatToHalf(-16384.0f);
    x[n / 2] = FloatToHalf(16384.0f);
    const absl::Status s = CheckHalfRange(x.data(), n, bound, "k");
    ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(
        std::string(s.message())
            .find("k holds NaN, Inf or a magnitude over 16376 at element " + std::to_string(n / 2)),
        std::string::npos)
        << s.message();
    EXPECT_TRUE(CheckHalfRange(x.data(), n, kHalfMaxFiniteBits, "k").ok());
  }
}

}  // namespace
}  // namespace kvpool::store_internal
