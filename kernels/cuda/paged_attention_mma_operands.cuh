// The tensor-core split kernel's operands (paged_attention_mma.cuh): page codes unpacked into
// m16n8k16 fp16 fragments (MmaCodec), the shared-memory stage layout and register budget
// (MmaTraits), and the small device helpers they use.
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_OPERANDS_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_OPERANDS_CUH_

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/kv_kernels.h"

namespace kvpool::cuda {
namespace attention_internal {

inline constexpr int kMmaWarps = kAttnThreads / 32;
inline constexpr int kTileTokens = 16;

__device__ __forceinline__ uint32_t PackHalf2(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) |
         (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}
// 2^x (MUFU.EX2, subnormal results flushed to 0; 2^-inf = 0).
__device__ __forceinline__ float Exp2Ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ uint32_t Fp8PairToHalf2(uint32_t pair16) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair16), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The exponent of the fp16 V scale in the low half of a token's meta word ({scale, zero}), as a
// float in [-15, 16]: 2^e <= scale < 2^(e + 1) for normal scales, e = -15 for subnormal and zero
// ones (scale < 2^(e + 1) still).
__device__ __forceinline__ float VScaleExponent(uint32_t meta) {
  return static_cast<float>(static_cast<int>((meta >> 10) & 0x1Fu) - 15);
}

template <KvDtype kDtype>
struct MmaCodec {
  static constexpr int kBits = DtypeBits(kDtype);
  static constexpr int kUnitBytes = kBits;  // 8 channels
  // Channel (within a unit of 8) of each k-pair element UnpackUnit returns: pair i holds
  // channels kPerm[2i] (low half) and kPerm[2i + 1] (high half).
  __device__ static constexpr int Perm(int i) {
    return kDtype == KvDtype::kInt4 ? (i % 2 == 0 ? i / 2 : 4 + i / 2) : i;
  }
  // Integer codes reach the score MMA as fp16 subnormals, their bits masked in place: pair i
  // holds c 2^-24, except INT4 high nibbles (odd pairs), 16 c 2^-24. With the A weights of pair
  // i multiplied by PairWeight(i), sum_k a_k b_k is the code dot product times 2^-24, which
  // kDotScale undoes. (Codes biased to normal fp16 values, 1024 + c, left the dot product as
  // the small difference of two sums near 1024 sum_k a_k: scores of tokens with large scales,
  // such as outlier tokens, lost up to 8e-3 to the cancellation.)
  static constexpr bool kIntCodes = kDtype == KvDtype::kInt4 || kDtype == KvDtype::kInt8;
  static constexpr float kDotScale = kIntCodes ? 16777216.0f : 1.0f;
  __device__ static constexpr float PairWeight(int pair) {
    return kDtype == KvDtype::kInt4 && pair % 2 == 1 ? 1.0f / 16.0f : 1.0f;
  }
  // The 8 channels of one unit of a page row (its kUnitBytes / 4 words w[0], ...) as 4 half2
  // k-pairs (see Perm); integer codes as subnormals (kDotScale).
  __device__ static void UnpackUnit(const uint32_t* u, uint32_t (&out)[4]) {
    if constexpr (kDtype == KvDtype::kInt4) {
      const uint32_t w = u[0];
      const uint32_t w8 = w >> 8;
      out[0] = w & 0x000F000Fu;
      out[1] = w & 0x00F000F0u;
      out[2] = w8 & 0x000F000Fu;
      out[3] = w8 & 0x00F000F0u;
    } else if constexpr (kDtype == KvDtype::kInt8) {
      // Bytes 0 / 1 (2 / 3) of a word into the low bytes of the two halves, zeros above.
      const uint2 w = make_uint2(u[0], u[1]);
      out[0] = __byte_perm(w.x, 0, 0x4140);
      out[1] = __byte_perm(w.x, 0, 0x4342);
      out[2] = __byte_perm(w.y, 0, 0x4140);
      out[3] = __byte_perm(w.y, 0, 0x4342);
    } else if constexpr (kDtype == KvDtype::kFp8E4M3) {
      const uint2 w = make_uint2(u[0], u[1]);
      out[0] = Fp8PairToHalf2(w.x & 0xFFFFu);
      out[1] = Fp8PairToHalf2(w.x >> 16);
      out[2] = Fp8PairToHalf2(w.y & 0xFFFFu);
      out[3] = Fp8PairToHalf2(w.y >> 16);
    } else {
      const uint4 w = make_uint4(u[0], u[1], u[2], u[3]);
      out[0] = w.x;
      out[1] = w.y;
      out[2] = w.z;
      out[3] = w.w;
    }
  }
  // For each channel c of a 32-bit word of two rows a and b: half2 {code_a[c], code_b[c]}.
  // Channels per word: 32 / kBits; out[i] is the word's i-th channel. Integer codes come as fp16
  // subnormals, the code's bits masked in place: c 2^-24 for INT8 bytes and INT4 low nibbles
  // (even channels), 16 c 2^-24 for INT4 high nibbles (odd channels). Products with fp16 P^T
  // entries are exact in the MMA's fp32 accumulation; ChannelScale(odd) scales the sums back.
  static constexpr int kChPerWord = 32 / kBits;
  __device__ static void PairWord(uint32_t a, uint32_t b, uint32_t (&out)[kChPerWord]) {
    if constexpr (kDtype == KvDtype::kInt4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t x = __byte_perm(a, b, i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12));
        out[2 * i] = x & 0x000F000Fu;
        out[2 * i + 1] = x & 0x00F000F0u;
      }
    } else if constexpr (kDtype == KvDtype::kInt8) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[i] = __byte_perm(a, b, i | ((4 + i) << 8)) & 0x00FF00FFu;
      }
    } else if constexpr (kDtype == KvDtype::kFp8E4M3) {
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const uint32_t x = __byte_perm(a, b, i | ((4 + i) << 4) | ((i + 1) << 8) | ((5 + i) << 12));
        out[i] = Fp8PairToHalf2(x & 0xFFFFu);
        out[i + 1] = Fp8PairToHalf2(x >> 16);
      }
    } else {
      out[0] = __byte_perm(a, b, 0x5410);
      out[1] = __byte_perm(a, b, 0x7632);
    }
  }
  // The factor that turns a value-MMA sum over PairWord channels of parity `odd` into a sum over
  // codes: 2^24 for INT8 and INT4 low nibbles, 2^20 for INT4 high nibbles, 1 for FP8 and FP16.
  __device__ static constexpr float ChannelScale(bool odd) {
    return !kIntCodes ? 1.0f : kDtype == KvDtype::kInt4 && odd ? 1048576.0f : 16777216.0f;
  }
};

// kCtasPerSm: the CTAs per SM the kernel is built for (its register budget and stages).
template <KvDtype kDtype, int kHeadDim, int kCtasPerSm>
struct MmaTraits {
  static constexpr bool kQuantized = kDtype != KvDtype::kFp16;
  static constexpr int kCodeBytes = kHeadDim * DtypeBits(kDtype) / 8;
  static constexpr int kCodeChunks = kCodeBytes / 16;
  // The score MMA's B fragments: lane tig of a group reads kKSlice bytes of its K row, as
  // kKChunks chunks of kKChunk bytes, chunk q at byte (4 q + tig) kKChunk; unit i of the lane's
  // (i < kHeadDim / 32, covering slabs 2 i and 2 i + 1) is KUnit(i, tig). Rows are kKStride
  // apart so that the two (four for 8-byte chunks) rows one load instruction serves per pass
  // fall on distinct banks (FP16 keeps 16 bytes of padding, which fits one more stage).
  static constexpr int kKSlice = kCodeBytes / 4;
  static constexpr int kKChunk = kKSlice < 16 ? kKSlice : 16;
  static constexpr int kKChunks = kKSlice / kKChunk;
  static constexpr int kUnitsPerChunk = kKChunk / MmaCodec<kDtype>::kUnitBytes;
  static constexpr int kKStride =
      kCodeBytes <= 64 ? kCodeBytes : kCodeBytes + (kDtype == KvDtype::kFp16 ? 16 : 64);
  __host__ __device__ static constexpr int KUnit(int i, int tig) {
    return (4 * (i / kUnitsPerChunk) + tig) * kUnitsPerChunk + i % kUnitsPerChunk;
  }
  // The value MMA's A fragments read 4 rows (tokens 2 tig, 2 tig + 1, +8) of kCodeBytes / 8
  // bytes each per lane: 16 bytes of padding spread the rows of one load over the banks.
  static constexpr int kVStride = kCodeBytes + 16;
  static constexpr int kMetaBytes = kQuantized ? 4 : 0;  // one {scale, zero} per token
  static constexpr int kVArea = kTileTokens * kKStride;   // V rows start here in a stage
  static constexpr int kMetaArea = kVArea + kTileTokens * kVStride;
  static constexpr int kTileBytes = kMetaArea + 2 * kTileTokens * kMetaBytes;
  static constexpr int kSlabs = kHeadDim / 16;     // k16 slabs of the score MMA
  static constexpr int kMTiles = kHeadDim / 16;    // m16 tiles (channels) of the value MMA
  static constexpr int kVChannels = kHeadDim / 8;  // channels per thread in the value MMA
  static constexpr int kVWords = kVChannels * DtypeBits(kDtype) / 32;
  static constexpr int kH = kAttnMaxHeadsPerCta;
  // Shared memory: per warp kStages tiles; the q' A fragments [kSlabs][32 lanes] uint4; the
  // sums of q' [kH].
  // The end-of-CTA merge reuses the tiles: {m, l, z} [warps][kH] and o [warps][kH][kHeadDim]
  // floats.
  static constexpr int kQBytes = kSlabs * 32 * 16 + kH * 4;
  // Tile stages per warp: as many as fit (at most 8, at least 2: one loading while one is used)
  // when kCtasPerSm CTAs share an SM's 228 KiB of shared memory, 1 KiB of it reserved per CTA.
  static constexpr int kFitStages =
      (228 * 1024 / kCtasPerSm - 1024 - kQBytes) / (kMmaWarps * kTileBytes);
  static constexpr int kStages = kFitStages > 8 ? 8 : kFitStages < 2 ? 2 : kFitStages;
  static constexpr size_t kStageArea = static_cast<size_t>(kMmaWarps) * kStages * kTileBytes;
  // o rows of the merge are padded by four floats per 16 channels (OIndex), and 8 per row: the
  // lanes that store channels 16 apart hit distinct banks, and 4 channels from a multiple of 4
  // load as one 16-byte word.
  static constexpr int kORow = kHeadDim + kHeadDim / 4 + 8;
  __device__ static int OIndex(int row, int channel) {
    return row * kORow + channel + (channel / 16) * 4;
  }
  // A CTA that finishes its rows (AttnSplitArgs::out) also keeps the merged o' [kH][kHeadDim]
  // and {m, l} [kH] there, after the o rows (MergeWarpsIntoSplit).
  static constexpr size_t kMergeBytes =
      (static_cast<size_t>(kMmaWarps) * kH * (kORow + 3) + kH * (kHeadDim + 2)) * 4;
  static constexpr size_t kTilesArea = kStageArea > kMergeBytes ? kStageArea : kMergeBytes;
  static constexpr size_t kSharedBytes = kTilesArea + kQBytes;
};

}  // namespace attention_internal
}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_OPERANDS_CUH_
