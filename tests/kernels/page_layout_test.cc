#include "kernels/page_layout.h"

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kv_kernels.h"

namespace kvpool {
namespace {

PageLayout Int4Layout() {
  PageLayout l;
  l.num_kv_heads = 8;
  l.head_dim = 128;
  l.block_tokens = 16;
  l.dtype = KvDtype::kInt4;
  l.group_size = 128;
  l.rot_block = 128;
  l.sign_seed = 42;
  return l;
}

TEST(PageLayout, Int4CostsSixtyEightBytesPerTokenHeadAtHeadDim128) {
  const PageLayout l = Int4Layout();
  EXPECT_EQ(l.code_bytes_per_token(), 64u);
  EXPECT_EQ(l.meta_bytes_per_token(), 4u);
  EXPECT_EQ(l.head_page_bytes(), 16u * 68u);
  EXPECT_EQ(l.layer_page_bytes(), 2u * 8u * 16u * 68u);
  EXPECT_EQ(l.head_page_offset(1, 0), 8u * 16u * 68u);
  EXPECT_EQ(ValidatePageLayout(l), nullptr);
}

TEST(PageLayout, PadsEveryHeadPageSectionTo16Bytes) {
  PageLayout l = Int4Layout();
  l.head_dim = 16;
  l.group_size = 16;
  l.rot_block = 16;
  l.block_tokens = 3;  // 3 * 8 code bytes, 3 * 4 meta bytes
  EXPECT_EQ(l.codes_bytes(), 32u);
  EXPECT_EQ(l.meta_bytes(), 16u);
  EXPECT_EQ(l.head_page_bytes(), 48u);
}

TEST(PageLayout, Fp16HasNoMetaAndSinkOffsetsAreTokenMajorPerHead) {
  PageLayout l = Int4Layout();
  l.dtype = KvDtype::kFp16;
  l.group_size = 0;
  l.sink_tokens = 4;
  EXPECT_EQ(l.groups(), 0);
  EXPECT_FALSE(l.rotated());
  EXPECT_EQ(l.head_page_bytes(), 16u * 256u);
  EXPECT_EQ(l.sink_page_bytes(), 2u * 8u * 4u * 128u * 2u);
  EXPECT_EQ(l.sink_offset(1, 2, 3), ((1u * 8u + 2u) * 4u + 3u) * 256u);
  EXPECT_EQ(ValidatePageLayout(l), nullptr);
}

TEST(PageLayout, RejectsLayoutsTheBackendsCannotServe) {
  struct Case {
    const char* what;
    void (*mutate)(PageLayout&);
  };
  const Case cases[] = {
      {"no heads", [](PageLayout& l) { l.num_kv_heads = 0; }},
      {"head_dim 0", [](PageLayout& l) { l.head_dim = 0; }},
      {"head_dim not multiple of 16", [](PageLayout& l) { l.head_dim = 120; }},
      {"no tokens", [](PageLayout& l) { l.block_tokens = 0; }},
      {"group 0", [](PageLayout& l) { l.group_size = 0; }},
      {"group not dividing", [](PageLayout& l) { l.group_size = 48; }},
      {"odd INT4 group",
       [](PageLayout& l) {
         l.head_dim = 48;
         l.group_size = 3;
         l.rot_block = 16;
       }},
      {"rot 8", [](PageLayout& l) { l.rot_block = 8; }},
      {"rot not power of two", [](PageLayout& l) { l.rot_block = 24; }},
      {"rot above head_dim", [](PageLayout& l) { l.rot_block = 256; }},
      {"rot not dividing",
       [](PageLayout& l) {
         l.head_dim = 48;
         l.group_size = 16;
         l.rot_block = 32;
       }},
      {"sinks above block", [](PageLayout& l) { l.sink_tokens = 17; }},
      {"negative sinks", [](PageLayout& l) { l.sink_tokens = -1; }},
      {"unknown dtype", [](PageLayout& l) { l.dtype = static_cast<KvDtype>(9); }},
  };
  for (const Case& c : cases) {
    PageLayout l = Int4Layout();
    c.mutate(l);
    EXPECT_NE(ValidatePageLayout(l), nullptr) << c.what;
  }
}

TEST(PageLayout, AcceptsOddGroupForInt8AndNoRotation) {
  PageLayout l = Int4Layout();
  l.dtype = KvDtype::kInt8;
  l.head_dim = 48;
  l.group_size = 3;
  l.rot_block = 0;
  EXPECT_EQ(ValidatePageLayout(l), nullptr);
}

TEST(RotationSign, IsAllPlusForSeedZeroAndMixedOtherwise) {
  int minus = 0;
  for (int c = 0; c < 128; ++c) {
    EXPECT_EQ(RotationSign(0, c), 1.0f);
    minus += RotationSign(42, c) < 0;
  }
  EXPECT_GT(minus, 32);
  EXPECT_LT(minus, 96);
}

TEST(FirstBlockIdOutOfRange, FindsTheFirstBadIdInChunksAndTail) {
  std::vector<int32_t> ids(200);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37) % 1000);
  EXPECT_EQ(FirstBlockIdOutOfRange(ids.data(), 200, 1000), -1);
  EXPECT_EQ(FirstBlockIdOutOfRange(ids.data(), 0, 0), -1);
  // 999 is the largest id (i = 27 and others): out of range for 999 blocks.
  EXPECT_EQ(FirstBlockIdOutOfRange(ids.data(), 200, 999), 27);
  EXPECT_EQ(FirstBlockIdOutOfRange(ids.data(), 27, 999), -1);
  for (int bad : {0, 63, 64, 130, 199}) {  // in the first chunk, at its end and start, the tail
    for (int32_t value : {-1, 1000, INT32_MIN, INT32_MAX}) {
      std::vector<int32_t> v = ids;
      v[bad] = value;
      EXPECT_EQ(FirstBlockIdOutOfRange(v.data(), 200, 1000), bad) << bad << " " << value;
      EXPECT_EQ(FirstBlockIdOutOfRange(v.data(), bad, 1000), -1);
    }
  }
  // More blocks than int32 ids can name: only negative ids are out of range.
  std::vector<int32_t> big = {0, INT32_MAX, 5};
  EXPECT_EQ(FirstBlockIdOutOfRange(big.data(), 3, int64_t{1} << 40), -1);
  big[2] = -7;
  EXPECT_EQ(FirstBlockIdOutOfRange(big.data(), 3, int64_t{1} << 40), 2);
  EXPECT_EQ(FirstBlockIdOutOfRange(big.data(), 3, -5), 0);
}

TEST(AttentionTables, SpanAtMostTwoToTheThirtyTokens) {
  const PageLayout l = Int4Layout();  // 16-token blocks
  EXPECT_TRUE(AttentionTableSpanOk(l, 1));
  EXPECT_TRUE(AttentionTableSpanOk(l, 1 << 26));  // 2^30 tokens
  EXPECT_FALSE(AttentionTableSpanOk(l, (1 << 26) + 1));
  EXPECT_FALSE(AttentionTableSpanOk(l, 1 << 28));  // 2^32 tokens: 0 in 32-bit arithmetic
  EXPECT_FALSE(AttentionTableSpanOk(l, INT_MAX));
  EXPECT_FALSE(AttentionTableSpanOk(l, 0));
  EXPECT_FALSE(AttentionTableSpanOk(l, -1));
  PageLayout wide = l;
  wide.block_tokens = INT_MAX;
  EXPECT_FALSE(AttentionTableSpanOk(wide, 1));
}

TEST(AttentionTables, FindsTheFirstSequenceWithABadLengthOrBlock) {
  const PageLayout l = Int4Layout();  // 16-token blocks
  // Three sequences, tables of 4 blocks: lengths 16 (1 block), 17 (2 blocks), 64 (4 blocks).
  std::vector<int32_t> lens = {16, 17, 64};
  std::vector<int32_t> tables = {0, -9, -9, -9, 1, 2, 77, 77, 3, 4, 5, 6};
  auto find = [&] {
    return FindBadAttentionSequence(l, lens.data(), tables.data(), 3, 4, 10, /*sink_blocks=*/0);
  };
  EXPECT_EQ(find().seq, -1);  // ids past each length are not looked at
  lens[1] = 65;               // past the table's 4 blocks
  EXPECT_EQ(find().seq, 1);
  EXPECT_EQ(find().block, -1);
  lens[1] = 0;
  EXPECT_EQ(find().seq, 1);
  lens[1] = 33;  // now 3 blocks: the third id, 77, is past the arena's 10
  EXPECT_EQ(find().seq, 1);
  EXPECT_EQ(find().block, 2);
  lens[1] = 17;
  tables[11] = -1;
  EXPECT_EQ(find().seq, 2);
  EXPECT_EQ(find().block, 3);
}

// With sinks, a sequence's first block must have a sink page: be among the lowest ids.
TEST(AttentionTables, WithSinksAFirstBlockPastTheSinkBlocksIsBad) {
  PageLayout l = Int4Layout();
  l.sink_tokens = 4;
  std::vector<int32_t> lens = {16, 40};
  std::vector<int32_t> tables = {1, -9, -9, 0, 7, 8};
  auto find = [&](int64_t sink_blocks) {
    return FindBadAttentionSequence(l, lens.data(), tables.data(), 2, 3, 10, sink_blocks);
  };
  EXPECT_EQ(find(2).seq, -1);  // first blocks 1 and 0; 7 and 8 need no sink page
  EXPECT_EQ(find(1).seq, 0);   // block 1 has none
  EXPECT_EQ(find(1).block, 0);
  EXPECT_EQ(find(0).seq, 0);
  l.sink_tokens = 0;  // without sinks the bound does not apply
  EXPECT_EQ(find(0).seq, -1);
}

// Tables spanning more than 2^30 tokens are not planned (their token count overflowed int and the
// split planning divided by zero).
TEST(PlanAttention, RefusesTablesSpanningOverTwoToTheThirtyTokens) {
  const PageLayout l = Int4Layout();  // 16-token blocks
  for (int blocks : {(1 << 26) + 1, 1 << 27, 1 << 28, INT_MAX}) {
    EXPECT_EQ(cuda::AttentionWorkspaceBytes(l, 1, 32, blocks, 0), 0u) << blocks;
    const cuda::AttentionPlan plan = cuda::PlanAttention(l, 1, 32, blocks, 0);
    EXPECT_EQ(plan.num_splits, cuda::AttentionPlan{}.num_splits) << blocks;
    EXPECT_EQ(plan.ctas_per_sm, 0) << blocks;
  }
}

// The layouts the CUDA kernels serve (CreateNamespace refuses the others on the CUDA backend).
TEST(ServesLayout, TheCompiledShapesOnly) {
  const PageLayout int4 = Int4Layout();  // head_dim 128, 16-token blocks, rotation 128
  if (cuda::PlanAttention(int4, 1, 32, 1, 0).ctas_per_sm == 0) GTEST_SKIP() << "built without CUDA";
  EXPECT_EQ(cuda::ServesLayout(int4), KernelStatus::kOk);
  auto with = [&](auto change) {
    PageLayout l = int4;
    change(l);
    return cuda::ServesLayout(l);
  };
  EXPECT_EQ(with([](PageLayout& l) { l.head_dim = l.group_size = l.rot_block = 64; }),
            KernelStatus::kOk);
  EXPECT_EQ(with([](PageLayout& l) { l.block_tokens = 64; }), KernelStatus::kOk);
  EXPECT_EQ(with([](PageLayout& l) { l.dtype = KvDtype::kFp16; }), KernelStatus::kOk);
  EXPECT_EQ(with([](PageLayout& l) { l.head_dim = l.group_size = l.rot_block = 32; }),
            KernelStatus::kUnsupported);
  EXPECT_EQ(with([](PageLayout& l) { l.block_tokens = 8; }), KernelStatus::kUnsupported);
  EXPECT_EQ(with([](PageLayout& l) { l.group_size = 8; }), KernelStatus::kUnsupported);
  EXPECT_EQ(with([](PageLayout& l) { l.head_dim = l.group_size = l.rot_block = 256; }),
            KernelStatus::kUnsupported);  // rotation blocks of at most 128
  EXPECT_EQ(with([](PageLayout& l) { l.rot_block = 12; }), KernelStatus::kInvalidArgument);
}

// Batches past a grid's y / z limit (65535 sequences, or query heads for the merge kernel) are
// refused as unsupported before anything is read, not failed at launch with a CUDA error. The
// pointers are never dereferenced.
TEST(PlanAttention, GridLimitsAreUnsupported) {
  PagedDecodeAttentionParams p;
  p.layout = Int4Layout();
  p.num_seqs = 65536;
  p.num_q_heads = 32;
  p.max_blocks_per_seq = 1;
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kUnsupported);
  p.num_seqs = 1;
  p.num_q_heads = 65536;
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr), KernelStatus::kUnsupported);
}

// The CUDA backend plans a call's split count once and passes it back as num_splits: the count,
// the split kernel's build and the workspace must not change when they are planned again from it
// (no GPU needed; built without CUDA the plan is always one split and no build).
TEST(PlanAttention, PassedBackGivesTheSamePlanAndWorkspace) {
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp16}) {
    PageLayout l = Int4Layout();
    l.dtype = dtype;
    for (int seqs : {1, 3, 8, 32, 64, 200}) {
      for (int blocks : {1, 7, 64, 513, 2048, 4096}) {
        for (int requested : {0, 5, 64}) {
          for (int q_heads : {32, 64}) {  // GQA 4 and 8
            const cuda::AttentionPlan plan =
                cuda::PlanAttention(l, seqs, q_heads, blocks, requested);
            ASSERT_GE(plan.num_splits, 1);
            const cuda::AttentionPlan again =
                cuda::PlanAttention(l, seqs, q_heads, blocks, plan.num_splits);
            EXPECT_EQ(again.num_splits, plan.num_splits)
                << seqs << " x " << blocks << " blocks, requested " << requested;
            EXPECT_EQ(again.ctas_per_sm, plan.ctas_per_sm)
                << seqs << " x " << blocks << " blocks, requested " << requested;
            EXPECT_EQ(cuda::AttentionWorkspaceBytes(l, seqs, q_heads, blocks, plan.num_splits),
                      cuda::AttentionWorkspaceBytes(l, seqs, q_heads, blocks, requested))
                << seqs << " x " << blocks << " blocks, requested " << requested;
          }
        }
      }
    }
  }
}

// INT4 at head_dim 128 runs the deep build (three CTAs per SM) for more than 4 query heads per KV
// head, or for CTAs of at least 4096 tokens, unless that needs more rounds than four CTAs per SM;
// every other layout its own build (results/experiments_2026-11-29.md, "Eighteenth session").
TEST(PlanAttention, TakesTheDeepBuildWhereItWasMeasuredFaster) {
  const PageLayout int4 = Int4Layout();  // 8 KV heads, head_dim 128, 16-token blocks
  if (cuda::PlanAttention(int4, 1, 32, 1, 0).ctas_per_sm == 0) GTEST_SKIP() << "built without CUDA";
  auto ctas = [](const PageLayout& l, int seqs, int q_heads, int context) {
    return cuda::PlanAttention(l, seqs, q_heads, context / l.block_tokens, 0).ctas_per_sm;
  };
  // GQA 4: 1024- and 2048-token CTAs keep four per SM, longer ones take the deep build, and
  // 512 CTAs of 8K tokens would need two rounds at three per SM.
  EXPECT_EQ(ctas(int4, 1, 32, 32768), 4);
  EXPECT_EQ(ctas(int4, 8, 32, 8192), 4);
  EXPECT_EQ(ctas(int4, 8, 32, 32768), 3);
  EXPECT_EQ(ctas(int4, 32, 32, 4096), 3);
  EXPECT_EQ(ctas(int4, 32, 32, 16384), 3);
  EXPECT_EQ(ctas(int4, 64, 32, 8192), 4);
  // GQA 8: the deep build whatever the CTAs' length, but not past one round.
  EXPECT_EQ(ctas(int4, 1, 64, 32768), 3);
  EXPECT_EQ(ctas(int4, 8, 64, 8192), 3);
  EXPECT_EQ(ctas(int4, 48, 64, 8192), 3);
  EXPECT_EQ(ctas(int4, 64, 64, 8192), 4);
  // Other dtypes and head_dims: their one build.
  PageLayout fp8 = int4;
  fp8.dtype = KvDtype::kFp8E4M3;
  EXPECT_EQ(ctas(fp8, 8, 64, 32768), 3);
  EXPECT_EQ(ctas(fp8, 64, 32, 8192), 3);
  PageLayout fp16 = int4;
  fp16.dtype = KvDtype::kFp16;
  EXPECT_EQ(ctas(fp16, 8, 32, 32768), 2);
  PageLayout int4_d64 = int4;
  int4_d64.head_dim = 64;
  int4_d64.group_size = 64;
  int4_d64.rot_block = 64;
  EXPECT_EQ(ctas(int4_d64, 8, 64, 32768), 4);
  PageLayout int4_d256 = int4;
  int4_d256.head_dim = 256;
  int4_d256.group_size = 256;
  EXPECT_EQ(ctas(int4_d256, 8, 32, 32768), 2);
}

TEST(KernelStatusName, NamesEveryStatus) {
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kOk)), "OK");
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kInvalidArgument)), "INVALID_ARGUMENT");
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kUnsupported)), "UNSUPPORTED");
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kCudaError)), "CUDA_ERROR");
}

}  // namespace
}  // namespace kvpool
