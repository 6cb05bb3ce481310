#include "kernels/fp16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

TEST(Fp16, EveryHalfRoundTripsBitExact) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = HalfToFloat(h);
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_EQ(FloatToHalf(f) & 0x7C00u, 0x7C00u);
      EXPECT_NE(FloatToHalf(f) & 0x3FFu, 0u);
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

TEST(Fp16, DecodesKnownValues) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

// Midpoints between neighbouring halves (exact in float) round to the even one; the floats just
// beside a midpoint round towards their side. Covers subnormals, normals and the carry into the
// exponent.
TEST(Fp16, RoundsTiesToEvenAcrossTheWholeRange) {
  for (uint16_t h = 0; h < 0x7BFF; ++h) {
    const float lo = HalfToFloat(h);
    const float hi = HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = (lo + hi) / 2;  // exact: 12 significant bits
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const uint16_t even = (h % 2 == 0) ? h : static_cast<uint16_t>(h + 1);
    EXPECT_EQ(FloatToHalf(mid), even) << std::hex << h;
    EXPECT_EQ(FloatToHalf(-mid), even | 0x8000) << std::hex << h;
    EXPECT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    EXPECT_EQ(FloatToHalf(std::nextafter(mid, 1e9f)), h + 1) << std::hex << h;
  }
}

TEST(Fp16, OverflowsToInfinityAndUnderflowsToZero) {
  EXPECT_EQ(FloatToHalf(65519.99f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie between 65504 and 2^16 goes to even (inf)
  EXPECT_EQ(FloatToHalf(1e10f), 0x7C00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie with 2^-24 goes to even (0)
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(-1e-30f), 0x8000);
  EXPECT_GT(FloatToHalf(std::nanf("")) & 0x7FFFu, 0x7C00u);  // a NaN: all-ones exponent, payload
}

TEST(Fp16, ArrayConversionMatchesFloatToHalfBitForBit) {
  // Random bit patterns cover every exponent (normals, subnormals, ties, overflow), plus the
  // specials; a NaN inside a block of 8 takes the scalar path.
  std::mt19937 rng(7);
  std::vector<float> in(1 << 16);
  for (float& x : in) {
    const uint32_t bits = rng();
    std::memcpy(&x, &bits, sizeof(x));
  }
  const float specials[] = {0.0f, -0.0f, 65520.0f, 65519.99f, std::ldexp(1.0f, -25),
                            std::numeric_limits<float>::infinity(), std::nanf("")};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) in[100 + 3 * i] = specials[i];
  std::vector<uint16_t> out(in.size() - 3);  // a length that is not a multiple of 8
  FloatsToHalves(in.data(), out.data(), out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], FloatToHalf(in[i])) << "value " << in[i] << " at " << i;
  }
}

TEST(Fp16, ArrayDecodingMatchesHalfToFloatBitForBit) {
  // Every half (subnormals, infinities, quiet and signaling NaNs among them), then a length that
  // is not a multiple of 8 from an odd start.
  std::vector<uint16_t> in(1 << 16);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(in.size());
  HalvesToFloats(in.data(), out.data(), out.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const float want = HalfToFloat(in[i]);
    ASSERT_EQ(std::memcmp(&out[i], &want, sizeof(want)), 0) << "half 0x" << std::hex << in[i];
  }
  std::vector<float> tail(in.size() - 13);
  HalvesToFloats(in.data() + 3, tail.data(), tail.size());
  for (size_t i = 0; i < tail.size(); ++i) {
    const float want = HalfToFloat(in[i + 3]);
    ASSERT_EQ(std::memcmp(&tail[i], &want, sizeof(want)), 0) << "half 0x" << std::hex << in[i + 3];
  }
}

TEST(Fp8E4M3, EveryCodeRoundTripsAndNaNIsOnlyS1111111) {
  for (int i = 0; i < 256; ++i) {
    const uint8_t v = static_cast<uint8_t>(i);
    const float f = Fp8E4M3ToFloat(v);
    if ((v & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f)) << i;
      continue;
    }
    EXPECT_TRUE(std::isfinite(f)) << i;
    EXPECT_EQ(FloatToFp8E4M3(f), v) << i;
  }
}

TEST(Fp8E4M3, DecodesKnownValues) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(Fp8E4M3ToFloat(0x3F), 1.875f);
}

TEST(Fp8E4M3, RoundsTiesToEven) {
  for (int i = 0; i < 0x7E; ++i) {
    const float lo = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
    const float hi = Fp8E4M3ToFloat(static_cast<uint8_t>(i + 1));
    const float mid = (lo + hi) / 2;
    const int even = (i % 2 == 0) ? i : i + 1;
    EXPECT_EQ(FloatToFp8E4M3(mid), even) << i;
    EXPECT_EQ(FloatToFp8E4M3(-mid), even | 0x80) << i;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(mid, 0.0f)), i) << i;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(mid, 1e9f)), i + 1) << i;
  }
}

TEST(Fp8E4M3, SaturatesToMaxFiniteAndMapsNaNTo7F) {
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(1e6f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-1e6f), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::nanf("")), 0x7F);
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie with 2^-9 goes to even (0)
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 units of 2^-9 goes to 2
}

}  // namespace
}  // namespace kvpool
