#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "tests/common/attention_batch.h"
#include "tests/common/kv_test_data.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool {
namespace {

using testing::MakeLayout;

using Batch = testing::HostBatch;

// A batch of sequences appended to shuffled blocks of one layer, with its queries.
Batch MakeBatch(const PageLayout& l, int num_q_heads, const std::vector<int32_t>& lens,
                uint64_t seed) {
  Batch b;
  EXPECT_TRUE(testing::MakeHostBatch(l, num_q_heads, lens, testing::Outliers::kOffset, seed, &b));
  return b;
}

struct Expected {
  std::vector<double> out;  // [seqs][q heads][dim]
  std::vector<double> lse;  // [seqs][q heads]
};

// Naive softmax attention in double over K/V rows given by `row(seq, kv, head, t)`.
template <typename RowFn>
Expected NaiveAttention(const Batch& b, RowFn row) {
  const PageLayout& l = b.layout;
  const int ratio = b.num_q_heads / l.num_kv_heads;
  const double sm_scale = b.HostParams(nullptr, nullptr).sm_scale;
  Expected e;
  e.out.assign(b.q.size(), 0.0);
  e.lse.assign(b.seq_lens.size() * b.num_q_heads, 0.0);
  for (size_t s = 0; s < b.seq_lens.size(); ++s) {
    const int len = b.seq_lens[s];
    for (int h = 0; h < b.num_q_heads; ++h) {
      const size_t qi = s * b.num_q_heads + h;
      std::vector<double> scores(len);
      for (int t = 0; t < len; ++t) {
        const std::vector<double> k = row(s, 0, h / ratio, t);
        double dot = 0;
        for (int c = 0; c < l.head_dim; ++c) dot += HalfToFloat(b.q[qi * l.head_dim + c]) * k[c];
        scores[t] = sm_scale * dot;
      }
      const double m = *std::max_element(scores.begin(), scores.end());
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - m));
      for (int t = 0; t < len; ++t) {
        const std::vector<double> v = row(s, 1, h / ratio, t);
        for (int c = 0; c < l.head_dim; ++c) e.out[qi * l.head_dim + c] += scores[t] / sum * v[c];
      }
      e.lse[qi] = m + std::log(sum);
    }
  }
  return e;
}

// Original fp16 row of the batch's input.
std::vector<double> InputRow(const Batch& b, size_t s, int kv, int head, int t) {
  const uint16_t* src = (kv ? b.v[s] : b.k[s]).data() +
                        (static_cast<size_t>(t) * b.layout.num_kv_heads + head) * b.layout.head_dim;
  std::vector<double> x(b.layout.head_dim);
  for (int c = 0; c < b.layout.head_dim; ++c) x[c] = HalfToFloat(src[c]);
  return x;
}

// The stored cache, read back exactly: sink tokens from the input, the rest decoded in double.
Expected ExpectedFromPages(const Batch& b) {
  const PageLayout& l = b.layout;
  return NaiveAttention(b, [&](size_t s, int kv, int head, int t) {
    if (t < l.sink_tokens) return InputRow(b, s, kv, head, t);
    const int block = b.block_tables[s * b.max_blocks_per_seq + t / l.block_tokens];
    return testing::DecodeOriginal(l, b.pages.data(), block, kv, head, t % l.block_tokens);
  });
}

// Per (seq, head) relative L2 error of `out` against `want`, the largest over the batch.
double MaxRelativeError(const Batch& b, const std::vector<float>& out,
                        const std::vector<double>& want) {
  const int dim = b.layout.head_dim;
  double worst = 0;
  for (size_t row = 0; row < out.size() / dim; ++row) {
    double err = 0, norm = 0;
    for (int c = 0; c < dim; ++c) {
      err += std::pow(out[row * dim + c] - want[row * dim + c], 2);
      norm += std::pow(want[row * dim + c], 2);
    }
    worst = std::max(worst, std::sqrt(err / norm));
  }
  return worst;
}

// (dtype, GQA ratio)
class PagedAttentionCpuTest : public ::testing::TestWithParam<std::tuple<KvDtype, int>> {};

TEST_P(PagedAttentionCpuTest, MatchesNaiveAttentionOverTheDequantizedCache) {
  const auto [dtype, ratio] = GetParam();
  for (int sinks : {0, 3}) {
    const PageLayout l = MakeLayout(dtype, dtype == KvDtype::kFp16 ? 0 : 64, 64, 2, 128, 16, sinks);
    const Batch b = MakeBatch(l, 2 * ratio, {1, 17, 50, 16, 93}, 100 + ratio + sinks);
    std::vector<float> out(b.q.size()), lse(b.seq_lens.size() * b.num_q_heads);
    ASSERT_EQ(cpu::PagedDecodeAttention(b.HostParams(out.data(), lse.data())), KernelStatus::kOk);
    const Expected want = ExpectedFromPages(b);
    EXPECT_LT(MaxRelativeError(b, out, want.out), 1e-5) << "sinks " << sinks;
    for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], want.lse[i], 1e-5) << i;

    // Against Dequantize's fp16 output: equal up to fp16 rounding of K and V.
    const Expected from_fp16 = NaiveAttention(b, [&](size_t s, int kv, int head, int t) {
      if (t < l.sink_tokens) return InputRow(b, s, kv, head, t);
      DequantizeParams dp;
      dp.layout = l;
      dp.pages = b.pages.data();
      dp.block_ids = &b.block_tables[s * b.max_blocks_per_seq + t / l.block_tokens];
      dp.num_out_blocks = 1;
      dp.head_begin = head;
      dp.head_end = head + 1;
      std::vector<uint16_t> k(l.block_tokens * l.head_dim), v(k.size());
      dp.k_out = k.data();
      dp.v_out = v.data();
      dp.num_blocks = b.num_blocks;
      EXPECT_EQ(cpu::Dequantize(dp), KernelStatus::kOk);
      const uint16_t* src = (kv ? v : k).data() + (t % l.block_tokens) * l.head_dim;
      std::vector<double> x(l.head_dim);
      for (int c = 0; c < l.head_dim; ++c) x[c] = HalfToFloat(src[c]);
      return x;
    });
    EXPECT_LT(MaxRelativeError(b, out, from_fp16.out), dtype == KvDtype::kFp16 ? 1e-5 : 3e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesAndGqaRatios, PagedAttentionCpuTest,
                         ::testing::Combine(::testing::Values(KvDtype::kFp16, KvDtype::kFp8E4M3,
                                                              KvDtype::kInt8, KvDtype::kInt4),
                                            ::testing::Values(1, 4, 8)),
                         [](const auto& info) {
                           return std::string(testing::DtypeName(std::get<0>(info.param))) +
                                  "_gqa" + std::to_string(std::get<1>(info.param));
                         });

TEST(PagedAttentionCpu, SequenceWithinTheSinksIsExactFp16Attention) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 128, 128, 1, 128, 16, 4);
  const Batch b = MakeBatch(l, 4, {3, 4}, 9);
  std::vector<float> out(b.q.size()), lse(b.seq_lens.size() * b.num_q_heads);
  ASSERT_EQ(cpu::PagedDecodeAttention(b.HostParams(out.data(), lse.data())), KernelStatus::kOk);
  const Expected want = NaiveAttention(
      b, [&](size_t s, int kv, int head, int t) { return InputRow(b, s, kv, head, t); });
  EXPECT_LT(MaxRelativeError(b, out, want.out), 1e-6);
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], want.lse[i], 1e-6) << i;
}

TEST(PagedAttentionCpu, SinksMakeTheFirstTokensExactInLongerSequences) {
  const PageLayout with = MakeLayout(KvDtype::kInt4, 0, 128, 1, 128, 16, 4);
  const PageLayout without = MakeLayout(KvDtype::kInt4, 0, 128, 1, 128, 16, 0);
  const Batch bw = MakeBatch(with, 1, {40}, 4);
  const Batch bo = MakeBatch(without, 1, {40}, 4);
  std::vector<float> ow(bw.q.size()), oo(bo.q.size());
  ASSERT_EQ(cpu::PagedDecodeAttention(bw.HostParams(ow.data(), nullptr)), KernelStatus::kOk);
  ASSERT_EQ(cpu::PagedDecodeAttention(bo.HostParams(oo.data(), nullptr)), KernelStatus::kOk);
  const Expected exact = NaiveAttention(
      bw, [&](size_t s, int kv, int head, int t) { return InputRow(bw, s, kv, head, t); });
  EXPECT_LT(MaxRelativeError(bw, ow, exact.out), MaxRelativeError(bo, oo, exact.out));
}

// The fp16 output is the fp32 output rounded to nearest, element for element; lse is the same.
TEST(PagedAttentionCpu, Fp16OutputIsTheRoundedFp32Output) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 128, 128, 2, 128, 16, 2);
  const Batch b = MakeBatch(l, 4, {37, 5}, 11);
  std::vector<float> out(b.q.size()), lse(2 * 4), lse16(2 * 4, -1.0f);  // 2 seqs x 4 q heads
  ASSERT_EQ(cpu::PagedDecodeAttention(b.HostParams(out.data(), lse.data())), KernelStatus::kOk);
  std::vector<uint16_t> out16(b.q.size(), 0xFFFF);
  PagedDecodeAttentionParams p = b.HostParams(nullptr, lse16.data());
  p.out_fp16 = out16.data();
  ASSERT_EQ(cpu::PagedDecodeAttention(p), KernelStatus::kOk);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out16[i], FloatToHalf(out[i])) << "element " << i;
  }
  EXPECT_EQ(lse16, lse);
}

// Many query heads over a long sequence are scored in passes of fewer heads (64 x 70,000 scores
// pass the kernel's budget): each head's output and lse are those of a call of that head alone.
TEST(PagedAttentionCpu, HeadsScoredInPassesMatchHeadsScoredAlone) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 16, 32, /*num_kv_heads=*/1, /*head_dim=*/32);
  constexpr int kHeads = 64;
  const Batch b = MakeBatch(l, kHeads, {70000}, 13);
  std::vector<float> out(b.q.size()), lse(kHeads);
  ASSERT_EQ(cpu::PagedDecodeAttention(b.HostParams(out.data(), lse.data())), KernelStatus::kOk);
  std::vector<float> alone(l.head_dim);
  float alone_lse = 0;
  for (int h = 0; h < kHeads; ++h) {
    PagedDecodeAttentionParams p = b.HostParams(alone.data(), &alone_lse);
    p.num_q_heads = 1;
    p.q = b.q.data() + static_cast<size_t>(h) * l.head_dim;
    ASSERT_EQ(cpu::PagedDecodeAttention(p), KernelStatus::kOk);
    ASSERT_TRUE(std::equal(alone.begin(), alone.end(), out.begin() + h * l.head_dim)) << h;
    ASSERT_EQ(alone_lse, lse[h]) << h;
  }
}

TEST(PagedAttentionCpu, RejectsInvalidInputsWithoutWriting) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 128, 128, 2, 128, 16, 2);
  const Batch good = MakeBatch(l, 4, {20, 5}, 3);
  std::vector<float> out(good.q.size(), 7.0f);
  std::vector<float> lse(4, 7.0f);
  struct Case {
    const char* what;
    void (*mutate)(Batch&, PagedDecodeAttentionParams&);
  };
  const Case cases[] = {
      {"q heads not a multiple", [](Batch&, PagedDecodeAttentionParams& p) { p.num_q_heads = 3; }},
      {"zero length", [](Batch& b, PagedDecodeAttentionParams&) { b.seq_lens[1] = 0; }},
      {"length past the table", [](Batch& b, PagedDecodeAttentionParams&) { b.seq_lens[1] = 33; }},
      {"block id past the arena",
       [](Batch& b, PagedDecodeAttentionParams&) {
         b.block_tables[1] = static_cast<int32_t>(b.num_blocks);
       }},
      {"negative block id", [](Batch& b, PagedDecodeAttentionParams&) { b.block_tables[2] = -1; }},
      {"sinks without sink pages",
       [](Batch&, PagedDecodeAttentionParams& p) { p.sink_pages = nullptr; }},
      {"bad layout", [](Batch&, PagedDecodeAttentionParams& p) { p.layout.rot_block = 12; }},
      {"tables spanning over 2^30 tokens",
       [](Batch&, PagedDecodeAttentionParams& p) { p.max_blocks_per_seq = 1 << 27; }},
      {"blocks of INT_MAX tokens",  // lengths past INT_MAX - block_tokens overflowed the count
       [](Batch&, PagedDecodeAttentionParams& p) { p.layout.block_tokens = INT_MAX; }},
      {"no output", [](Batch&, PagedDecodeAttentionParams& p) { p.out = nullptr; }},
      {"both outputs",
       [](Batch&, PagedDecodeAttentionParams& p) {
         p.out_fp16 = reinterpret_cast<uint16_t*>(p.out);
       }},
  };
  for (const Case& c : cases) {
    Batch b = good;
    PagedDecodeAttentionParams p = b.HostParams(out.data(), lse.data());
    c.mutate(b, p);
    EXPECT_EQ(cpu::PagedDecodeAttention(p), KernelStatus::kInvalidArgument) << c.what;
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; })) << c.what;
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; })) << c.what;
  }
}

}  // namespace
}  // namespace kvpool
