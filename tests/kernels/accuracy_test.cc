// Attention accuracy of each cache format against fp64 attention over the original fp32 K/V
// (DESIGN.md section 1): 4096 tokens, one KV head and one query head, head_dim 128, q ~ N(0,1).
// Prints a table; writes it as JSON to $KVPOOL_ACCURACY_JSON when set.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "tests/common/kv_test_data.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool {
namespace {

constexpr int kTokens = 4096;
constexpr int kHeadDim = 128;
constexpr int kBlockTokens = 16;
constexpr int kSeeds = 5;

struct Format {
  std::string name;
  KvDtype dtype;
  int rot_block;
};

const std::vector<Format>& Formats() {
  static const std::vector<Format> formats = {
      {"int4_naive", KvDtype::kInt4, 0},      {"int4_rot16", KvDtype::kInt4, 16},
      {"int4_rot32", KvDtype::kInt4, 32},     {"int4_rot64", KvDtype::kInt4, 64},
      {"int4_rot128", KvDtype::kInt4, 128},   {"int8_rot128", KvDtype::kInt8, 128},
      {"fp8_rot128", KvDtype::kFp8E4M3, 128}, {"fp16", KvDtype::kFp16, 0},
  };
  return formats;
}

const testing::Outliers kGenerators[] = {testing::Outliers::kOffset, testing::Outliers::kRope,
                                         testing::Outliers::kVariance, testing::Outliers::kSpikes};

// fp64 softmax attention of one query over [kTokens][kHeadDim] fp32 K/V.
std::vector<double> ReferenceAttention(const std::vector<float>& q, const testing::KvData& d,
                                       double sm_scale) {
  std::vector<double> scores(kTokens);
  for (int t = 0; t < kTokens; ++t) {
    double dot = 0;
    for (int c = 0; c < kHeadDim; ++c) dot += static_cast<double>(q[c]) * d.k[t * kHeadDim + c];
    scores[t] = sm_scale * dot;
  }
  const double m = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double& s : scores) sum += (s = std::exp(s - m));
  std::vector<double> out(kHeadDim, 0.0);
  for (int t = 0; t < kTokens; ++t) {
    for (int c = 0; c < kHeadDim; ++c) out[c] += scores[t] / sum * d.v[t * kHeadDim + c];
  }
  return out;
}

// Relative L2 error of the CPU backend's attention output for one format and one seed.
double RelativeError(const Format& f, testing::Outliers gen, uint64_t seed) {
  PageLayout l = testing::MakeLayout(f.dtype, f.rot_block, f.dtype == KvDtype::kFp16 ? 0 : 128, 1,
                                     kHeadDim, kBlockTokens);
  const testing::KvData d = testing::MakeKv(kTokens, 1, kHeadDim, gen, seed);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  const int num_blocks = kTokens / kBlockTokens;
  std::vector<uint8_t> pages(static_cast<size_t>(num_blocks) * l.layer_page_bytes());
  std::vector<int64_t> slots(kTokens);
  for (int t = 0; t < kTokens; ++t) slots[t] = t;
  QuantizeAppendParams qp;
  qp.layout = l;
  qp.k = k.data();
  qp.v = v.data();
  qp.slot_mapping = slots.data();
  qp.num_tokens = kTokens;
  qp.pages = pages.data();
  qp.num_blocks = num_blocks;
  EXPECT_EQ(cpu::QuantizeAppend(qp), KernelStatus::kOk);

  const std::vector<uint16_t> q_half = testing::ToHalf(testing::MakeNormal(kHeadDim, seed + 1000));
  const std::vector<float> q = testing::FromHalf(q_half);
  std::vector<int32_t> table(num_blocks);
  for (int b = 0; b < num_blocks; ++b) table[b] = b;
  const int32_t len = kTokens;
  std::vector<float> out(kHeadDim);
  PagedDecodeAttentionParams ap;
  ap.layout = l;
  ap.pages = pages.data();
  ap.q = q_half.data();
  ap.num_seqs = 1;
  ap.num_q_heads = 1;
  ap.block_tables = table.data();
  ap.max_blocks_per_seq = num_blocks;
  ap.seq_lens = &len;
  ap.sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  ap.out = out.data();
  ap.num_blocks = num_blocks;
  EXPECT_EQ(cpu::PagedDecodeAttention(ap), KernelStatus::kOk);

  const std::vector<double> want = ReferenceAttention(q, d, 1.0 / std::sqrt(double{kHeadDim}));
  double err = 0, norm = 0;
  for (int c = 0; c < kHeadDim; ++c) {
    err += (out[c] - want[c]) * (out[c] - want[c]);
    norm += want[c] * want[c];
  }
  return std::sqrt(err / norm);
}

double Median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

TEST(Accuracy, RotationCutsInt4AttentionErrorOnOutlierChannels) {
  // errors[g][f]: median over seeds of the relative L2 error.
  std::vector<std::vector<double>> errors;
  for (testing::Outliers gen : kGenerators) {
    errors.emplace_back();
    for (const Format& f : Formats()) {
      std::vector<double> per_seed;
      for (int s = 0; s < kSeeds; ++s) per_seed.push_back(RelativeError(f, gen, 1 + s));
      errors.back().push_back(Median(per_seed));
    }
  }

  std::printf("relative L2 error of attention output, median of %d seeds (%d tokens, d=%d)\n",
              kSeeds, kTokens, kHeadDim);
  std::printf("%-10s", "generator");
  for (const Format& f : Formats()) std::printf(" %12s", f.name.c_str());
  std::printf("\n");
  for (size_t g = 0; g < errors.size(); ++g) {
    std::printf("%-10s", testing::OutliersName(kGenerators[g]));
    for (double e : errors[g]) std::printf(" %12.3e", e);
    std::printf("\n");
  }
  if (const char* path = std::getenv("KVPOOL_ACCURACY_JSON")) {
    std::ofstream json(path);
    json << "{\"tokens\": " << kTokens << ", \"head_dim\": " << kHeadDim
         << ", \"block_tokens\": " << kBlockTokens << ", \"group_size\": 128, \"seeds\": " << kSeeds
         << ", \"metric\": \"median relative L2 error of attention output\", "
         << "\"errors\": {";
    for (size_t g = 0; g < errors.size(); ++g) {
      json << (g ? ", " : "") << "\"" << testing::OutliersName(kGenerators[g]) << "\": {";
      for (size_t f = 0; f < Formats().size(); ++f) {
        json << (f ? ", " : "") << "\"" << Formats()[f].name << "\": " << errors[g][f];
      }
      json << "}";
    }
    json << "}}\n";
    EXPECT_TRUE(json.good()) << path;
  }

  const auto column = [](const char* name) {
    for (size_t f = 0; f < Formats().size(); ++f) {
      if (Formats()[f].name == name) return f;
    }
    return Formats().size();
  };
  const size_t naive = column("int4_naive"), rot128 = column("int4_rot128");
  EXPECT_GE(errors[0][naive] / errors[0][rot128], 1.5) << "offset";
  EXPECT_GE(errors[1][naive] / errors[1][rot128], 1.5) << "rope";
  EXPECT_GE(errors[2][naive] / errors[2][rot128], 2.5) << "variance";
  // Finer formats are more accurate than INT4 on every generator.
  for (size_t g = 0; g < errors.size(); ++g) {
    EXPECT_LT(errors[g][column("int8_rot128")], errors[g][rot128]) << g;
    EXPECT_LT(errors[g][column("fp16")], errors[g][column("int8_rot128")]) << g;
  }
}

}  // namespace
}  // namespace kvpool
