// Paged decode attention on the GPU: the pieces shared by the driver (paged_attention.cu) and the
// per-dtype instantiation files of the split kernel (paged_attention_<dtype>.cu).
//
// One call runs two or three kernels on the caller's stream; the split kernels and the merge are
// launched as programmatic dependents of the kernel before them (LaunchDependent), so their
// launch and their work that needs no result of that kernel overlap it:
//   1. RotateQueryKernel<head_dim, rot_block>, for the CUDA-core split kernel only: q (fp16,
//      original space) -> q' = H(sign . q) in fp32, into the workspace. Once per (sequence, query
//      head). The tensor-core split kernel rotates its CTA's query heads itself.
//   2. a split kernel (LaunchAttentionSplits below picks one): for each (split of the context,
//      KV head, sequence), the unnormalized softmax state of the split's quantized tokens
//      for every query head of the KV head: running max m and sum l (log2 domain) and the
//      accumulator o' = sum_t 2^(s_t - m) v'_t in the ROTATED space.
//   3. MergeSplitsKernel<head_dim, rot_block>: log-sum-exp merge of the splits, one un-rotation
//      of the merged accumulator, merge with the fp16 sink segment, normalization; writes out and
//      lse. Skipped when the tensor-core split kernel runs one split and the layout keeps no sink
//      tokens: that kernel then un-rotates, normalizes and writes out and lse itself.
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool::cuda {

// Query heads one split CTA serves; a KV head with more query heads (GQA ratio > 8) is served by
// ceil(ratio / 8) CTAs, each reading the KV head's pages.
inline constexpr int kAttnMaxHeadsPerCta = 8;
inline constexpr int kAttnThreads = 128;
inline constexpr float kLn2 = 0.6931471805599453f;
// cp.async stages in flight per split CTA.
inline constexpr int kAttnStages = 4;

// Tokens one pipeline stage holds: the power of two in [16, 64] that keeps a stage's K+V codes
// near 16 KiB. A stage is either several whole blocks or an aligned part of one block.
__host__ __device__ constexpr int AttnStageTokens(KvDtype dtype, int head_dim) {
  const int kv_bytes_per_token = 2 * (head_dim * DtypeBits(dtype) / 8 + 4);
  const int fit = 16384 / kv_bytes_per_token;
  return fit >= 64 ? 64 : fit >= 32 ? 32 : 16;
}

// Vectors of head_dim channels as 8 channels per lane (Hadamard8PerLane): kLanes lanes per
// vector, kVecs per CTA.
template <int kHeadDim>
struct LaneVector {
  static constexpr int kLanes = kHeadDim / 8;
  static constexpr int kVecs = kAttnThreads / kLanes;
};

// Register budget of the tensor-core split kernel (CTAs per SM the compiler must fit, and the
// occupancy PlanAttentionSplits assumes): 4 (16 warps) where the accumulators fit in 128
// registers (head_dim 64, INT4 at 128), 3 for INT8/FP8 at 128, 2 for FP16 at 128 (its 16-byte
// units) and for head_dim 256. There FP16's two stages per warp take 140 KiB of shared memory, so
// one of its CTAs fits an SM, not the two the plan assumes; a build for one CTA per SM (three
// stages) was no faster (results/experiments_2026-11-29.md, "Nineteenth session").
__host__ __device__ constexpr int AttnMmaCtasPerSm(KvDtype dtype, int head_dim) {
  return head_dim > 128 || dtype == KvDtype::kFp16
             ? (head_dim == 64 ? 4 : 2)
             : (head_dim == 64 || dtype == KvDtype::kInt4) ? 4 : 3;
}
// INT4 at head_dim 128 also has a deep build of the split kernel, for kAttnDeepCtasPerSm CTAs per
// SM: up to 168 registers and seven stages let its loop take three tiles per iteration.
// PlanAttentionSplits takes it wherever it runs the plan's CTAs in as many rounds as the
// four-CTA build and either the CTAs serve more than 4 query heads each (two P^T tiles: 5-15%
// faster on the H200) or each CTA's share of the context is at least kAttnDeepMinTokens (the
// deeper pipeline's fill paid over a long loop).
inline constexpr int kAttnDeepCtasPerSm = 3;
inline constexpr int kAttnDeepMinTokens = 4096;
__host__ __device__ constexpr bool AttnHasDeepBuild(KvDtype dtype, int head_dim) {
  return dtype == KvDtype::kInt4 && head_dim == 128;
}

// Whether a layout's splits run on the tensor-core kernel (one {scale, zero} per token and head,
// or FP16 pages), which rotates q itself, rather than the CUDA-core kernel, which reads q' from
// the workspace.
inline bool AttnUsesMma(const PageLayout& layout) {
  return !layout.quantized() || layout.group_size == layout.head_dim;
}

// Split-K geometry of one call, identical in AttentionWorkspaceBytes and the launch.
struct AttnSplitPlan {
  bool mma = true;  // AttnUsesMma(layout)
  int num_splits = 1;
  int tokens_per_split = 0;  // a multiple of the stage tokens
  int head_groups = 1;       // CTAs per KV head: ceil(ratio / kAttnMaxHeadsPerCta)
  // CTAs per SM the split kernel runs: the tensor-core kernel's build (AttnMmaCtasPerSm, or
  // kAttnDeepCtasPerSm), 4 assumed for the CUDA-core kernel.
  int ctas_per_sm = 0;
};
AttnSplitPlan PlanAttentionSplits(const PageLayout& layout, int num_seqs, int num_q_heads,
                                  int max_blocks_per_seq, int num_splits);

// What the split kernel reads and writes. Every pointer is device memory.
struct AttnSplitArgs {
  PageGeometry geo;
  int num_kv_heads = 0;
  int group_size = 0;  // channels per {scale, zero}; a multiple of 16 (quantized dtypes)
  int sink_tokens = 0;
  const uint8_t* pages = nullptr;         // [num_blocks][layer_page_bytes]
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  // [num_seqs]
  int num_q_heads = 0;
  int ratio = 0;                    // query heads per KV head
  const uint16_t* q = nullptr;      // [num_seqs][num_q_heads][head_dim] fp16 (tensor-core kernel)
  RotationSigns signs;              // and the rotation it applies to q
  int rot_block = 0;
  const float* q_rot = nullptr;  // [num_seqs][num_q_heads][head_dim] q' fp32 (CUDA-core kernel)
  float score_scale = 0.0f;      // sm_scale * log2(e): scores in the log2 domain
  AttnSplitPlan plan;
  float* part_o = nullptr;    // [num_seqs][num_q_heads][num_splits][head_dim] o', rotated
  float2* part_ml = nullptr;  // [num_seqs][num_q_heads][num_splits] {m, l}, log2 domain
  // Set (out or out_fp16, and lse when wanted) only when the tensor-core kernel finishes the
  // call itself (one split, no sink tokens); part_o and part_ml are then not written.
  float* out = nullptr;          // [num_seqs][num_q_heads][head_dim] fp32, or
  uint16_t* out_fp16 = nullptr;  // fp16
  float* lse = nullptr;          // [num_seqs][num_q_heads] or null
};

// Normalizes channels [8 chunk, 8 chunk + 8) of query-head row `head_row`'s accumulator o (in
// the original space; m and l in the log2 domain) by l, stores them into out (fp32) or out_fp16,
// and, from chunk 0, the row's natural-log log-sum-exp into lse (when not null).
__device__ __forceinline__ void StoreAttentionRow(float (&o)[8], float m, float l, size_t head_row,
                                                  int chunk, int head_dim, float* out,
                                                  uint16_t* out_fp16, float* lse) {
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] *= inv;
  const size_t first = head_row * head_dim + chunk * 8;
  if (out_fp16 != nullptr) {
    *reinterpret_cast<uint4*>(out_fp16 + first) = PackHalf8(o);
  } else {
    float4* dst = reinterpret_cast<float4*>(out + first);
    dst[0] = make_float4(o[0], o[1], o[2], o[3]);
    dst[1] = make_float4(o[4], o[5], o[6], o[7]);
  }
  if (lse != nullptr && chunk == 0) lse[head_row] = (m + log2f(l)) * kLn2;
}

// Launches the split kernel over grid (num_splits, num_kv_heads * head_groups, num_seqs):
// AttentionSplitMmaKernel (tensor cores, paged_attention_mma.cuh) when args.plan.mma, else
// AttentionSplitKernel (CUDA cores, any group size that is a multiple of 16,
// paged_attention_split.cuh). Defined in paged_attention_launch.cuh, instantiated per dtype in
// paged_attention_<dtype>.cu.
template <KvDtype kDtype, int kHeadDim>
KernelStatus LaunchAttentionSplits(const AttnSplitArgs& args, int num_seqs, cudaStream_t stream);

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_CUH_
