// The quantize kernel's block-diagonal Walsh-Hadamard on tensor cores, over rows spread as 32
// consecutive channels per lane: lane `chunk` of a row's kHeadDim / 32 aligned consecutive lanes
// of the warp holds channels [32 chunk, 32 chunk + 32) as 16 raw fp16 half2 words (word j =
// channels 2j, 2j + 1).
//
// H_kRot is the Kronecker product of H_2 over the channel bits below log2(kRot), so its factors
// may run in any order. The lane's words are read as 4 tiles (channel bits 2 and 3) of one
// m16n8k16 A fragment each, with index bits
//   k (column, transformed): bit 0 = channel bit 0 (the half of a word), bits 1-2 = lane % 4,
//                            bit 3 = channel bit 1;
//   m (row, kept):           bits 0-2 = lane / 4, bit 3 = channel bit 4.
// lane % 4 is channel bits 5-6 of the row (head_dim >= 128), or channel bit 5 and the row's parity
// in the warp (head_dim 64). D = A . B, where B is the Kronecker product over the four k bits of
// H_2 for a transform bit and I_2 for the others (entries 0 and +-1), with fp16 inputs (the
// sign-flipped raw values: exact products) and fp32 accumulation: two m16n8k16 per tile (n = 0..7
// and 8..15), whose fp32 outputs sit in the lane at the places of their inputs. The remaining
// transform bits (channel bits 2, 3, and 4 when kRot >= 32) follow as fp32 butterflies in
// registers. No shuffles; all 32 lanes of the warp must call it.
#ifndef KVPOOL_KERNELS_CUDA_HADAMARD_MMA_CUH_
#define KVPOOL_KERNELS_CUDA_HADAMARD_MMA_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace kvpool::cuda {

// The B fragments of the k-bit Kronecker product for kRot (16..128): b[2h], b[2h + 1] are the
// fragment of output columns 8h..8h+7. Computed once per thread.
template <int kRot>
__device__ __forceinline__ void HadamardMmaFragments(uint32_t (&b)[4]) {
  static_assert(kRot >= 16 && kRot <= 128 && (kRot & (kRot - 1)) == 0, "rot block");
  // k bits that are transform bits: channel bits 0 and 1 always, lane bit 0 (channel bit 5) from
  // kRot 64, lane bit 1 (channel bit 6; the row parity for head_dim 64, where kRot <= 64) at 128.
  constexpr uint32_t kTransformBits = 0b1001u | (kRot >= 64 ? 0b0010u : 0u) |
                                      (kRot >= 128 ? 0b0100u : 0u);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t g = lane / 4, q = lane % 4;
  auto entry = [](uint32_t k, uint32_t n) -> uint32_t {
    if (((k ^ n) & ~kTransformBits & 15u) != 0) return 0u;                 // I_2 off-diagonal
    return (__popc(k & n & kTransformBits) & 1) != 0 ? 0xbc00u : 0x3c00u;  // -1 or +1 in fp16
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t n = g + 8 * h;
    b[2 * h] = entry(2 * q, n) | (entry(2 * q + 1, n) << 16);
    b[2 * h + 1] = entry(2 * q + 8, n) | (entry(2 * q + 9, n) << 16);
  }
}

// x = the un-normalized block Hadamard (no 1/sqrt(kRot); the caller applies it) of the lane's
// 32 channels whose raw fp16 words (sign flip already applied) are `raw` (word j = raw[j / 4]'s
// component j % 4), with `b` from HadamardMmaFragments<kRot>. With kSkipLast the last butterfly
// stage is left to the caller: x[i] and x[i + HadamardLastStride(kRot)] (i without that bit) then
// hold a and c, whose transform outputs are a + c and a - c.
constexpr int HadamardLastStride(int rot) { return (rot < 32 ? rot : 32) / 2; }
template <int kRot, bool kSkipLast = false>
__device__ __forceinline__ void HadamardMma32PerLane(const uint4 (&raw)[4], const uint32_t (&b)[4],
                                                     float (&x)[32]) {
  uint32_t w[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[4 * i] = raw[i].x;
    w[4 * i + 1] = raw[i].y;
    w[4 * i + 2] = raw[i].z;
    w[4 * i + 3] = raw[i].w;
  }
  // Tile t holds words j = k3 + 2 t + 8 m3 (k3 = channel bit 1, m3 = channel bit 4); output half
  // h is k3 = h.
#pragma unroll
  for (int t = 0; t < 4; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float d[4];
      constexpr float kZeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      Mma16816From(d, make_uint4(w[2 * t], w[2 * t + 8], w[2 * t + 1], w[2 * t + 9]), b[2 * h],
                   b[2 * h + 1], kZeros);
      const int j = h + 2 * t;
      x[2 * j] = d[0];
      x[2 * j + 1] = d[1];
      x[2 * j + 16] = d[2];
      x[2 * j + 17] = d[3];
    }
  }
  constexpr int kLast = HadamardLastStride(kRot);
#pragma unroll
  for (int s = 4; s < (kSkipLast ? kLast : 2 * kLast); s <<= 1) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if ((i & s) == 0) {
        const float a = x[i], c = x[i + s];
        x[i] = a + c;
        x[i + s] = a - c;
      }
    }
  }
}

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_HADAMARD_MMA_CUH_
