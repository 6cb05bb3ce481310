// Reading and writing one (token, head) row of a head page: the per-row math of the CPU reference
// (kernels/page_layout.h describes the bytes). The CUDA kernels must reproduce exactly this:
//
//   INT4 / INT8 (L = 15 / 255), per group of group_size channels of the rotated row x' (float):
//     mn = min x', mx = max x'
//     scale_h = ScaleBits((mx - mn) / L), zero_h = FloatToHalf(mn + 0) (a -0 minimum as +0)
//     s = HalfToFloat(scale_h), z = HalfToFloat(zero_h)
//     r = 1.0f / s (IEEE, once per group), b = fmaf(-z, r, 128)          (kCodeOffset)
//     code = s > 0 ? clamp((int)nearbyintf(fmaf(x', r, b)), 128, 128 + L) - 128 : 0
//   The offset puts q where bf16 has unit steps (INT4: [128, 143]), so that a GPU can round and
//   pack two codes with one cvt.rn.bf16x2.f32; each fma is rounded once, on a 2^-16 grid.
//   FP8 E4M3, per group:
//     scale_h = ScaleBits(max|x'| / 448), zero_h = 0, s = HalfToFloat(scale_h), r = 1.0f / s
//     code = s > 0 ? FloatToFp8E4M3(x' * r) : 0
//   INT4 packing: byte j = code[2j] | code[2j+1] << 4.
//   Decoding: x' = code * s + z in float (FP8: Fp8E4M3ToFloat(code) * s + 0).
#ifndef KVPOOL_KERNELS_CPU_PAGE_CODEC_H_
#define KVPOOL_KERNELS_CPU_PAGE_CODEC_H_

#include <cmath>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvpool::cpu {

// Integer codes are computed as q = code + kCodeOffset (see above).
inline constexpr float kCodeOffset = 128.0f;

// The stored fp16 bits of a group's scale q (finite, >= 0): to_half(q), the conversion to nearest,
// except below fp16's smallest normal (2^-14), where q is rounded up to a multiple of the
// subnormal step 2^-24 (ceil(q 2^24) is its bits; 1024 steps are the smallest normal, 0x0400).
// A scale rounded down there could lose up to half of itself (the top codes clipped, FP8
// saturated), and one rounded to 0 would turn a whole group into its zero point.
template <typename ToHalf>
KVPOOL_HD uint16_t ScaleBits(float q, ToHalf to_half) {
  return q < 0x1p-14f ? static_cast<uint16_t>(ceilf(q * 0x1p24f)) : to_half(q);
}

// Scale and zero of one (token, group), converted from their stored fp16.
struct GroupMeta {
  float scale = 0.0f;
  float zero = 0.0f;
};

// The head page of (block, kv, head) in a layer's pages [num_blocks][layer_page_bytes].
inline const uint8_t* HeadPage(const PageLayout& l, const uint8_t* pages, int64_t block, int kv,
                               int head) {
  return pages + static_cast<size_t>(block) * l.layer_page_bytes() + l.head_page_offset(kv, head);
}
inline uint8_t* HeadPage(const PageLayout& l, uint8_t* pages, int64_t block, int kv, int head) {
  return pages + static_cast<size_t>(block) * l.layer_page_bytes() + l.head_page_offset(kv, head);
}

// Quantizes the rotated row x' [head_dim] into token `token` (< block_tokens) of a head page:
// its codes and its {scale, zero} per group. Requires a quantized layout.
void EncodeQuantizedRow(const PageLayout& l, const float* x, int token, uint8_t* head_page);

// The code values of token `token` [head_dim]: the integer codes for INT4/INT8, the decoded
// e4m3 values for FP8, the fp16 values for FP16.
void UnpackCodes(const PageLayout& l, const uint8_t* head_page, int token, float* codes);

// {scale, zero} of group `group` of token `token`. Requires a quantized layout.
GroupMeta ReadGroupMeta(const PageLayout& l, const uint8_t* head_page, int token, int group);

// The stored row of token `token` [head_dim] as float: x' = code * s + z (rotated space) for
// quantized dtypes, the fp16 values for FP16.
void DecodeRow(const PageLayout& l, const uint8_t* head_page, int token, float* x);

}  // namespace kvpool::cpu

#endif  // KVPOOL_KERNELS_CPU_PAGE_CODEC_H_
