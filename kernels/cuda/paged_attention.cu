// kvpool::cuda::PagedDecodeAttention and AttentionWorkspaceBytes: validation, the split plan,
// and the query-rotation and merge kernels around the split kernel (paged_attention.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool::cuda {
namespace {

// Auto split count (AutoSplits): SMs of the part, and the fixed cost of a split CTA (pipeline
// fill, q' fragments, end-of-CTA merge, partial writes) in tokens of its work.
constexpr int kNumSms = 132;
constexpr int kCtaFixedTokens = 256;
// Co-resident split CTAs that draw an SM's full throughput (AutoSplits): more of them in one round
// only add their fixed costs (prologue, end-of-CTA merge, partials for the merge kernel).
// Measured on the H200 with attention_bench --splits: at 1 x 32K and 8 x 8K, INT4 with two CTAs
// per SM (32 / 4 splits) ran 10% / 6% faster than with four (64 / 8), INT8 and FP8 at 8 x 8K 3%
// faster than with three (results/experiments_2026-11-29.md, "Seventh session").
constexpr int64_t kBandwidthCtasPerSm = 2;
constexpr float kLog2e = 1.4426950408889634f;

// Workspace carving: q' [num_seqs][num_q_heads][head_dim] fp32 (CUDA-core split kernel only),
// then the split partials.
struct Workspace {
  float* q_rot;
  float* part_o;
  float2* part_ml;
};
struct WorkspaceSizes {
  size_t q_rot, part_o, part_ml;
  size_t total() const { return q_rot + part_o + part_ml; }
};
WorkspaceSizes SizeWorkspace(const PageLayout& layout, int num_seqs, int num_q_heads,
                             int num_splits) {
  const size_t rows = static_cast<size_t>(num_seqs) * num_q_heads;
  return {AttnUsesMma(layout) ? 0 : AlignUp16(rows * layout.head_dim * sizeof(float)),
          AlignUp16(rows * num_splits * layout.head_dim * sizeof(float)),
          AlignUp16(rows * num_splits * sizeof(float2))};
}

// q' = H(sign . q) in fp32 for every (sequence, query head); a plain conversion when kRot == 0.
// Grid (num_seqs, ceil(num_q_heads / kVecs)), kAttnThreads threads; lane group `vec` serves query
// head blockIdx.y * kVecs + vec.
//   q      [num_seqs][num_q_heads][kHeadDim] fp16
//   q_rot  [num_seqs][num_q_heads][kHeadDim] fp32
template <int kHeadDim, int kRot>
__global__ void __launch_bounds__(kAttnThreads)
    RotateQueryKernel(const uint16_t* q, int num_q_heads, RotationSigns signs, float* q_rot) {
  using V = LaneVector<kHeadDim>;
  const int chunk = threadIdx.x % V::kLanes;
  const int head = blockIdx.y * V::kVecs + threadIdx.x / V::kLanes;
  const bool active = head < num_q_heads;
  // The first kernel of the call, launched as a programmatic dependent like the rest: it waits
  // for what the stream ran before (a decode step's append) so that the split kernel, which waits
  // for this one, sees the pages complete; the split kernel's launch overlaps this one.
  GridDependencyWait();
  AllowDependentLaunch();
  const size_t row = (static_cast<size_t>(blockIdx.x) * num_q_heads + head) * kHeadDim;
  float x[8] = {};
  if (active) UnpackHalf8(*reinterpret_cast<const uint4*>(q + row + chunk * 8), x);
  if constexpr (kRot > 0) {
    ApplySigns8(SignByte(signs, chunk), x);
    Hadamard8PerLane(x, chunk, kRot);
  }
  if (active) {
    float4* dst = reinterpret_cast<float4*>(q_rot + row + chunk * 8);
    dst[0] = make_float4(x[0], x[1], x[2], x[3]);
    dst[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

struct MergeArgs {
  const float* part_o = nullptr;    // [num_seqs][num_q_heads][num_splits][head_dim]
  const float2* part_ml = nullptr;  // [num_seqs][num_q_heads][num_splits] {m, l} log2 domain
  int num_splits = 0;
  int num_q_heads = 0;
  int ratio = 0;
  RotationSigns signs;
  float score_scale = 0.0f;  // sm_scale * log2(e)
  // Sink segment (sink_tokens > 0): fp16 K/V of the first block's sink page, original space.
  int sink_tokens = 0;
  int num_kv_heads = 0;
  uint32_t sink_page_bytes = 0;
  const uint8_t* sink_pages = nullptr;    // [num_sink_blocks][sink_page_bytes]
  int64_t num_sink_blocks = 0;
  const uint16_t* q = nullptr;            // [num_seqs][num_q_heads][head_dim] fp16
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  // [num_seqs]
  int block_tokens_log2 = 0;
  float* out = nullptr;          // [num_seqs][num_q_heads][head_dim] fp32, or
  uint16_t* out_fp16 = nullptr;  // fp16
  float* lse = nullptr;          // [num_seqs][num_q_heads] or null
};

// Merges the splits of one (sequence, query head) by log-sum-exp, un-rotates the merged o' once,
// merges the fp16 sink segment the same way, normalizes, and writes out and lse.
// Grid (num_seqs, num_q_heads), kAttnThreads threads: the kVecs lane groups (kLanes lanes, 8
// channels each) take the splits round-robin, kMergeBatch at a time with every load of a batch in
// flight together, and merge them against their own running max; warp 0 then merges the groups
// and finishes (its lane groups all compute the same values; group 0 writes).
constexpr int kMergeBatch = 8;
template <int kHeadDim, int kRot>
__global__ void __launch_bounds__(kAttnThreads) MergeSplitsKernel(const MergeArgs a) {
  using V = LaneVector<kHeadDim>;
  __shared__ float group_m[V::kVecs];
  __shared__ float group_l[V::kVecs];
  __shared__ float4 group_o[V::kVecs][kHeadDim / 4];
  GridDependencyWait();  // the split partials
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int warp = threadIdx.x / 32;
  const int vec = threadIdx.x / V::kLanes;
  const int chunk = threadIdx.x % V::kLanes;
  const size_t head_row = static_cast<size_t>(seq) * a.num_q_heads + head;
  const float2* ml = a.part_ml + head_row * a.num_splits;
  const float4* po =
      reinterpret_cast<const float4*>(a.part_o + head_row * a.num_splits * kHeadDim + chunk * 8);

  // Empty splits hold {-inf, 0} and o' = 0, as do the batch's slots past the last split: weight
  // 0 once the group has a finite max, and no branch between the loads.
  float m = -INFINITY;
  float l = 0.0f;
  float o[8] = {};
  for (int first = vec; first < a.num_splits; first += V::kVecs * kMergeBatch) {
    float2 split_ml[kMergeBatch];
    float4 p[kMergeBatch][2];
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int s = first + b * V::kVecs;
      const bool in = s < a.num_splits;
      split_ml[b] = in ? ml[s] : make_float2(-INFINITY, 0.0f);
      p[b][0] = in ? po[s * (kHeadDim / 4)] : make_float4(0.f, 0.f, 0.f, 0.f);
      p[b][1] = in ? po[s * (kHeadDim / 4) + 1] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float m_new = m;
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) m_new = fmaxf(m_new, split_ml[b].x);
    if (m_new == -INFINITY) continue;  // nothing but empty splits so far
    const float alpha = exp2f(m - m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] *= alpha;
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const float w = exp2f(split_ml[b].x - m_new);
      l += w * split_ml[b].y;
      o[0] += w * p[b][0].x;
      o[1] += w * p[b][0].y;
      o[2] += w * p[b][0].z;
      o[3] += w * p[b][0].w;
      o[4] += w * p[b][1].x;
      o[5] += w * p[b][1].y;
      o[6] += w * p[b][1].z;
      o[7] += w * p[b][1].w;
    }
    m = m_new;
  }
  group_o[vec][2 * chunk] = make_float4(o[0], o[1], o[2], o[3]);
  group_o[vec][2 * chunk + 1] = make_float4(o[4], o[5], o[6], o[7]);
  if (chunk == 0) {
    group_m[vec] = m;
    group_l[vec] = l;
  }
  __syncthreads();
  if (warp != 0) return;

  m = -INFINITY;
  for (int v = 0; v < V::kVecs; ++v) m = fmaxf(m, group_m[v]);
  l = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = 0.0f;
  if (m > -INFINITY) {
    for (int v = 0; v < V::kVecs; ++v) {
      const float w = exp2f(group_m[v] - m);  // 0 for a group without a finite max
      const float4 p0 = group_o[v][2 * chunk], p1 = group_o[v][2 * chunk + 1];
      o[0] += w * p0.x;
      o[1] += w * p0.y;
      o[2] += w * p0.z;
      o[3] += w * p0.w;
      o[4] += w * p1.x;
      o[5] += w * p1.y;
      o[6] += w * p1.z;
      o[7] += w * p1.w;
      l += w * group_l[v];
    }
  }
  if constexpr (kRot > 0) {  // back to the original space: sign . H o'
    Hadamard8PerLane(o, chunk, kRot);
    ApplySigns8(SignByte(a.signs, chunk), o);
  }

  const int len = min(a.seq_lens[seq], a.max_blocks_per_seq << a.block_tokens_log2);
  // The host validated the first block; never read past the sink arena.
  const int block =
      a.sink_tokens > 0 ? a.block_tables[static_cast<size_t>(seq) * a.max_blocks_per_seq] : 0;
  const int n_sink = block >= 0 && block < a.num_sink_blocks ? min(a.sink_tokens, len) : 0;
  if (n_sink > 0) {
    float q[8];
    UnpackHalf8(*reinterpret_cast<const uint4*>(a.q + head_row * kHeadDim + chunk * 8), q);
    const int kv_head = head / a.ratio;
    const uint8_t* page = a.sink_pages + static_cast<size_t>(block) * a.sink_page_bytes;
    const size_t row_bytes = static_cast<size_t>(kHeadDim) * 2;
    const uint8_t* k_rows = page + static_cast<size_t>(kv_head) * a.sink_tokens * row_bytes;
    const uint8_t* v_rows =
        k_rows + static_cast<size_t>(a.num_kv_heads) * a.sink_tokens * row_bytes;
    for (int t = 0; t < n_sink; ++t) {
      float k[8], v[8];
      UnpackHalf8(*reinterpret_cast<const uint4*>(k_rows + t * row_bytes + chunk * 16), k);
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) dot += q[i] * k[i];
      const float s = GroupSum<V::kLanes>(dot) * a.score_scale;
      const float m_new = fmaxf(m, s);
      const float alpha = exp2f(m - m_new);
      const float p = exp2f(s - m_new);
      UnpackHalf8(*reinterpret_cast<const uint4*>(v_rows + t * row_bytes + chunk * 16), v);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = o[i] * alpha + p * v[i];
      l = l * alpha + p;
      m = m_new;
    }
  }

  if (vec == 0) StoreAttentionRow(o, m, l, head_row, chunk, kHeadDim, a.out, a.out_fp16, a.lse);
}

// Beyond the CPU reference's checks (except the device-resident lengths and block ids): group
// sizes that are multiples of 16, layer pages under 4 GiB, enough workspace, and 16-byte
// alignment of q, out or out_fp16, pages, sink_pages and workspace (the kernels use 16-byte
// loads and stores on them).
KernelStatus Validate(const PagedDecodeAttentionParams& p) {
  const PageLayout& l = p.layout;
  // Invalid layouts, and the layouts these kernels were not built for (ServesLayout: group sizes,
  // 32-bit page offsets), before anything else.
  if (const KernelStatus served = ServesLayout(l); served != KernelStatus::kOk) return served;
  if (p.num_seqs < 0 || p.num_q_heads <= 0 || p.num_q_heads % l.num_kv_heads != 0 ||
      !AttentionTableSpanOk(l, p.max_blocks_per_seq) || p.num_splits < 0 ||
      p.num_splits > kMaxAttentionSplits) {
    return KernelStatus::kInvalidArgument;
  }
  // The split kernels' grids take sequences as z and the merge kernel's query heads as y (at
  // most 65535 each).
  if (p.num_seqs > kMaxAttentionSeqsOrHeads || p.num_q_heads > kMaxAttentionSeqsOrHeads) {
    return KernelStatus::kUnsupported;
  }
  if (p.num_seqs == 0) return KernelStatus::kOk;
  if (p.pages == nullptr || p.q == nullptr || p.block_tables == nullptr || p.seq_lens == nullptr ||
      (p.out == nullptr) == (p.out_fp16 == nullptr) ||
      (l.sink_tokens > 0 && p.sink_pages == nullptr) || p.workspace == nullptr ||
      p.workspace_bytes < AttentionWorkspaceBytes(l, p.num_seqs, p.num_q_heads,
                                                  p.max_blocks_per_seq, p.num_splits)) {
    return KernelStatus::kInvalidArgument;
  }
  if (!Aligned16(p.q) || !Aligned16(p.out) || !Aligned16(p.out_fp16) || !Aligned16(p.pages) ||
      !Aligned16(p.sink_pages) || !Aligned16(p.workspace)) {
    return KernelStatus::kInvalidArgument;
  }
  return KernelStatus::kOk;
}

// The busiest SM runs min(ceil(CTAs / SMs), resident) CTAs at once.
int64_t CtasPerSmAtOnce(int64_t ctas, int64_t resident) {
  return std::min(CeilDiv(ctas, kNumSms), resident);
}
// Rounds of `ctas` CTAs with `resident` of them per SM.
int64_t Rounds(int64_t ctas, int64_t resident) {
  return CeilDiv(ctas, kNumSms * CtasPerSmAtOnce(ctas, resident));
}

// The split count that minimizes the modelled time of the split kernel for `resident` CTAs per SM
// (the tensor-core kernel's build, 4 assumed for the other one): the busiest SM runs per_sm CTAs
// at once (CtasPerSmAtOnce), in Rounds rounds; a round's CTAs each do their tokens plus
// kCtaFixedTokens of work, and share the SM's throughput, which kBandwidthCtasPerSm of them
// already draw. Equal-length sequences make CTAs of one round finish together, so a partial last
// round costs a whole one. Counts beyond 4 rounds' worth of CTAs are not tried; ties go to fewer
// splits.
int AutoSplits(int64_t resident, int64_t ctas, int max_tokens, int stage_tokens) {
  const int64_t max_splits =
      std::min<int64_t>(CeilDiv(max_tokens, stage_tokens), CeilDiv(4 * kNumSms * resident, ctas));
  int best = 1;
  double best_cost = 0;
  for (int s = 1; s <= max_splits; ++s) {
    const int64_t tokens = CeilDiv(CeilDiv(max_tokens, s), stage_tokens) * stage_tokens;
    const int64_t n = ctas * CeilDiv(max_tokens, tokens);
    const int64_t per_sm = CtasPerSmAtOnce(n, resident);
    const int64_t rounds = Rounds(n, resident);
    const double cost = static_cast<double>(rounds * per_sm * (tokens + kCtaFixedTokens)) /
                        static_cast<double>(std::min(per_sm, kBandwidthCtasPerSm));
    if (s == 1 || cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

}  // namespace

AttnSplitPlan PlanAttentionSplits(const PageLayout& layout, int num_seqs, int num_q_heads,
                                  int max_blocks_per_seq, int num_splits) {
  AttnSplitPlan plan;
  plan.mma = AttnUsesMma(layout);
  const int stage_tokens = AttnStageTokens(layout.dtype, layout.head_dim);
  const int max_tokens = max_blocks_per_seq * layout.block_tokens;
  const int ratio = num_q_heads / layout.num_kv_heads;
  plan.head_groups = static_cast<int>(CeilDiv(ratio, kAttnMaxHeadsPerCta));
  plan.ctas_per_sm = plan.mma ? AttnMmaCtasPerSm(layout.dtype, layout.head_dim) : 4;
  const int64_t ctas =
      std::max<int64_t>(1, static_cast<int64_t>(num_seqs) * layout.num_kv_heads * plan.head_groups);
  int splits = num_splits;
  if (splits <= 0) splits = AutoSplits(plan.ctas_per_sm, ctas, max_tokens, stage_tokens);
  splits = std::clamp(splits, 1, static_cast<int>(CeilDiv(max_tokens, stage_tokens)));
  plan.tokens_per_split =
      static_cast<int>(CeilDiv(CeilDiv(max_tokens, splits), stage_tokens) * stage_tokens);
  plan.num_splits = static_cast<int>(CeilDiv(max_tokens, plan.tokens_per_split));
  // The deep build (a function of the split count alone, so that a count passed back plans the
  // same call) unless its lower residency would run the CTAs in more rounds.
  const int64_t n = ctas * plan.num_splits;
  if (plan.mma && AttnHasDeepBuild(layout.dtype, layout.head_dim) &&
      (ratio > 4 || plan.tokens_per_split >= kAttnDeepMinTokens) &&
      Rounds(n, kAttnDeepCtasPerSm) <= Rounds(n, plan.ctas_per_sm)) {
    plan.ctas_per_sm = kAttnDeepCtasPerSm;
  }
  return plan;
}

namespace {
// Whether a batch shape can be planned (PlanAttentionSplits divides by these).
bool PlannableShape(const PageLayout& layout, int num_seqs, int num_q_heads,
                    int max_blocks_per_seq) {
  return layout.num_kv_heads > 0 && layout.head_dim > 0 && num_seqs > 0 && num_q_heads > 0 &&
         AttentionTableSpanOk(layout, max_blocks_per_seq);
}
}  // namespace

size_t AttentionWorkspaceBytes(const PageLayout& layout, int num_seqs, int num_q_heads,
                               int max_blocks_per_seq, int num_splits) {
  if (!PlannableShape(layout, num_seqs, num_q_heads, max_blocks_per_seq)) return 0;
  const AttnSplitPlan plan =
      PlanAttentionSplits(layout, num_seqs, num_q_heads, max_blocks_per_seq, num_splits);
  return SizeWorkspace(layout, num_seqs, num_q_heads, plan.num_splits).total();
}

AttentionPlan PlanAttention(const PageLayout& layout, int num_seqs, int num_q_heads,
                            int max_blocks_per_seq, int num_splits) {
  if (!PlannableShape(layout, num_seqs, num_q_heads, max_blocks_per_seq)) return {};
  const AttnSplitPlan plan =
      PlanAttentionSplits(layout, num_seqs, num_q_heads, max_blocks_per_seq, num_splits);
  return {plan.num_splits, plan.ctas_per_sm};
}

KernelStatus PagedDecodeAttention(const PagedDecodeAttentionParams& p, void* stream) {
  const KernelStatus valid = Validate(p);
  if (valid != KernelStatus::kOk || p.num_seqs == 0) return valid;
  const PageLayout& l = p.layout;
  const auto s = static_cast<cudaStream_t>(stream);
  const AttnSplitPlan plan =
      PlanAttentionSplits(l, p.num_seqs, p.num_q_heads, p.max_blocks_per_seq, p.num_splits);
  const WorkspaceSizes sizes = SizeWorkspace(l, p.num_seqs, p.num_q_heads, plan.num_splits);
  auto* ws = static_cast<uint8_t*>(p.workspace);
  const Workspace w{reinterpret_cast<float*>(ws), reinterpret_cast<float*>(ws + sizes.q_rot),
                    reinterpret_cast<float2*>(ws + sizes.q_rot + sizes.part_o)};
  const PageGeometry geo = MakePageGeometry(l);
  const RotationSigns signs = MakeRotationSigns(l);
  const float score_scale = p.sm_scale * kLog2e;
  const int ratio = p.num_q_heads / l.num_kv_heads;

  AttnSplitArgs split;
  split.geo = geo;
  split.num_kv_heads = l.num_kv_heads;
  split.group_size = l.quantized() ? l.group_size : l.head_dim;
  split.sink_tokens = l.sink_tokens;
  split.pages = p.pages;
  split.block_tables = p.block_tables;
  split.max_blocks_per_seq = p.max_blocks_per_seq;
  split.seq_lens = p.seq_lens;
  split.num_q_heads = p.num_q_heads;
  split.ratio = ratio;
  split.q = p.q;
  split.signs = signs;
  split.q_rot = plan.mma ? nullptr : w.q_rot;  // no q' region when the MMA kernel rotates q
  split.score_scale = score_scale;
  split.plan = plan;
  split.part_o = w.part_o;
  split.part_ml = w.part_ml;
  // One split of the tensor-core kernel and no sink segment: nothing to merge.
  const bool merge_splits = !plan.mma || plan.num_splits > 1 || l.sink_tokens > 0;
  if (!merge_splits) {
    split.out = p.out;
    split.out_fp16 = p.out_fp16;
    split.lse = p.lse;
  }

  MergeArgs merge;
  merge.part_o = w.part_o;
  merge.part_ml = w.part_ml;
  merge.num_splits = plan.num_splits;
  merge.num_q_heads = p.num_q_heads;
  merge.ratio = ratio;
  merge.signs = signs;
  merge.score_scale = score_scale;
  merge.sink_tokens = l.sink_tokens;
  merge.num_kv_heads = l.num_kv_heads;
  merge.sink_page_bytes = geo.sink_page_bytes;
  merge.sink_pages = p.sink_pages;
  merge.num_sink_blocks = p.num_sink_blocks;
  merge.q = p.q;
  merge.block_tables = p.block_tables;
  merge.max_blocks_per_seq = p.max_blocks_per_seq;
  merge.seq_lens = p.seq_lens;
  merge.block_tokens_log2 = geo.block_tokens_log2;
  merge.out = p.out;
  merge.out_fp16 = p.out_fp16;
  merge.lse = p.lse;

  return DispatchLayout</*kWithBlockTokens=*/false>(
      l, [&](auto dtype, auto head_dim, auto rot, auto) -> KernelStatus {
        constexpr KvDtype kDtype = decltype(dtype)::value;
        constexpr int kHeadDim = decltype(head_dim)::value;
        constexpr int kRot = decltype(rot)::value;
        if (!plan.mma) {  // the CUDA-core kernel reads q' from here
          const dim3 rotate_grid(
              p.num_seqs, static_cast<int>(CeilDiv(p.num_q_heads, LaneVector<kHeadDim>::kVecs)));
          const KernelStatus st = CheckCuda(
              LaunchDependent(RotateQueryKernel<kHeadDim, kRot>, rotate_grid, dim3(kAttnThreads), 0,
                              s, p.q, p.num_q_heads, signs, w.q_rot),
              "RotateQueryKernel");
          if (st != KernelStatus::kOk) return st;
        }
        split.rot_block = kRot;  // the effective rotation: 0 for FP16 pages
        const KernelStatus st = LaunchAttentionSplits<kDtype, kHeadDim>(split, p.num_seqs, s);
        if (st != KernelStatus::kOk || !merge_splits) return st;
        return CheckCuda(
            LaunchDependent(MergeSplitsKernel<kHeadDim, kRot>, dim3(p.num_seqs, p.num_q_heads),
                            dim3(kAttnThreads), 0, s, merge),
            "MergeSplitsKernel");
      });
}

}  // namespace kvpool::cuda
