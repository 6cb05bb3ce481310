// store_internal::CheckFinite, the NaN/Inf screen of every K, V and q that enters the store: it
// screens blocks of 256 values at a time (vectorized), so the first bad element must be found at
// any length, offset and alignment, for each kind of non-finite fp16.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "service/store/kv_store_impl.h"

namespace kvpool::store_internal {
namespace {

std::vector<uint16_t> FiniteHalves(size_t n) {
  std::vector<uint16_t> x(n);
  // Every finite exponent and both signs, including the largest finite value 0x7BFF / 0xFBFF.
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<uint16_t>((i * 40503u) & 0xFBFF);
  return x;
}

TEST(CheckFinite, AcceptsEveryFiniteValue) {
  std::vector<uint16_t> all;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00u) != 0x7C00u) all.push_back(static_cast<uint16_t>(h));
  }
  EXPECT_TRUE(CheckFinite(all.data(), all.size(), "x").ok());
  EXPECT_TRUE(CheckFinite(all.data(), 0, "x").ok());
}

TEST(CheckFinite, ReportsTheFirstNonFiniteAtAnyLengthAndOffset) {
  const uint16_t bad_values[] = {0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01};  // +-Inf, NaNs
  for (size_t n : {1u, 3u, 4u, 5u, 255u, 256u, 257u, 1000u}) {
    for (size_t offset : {0u, 1u, 2u, 3u}) {
      const std::vector<uint16_t> finite = FiniteHalves(n + offset);
      std::vector<uint16_t> x = finite;
      const uint16_t* data = x.data() + offset;
      ASSERT_TRUE(CheckFinite(data, n, "x").ok()) << n << " " << offset;
      for (size_t pos : {size_t{0}, n / 2, n - 1}) {
        for (uint16_t bad : bad_values) {
          x[offset + pos] = bad;
          if (pos + 1 < n) x[offset + n - 1] = 0x7C00;  // a later one must not be reported
          const absl::Status s = CheckFinite(data, n, "x");
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

}  // namespace
}  // namespace kvpool::store_internal
