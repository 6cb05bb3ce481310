#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "service/store/kv_store.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

// Token t of `kv` at `layer`: [heads][head_dim].
const uint16_t* TokenK(const SequenceKv& kv, int layer, int t, size_t per_token) {
  return kv.k[layer].data() + t * per_token;
}
const uint16_t* TokenV(const SequenceKv& kv, int layer, int t, size_t per_token) {
  return kv.v[layer].data() + t * per_token;
}

TEST_F(StoreTest, AppendThenAttendEqualsCpuReferenceOverThePages) {
  MakeStore(16);
  const std::vector<int32_t> ids = TokenIds(9, 2);
  const SequenceKv kv = MakeSequenceKv(config_, 9, 20);
  ASSERT_TRUE(Put(std::vector<int32_t>(ids.begin(), ids.begin() + 8), kv).ok());
  auto lease = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->cached_tokens, 8u);
  const size_t pt = PerToken();
  // Token 8: appended to layer 0, and to layer 1 by Attend itself.
  auto held =
      store_->Append(lease->lease_id, 0, {ids[8]}, 1, TokenK(kv, 0, 8, pt), TokenV(kv, 0, 8, pt));
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, 9u);

  const int q_heads = 4;
  const std::vector<uint16_t> q = ToHalf(MakeNormal(q_heads * config_.head_dim, 21));
  for (int layer = 0; layer < 2; ++layer) {
    KvStore::AttendItem item;
    item.lease_id = lease->lease_id;
    item.q = q.data();
    if (layer == 1) {
      item.new_k = TokenK(kv, 1, 8, pt);
      item.new_v = TokenV(kv, 1, 8, pt);
      item.new_token_id = ids[8];
    }
    std::vector<float> out(q_heads * config_.head_dim), lse(q_heads);
    uint32_t context = 0;
    ASSERT_TRUE(
        store_->Attend(layer, q_heads, 0.f, {item}, {out.data(), nullptr, lse.data(), &context})
            .ok());
    EXPECT_EQ(context, 9u);

    const std::vector<uint8_t> pages = ReferencePages(kv, layer, 9);
    const int32_t table[3] = {0, 1, 2};
    const int32_t len = 9;
    std::vector<float> ref(out.size()), ref_lse(q_heads);
    PagedDecodeAttentionParams a;
    a.layout = LayerLayout(config_, layer);
    a.pages = pages.data();
    a.q = q.data();
    a.num_seqs = 1;
    a.num_q_heads = q_heads;
    a.block_tables = table;
    a.max_blocks_per_seq = 3;
    a.seq_lens = &len;
    a.sm_scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    a.out = ref.data();
    a.lse = ref_lse.data();
    a.num_blocks = 3;
    ASSERT_EQ(cpu::PagedDecodeAttention(a), KernelStatus::kOk);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_FLOAT_EQ(out[i], ref[i]) << "layer " << layer;
    for (int h = 0; h < q_heads; ++h) EXPECT_FLOAT_EQ(lse[h], ref_lse[h]);
  }
  auto view = store_->DescribeLease(lease->lease_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->num_blocks, 3u);
  EXPECT_EQ(view->layer_tokens, (std::vector<uint32_t>{9, 9}));
}

// Every read path (raw and fp16, to the host and to an arena) returns zeros for the rows past a
// layer's written tokens, though the lease's tail block held another sequence's tokens before:
// the rows after a partial block's 3 tokens, and the whole block of a layer not written yet.
TEST_F(StoreTest, ReadsReturnZerosPastTheWrittenTokens) {
  MakeStore(2);
  ASSERT_TRUE(Put(TokenIds(8, 500), MakeSequenceKv(config_, 8, 30)).ok());  // fills the pool
  auto lease = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const SequenceKv kv = MakeSequenceKv(config_, 3, 31);
  ASSERT_TRUE(
      store_->Append(lease->lease_id, 0, TokenIds(3, 2), 3, kv.k[0].data(), kv.v[0].data()).ok());
  ASSERT_EQ(store_->Stats().namespaces[0].evictions, 1u);  // the tail block was a cached one
  const uint64_t id = lease->lease_id;
  const uint32_t heads = config_.num_kv_heads;

  // Raw: layer 0 as the CPU reference writes 3 tokens into a zeroed page; layer 1 all zeros.
  std::vector<uint8_t> raw[2][2];  // [layer][K|V]
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const size_t half = heads * LayerLayout(config_, static_cast<int>(layer)).head_page_bytes();
    raw[layer][0].resize(half);
    raw[layer][1].resize(half);
    ASSERT_TRUE(
        store_->ReadRaw(id, layer, 0, 1, 0, heads, raw[layer][0].data(), raw[layer][1].data())
            .ok());
  }
  const std::vector<uint8_t> ref = ReferencePages(kv, 0, 3);
  const size_t half0 = raw[0][0].size();
  EXPECT_EQ(raw[0][0], std::vector<uint8_t>(ref.begin(), ref.begin() + half0));
  EXPECT_EQ(raw[0][1], std::vector<uint8_t>(ref.begin() + half0, ref.end()));
  EXPECT_EQ(raw[1][0], std::vector<uint8_t>(raw[1][0].size(), 0));
  EXPECT_EQ(raw[1][1], std::vector<uint8_t>(raw[1][1].size(), 0));

  // FP16: rows 0..2 of layer 0 as the reference pages dequantize, the rest zeros.
  const size_t elems = config_.block_tokens * PerToken();
  std::vector<uint16_t> fp16[2][2];
  for (uint32_t layer = 0; layer < 2; ++layer) {
    fp16[layer][0].resize(elems);
    fp16[layer][1].resize(elems);
    ASSERT_TRUE(
        store_->ReadFp16(id, layer, 0, 1, 0, heads, fp16[layer][0].data(), fp16[layer][1].data())
            .ok());
  }
  std::vector<uint16_t> ref_k(elems), ref_v(elems);
  const int32_t block = 0;
  DequantizeParams d;
  d.layout = LayerLayout(config_, 0);
  d.pages = ref.data();
  d.block_ids = &block;
  d.num_out_blocks = 1;
  d.head_end = static_cast<int>(heads);
  d.k_out = ref_k.data();
  d.v_out = ref_v.data();
  d.num_blocks = 1;
  ASSERT_EQ(cpu::Dequantize(d), KernelStatus::kOk);
  std::vector<uint16_t> want_k(elems, 0), want_v(elems, 0);
  std::copy(ref_k.begin(), ref_k.begin() + 3 * PerToken(), want_k.begin());
  std::copy(ref_v.begin(), ref_v.begin() + 3 * PerToken(), want_v.begin());
  EXPECT_EQ(fp16[0][0], want_k);
  EXPECT_EQ(fp16[0][1], want_v);
  EXPECT_EQ(fp16[1][0], std::vector<uint16_t>(elems, 0));
  EXPECT_EQ(fp16[1][1], std::vector<uint16_t>(elems, 0));

  // To an arena (the NCCL data plane's reads): both layers, K then V, as above.
  const size_t raw_bytes = 2 * (raw[0][0].size() + raw[1][0].size());
  absl::StatusOr<uint8_t*> arena = backend_->AllocateArena(std::max(raw_bytes, 8 * elems));
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE(store_->ReadRawToArena(id, 0, 2, 0, 1, 0, heads, /*sinks=*/false, *arena).ok());
  EXPECT_EQ(store_->ReadRawToArena(id, 0, 2, 0, 1, 0, heads, /*sinks=*/true, *arena).code(),
            absl::StatusCode::kFailedPrecondition);  // the namespace keeps no sinks
  std::vector<uint8_t> raw_all;
  for (const auto& layer : raw) {
    for (const auto& half : layer) raw_all.insert(raw_all.end(), half.begin(), half.end());
  }
  EXPECT_EQ(std::vector<uint8_t>(*arena, *arena + raw_bytes), raw_all);
  ASSERT_TRUE(store_->ReadFp16ToArena(id, 0, 2, 0, 1, 0, heads, *arena).ok());
  const auto* got = reinterpret_cast<const uint16_t*>(*arena);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(std::vector<uint16_t>(got + i * elems, got + (i + 1) * elems), fp16[i / 2][i % 2])
        << "layer " << i / 2 << (i % 2 == 0 ? " K" : " V");
  }
  backend_->FreeArena(*arena);
}

TEST_F(StoreTest, AttendBatchesLeasesInOneCall) {
  MakeStore(16);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 22);
  const std::vector<int32_t> a_ids = TokenIds(8, 1), b_ids = TokenIds(4, 600);
  ASSERT_TRUE(Put(a_ids, kv).ok());
  ASSERT_TRUE(Put(b_ids, kv).ok());
  auto a = store_->Match("main", a_ids, absl::ZeroDuration());
  auto b = store_->Match("main", b_ids, absl::ZeroDuration());
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<uint16_t> q = ToHalf(MakeNormal(2 * 2 * config_.head_dim, 23));
  KvStore::AttendItem items[2];
  items[0].lease_id = a->lease_id;
  items[0].q = q.data();
  items[1].lease_id = b->lease_id;
  items[1].q = q.data() + 2 * config_.head_dim;
  std::vector<float> out(2 * 2 * config_.head_dim);
  uint32_t context[2];
  ASSERT_TRUE(store_->Attend(0, 2, 0.f, items, {out.data(), nullptr, nullptr, context}).ok());
  EXPECT_EQ(context[0], 8u);
  EXPECT_EQ(context[1], 4u);
  // fp16 output: the fp32 output rounded, element for element.
  std::vector<uint16_t> out16(out.size(), 0xFFFF);
  ASSERT_TRUE(store_->Attend(0, 2, 0.f, items, {nullptr, out16.data(), nullptr, context}).ok());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out16[i], FloatToHalf(out[i])) << i;
  // Exactly one of the two outputs.
  EXPECT_EQ(store_->Attend(0, 2, 0.f, items, {out.data(), out16.data(), nullptr, context}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, TailBlockPublishedAfterAllLayersFilled) {
  MakeStore(16);
  const std::vector<int32_t> ids = TokenIds(12, 7);
  const SequenceKv kv = MakeSequenceKv(config_, 12, 24);
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 8);
  ASSERT_TRUE(Put(prefix, kv).ok());
  auto lease = store_->Match("main", prefix, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  const size_t pt = PerToken();
  const std::vector<int32_t> tail(ids.begin() + 8, ids.end());
  ASSERT_TRUE(
      store_->Append(lease->lease_id, 0, tail, 4, TokenK(kv, 0, 8, pt), TokenV(kv, 0, 8, pt)).ok());
  auto probe = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(probe.ok());
  EXPECT_EQ(probe->cached_tokens, 8u);  // layer 1 has not filled the block yet
  ASSERT_TRUE(store_->Release(probe->lease_id).ok());
  ASSERT_TRUE(
      store_->Append(lease->lease_id, 1, tail, 4, TokenK(kv, 1, 8, pt), TokenV(kv, 1, 8, pt)).ok());
  probe = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(probe.ok());
  EXPECT_EQ(probe->cached_tokens, 12u);
  // The published block holds what was appended, as the reference writes it.
  for (int l = 0; l < 2; ++l) {
    std::vector<uint16_t> k(12 * pt), v(12 * pt);
    ASSERT_TRUE(store_->ReadFp16(probe->lease_id, l, 0, 3, 0, 2, k.data(), v.data()).ok());
    const auto [rk, rv] = ReferenceFp16(kv, l, 12);
    EXPECT_EQ(k, rk);
    EXPECT_EQ(v, rv);
  }
  // Released, the published tail block stays cached.
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  ASSERT_TRUE(store_->Release(probe->lease_id).ok());
  EXPECT_EQ(store_->Stats().namespaces[0].tokens_stored, 12u);
}

// A decode loop appending one token per step and layer publishes each tail block, in order, once
// every layer has filled it.
TEST_F(StoreTest, TailBlocksPublishOneAfterAnotherTokenByToken) {
  MakeStore(32);
  const int bt = config_.block_tokens;
  const std::vector<int32_t> ids = TokenIds(5 * bt, 11);
  const SequenceKv kv = MakeSequenceKv(config_, 5 * bt, 31);
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 2 * bt);
  ASSERT_TRUE(Put(prefix, kv).ok());
  auto lease = store_->Match("main", prefix, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  const size_t pt = PerToken();
  for (int t = 2 * bt; t < 5 * bt; ++t) {
    for (int l = 0; l < config_.num_layers; ++l) {
      ASSERT_TRUE(
          store_
              ->Append(lease->lease_id, l, {ids[t]}, 1, TokenK(kv, l, t, pt), TokenV(kv, l, t, pt))
              .ok());
    }
    auto probe = store_->Match("main", ids, absl::ZeroDuration());
    ASSERT_TRUE(probe.ok());
    EXPECT_EQ(probe->cached_tokens, static_cast<uint32_t>((t + 1) / bt * bt)) << "token " << t;
    ASSERT_TRUE(store_->Release(probe->lease_id).ok());
  }
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  EXPECT_EQ(store_->Stats().namespaces[0].tokens_stored, static_cast<uint32_t>(5 * bt));
}

TEST_F(StoreTest, TailWithoutTokenIdsStaysPrivateAndIsFreedOnRelease) {
  MakeStore(16);
  const SequenceKv kv = MakeSequenceKv(config_, 4, 25);
  auto lease = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->num_blocks, 0u);
  for (int l = 0; l < 2; ++l) {
    ASSERT_TRUE(store_->Append(lease->lease_id, l, {}, 4, kv.k[l].data(), kv.v[l].data()).ok());
  }
  NamespaceStoreStats stats = store_->Stats().namespaces[0];
  EXPECT_EQ(stats.tokens_stored, 0u);
  EXPECT_EQ(stats.blocks_in_use, 1u);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  stats = store_->Stats().namespaces[0];
  EXPECT_EQ(stats.blocks_free, 16u);
}

TEST_F(StoreTest, LeasesExpireWithTheClock) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(8, 3);
  ASSERT_TRUE(Put(ids, MakeSequenceKv(config_, 8, 26)).ok());
  auto lease = store_->Match("main", ids, absl::Seconds(10));
  auto described = store_->Match("main", ids, absl::Seconds(10));
  ASSERT_TRUE(lease.ok() && described.ok());
  EXPECT_EQ(lease->expires, clock_.Now() + absl::Seconds(10));
  EXPECT_EQ(store_->Stats().namespaces[0].blocks_evictable, 0u);
  clock_.Advance(absl::Seconds(6));
  ASSERT_TRUE(store_->RenewLease(lease->lease_id).ok());
  ASSERT_TRUE(store_->DescribeLease(described->lease_id).ok());  // does not renew
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(store_->ExpireLeases(), 1u);
  EXPECT_EQ(store_->DescribeLease(described->lease_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->RenewLease(described->lease_id).code(), absl::StatusCode::kNotFound);
  clock_.Advance(absl::Seconds(5));
  EXPECT_EQ(store_->ExpireLeases(), 1u);
  EXPECT_EQ(store_->Release(lease->lease_id).code(), absl::StatusCode::kNotFound);
  const StoreStats stats = store_->Stats();
  EXPECT_EQ(stats.active_leases, 0u);
  EXPECT_EQ(stats.namespaces[0].blocks_evictable, 2u);
}

// Stats expires what is past its TTL first: a lease nobody calls on is not counted as live, nor
// its blocks as in use, once its time is up (the metrics read Stats alone).
TEST_F(StoreTest, StatsDoNotCountExpiredLeases) {
  MakeStore(8);
  const std::vector<int32_t> ids = TokenIds(8, 4);
  ASSERT_TRUE(Put(ids, MakeSequenceKv(config_, 8, 28)).ok());
  ASSERT_TRUE(store_->Match("main", ids, absl::Seconds(1)).ok());
  StoreStats stats = store_->Stats();
  EXPECT_EQ(stats.active_leases, 1u);
  EXPECT_EQ(stats.namespaces[0].blocks_in_use, 2u);
  clock_.Advance(absl::Seconds(2));
  stats = store_->Stats();
  EXPECT_EQ(stats.active_leases, 0u);
  EXPECT_EQ(stats.namespaces[0].blocks_in_use, 0u);
  EXPECT_EQ(stats.namespaces[0].blocks_evictable, 2u);
}

// The limit counts the ids an append keeps: up to the last position it names, not its end.
TEST_F(StoreTest, LeaseTokenIdLimitCountsOnlyTheIdsAnAppendKeeps) {
  store_options_.max_lease_token_ids = 6;
  MakeStore(16);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 27);
  // Nothing cached: the lease holds no tokens but keeps the 4 ids.
  auto lease = store_->Match("main", TokenIds(4, 5), absl::ZeroDuration());
  ASSERT_TRUE(lease.ok());
  std::vector<int32_t> ids(8, -1);
  ids[5] = 77;  // positions 0..7 of layer 0: naming 5 grows the ids from 4 to 6, the limit
  const absl::StatusOr<uint32_t> held =
      store_->Append(lease->lease_id, 0, ids, 8, kv.k[0].data(), kv.v[0].data());
  EXPECT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(store_->Stats().lease_token_ids, 6u);
  ids[5] = -1;
  ids[7] = 78;  // positions 8..15: naming 15 needs 16 ids
  EXPECT_EQ(
      store_->Append(lease->lease_id, 0, ids, 8, kv.k[0].data(), kv.v[0].data()).status().code(),
      absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Stats().lease_token_ids, 6u);
}

TEST_F(StoreTest, LeaseTokenIdsAreBoundedAcrossLeases) {
  store_options_.max_lease_token_ids = 20;
  MakeStore(16);
  const size_t pt = PerToken();
  const SequenceKv kv = MakeSequenceKv(config_, 12, 27);
  auto first = store_->Match("main", TokenIds(12, 5), absl::ZeroDuration());
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(store_->Stats().lease_token_ids, 12u);
  // 12 + 9 ids pass the limit: refused, and no lease is added.
  EXPECT_EQ(store_->Match("main", TokenIds(9, 5), absl::ZeroDuration()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Stats().active_leases, 1u);
  auto second = store_->Match("main", {}, absl::ZeroDuration());
  ASSERT_TRUE(second.ok());
  // Appends that name ids grow the lease's list; past the limit one is refused whole.
  ASSERT_TRUE(
      store_->Append(second->lease_id, 0, TokenIds(4, 100), 4, kv.k[0].data(), kv.v[0].data())
          .ok());
  EXPECT_EQ(store_->Stats().lease_token_ids, 16u);
  const std::vector<int32_t> five = TokenIds(5, 200);
  EXPECT_EQ(store_->Append(second->lease_id, 0, five, 5, TokenK(kv, 0, 4, pt), TokenV(kv, 0, 4, pt))
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  auto view = store_->DescribeLease(second->lease_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->layer_tokens, (std::vector<uint32_t>{4, 0}));
  EXPECT_EQ(store_->Stats().namespaces[0].blocks_in_use, 1u);
  // Appends without ids keep none.
  ASSERT_TRUE(
      store_->Append(second->lease_id, 0, {}, 4, TokenK(kv, 0, 4, pt), TokenV(kv, 0, 4, pt)).ok());
  EXPECT_EQ(store_->Stats().lease_token_ids, 16u);
  // Releasing a lease gives its ids back.
  ASSERT_TRUE(store_->Release(first->lease_id).ok());
  EXPECT_EQ(store_->Stats().lease_token_ids, 4u);
  ASSERT_TRUE(store_->Match("main", TokenIds(16, 5), absl::ZeroDuration()).ok());
  EXPECT_EQ(store_->Stats().lease_token_ids, 20u);
  ASSERT_TRUE(store_->Release(second->lease_id).ok());
  EXPECT_EQ(store_->Stats().lease_token_ids, 16u);
}

TEST_F(StoreTest, LeaseTtlIsCappedByTheStore) {
  MakeStore(4);
  auto lease = store_->Match("main", TokenIds(4, 1), absl::Hours(5));
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->expires, clock_.Now() + absl::Minutes(10));
}

}  // namespace
}  // namespace kvpool::testing
