// A paged decode batch built on host by the CPU reference, shared by the CPU attention test and
// the GPU attention test (which copies it to the device). Header-only, no CUDA.
#ifndef KVPOOL_TESTS_COMMON_ATTENTION_BATCH_H_
#define KVPOOL_TESTS_COMMON_ATTENTION_BATCH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"

namespace kvpool::testing {

// A decode batch on host: pages written by cpu::QuantizeAppend from fresh K/V with outlier
// channels (the fp16 inputs are kept), scattered block tables (a random permutation of the
// arena), queries, and a params struct whose pointers are the host copies.
struct HostBatch {
  PageLayout layout;
  int num_q_heads = 0;
  std::vector<int32_t> seq_lens;
  int max_blocks_per_seq = 0;
  int64_t num_blocks = 0;
  std::vector<int32_t> block_tables;  // [num_seqs][max_blocks_per_seq]
  std::vector<uint8_t> pages;         // [num_blocks][layer_page_bytes]
  std::vector<uint8_t> sink_pages;    // [num_blocks][sink_page_bytes]: every block has one
  std::vector<uint16_t> q;            // [num_seqs][num_q_heads][head_dim]
  std::vector<std::vector<uint16_t>> k, v;  // per seq [len][num_kv_heads][head_dim] fp16

  PagedDecodeAttentionParams HostParams(float* out, float* lse) const {
    PagedDecodeAttentionParams p;
    p.layout = layout;
    p.pages = pages.data();
    p.sink_pages = sink_pages.empty() ? nullptr : sink_pages.data();
    p.num_sink_blocks = sink_pages.empty() ? 0 : num_blocks;
    p.q = q.data();
    p.num_seqs = static_cast<int>(seq_lens.size());
    p.num_q_heads = num_q_heads;
    p.block_tables = block_tables.data();
    p.max_blocks_per_seq = max_blocks_per_seq;
    p.seq_lens = seq_lens.data();
    p.sm_scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
    p.out = out;
    p.lse = lse;
    p.num_blocks = num_blocks;
    return p;
  }
};

// Builds a batch; returns false when cpu::QuantizeAppend rejects it. `spare_blocks` unused blocks
// are mixed into the arena so that tables are scattered and not dense; `edit_kv`, when set,
// changes each sequence's K/V ([len][num_kv_heads][head_dim] floats) before it is stored.
inline bool MakeHostBatch(const PageLayout& layout, int num_q_heads,
                          const std::vector<int32_t>& seq_lens, Outliers outliers, uint64_t seed,
                          HostBatch* b, int spare_blocks = 7,
                          const std::function<void(KvData&)>& edit_kv = nullptr) {
  b->layout = layout;
  b->num_q_heads = num_q_heads;
  b->seq_lens = seq_lens;
  const int bt = layout.block_tokens;
  int total_blocks = 0;
  b->max_blocks_per_seq = 1;
  for (int len : seq_lens) {
    const int blocks = (len + bt - 1) / bt;
    total_blocks += blocks;
    b->max_blocks_per_seq = std::max(b->max_blocks_per_seq, blocks);
  }
  b->num_blocks = total_blocks + spare_blocks;
  std::vector<int32_t> ids(b->num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed ^ 0x5eedull);
  std::shuffle(ids.begin(), ids.end(), rng);
  const size_t num_seqs = seq_lens.size();
  // Unused table entries point past the arena: the kernels must never read them.
  b->block_tables.assign(num_seqs * b->max_blocks_per_seq,
                         static_cast<int32_t>(b->num_blocks + 1000));
  b->pages.assign(static_cast<size_t>(b->num_blocks) * layout.layer_page_bytes(), 0xA5);
  if (layout.sink_tokens > 0) {
    b->sink_pages.assign(static_cast<size_t>(b->num_blocks) * layout.sink_page_bytes(), 0);
  } else {
    b->sink_pages.clear();
  }
  b->k.clear();
  b->v.clear();
  size_t next = 0;
  for (size_t s = 0; s < num_seqs; ++s) {
    const int len = seq_lens[s];
    KvData kv = MakeKv(len, layout.num_kv_heads, layout.head_dim, outliers, seed + 17 * s);
    if (edit_kv) edit_kv(kv);
    std::vector<int64_t> slots(len);
    std::vector<int32_t> positions(len);
    for (int t = 0; t < len; ++t) {
      if (t % bt == 0) b->block_tables[s * b->max_blocks_per_seq + t / bt] = ids[next++];
      slots[t] =
          static_cast<int64_t>(b->block_tables[s * b->max_blocks_per_seq + t / bt]) * bt + t % bt;
      positions[t] = t;
    }
    b->k.push_back(ToHalf(kv.k));
    b->v.push_back(ToHalf(kv.v));
    QuantizeAppendParams qp;
    qp.layout = layout;
    qp.k = b->k.back().data();
    qp.v = b->v.back().data();
    qp.slot_mapping = slots.data();
    qp.positions = positions.data();
    qp.num_tokens = len;
    qp.pages = b->pages.data();
    qp.sink_pages = b->sink_pages.empty() ? nullptr : b->sink_pages.data();
    qp.num_blocks = b->num_blocks;
    qp.num_sink_blocks = b->sink_pages.empty() ? 0 : b->num_blocks;
    if (cpu::QuantizeAppend(qp) != KernelStatus::kOk) return false;
  }
  b->q = ToHalf(MakeNormal(num_seqs * num_q_heads * layout.head_dim, seed * 31 + 7));
  return true;
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_COMMON_ATTENTION_BATCH_H_
