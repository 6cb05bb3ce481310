// The three KV-cache operations, declared once for both backends (DESIGN.md section 5).
//
// The CPU functions (namespace kvpool::cpu) take host pointers, are the reference the CUDA
// kernels are tested against, and accumulate in double where it matters. The CUDA functions
// (namespace kvpool::cuda, kernels/cuda/) take pointers the device can dereference (device
// memory, or pinned host memory where the device can use host pointers: the CUDA backend passes
// attention's q and outputs that way) and a cudaStream_t passed as void*, enqueue asynchronously
// and check every launch. Both return a KernelStatus and never throw. Nothing here knows about
// gRPC or the store.
//
// fp16 values travel as their IEEE binary16 bit patterns in uint16_t.
#ifndef KVPOOL_KERNELS_KV_KERNELS_H_
#define KVPOOL_KERNELS_KV_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvpool {

enum class KernelStatus : int {
  kOk = 0,
  kInvalidArgument = 1,  // a size, pointer or layout the kernel cannot serve
  kUnsupported = 2,      // a valid combination this backend was not compiled for
  kCudaError = 3,        // a CUDA runtime call or launch failed
};
const char* KernelStatusName(KernelStatus s);

// Rotates, quantizes and writes `num_tokens` tokens of one layer into their page slots.
struct QuantizeAppendParams {
  PageLayout layout;
  const uint16_t* k = nullptr;  // [num_tokens][num_kv_heads][head_dim] fp16
  const uint16_t* v = nullptr;  // [num_tokens][num_kv_heads][head_dim] fp16
  // [num_tokens] slot = block_id * block_tokens + offset in block; a negative slot is skipped.
  const int64_t* slot_mapping = nullptr;
  // [num_tokens] position of the token in its sequence; only read when sink_tokens > 0:
  // tokens with position < sink_tokens are also written in fp16 to the sink page of their block,
  // which must then be one of the first num_sink_blocks.
  const int32_t* positions = nullptr;
  int num_tokens = 0;
  uint8_t* pages = nullptr;  // this layer's base: [num_blocks][layer_page_bytes]
  // This layer's sink base, [num_sink_blocks][sink_page_bytes]: blocks [0, num_sink_blocks) have
  // a sink page. Required iff sink_tokens > 0.
  uint8_t* sink_pages = nullptr;
  int64_t num_blocks = 0;  // arena size, for bounds checks of the slot mapping
  int64_t num_sink_blocks = 0;
};

// The first token of `p` (host slot mapping and positions) whose slot is past the arena, or,
// when the layout keeps sinks, whose position is negative or below sink_tokens in a block without
// a sink page; -1 when every token can be written (negative slots are skipped).
int FirstBadAppendSlot(const QuantizeAppendParams& p);

// Reads blocks back as fp16 in the original (un-rotated) space, for a range of KV heads.
struct DequantizeParams {
  PageLayout layout;
  const uint8_t* pages = nullptr;      // this layer's base: [num_blocks][layer_page_bytes]
  const int32_t* block_ids = nullptr;  // [num_out_blocks]
  int num_out_blocks = 0;
  int head_begin = 0;  // KV heads [head_begin, head_end)
  int head_end = 0;
  uint16_t* k_out = nullptr;  // [num_out_blocks * block_tokens][head_end - head_begin][head_dim]
  uint16_t* v_out = nullptr;  // same shape
  int64_t num_blocks = 0;     // arena size, for bounds checks
  // Output rows (tokens from the first out block's first) that hold tokens: rows from here on
  // are written as zeros, whatever their pages hold (a lease's last block past its written
  // tokens keeps what the block held for an earlier sequence). >= 0.
  int64_t valid_tokens = INT64_MAX;
  // Null, or (layout.sink_tokens > 0) the sink page of out block 0 when that block is a
  // sequence's first, in the memory `pages` is in: its rows [0, sink_tokens) then come from
  // there, the exact fp16 tokens, instead of their quantized rows (16-byte aligned).
  const uint8_t* first_sink_page = nullptr;
};

// Decode attention of one new query per sequence over its paged, quantized KV.
//
// For sequence s, query head h (KV head h / (num_q_heads / num_kv_heads)), and tokens
// t < seq_lens[s] at block_tables[s][t / block_tokens], offset t % block_tokens:
//   o = softmax_t(sm_scale * q . k_t) . v_t,   lse = log(sum_t exp(sm_scale * q . k_t))
// computed on the rotated pages: q' = H.(sign*q), score = sum_g scale_g (q'_g . codes_g) +
// zero_g sum(q'_g); V accumulated in the rotated space and un-rotated once. When sink_tokens > 0
// the first min(sink_tokens, len) tokens come from the fp16 sink page of the first block (one of
// the first num_sink_blocks) instead of the quantized page, merged by log-sum-exp.
struct PagedDecodeAttentionParams {
  PageLayout layout;
  const uint8_t* pages = nullptr;  // this layer's base: [num_blocks][layer_page_bytes]
  // This layer's sink base, [num_sink_blocks][sink_page_bytes]; required iff sink_tokens > 0.
  const uint8_t* sink_pages = nullptr;
  const uint16_t* q = nullptr;          // [num_seqs][num_q_heads][head_dim] fp16, original space
  int num_seqs = 0;
  int num_q_heads = 0;                    // a multiple of num_kv_heads (GQA)
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks_per_seq] block ids
  int max_blocks_per_seq = 0;  // times block_tokens at most kMaxAttentionTableTokens (2^30)
  const int32_t* seq_lens = nullptr;  // [num_seqs], each in [1, max_blocks_per_seq*block_tokens]
  float sm_scale = 0.0f;              // usually 1/sqrt(head_dim)
  float* out = nullptr;               // [num_seqs][num_q_heads][head_dim] fp32, or
  uint16_t* out_fp16 = nullptr;       // the same in fp16 (round to nearest): exactly one of the two
  float* lse = nullptr;               // [num_seqs][num_q_heads] natural log, or null
  int64_t num_blocks = 0;             // arena size, for bounds checks
  int64_t num_sink_blocks = 0;        // blocks with a sink page, for bounds checks of first blocks
  // CUDA only: split-K partials. Size from cuda::AttentionWorkspaceBytes(); 0 splits = auto.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int num_splits = 0;
};

namespace cpu {

[[nodiscard]] KernelStatus QuantizeAppend(const QuantizeAppendParams& p);
[[nodiscard]] KernelStatus Dequantize(const DequantizeParams& p);
[[nodiscard]] KernelStatus PagedDecodeAttention(const PagedDecodeAttentionParams& p);

}  // namespace cpu

namespace cuda {

// True when the library was built with CUDA and a device is visible.
bool Available();
// kOk when QuantizeAppend, Dequantize and PagedDecodeAttention all serve `layout`: head_dim 64,
// 128 or 256, block_tokens 16, 32 or 64, rot_block 0 or 16..128 (at most head_dim), group_size
// a multiple of 16, pages under 4 GiB per layer. kInvalidArgument for an invalid layout,
// kUnsupported otherwise (always without CUDA).
KernelStatus ServesLayout(const PageLayout& layout);
// PagedDecodeAttention takes at most this many sequences and query heads per call (kUnsupported
// past it): its grids carry them as y or z dimensions.
inline constexpr int kMaxAttentionSeqsOrHeads = 65535;
// ... and at most this many splits of the context when num_splits is given (kInvalidArgument
// past it; the automatic count stays far below, and the merge indexes splits in 32 bits).
inline constexpr int kMaxAttentionSplits = 1 << 16;
[[nodiscard]] KernelStatus QuantizeAppend(const QuantizeAppendParams& p, void* stream);
// QuantizeAppend of `num_layers` (1 to kMaxQuantizeLayers) layers in ONE launch: layer i reads
// k and v, and writes pages and sink_pages, i strides (bytes) past p's, rotated with the signs
// of sign_seeds[i] in place of p.layout.sign_seed; everything else (the layout otherwise, the
// slot mapping, positions, tokens and arena sizes) is p's.
inline constexpr int kMaxQuantizeLayers = 32;
struct QuantizeLayerStrides {
  int64_t kv = 0;  // k and v alike
  int64_t pages = 0;
  int64_t sink_pages = 0;
};
[[nodiscard]] KernelStatus QuantizeAppendLayers(const QuantizeAppendParams& p, int num_layers,
                                                const QuantizeLayerStrides& stride,
                                                const uint64_t* sign_seeds, void* stream);
[[nodiscard]] KernelStatus Dequantize(const DequantizeParams& p, void* stream);
// Checks what the CPU reference checks but the device-resident seq_lens and block_tables, whose
// contract (FindBadAttentionSequence) the caller must check on its host copies, as the CUDA
// backend does: a sequence breaking it reads outside the arena or leaves tokens out.
[[nodiscard]] KernelStatus PagedDecodeAttention(const PagedDecodeAttentionParams& p, void* stream);
// Workspace PagedDecodeAttention needs for a batch of this shape (0 splits = auto).
size_t AttentionWorkspaceBytes(const PageLayout& layout, int num_seqs, int num_q_heads,
                               int max_blocks_per_seq, int num_splits);
// What PagedDecodeAttention runs for a batch of this shape (num_splits 0 = auto): the splits of
// the context (each split reads the batch's q again) and the CTAs per SM of the split kernel's
// build (0 without CUDA). num_splits passed back plans the same call again, without the automatic
// count (which costs microseconds for small batches over long contexts).
struct AttentionPlan {
  int num_splits = 1;
  int ctas_per_sm = 0;
};
AttentionPlan PlanAttention(const PageLayout& layout, int num_seqs, int num_q_heads,
                            int max_blocks_per_seq, int num_splits);
// The last CUDA error message seen by a function above that returned kCudaError.
const char* LastErrorMessage();

}  // namespace cuda

}  // namespace kvpool

#endif  // KVPOOL_KERNELS_KV_KERNELS_H_
