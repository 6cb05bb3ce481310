#include "kernels/fp16.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvpool {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Rounds a small non-negative float to the nearest integer, ties to even (the default rounding
// mode, which the library never changes).
uint32_t RoundToEvenInt(float a) { return static_cast<uint32_t>(std::nearbyint(a)); }

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(FloatBits(mag) | sign);
  }
  if (exp == 0x1F) return BitsFloat(sign | 0x7F800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7FFF;  // canonical NaN, as __float2half_rn
  if (abs >= 0x38800000u) {
    // Normal range of half (>= 2^-14): re-bias the exponent by 112 and round the 23-bit mantissa
    // to 10 bits, ties to even; a carry moves into the exponent, overflow saturates to inf.
    const uint32_t rebased = abs - 0x38000000u;
    const uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
    const uint32_t h = rounded >> 13;
    return static_cast<uint16_t>(sign | (h >= 0x7C00u ? 0x7C00u : h));
  }
  // Subnormal range: the value in units of 2^-24, rounded to even; 1024 is the smallest normal.
  const float units = BitsFloat(abs) * 16777216.0f;
  return static_cast<uint16_t>(sign | RoundToEvenInt(units));
}

#if defined(__x86_64__)
namespace {

bool HasF16c() {
  static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return f16c;
}

// 8 values per vcvtps2ph (round to nearest even, the IEEE conversion FloatToHalf implements);
// a block holding a NaN goes through FloatToHalf for its canonical NaN.
__attribute__((target("avx,f16c"))) void FloatsToHalvesF16c(const float* in, uint16_t* out,
                                                            size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      for (size_t j = i; j < i + 8; ++j) out[j] = FloatToHalf(in[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

// 8 values per vcvtph2ps (exact); a block holding an Inf or NaN goes through HalfToFloat, which
// keeps a signaling NaN's payload as it is (vcvtph2ps would quiet it).
__attribute__((target("avx,f16c"))) void HalvesToFloatsF16c(const uint16_t* in, float* out,
                                                            size_t n) {
  const __m128i exponent = _mm_set1_epi16(0x7C00);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent)) != 0) {
      for (size_t j = i; j < i + 8; ++j) out[j] = HalfToFloat(in[j]);
      continue;
    }
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

}  // namespace
#endif

void HalvesToFloats(const uint16_t* in, float* out, size_t n) {
#if defined(__x86_64__)
  if (HasF16c()) {
    HalvesToFloatsF16c(in, out, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

void FloatsToHalves(const float* in, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  if (HasF16c()) {
    FloatsToHalvesF16c(in, out, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

float Fp8E4M3ToFloat(uint8_t v) {
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xF;
  const int mant = v & 0x7;
  if (exp == 0xF && mant == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

uint8_t FloatToFp8E4M3(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7F;
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const float a = BitsFloat(abs);
  if (a >= 448.0f) return sign | 0x7E;  // saturate (__NV_SATFINITE), infinities included
  if (abs < 0x3C800000u) {
    // Below 2^-6: subnormal codes in units of 2^-9, rounded to even; 8 is the smallest normal.
    return static_cast<uint8_t>(sign | RoundToEvenInt(a * 512.0f));
  }
  // Normal: re-bias the exponent (127 -> 7) and round the mantissa to 3 bits, ties to even. A
  // value below 448 never rounds past 448 (0x7E).
  const uint32_t rebased = abs - (120u << 23);
  const uint32_t rounded = rebased + 0x7FFFFu + ((rebased >> 20) & 1u);
  return static_cast<uint8_t>(sign | (rounded >> 20));
}

}  // namespace kvpool
