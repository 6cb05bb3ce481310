#include "kernels/page_layout.h"

#include <string>

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

TEST(KernelStatusName, NamesEveryStatus) {
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kOk)), "OK");
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kInvalidArgument)), "INVALID_ARGUMENT");
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kUnsupported)), "UNSUPPORTED");
  EXPECT_EQ(std::string(KernelStatusName(KernelStatus::kCudaError)), "CUDA_ERROR");
}

}  // namespace
}  // namespace kvpool
