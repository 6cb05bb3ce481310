#include "service/store/block_pool.h"

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "service/store/compute_backend.h"
#include "service/store/namespace_config.h"

namespace kvpool {
namespace {

NamespaceConfig Config(int sink_tokens) {
  NamespaceConfig c;
  c.name = "pool";
  c.num_layers = 3;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.block_tokens = 4;
  c.layer_dtypes = {KvDtype::kFp8E4M3, KvDtype::kInt4, KvDtype::kInt8};
  c.rotation_block = 16;
  c.group_size = 16;
  c.sink_tokens = sink_tokens;
  return c;
}

TEST(BlockPool, AllocatesDistinctBlocksUntilExhausted) {
  auto backend = NewCpuBackend();
  auto pool = BlockPool::Create(Config(0), {5, 0}, backend.get());
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto a = (*pool)->Allocate(3);
  ASSERT_TRUE(a.ok());
  auto b = (*pool)->Allocate(2);
  ASSERT_TRUE(b.ok());
  std::set<int32_t> all(a->begin(), a->end());
  all.insert(b->begin(), b->end());
  EXPECT_EQ(all.size(), 5u);
  EXPECT_EQ(*all.begin(), 0);
  EXPECT_EQ(*all.rbegin(), 4);
  EXPECT_EQ((*pool)->num_free(), 0u);
  EXPECT_EQ((*pool)->Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(BlockPool, FailedAllocationTakesNothing) {
  auto backend = NewCpuBackend();
  auto pool = BlockPool::Create(Config(0), {4, 0}, backend.get());
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE((*pool)->Allocate(3).ok());
  EXPECT_FALSE((*pool)->Allocate(2).ok());
  EXPECT_EQ((*pool)->num_free(), 1u);
}

TEST(BlockPool, FreedBlocksAreReused) {
  auto backend = NewCpuBackend();
  auto pool = BlockPool::Create(Config(0), {2, 0}, backend.get());
  ASSERT_TRUE(pool.ok());
  auto a = (*pool)->Allocate(2);
  ASSERT_TRUE(a.ok());
  (*pool)->Free({(*a)[1]});
  EXPECT_FALSE((*pool)->IsAllocated((*a)[1]));
  auto b = (*pool)->Allocate(1);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)[0], (*a)[1]);
  EXPECT_TRUE((*pool)->IsAllocated((*a)[1]));
}

TEST(BlockPool, ArenaIsLayerMajorWithSinksAfterPages) {
  auto backend = NewCpuBackend();
  const NamespaceConfig config = Config(2);
  const int64_t n = 7, sinks = 3;
  auto pool = BlockPool::Create(config, {n, sinks}, backend.get());
  ASSERT_TRUE(pool.ok());
  const BlockPool& p = **pool;
  for (int l = 1; l < config.num_layers; ++l) {
    EXPECT_EQ(p.layer_base(l) - p.layer_base(l - 1),
              static_cast<ptrdiff_t>(p.layout(l - 1).layer_page_bytes() * n));
  }
  const int last = config.num_layers - 1;
  EXPECT_EQ(p.sink_base(0) - p.layer_base(last),
            static_cast<ptrdiff_t>(p.layout(last).layer_page_bytes() * n));
  EXPECT_EQ(p.sink_base(1) - p.sink_base(0),
            static_cast<ptrdiff_t>(p.layout(0).sink_page_bytes() * sinks));
  const uint64_t bytes = BytesPerBlock(config) * n + SinkBytesPerBlock(config) * sinks;
  EXPECT_GE(backend->Stats().arena_bytes, bytes);
  const uint8_t* end = p.sink_base(last) + p.layout(last).sink_page_bytes() * sinks;
  EXPECT_EQ(static_cast<uint64_t>(end - p.layer_base(0)), bytes);
}

// A sequence's first block comes from the ids with a sink page; other blocks take the rest first
// and those ids only when the rest are gone.
TEST(BlockPool, FirstBlocksTakeTheIdsWithASinkPage) {
  auto backend = NewCpuBackend();
  auto pool = BlockPool::Create(Config(2), {6, 2}, backend.get());
  ASSERT_TRUE(pool.ok()) << pool.status();
  BlockPool& p = **pool;
  EXPECT_EQ(p.num_sink_blocks(), 2);
  auto a = p.Allocate(3, /*firsts=*/1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(p.num_free_sink(), 1u);
  auto b = p.Allocate(3);  // ids 4 and 5, then the last with a sink page
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<int32_t>{4, 5, 1}));
  EXPECT_EQ(p.num_free(), 0u);
  p.Free({3, 1});
  EXPECT_EQ(p.num_free_sink(), 1u);
  EXPECT_EQ(p.Allocate(2, 2).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(p.num_free(), 2u);  // the refused call took nothing
  auto c = p.Allocate(1, 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<int32_t>{1}));
}

TEST(BlockPool, RejectsSinkBlocksThatDoNotMatchTheSinks) {
  auto backend = NewCpuBackend();
  for (const ArenaBlocks& bad : {ArenaBlocks{4, 0}, ArenaBlocks{4, 5}}) {
    EXPECT_EQ(BlockPool::Create(Config(2), bad, backend.get()).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad.sink_blocks;
  }
  EXPECT_EQ(BlockPool::Create(Config(0), {4, 1}, backend.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BlockPool, NoSinkBaseWithoutSinks) {
  auto backend = NewCpuBackend();
  auto pool = BlockPool::Create(Config(0), {3, 0}, backend.get());
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->sink_base(0), nullptr);
}

TEST(BlockPool, ArenaReturnedOnDestruction) {
  auto backend = NewCpuBackend();
  {
    auto pool = BlockPool::Create(Config(0), {3, 0}, backend.get());
    ASSERT_TRUE(pool.ok());
    EXPECT_GT(backend->Stats().arena_bytes, 0u);
  }
  EXPECT_EQ(backend->Stats().arena_bytes, 0u);
}

TEST(BlockPool, RejectsZeroBlocks) {
  auto backend = NewCpuBackend();
  EXPECT_EQ(BlockPool::Create(Config(0), {0, 0}, backend.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
