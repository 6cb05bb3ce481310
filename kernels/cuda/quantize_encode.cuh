// The per-lane encode math of the fused quantize-append kernel (quantize_append.cu): the group
// meta ({scale, zero} and the quantizer's constants, as kernels/cpu/page_codec.h defines them),
// the lane's min / max across its group, and the codes of a lane's 32 channels, packed as stored.
#ifndef KVPOOL_KERNELS_CUDA_QUANTIZE_ENCODE_CUH_
#define KVPOOL_KERNELS_CUDA_QUANTIZE_ENCODE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/page_codec.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/page_layout.h"

namespace kvpool::cuda {
namespace quantize_internal {

// a / b, correctly rounded like IEEE division, from r = RN(1 / b): one fma correction of the
// product a * r (Markstein's theorem; holds for the normal, finite operands seen here).
__device__ __forceinline__ float DivWithReciprocal(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  const float rem = __fmaf_rn(-q, b, a);
  return __fmaf_rn(rem, r, q);
}

// RN(1 / s) for s > 0 an fp16 value, as __frcp_rn(s), without the subroutine call that rcp.rn
// compiles to for inputs it cannot take on its fast path (which never happen here): at the
// 128-register cap the call's register convention made ptxas spill. y = rcp.approx(s) is within
// 1 ulp of 1 / s (PTX ISA), so e = 1 - s y is exact and y + y e = (1 / s)(1 - e^2) is within
// 2^-46 of 1 / s (relative); every rounding midpoint M (25 significant bits) is farther, since
// for s of 11 significant bits 1 - s M is a nonzero multiple of a power of two above 2^-36: one
// rounding of it gives RN(1 / s).
__device__ __forceinline__ float ReciprocalOfHalf(float s) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(s));
  return __fmaf_rn(y, __fmaf_rn(-s, y, 1.0f), y);
}

// Max (and min when kWithMin) over aligned groups of `lanes` lanes (a power of two <= kLanes,
// the same in every lane of the warp, so the early exit is uniform).
template <int kLanes, bool kWithMin>
__device__ __forceinline__ void GroupMinMax(int lanes, float& mn, float& mx) {
#pragma unroll
  for (int m = 1; m < kLanes; m <<= 1) {
    if (m >= lanes) break;
    if constexpr (kWithMin) mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, m));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
  }
}

// 1.5 * 2^23: for |q| < 2^22, q + kRoundMagic rounds q to an integer (ties to even, like
// nearbyintf) held in the low mantissa bits; the low byte of the sum's bits is the INT8 code
// plus kCodeOffset (mod 256).
constexpr float kRoundMagic = 12582912.0f;
constexpr float kCodeOffset = cpu::kCodeOffset;
static_assert(kCodeOffset == 128.0f, "INT4 rounds through bf16, INT8 flips the codes' top bit");

// {scale, zero} of one group (kernels/cpu/page_codec.h) and the quantizer's constants:
// r = RN(1 / s) (0 when s == 0, which makes every INT code 0), b = RN(kCodeOffset - z * r)
// (integer dtypes; FP8 uses r alone), and the stored word (scale in the low half).
struct GroupMeta {
  float r, b;
  uint32_t word;
};

// mn, mx: the group's min and max of x' (FP8: mx = max |x'|, mn unused).
template <KvDtype kDtype>
__device__ __forceinline__ GroupMeta MakeGroupMeta(float mn, float mx) {
  GroupMeta m;
  float s, z = 0.0f;
  const auto to_half = [](float f) { return FloatToHalfBits(f); };
  if constexpr (kDtype == KvDtype::kFp8E4M3) {
    const uint16_t scale_h = cpu::ScaleBits(DivWithReciprocal(mx, 448.0f, 1.0f / 448.0f), to_half);
    s = HalfBitsToFloat(scale_h);
    m.word = scale_h;
  } else {
    constexpr float kLevels = kDtype == KvDtype::kInt4 ? 15.0f : 255.0f;
    const uint16_t scale_h =
        cpu::ScaleBits(DivWithReciprocal(__fsub_rn(mx, mn), kLevels, 1.0f / kLevels), to_half);
    const uint16_t zero_h = FloatToHalfBits(__fadd_rn(mn, 0.0f));  // -0 as +0, as the CPU
    s = HalfBitsToFloat(scale_h);
    z = HalfBitsToFloat(zero_h);
    m.word = static_cast<uint32_t>(scale_h) | (static_cast<uint32_t>(zero_h) << 16);
  }
  m.r = s > 0.0f ? ReciprocalOfHalf(s) : 0.0f;
  m.b = kDtype == KvDtype::kFp8E4M3 ? 0.0f : __fmaf_rn(-z, m.r, kCodeOffset);
  return m;
}

// Packs the low bytes of four words (code bits) into one: byte j from w[j].
__device__ __forceinline__ uint32_t PackLowBytes(uint32_t w0, uint32_t w1, uint32_t w2,
                                                 uint32_t w3) {
  return __byte_perm(__byte_perm(w0, w1, 0x0040), __byte_perm(w2, w3, 0x0040), 0x5410);
}

// Quantizes the 32 channels x of one lane, channels [8j, 8j + 8) with the meta m[j] (m[0] for all
// when kOneMeta), and returns their packed codes as stored (INT4: 4 words, INT8 / FP8: 8 words).
// `x_scale` is the factor between x and x' (the Hadamard normalization when x holds bare
// butterflies, else 1): the code of x' is computed as fma(x, r * x_scale, b); x_mn / x_mx bound x
// over each j. kPairStride > 0 (integer dtypes, kOneMeta): x holds the Hadamard's last butterfly
// stage undone (HadamardMma32PerLane<kRot, true>), pairs a = x[i], c = x[i + kPairStride]; the
// codes of a + c and a - c are then fma(+-c, r, fma(a, r, b)), 3 fma per pair instead of 2 adds
// and 2 fma. Every lane of the warp must call it (the clamp decision is warp-uniform).
template <KvDtype kDtype, bool kOneMeta, int kPairStride = 0>
__device__ __forceinline__ void EncodeLane(const float (&x)[32], const GroupMeta (&m)[4],
                                           const float (&x_mn)[4], const float (&x_mx)[4],
                                           float x_scale, uint32_t (&out)[8]) {
  constexpr int kMetas = kOneMeta ? 1 : 4;
  auto meta = [](int i) { return kOneMeta ? 0 : i / 8; };  // meta of channel i
  float r[kMetas];
#pragma unroll
  for (int j = 0; j < kMetas; ++j) r[j] = x_scale == 1.0f ? m[j].r : __fmul_rn(m[j].r, x_scale);
  if constexpr (kDtype == KvDtype::kFp8E4M3) {
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const int j = meta(4 * w);
      uint32_t pair[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * w + 2 * h;
        pair[h] =
            __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(x[i], r[j]), __fmul_rn(x[i + 1], r[j])),
                                     __NV_SATFINITE, __NV_E4M3);
      }
      // s == 0: code 0 (x * 0 may be -0, whose e4m3 code is 0x80).
      out[w] = m[j].r > 0.0f ? __byte_perm(pair[0], pair[1], 0x5410) : 0u;
    }
  } else {
    static_assert(kPairStride == 0 || kOneMeta, "pairs share their meta");
    constexpr float kTop = kCodeOffset + (kDtype == KvDtype::kInt4 ? 15.0f : 255.0f);
    // q = fma(x, r, b) = code + kCodeOffset before rounding (within a few ulp of it with pairs).
    // It is monotonic in x, so each group's min and max bound its q: clamping is needed only
    // when they round outside [kCodeOffset, kTop] (fp16 rounding of s and z), which is rare: the
    // clamp runs only when some lane of the warp needs it. From kCodeOffset - 0.25 up both
    // roundings below (bf16, whose step is 0.5 below 128, and the magic number) reach
    // kCodeOffset, and up to kTop + 0.5 they stay below kTop + 1: the bounds keep 1/8 from those
    // (for the pairs' roundings). A bound at kCodeOffset itself would send the groups whose zero
    // rounded up (half of them) to the clamp.
    bool clamp = false;
#pragma unroll
    for (int j = 0; j < kMetas; ++j) {
      clamp |= __fmaf_rn(x_mn[j], r[j], m[j].b) < kCodeOffset - 0.125f ||
               __fmaf_rn(x_mx[j], r[j], m[j].b) >= kTop + 0.375f;
    }
    float q[32];
    if constexpr (kPairStride > 0) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        if ((i & kPairStride) != 0) continue;
        const float u = __fmaf_rn(x[i], r[0], m[0].b);
        q[i] = __fmaf_rn(x[i + kPairStride], r[0], u);
        q[i + kPairStride] = __fmaf_rn(-x[i + kPairStride], r[0], u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) q[i] = __fmaf_rn(x[i], r[meta(i)], m[meta(i)].b);
    }
    // The clamp is a fix-up between the rounding and the packing, not a second encode path:
    // with both encodes in the kernel the rotated INT4 kernel took 0.366-0.369 ms for 1 GiB
    // against 0.355-0.357 (results/experiments_2026-11-29.md, "Twelfth session").
    clamp = __any_sync(0xffffffffu, clamp);
    if constexpr (kDtype == KvDtype::kInt4) {
      // bf16 steps by 1 on [128, 256): cvt.rn.bf16x2.f32 rounds two q to integers (ties to even,
      // like nearbyintf), bits 0x4300 + code, clamped after the rounding (integral from
      // kCodeOffset up). Word k: channel 2k in the low half, 2k + 1 in the high one.
      __nv_bfloat162 h[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) h[k] = __floats2bfloat162_rn(q[2 * k], q[2 * k + 1]);
      if (clamp) {
        const __nv_bfloat162 lo = __float2bfloat162_rn(kCodeOffset);
        const __nv_bfloat162 hi = __float2bfloat162_rn(kTop);
#pragma unroll
        for (int k = 0; k < 16; ++k) h[k] = __hmax2(__hmin2(h[k], hi), lo);
      }
      auto bits = [&](int k) { return *reinterpret_cast<const uint32_t*>(&h[k]); };
      // Per 8 channels: [c0 c2 c1 c3] and [c4 c6 c5 c7] from the low bytes of the halves, then
      // the even codes plus 16 times the odd ones: byte j = c(2j) | c(2j + 1) << 4.
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t a = __byte_perm(bits(4 * w), bits(4 * w + 1), 0x6240);
        const uint32_t b = __byte_perm(bits(4 * w + 2), bits(4 * w + 3), 0x6240);
        out[w] = __byte_perm(a, b, 0x5410) + __byte_perm(a, b, 0x7632) * 16u;
      }
    } else {
      if (clamp) {
#pragma unroll
        for (int i = 0; i < 32; ++i) q[i] = fminf(fmaxf(q[i], kCodeOffset), kTop);
      }
      uint32_t t[32];  // bits of the rounded code + kCodeOffset + kRoundMagic
#pragma unroll
      for (int i = 0; i < 32; ++i) t[i] = __float_as_uint(__fadd_rn(q[i], kRoundMagic));
      // The low bytes hold code + 128 (mod 256): flipping their top bit leaves the codes.
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        out[w] = PackLowBytes(t[4 * w], t[4 * w + 1], t[4 * w + 2], t[4 * w + 3]) ^ 0x80808080u;
      }
    }
  }
}

}  // namespace quantize_internal
}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_QUANTIZE_ENCODE_CUH_
