// One test per class of bad input to the store API: each is rejected with the documented code
// and changes nothing; and what a namespace being created holds (its name and capacity, not the
// store's lock).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/page_layout.h"
#include "service/store/kv_store.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

using absl::StatusCode;

// A store over `backend` whose pool holds `pool_bytes`.
absl::StatusOr<std::unique_ptr<KvStore>> StoreOver(ComputeBackend* backend, uint64_t pool_bytes) {
  KvStore::Options o;
  o.pool_bytes = pool_bytes;
  o.backend = backend;
  return KvStore::Create(o);
}

// A backend whose kernels do not serve INT8 pages.
class NoInt8Backend final : public ForwardingBackend {
 public:
  absl::Status CheckLayout(const PageLayout& layout) const override {
    return layout.dtype == KvDtype::kInt8 ? absl::InvalidArgumentError("no INT8 pages here")
                                          : absl::OkStatus();
  }
};

// A namespace with a layer the backend does not serve is refused, and reserves nothing (its
// Puts would all fail).
TEST(StoreNamespaces, ALayerTheBackendDoesNotServeIsRefused) {
  NoInt8Backend backend;
  auto store = StoreOver(&backend, 1 << 20);
  ASSERT_TRUE(store.ok()) << store.status();
  NamespaceConfig c = SmallConfig("mixed");  // layer 0 INT4, layer 1 INT8
  const absl::StatusOr<NamespaceInfo> refused = (*store)->CreateNamespace(c);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("layer 1: no INT8 pages here"), std::string::npos)
      << refused.status();
  EXPECT_TRUE((*store)->ListNamespaces().empty());
  c.layer_dtypes = {KvDtype::kInt4, KvDtype::kInt4};
  const absl::StatusOr<NamespaceInfo> created = (*store)->CreateNamespace(c);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->config.capacity_bytes, uint64_t{1} << 20);  // the whole pool was free
}

// A backend whose arena allocations, once gated, wait until released (at most 10 s).
class GatedArenaBackend final : public ForwardingBackend {
 public:
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    if (gated.load()) {
      entered.Notify();
      timed_out = !released.WaitForNotificationWithTimeout(absl::Seconds(10));
    }
    return ForwardingBackend::AllocateArena(bytes);
  }
  std::atomic<bool> gated{false};
  absl::Notification entered, released;
  bool timed_out = false;  // read after the creating thread is joined
};

// A namespace's arena is allocated and zero-filled without the store's lock: other calls go on
// meanwhile, while its name and capacity are already taken.
TEST(StoreNamespaces, CallsGoOnWhileANamespaceArenaIsFilled) {
  GatedArenaBackend backend;
  auto store = StoreOver(&backend, 2 << 20);
  ASSERT_TRUE(store.ok()) << store.status();
  NamespaceConfig main = SmallConfig("main");
  main.capacity_bytes = 1 << 20;
  ASSERT_TRUE((*store)->CreateNamespace(main).ok());
  const std::vector<int32_t> ids = TokenIds(8, 1);
  ASSERT_TRUE(PutIntoStore(**store, "main", ids, MakeSequenceKv(main, 8, 2)).ok());

  backend.gated = true;
  absl::StatusOr<NamespaceInfo> second = absl::UnknownError("not run");
  std::thread creating([&] { second = (*store)->CreateNamespace(SmallConfig("second")); });
  backend.entered.WaitForNotification();
  auto lease = (*store)->Match("main", ids, absl::Seconds(10));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->cached_tokens, 8u);
  EXPECT_EQ((*store)->Stats().namespaces.size(), 1u);
  EXPECT_EQ((*store)->CreateNamespace(SmallConfig("second")).status().code(),
            StatusCode::kAlreadyExists);
  NamespaceConfig third = SmallConfig("third");
  third.capacity_bytes = 64 << 10;  // the rest of the pool is the second's
  EXPECT_EQ((*store)->CreateNamespace(third).status().code(), StatusCode::kResourceExhausted);
  backend.released.Notify();
  creating.join();
  EXPECT_FALSE(backend.timed_out) << "the calls above waited for the arena";
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->config.capacity_bytes, uint64_t{1} << 20);
  EXPECT_EQ((*store)->ListNamespaces().size(), 2u);
}

// A backend whose attention kernels take at most 2 query heads per call (as the CUDA backend's
// take at most 65535), and refuse more when called.
class TwoHeadsBackend final : public ForwardingBackend {
 public:
  absl::Status CheckAttentionShape(size_t num_seqs, size_t num_q_heads) const override {
    return num_q_heads > 2 ? absl::UnimplementedError("at most 2 query heads here")
                           : ForwardingBackend::CheckAttentionShape(num_seqs, num_q_heads);
  }
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override {
    if (absl::Status s = CheckAttentionShape(p.num_seqs, p.num_q_heads); !s.ok()) return s;
    return ForwardingBackend::PagedDecodeAttention(p, append);
  }
};

// An Attend of a shape the backend does not serve is refused before its new token takes a block
// (which, in a full pool, would evict a cached sequence).
TEST_F(StoreTest, AnAttendShapeTheBackendDoesNotServeTakesAndEvictsNothing) {
  backend_ = std::make_unique<TwoHeadsBackend>();
  MakeStore(4);
  const std::vector<int32_t> ids = TokenIds(8, 1), other = TokenIds(8, 100);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 40);
  ASSERT_TRUE(Put(ids, kv).ok());
  ASSERT_TRUE(Put(other, MakeSequenceKv(config_, 8, 41)).ok());  // the pool is full
  auto lease = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const std::vector<uint16_t> q = ToHalf(MakeNormal(4 * config_.head_dim, 42));
  KvStore::AttendItem item;
  item.lease_id = lease->lease_id;
  item.q = q.data();
  item.new_k = kv.k[0].data();
  item.new_v = kv.v[0].data();
  std::vector<float> out(4 * config_.head_dim);
  uint32_t ctx = 0;
  const absl::Status s = store_->Attend(0, 4, 0.f, {item}, {out.data(), nullptr, nullptr, &ctx});
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
  auto view = store_->DescribeLease(lease->lease_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->num_blocks, 2u);
  EXPECT_EQ(view->layer_tokens, (std::vector<uint32_t>{8, 8}));
  auto cached = store_->Match("main", other, absl::ZeroDuration());
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ(cached->cached_tokens, 8u);
  ASSERT_TRUE(store_->Release(cached->lease_id).ok());
  // Two heads are served (evicting the other sequence's last block for the new token).
  EXPECT_TRUE(store_->Attend(0, 2, 0.f, {item}, {out.data(), nullptr, nullptr, &ctx}).ok());
  EXPECT_EQ(ctx, 9u);
}

class StoreErrorsTest : public StoreTest {
 protected:
  void SetUp() override {
    MakeStore(8);
    ids_ = TokenIds(8, 1);
    kv_ = MakeSequenceKv(config_, 8, 30);
    ASSERT_TRUE(Put(ids_, kv_).ok());
    auto lease = store_->Match("main", ids_, absl::ZeroDuration());
    ASSERT_TRUE(lease.ok());
    lease_ = lease->lease_id;
    out_.resize(8 * PerToken());
    out_v_.resize(8 * PerToken());
  }

  // A decode step of 2 query heads over `lease` at `layer`, without a new token.
  absl::Status AttendOne(uint64_t lease, uint32_t layer) {
    const std::vector<uint16_t> q = ToHalf(MakeNormal(2 * config_.head_dim, 31));
    KvStore::AttendItem item;
    item.lease_id = lease;
    item.q = q.data();
    std::vector<float> out(2 * config_.head_dim);
    uint32_t ctx;
    return store_->Attend(layer, 2, 0.f, {item}, {out.data(), nullptr, nullptr, &ctx});
  }

  std::vector<int32_t> ids_;
  SequenceKv kv_;
  uint64_t lease_ = 0;
  std::vector<uint16_t> out_, out_v_;
};

TEST_F(StoreErrorsTest, UnknownNamespaceIsNotFound) {
  EXPECT_EQ(store_->BeginPut("other", ids_).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->Match("other", ids_, absl::ZeroDuration()).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(store_->GetNamespace("other").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(store_->GetNamespace("").ok());  // the default one
}

TEST_F(StoreErrorsTest, UnknownLeaseIsNotFound) {
  const uint64_t bad = lease_ + 1000;
  EXPECT_EQ(store_->ReadFp16(bad, 0, 0, 1, 0, 2, out_.data(), out_v_.data()).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(store_->Append(bad, 0, {}, 1, kv_.k[0].data(), kv_.v[0].data()).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(store_->Release(bad).code(), StatusCode::kNotFound);
  EXPECT_EQ(AttendOne(bad, 0).code(), StatusCode::kNotFound);
}

// Calls refused for bad input leave the expiry of the leases they name alone (bad input changes
// nothing); a call that passes its checks renews its lease. The fixture's lease lives 30 s.
TEST_F(StoreErrorsTest, RefusedCallsDoNotRenewTheirLeases) {
  std::vector<uint16_t> nan_k = kv_.k[0];
  nan_k[3] = 0x7e00;
  clock_.Advance(absl::Seconds(25));
  EXPECT_EQ(store_->ReadFp16(lease_, 2, 0, 1, 0, 2, out_.data(), out_v_.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Append(lease_, 0, {}, 1, nan_k.data(), kv_.v[0].data()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(AttendOne(lease_, 2).code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> sink_k(1 << 16), sink_v(1 << 16);  // the namespace keeps no sinks
  EXPECT_EQ(store_->ReadRawSinks(lease_, 0, 0, 2, sink_k.data(), sink_v.data()).code(),
            StatusCode::kFailedPrecondition);
  absl::StatusOr<uint8_t*> arena = backend_->AllocateArena(1 << 16);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(store_->ReadRawToArena(lease_, 0, 2, 0, 1, 0, 2, /*sinks=*/true, *arena).code(),
            StatusCode::kFailedPrecondition);
  backend_->FreeArena(*arena);
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(store_->DescribeLease(lease_).status().code(), StatusCode::kNotFound);

  auto renewed = store_->Match("main", ids_, absl::ZeroDuration());
  ASSERT_TRUE(renewed.ok());
  clock_.Advance(absl::Seconds(25));
  EXPECT_TRUE(store_->ReadFp16(renewed->lease_id, 0, 0, 1, 0, 2, out_.data(), out_v_.data()).ok());
  clock_.Advance(absl::Seconds(6));
  EXPECT_TRUE(store_->DescribeLease(renewed->lease_id).ok());
}

// A K or V value whose rotation could carry past fp16 (its page's zero would be infinite) is
// refused before anything is written, on Put and Append; values at the bound store and read back
// finite even when they all add up in one rotated value. SmallConfig rotates blocks of 16 channels:
// the bound is 65504 / 4 = 16376.
TEST_F(StoreErrorsTest, ValuesARotationWouldCarryPastFp16AreRefused) {
  const size_t pt = PerToken();
  SequenceKv kv = MakeSequenceKv(config_, 4, 40);
  kv.k[1][pt + 5] = FloatToHalf(-16384.0f);
  const uint64_t blocks_in_use = store_->Stats().namespaces[0].blocks_in_use;
  auto session = store_->BeginPut("main", TokenIds(4, 300));
  ASSERT_TRUE(session.ok());
  const absl::Status refused = (*session)->AddChunk(1, 0, 4, kv.k[1].data(), kv.v[1].data());
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.message()).find("over 16376 at element " + std::to_string(pt + 5)),
            std::string::npos)
      << refused;
  session->reset();
  EXPECT_EQ(
      store_->Append(lease_, 1, {}, 1, kv.k[1].data() + pt, kv.v[1].data() + pt).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Stats().namespaces[0].blocks_in_use, blocks_in_use);

  // Token 0, head 0 of every layer at the bound with the rotation's signs: rotated channel 0 of
  // each block is 4 x 16376 = 65504, fp16's largest.
  kv.k[1][pt + 5] = 0;
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const PageLayout l = LayerLayout(config_, layer);
    for (int c = 0; c < config_.head_dim; ++c) {
      kv.k[layer][c] = FloatToHalf(16376.0f * RotationSign(l.sign_seed, c));
    }
  }
  const std::vector<int32_t> ids = TokenIds(4, 300);
  const absl::StatusOr<KvStore::PutResult> stored = Put(ids, kv);
  ASSERT_TRUE(stored.ok()) << stored.status();
  auto match = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok());
  for (uint32_t layer = 0; layer < 2; ++layer) {
    std::vector<uint16_t> k(4 * pt), v(4 * pt);
    ASSERT_TRUE(store_->ReadFp16(match->lease_id, layer, 0, 1, 0, 2, k.data(), v.data()).ok());
    for (size_t i = 0; i < k.size(); ++i) {
      ASSERT_TRUE(std::isfinite(HalfToFloat(k[i]))) << "layer " << layer << " element " << i;
    }
    EXPECT_NEAR(HalfToFloat(k[0]), HalfToFloat(kv.k[layer][0]), 0.05 * 16376.0f);
  }
}

// A query value that its layer's rotation and sm_scale could carry past the CUDA kernels' fp16
// operands is refused on every backend: at sm_scale 1, SmallConfig's layers (rotation blocks of
// 16) take magnitudes up to 11344 (MaxQueryHalfBits).
TEST_F(StoreErrorsTest, QueriesScaledPastFp16AreRefused) {
  std::vector<uint16_t> q = ToHalf(MakeNormal(2 * config_.head_dim, 31));
  KvStore::AttendItem item;
  item.lease_id = lease_;
  item.q = q.data();
  std::vector<float> out(2 * config_.head_dim);
  uint32_t ctx;
  auto attend = [&](float sm_scale) {
    return store_->Attend(0, 2, sm_scale, {item}, {out.data(), nullptr, nullptr, &ctx});
  };
  q[7] = FloatToHalf(-11400.0f);
  const absl::Status refused = attend(1.0f);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.message()).find("over 11344 at element 7"), std::string::npos)
      << refused;
  EXPECT_TRUE(attend(0.0f).ok());  // 1 / sqrt(32): the bound is past 65504
  q[7] = FloatToHalf(11000.0f);
  EXPECT_TRUE(attend(1.0f).ok());
}

TEST_F(StoreErrorsTest, LayerOutOfRangeIsInvalid) {
  auto session = store_->BeginPut("main", TokenIds(4, 77));
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->AddChunk(2, 0, 4, kv_.k[0].data(), kv_.v[0].data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->ReadFp16(lease_, 2, 0, 1, 0, 2, out_.data(), out_v_.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Append(lease_, 5, {}, 1, kv_.k[0].data(), kv_.v[0].data()).status().code(),
            StatusCode::kInvalidArgument);
  auto view = store_->DescribeLease(lease_);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->layer_tokens, (std::vector<uint32_t>{8, 8}));
}

TEST_F(StoreErrorsTest, HeadOrBlockRangeOutOfRangeIsInvalid) {
  std::vector<uint8_t> raw_k(1 << 16), raw_v(1 << 16);
  EXPECT_EQ(store_->ReadRaw(lease_, 0, 0, 1, 1, 3, raw_k.data(), raw_v.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->ReadRaw(lease_, 0, 0, 1, 1, 1, raw_k.data(), raw_v.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->ReadFp16(lease_, 0, 1, 2, 0, 2, out_.data(), out_v_.data()).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(StoreErrorsTest, TokenCountMismatchIsInvalid) {
  EXPECT_EQ(store_->Append(lease_, 0, {1, 2}, 3, kv_.k[0].data(), kv_.v[0].data()).status().code(),
            StatusCode::kInvalidArgument);
  auto session = store_->BeginPut("main", TokenIds(4, 77));
  ASSERT_TRUE(session.ok());
  // Chunk tokens beyond the sequence.
  EXPECT_EQ((*session)->AddChunk(0, 2, 4, kv_.k[0].data(), kv_.v[0].data()).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(StoreErrorsTest, EmptyPayloadIsInvalid) {
  EXPECT_EQ(store_->BeginPut("main", {}).status().code(), StatusCode::kInvalidArgument);
  auto session = store_->BeginPut("main", TokenIds(4, 77));
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->AddChunk(0, 0, 0, kv_.k[0].data(), kv_.v[0].data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*session)->AddChunk(0, 0, 4, nullptr, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Append(lease_, 0, {}, 0, kv_.k[0].data(), kv_.v[0].data()).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<float> out(2 * config_.head_dim);
  uint32_t ctx;
  EXPECT_EQ(store_->Attend(0, 2, 0.f, {}, {out.data(), nullptr, nullptr, &ctx}).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(StoreErrorsTest, BadAttendItemAppendsNothing) {
  const std::vector<uint16_t> q = ToHalf(MakeNormal(2 * config_.head_dim, 32));
  std::vector<uint16_t> bad_k(kv_.k[0].begin(), kv_.k[0].begin() + PerToken());
  bad_k[3] = 0x7C00;  // +Inf
  KvStore::AttendItem items[2];
  items[0].lease_id = lease_;
  items[0].q = q.data();
  items[0].new_k = kv_.k[0].data();
  items[0].new_v = kv_.v[0].data();
  items[1].lease_id = lease_;
  items[1].q = q.data();
  items[1].new_k = bad_k.data();
  items[1].new_v = kv_.v[0].data();
  std::vector<float> out(2 * 2 * config_.head_dim);
  uint32_t ctx[2];
  EXPECT_EQ(store_->Attend(0, 2, 0.f, items, {out.data(), nullptr, nullptr, ctx}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Attend(0, 3, 0.f, {items[0]}, {out.data(), nullptr, nullptr, ctx}).code(),
            StatusCode::kInvalidArgument);  // 3 q heads over 2 KV heads
  items[1].new_k = kv_.k[0].data();
  items[1].new_token_id = -7;  // -1 means unknown; other negative ids are not ids
  EXPECT_EQ(store_->Attend(0, 2, 0.f, items, {out.data(), nullptr, nullptr, ctx}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Append(lease_, 0, {-7}, 1, kv_.k[0].data(), kv_.v[0].data()).status().code(),
            StatusCode::kInvalidArgument);
  auto view = store_->DescribeLease(lease_);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->layer_tokens, (std::vector<uint32_t>{8, 8}));
  EXPECT_EQ(view->num_blocks, 2u);
}

// A batch naming leases of two namespaces is refused, with the other lease's item named, and
// appends nothing. The refusal comes before any item's q or new K/V is read, since they would be
// read at the first item's namespace's sizes: past item 1's arrays here, which only a sanitizer
// build would report.
TEST(StoreAttendBatch, ItemsOfAnotherNamespaceAreRefusedBeforeTheirInputsAreRead) {
  const std::unique_ptr<ComputeBackend> backend = NewCpuBackend();
  NamespaceConfig wide = SmallConfig("wide"), narrow = SmallConfig("narrow");
  narrow.head_dim = 16;
  wide.capacity_bytes = ArenaBytes(wide, 8);
  narrow.capacity_bytes = ArenaBytes(narrow, 8);
  auto store = StoreOver(backend.get(), wide.capacity_bytes + narrow.capacity_bytes);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->CreateNamespace(wide).ok());
  ASSERT_TRUE((*store)->CreateNamespace(narrow).ok());
  uint64_t leases[2];
  for (int i = 0; i < 2; ++i) {
    const NamespaceConfig& c = i == 0 ? wide : narrow;
    ASSERT_TRUE(
        PutIntoStore(**store, c.name, TokenIds(8, 1 + i), MakeSequenceKv(c, 8, 5 + i)).ok());
    auto m = (*store)->Match(c.name, TokenIds(8, 1 + i), absl::ZeroDuration());
    ASSERT_TRUE(m.ok()) << m.status();
    leases[i] = m->lease_id;
  }
  // Item 1's arrays are its own namespace's size, half of what item 0's namespace would read.
  const std::vector<uint16_t> q0 = ToHalf(MakeNormal(2 * wide.head_dim, 7));
  const std::vector<uint16_t> kv0 = ToHalf(MakeNormal(2 * wide.head_dim, 8));
  const std::vector<uint16_t> q1 = ToHalf(MakeNormal(2 * narrow.head_dim, 9));
  const std::vector<uint16_t> kv1 = ToHalf(MakeNormal(2 * narrow.head_dim, 10));
  std::vector<KvStore::AttendItem> items(2);
  items[0] = {leases[0], q0.data(), kv0.data(), kv0.data(), -1};
  items[1] = {leases[1], q1.data(), kv1.data(), kv1.data(), -1};
  std::vector<float> out(2 * 2 * wide.head_dim);
  uint32_t context[2];
  const absl::Status s =
      (*store)->Attend(0, 2, 0.f, items, {out.data(), nullptr, nullptr, context});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("item 1"), std::string::npos) << s;
  for (uint64_t lease : leases) {
    EXPECT_EQ((*store)->DescribeLease(lease)->layer_tokens, (std::vector<uint32_t>{8, 8}));
  }
}

TEST_F(StoreErrorsTest, InvalidNamespaceConfigIsRejected) {
  NamespaceConfig c = SmallConfig("bad name!");
  EXPECT_EQ(store_->CreateNamespace(c).status().code(), StatusCode::kInvalidArgument);
  c = SmallConfig("ok");
  c.layer_dtypes.pop_back();
  EXPECT_EQ(store_->CreateNamespace(c).status().code(), StatusCode::kInvalidArgument);
  c = SmallConfig("ok");
  c.group_size = 12;  // does not divide head_dim
  EXPECT_EQ(store_->CreateNamespace(c).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->CreateNamespace(SmallConfig("main")).status().code(),
            StatusCode::kAlreadyExists);
  // The first namespace took the whole pool.
  EXPECT_EQ(store_->CreateNamespace(SmallConfig("ok")).status().code(),
            StatusCode::kResourceExhausted);
}

// A capacity_bytes too small for one block is INVALID_ARGUMENT (a retry cannot succeed), however
// much of the pool is unreserved.
TEST(StoreNamespaces, CapacityHoldingNoBlockIsInvalidArgument) {
  ForwardingBackend backend;
  auto store = StoreOver(&backend, 1 << 20);
  ASSERT_TRUE(store.ok()) << store.status();
  NamespaceConfig c = SmallConfig("tiny");
  c.capacity_bytes = BytesPerBlock(c) - 1;
  const absl::Status s = (*store)->CreateNamespace(c).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE((*store)->ListNamespaces().empty());
  c.capacity_bytes = BytesPerBlock(c);
  EXPECT_TRUE((*store)->CreateNamespace(c).ok());
}

}  // namespace
}  // namespace kvpool::testing
