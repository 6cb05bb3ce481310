// Page layout of the quantized KV cache: the one definition of where every byte of a
// (block, layer) page lives, shared by the CPU reference, the CUDA kernels and the store.
//
// A namespace's arena is layer-major: the page of block `b` for layer `l` starts at
// `layer_base[l] + b * layer_page_bytes()`. Inside a layer page:
//
//   page = [K | V]                      2 halves, K first
//   half = [head 0 | head 1 | ...]      num_kv_heads head pages
//   head page (one (block, layer, K|V, head), contiguous, 16-byte aligned):
//     codes[block_tokens][code_bytes_per_token]   padded to 16 bytes
//     meta [block_tokens][groups] of {fp16 scale, fp16 zero}  (quantized dtypes only), padded
//
// Codes per dtype, for the rotated vector x' of one (token, head):
//   kInt4     asymmetric per group: scale = (max-min)/15, zero = min + 0 (a -0 minimum stored as
//             +0; both stored fp16),
//             code = clamp(rint(fmaf(x', r, fmaf(-zero, r, 128))), 128, 143) - 128 with fp32
//             math on the fp16 scale and zero, r = 1 / scale (IEEE, once per group), each fma
//             rounded once (kernels/cpu/page_codec.h); byte j holds channel 2j in its low
//             nibble, 2j+1 in its high nibble.
//             x' ~= code * scale + zero.
//   kInt8     the same with 255 levels, one byte per channel.
//   kFp8E4M3  symmetric per group: scale = absmax/448 (fp16), zero = 0;
//             code = e4m3(x' * r), r = 1 / scale (round-to-nearest-even, saturating).
//   kFp16     the values themselves (never rotated), no meta.
//
// A scale of 0 (all channels of a group equal) stores code 0 and reproduces `zero` exactly.
//
// Sinks: when sink_tokens > 0, the first sink_tokens tokens of every sequence are also kept in
// fp16, in a separate sink arena laid out like the pages: the sink page of block `b`, layer `l`
// is at `sink_base[l] + b * sink_page_bytes()`, = [K|V][head][sink_tokens][head_dim] fp16. Only
// the first block of a sequence uses its sink page (positions < sink_tokens <= block_tokens), so
// the sink arena covers only the lowest block ids, those a sequence's first block is taken from.
#ifndef KVPOOL_KERNELS_PAGE_LAYOUT_H_
#define KVPOOL_KERNELS_PAGE_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define KVPOOL_HD __host__ __device__ __forceinline__
#else
#define KVPOOL_HD inline
#endif

namespace kvpool {

enum class KvDtype : uint8_t { kFp16 = 0, kFp8E4M3 = 1, kInt8 = 2, kInt4 = 3 };

KVPOOL_HD constexpr size_t AlignUp16(size_t n) { return (n + 15) & ~size_t{15}; }
// Whether p is 16-byte aligned (null is): the kernels' 16-byte loads and stores need it.
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Bits of a value per channel for each dtype.
KVPOOL_HD constexpr int DtypeBits(KvDtype d) {
  return d == KvDtype::kFp16 ? 16 : d == KvDtype::kInt4 ? 4 : 8;
}

struct PageLayout {
  int num_kv_heads = 0;
  int head_dim = 0;      // 64, 128 or 256 on CUDA; any multiple of 16 on the CPU
  int block_tokens = 0;  // tokens per block (16, 32 or 64 on CUDA)
  KvDtype dtype = KvDtype::kInt4;
  int group_size = 0;    // channels per {scale, zero}; divides head_dim (== head_dim: one per token)
  int rot_block = 0;     // block-diagonal Hadamard size (power of two, 16..head_dim); 0 = none
  uint64_t sign_seed = 0;  // seed of the per-channel +-1 vector applied before the Hadamard
  int sink_tokens = 0;   // leading tokens of a sequence also kept in fp16 (0 = none)

  KVPOOL_HD bool quantized() const { return dtype != KvDtype::kFp16; }
  KVPOOL_HD bool rotated() const { return quantized() && rot_block > 0; }
  KVPOOL_HD int groups() const { return quantized() ? head_dim / group_size : 0; }
  KVPOOL_HD size_t code_bytes_per_token() const {
    return static_cast<size_t>(head_dim) * DtypeBits(dtype) / 8;
  }
  KVPOOL_HD size_t meta_bytes_per_token() const { return static_cast<size_t>(groups()) * 4; }
  KVPOOL_HD size_t codes_bytes() const { return AlignUp16(block_tokens * code_bytes_per_token()); }
  KVPOOL_HD size_t meta_bytes() const { return AlignUp16(block_tokens * meta_bytes_per_token()); }
  KVPOOL_HD size_t head_page_bytes() const { return codes_bytes() + meta_bytes(); }
  KVPOOL_HD size_t layer_page_bytes() const { return 2 * num_kv_heads * head_page_bytes(); }
  // kv: 0 = K, 1 = V.
  KVPOOL_HD size_t head_page_offset(int kv, int head) const {
    return (static_cast<size_t>(kv) * num_kv_heads + head) * head_page_bytes();
  }
  KVPOOL_HD size_t sink_page_bytes() const {
    return static_cast<size_t>(2) * num_kv_heads * sink_tokens * head_dim * 2;
  }
  // Byte offset of sink token `t` of (kv, head) inside a sink page.
  KVPOOL_HD size_t sink_offset(int kv, int head, int t) const {
    return ((static_cast<size_t>(kv) * num_kv_heads + head) * sink_tokens + t) * head_dim * 2;
  }
};

// +-1 sign of channel `c` for a layout's sign_seed (splitmix64 of seed and channel). A seed of 0
// means all +1. Identical on host and device.
KVPOOL_HD float RotationSign(uint64_t seed, int c) {
  if (seed == 0) return 1.0f;
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(c + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z & 1) ? -1.0f : 1.0f;
}

// Checks a layout for the CPU backend: positive sizes, head_dim % 16 == 0, group_size divides
// head_dim (and is even for INT4), rot_block a power of two in [16, head_dim] dividing head_dim,
// sink_tokens <= block_tokens. Returns nullptr when valid, else a static message.
const char* ValidatePageLayout(const PageLayout& layout);

// The magnitude bits (sign cleared) of the largest finite fp16 value, 65504.
inline constexpr uint16_t kHalfMaxFiniteBits = 0x7BFF;
// The largest magnitude (fp16 bits, sign cleared) of a K or V value `layout` quantizes: its
// rotation (orthonormal, by blocks of rot_block) sums up to sqrt(rot_block) times that into one
// rotated value, which the page's fp16 meta (zero, scale) must hold: 65504 / sqrt(rot_block)
// rounded down (larger values would store an infinite zero). Unrotated quantized values decode
// up to 2^-10 of their magnitude past it (the fp16 scale's rounding), which must stay finite in
// an fp16 read: 65440. FP16 pages unrotated: kHalfMaxFiniteBits.
uint16_t MaxInputHalfBits(const PageLayout& layout);
// The largest magnitude (fp16 bits, sign cleared) of a query value PagedDecodeAttention takes at
// `sm_scale`: the CUDA kernels carry q' sm_scale log2(e) in fp16 operands, q' the rotated query
// (up to sqrt(rot_block) times |q|, as above); kHalfMaxFiniteBits when every finite query
// passes (sm_scale 0 included), 0 when only zeros do.
uint16_t MaxQueryHalfBits(const PageLayout& layout, float sm_scale);

// The index of the first of ids[0, n) outside [0, num_blocks), or -1 when all are in range. A
// decode call's tables hold thousands of ids: one branch-free pass over fixed-size chunks (which
// the compiler vectorizes) finds whether any is bad before the culprit is looked for.
int FirstBlockIdOutOfRange(const int32_t* ids, int n, int64_t num_blocks);

// The most tokens a decode attention call's block table may span per sequence,
// max_blocks_per_seq * block_tokens: token positions and split ranges then stay in int.
inline constexpr int64_t kMaxAttentionTableTokens = int64_t{1} << 30;
// Whether tables of max_blocks_per_seq blocks span [1, kMaxAttentionTableTokens] tokens.
bool AttentionTableSpanOk(const PageLayout& layout, int max_blocks_per_seq);

// A sequence of a decode attention call (PagedDecodeAttentionParams) that breaks the call's
// contract: its length outside [1, max_blocks_per_seq * block_tokens] (block -1), or the id at
// `block` of its table row outside [0, num_blocks), or (block 0) its first block outside
// [0, num_sink_blocks) when the layout keeps sinks. seq -1: none does.
struct BadAttentionSequence {
  int seq = -1;
  int block = -1;
};
// The first such sequence of the call's host arrays. Requires AttentionTableSpanOk.
BadAttentionSequence FindBadAttentionSequence(const PageLayout& layout, const int32_t* seq_lens,
                                              const int32_t* block_tables, int num_seqs,
                                              int max_blocks_per_seq, int64_t num_blocks,
                                              int64_t num_sink_blocks);

}  // namespace kvpool

#endif  // KVPOOL_KERNELS_PAGE_LAYOUT_H_
