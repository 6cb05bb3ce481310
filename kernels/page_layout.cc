#include "kernels/page_layout.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"

namespace kvpool {

// group_size and rot_block only mean something for quantized dtypes, so they are checked only
// then (an FP16 layer of a namespace may carry the namespace's rotation settings).
const char* ValidatePageLayout(const PageLayout& layout) {
  if (layout.num_kv_heads <= 0) return "num_kv_heads must be positive";
  if (layout.head_dim <= 0 || layout.head_dim % 16 != 0) {
    return "head_dim must be a positive multiple of 16";
  }
  if (layout.block_tokens <= 0) return "block_tokens must be positive";
  if (static_cast<int>(layout.dtype) > static_cast<int>(KvDtype::kInt4)) return "unknown dtype";
  if (layout.sink_tokens < 0 || layout.sink_tokens > layout.block_tokens) {
    return "sink_tokens must be in [0, block_tokens]";
  }
  if (!layout.quantized()) return nullptr;
  if (layout.group_size <= 0 || layout.head_dim % layout.group_size != 0) {
    return "group_size must divide head_dim";
  }
  if (layout.dtype == KvDtype::kInt4 && layout.group_size % 2 != 0) {
    return "group_size must be even for INT4";
  }
  const int b = layout.rot_block;
  if (b != 0) {
    if (b < 16 || b > layout.head_dim || (b & (b - 1)) != 0 || layout.head_dim % b != 0) {
      return "rot_block must be 0 or a power of two in [16, head_dim] dividing head_dim";
    }
  }
  return nullptr;
}

namespace {

// The fp16 bits of the largest fp16 value at most `bound` (> 0), at most 65504.
uint16_t HalfBitsAtMost(float bound) {
  if (bound >= 65504.0f) return kHalfMaxFiniteBits;
  uint16_t bits = FloatToHalf(bound);
  if (HalfToFloat(bits) > bound) --bits;  // positive fp16 bits order like their values
  return bits;
}

float RotationGain(const PageLayout& layout) {
  return layout.rotated() ? std::sqrt(static_cast<float>(layout.rot_block)) : 1.0f;
}

}  // namespace

uint16_t MaxInputHalfBits(const PageLayout& layout) {
  if (!layout.rotated() && layout.dtype != KvDtype::kFp16) {
    // Decoded values pass their row's range by up to the fp16 scale's rounding, 2^-11 of the
    // range, at most 2^-10 of the largest magnitude: kept free below 65504.
    return HalfBitsAtMost(65504.0f / (1.0f + 1.0f / 1024.0f));
  }
  return HalfBitsAtMost(65504.0f / RotationGain(layout));
}

uint16_t MaxQueryHalfBits(const PageLayout& layout, float sm_scale) {
  constexpr float kLog2e = 1.44269504f;
  return HalfBitsAtMost(65504.0f / (RotationGain(layout) * sm_scale * kLog2e));
}

int FirstBlockIdOutOfRange(const int32_t* ids, int n, int64_t num_blocks) {
  // As unsigned, a negative id is at least 2^31 and fails the one comparison too.
  const uint32_t limit =
      static_cast<uint32_t>(std::clamp<int64_t>(num_blocks, 0, int64_t{INT32_MAX} + 1));
  constexpr int kChunk = 64;
  uint32_t bad = 0;
  int i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    for (int j = 0; j < kChunk; ++j) bad |= static_cast<uint32_t>(ids[i + j]) >= limit;
  }
  for (; i < n; ++i) bad |= static_cast<uint32_t>(ids[i]) >= limit;
  if (bad == 0) return -1;
  i = 0;
  while (static_cast<uint32_t>(ids[i]) < limit) ++i;
  return i;
}

int FirstBadAppendSlot(const QuantizeAppendParams& p) {
  const PageLayout& l = p.layout;
  const int64_t num_slots = p.num_blocks * l.block_tokens;
  const int64_t sink_slots = p.num_sink_blocks * l.block_tokens;
  for (int t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    if (slot >= num_slots) return t;
    if (l.sink_tokens > 0 &&
        (p.positions[t] < 0 || (p.positions[t] < l.sink_tokens && slot >= sink_slots))) {
      return t;
    }
  }
  return -1;
}

const char* KernelStatusName(KernelStatus s) {
  switch (s) {
    case KernelStatus::kOk:
      return "OK";
    case KernelStatus::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case KernelStatus::kUnsupported:
      return "UNSUPPORTED";
    case KernelStatus::kCudaError:
      return "CUDA_ERROR";
  }
  return "UNKNOWN";
}

bool AttentionTableSpanOk(const PageLayout& layout, int max_blocks_per_seq) {
  return max_blocks_per_seq > 0 && layout.block_tokens > 0 &&
         static_cast<int64_t>(max_blocks_per_seq) * layout.block_tokens <= kMaxAttentionTableTokens;
}

BadAttentionSequence FindBadAttentionSequence(const PageLayout& layout, const int32_t* seq_lens,
                                              const int32_t* block_tables, int num_seqs,
                                              int max_blocks_per_seq, int64_t num_blocks,
                                              int64_t num_sink_blocks) {
  const int max_len = max_blocks_per_seq * layout.block_tokens;  // AttentionTableSpanOk
  const int64_t first_limit = layout.sink_tokens > 0 ? num_sink_blocks : num_blocks;
  for (int s = 0; s < num_seqs; ++s) {
    const int len = seq_lens[s];
    if (len < 1 || len > max_len) return {s, -1};
    const int32_t* row = block_tables + static_cast<size_t>(s) * max_blocks_per_seq;
    if (FirstBlockIdOutOfRange(row, 1, first_limit) == 0) return {s, 0};
    const int b = FirstBlockIdOutOfRange(row, (len + layout.block_tokens - 1) / layout.block_tokens,
                                         num_blocks);
    if (b >= 0) return {s, b};
  }
  return {};
}

}  // namespace kvpool
