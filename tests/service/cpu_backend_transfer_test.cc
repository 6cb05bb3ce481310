// The CPU backend's list calls of the transfer paths behave as the CUDA backend's
// (tests/gpu/transfer_backend_test.cc): a bad element refuses the whole call before anything is
// written, and the first failing range check is the one reported.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/kv_kernels.h"
#include "service/store/compute_backend.h"
#include "tests/common/kv_test_data.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool {
namespace {

constexpr int kTokens = 16;
constexpr int kBlocks = 2;

TEST(CpuBackendTransfer, QuantizeAppendFromArenaWritesNothingWhenAnElementIsBad) {
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  const PageLayout l = testing::MakeLayout(KvDtype::kInt4, 64, 64, 2, 64, kTokens);
  const testing::KvData d =
      testing::MakeKv(kTokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 3);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  std::vector<int64_t> good_slots(kTokens), bad_slots(kTokens);
  for (int t = 0; t < kTokens; ++t) good_slots[t] = bad_slots[t] = t;
  bad_slots[5] = int64_t{kBlocks} * kTokens;  // past the arena
  const size_t page_bytes = kBlocks * l.layer_page_bytes();
  absl::StatusOr<uint8_t*> pages = cpu->AllocateArena(page_bytes);
  ASSERT_TRUE(pages.ok());
  std::memset(*pages, 0x5a, page_bytes);
  QuantizeAppendParams good;
  good.layout = l;
  good.k = k.data();
  good.v = v.data();
  good.slot_mapping = good_slots.data();
  good.num_tokens = kTokens;
  good.pages = *pages;
  good.num_blocks = kBlocks;
  // Bad elements: a slot past the arena, no pages, a layout with groups that do not divide
  // head_dim.
  std::vector<QuantizeAppendParams> bads(3, good);
  bads[0].slot_mapping = bad_slots.data();
  bads[1].pages = nullptr;
  bads[2].layout.group_size = 48;

  const std::vector<uint8_t> untouched(page_bytes, 0x5a);
  for (size_t i = 0; i < bads.size(); ++i) {
    EXPECT_EQ(cpu->QuantizeAppendFromArena({good, bads[i]}).code(),
              absl::StatusCode::kInvalidArgument)
        << "bad element " << i;
    EXPECT_EQ(std::memcmp(*pages, untouched.data(), page_bytes), 0)
        << "the good element written beside bad element " << i;
  }
  ASSERT_TRUE(cpu->QuantizeAppendFromArena({good}).ok());
  EXPECT_NE(std::memcmp(*pages, untouched.data(), page_bytes), 0);
  cpu->FreeArena(*pages);
}

TEST(CpuBackendTransfer, CheckHalfRangeArenaReportsTheFirstFailingCheck) {
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  std::vector<uint16_t> clean(100, 0x3c00), nan_at_7 = clean, inf_at_2 = clean;
  nan_at_7[7] = 0x7e00;
  inf_at_2[2] = 0x7c00;
  const absl::Status s = cpu->CheckHalfRangeArena({{clean.data(), clean.size(), 0x7bff, "k"},
                                                   {nan_at_7.data(), 100, 0x7bff, "v"},
                                                   {inf_at_2.data(), 100, 0x7bff, "k"}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().substr(0, 7), "v holds") << s;
  EXPECT_NE(s.message().find("element 7"), absl::string_view::npos) << s;
  EXPECT_TRUE(cpu->CheckHalfRangeArena({{clean.data(), clean.size(), 0x7bff, "k"}}).ok());
}

}  // namespace
}  // namespace kvpool
