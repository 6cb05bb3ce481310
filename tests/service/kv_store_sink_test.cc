// Sink pages only for the blocks sequences start in: the arena's plan (a namespace with sinks
// holds nearly as many blocks as one without), and the store taking a block with a sink page for
// every new sequence's first block, evicting for one when none is free, refusing when every one
// is pinned, over Put, Append and a decode step that starts two sequences at once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
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

// A store of SmallConfig blocks (4 tokens) whose namespace keeps 2 sink tokens.
class SinkStoreBase : public StoreTest {
 protected:
  void Make(uint64_t blocks, int blocks_per_sink_page, uint64_t sink_blocks) {
    MakeStore(blocks, /*sink_tokens=*/2, blocks_per_sink_page);
    ASSERT_EQ(store_->ListNamespaces()[0].num_sink_blocks, sink_blocks);
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
  static std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }

  static constexpr int kQHeads = 2;  // one per KV head
  struct Step {
    absl::Status status;
    std::vector<float> out;  // [leases][kQHeads][head_dim]
    std::vector<uint32_t> context;
  };
  // One decode step on layer 0 that appends to each of `leases` its row of `kv` as K and V.
  Step DecodeStep(const std::vector<uint64_t>& leases, const std::vector<uint16_t>& kv) {
    const size_t q_elems = kQHeads * config_.head_dim;
    const std::vector<uint16_t> q = ToHalf(MakeNormal(leases.size() * q_elems, 5));
    std::vector<KvStore::AttendItem> items(leases.size());
    for (size_t i = 0; i < leases.size(); ++i) {
      items[i].lease_id = leases[i];
      items[i].q = q.data() + i * q_elems;
      items[i].new_k = kv.data() + i * PerToken();
      items[i].new_v = items[i].new_k;
      items[i].new_token_id = -1;
    }
    Step step;
    step.out.resize(leases.size() * q_elems);
    step.context.resize(leases.size());
    step.status = store_->Attend(0, kQHeads, 0.f, items,
                                 {step.out.data(), nullptr, nullptr, step.context.data()});
    return step;
  }
  // The relative L2 error of n fp16 values `got` against `want`.
  static double RelError(const uint16_t* got, const uint16_t* want, size_t n) {
    double err = 0, norm = 0;
    for (size_t c = 0; c < n; ++c) {
      err += std::pow(HalfToFloat(got[c]) - HalfToFloat(want[c]), 2);
      norm += std::pow(HalfToFloat(want[c]), 2);
    }
    return std::sqrt(err / norm);
  }
};

// 8 blocks, 2 of them (ids 0, 1) with a sink page.
class SinkStoreTest : public SinkStoreBase {
 protected:
  void SetUp() override { Make(8, 4, 2); }
  const std::vector<int32_t> a_ = TokenIds(8, 1), b_ = TokenIds(8, 2), c_ = TokenIds(4, 3);
};

// 16 blocks, 2 of them with a sink page.
class WideSinkStoreTest : public SinkStoreBase {
 protected:
  void SetUp() override { Make(16, 8, 2); }
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

// Two puts of the same sequence at once each take a block with a sink page for its first block;
// the one that commits second finds the first published and gives its copy back.
TEST_F(SinkStoreTest, TwoPutsOfOneSequenceGiveTheSecondBlockWithASinkPageBack) {
  const SequenceKv kv = MakeSequenceKv(config_, 8, 10);
  auto first = store_->BeginPut("main", a_);
  auto second = store_->BeginPut("main", a_);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 0u);
  EXPECT_EQ(store_->BeginPut("main", b_).status().code(), absl::StatusCode::kResourceExhausted);
  for (auto* session : {&*first, &*second}) {
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      ASSERT_TRUE((*session)->AddChunk(layer, 0, 8, kv.k[layer].data(), kv.v[layer].data()).ok());
    }
    ASSERT_TRUE((*session)->Commit().ok());
  }
  EXPECT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 1u);
  EXPECT_EQ(Cached(a_), 8u);
  EXPECT_TRUE(PutTokens(b_, 11).ok());
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
  const std::vector<uint16_t> kv = ToHalf(MakeNormal(2 * PerToken(), 6));
  const Step step = DecodeStep({l1->lease_id, l2->lease_id}, kv);
  ASSERT_TRUE(step.status.ok()) << step.status;
  EXPECT_EQ(step.context, (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(Evictions(), 4u);
  EXPECT_EQ(Cached(a_), 0u);
  EXPECT_EQ(Cached(b_), 0u);
  // One token attends to itself alone: its output is its own V (here equal to K), from the sink
  // page in fp16.
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < kQHeads; ++h) {
      const int kv_head = h / (kQHeads / config_.num_kv_heads);
      for (int d = 0; d < config_.head_dim; ++d) {
        EXPECT_FLOAT_EQ(step.out[(i * kQHeads + h) * config_.head_dim + d],
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

// A full pool and one lease growing its sequence: its new blocks are evicted for among those
// without a sink page, and the next new sequence evicts the cached one that holds a block with a
// sink page (the lease used to evict that one and take its block, and the new sequence was then
// refused).
TEST_F(WideSinkStoreTest, AGrowingLeaseLeavesBlocksWithASinkPageToNewSequences) {
  const std::vector<int32_t> a = TokenIds(4, 1), b = TokenIds(28, 100);
  ASSERT_TRUE(PutTokens(a, 1).ok());                             // block 0
  ASSERT_TRUE(PutTokens(b, 2).ok());                             // blocks 1, 2..7
  ASSERT_TRUE(PutTokens(Concat(b, TokenIds(28, 500)), 3).ok());  // 8..14
  ASSERT_TRUE(PutTokens(Concat(b, TokenIds(4, 900)), 4).ok());   // 15: the pool is full
  auto lease = store_->Match("main", b, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  const std::vector<uint16_t> kv = ToHalf(MakeNormal(8 * PerToken(), 7));
  ASSERT_TRUE(store_->Append(lease->lease_id, 0, {}, 8, kv.data(), kv.data()).ok());
  EXPECT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 0u);
  EXPECT_EQ(Cached(a), 4u);  // the append evicted blocks without a sink page
  EXPECT_TRUE(PutTokens(TokenIds(4, 7000), 9).ok());
  EXPECT_EQ(Cached(a), 0u);
}

// A new sequence evicts the least recently used tree that frees a block with a sink page, not the
// older cached sequences under a pinned first block, which would free none.
TEST_F(WideSinkStoreTest, ANewSequenceEvictsOnlyATreeWithASinkPage) {
  const std::vector<int32_t> s = TokenIds(4, 1);  // a shared first block, kept by a lease
  ASSERT_TRUE(PutTokens(s, 1).ok());
  auto pin = store_->Match("main", s, absl::ZeroDuration());
  ASSERT_TRUE(pin.ok());
  const std::vector<int32_t> s1 = Concat(s, TokenIds(12, 100)), s2 = Concat(s, TokenIds(12, 200));
  ASSERT_TRUE(PutTokens(s1, 2).ok());
  ASSERT_TRUE(PutTokens(s2, 3).ok());
  const std::vector<int32_t> u = TokenIds(8, 300);
  ASSERT_TRUE(PutTokens(u, 4).ok());  // the other block with a sink page, and one more
  ASSERT_TRUE(PutTokens(TokenIds(4, 400), 5).ok());
  EXPECT_EQ(Evictions(), 2u);  // u's two blocks
  EXPECT_EQ(Cached(u), 0u);
  EXPECT_EQ(Cached(s1), 16u);
  EXPECT_EQ(Cached(s2), 16u);
}

// 18 blocks, 6 of them (ids 0..5) with a sink page. A chain whose leaf took a block with a sink
// page (every block without one was taken) holds unpinned blocks without one, reachable only by
// evicting that leaf. A block without a sink page then takes the free block with one rather than
// evicting leaves with a sink page, the least recently used unrelated sequences first (it evicted
// all four leaves down to one of that chain's blocks); a full pool evicts the one least recently
// used leaf for it.
TEST_F(SinkStoreBase, ABlockWithoutASinkPageTakesAFreeOneWithRatherThanEvictingSequences) {
  Make(18, 3, 6);
  const std::vector<int32_t> u1 = TokenIds(4, 1), u2 = TokenIds(4, 2), u3 = TokenIds(4, 3);
  for (const auto* u : {&u1, &u2, &u3}) ASSERT_TRUE(PutTokens(*u, 1).ok());  // blocks 0, 1, 2
  const std::vector<int32_t> a = TokenIds(32, 100), a2 = Concat(a, TokenIds(24, 200));
  ASSERT_TRUE(PutTokens(a, 2).ok());   // blocks 3, 6..12
  ASSERT_TRUE(PutTokens(a2, 3).ok());  // 13..17 and 4, its leaf
  ASSERT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 1u);
  ASSERT_EQ(Evictions(), 0u);
  const std::vector<int32_t> u2_longer = Concat(u2, TokenIds(4, 300));
  ASSERT_TRUE(PutTokens(u2_longer, 4).ok());  // block 5
  EXPECT_EQ(Evictions(), 0u);
  EXPECT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 0u);
  const std::vector<int32_t> u3_longer = Concat(u3, TokenIds(4, 400));
  ASSERT_TRUE(PutTokens(u3_longer, 5).ok());  // the pool is full: u1, the oldest leaf, goes
  EXPECT_EQ(Evictions(), 1u);
  EXPECT_EQ(Cached(u1), 0u);
  EXPECT_EQ(Cached(u2_longer), 8u);
  EXPECT_EQ(Cached(u3_longer), 8u);
  EXPECT_EQ(Cached(a2), 56u);
}

// One decode step in which a lease crosses into its second block before another lease starts:
// the starting lease's first block is the one with a sink page, and the two blocks differ (each
// lease reads back its own token).
TEST_F(WideSinkStoreTest, ADecodeStepGivesTheSinkBlockToTheLeaseThatStarts) {
  const std::vector<int32_t> a = TokenIds(4, 1);
  ASSERT_TRUE(PutTokens(a, 1).ok());  // block 0; block 1 is the other with a sink page
  auto growing = store_->Match("main", a, absl::ZeroDuration());
  auto starting = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(growing.ok() && starting.ok());
  const std::vector<uint16_t> kv = ToHalf(MakeNormal(2 * PerToken(), 6));
  const Step step = DecodeStep({growing->lease_id, starting->lease_id}, kv);
  ASSERT_TRUE(step.status.ok()) << step.status;
  EXPECT_EQ(step.context, (std::vector<uint32_t>{5, 1}));
  for (int i = 0; i < 2; ++i) {
    const uint64_t lease = i == 0 ? growing->lease_id : starting->lease_id;
    const uint32_t block = i == 0 ? 1 : 0;  // where the item's new token went
    std::vector<uint16_t> k(4 * PerToken()), v(4 * PerToken());
    ASSERT_TRUE(
        store_->ReadFp16(lease, 0, block, 1, 0, config_.num_kv_heads, k.data(), v.data()).ok());
    // INT4's error, not another token's.
    EXPECT_LT(RelError(k.data(), kv.data() + i * PerToken(), PerToken()), 0.2) << "item " << i;
  }
}

// An fp16 read that starts at a sequence's first block returns its sink tokens exact (from the
// block's sink page, as Attend uses them) and the other tokens dequantized; one that starts later
// is not changed.
TEST_F(SinkStoreTest, AReadFromTheFirstBlockReturnsTheSinkTokensExact) {
  const SequenceKv kv = MakeSequenceKv(config_, 8, 11);
  ASSERT_TRUE(Put(a_, kv).ok());
  auto lease = store_->Match("main", a_, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const size_t pt = PerToken();
  for (uint32_t layer = 0; layer < 2; ++layer) {
    std::vector<uint16_t> k(8 * pt), v(8 * pt), k1(4 * pt), v1(4 * pt);
    ASSERT_TRUE(
        store_->ReadFp16(lease->lease_id, layer, 0, 2, 0, config_.num_kv_heads, k.data(), v.data())
            .ok());
    const size_t sink = static_cast<size_t>(config_.sink_tokens) * pt;
    EXPECT_TRUE(std::equal(k.begin(), k.begin() + sink, kv.k[layer].begin())) << layer;
    EXPECT_TRUE(std::equal(v.begin(), v.begin() + sink, kv.v[layer].begin())) << layer;
    EXPECT_FALSE(std::equal(k.begin() + sink, k.end(), kv.k[layer].begin() + sink)) << layer;
    EXPECT_LT(RelError(k.data() + sink, kv.k[layer].data() + sink, 8 * pt - sink), 0.2);
    // Block 1 alone reads as the same rows of the two-block read.
    ASSERT_TRUE(
        store_
            ->ReadFp16(lease->lease_id, layer, 1, 1, 0, config_.num_kv_heads, k1.data(), v1.data())
            .ok());
    EXPECT_TRUE(std::equal(k1.begin(), k1.end(), k.begin() + 4 * pt)) << layer;
  }
}

// The raw sink rows of a first block: the selected heads' sink tokens exact, [heads][sink][dim]
// as the sink page stores them, rows past the tokens a layer holds as zeros (a namespace without
// sinks refuses them: StoreErrorsTest.RefusedCallsDoNotRenewTheirLeases).
TEST_F(SinkStoreTest, RawSinkRowsAreTheSelectedHeadsSinkTokensExact) {
  const SequenceKv kv = MakeSequenceKv(config_, 8, 12);
  ASSERT_TRUE(Put(a_, kv).ok());
  auto lease = store_->Match("main", a_, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const int sink = config_.sink_tokens, dim = config_.head_dim, heads = config_.num_kv_heads;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    std::vector<uint16_t> k(sink * dim, 0xFFFF), v(sink * dim, 0xFFFF);
    ASSERT_TRUE(store_
                    ->ReadRawSinks(lease->lease_id, layer, 1, 2,
                                   reinterpret_cast<uint8_t*>(k.data()),
                                   reinterpret_cast<uint8_t*>(v.data()))
                    .ok());
    for (int t = 0; t < sink; ++t) {
      const size_t src = (static_cast<size_t>(t) * heads + 1) * dim;
      EXPECT_TRUE(
          std::equal(k.begin() + t * dim, k.begin() + (t + 1) * dim, kv.k[layer].begin() + src))
          << "layer " << layer << " token " << t;
      EXPECT_TRUE(
          std::equal(v.begin() + t * dim, v.begin() + (t + 1) * dim, kv.v[layer].begin() + src))
          << "layer " << layer << " token " << t;
    }
  }
  // A lease holding one token at layer 0 (and none at layer 1): its second sink row is zeros.
  auto fresh = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const std::vector<uint16_t> row = ToHalf(MakeNormal(PerToken(), 13));
  ASSERT_TRUE(store_->Append(fresh->lease_id, 0, {}, 1, row.data(), row.data()).ok());
  std::vector<uint16_t> k(heads * sink * dim, 0xFFFF), v(heads * sink * dim, 0xFFFF);
  ASSERT_TRUE(store_
                  ->ReadRawSinks(fresh->lease_id, 0, 0, heads, reinterpret_cast<uint8_t*>(k.data()),
                                 reinterpret_cast<uint8_t*>(v.data()))
                  .ok());
  for (int h = 0; h < heads; ++h) {
    const auto head = k.begin() + static_cast<size_t>(h) * sink * dim;
    EXPECT_TRUE(std::equal(head, head + dim, row.begin() + h * dim)) << h;
    EXPECT_TRUE(std::all_of(head + dim, head + sink * dim, [](uint16_t x) { return x == 0; })) << h;
  }
}

// The arena read behind a RAW NcclGet, with sinks: after each layer's K and V pages, that
// layer's sink rows, K then V, as ReadRaw and ReadRawSinks return them (here of head 1 alone);
// refused from a block past the first, which has no sink rows.
TEST_F(SinkStoreTest, ArenaRawReadWithSinksPutsEachLayersSinkRowsAfterItsPages) {
  const SequenceKv kv = MakeSequenceKv(config_, 8, 14);
  ASSERT_TRUE(Put(a_, kv).ok());
  auto lease = store_->Match("main", a_, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const uint64_t id = lease->lease_id;
  std::vector<uint8_t> want;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const size_t pages = 2 * LayerLayout(config_, static_cast<int>(layer)).head_page_bytes();
    const size_t sinks = size_t{2} * config_.head_dim * sizeof(uint16_t);  // 2 sink tokens
    std::vector<uint8_t> k(pages), v(pages), sink_k(sinks), sink_v(sinks);
    ASSERT_TRUE(store_->ReadRaw(id, layer, 0, 2, 1, 2, k.data(), v.data()).ok());
    ASSERT_TRUE(store_->ReadRawSinks(id, layer, 1, 2, sink_k.data(), sink_v.data()).ok());
    for (const std::vector<uint8_t>* part : {&k, &v, &sink_k, &sink_v}) {
      want.insert(want.end(), part->begin(), part->end());
    }
  }
  absl::StatusOr<uint8_t*> arena = backend_->AllocateArena(want.size());
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE(store_->ReadRawToArena(id, 0, 2, 0, 2, 1, 2, /*sinks=*/true, *arena).ok());
  EXPECT_EQ(std::vector<uint8_t>(*arena, *arena + want.size()), want);
  EXPECT_EQ(store_->ReadRawToArena(id, 0, 2, 1, 1, 1, 2, /*sinks=*/true, *arena).code(),
            absl::StatusCode::kFailedPrecondition);
  backend_->FreeArena(*arena);
}

// An Append of several blocks into an empty lease: its first block has a sink page, and the
// blocks are distinct (each reads back its own tokens).
TEST_F(WideSinkStoreTest, AnAppendOfSeveralBlocksStartsInABlockWithASinkPage) {
  auto lease = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  constexpr int kTokens = 13;
  const std::vector<uint16_t> kv = ToHalf(MakeNormal(kTokens * PerToken(), 7));
  ASSERT_TRUE(store_->Append(lease->lease_id, 0, {}, kTokens, kv.data(), kv.data()).ok());
  std::vector<uint16_t> k(16 * PerToken()), v(16 * PerToken());
  ASSERT_TRUE(
      store_->ReadFp16(lease->lease_id, 0, 0, 4, 0, config_.num_kv_heads, k.data(), v.data()).ok());
  EXPECT_LT(RelError(k.data(), kv.data(), kTokens * PerToken()), 0.2);
  EXPECT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 1u);
}

// A lease that starts a sequence and decodes it for long ranks, once released, by when it ended:
// a new sequence evicts the tree put in the meantime, not the lease's.
TEST_F(WideSinkStoreTest, AReleasedLeasesTreeRanksByItsLastUse) {
  auto lease = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  const std::vector<int32_t> ids = TokenIds(16, 42);
  auto append = [&](int begin, int n) {
    const std::vector<uint16_t> kv = ToHalf(MakeNormal(n * PerToken(), 7 + begin));
    const std::vector<int32_t> t(ids.begin() + begin, ids.begin() + begin + n);
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      ASSERT_TRUE(store_->Append(lease->lease_id, layer, t, n, kv.data(), kv.data()).ok());
    }
  };
  append(0, 4);  // its first block published
  const std::vector<int32_t> x = TokenIds(8, 50);
  ASSERT_TRUE(PutTokens(x, 1).ok());  // the other block with a sink page
  append(4, 12);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  ASSERT_TRUE(PutTokens(TokenIds(4, 7000), 9).ok());
  EXPECT_EQ(Cached(ids), 16u);
  EXPECT_EQ(Cached(x), 0u);
}

// 16 blocks, 8 with a sink page. Growing a cached sequence by a block when only blocks with a
// sink page are free evicts one leaf without a sink page, not the older one-block sequences.
class HalfSinkStoreTest : public SinkStoreBase {
 protected:
  void SetUp() override { Make(16, 2, 8); }
};

TEST_F(HalfSinkStoreTest, GrowingASequenceSparesOlderSequencesInBlocksWithASinkPage) {
  std::vector<std::vector<int32_t>> singles;
  for (int i = 0; i < 4; ++i) {
    singles.push_back(TokenIds(4, 100 + i));
    ASSERT_TRUE(PutTokens(singles.back(), i).ok());
  }
  const std::vector<int32_t> b = TokenIds(20, 7), d = TokenIds(20, 8);
  ASSERT_TRUE(PutTokens(b, 20).ok());
  ASSERT_TRUE(PutTokens(d, 21).ok());
  ASSERT_EQ(store_->Stats().namespaces[0].sink_blocks_free, 2u);  // and no other block free
  ASSERT_TRUE(PutTokens(Concat(b, TokenIds(4, 9)), 22).ok());
  EXPECT_EQ(Evictions(), 1u);
  for (const std::vector<int32_t>& single : singles) EXPECT_EQ(Cached(single), 4u);
}

}  // namespace
}  // namespace kvpool::testing
