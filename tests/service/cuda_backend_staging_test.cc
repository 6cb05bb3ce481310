// The CUDA backend's host-side argument checks (service/store/cuda_backend_staging.h), which need
// no GPU: what reaches the kernels never names an out-of-range block, length or slot.
#include "service/store/cuda_backend_staging.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/kv_kernels.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::cuda_backend_internal {
namespace {

// INT4, 2 KV heads, head_dim 64, 16-token blocks.
PageLayout Layout() { return testing::MakeLayout(KvDtype::kInt4, 64, 64, 2, 64, 16); }

TEST(ValidatePagedDecodeAttention, RefusesWhatTheKernelsMustNotSeeAndSaysWhich) {
  const std::vector<uint16_t> q(2 * 64);
  std::vector<float> out(q.size());
  std::vector<int32_t> tables = {0, 1, 2, 3};  // two sequences, two blocks each
  std::vector<int32_t> lens = {32, 17};
  PagedDecodeAttentionParams p;
  p.layout = Layout();
  p.q = q.data();
  p.num_seqs = 2;
  p.num_q_heads = 2;
  p.block_tables = tables.data();
  p.max_blocks_per_seq = 2;
  p.seq_lens = lens.data();
  p.out = out.data();
  p.num_blocks = 4;
  EXPECT_TRUE(ValidatePagedDecodeAttention(p, nullptr).ok());

  auto message = [&] { return std::string(ValidatePagedDecodeAttention(p, nullptr).message()); };
  lens[1] = 33;  // past its two blocks
  EXPECT_NE(message().find("seq 1 length 33 out of range"), std::string::npos) << message();
  lens[1] = 17;
  tables[3] = 4;  // past the arena
  EXPECT_NE(message().find("seq 1 block 1 id 4 out of range"), std::string::npos) << message();
  tables[3] = 3;
  p.max_blocks_per_seq = 1 << 27;  // 2^31 tokens: its length bound would overflow int
  EXPECT_EQ(ValidatePagedDecodeAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.max_blocks_per_seq = 2;
  p.out_fp16 = reinterpret_cast<uint16_t*>(out.data());  // both outputs
  EXPECT_EQ(ValidatePagedDecodeAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.out_fp16 = nullptr;
  // Past the kernels' grids: refused here, before the append riding in the step runs (the
  // kernel's own check came after it).
  p.num_q_heads = cuda::kMaxAttentionSeqsOrHeads + 1;
  EXPECT_EQ(ValidatePagedDecodeAttention(p, nullptr).code(), absl::StatusCode::kUnimplemented);
  p.num_q_heads = 2;

  // The append riding in the step is checked with it.
  const std::vector<uint16_t> kv(2 * 64);
  const std::vector<int64_t> slots = {4 * 16};  // one past the arena's last slot
  QuantizeAppendParams a;
  a.layout = Layout();
  a.k = kv.data();
  a.v = kv.data();
  a.slot_mapping = slots.data();
  a.num_tokens = 1;
  a.num_blocks = 4;
  EXPECT_EQ(ValidatePagedDecodeAttention(p, &a).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::cuda_backend_internal
