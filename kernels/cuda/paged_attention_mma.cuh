// The tensor-core split kernel of paged decode attention, for layouts with one {scale, zero} per
// (token, head) (group_size == head_dim) and for FP16 pages (paged_attention_split.cuh serves
// the other group sizes; same contract and partial outputs). Launched by
// paged_attention_launch.cuh.
//
// Grid (num_splits, num_kv_heads * head_groups, num_seqs), kMmaWarps (4) warps. The CTA first
// rotates its query heads' q (the layout's block-diagonal Hadamard, as the CUDA-core path's
// RotateQueryKernel does). Then each warp runs on its own: it takes the 16-token tiles w, w + 4,
// w + 8, ... of the CTA's token range, streams them through its own cp.async stages in shared
// memory (16-byte copies, several tiles in flight, no CTA barrier in the loop), scores one to four
// tiles per iteration (kTPI), and keeps its own online-softmax state. Per tile, with
// mma.sync.m16n8k16 (fp16 inputs, fp32 accumulation):
//   scores  with kPT == 2 (5 to 8 query heads): S^T[16 x 8 tokens] = Q'[16 x D] . codes^T, rows
//           0..7 the hi parts of the 8 heads' q' (fp16), rows 8..15 the lo parts (q' - hi in
//           fp16), so row g + row g + 8 is q' . codes to ~2^-22. With kPT == 1 (at most 4
//           heads): S[16 tokens x 8] = codes . Q'^T, K the A operand (one MMA for all 16
//           tokens), column 2 h the hi parts of head h and 2 h + 1 its lo parts, so a lane's two
//           columns sum to its head's score. q' enters times sm_scale (log2 domain). Codes
//           (INT4/INT8 integers, e4m3 values, fp16 values) are exact in fp16. Integer codes
//           enter as fp16 subnormals c 2^-24 (INT4 high nibbles 16 c 2^-24, against q' / 16),
//           their bits masked in place: dot = 2^24 times the sum.
//           score = scale_t * dot + zero_t * sum(q').
//   values  O^T[D x 8 kPT] += codes^T[D x 16 tokens] . P^T[16 tokens x 8 kPT]: the codes are
//           the A operand (16 channels per m16 tile), and the columns of P^T carry the hi / lo
//           parts of p_t * scale_t: with kPT == 1 columns 2 h / 2 h + 1 of head h, as in S;
//           with kPT == 2 n8 tile 0 holds the hi parts of heads 0..7 and tile 1 the lo parts.
//           Integer value codes enter as fp16 subnormals (their bits masked in place, no
//           subtraction), scaled back once at the end (MmaCodec::ChannelScale).
//           sum_t p_t zero_t is accumulated beside in fp32: V stays rotated.
// With kPT == 2 the thread that holds a score in the S^T accumulator holds the same entries of
// P^T as a B operand; with kPT == 1 the P tile (hi and lo parts, fp16) becomes P^T's B operand
// through movmatrix.trans. Scores never leave registers. At the end the four warps' states are
// merged in shared memory into the split's {m, l} and o', or, for a call of one split without
// sinks, into its output (paged_attention_mma_merge.cuh).
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_CUH_

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/cuda/paged_attention_mma_merge.cuh"
#include "kernels/cuda/paged_attention_mma_operands.cuh"
#include "kernels/cuda/paged_attention_mma_query.cuh"
#include "kernels/cuda/paged_attention_split.cuh"

namespace kvpool::cuda {
namespace attention_internal {

// kPT: n8 tiles of P^T, 1 when the CTA serves at most 4 query heads, else 2. kCtasPerSm: the CTAs
// per SM it is built for (AttnSplitPlan::ctas_per_sm).
template <KvDtype kDtype, int kHeadDim, int kPT, int kCtasPerSm>
__global__ void __launch_bounds__(kAttnThreads, kCtasPerSm)
    AttentionSplitMmaKernel(const AttnSplitArgs a) {
  using T = MmaTraits<kDtype, kHeadDim, kCtasPerSm>;
  using C = MmaCodec<kDtype>;
  constexpr int kH = T::kH;
  extern __shared__ __align__(16) uint8_t smem[];

  // The first kernel of the call: what the stream ran before (the pages' appends, the tables,
  // lengths and q) must be complete before anything is read.
  GridDependencyWait();
  AllowDependentLaunch();  // the merge may be scheduled as soon as every split CTA runs
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;    // mma group
  const int tig = lane % 4;  // thread in group
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / a.plan.head_groups;
  const int h_first = (blockIdx.y % a.plan.head_groups) * kH;
  const int nh = min(kH, a.ratio - h_first);
  const int seq = blockIdx.z;
  const int num_splits = a.plan.num_splits;
  const int bt_log2 = a.geo.block_tokens_log2;

  const size_t head_row = static_cast<size_t>(seq) * a.num_q_heads + kv_head * a.ratio + h_first;
  // The loads that do not depend on the sequence's length go out together with it: this CTA's
  // heads of q, and the block ids of the warp's first tiles. A CTA with work begins at
  // max(split * tokens_per_split, sink_tokens) whatever the length (a sequence no longer than
  // its sink leaves every split empty), so its first tiles are known before the length is.
  uint4 q_raw[kQueryLoads<kHeadDim>];
  LoadQuery<kHeadDim>(a, head_row, nh, q_raw);
  const int begin = max(split * a.plan.tokens_per_split, a.sink_tokens);
  const int first_token = begin & ~(kTileTokens - 1);
  const int32_t* table = a.block_tables + static_cast<size_t>(seq) * a.max_blocks_per_seq;
  const int32_t* const table_end = table + a.max_blocks_per_seq;
  const int32_t* table_cursor =  // the entry next_tile_block looks up
      KeepInRegister(table + ((first_token + warp * kTileTokens) >> bt_log2));
  const int table_step = (kMmaWarps * kTileTokens) >> bt_log2;
  // The block id of this warp's next tile (0 past the table; entries past the sequence's last
  // block are loaded but never used): tiles 0, 1, 2, ... in order.
  auto next_tile_block = [&]() -> uint32_t {
    const uint32_t block = table_cursor < table_end ? __ldg(table_cursor) : 0;
    table_cursor += table_step;
    return block;
  };
  // The loop takes kTPI tiles per iteration (tiles i .. i + kTPI - 1 of this warp, tile x in
  // stage x % kStages) while the next kStages - kTPI tiles load: more tiles per iteration mean
  // one softmax update and more independent MMA chains for all of them. As many as half the
  // stages, at most 4 (with eight stages the four tiles scored were queued while the previous
  // four were). With two P^T tiles head_dim 256 keeps 1: its scores' longer single MMA chains
  // moved the GQA-12 log-sum-exp past attention_gpu_test's bound
  // (results/experiments_2026-11-29.md).
  constexpr int kTPI = kPT == 2 && kHeadDim == 256 ? 1 : T::kStages / 2 > 4 ? 4 : T::kStages / 2;
  constexpr int kLead = T::kStages - kTPI;
  uint32_t first_blocks[kLead];
#pragma unroll
  for (int i = 0; i < kLead; ++i) first_blocks[i] = next_tile_block();

  const int len = min(a.seq_lens[seq], a.max_blocks_per_seq << bt_log2);
  const int end = min((split + 1) * a.plan.tokens_per_split, len);
  float2* ml_out = a.part_ml + head_row * num_splits + split;
  float* o_out = a.part_o + (head_row * num_splits + split) * kHeadDim;
  if (begin >= end) {  // nothing quantized here: an empty state (weight 0 in the merge)
    // The call's only split (AttnSplitArgs::out): a zero-length sequence (outside the contract)
    // gets what the merge kernel would write for it.
    if (a.out != nullptr || a.out_fp16 != nullptr) {
      using V = LaneVector<kHeadDim>;
      for (int h = tid / V::kLanes; h < nh; h += V::kVecs) {
        float o[8] = {};
        StoreAttentionRow(o, -INFINITY, 0.0f, head_row + h, tid % V::kLanes, kHeadDim, a.out,
                          a.out_fp16, a.lse);
      }
      return;
    }
    for (int i = tid; i < nh * kHeadDim; i += kAttnThreads) {
      o_out[static_cast<size_t>(i / kHeadDim) * num_splits * kHeadDim + i % kHeadDim] = 0.0f;
    }
    if (tid < nh) ml_out[tid * num_splits] = make_float2(-INFINITY, 0.0f);
    return;
  }

  uint8_t* my_stages = smem + static_cast<size_t>(warp) * T::kStages * T::kTileBytes;
  uint4* qfrag = reinterpret_cast<uint4*>(smem + T::kTilesArea);  // [kSlabs][32]
  float* qsum_s = reinterpret_cast<float*>(qfrag + T::kSlabs * 32);

  const size_t k_offset = static_cast<size_t>(kv_head) * a.geo.head_page_bytes;
  const size_t v_minus_k = static_cast<size_t>(a.num_kv_heads) * a.geo.head_page_bytes;
  const int num_tiles = (end - first_token + kTileTokens - 1) / kTileTokens;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kMmaWarps - 1) / kMmaWarps : 0;

  // A tile's K (then V) code rows are kTileTokens * kCodeBytes contiguous bytes of the page; one
  // pass of the warp's 16-byte copies covers kRowsPerPass rows, so copy j of this lane moves the
  // bytes at lane * 16 + (j % kPassesPerKv) * 512 of K (j < kPassesPerKv) or V, into row
  // copy_row + (j % kPassesPerKv) * kRowsPerPass of the stage.
  static_assert(T::kCodeChunks % 2 == 0, "a pass of 32 copies covers whole rows of one of K|V");
  constexpr int kPassesPerKv = T::kCodeChunks / 2;
  constexpr int kRowsPerPass = 32 / T::kCodeChunks;
  const int copy_row = lane / T::kCodeChunks;
  const int copy_chunk = (lane % T::kCodeChunks) * 16;

  // What a tile's copies need that does not change from tile to tile: the lane's source bytes in
  // a page (K and V) and its destination offsets in a stage; lanes 0..7 also copy 4 tokens' meta
  // each (K, then V). A warp's tiles are kMmaWarps * kTileTokens = 64 tokens apart, a multiple
  // of block_tokens (16, 32 or 64, as table_step assumes): each starts at row in_block of its
  // block.
  const int in_block = (first_token + warp * kTileTokens) & ((1 << bt_log2) - 1);
  const uint8_t* k_src = KeepInRegister(a.pages + k_offset + in_block * T::kCodeBytes + lane * 16);
  const uint8_t* v_src = KeepInRegister(k_src + v_minus_k);
  const int meta_row = (lane % 4) * 4;
  const uint8_t* meta_src = KeepInRegister(a.pages + k_offset + (lane / 4) * v_minus_k +
                                           a.geo.codes_bytes + (in_block + meta_row) * 4);
  const int meta_dst = T::kMetaArea + ((lane / 4) * kTileTokens + meta_row) * 4;
  // 32-bit products: PagedDecodeAttention rejects layer pages of 4 GiB or more.
  const uint32_t layer_page_bytes = static_cast<uint32_t>(a.geo.layer_page_bytes);
  int copy_dst[T::kCodeChunks];
#pragma unroll
  for (int j = 0; j < T::kCodeChunks; ++j) {
    const int row = copy_row + (j % kPassesPerKv) * kRowsPerPass;
    copy_dst[j] = (j < kPassesPerKv ? row * T::kKStride : T::kVArea + row * T::kVStride) +
                  copy_chunk;
  }

  // Enqueues this warp's local tile i (CTA tile warp + 4 i) into stage `stage`: K and V code
  // rows and their meta. `block` is the tile's block id (a tile never crosses a block:
  // block_tokens >= 16), so every row of the tile lies in that block's page. Integer codes are
  // finite whatever their bits, so their tiles copy whole, rows outside [begin, end) included;
  // FP8 and FP16 rows outside [begin, end) are zeroed instead (their bytes could be inf or NaN).
  // Always commits one group per lane.
  auto issue = [&](int i, uint32_t block, int stage) {
    if (i < my_tiles) {
      const int t0 = first_token + (warp + kMmaWarps * i) * kTileTokens;
      uint8_t* base = my_stages + stage * T::kTileBytes;
      const size_t page = static_cast<size_t>(block) * layer_page_bytes;
      const uint8_t* k = k_src + page;
      const uint8_t* v = v_src + page;
      if (C::kIntCodes || (t0 >= begin && t0 + kTileTokens <= end)) {  // no predicate
#pragma unroll
        for (int j = 0; j < T::kCodeChunks; ++j) {
          CpAsync16(base + copy_dst[j], (j < kPassesPerKv ? k : v) + (j % kPassesPerKv) * 512);
        }
      } else {
        const int row_lo = begin - t0;  // rows of tokens in [begin, end): [row_lo, row_hi)
        const int row_hi = end - t0;
#pragma unroll
        for (int j = 0; j < T::kCodeChunks; ++j) {
          const int row = copy_row + (j % kPassesPerKv) * kRowsPerPass;
          CpAsync16OrZero(base + copy_dst[j], (j < kPassesPerKv ? k : v) + (j % kPassesPerKv) * 512,
                          row >= row_lo && row < row_hi);
        }
      }
      if constexpr (T::kQuantized) {
        if (lane < 8 && (C::kIntCodes || t0 + meta_row < end)) {
          CpAsync16(base + meta_dst, meta_src + page);
        }
      }
    }
    CpAsyncCommit();
  };
  uint32_t next_blocks[kTPI];  // the block ids of the tiles the iteration queues
#pragma unroll
  for (int t = 0; t < kTPI; ++t) next_blocks[t] = next_tile_block();
  int load_stage = kLead;  // stage of local tile i + kLead in iteration i
  int use_stage = 0;       // stage of local tile i

  // Prologue: the CTA's q' operands and sums (paged_attention_mma_query.cuh), the first tiles
  // queued once q has arrived.
  StageQueryFragments<kDtype, kHeadDim, kPT, kCtasPerSm>(q_raw, nh, a, qfrag, qsum_s, [&] {
#pragma unroll
    for (int i = 0; i < kLead; ++i) issue(i, first_blocks[i], i);
  });
  // The head whose softmax state this lane keeps: with kPT == 1 the score tile is S[16 tokens x
  // 8 columns], and this lane's columns 2 tig and 2 tig + 1 are the hi and lo parts of head tig, at
  // tokens g and g + 8; with kPT == 2 the tile is S^T, and this lane's row is head g, at tokens
  // 2 tig, 2 tig + 1, 8 + 2 tig and 9 + 2 tig.
  const float qsum = qsum_s[kPT == 1 ? tig : g];
  float m_run = -INFINITY;  // log2 domain; the same in every lane that keeps the head
  float l_run = 0.0f;       // this lane's tokens only
  float z_run = 0.0f;       // sum p_t zero_t, this lane's tokens only
  constexpr float kZeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  // O^T: acc[mt][j] rows g / g + 8 are channels kVChannels g + 2 mt / + 1, columns 2 tig and
  // 2 tig + 1 of P^T tile j.
  float acc[T::kMTiles][kPT][4];
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int j = 0; j < kPT; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
  }
  // This lane's tokens of a tile in the value MMA's B operand (P^T rows): 2 tig, 2 tig + 1,
  // 8 + 2 tig, 9 + 2 tig.
  int tok[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) tok[u] = (u / 2) * 8 + 2 * tig + (u % 2);

  // Values of one tile: O^T += codes^T . P^T, P^T's B fragments pb0 (tokens 2 tig, 2 tig + 1) and
  // pb1 (8 + 2 tig, 9 + 2 tig) per n8 tile. This lane's channels [kVChannels g, +kVChannels) of
  // its 4 token rows, one 32-bit word of each row at a time; rows outside [begin, end) hold
  // finite codes (see issue) against p = 0.
  auto values = [&](const uint8_t* tile, const uint32_t(&pb0)[kPT], const uint32_t(&pb1)[kPT]) {
    const uint8_t* v_codes = tile + T::kVArea;
    const uint32_t* vrow[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      vrow[u] =
          reinterpret_cast<const uint32_t*>(v_codes + tok[u] * T::kVStride + g * (T::kVWords * 4));
    }
#pragma unroll
    for (int w = 0; w < T::kVWords; ++w) {
      uint32_t word[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) word[u] = vrow[u][w];
      uint32_t c01[C::kChPerWord], c23[C::kChPerWord];
      C::PairWord(word[0], word[1], c01);
      C::PairWord(word[2], word[3], c23);
#pragma unroll
      for (int e = 0; e < C::kChPerWord; e += 2) {
        // Channels e and e + 1 of the word are A rows g and g + 8 of m16 tile mt.
        const int mt = (w * C::kChPerWord + e) / 2;
        const uint4 va = make_uint4(c01[e], c01[e + 1], c23[e], c23[e + 1]);
#pragma unroll
        for (int j = 0; j < kPT; ++j) Mma16816(acc[mt][j], va, pb0[j], pb1[j]);
      }
    }
  };
  // Rescales the accumulators when a head's running max moved: columns 2 tig + c of acc by
  // col_alpha[c].
  auto rescale = [&](const float(&col_alpha)[2]) {
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int j = 0; j < kPT; ++j) {
        acc[mt][j][0] *= col_alpha[0];
        acc[mt][j][1] *= col_alpha[1];
        acc[mt][j][2] *= col_alpha[0];
        acc[mt][j][3] *= col_alpha[1];
      }
    }
  };

  for (int i = 0; i < my_tiles; i += kTPI) {
    CpAsyncWait<T::kStages - 2 * kTPI>();
    __syncwarp();  // tiles i.. landed for the whole warp; the previous iteration's stages are free
#pragma unroll
    for (int t = 0; t < kTPI; ++t) {
      issue(i + kLead + t, next_blocks[t], load_stage);
      next_blocks[t] = next_tile_block();
      load_stage = load_stage + 1 == T::kStages ? 0 : load_stage + 1;
    }
    const uint8_t* base[kTPI];
    int t0[kTPI];  // first token of tile t (past `end` for a tile after the warp's last)
#pragma unroll
    for (int t = 0; t < kTPI; ++t) {
      base[t] = my_stages + use_stage * T::kTileBytes;
      use_stage = use_stage + 1 == T::kStages ? 0 : use_stage + 1;
      t0[t] = first_token + (warp + kMmaWarps * (i + t)) * kTileTokens;
    }

    // This lane's slice of each tile's K rows g and 8 + g: the B operand of S^T (kPT == 2) or the
    // A operand of S (kPT == 1), the same registers.
    uint32_t kw[kTPI][2][T::kKSlice / 4];
#pragma unroll
    for (int t = 0; t < kTPI; ++t) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint8_t* row = base[t] + (nt * 8 + g) * T::kKStride + tig * T::kKChunk;
#pragma unroll
        for (int q = 0; q < T::kKChunks; ++q) {
          if constexpr (T::kKChunk == 16) {
            const uint4 c = *reinterpret_cast<const uint4*>(row + 4 * q * T::kKChunk);
            kw[t][nt][4 * q] = c.x;
            kw[t][nt][4 * q + 1] = c.y;
            kw[t][nt][4 * q + 2] = c.z;
            kw[t][nt][4 * q + 3] = c.w;
          } else {
            const uint2 c = *reinterpret_cast<const uint2*>(row + 4 * q * T::kKChunk);
            kw[t][nt][2 * q] = c.x;
            kw[t][nt][2 * q + 1] = c.y;
          }
        }
      }
    }
    bool full = i + kTPI <= my_tiles;
#pragma unroll
    for (int t = 0; t < kTPI; ++t) full = full && t0[t] >= begin && t0[t] + kTileTokens <= end;

    // Scores, then the softmax update and the value MMAs of the iteration's tiles. This lane's
    // softmax entry u of a tile is token entry_token(u) of its head: u * 8 + g of head tig
    // (kPT == 1) or tok[u] of head g (kPT == 2). A tile past the warp's last is scored on
    // whatever its stage holds and selected away below.
    constexpr int kE = kPT == 1 ? 2 : 4;
    auto entry_token = [&](int u) { return kPT == 1 ? u * 8 + g : tok[u]; };
    // The score MMAs' accumulators: [tile][slab parity][4] (kPT == 1) or
    // [tile][n8 tile][kChains][4] (kPT == 2).
    constexpr int kChains = kPT == 2 && kTPI == 1 ? 2 : 1;
    std::conditional_t<kPT == 1, float[kTPI][2][4], float[kTPI][2][kChains][4]> s_acc;
    if constexpr (kPT == 1) {
      // S[16 tokens x 8] = codes . Q'^T per tile, one m16n8k16 per k16 slab (K the A operand,
      // rows g and g + 8 of this lane), even and odd slabs in two chains; Q'^T column 2 h holds
      // the hi parts of head h, column 2 h + 1 its lo parts.
#pragma unroll
      for (int cc = 0; cc < kHeadDim / 32; ++cc) {
        const uint4 qb = qfrag[cc * 32 + lane];
#pragma unroll
        for (int t = 0; t < kTPI; ++t) {
          uint32_t p0[4], p1[4];
          C::UnpackUnit(&kw[t][0][cc * (C::kUnitBytes / 4)], p0);
          C::UnpackUnit(&kw[t][1][cc * (C::kUnitBytes / 4)], p1);
          const uint4 a0 = make_uint4(p0[0], p1[0], p0[1], p1[1]);
          const uint4 a1 = make_uint4(p0[2], p1[2], p0[3], p1[3]);
          if (cc == 0) {
            Mma16816From(s_acc[t][0], a0, qb.x, qb.y, kZeros);
            Mma16816From(s_acc[t][1], a1, qb.z, qb.w, kZeros);
          } else {
            Mma16816(s_acc[t][0], a0, qb.x, qb.y);
            Mma16816(s_acc[t][1], a1, qb.z, qb.w);
          }
        }
      }
    } else {
      // Per tile two n8 tiles of S^T (tokens 0..7, 8..15); this lane's token rows are g and
      // 8 + g. Each n8 tile accumulates in kChains independent chains (with one tile per
      // iteration, the two slabs of a unit, for ILP), each from 0.
#pragma unroll
      for (int cc = 0; cc < kHeadDim / 32; ++cc) {
        const uint4 qa = qfrag[(2 * cc) * 32 + lane];
        const uint4 qb = qfrag[(2 * cc + 1) * 32 + lane];
#pragma unroll
        for (int t = 0; t < kTPI; ++t) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t pairs[4];
            C::UnpackUnit(&kw[t][nt][cc * (C::kUnitBytes / 4)], pairs);
            if (cc == 0) {
              Mma16816From(s_acc[t][nt][0], qa, pairs[0], pairs[1], kZeros);
              if constexpr (kChains == 2) {
                Mma16816From(s_acc[t][nt][1], qb, pairs[2], pairs[3], kZeros);
              } else {
                Mma16816(s_acc[t][nt][0], qb, pairs[2], pairs[3]);
              }
            } else {
              Mma16816(s_acc[t][nt][0], qa, pairs[0], pairs[1]);
              Mma16816(s_acc[t][nt][kChains - 1], qb, pairs[2], pairs[3]);
            }
          }
        }
      }
    }
    // q' . codes of entry u of tile t (integer codes: 2^-24 times it).
    auto score_dot = [&](int t, int u) {
      if constexpr (kPT == 1) {  // columns 2 tig (hi) + 2 tig + 1 (lo), both chains
        return (s_acc[t][0][2 * u] + s_acc[t][0][2 * u + 1]) +
               (s_acc[t][1][2 * u] + s_acc[t][1][2 * u + 1]);
      } else {  // rows g (hi) + g + 8 (lo)
        const float(&sa)[kChains][4] = s_acc[t][u / 2];
        float dot = sa[0][u % 2] + sa[0][2 + u % 2];
        if constexpr (kChains == 2) dot += sa[1][u % 2] + sa[1][2 + u % 2];
        return dot;
      }
    };
    // Rows outside [begin, end) hold finite codes (see issue) and any meta (possibly inf/NaN as
    // floats): their scores and P^T entries are selected away, never multiplied by 0. kFull:
    // every token of the kTPI tiles lies in [begin, end), so there is nothing to select (all but
    // a warp's first and last iterations of a split; warp-uniform).
    auto update = [&](auto full_tag) {
      constexpr bool kFull = decltype(full_tag)::value;
      const uint32_t range = end - begin;
      bool valid[kTPI][kE];
      float s[kTPI][kE];
      // What the running max is taken over: s_t, plus for quantized pages the exponent of token
      // t's V scale (VScaleExponent). The P^T entries p_t scale_t = 2^(s_t - m) scale_t then stay
      // below 2 whatever the scales, with the largest near 1: in fp16 hi / lo parts each keeps its
      // precision relative to the largest weight, as p_t does for FP16 pages. (With the max over
      // s_t alone they are at most the largest scale: with small V scales, 2^-10 and below, the
      // hi / lo parts fell to fp16 subnormals, and the output's error relative to V grew as V
      // shrank.) p_t = 2^(s_t - m) may then pass 1 (up to 2^15): l and z are fp32.
      float key[kTPI][kE];
      uint32_t v_meta[kTPI][kE];  // quantized: the entry's V {scale, zero}, fp16 bits
      float tile_max;
#pragma unroll
      for (int t = 0; t < kTPI; ++t) {
#pragma unroll
        for (int u = 0; u < kE; ++u) {
          valid[t][u] = kFull || static_cast<uint32_t>(t0[t] + entry_token(u) - begin) < range;
          float dot = score_dot(t, u);
          if constexpr (T::kQuantized) {
            const float2 sz = LoadMeta(base[t] + T::kMetaArea + entry_token(u) * 4, 0);
            dot = (sz.x * C::kDotScale) * dot + sz.y * qsum;
            v_meta[t][u] = *reinterpret_cast<const uint32_t*>(base[t] + T::kMetaArea +
                                                              (kTileTokens + entry_token(u)) * 4);
          }
          s[t][u] = valid[t][u] ? dot : -INFINITY;
          key[t][u] = s[t][u];
          if constexpr (T::kQuantized) key[t][u] += VScaleExponent(v_meta[t][u]);
        }
        // A tree, not a chain of dependent maxima.
        float m = fmaxf(key[t][0], key[t][1]);
        if constexpr (kE == 4) m = fmaxf(m, fmaxf(key[t][2], key[t][3]));
        tile_max = t == 0 ? m : fmaxf(tile_max, m);
      }
      // Over the lanes that keep the same head: the 8 of one tig (kPT == 1) or the 4 of one g.
#pragma unroll
      for (int x = kPT == 1 ? 4 : 1; x < (kPT == 1 ? 32 : 4); x <<= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, x));
      }
      // The exact running max, so that the P^T entries stay below 2 (p_t <= 1 for FP16 pages):
      // a max that lagged the tiles' maxima would let them overflow fp16.
      const float m_new = fmaxf(m_run, tile_max);  // finite: tile i has a token in [begin, end)
      const float alpha = Exp2Ftz(m_run - m_new);
      m_run = m_new;
      l_run *= alpha;
      z_run *= alpha;
      if (__any_sync(0xffffffffu, alpha != 1.0f)) {  // rare once the maxima settle
        if constexpr (kPT == 1) {
          rescale({alpha, alpha});  // columns 2 tig and 2 tig + 1 are head tig's
        } else {
          // Column 2 tig (+1) of acc holds the state of the group whose g is that column: its
          // alpha, fetched from lane 4 * column.
          float col_alpha[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            col_alpha[c] = __shfl_sync(0xffffffffu, alpha, 4 * (2 * tig + c));
          }
          rescale(col_alpha);
        }
      }
#pragma unroll
      for (int t = 0; t < kTPI; ++t) {
        if (!kFull && t > 0 && i + t >= my_tiles) break;  // past the warp's last tile
        float ps[kE];                                     // p_t scale_t
#pragma unroll
        for (int u = 0; u < kE; ++u) {
          const float p = Exp2Ftz(s[t][u] - m_new);
          l_run += p;
          ps[u] = p;
          if constexpr (T::kQuantized) {
            const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&v_meta[t][u]));
            ps[u] = valid[t][u] ? p * sz.x : 0.0f;
            z_run += valid[t][u] ? p * sz.y : 0.0f;
          }
        }
        // P^T's B fragments: pb0 for tokens 2 tig, 2 tig + 1 and pb1 for 8 + 2 tig, 9 + 2 tig, of
        // column g, with hi = fp16(ps) and lo = fp16(ps - hi).
        uint32_t pb0[kPT], pb1[kPT];
        if constexpr (kPT == 1) {
          // P rows g and g + 8 (columns 2 tig, 2 tig + 1: hi and lo), transposed.
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const __half hi = __float2half_rn(ps[u]);
            const uint32_t row = PackHalf2(hi, __float2half_rn(ps[u] - __half2float(hi)));
            (u == 0 ? pb0 : pb1)[0] = MovMatrixTrans(row);
          }
        } else {
          // This lane's entries are already P^T's: each pair of tokens rounded to fp16 in one
          // conversion, n8 tile 0 the hi parts and tile 1 the lo parts.
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const __half2 h = __floats2half2_rn(ps[2 * k], ps[2 * k + 1]);
            const float2 hf = __half22float2(h);
            const __half2 l = __floats2half2_rn(ps[2 * k] - hf.x, ps[2 * k + 1] - hf.y);
            (k == 0 ? pb0 : pb1)[0] = *reinterpret_cast<const uint32_t*>(&h);
            (k == 0 ? pb0 : pb1)[1] = *reinterpret_cast<const uint32_t*>(&l);
          }
        }
        values(base[t], pb0, pb1);
      }
    };
    if (full) {
      update(std::true_type{});
    } else {
      update(std::false_type{});
    }
  }

  // The split's {m, l} and o' from the four warps' states, or the call's output
  // (paged_attention_mma_merge.cuh).
  MergeWarpsIntoSplit<kDtype, kHeadDim, kPT, kCtasPerSm>(smem, acc, m_run, l_run, z_run, nh,
                                                         num_splits, o_out, ml_out, a, head_row);
}

}  // namespace attention_internal
}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_MMA_CUH_
