// The CUDA-core split kernel of paged decode attention, for any group size that is a multiple of
// 16 (see paged_attention.cuh for the three-kernel structure; paged_attention_mma.cuh serves
// group_size == head_dim on tensor cores and includes this file for the shared helpers).
//
// Grid (num_splits, num_kv_heads * head_groups, num_seqs), kAttnThreads (128) threads. A CTA
// serves split `blockIdx.x` of sequence `blockIdx.z`: its quantized tokens
// [max(split * tokens_per_split, n_sink), min((split + 1) * tokens_per_split, len)) of KV head
// blockIdx.y / head_groups, for up to 8 query heads of that KV head (all of them share every page
// read). Pages stream through kAttnStages cp.async stages of kStageTokens tokens (16-byte copies,
// several stages in flight) into shared memory; each stage then runs three phases:
//   A  scores: thread (token, channel slice) unpacks its slice of the token's K codes once and
//      dots it with every head's q' (fp32 in shared memory), applying scale/zero per group
//      segment: sum_g scale_g (q'_g . codes_g) + zero_g sum(q'_g). Slices are summed in phase B.
//   B  online softmax: warp w owns heads w and w + 4 (running max m and sum l in registers,
//      log2 domain) and writes p_t = 2^(s_t - m) for the stage.
//   C  values: thread (8-channel chunk, token subset) accumulates sum_t (p_t scale_t) codes_t
//      and sum_t p_t zero_t in fp32 registers for every head: V stays in the rotated space.
// The end reduces the token subsets in shared memory and writes the split's {m, l} and o'.
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_SPLIT_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_SPLIT_CUH_

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"

namespace kvpool::cuda {
namespace attention_internal {

// The code values of channels [8 chunk, 8 chunk + 8) of one page row in shared memory: integer
// codes for INT4/INT8 (exact, through the 2^23 float trick), decoded e4m3 for FP8, the values for
// FP16.
template <KvDtype kDtype>
__device__ __forceinline__ void LoadCodes8(const uint8_t* row, int chunk, float (&x)[8]) {
  constexpr uint32_t kMagicBits = 0x4B000000u;  // 2^23 as float
  constexpr float kMagic = 8388608.0f;
  if constexpr (kDtype == KvDtype::kInt4) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + chunk * 4);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      x[i] = __uint_as_float(((w >> (4 * i)) & 0xFu) | kMagicBits) - kMagic;
  } else if constexpr (kDtype == KvDtype::kInt8) {
    const uint2 w = *reinterpret_cast<const uint2*>(row + chunk * 8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = __uint_as_float(__byte_perm(w.x, kMagicBits, 0x7440u | i)) - kMagic;
      x[i + 4] = __uint_as_float(__byte_perm(w.y, kMagicBits, 0x7440u | i)) - kMagic;
    }
  } else if constexpr (kDtype == KvDtype::kFp8E4M3) {
    const uint2 w = *reinterpret_cast<const uint2*>(row + chunk * 8);
    const uint32_t words[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto pair =
          static_cast<__nv_fp8x2_storage_t>((words[i / 2] >> (16 * (i % 2))) & 0xFFFFu);
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else {
    UnpackHalf8(*reinterpret_cast<const uint4*>(row + chunk * 16), x);
  }
}

// {scale, zero} of group `group` of a page row's meta in shared memory.
__device__ __forceinline__ float2 LoadMeta(const uint8_t* meta_row, int group) {
  return __half22float2(*reinterpret_cast<const __half2*>(meta_row + 4 * group));
}

template <KvDtype kDtype, int kHeadDim>
struct SplitTraits {
  static constexpr bool kQuantized = kDtype != KvDtype::kFp16;
  static constexpr int kStageTokens = AttnStageTokens(kDtype, kHeadDim);
  static constexpr int kCodeBytes = kHeadDim * DtypeBits(kDtype) / 8;  // per token
  static constexpr int kCodeChunks = kCodeBytes / 16;                  // 16-byte copies per row
  static constexpr int kCodeStride = kCodeBytes + 16;  // shared row pitch: conflict-free phase A
  static constexpr int kSlices = kAttnThreads / kStageTokens;  // phase A channel slices
  static constexpr int kSliceDim = kHeadDim / kSlices;
  static constexpr int kChunks = kHeadDim / 8;               // phase C 8-channel chunks
  static constexpr int kTokenSets = kAttnThreads / kChunks;  // phase C token subsets
  static constexpr int kH = kAttnMaxHeadsPerCta;
  static_assert(kSliceDim >= 16 && kSliceDim % 8 == 0, "slice");
  // Shared floats after the stages: q' [kH][kHeadDim], segment sums of q' [kH][kHeadDim / 16],
  // partial scores [kSlices][kStageTokens][kH], probabilities [kStageTokens][kH], alpha [kH].
  static constexpr int kFixedFloats =
      kH * kHeadDim + kH * (kHeadDim / 16) + kSlices * kStageTokens * kH + kStageTokens * kH + kH;
  __host__ __device__ static constexpr size_t StageBytes(int meta_bytes_per_token) {
    return 2 * static_cast<size_t>(kStageTokens) * (kCodeStride + meta_bytes_per_token);
  }
  // The end's reduction: every token subset's sums [kTokenSets][kH][kHeadDim], over the freed
  // stages and fixed floats.
  static constexpr size_t kReduceBytes = static_cast<size_t>(kTokenSets) * kH * kHeadDim * 4;
  static constexpr size_t SharedBytes(int meta_bytes_per_token) {
    const size_t loop =
        kAttnStages * StageBytes(meta_bytes_per_token) + kFixedFloats * sizeof(float);
    return loop > kReduceBytes ? loop : kReduceBytes;
  }
};

template <KvDtype kDtype, int kHeadDim>
__global__ void __launch_bounds__(kAttnThreads) AttentionSplitKernel(const AttnSplitArgs a) {
  using T = SplitTraits<kDtype, kHeadDim>;
  constexpr int kS = T::kStageTokens;
  constexpr int kH = T::kH;
  extern __shared__ __align__(16) uint8_t smem[];

  // Launched as a programmatic dependent of RotateQueryKernel: q' and, through that kernel's own
  // wait, the pages of a decode step's append are complete after this.
  GridDependencyWait();
  AllowDependentLaunch();  // the merge may be scheduled as soon as every split CTA runs
  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / a.plan.head_groups;
  const int h_first = (blockIdx.y % a.plan.head_groups) * kH;  // within the KV head's ratio
  const int nh = min(kH, a.ratio - h_first);
  const int q_head0 = kv_head * a.ratio + h_first;
  const int seq = blockIdx.z;
  const int num_splits = a.plan.num_splits;
  const int bt_log2 = a.geo.block_tokens_log2;

  const int len = min(a.seq_lens[seq], a.max_blocks_per_seq << bt_log2);
  const int begin = max(split * a.plan.tokens_per_split, min(a.sink_tokens, len));
  const int end = min((split + 1) * a.plan.tokens_per_split, len);
  // Head h's partials: {m, l} at ml_out[h * num_splits], o' at o_out[h * num_splits * kHeadDim].
  const size_t head_row = static_cast<size_t>(seq) * a.num_q_heads + q_head0;
  float2* ml_out = a.part_ml + head_row * num_splits + split;
  float* o_out = a.part_o + (head_row * num_splits + split) * kHeadDim;
  if (begin >= end) {  // nothing quantized here: an empty state (weight 0 in the merge)
    for (int i = tid; i < nh * kHeadDim; i += kAttnThreads) {
      o_out[static_cast<size_t>(i / kHeadDim) * num_splits * kHeadDim + i % kHeadDim] = 0.0f;
    }
    if (tid < nh) ml_out[tid * num_splits] = make_float2(-INFINITY, 0.0f);
    return;
  }

  const int mb = static_cast<int>(a.geo.meta_bytes_per_token);
  const size_t stage_bytes = T::StageBytes(mb);
  uint8_t* stages = smem;
  float* q_s = reinterpret_cast<float*>(smem + kAttnStages * stage_bytes);
  float* qseg_s = q_s + kH * kHeadDim;
  float* part_s = qseg_s + kH * (kHeadDim / 16);
  float* prob_s = part_s + T::kSlices * kS * kH;
  float* alpha_s = prob_s + kS * kH;

  const int32_t* table = a.block_tables + static_cast<size_t>(seq) * a.max_blocks_per_seq;
  // Head page of (kv, kv_head) inside a layer page: k_offset + kv * v_minus_k.
  const size_t k_offset = static_cast<size_t>(kv_head) * a.geo.head_page_bytes;
  const size_t v_minus_k = static_cast<size_t>(a.num_kv_heads) * a.geo.head_page_bytes;
  const int first_token = begin & ~(kS - 1);
  const int num_stages = (end - first_token + kS - 1) / kS;

  // Enqueues stage i's rows of tokens in [begin, end) (K and V codes, then meta) into buffer
  // i % kAttnStages; always commits one group so that group counting stays uniform.
  auto issue = [&](int i) {
    if (i < num_stages) {
      const int t0 = first_token + i * kS;
      uint8_t* base = stages + (i % kAttnStages) * stage_bytes;
      for (int c = tid; c < 2 * kS * T::kCodeChunks; c += kAttnThreads) {
        const int kv = c / (kS * T::kCodeChunks);
        const int r = (c / T::kCodeChunks) % kS;
        const int part = c % T::kCodeChunks;
        const int t = t0 + r;
        if (t < begin || t >= end) continue;
        const int block = __ldg(table + (t >> bt_log2));
        const uint8_t* src = a.pages + static_cast<size_t>(block) * a.geo.layer_page_bytes +
                             k_offset + kv * v_minus_k +
                             (t & ((1 << bt_log2) - 1)) * T::kCodeBytes + part * 16;
        CpAsync16(base + (kv * kS + r) * T::kCodeStride + part * 16, src);
      }
      if constexpr (T::kQuantized) {
        const int per_kv = kS * mb / 16;
        uint8_t* meta_base = base + 2 * kS * T::kCodeStride;
        for (int c = tid; c < 2 * per_kv; c += kAttnThreads) {
          const int kv = c / per_kv;
          const int off = (c - kv * per_kv) * 16;  // byte in the stage's meta rows of this kv
          const int r = off / mb;
          const int t = t0 + r;
          if (t >= end) continue;
          const int block = __ldg(table + (t >> bt_log2));
          const uint8_t* src = a.pages + static_cast<size_t>(block) * a.geo.layer_page_bytes +
                               k_offset + kv * v_minus_k + a.geo.codes_bytes +
                               (t & ((1 << bt_log2) - 1)) * mb + (off - r * mb);
          CpAsync16(meta_base + kv * kS * mb + off, src);
        }
      }
    }
    CpAsyncCommit();
  };

#pragma unroll
  for (int i = 0; i < kAttnStages - 1; ++i) issue(i);

  // Prologue while the first stages load: q' of the CTA's heads, and the sums of q' over each
  // segment of seg = min(group_size, kSliceDim) channels (the unit phase A applies meta to).
  const float* q_src = a.q_rot + head_row * kHeadDim;
  for (int i = tid; i < kH * kHeadDim / 4; i += kAttnThreads) {
    const float4 v = i < nh * kHeadDim / 4 ? reinterpret_cast<const float4*>(q_src)[i]
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
    reinterpret_cast<float4*>(q_s)[i] = v;
  }
  __syncthreads();
  const int seg = min(a.group_size, T::kSliceDim);
  if constexpr (T::kQuantized) {
    const int segs = kHeadDim / seg;
    for (int i = tid; i < kH * segs; i += kAttnThreads) {
      const float* q = q_s + (i / segs) * kHeadDim + (i % segs) * seg;
      float sum = 0.0f;
      for (int c = 0; c < seg; ++c) sum += q[c];
      qseg_s[(i / segs) * (kHeadDim / 16) + i % segs] = sum;
    }
  }

  const int warp = tid / 32;
  const int lane = tid % 32;
  const int a_token = tid % kS;
  const int a_slice = tid / kS;
  const int c_chunk = tid % T::kChunks;
  const int c_set = tid / T::kChunks;
  const int c_group = T::kQuantized ? c_chunk * 8 / a.group_size : 0;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads warp and warp + 4, log2 domain
  float l_run[2] = {0.0f, 0.0f};
  float acc[kH][8];  // sum_t p_t scale_t code_t for channels [8 c_chunk, +8) of each head
  float zacc[kH];    // sum_t p_t zero_t
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    zacc[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }

  for (int i = 0; i < num_stages; ++i) {
    CpAsyncWait<kAttnStages - 2>();
    __syncthreads();  // stage i landed for all threads; stage i - 1's buffer is free
    issue(i + kAttnStages - 1);
    const uint8_t* base = stages + (i % kAttnStages) * stage_bytes;
    const uint8_t* k_meta = base + 2 * kS * T::kCodeStride;
    const uint8_t* v_meta = k_meta + kS * mb;
    const int t0 = first_token + i * kS;
    const int lo = max(begin - t0, 0);
    const int hi = min(end - t0, kS);

    {  // Phase A. Rows outside [lo, hi) hold stale bytes; phase B masks their scores.
      const uint8_t* row = base + a_token * T::kCodeStride;
      const uint8_t* meta = k_meta + a_token * mb;
      float score[kH];
      float dot[kH];
#pragma unroll
      for (int h = 0; h < kH; ++h) score[h] = dot[h] = 0.0f;
#pragma unroll
      for (int k = 0; k < T::kSliceDim / 8; ++k) {
        const int chunk = a_slice * (T::kSliceDim / 8) + k;
        float x[8];
        LoadCodes8<kDtype>(row, chunk, x);
#pragma unroll
        for (int h = 0; h < kH; ++h) {
          if (h < nh) {
            const float4 q0 = *reinterpret_cast<const float4*>(q_s + h * kHeadDim + chunk * 8);
            const float4 q1 = *reinterpret_cast<const float4*>(q_s + h * kHeadDim + chunk * 8 + 4);
            dot[h] += x[0] * q0.x + x[1] * q0.y + x[2] * q0.z + x[3] * q0.w + x[4] * q1.x +
                      x[5] * q1.y + x[6] * q1.z + x[7] * q1.w;
          }
        }
        if constexpr (T::kQuantized) {
          const int c_last = chunk * 8 + 7;
          if (((c_last + 1) & (seg - 1)) == 0) {  // end of a segment: apply its group's meta
            const float2 sz = LoadMeta(meta, c_last / a.group_size);
            const float* qseg = qseg_s + c_last / seg;
#pragma unroll
            for (int h = 0; h < kH; ++h) {
              score[h] += sz.x * dot[h] + sz.y * qseg[h * (kHeadDim / 16)];
              dot[h] = 0.0f;
            }
          }
        }
      }
      if constexpr (!T::kQuantized) {
#pragma unroll
        for (int h = 0; h < kH; ++h) score[h] = dot[h];
      }
      float4* dst = reinterpret_cast<float4*>(part_s + (a_slice * kS + a_token) * kH);
      dst[0] = make_float4(score[0], score[1], score[2], score[3]);
      dst[1] = make_float4(score[4], score[5], score[6], score[7]);
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < 2; ++k) {  // Phase B
      const int h = warp + 4 * k;
      if (h < nh) {
        float s[2];
        float stage_max = -INFINITY;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = lane + 32 * u;
          s[u] = -INFINITY;
          if (j >= lo && j < hi) {
            float v = 0.0f;
#pragma unroll
            for (int sl = 0; sl < T::kSlices; ++sl) v += part_s[(sl * kS + j) * kH + h];
            s[u] = v * a.score_scale;
          }
          stage_max = fmaxf(stage_max, s[u]);
        }
        const float m_new = fmaxf(m_run[k], GroupMax<32>(stage_max));  // finite: lo < hi
        const float alpha = exp2f(m_run[k] - m_new);
        float p_sum = 0.0f;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = lane + 32 * u;
          const float p = exp2f(s[u] - m_new);
          if (j < kS) prob_s[j * kH + h] = p;
          p_sum += p;
        }
        l_run[k] = l_run[k] * alpha + GroupSum<32>(p_sum);
        m_run[k] = m_new;
        if (lane == 0) alpha_s[h] = alpha;
      }
    }
    __syncthreads();

    // Phase C
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      if (h < nh) {
        const float alpha = alpha_s[h];
        zacc[h] *= alpha;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[h][c] *= alpha;
      }
    }
    for (int j = lo + ((c_set - lo) % T::kTokenSets + T::kTokenSets) % T::kTokenSets; j < hi;
         j += T::kTokenSets) {
      float x[8];
      LoadCodes8<kDtype>(base + (kS + j) * T::kCodeStride, c_chunk, x);
      const float2 sz = T::kQuantized ? LoadMeta(v_meta + j * mb, c_group) : make_float2(1.f, 0.f);
      float p[kH];
      *reinterpret_cast<float4*>(&p[0]) = *reinterpret_cast<const float4*>(prob_s + j * kH);
      *reinterpret_cast<float4*>(&p[4]) = *reinterpret_cast<const float4*>(prob_s + j * kH + 4);
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        if (h < nh) {
          const float ps = T::kQuantized ? p[h] * sz.x : p[h];
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[h][c] += ps * x[c];
          if constexpr (T::kQuantized) zacc[h] += p[h] * sz.y;
        }
      }
    }
  }

  // Reduce the token subsets in a fixed order, so that a call's output does not depend on
  // timing: each subset's sums go to its own slice of shared memory (free once every copy group
  // has landed), then each output sums the slices in subset order.
  CpAsyncWait<0>();
  __syncthreads();
  float* subset_s = reinterpret_cast<float*>(smem);  // [kTokenSets][kH][kHeadDim]
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    if (h < nh) {
      float4* dst =
          reinterpret_cast<float4*>(subset_s + (c_set * kH + h) * kHeadDim + c_chunk * 8);
      dst[0] = make_float4(acc[h][0] + zacc[h], acc[h][1] + zacc[h], acc[h][2] + zacc[h],
                           acc[h][3] + zacc[h]);
      dst[1] = make_float4(acc[h][4] + zacc[h], acc[h][5] + zacc[h], acc[h][6] + zacc[h],
                           acc[h][7] + zacc[h]);
    }
  }
  __syncthreads();
  const float4* subsets = reinterpret_cast<const float4*>(subset_s);
  for (int i = tid; i < nh * kHeadDim / 4; i += kAttnThreads) {
    const int h = i / (kHeadDim / 4);
    const int c4 = i % (kHeadDim / 4);
    float4 sum = subsets[i];  // subset 0
#pragma unroll
    for (int set = 1; set < T::kTokenSets; ++set) {
      const float4 p = subsets[(set * kH + h) * (kHeadDim / 4) + c4];
      sum = make_float4(sum.x + p.x, sum.y + p.y, sum.z + p.z, sum.w + p.w);
    }
    reinterpret_cast<float4*>(o_out + static_cast<size_t>(h) * num_splits * kHeadDim)[c4] = sum;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int h = warp + 4 * k;
    if (h < nh && lane == 0) ml_out[h * num_splits] = make_float2(m_run[k], l_run[k]);
  }
}

template <KvDtype kDtype, int kHeadDim>
KernelStatus LaunchAttentionSplitsGeneral(const AttnSplitArgs& args, int num_seqs,
                                          cudaStream_t stream) {
  using T = SplitTraits<kDtype, kHeadDim>;
  constexpr auto kernel = AttentionSplitKernel<kDtype, kHeadDim>;
  // The cap is the kernel's, on the whole device: set once for the largest meta (groups of 16,
  // the smallest ServesLayout takes), never per launch (one launch's setting could fall between
  // another's setting and its launch, on another lane).
  constexpr int kMaxShared = static_cast<int>(T::SharedBytes(kHeadDim / 16 * 4));
  KVPOOL_CUDA_RETURN_IF_ERROR((AllowDynamicSharedMemory<kernel, kMaxShared>()));
  const size_t smem = T::SharedBytes(static_cast<int>(args.geo.meta_bytes_per_token));
  const dim3 grid(args.plan.num_splits, args.num_kv_heads * args.plan.head_groups, num_seqs);
  return CheckCuda(LaunchDependent(kernel, grid, dim3(kAttnThreads), smem, stream, args),
                   "AttentionSplitKernel");
}

}  // namespace attention_internal
}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_SPLIT_CUH_
