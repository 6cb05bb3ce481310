// Sink pages only for the blocks sequences start in: the arena's plan (a namespace with sinks
// holds nearly as many blocks as one without), and the store taking a block with a sink page for
// every new sequence's first block, evicting for one when none is free, refusing when every one
// is pinned, over Put, Append and a decode step that starts two sequences at once.
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

// The README's example: 32 INT4 layers of 8 KV heads, head_dim 128, 16-token blocks, 4 sinks.
NamespaceConfig SinkNamespace(int blocks_per_sink_page) {
  NamespaceConfig c = DefaultNamespaceConfig(0);
  c.sink_tokens = 4;
  c.blocks_per_sink_page = blocks_per_sink_page;
  return c;
}

TEST(SinkArena, PlanHoldsAsManyBlocksAsFitWithASinkPagePerShare) {
  constexpr uint64_t kCapacity = uint64_t{1} << 30;
  for (int r : {1, 3, 16, 1000}) {
    const NamespaceConfig c = SinkNamespace(r);
    const ArenaBlocks a = PlanArena(c, kCapacity);
    EXPECT_LE(ArenaBytes(c, a.blocks), kCapacity) << r;
    EXPECT_GT(ArenaBytes(c, a.blocks + 1), kCapacity) << r;
    EXPECT_EQ(a.sink_blocks, (a.blocks + r - 1) / r) << r;
  }
  // A sink page per block (the layout before) against one per 16: 32 x 16 KiB of sink pages
  // per block beside 32 x 17 KiB of INT4 pages.
  const NamespaceConfig every = SinkNamespace(1), shared = SinkNamespace(16);
  EXPECT_EQ(SinkBytesPerBlock(every), 32u * 16384);
  EXPECT_EQ(PlanArena(every, kCapacity).blocks, kCapacity / (32 * (17408 + 16384)));
  EXPECT_EQ(PlanArena(every, kCapacity).blocks, 992u);  // the figures the README quotes
  EXPECT_EQ(PlanArena(shared, kCapacity).blocks, 1820u);
  EXPECT_EQ(PlanArena(shared, kCapacity).sink_blocks, 114u);
  EXPECT_DOUBLE_EQ(BytesPerToken(shared), 32.0 * (17408 + 16384 / 16.0) / 16);
  NamespaceConfig none = shared;
  none.sink_tokens = 0;
  EXPECT_EQ(PlanArena(none, kCapacity).sink_blocks, 0u);
  EXPECT_EQ(PlanArena(none, kCapacity).blocks, kCapacity / BytesPerBlock(none));
}

TEST(SinkArena, NamespaceRefusesBlocksPerSinkPageBelowOne) {
  NamespaceConfig c = SinkNamespace(0);
  c.name = "x";
  EXPECT_EQ(ValidateNamespaceConfig(c).code(), absl::StatusCode::kInvalidArgument);
}

// 8 blocks of 4 tokens, 2 of them (ids 0, 1) with a sink page.
class SinkStoreTest : public StoreTest {
 protected:
  void SetUp() override {
    MakeStore(8, /*sink_tokens=*/2, /*blocks_per_sink_page=*/4);
    ASSERT_EQ(store_->ListNamespaces()[0].num_sink_blocks, 2u);
  }
  uint64_t Evictions() const { return store_->Stats().namespaces[0].evictions; }
  uint32_t Cached(const std::vector<int32_t>& ids) {
    absl::StatusOr<KvStore::MatchResult> m = store_->Match("main", ids, absl::ZeroDuration());
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return 0;
    EXPECT_TRUE(store_->Release(m->lease_id).ok());
    return m->cached_tokens;
  }
  absl::Status PutTokens(const std::vector<int32_t>& ids, uint64_t seed) {
    return Put(ids, MakeSequenceKv(config_, static_cast<int>(ids.size()), seed)).status();
  }

  const std::vector<int32_t> a_ = TokenIds(8, 1), b_ = TokenIds(8, 2), c_ = TokenIds(4, 3);
};

// Two cached sequences hold both blocks with a sink page: a third evicts, least recently used
// first, until one frees (the first sequence's two blocks), though four blocks without one are
// free.
TEST_F(SinkStoreTest, ANewSequenceEvictsForABlockWithASinkPage) {
  ASSERT_TRUE(PutTokens(a_, 10).ok());
  ASSERT_TRUE(PutTokens(b_, 11).ok());
  ASSERT_TRUE(PutTokens(c_, 12).ok());
  EXPECT_EQ(Evictions(), 2u);
  EXPECT_EQ(Cached(a_), 0u);
  EXPECT_EQ(Cached(b_), 8u);
  EXPECT_EQ(Cached(c_), 4u);
}

// With both blocks that have a sink page pinned, a new sequence is refused and nothing is
// evicted; a sequence that continues a cached one needs no new first block.
TEST_F(SinkStoreTest, NoNewSequenceWhileEveryBlockWithASinkPageIsPinned) {
  ASSERT_TRUE(PutTokens(a_, 10).ok());
  ASSERT_TRUE(PutTokens(b_, 11).ok());
  auto la = store_->Match("main", a_, absl::ZeroDuration());
  auto lb = store_->Match("main", b_, absl::ZeroDuration());
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(PutTokens(c_, 12).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Evictions(), 0u);
  std::vector<int32_t> longer = a_;
  longer.insert(longer.end(), {90, 91, 92, 93});
  EXPECT_TRUE(PutTokens(longer, 10).ok());
  EXPECT_EQ(Cached(longer), 12u);
  ASSERT_TRUE(store_->Release(la->lease_id).ok());
  EXPECT_TRUE(PutTokens(c_, 12).ok());
  EXPECT_EQ(Cached(b_), 8u);
}

// A decode step that starts two sequences takes two blocks with a sink page (evicting both
// cached sequences), and attention over their sink tokens runs: the backend refuses a first block
// without a sink page.
TEST_F(SinkStoreTest, ADecodeStepStartingTwoSequencesTakesTwoBlocksWithASinkPage) {
  ASSERT_TRUE(PutTokens(a_, 10).ok());
  ASSERT_TRUE(PutTokens(b_, 11).ok());
  auto l1 = store_->Match("main", {500}, absl::ZeroDuration());
  auto l2 = store_->Match("main", {600}, absl::ZeroDuration());
  ASSERT_TRUE(l1.ok() && l2.ok());
  ASSERT_EQ(l1->num_blocks, 0u);
  const int q_heads = 2;
  const std::vector<uint16_t> q = ToHalf(MakeNormal(2 * q_heads * config_.head_dim, 5));
  const std::vector<uint16_t> kv = ToHalf(MakeNormal(2 * PerToken(), 6));
  std::vector<KvStore::AttendItem> items(2);
  for (int i = 0; i < 2; ++i) {
    items[i].lease_id = i == 0 ? l1->lease_id : l2->lease_id;
    items[i].q = q.data() + i * q_heads * config_.head_dim;
    items[i].new_k = kv.data() + i * PerToken();
    items[i].new_v = items[i].new_k;
    items[i].new_token_id = -1;
  }
  std::vector<float> out(2 * q_heads * config_.head_dim);
  uint32_t context[2] = {};
  const absl::Status s =
      store_->Attend(0, q_heads, 0.f, items, {out.data(), nullptr, nullptr, context});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(context[0], 1u);
  EXPECT_EQ(context[1], 1u);
  EXPECT_EQ(Evictions(), 4u);
  EXPECT_EQ(Cached(a_), 0u);
  EXPECT_EQ(Cached(b_), 0u);
  // One token attends to itself alone: its output is its own V (here equal to K).
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < q_heads; ++h) {
      const int kv_head = h / (q_heads / config_.num_kv_heads);
      for (int d = 0; d < config_.head_dim; ++d) {
        EXPECT_FLOAT_EQ(out[(i * q_heads + h) * config_.head_dim + d],
                        HalfToFloat(kv[i * PerToken() + kv_head * config_.head_dim + d]))
            << i << " " << h << " " << d;
      }
    }
  }
}

// An Append that starts a lease's sequence takes a block with a sink page too.
TEST_F(SinkStoreTest, AnAppendStartingASequenceTakesABlockWithASinkPage) {
  ASSERT_TRUE(PutTokens(a_, 10).ok());
  ASSERT_TRUE(PutTokens(b_, 11).ok());
  auto lease = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  const std::vector<uint16_t> kv = ToHalf(MakeNormal(PerToken(), 7));
  auto held = store_->Append(lease->lease_id, 0, {}, 1, kv.data(), kv.data());
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(Evictions(), 2u);
  EXPECT_EQ(Cached(a_), 0u);
  EXPECT_EQ(Cached(b_), 8u);
}

}  // namespace
}  // namespace kvpool::testing
