// CPU-reference view of what the pool should hold for one sequence: its K/V quantized with
// cpu::QuantizeAppend into local pages (block i of the sequence = local block i), and the
// reference Dequantize / PagedDecodeAttention over them. Header-only.
#ifndef KVPOOL_TESTS_INTEGRATION_REFERENCE_PAGES_H_
#define KVPOOL_TESTS_INTEGRATION_REFERENCE_PAGES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "service/store/namespace_config.h"

namespace kvpool::testing {

class ReferencePages {
 public:
  ReferencePages(const NamespaceConfig& c, int max_blocks) : c_(c), max_blocks_(max_blocks) {
    for (int l = 0; l < c.num_layers; ++l) {
      pages_.emplace_back(static_cast<size_t>(max_blocks) * LayerLayout(c, l).layer_page_bytes());
    }
  }

  // Quantizes tokens [begin, begin + n) of `layer` (k/v point at token `begin`).
  void Append(int layer, int begin, int n, const uint16_t* k, const uint16_t* v) {
    std::vector<int64_t> slots(n);
    std::vector<int32_t> positions(n);
    for (int i = 0; i < n; ++i) slots[i] = positions[i] = begin + i;
    QuantizeAppendParams p;
    p.layout = LayerLayout(c_, layer);
    p.k = k;
    p.v = v;
    p.slot_mapping = slots.data();
    p.positions = positions.data();
    p.num_tokens = n;
    p.pages = pages_[layer].data();
    p.num_blocks = max_blocks_;
    ASSERT_EQ(cpu::QuantizeAppend(p), KernelStatus::kOk);
  }

  const std::vector<uint8_t>& pages(int layer) const { return pages_[layer]; }

  // fp16 K and V of blocks [0, blocks) of `layer`, all heads.
  void Dequantize(int layer, int blocks, std::vector<uint16_t>* k, std::vector<uint16_t>* v) {
    std::vector<int32_t> ids(blocks);
    for (int i = 0; i < blocks; ++i) ids[i] = i;
    const size_t n = static_cast<size_t>(blocks) * c_.block_tokens * c_.num_kv_heads * c_.head_dim;
    k->assign(n, 0);
    v->assign(n, 0);
    DequantizeParams p;
    p.layout = LayerLayout(c_, layer);
    p.pages = pages_[layer].data();
    p.block_ids = ids.data();
    p.num_out_blocks = blocks;
    p.head_begin = 0;
    p.head_end = c_.num_kv_heads;
    p.k_out = k->data();
    p.v_out = v->data();
    p.num_blocks = max_blocks_;
    ASSERT_EQ(cpu::Dequantize(p), KernelStatus::kOk);
  }

  // Reference attention of one query over the first `len` tokens of `layer`.
  void Attend(int layer, int len, int num_q_heads, float sm_scale, const uint16_t* q,
              std::vector<float>* out, std::vector<float>* lse) {
    std::vector<int32_t> table(max_blocks_);
    for (int i = 0; i < max_blocks_; ++i) table[i] = i;
    out->assign(static_cast<size_t>(num_q_heads) * c_.head_dim, 0.f);
    lse->assign(num_q_heads, 0.f);
    PagedDecodeAttentionParams p;
    p.layout = LayerLayout(c_, layer);
    p.pages = pages_[layer].data();
    p.q = q;
    p.num_seqs = 1;
    p.num_q_heads = num_q_heads;
    p.block_tables = table.data();
    p.max_blocks_per_seq = max_blocks_;
    p.seq_lens = &len;
    p.sm_scale = sm_scale;
    p.out = out->data();
    p.lse = lse->data();
    p.num_blocks = max_blocks_;
    ASSERT_EQ(cpu::PagedDecodeAttention(p), KernelStatus::kOk);
  }

 private:
  const NamespaceConfig c_;
  const int max_blocks_;
  std::vector<std::vector<uint8_t>> pages_;  // [layer][max_blocks * layer_page_bytes]
};

// Attention in double over unquantized fp16 K/V [tokens][kv_heads][head_dim] (the accuracy
// yardstick for the quantized pool).
inline std::vector<float> Fp16Attention(const uint16_t* q, int num_q_heads, const uint16_t* k,
                                        const uint16_t* v, int tokens, int kv_heads, int head_dim,
                                        float sm_scale) {
  std::vector<float> out(static_cast<size_t>(num_q_heads) * head_dim);
  const int group = num_q_heads / kv_heads;
  for (int h = 0; h < num_q_heads; ++h) {
    const int kh = h / group;
    std::vector<double> s(tokens);
    double mx = -1e300;
    for (int t = 0; t < tokens; ++t) {
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) {
        dot += static_cast<double>(HalfToFloat(q[h * head_dim + d])) *
               HalfToFloat(k[(static_cast<size_t>(t) * kv_heads + kh) * head_dim + d]);
      }
      s[t] = dot * sm_scale;
      mx = std::max(mx, s[t]);
    }
    double z = 0;
    for (double& x : s) z += (x = std::exp(x - mx));
    for (int d = 0; d < head_dim; ++d) {
      double acc = 0;
      for (int t = 0; t < tokens; ++t) {
        acc += s[t] * HalfToFloat(v[(static_cast<size_t>(t) * kv_heads + kh) * head_dim + d]);
      }
      out[h * head_dim + d] = static_cast<float>(acc / z);
    }
  }
  return out;
}

// ||a - b|| / ||b||.
inline double RelativeL2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_INTEGRATION_REFERENCE_PAGES_H_
