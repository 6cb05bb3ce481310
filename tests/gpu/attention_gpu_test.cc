// cuda::PagedDecodeAttention against the CPU reference cpu::PagedDecodeAttention, on pages the
// CPU reference quantized from fresh random K/V with outlier channels, scattered block tables,
// variable lengths, GQA, sinks, and every compiled head_dim / block_tokens / dtype.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/attention_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvpool {
namespace {

using testing::DeviceBuffer;
using testing::HostBatch;
using testing::KvData;
using testing::MakeHostBatch;
using testing::Outliers;

constexpr double kMaxRelError = 1e-3;
constexpr double kMaxLseError = 1e-3;

PageLayout Layout(KvDtype dtype, int head_dim, int block_tokens, int num_kv_heads = 2) {
  PageLayout l;
  l.num_kv_heads = num_kv_heads;
  l.head_dim = head_dim;
  l.block_tokens = block_tokens;
  l.dtype = dtype;
  l.group_size = head_dim;
  l.rot_block = dtype == KvDtype::kFp16 ? 0 : std::min(head_dim, 128);
  l.sign_seed = 0x1234abcdull;
  return l;
}

struct Errors {
  double out_rel = 0.0;  // max over (seq, head) rows of max|gpu - cpu| / max|cpu|
  double lse_abs = 0.0;  // max |gpu - cpu| of lse
  // Elements of the GPU's fp16 output that are not its fp32 output rounded to nearest: none, as
  // both runs sum in the same fixed order (no atomics), so their fp32 values are the same.
  size_t fp16_not_rounded = 0;
};

// Runs both backends on `b` (GPU with `num_splits`, 0 = auto) and compares them.
Errors Compare(const HostBatch& b, int num_splits = 0) {
  const int num_seqs = static_cast<int>(b.seq_lens.size());
  const int dim = b.layout.head_dim;
  const size_t rows = static_cast<size_t>(num_seqs) * b.num_q_heads;
  std::vector<float> ref_out(rows * dim), ref_lse(rows);
  const PagedDecodeAttentionParams host = b.HostParams(ref_out.data(), ref_lse.data());
  EXPECT_EQ(cpu::PagedDecodeAttention(host), KernelStatus::kOk);

  DeviceBuffer pages(b.pages), sink_pages(b.sink_pages), q(b.q), tables(b.block_tables),
      lens(b.seq_lens), out(rows * dim * sizeof(float)), lse(rows * sizeof(float));
  PagedDecodeAttentionParams dev = host;
  dev.pages = pages.get<uint8_t>();
  dev.sink_pages = sink_pages.get<uint8_t>();
  dev.q = q.get<uint16_t>();
  dev.block_tables = tables.get<int32_t>();
  dev.seq_lens = lens.get<int32_t>();
  dev.out = out.get<float>();
  dev.lse = lse.get<float>();
  dev.num_splits = num_splits;
  DeviceBuffer workspace(cuda::AttentionWorkspaceBytes(b.layout, num_seqs, b.num_q_heads,
                                                       b.max_blocks_per_seq, num_splits));
  dev.workspace = workspace.get();
  dev.workspace_bytes = workspace.bytes();
  const KernelStatus st = cuda::PagedDecodeAttention(dev, nullptr);
  EXPECT_EQ(st, KernelStatus::kOk) << cuda::LastErrorMessage();
  KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got_out = out.ToHost<float>(), got_lse = lse.ToHost<float>();

  // The same call with fp16 output: the fp32 result rounded to nearest, element for element.
  DeviceBuffer out16(rows * dim * sizeof(uint16_t));
  KVPOOL_CUDA_CHECK(cudaMemset(out16.get(), 0xFF, out16.bytes()));
  dev.out = nullptr;
  dev.out_fp16 = out16.get<uint16_t>();
  EXPECT_EQ(cuda::PagedDecodeAttention(dev, nullptr), KernelStatus::kOk)
      << cuda::LastErrorMessage();
  KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got_out16 = out16.ToHost<uint16_t>();

  Errors e;
  for (size_t i = 0; i < got_out.size(); ++i) {
    e.fp16_not_rounded += got_out16[i] != FloatToHalf(got_out[i]) ? 1 : 0;
  }
  for (size_t r = 0; r < rows; ++r) {
    double max_ref = 0.0, max_diff = 0.0;
    for (int c = 0; c < dim; ++c) {
      const double ref = ref_out[r * dim + c];
      const double got = got_out[r * dim + c];
      max_ref = std::max(max_ref, std::abs(ref));
      max_diff = std::max(max_diff, std::isfinite(got) ? std::abs(got - ref) : 1e30);
    }
    e.out_rel = std::max(e.out_rel, max_diff / max_ref);
    const double lse_diff = std::abs(static_cast<double>(got_lse[r]) - ref_lse[r]);
    e.lse_abs = std::max(e.lse_abs, std::isfinite(got_lse[r]) ? lse_diff : 1e30);
  }
  return e;
}

std::string Name(const PageLayout& l, int ratio) {
  return "dtype=" + std::to_string(static_cast<int>(l.dtype)) +
         " head_dim=" + std::to_string(l.head_dim) +
         " block_tokens=" + std::to_string(l.block_tokens) +
         " group=" + std::to_string(l.group_size) + " rot=" + std::to_string(l.rot_block) +
         " sinks=" + std::to_string(l.sink_tokens) + " ratio=" + std::to_string(ratio);
}

void ExpectBatchMatchesReference(const HostBatch& b, int num_splits = 0) {
  const int ratio = b.num_q_heads / b.layout.num_kv_heads;
  const Errors e = Compare(b, num_splits);
  EXPECT_LE(e.out_rel, kMaxRelError) << Name(b.layout, ratio) << " splits=" << num_splits;
  EXPECT_LE(e.lse_abs, kMaxLseError) << Name(b.layout, ratio) << " splits=" << num_splits;
  EXPECT_EQ(e.fp16_not_rounded, 0u)
      << Name(b.layout, ratio) << " splits=" << num_splits << ": fp16 output not the fp32 rounded";
}

void ExpectMatchesReference(const PageLayout& layout, int ratio, const std::vector<int32_t>& lens,
                            Outliers outliers, uint64_t seed, int num_splits = 0) {
  HostBatch b;
  ASSERT_TRUE(MakeHostBatch(layout, layout.num_kv_heads * ratio, lens, outliers, seed, &b))
      << Name(layout, ratio);
  ExpectBatchMatchesReference(b, num_splits);
}

constexpr KvDtype kAllDtypes[] = {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3,
                                  KvDtype::kFp16};

TEST(CudaPagedAttention, MatchesReferenceForEveryDtypeHeadDimAndBlockSize) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (KvDtype dtype : kAllDtypes) {
    for (int head_dim : {64, 128, 256}) {
      for (int bt : {16, 32, 64}) {
        // Lengths: a single token, a non-multiple of the block, several stages and splits.
        ExpectMatchesReference(Layout(dtype, head_dim, bt), 4, {1, 3 * bt + 5, 777, 2 * bt},
                               Outliers::kOffset, ++seed);
      }
    }
  }
}

TEST(CudaPagedAttention, SharesPagesAcrossGqaRatios) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 200;
  for (KvDtype dtype : kAllDtypes) {
    // 2 and 7 as in Gemma-2 and Qwen2.5-7B (7: 8-head CTAs with one head unused); 12: two CTAs
    // per KV head, the second one partial.
    for (int ratio : {1, 2, 4, 7, 8, 12}) {
      ExpectMatchesReference(Layout(dtype, 128, 16, 2), ratio, {513, 64, 1000}, Outliers::kRope,
                             ++seed);
    }
  }
}

// INT4 at head_dim 128 runs one of two builds of its split kernel (AttnHasDeepBuild): the deep
// build (three CTAs per SM) for more than 4 query heads per KV head, as in the GQA test above, or
// for CTAs of at least kAttnDeepMinTokens tokens (one split over 5000 here), unless it would need
// more rounds than the four-CTA build, as 200 sequences x 2 KV heads x 1 split do here (400 and
// 800 CTAs).
TEST(CudaPagedAttention, Int4Head128BuildsMatchTheReference) {
  KVPOOL_SKIP_WITHOUT_GPU();
  const PageLayout l = Layout(KvDtype::kInt4, 128, 16, 2);
  ExpectMatchesReference(l, 4, {5000, 4097, 33}, Outliers::kSpikes, 245, /*num_splits=*/1);
  std::vector<int32_t> lens(200);
  for (size_t i = 0; i < lens.size(); ++i) lens[i] = 1 + static_cast<int32_t>(i * 37 % 300);
  for (int ratio : {8, 12}) {
    ExpectMatchesReference(l, ratio, lens, Outliers::kRope, 250 + ratio, /*num_splits=*/1);
  }
}

TEST(CudaPagedAttention, MergesFp16SinksByLogSumExp) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 300;
  for (KvDtype dtype : kAllDtypes) {
    for (int bt : {16, 64}) {
      PageLayout l = Layout(dtype, 128, bt);
      l.sink_tokens = 4;
      // Lengths shorter than, equal to and longer than the sink segment.
      ExpectMatchesReference(l, 4, {1, 3, 4, 5, 300, 2000}, Outliers::kSpikes, ++seed);
    }
  }
  PageLayout full = Layout(KvDtype::kInt4, 64, 16);
  full.sink_tokens = 16;  // a whole first block of sinks
  ExpectMatchesReference(full, 8, {16, 17, 450}, Outliers::kVariance, ++seed);
}

TEST(CudaPagedAttention, AppliesPerGroupScalesAndEveryRotationBlock) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 400;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3}) {
    for (int group : {16, 32, 64}) {
      for (int rot : {0, 16, 64, 128}) {
        PageLayout l = Layout(dtype, 128, 32);
        l.group_size = group;
        l.rot_block = rot;
        ExpectMatchesReference(l, 4, {200, 999}, Outliers::kOffset, ++seed);
      }
    }
  }
}

TEST(CudaPagedAttention, ExplicitSplitCountsAgreeWithTheReference) {
  KVPOOL_SKIP_WITHOUT_GPU();
  const PageLayout l = Layout(KvDtype::kInt4, 128, 16);
  for (int splits : {1, 2, 7, 64}) {
    ExpectMatchesReference(l, 4, {3000, 17, 1200}, Outliers::kRope, 500 + splits, splits);
  }
}

// One split and no sinks: the tensor-core kernel un-rotates, normalizes and writes the output
// itself, with no merge kernel; every head_dim (rows of 8 channels over 8, 16 or 32 lanes), a
// partial second CTA of query heads (ratio 12) and rotation blocks below head_dim.
TEST(CudaPagedAttention, OneSplitCallsFinishInTheSplitKernel) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 550;
  for (KvDtype dtype : kAllDtypes) {
    for (int head_dim : {64, 128, 256}) {
      for (int ratio : {4, 12}) {
        ExpectMatchesReference(Layout(dtype, head_dim, 16), ratio, {1, 300, 2000},
                               Outliers::kSpikes, ++seed, /*num_splits=*/1);
      }
    }
  }
  for (int rot : {16, 32, 64}) {
    PageLayout l = Layout(KvDtype::kInt4, 128, 32);
    l.rot_block = rot;
    ExpectMatchesReference(l, 8, {5, 1500}, Outliers::kOffset, ++seed, /*num_splits=*/1);
  }
}

TEST(CudaPagedAttention, LongContextsUpTo64K) {
  KVPOOL_SKIP_WITHOUT_GPU();
  PageLayout l = Layout(KvDtype::kInt4, 128, 16, 1);
  ExpectMatchesReference(l, 4, {65536, 40003, 1}, Outliers::kRope, 600);
  l.dtype = KvDtype::kFp8E4M3;
  l.block_tokens = 64;
  ExpectMatchesReference(l, 8, {65536, 16385}, Outliers::kSpikes, 601);
}

// The value MMA's P^T entries are p_t scale_t in fp16. With V scales near 1000 (V values near
// +-3000) and scores that climb steadily along the sequence (by ~7 in the log2 domain between a
// warp's consecutive iterations, whose tiles lie 128 tokens apart), they must stay finite: a
// running max that lagged the tiles' maxima by more than log2(65504 / 1000) ~ 6 would overflow
// them.
TEST(CudaPagedAttention, LargeValueScalesWithClimbingScoresStayFinite) {
  KVPOOL_SKIP_WITHOUT_GPU();
  constexpr int kHeadDim = 128;
  std::mt19937 rng(651);
  std::vector<float> dir(kHeadDim);  // the direction the keys climb along; every q is dir / 2
  for (float& x : dir) x = (rng() & 1) != 0 ? 1.0f : -1.0f;
  uint64_t seed = 650;
  for (KvDtype dtype : kAllDtypes) {
    const PageLayout l = Layout(dtype, kHeadDim, 16);
    // Token t's keys get 0.00674 t dir: q . k_t grows by 0.00674 * 64 per token, 0.055 in the
    // log2 domain of the scores (sm_scale 1/sqrt(128)), against noise of sd 0.72 there.
    const auto climb = [&dir, l](KvData& kv) {
      const size_t row = static_cast<size_t>(l.num_kv_heads) * kHeadDim;
      for (size_t i = 0; i < kv.k.size(); ++i) {
        kv.k[i] += 0.00674f * static_cast<float>(i / row) * dir[i % kHeadDim];
      }
      for (float& x : kv.v) x *= 3000.0f;
    };
    HostBatch b;
    ASSERT_TRUE(MakeHostBatch(l, 4 * l.num_kv_heads, {1500, 777}, Outliers::kNone, ++seed, &b,
                              /*spare_blocks=*/7, climb));
    for (size_t i = 0; i < b.q.size(); ++i) b.q[i] = FloatToHalf(0.5f * dir[i % kHeadDim]);
    // One split: each warp walks the whole sequence (more splits would leave each warp a tile).
    ExpectBatchMatchesReference(b, /*num_splits=*/1);
  }
}

// Small V values (layers whose V spans hundredths): the output's error must stay within the bound
// relative to V itself. The value MMA's fp16 P^T entries p_t scale_t fell to subnormals when the
// V scales were small, and the error relative to the output grew as V shrank.
TEST(CudaPagedAttention, SmallValueScalesStayWithinTheBound) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 800;
  const struct {
    KvDtype dtype;
    float v_factor;
  } cases[] = {{KvDtype::kInt8, 0.05f},
               {KvDtype::kInt8, 0.002f},
               {KvDtype::kFp8E4M3, 0.02f},
               {KvDtype::kInt4, 0.003f},
               {KvDtype::kInt4, 1e-4f}};
  for (const auto& c : cases) {
    for (int ratio : {4, 8}) {  // one and two P^T tiles
      HostBatch b;
      ASSERT_TRUE(MakeHostBatch(Layout(c.dtype, 128, 16), ratio * 2, {1000, 2000, 300},
                                Outliers::kOffset, ++seed, &b, 7,
                                [&c](KvData& kv) {
                                  for (float& x : kv.v) x *= c.v_factor;
                                }))
          << Name(Layout(c.dtype, 128, 16), ratio);
      ExpectBatchMatchesReference(b, /*num_splits=*/1);  // the split kernel finishes the rows
      ExpectBatchMatchesReference(b);                    // the merge kernel does
    }
  }
}

// Groups smaller than head_dim run the CUDA-core split kernel (and RotateQueryKernel): every
// head_dim, 16- and 64-token blocks, GQA ratios that leave head slots unused or take two CTAs
// of heads, sinks up to a whole block, and explicit split counts (64 leaves splits empty).
TEST(CudaPagedAttention, CudaCoreSplitKernelAtEveryHeadDimAndRatio) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 900;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3}) {
    for (int head_dim : {64, 256}) {
      for (int bt : {16, 64}) {
        for (int ratio : {3, 6, 16}) {
          PageLayout l = Layout(dtype, head_dim, bt);
          l.group_size = head_dim / 2;
          l.rot_block = head_dim == 64 ? 32 : 128;
          l.sink_tokens = ratio == 6 ? bt : 4;
          for (int splits : {0, 1, 64}) {
            ExpectMatchesReference(l, ratio, {1, 4, 5, bt - 1, bt, 3 * bt + 1, 1500},
                                   Outliers::kSpikes, ++seed, splits);
          }
        }
      }
    }
  }
}

// The tensor-core kernel with quantized pages not rotated (the signs skipped too), rotation
// blocks below head_dim at head_dims 64 and 256, GQA ratios 3, 5 and 16, and sinks at head_dim
// 256 and on 32-token blocks.
TEST(CudaPagedAttention, TensorCoreKernelUnrotatedAndAtOddRatios) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 1000;
  for (KvDtype dtype : kAllDtypes) {
    for (int head_dim : {64, 256}) {
      for (int ratio : {3, 5, 16}) {
        for (int rot : {0, 16}) {
          PageLayout l = Layout(dtype, head_dim, 32);
          if (dtype != KvDtype::kFp16) l.rot_block = rot;
          l.sink_tokens = ratio == 16 ? 32 : 4;
          ExpectMatchesReference(l, ratio, {3, 4, 31, 32, 33, 700}, Outliers::kOffset, ++seed);
        }
      }
    }
  }
}

TEST(CudaPagedAttention, RejectsWhatItCannotServe) {
  KVPOOL_SKIP_WITHOUT_GPU();
  HostBatch b;
  ASSERT_TRUE(MakeHostBatch(Layout(KvDtype::kInt4, 128, 16), 8, {100}, Outliers::kNone, 700, &b));
  std::vector<float> out(8 * 128);
  DeviceBuffer workspace(cuda::AttentionWorkspaceBytes(b.layout, 1, 8, b.max_blocks_per_seq, 0));
  PagedDecodeAttentionParams p = b.HostParams(out.data(), nullptr);
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.bytes() - 16;  // too small
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kInvalidArgument);
  p.workspace_bytes = workspace.bytes();
  p.num_splits = cuda::kMaxAttentionSplits + 1;
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kInvalidArgument);
  p.num_splits = 0;
  p.q = b.q.data() + 1;  // not 16-byte aligned
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kInvalidArgument);
  p.q = b.q.data();
  std::vector<uint16_t> out16(8 * 128);
  p.out_fp16 = out16.data();  // both outputs
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kInvalidArgument);
  p.out = nullptr;
  p.out_fp16 = nullptr;  // neither
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kInvalidArgument);
  p.out = out.data();
  p.layout.group_size = 8;  // valid for the CPU, not a multiple of 16 (cuda::ServesLayout)
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kUnsupported);
  p.layout = b.layout;
  p.layout.head_dim = 96;  // valid layout, not compiled
  p.layout.group_size = 96;
  p.layout.rot_block = 32;
  p.workspace_bytes = cuda::AttentionWorkspaceBytes(p.layout, 1, 8, b.max_blocks_per_seq, 0);
  ASSERT_LE(p.workspace_bytes, workspace.bytes());
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kUnsupported);
  p.layout = b.layout;
  p.layout.num_kv_heads = 1 << 21;  // a layer page of 4.5 GB: page offsets would overflow
  p.num_q_heads = p.layout.num_kv_heads;
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kUnsupported);
}

}  // namespace
}  // namespace kvpool
