// The query side of the tensor-core split kernel (paged_attention_mma.cuh): its CTA's heads of q
// loaded, rotated (q' = H(sign . q), the rotation RotateQueryKernel applies, at the layout's
// block) and split into the hi / lo fp16 operands of the score MMA, and sum(q') per head.
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_QUERY_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_QUERY_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/cuda/paged_attention_mma_operands.cuh"

namespace kvpool::cuda {
namespace attention_internal {

// q's 16-byte loads per thread: kAttnMaxHeadsPerCta rows of kHeadDim fp16, LaneVector lanes per
// row.
template <int kHeadDim>
inline constexpr int kQueryLoads = kAttnMaxHeadsPerCta > LaneVector<kHeadDim>::kVecs
                                       ? kAttnMaxHeadsPerCta / LaneVector<kHeadDim>::kVecs
                                       : 1;

// This thread's share of the CTA's nh heads of q, from row head_row (zeros past nh).
template <int kHeadDim>
__device__ __forceinline__ void LoadQuery(const AttnSplitArgs& a, size_t head_row, int nh,
                                          uint4 (&q_raw)[kQueryLoads<kHeadDim>]) {
  using QV = LaneVector<kHeadDim>;
  const int tid = threadIdx.x;
#pragma unroll
  for (int r = 0; r < kQueryLoads<kHeadDim>; ++r) {
    const int h = r * QV::kVecs + tid / QV::kLanes;
    q_raw[r] = h < nh ? *reinterpret_cast<const uint4*>(a.q + (head_row + h) * kHeadDim +
                                                        (tid % QV::kLanes) * 8)
                      : make_uint4(0, 0, 0, 0);
  }
}

// Every thread of the CTA calls it with its q_raw. q' is staged as fp32 [kH][kHeadDim] where the
// fragments will go (the same bytes); issue_first() runs once q has arrived (the first tiles'
// copies: every CTA's first copies at once, 6.7 MB at 1 x 32K, delayed q, which the whole
// prologue waits for (Nsight Compute), while the copies' latency still overlaps the fragments
// built here). Then, both times score_scale (the MMA yields scores in the log2 domain):
//  * qfrag, the score MMA's q' operands per k16 slab and lane: with kPT == 2 the A fragments of
//    Q' (rows g: hi parts of head g, rows g + 8: its lo parts) as qfrag[slab][32]; with
//    kPT == 1 the B fragments of Q'^T (column g: the hi parts of head g / 2 for even g, the lo
//    parts for odd g), slabs 2 c and 2 c + 1 in one uint4 qfrag[c][32];
//  * qsum_s[h] = sum(q') of head h (kSumLanes lanes per head).
// Returns after a CTA barrier, with both in shared memory.
template <KvDtype kDtype, int kHeadDim, int kPT, int kCtasPerSm, typename IssueFirst>
__device__ __forceinline__ void StageQueryFragments(const uint4 (&q_raw)[kQueryLoads<kHeadDim>],
                                                    int nh, const AttnSplitArgs& a, uint4* qfrag,
                                                    float* qsum_s, IssueFirst&& issue_first) {
  using T = MmaTraits<kDtype, kHeadDim, kCtasPerSm>;
  using C = MmaCodec<kDtype>;
  using QV = LaneVector<kHeadDim>;
  constexpr int kH = T::kH;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  float* q_stage = reinterpret_cast<float*>(qfrag);
  static_assert(kH * kHeadDim * 4 == T::kSlabs * 32 * 16, "q' fills the fragment area");
  {
    const int chunk = tid % QV::kLanes;
#pragma unroll
    for (int r = 0; r < kQueryLoads<kHeadDim>; ++r) {
      // A warp whose heads all lie past nh stages nothing (warp-uniform: the rotation shuffles
      // across the whole warp); the fragments below read only heads below nh.
      if (r * QV::kVecs + warp * (32 / QV::kLanes) >= nh) continue;
      const int h = r * QV::kVecs + tid / QV::kLanes;
      float x[8];
      UnpackHalf8(q_raw[r], x);
      if (a.rot_block > 0) {
        ApplySigns8(SignByte(a.signs, chunk), x);
        Hadamard8PerLane(x, chunk, a.rot_block);
      }
      if (h < kH) {
        float4* dst = reinterpret_cast<float4*>(q_stage + h * kHeadDim + chunk * 8);
        dst[0] = make_float4(x[0], x[1], x[2], x[3]);
        dst[1] = make_float4(x[4], x[5], x[6], x[7]);
      }
    }
  }
  issue_first();
  __syncthreads();
  constexpr int kFragsPerThread = T::kSlabs * 32 / kAttnThreads;
  uint4 frag[kFragsPerThread];
#pragma unroll
  for (int f = 0; f < kFragsPerThread; ++f) {
    const int i = tid + f * kAttnThreads;
    const int slab = i / 32, fl = i % 32, ft = fl % 4;
    const int fh = kPT == 1 ? fl / 8 : fl / 4;  // the head of A rows / B column fl / 4
    // Slab `slab` = the lane's unit slab / 2, half slab % 2 of its k-pairs.
    const int unit_base = 8 * T::KUnit(slab / 2, ft);
    const int pair0 = 2 * (slab % 2);  // k = 2 ft, 2 ft + 1 -> pair pair0; k + 8 -> pair0 + 1
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = fh < nh ? q_stage[fh * kHeadDim + unit_base + C::Perm(2 * pair0 + e)] *
                           (a.score_scale * C::PairWeight(pair0 + e / 2))
                     : 0.0f;
    }
    __half hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[e] = __float2half_rn(x[e]);
      lo[e] = __float2half_rn(x[e] - __half2float(hi[e]));
    }
    if constexpr (kPT == 1) {
      const bool hi_col = (fl / 4) % 2 == 0;
      frag[f] = make_uint4(hi_col ? PackHalf2(hi[0], hi[1]) : PackHalf2(lo[0], lo[1]),
                           hi_col ? PackHalf2(hi[2], hi[3]) : PackHalf2(lo[2], lo[3]), 0, 0);
    } else {
      frag[f] = make_uint4(PackHalf2(hi[0], hi[1]), PackHalf2(lo[0], lo[1]),
                           PackHalf2(hi[2], hi[3]), PackHalf2(lo[2], lo[3]));
    }
  }
  {
    constexpr int kSumLanes = kAttnThreads / kH;
    const int h = tid / kSumLanes;
    float sum = 0.0f;
    if (h < nh) {
#pragma unroll
      for (int c = tid % kSumLanes; c < kHeadDim; c += kSumLanes) sum += q_stage[h * kHeadDim + c];
    }
    sum = GroupSum<kSumLanes>(sum);
    if (tid % kSumLanes == 0) qsum_s[h] = sum * a.score_scale;
  }
  __syncthreads();  // q' read: its bytes take the fragments
#pragma unroll
  for (int f = 0; f < kFragsPerThread; ++f) {
    if constexpr (kPT == 1) {
      const int i = tid + f * kAttnThreads, slab = i / 32;
      reinterpret_cast<uint2*>(qfrag)[((slab / 2) * 32 + i % 32) * 2 + slab % 2] =
          make_uint2(frag[f].x, frag[f].y);
    } else {
      qfrag[tid + f * kAttnThreads] = frag[f];
    }
  }
  __syncthreads();
}

}  // namespace attention_internal
}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_QUERY_CUH_
