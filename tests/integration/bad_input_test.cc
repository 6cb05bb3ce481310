// Every class of bad input gets its documented status code and changes nothing in the pool (the
// limits on requests: bad_input_limits_test.cc).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {
namespace {

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = SmallNamespace("small", 1 << 20);
    t_ = TestServer::Start({c_});
    ASSERT_NE(t_, nullptr);
    pt_ = c_.num_kv_heads * c_.head_dim;
  }

  v1::KvPool::Stub* stub() { return t_->stub.get(); }

  // Streams `reqs` as one Put and returns the status.
  grpc::Status PutRaw(const std::vector<v1::PutRequest>& reqs) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto w = stub()->Put(&ctx, &resp);
    for (const auto& r : reqs) {
      if (!w->Write(r)) break;
    }
    w->WritesDone();
    return w->Finish();
  }

  v1::PutRequest Header(const Sequence& s, const std::string& ns = "small") {
    v1::PutRequest r;
    r.mutable_header()->set_namespace_(ns);
    for (int32_t t : s.tokens) r.mutable_header()->add_token_ids(t);
    return r;
  }

  v1::PutRequest Chunk(const Sequence& s, int layer, int begin, int n) {
    v1::PutRequest r;
    v1::PutChunk* c = r.mutable_chunk();
    c->set_layer(layer);
    c->set_token_begin(begin);
    c->set_num_tokens(n);
    c->set_k(reinterpret_cast<const char*>(s.k[layer].data() + begin * pt_), n * pt_ * 2);
    c->set_v(reinterpret_cast<const char*>(s.v[layer].data() + begin * pt_), n * pt_ * 2);
    return r;
  }

  uint64_t Match(const Sequence& s) { return MatchOk(stub(), "small", s).lease_id(); }

  // Nothing stored and nothing pinned in "small".
  void ExpectPoolUntouched() {
    const v1::StatsResponse s = GetStats(stub());
    const v1::NamespaceStats* ns = FindNamespace(s, "small");
    ASSERT_NE(ns, nullptr);
    EXPECT_EQ(ns->tokens_stored(), 0u);
    EXPECT_EQ(ns->blocks_in_use(), 0u);
    EXPECT_EQ(ns->blocks_free(), ns->blocks_total());
  }

  grpc::Status Attend(const v1::AttendRequest& req) {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    return stub()->Attend(&ctx, req, &resp);
  }

  v1::AttendRequest AttendFor(uint64_t lease, int layer, int q_heads) {
    v1::AttendRequest req;
    req.set_layer(layer);
    req.set_num_q_heads(q_heads);
    const std::vector<uint16_t> q = ToHalf(MakeNormal(q_heads * c_.head_dim, 77));
    v1::AttendItem* item = req.add_items();
    item->set_lease_id(lease);
    item->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
    return req;
  }

  // A complete 2-block sequence stored in the pool, and a lease on it.
  uint64_t StoreAndMatch(const Sequence& s) {
    v1::PutResponse r;
    EXPECT_TRUE(PutSequence(stub(), "small", s, pt_, 32, &r).ok());
    return Match(s);
  }

  NamespaceConfig c_;
  std::unique_ptr<TestServer> t_;
  int pt_ = 0;
};

TEST_F(BadInput, UnknownNamespaceOrLeaseIsNotFound) {
  const Sequence s = MakeSequence(c_, 32, 1, 1);
  EXPECT_EQ(PutRaw({Header(s, "nope"), Chunk(s, 0, 0, 32)}).error_code(),
            grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx;
  v1::MatchRequest m;
  m.set_namespace_("nope");
  m.add_token_ids(1);
  v1::MatchResponse mr;
  EXPECT_EQ(stub()->Match(&ctx, m, &mr).error_code(), grpc::StatusCode::NOT_FOUND);

  constexpr uint64_t kNoLease = 0xdead;
  v1::GetRequest get;
  get.set_lease_id(kNoLease);
  std::vector<v1::GetResponse> msgs;
  EXPECT_EQ(ReadAll(stub(), get, &msgs).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Attend(AttendFor(kNoLease, 0, 4)).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx2;
  v1::ReleaseRequest rel;
  rel.set_lease_id(kNoLease);
  v1::ReleaseResponse rr;
  EXPECT_EQ(stub()->Release(&ctx2, rel, &rr).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx3;
  v1::AppendRequest app;
  app.set_lease_id(kNoLease);
  app.set_num_tokens(1);
  app.set_k(std::string(pt_ * 2, '\x3c'));
  app.set_v(std::string(pt_ * 2, '\x3c'));
  v1::AppendResponse ar;
  EXPECT_EQ(stub()->Append(&ctx3, app, &ar).error_code(), grpc::StatusCode::NOT_FOUND);
  ExpectPoolUntouched();
}

TEST_F(BadInput, ByteLengthThatDisagreesWithShapeIsInvalid) {
  const Sequence s = MakeSequence(c_, 32, 1, 2);
  v1::PutRequest short_k = Chunk(s, 0, 0, 32);
  short_k.mutable_chunk()->mutable_k()->resize(32 * pt_ * 2 - 2);
  EXPECT_EQ(PutRaw({Header(s), short_k}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::PutRequest long_v = Chunk(s, 0, 0, 16);
  long_v.mutable_chunk()->set_num_tokens(15);
  EXPECT_EQ(PutRaw({Header(s), long_v}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectPoolUntouched();

  const uint64_t lease = StoreAndMatch(s);
  v1::AttendRequest bad_q = AttendFor(lease, 0, 4);
  bad_q.mutable_items(0)->mutable_q()->resize(3 * c_.head_dim * 2);
  EXPECT_EQ(Attend(bad_q).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::AttendRequest bad_k = AttendFor(lease, 0, 4);
  bad_k.mutable_items(0)->set_new_k(std::string(pt_ * 2 + 2, '\x3c'));
  bad_k.mutable_items(0)->set_new_v(std::string(pt_ * 2, '\x3c'));
  EXPECT_EQ(Attend(bad_k).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(BadInput, LayerOrHeadOutOfRangeIsInvalid) {
  const Sequence s = MakeSequence(c_, 32, 1, 3);
  v1::PutRequest layer2 = Chunk(s, 0, 0, 32);
  layer2.mutable_chunk()->set_layer(2);
  EXPECT_EQ(PutRaw({Header(s), layer2}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectPoolUntouched();

  const uint64_t lease = StoreAndMatch(s);
  std::vector<v1::GetResponse> msgs;
  v1::GetRequest get;
  get.set_lease_id(lease);
  get.set_layer_end(3);
  EXPECT_EQ(ReadAll(stub(), get, &msgs).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  get.set_layer_end(0);
  get.set_head_begin(1);
  get.set_head_end(3);
  EXPECT_EQ(ReadAll(stub(), get, &msgs).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(msgs.empty());
  EXPECT_EQ(Attend(AttendFor(lease, 2, 4)).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Attend(AttendFor(lease, 0, 3)).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << "num_q_heads must be a multiple of the KV heads";
}

TEST_F(BadInput, TokenCountMismatchIsInvalidAndMissingChunksFailPrecondition) {
  const Sequence s = MakeSequence(c_, 32, 1, 4);
  v1::PutRequest past_end = Chunk(s, 0, 16, 16);
  past_end.mutable_chunk()->set_token_begin(24);
  EXPECT_EQ(PutRaw({Header(s), past_end}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Layer 1 never arrives: the stream ends incomplete.
  EXPECT_EQ(PutRaw({Header(s), Chunk(s, 0, 0, 32)}).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  ExpectPoolUntouched();

  const uint64_t lease = StoreAndMatch(s);
  grpc::ClientContext ctx;
  v1::AppendRequest app;
  app.set_lease_id(lease);
  app.set_num_tokens(1);
  app.add_token_ids(5);
  app.add_token_ids(6);
  app.set_k(reinterpret_cast<const char*>(s.k[0].data()), pt_ * 2);
  app.set_v(reinterpret_cast<const char*>(s.v[0].data()), pt_ * 2);
  v1::AppendResponse ar;
  EXPECT_EQ(stub()->Append(&ctx, app, &ar).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(BadInput, EmptyPayloadOrMissingHeaderIsInvalid) {
  const Sequence s = MakeSequence(c_, 32, 1, 5);
  v1::PutRequest empty_k = Chunk(s, 0, 0, 32);
  empty_k.mutable_chunk()->clear_k();
  EXPECT_EQ(PutRaw({Header(s), empty_k}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(PutRaw({Chunk(s, 0, 0, 32), Header(s)}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(PutRaw({}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(PutRaw({Header(s), v1::PutRequest()}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::AttendRequest no_items;
  no_items.set_num_q_heads(4);
  EXPECT_EQ(Attend(no_items).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectPoolUntouched();
}

TEST_F(BadInput, NanOrInfInKvIsInvalidAndStoresNothing) {
  Sequence s = MakeSequence(c_, 32, 1, 6);
  s.k[1][17 * pt_ + 5] = 0x7E00;  // NaN
  v1::PutResponse r;
  EXPECT_EQ(PutSequence(stub(), "small", s, pt_, 16, &r).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ExpectPoolUntouched();
  Sequence inf = MakeSequence(c_, 32, 1, 7);
  inf.v[0][3] = 0xFC00;  // -Inf
  EXPECT_EQ(PutSequence(stub(), "small", inf, pt_, 32, &r).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ExpectPoolUntouched();
}

TEST_F(BadInput, NamespaceLayerCountOutOfRangeIsInvalidWithoutAllocating) {
  // 0xFFFFFFFF does not fit an int; 2e9 would size a multi-GiB per-layer table if unchecked.
  for (const uint32_t layers : {0u, 4097u, 2000000000u, 0xFFFFFFFFu}) {
    grpc::ClientContext ctx;
    v1::CreateNamespaceRequest req;
    v1::NamespaceSpec* spec = req.mutable_spec();
    spec->set_name("huge");
    spec->set_num_layers(layers);
    spec->set_num_kv_heads(1);
    spec->set_head_dim(32);
    spec->set_capacity_bytes(1 << 16);
    v1::CreateNamespaceResponse resp;
    EXPECT_EQ(stub()->CreateNamespace(&ctx, req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << layers << " layers";
  }
  grpc::ClientContext ctx;
  v1::ListNamespacesResponse list;
  ASSERT_TRUE(stub()->ListNamespaces(&ctx, v1::ListNamespacesRequest(), &list).ok());
  EXPECT_EQ(list.namespaces_size(), 1);
}

// NCCL transport limits are checked on every backend: a bad flag fails the start, not the first
// transfer on a GPU machine.
TEST(BadServerOptions, NonPositiveTransportLimitsAreRefused) {
  for (int which = 0; which < 3; ++which) {
    ServerOptions o;
    o.grpc_address = "";
    o.metrics_address = "";
    o.store.pool_bytes = 8 << 20;
    o.lease_sweep_interval = absl::ZeroDuration();
    if (which == 0) o.transport.staging_bytes = 0;
    if (which == 1) o.transport.channels.idle_timeout = absl::ZeroDuration();
    if (which == 2) o.transport.max_transfer_timeout = -absl::Seconds(1);
    EXPECT_EQ(Server::Start(std::move(o), NewCpuBackend()).status().code(),
              absl::StatusCode::kInvalidArgument)
        << which;
  }
}

}  // namespace
}  // namespace kvpool::testing
