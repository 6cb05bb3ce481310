#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "service/store/kv_store.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

TEST_F(StoreTest, PutMatchReadRoundTripEqualsCpuReference) {
  MakeStore(16);
  const std::vector<int32_t> ids = TokenIds(14, 5);  // 3 full blocks + 2 ignored tokens
  const SequenceKv kv = MakeSequenceKv(config_, 14, 1);
  auto put = Put(ids, kv);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens_cached, 0u);
  EXPECT_EQ(put->tokens_stored, 12u);
  EXPECT_EQ(put->tokens_ignored, 2u);

  auto match = store_->Match("", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok()) << match.status();
  EXPECT_EQ(match->cached_tokens, 12u);
  EXPECT_EQ(match->num_blocks, 3u);
  for (int l = 0; l < config_.num_layers; ++l) {
    std::vector<uint16_t> k(12 * PerToken()), v(12 * PerToken());
    ASSERT_TRUE(store_->ReadFp16(match->lease_id, l, 0, 3, 0, 2, k.data(), v.data()).ok());
    const auto [rk, rv] = ReferenceFp16(kv, l, 12);
    EXPECT_EQ(k, rk) << "layer " << l;
    EXPECT_EQ(v, rv) << "layer " << l;
  }
  const StoreStats stats = store_->Stats();
  EXPECT_EQ(stats.namespaces[0].tokens_stored, 12u);
  EXPECT_GT(stats.namespaces[0].quant_rel_error, 0.0);
  EXPECT_LT(stats.namespaces[0].quant_rel_error, 0.2);
}

// A Put whose layers come from arena memory, several per call (the NCCL path, whose sampled
// inputs are read back together), samples the same tokens as one from host memory a layer at a
// time, and so records the same quantization error to the last bit; both token ranges start
// inside a block.
TEST_F(StoreTest, ArenaPutSamplesTheSameErrorAsAHostPut) {
  const std::vector<int32_t> ids = TokenIds(14, 5);
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {{0, 6}, {6, 8}};
  MakeStore(16);
  const SequenceKv kv = MakeSequenceKv(config_, 14, 3);
  auto host = store_->BeginPut("main", ids);
  ASSERT_TRUE(host.ok()) << host.status();
  for (const auto& [begin, count] : ranges) {
    for (int l = 0; l < config_.num_layers; ++l) {
      ASSERT_TRUE((*host)->AddChunk(l, begin, count, kv.k[l].data() + begin * PerToken(),
                                   kv.v[l].data() + begin * PerToken())
                      .ok());
    }
  }
  ASSERT_TRUE((*host)->Commit().ok());
  const double host_error = store_->Stats().namespaces[0].quant_rel_error;
  ASSERT_GT(host_error, 0.0);

  MakeStore(16);
  const size_t layer_bytes = 14 * PerToken() * sizeof(uint16_t);
  absl::StatusOr<uint8_t*> arena = backend_->AllocateArena(2 * config_.num_layers * layer_bytes);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto* halves = reinterpret_cast<uint16_t*>(*arena);
  for (int l = 0; l < config_.num_layers; ++l) {
    std::memcpy(halves + 2 * l * 14 * PerToken(), kv.k[l].data(), layer_bytes);
    std::memcpy(halves + (2 * l + 1) * 14 * PerToken(), kv.v[l].data(), layer_bytes);
  }
  auto from_arena = store_->BeginPut("main", ids);
  ASSERT_TRUE(from_arena.ok()) << from_arena.status();
  for (const auto& [begin, count] : ranges) {
    std::vector<KvStore::PutSession::LayerChunk> chunks;
    for (int l = 0; l < config_.num_layers; ++l) {
      chunks.push_back({static_cast<uint32_t>(l), halves + (2 * l * 14 + begin) * PerToken(),
                        halves + ((2 * l + 1) * 14 + begin) * PerToken()});
    }
    ASSERT_TRUE((*from_arena)->AddChunksFromArena(begin, count, chunks).ok());
  }
  ASSERT_TRUE((*from_arena)->Commit().ok());
  EXPECT_EQ(store_->Stats().namespaces[0].quant_rel_error, host_error);
  backend_->FreeArena(*arena);
}

TEST_F(StoreTest, ArenaChunksNamingALayerTwiceAreRefusedAndWriteNothing) {
  const std::vector<int32_t> ids = TokenIds(8, 5);
  MakeStore(8);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 3);
  const size_t layer_bytes = 8 * PerToken() * sizeof(uint16_t);
  absl::StatusOr<uint8_t*> arena = backend_->AllocateArena(4 * layer_bytes);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto* halves = reinterpret_cast<uint16_t*>(*arena);
  for (int i = 0; i < 2; ++i) {  // layer 0's K and V, then layer 1's
    std::memcpy(halves + 2 * i * 8 * PerToken(), kv.k[i].data(), layer_bytes);
    std::memcpy(halves + (2 * i + 1) * 8 * PerToken(), kv.v[i].data(), layer_bytes);
  }
  const uint16_t* layer0_k = halves;
  const uint16_t* layer1_k = halves + 2 * 8 * PerToken();
  auto session = store_->BeginPut("main", ids);
  ASSERT_TRUE(session.ok()) << session.status();
  const absl::Status twice = (*session)->AddChunksFromArena(
      0, 8, {{0, layer0_k, layer0_k + 8 * PerToken()}, {0, layer1_k, layer1_k + 8 * PerToken()}});
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument) << twice;
  EXPECT_EQ(store_->Stats().namespaces[0].quantized_bytes, 0u);
  ASSERT_TRUE((*session)
                  ->AddChunksFromArena(0, 8,
                                       {{0, layer0_k, layer0_k + 8 * PerToken()},
                                        {1, layer1_k, layer1_k + 8 * PerToken()}})
                  .ok());
  ASSERT_TRUE((*session)->Commit().ok());
  backend_->FreeArena(*arena);
}

TEST_F(StoreTest, RawPagesAreByteIdenticalToCpuQuantizeAppend) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(8, 9);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 2);
  ASSERT_TRUE(Put(ids, kv).ok());
  auto match = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok());
  const int layer = 1;
  const PageLayout layout = LayerLayout(config_, layer);
  const size_t hp = layout.head_page_bytes();
  // Head 1 only, both blocks.
  std::vector<uint8_t> k(2 * hp), v(2 * hp);
  ASSERT_TRUE(store_->ReadRaw(match->lease_id, layer, 0, 2, 1, 2, k.data(), v.data()).ok());
  const std::vector<uint8_t> ref = ReferencePages(kv, layer, 8);
  for (int b = 0; b < 2; ++b) {
    const uint8_t* page = ref.data() + b * layout.layer_page_bytes();
    EXPECT_EQ(std::memcmp(k.data() + b * hp, page + layout.head_page_offset(0, 1), hp), 0);
    EXPECT_EQ(std::memcmp(v.data() + b * hp, page + layout.head_page_offset(1, 1), hp), 0);
  }
}

TEST_F(StoreTest, SecondPutOfSharedPrefixReportsTokensCached) {
  MakeStore(16);
  std::vector<int32_t> a = TokenIds(8, 1);
  const SequenceKv kv = MakeSequenceKv(config_, 12, 3);
  ASSERT_TRUE(Put(a, kv).ok());
  std::vector<int32_t> b = a;
  for (int32_t t : TokenIds(4, 900)) b.push_back(t);
  auto put = Put(b, kv);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens_cached, 8u);
  EXPECT_EQ(put->tokens_stored, 4u);
  const StoreStats stats = store_->Stats();
  EXPECT_EQ(stats.namespaces[0].tokens_stored, 12u);
  EXPECT_EQ(stats.namespaces[0].prefix_hit_tokens, 8u);
  EXPECT_EQ(stats.namespaces[0].prefix_query_tokens, 20u);
}

TEST_F(StoreTest, ConcurrentIdenticalPutsDedup) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(8, 4);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 4);
  auto first = store_->BeginPut("main", ids);
  auto second = store_->BeginPut("main", ids);
  ASSERT_TRUE(first.ok() && second.ok());
  for (auto* s : {&*first, &*second}) {
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE((*s)->AddChunk(l, 0, 8, kv.k[l].data(), kv.v[l].data()).ok());
    }
  }
  EXPECT_EQ(store_->Stats().namespaces[0].blocks_free, 4u);
  const absl::StatusOr<KvStore::PutResult> a = (*first)->Commit();
  const absl::StatusOr<KvStore::PutResult> b = (*second)->Commit();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens_stored, 8u);
  EXPECT_EQ(a->tokens_cached, 0u);
  // The second found both blocks published: they count as cached, not stored.
  EXPECT_EQ(b->tokens_stored, 0u);
  EXPECT_EQ(b->tokens_cached, 8u);
  const NamespaceStoreStats stats = store_->Stats().namespaces[0];
  EXPECT_EQ(stats.tokens_stored, 8u);
  EXPECT_EQ(stats.blocks_free, 6u);  // the duplicates went back
}

TEST_F(StoreTest, UncommittedPutLeavesNothing) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(8, 1);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 5);
  {
    auto session = store_->BeginPut("main", ids);
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->AddChunk(0, 0, 8, kv.k[0].data(), kv.v[0].data()).ok());
    EXPECT_EQ(store_->Stats().namespaces[0].blocks_in_use, 2u);
  }
  const NamespaceStoreStats stats = store_->Stats().namespaces[0];
  EXPECT_EQ(stats.blocks_free, 8u);
  EXPECT_EQ(stats.tokens_stored, 0u);
  auto match = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok());
  EXPECT_EQ(match->cached_tokens, 0u);
}

TEST_F(StoreTest, CommitBeforeEveryLayerArrivedFailsAndPublishesNothing) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(8, 1);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 6);
  auto session = store_->BeginPut("main", ids);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->AddChunk(0, 0, 8, kv.k[0].data(), kv.v[0].data()).ok());
  ASSERT_TRUE((*session)->AddChunk(1, 0, 7, kv.k[1].data(), kv.v[1].data()).ok());
  EXPECT_EQ((*session)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->Stats().namespaces[0].tokens_stored, 0u);
}

TEST_F(StoreTest, NanRejectedAndNothingStored) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(4, 1);
  SequenceKv kv = MakeSequenceKv(config_, 4, 7);
  kv.v[1][37] = 0x7E00;  // NaN
  auto session = store_->BeginPut("main", ids);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->AddChunk(0, 0, 4, kv.k[0].data(), kv.v[0].data()).ok());
  const uint64_t written = store_->Stats().namespaces[0].quantized_bytes;
  const absl::Status s = (*session)->AddChunk(1, 0, 4, kv.k[1].data(), kv.v[1].data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Stats().namespaces[0].quantized_bytes, written);
  EXPECT_FALSE((*session)->Commit().ok());
  EXPECT_EQ(store_->Stats().namespaces[0].tokens_stored, 0u);
}

// A Put that fails (here a NaN; a stream that ends incomplete or is cancelled alike) counts no
// prefix lookup: a retried prefill would otherwise count its prompt again.
TEST_F(StoreTest, FailedPutCountsNoPrefixLookup) {
  MakeStore(8);
  const std::vector<int32_t> cached = TokenIds(8, 1);
  SequenceKv kv = MakeSequenceKv(config_, 12, 9);
  ASSERT_TRUE(Put(cached, kv).ok());
  const NamespaceStoreStats before = store_->Stats().namespaces[0];
  std::vector<int32_t> ids = cached;
  for (int32_t t : TokenIds(4, 900)) ids.push_back(t);
  kv.k[0][8 * PerToken() + 5] = 0x7E00;  // NaN in the first new token
  {
    auto session = store_->BeginPut("main", ids);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ((*session)->tokens_cached(), 8u);
    EXPECT_EQ((*session)->AddChunk(0, 0, 12, kv.k[0].data(), kv.v[0].data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
  const NamespaceStoreStats after = store_->Stats().namespaces[0];
  EXPECT_EQ(after.prefix_query_tokens, before.prefix_query_tokens);
  EXPECT_EQ(after.prefix_hit_tokens, before.prefix_hit_tokens);
}

TEST_F(StoreTest, PoolFullOfPinnedBlocksIsResourceExhausted) {
  MakeStore(4);
  const std::vector<int32_t> ids = TokenIds(16, 1);
  const SequenceKv kv = MakeSequenceKv(config_, 16, 8);
  ASSERT_TRUE(Put(ids, kv).ok());
  auto lease = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->num_blocks, 4u);
  auto put = store_->BeginPut("main", TokenIds(4, 5000));
  ASSERT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(put.status().message().find("pool full: all 4 blocks are pinned"),
            std::string::npos)
      << put.status();
  EXPECT_EQ(store_->Stats().namespaces[0].tokens_stored, 16u);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  EXPECT_TRUE(store_->BeginPut("main", TokenIds(4, 5000)).ok());
}

TEST_F(StoreTest, EvictionNeverEvictsPinnedAndKeepsCachedBlocksReachable) {
  MakeStore(6);
  const SequenceKv kv = MakeSequenceKv(config_, 12, 9);
  const std::vector<int32_t> pinned_ids = TokenIds(8, 1);
  ASSERT_TRUE(Put(pinned_ids, kv).ok());
  auto pin = store_->Match("main", pinned_ids, absl::ZeroDuration());
  ASSERT_TRUE(pin.ok());
  std::vector<std::vector<int32_t>> sequences;
  for (int i = 0; i < 6; ++i) {
    sequences.push_back(TokenIds(4 * (1 + i % 3), 1000 * (i + 1)));
    auto put = Put(sequences.back(), kv);
    ASSERT_TRUE(put.ok()) << put.status();
    // Every published block is reachable: a Match of each sequence stops only at a missing
    // block, never past a hole, and the pinned one is intact.
    auto still = store_->Match("main", pinned_ids, absl::ZeroDuration());
    ASSERT_TRUE(still.ok());
    EXPECT_EQ(still->cached_tokens, 8u);
    ASSERT_TRUE(store_->Release(still->lease_id).ok());
    const NamespaceStoreStats stats = store_->Stats().namespaces[0];
    uint64_t reachable = 8;
    for (const auto& seq : sequences) {
      auto m = store_->Match("main", seq, absl::ZeroDuration());
      ASSERT_TRUE(m.ok());
      reachable += m->cached_tokens;
      ASSERT_TRUE(store_->Release(m->lease_id).ok());
    }
    EXPECT_EQ(reachable, stats.tokens_stored) << "after put " << i;
  }
  EXPECT_GT(store_->Stats().namespaces[0].evictions, 0u);
  std::vector<uint16_t> k(8 * PerToken()), v(8 * PerToken());
  ASSERT_TRUE(store_->ReadFp16(pin->lease_id, 0, 0, 2, 0, 2, k.data(), v.data()).ok());
  const auto [rk, rv] = ReferenceFp16(kv, 0, 8);
  EXPECT_EQ(k, rk);
}

TEST_F(StoreTest, SinkTokensRoundTrip) {
  MakeStore(8, /*sink_tokens=*/2);
  const std::vector<int32_t> ids = TokenIds(8, 1);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 10);
  ASSERT_TRUE(Put(ids, kv).ok());
  auto match = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok());
  std::vector<uint16_t> k(8 * PerToken()), v(8 * PerToken());
  ASSERT_TRUE(store_->ReadFp16(match->lease_id, 1, 0, 2, 0, 2, k.data(), v.data()).ok());
  const auto [rk, rv] = ReferenceFp16(kv, 1, 8);
  EXPECT_EQ(k, rk);
  EXPECT_EQ(v, rv);
}

}  // namespace
}  // namespace kvpool::testing
