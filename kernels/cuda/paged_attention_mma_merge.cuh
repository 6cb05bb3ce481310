// The end of the tensor-core split kernel (paged_attention_mma.cuh): its four warps' online-
// softmax states merged in shared memory into the split's {m, l} and o', written for the merge
// kernel, or, when the CTA's split is the call's only one and there are no sink tokens
// (AttnSplitArgs::out set), un-rotated, normalized and written as the call's output.
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_MERGE_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_MERGE_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/cuda/paged_attention_mma_operands.cuh"

namespace kvpool::cuda {
namespace attention_internal {

// Every thread of the CTA calls it once its loop is done, with its warp's state: m_run (log2
// domain), l_run and z_run (sum p_t and sum p_t zero_t over this lane's tokens) of head tig
// (kPT == 1) or g (kPT == 2), and acc, the O^T accumulators (rows g / g + 8 channels kVChannels g +
// 2 mt / + 1, columns 2 tig and 2 tig + 1 of P^T tile j). The stage tiles in smem are reused.
// Writes nh heads' o' (channels scaled back, sum p_t zero_t added) and {m, l}, num_splits apart, or
// with a.out or a.out_fp16 set the rows head_row .. head_row + nh - 1 of the output (and of a.lse).
template <KvDtype kDtype, int kHeadDim, int kPT, int kCtasPerSm>
__device__ __forceinline__ void MergeWarpsIntoSplit(
    uint8_t* smem, float (&acc)[MmaTraits<kDtype, kHeadDim, kCtasPerSm>::kMTiles][kPT][4],
    float m_run, float l_run, float z_run, int nh, int num_splits, float* o_out, float2* ml_out,
    const AttnSplitArgs& a, size_t head_row) {
  using T = MmaTraits<kDtype, kHeadDim, kCtasPerSm>;
  using C = MmaCodec<kDtype>;
  constexpr int kH = T::kH;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int tig = lane % 4;
  // Merge the warps: {m, l, z} [warp][head] then o [warp][P^T column][channel] in the freed
  // tiles.
  CpAsyncWait<0>();
  __syncthreads();
  float* ml_s = reinterpret_cast<float*>(smem);  // [kMmaWarps][kH][3]
  float* o_s = ml_s + kMmaWarps * kH * 3;        // [kMmaWarps][8 columns] rows of T::kORow
  float* fin_o = o_s + kMmaWarps * 8 * T::kORow;  // [kH][kHeadDim], when finishing
  float2* fin_ml = reinterpret_cast<float2*>(fin_o + kH * kHeadDim);  // [kH]
  const bool finish = a.out != nullptr || a.out_fp16 != nullptr;
  // Sums over this lane's group of lanes: the 8 of one tig (kPT == 1) or the 4 of one g.
#pragma unroll
  for (int x = kPT == 1 ? 4 : 1; x < (kPT == 1 ? 32 : 4); x <<= 1) {
    l_run += __shfl_xor_sync(0xffffffffu, l_run, x);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, x);
  }
  if (kPT == 1 ? g == 0 : tig == 0) {
    const int h = kPT == 1 ? tig : g;
    ml_s[(warp * kH + h) * 3] = m_run;
    ml_s[(warp * kH + h) * 3 + 1] = l_run;
    ml_s[(warp * kH + h) * 3 + 2] = z_run;
  }
  // Column c of P^T tile j holds head c (kPT == 2: hi / lo parts in tiles 0 / 1, summed here) or
  // head c / 2 (kPT == 1: hi / lo parts in columns 2 h / 2 h + 1, summed below).
  if constexpr (kPT == 2) {
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][0][r] += acc[mt][1][r];
    }
  }
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int column = 2 * tig + r % 2;
      const int channel = T::kVChannels * g + 2 * mt + r / 2;
      o_s[T::OIndex(warp * 8 + column, channel)] = acc[mt][0][r] * C::ChannelScale(r / 2 == 1);
    }
  }
  __syncthreads();
  constexpr int kQuads = kHeadDim / 4;  // each thread merges 4 channels of a head at a time
  for (int i = tid; i < nh * kQuads; i += kAttnThreads) {
    const int h = i / kQuads;
    const int c = (i % kQuads) * 4;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) m = fmaxf(m, ml_s[(w * kH + h) * 3]);
    float l = 0.0f;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) {
      const float* mlz = ml_s + (w * kH + h) * 3;
      if (mlz[0] == -INFINITY) continue;  // a warp without tiles
      const float wgt = exp2f(mlz[0] - m);
      l += wgt * mlz[1];
      float4 v =
          *reinterpret_cast<const float4*>(o_s + T::OIndex(w * 8 + (kPT == 1 ? 2 * h : h), c));
      if constexpr (kPT == 1) {
        const float4 lo = *reinterpret_cast<const float4*>(o_s + T::OIndex(w * 8 + 2 * h + 1, c));
        v = make_float4(v.x + lo.x, v.y + lo.y, v.z + lo.z, v.w + lo.w);
      }
      o.x += wgt * (v.x + mlz[2]);
      o.y += wgt * (v.y + mlz[2]);
      o.z += wgt * (v.z + mlz[2]);
      o.w += wgt * (v.w + mlz[2]);
    }
    if (finish) {
      *reinterpret_cast<float4*>(fin_o + h * kHeadDim + c) = o;
      if (c == 0) fin_ml[h] = make_float2(m, l);
    } else {
      *reinterpret_cast<float4*>(o_out + static_cast<size_t>(h) * num_splits * kHeadDim + c) = o;
      if (c == 0) ml_out[h * num_splits] = make_float2(m, l);
    }
  }
  if (!finish) return;
  // What MergeSplitsKernel does with a single split and no sinks: o = sign . H o', normalized.
  // Every lane takes part in each pass (the rotation shuffles across the warp); rows past nh are
  // rotated but not stored.
  __syncthreads();
  using V = LaneVector<kHeadDim>;
  const int chunk = tid % V::kLanes;
#pragma unroll
  for (int h0 = 0; h0 < kH; h0 += V::kVecs) {
    const int h = h0 + tid / V::kLanes;
    float o[8] = {};
    if (h < nh) {
      const float4* src = reinterpret_cast<const float4*>(fin_o + h * kHeadDim + chunk * 8);
      const float4 lo = src[0], hi = src[1];
      o[0] = lo.x, o[1] = lo.y, o[2] = lo.z, o[3] = lo.w;
      o[4] = hi.x, o[5] = hi.y, o[6] = hi.z, o[7] = hi.w;
    }
    if (a.rot_block > 0) {
      Hadamard8PerLane(o, chunk, a.rot_block);
      ApplySigns8(SignByte(a.signs, chunk), o);
    }
    if (h < nh) {
      const float2 ml = fin_ml[h];
      StoreAttentionRow(o, ml.x, ml.y, head_row + h, chunk, kHeadDim, a.out, a.out_fp16, a.lse);
    }
  }
}

}  // namespace attention_internal
}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_MERGE_CUH_
