// Every class of bad input gets its documented status code and changes nothing in the pool.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {
namespace {

// A Match of all of `s` in "small".
v1::MatchResponse MatchSmall(v1::KvPool::Stub* stub, const Sequence& s) {
  grpc::ClientContext ctx;
  v1::MatchRequest req;
  req.set_namespace_("small");
  for (int32_t t : s.tokens) req.add_token_ids(t);
  v1::MatchResponse r;
  EXPECT_TRUE(stub->Match(&ctx, req, &r).ok());
  return r;
}

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

  uint64_t Match(const Sequence& s) { return MatchSmall(stub(), s).lease_id(); }

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

TEST(BadInputLimits, MessageOverLimitIsResourceExhausted) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  auto t = TestServer::Start({c}, [](ServerOptions* o) { o->max_message_bytes = 16 << 10; });
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence s = MakeSequence(c, 64, 1, 8);
  v1::PutResponse r;
  // 64 tokens x 128 values x 2 bytes x (K and V) = 32 KiB in one message.
  EXPECT_EQ(PutSequence(t->stub.get(), "small", s, pt, 64, &r).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(PutSequence(t->stub.get(), "small", s, pt, 16, &r).ok());
}

TEST(BadInputLimits, PutStreamOverLimitIsResourceExhaustedAndStoresNothing) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  auto t =
      TestServer::Start({c}, [](ServerOptions* o) { o->service.max_put_stream_bytes = 100 << 10; });
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  // 2 layers x 256 tokens x 128 values x 2 bytes x 2 = 256 KiB in 8 KiB chunks.
  const Sequence s = MakeSequence(c, 256, 1, 9);
  v1::PutResponse r;
  const grpc::Status st = PutSequence(t->stub.get(), "small", s, pt, 16, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(FindNamespace(GetStats(t->stub.get()), "small")->tokens_stored(), 0u);
}

// A Put whose new blocks need more fp16 K/V than --max_put_stream_bytes lets its stream carry is
// refused at its header, before it evicts anything for them: the cached sequence stays.
TEST(BadInputLimits, PutThatCannotFitItsStreamLimitEvictsNothing) {
  NamespaceConfig c = SmallNamespace("small", 0);
  c.capacity_bytes = 8 * BytesPerBlock(c);
  auto t =
      TestServer::Start({c}, [](ServerOptions* o) { o->service.max_put_stream_bytes = 100 << 10; });
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence cached = MakeSequence(c, 64, 1, 1);  // 64 KiB of K/V: fits
  v1::PutResponse r;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", cached, pt, 16, &r).ok());
  const Sequence big = MakeSequence(c, 128, 5000, 2);  // 128 KiB: needs the whole pool
  const grpc::Status st = PutSequence(t->stub.get(), "small", big, pt, 16, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("--max_put_stream_bytes"), std::string::npos)
      << st.error_message();
  const v1::NamespaceStats* ns = FindNamespace(GetStats(t->stub.get()), "small");
  EXPECT_EQ(ns->evictions(), 0u);
  EXPECT_EQ(ns->tokens_stored(), 64u);
}

// A batch over --max_attend_batch is refused before anything is sized by its item count (the
// unary runner of each Attend thread is kept for the server's life, and so is what it sizes).
TEST(BadInputLimits, AttendBatchOverLimitIsResourceExhausted) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  auto t = TestServer::Start({c}, [](ServerOptions* o) { o->store.max_attend_batch = 2; });
  ASSERT_NE(t, nullptr);
  const Sequence s = MakeSequence(c, 32, 1, 12);
  v1::PutResponse r;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", s, c.num_kv_heads * c.head_dim, 16, &r).ok());
  const v1::MatchResponse mr = MatchSmall(t->stub.get(), s);
  const std::vector<uint16_t> q(4 * c.head_dim, 0x3c00);  // 1.0
  v1::AttendRequest req;
  req.set_num_q_heads(4);
  for (int i = 0; i < 3; ++i) {
    v1::AttendItem* item = req.add_items();
    item->set_lease_id(mr.lease_id());
    item->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
    item->set_new_token_id(-1);
  }
  for (int items : {3, 100000}) {  // past 3, items without q: the count alone is refused
    while (req.items_size() < items) req.add_items()->set_lease_id(mr.lease_id());
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = t->stub->Attend(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << items << " items";
    EXPECT_NE(st.error_message().find("over the limit of 2 (--max_attend_batch)"),
              std::string::npos)
        << st.error_message();
  }
  req.mutable_items()->DeleteSubrange(2, req.items_size() - 2);
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  EXPECT_TRUE(t->stub->Attend(&ctx, req, &resp).ok());
}

// Put streams beyond max_put_streams get RESOURCE_EXHAUSTED at their header, without touching the
// pool; once the open one ends, a new Put goes through.
TEST(BadInputLimits, PutStreamsPastTheLimitAreRefused) {
  const NamespaceConfig c = SmallNamespace("small", 0);
  auto t = TestServer::Start({c}, [](ServerOptions* o) { o->service.max_put_streams = 1; });
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence open = MakeSequence(c, 32, 1, 14);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer = t->stub->Put(&ctx, &resp);
  v1::PutRequest header;
  header.mutable_header()->set_namespace_("small");
  for (int32_t id : open.tokens) header.mutable_header()->add_token_ids(id);
  ASSERT_TRUE(writer->Write(header));
  for (int i = 0; i < 500 && FindNamespace(GetStats(t->stub.get()), "small")->blocks_in_use() == 0;
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));  // the open stream's header has arrived
  }
  const Sequence second = MakeSequence(c, 32, 1000, 15);
  v1::PutResponse put;
  EXPECT_EQ(PutSequence(t->stub.get(), "small", second, pt, 16, &put).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(FindNamespace(GetStats(t->stub.get()), "small")->blocks_in_use(), 2u);
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);  // no chunks
  bool stored = false;
  for (int i = 0; i < 500 && !stored; ++i) {  // the first stream's end reaches the server
    stored = PutSequence(t->stub.get(), "small", second, pt, 16, &put).ok();
    if (!stored) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(stored);
  EXPECT_EQ(put.tokens_stored(), 32u);
}

// Get streams beyond max_get_streams get RESOURCE_EXHAUSTED; once the open one ends, a Get goes
// through.
TEST(BadInputLimits, GetStreamsPastTheLimitAreRefused) {
  const NamespaceConfig c = SmallNamespace("small", 0);
  auto t = TestServer::Start({c}, [](ServerOptions* o) { o->service.max_get_streams = 1; });
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence s = MakeSequence(c, 32, 1, 16);
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", s, pt, 16, &put).ok());
  v1::GetRequest get;
  get.set_lease_id(MatchOk(t->stub.get(), "small", s).lease_id());
  grpc::ClientContext open_ctx;  // a Get whose client reads one message, then waits
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> open = t->stub->Get(&open_ctx, get);
  v1::GetResponse first;
  ASSERT_TRUE(open->Read(&first));
  std::vector<v1::GetResponse> got;
  EXPECT_EQ(ReadAll(t->stub.get(), get, &got).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  while (open->Read(&first)) {
  }
  ASSERT_TRUE(open->Finish().ok());
  bool served = false;
  for (int i = 0; i < 500 && !served; ++i) {  // the first stream's end reaches the server
    got.clear();
    served = ReadAll(t->stub.get(), get, &got).ok();
    if (!served) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(served);
}

// A Get whose client stops reading holds its slot among max_get_streams only until the sweep finds
// it without a message taken for longer than get_stall_timeout: then it is cancelled (counted
// DEADLINE_EXCEEDED) and a new Get goes through.
TEST(BadInputLimits, StalledGetIsCancelledAndFreesItsSlot) {
  const NamespaceConfig c = SmallNamespace("small", 0);
  auto t = TestServer::Start({c}, [](ServerOptions* o) {
    o->service.max_get_streams = 1;
    o->service.get_stall_timeout = absl::Minutes(1);
    o->service.get_chunk_bytes = 1;  // one block a message: 8 messages, more than any buffer
  });
  ASSERT_NE(t, nullptr);
  const Sequence s = MakeSequence(c, 64, 1, 16);
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", s, c.num_kv_heads * c.head_dim, 16, &put).ok());
  v1::GetRequest get;  // of a lease that outlives the test's 61 s
  get.set_lease_id(MatchOk(t->stub.get(), "small", s, 600000).lease_id());
  grpc::ClientContext stalled_ctx;  // reads one message, then nothing
  stalled_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> stalled = t->stub->Get(&stalled_ctx, get);
  v1::GetResponse first;
  ASSERT_TRUE(stalled->Read(&first));
  // The transport may still take a message or two of the stream's (each one progress, timed on
  // the server's clock when taken) before the writes stall.
  absl::SleepFor(absl::Milliseconds(100));
  std::vector<v1::GetResponse> got;
  t->clock.Advance(absl::Seconds(59));
  t->server->Sweep();
  EXPECT_EQ(ReadAll(t->stub.get(), get, &got).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "cancelled before get_stall_timeout";
  bool served = false;
  for (int i = 0; i < 500 && !served; ++i) {  // the stalled stream's end reaches the server
    if (i % 100 == 0) {  // past the timeout since any progress, however late it was taken
      t->clock.Advance(absl::Seconds(61));
      t->server->Sweep();
    }
    got.clear();
    served = ReadAll(t->stub.get(), get, &got).ok();
    if (!served) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(served);
  EXPECT_EQ(got.size(), 8u);
  // Sent bytes count the messages written: those the stalled client took and the served Get's,
  // not the write the cancel ended.
  size_t sent = first.ByteSizeLong();
  for (const v1::GetResponse& r : got) sent += r.ByteSizeLong();
  while (stalled->Read(&first)) sent += first.ByteSizeLong();
  EXPECT_EQ(stalled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  const std::string metrics = t->server->registry()->Serialize();
  EXPECT_NE(metrics.find(
                "kvpool_rpc_duration_seconds_count{method=\"Get\",code=\"DEADLINE_EXCEEDED\"} 1\n"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find(absl::StrCat("kvpool_rpc_sent_bytes_total{method=\"Get\"} ", sent, "\n")),
            std::string::npos)
      << metrics;
}

// A Get whose one block (K and V) would not fit a message is refused before anything is read,
// with a message that names the limit; the same Get of fewer heads goes through.
TEST(BadInputLimits, GetOfBlocksLargerThanAMessageIsRefusedUpFront) {
  const NamespaceConfig c = SmallNamespace("small", 0);  // fp16 block: 2 heads, 4 KiB for K
  auto t = TestServer::Start({c}, [](ServerOptions* o) { o->max_message_bytes = 6000; });
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence s = MakeSequence(c, 1, 1, 18);
  v1::GetRequest get;  // of a lease of one token: its appends are small messages
  get.set_lease_id(LeaseWithAppends(t->stub.get(), "small", s, pt, 1));
  std::vector<v1::GetResponse> got;
  grpc::ClientContext gctx;
  std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader = t->stub->Get(&gctx, get);
  v1::GetResponse r;
  EXPECT_FALSE(reader->Read(&r));
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("--max_message_bytes"), std::string::npos)
      << st.error_message();
  get.set_head_end(1);  // one head: 2 KiB of K and of V per block
  ASSERT_TRUE(ReadAll(t->stub.get(), get, &got).ok());
  EXPECT_EQ(got.size(), static_cast<size_t>(c.num_layers));
}

// FP16 rows past a lease's tokens in its last block are zeros, not what the block held for its
// earlier owner (here a released lease's tail, in a namespace of one block).
TEST(BadInputLimits, Fp16GetPadsAPartialBlockWithZeros) {
  NamespaceConfig c = SmallNamespace("small", 0);
  c.capacity_bytes = BytesPerBlock(c);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence s = MakeSequence(c, c.block_tokens, 1, 17);
  // The namespace's only block, filled by a lease that is then released.
  ReleaseOk(t->stub.get(), LeaseWithAppends(t->stub.get(), "small", s, pt, c.block_tokens));
  v1::GetRequest get;  // the same block, one token written
  get.set_lease_id(LeaseWithAppends(t->stub.get(), "small", s, pt, 1));
  std::vector<v1::GetResponse> got;
  ASSERT_TRUE(ReadAll(t->stub.get(), get, &got).ok());
  ASSERT_EQ(got.size(), static_cast<size_t>(c.num_layers));
  for (const v1::GetResponse& r : got) {
    EXPECT_EQ(r.valid_tokens(), 1u);
    ASSERT_EQ(r.k().size(), static_cast<size_t>(c.block_tokens) * pt * 2);
    const std::string tail_k = r.k().substr(pt * 2), tail_v = r.v().substr(pt * 2);
    EXPECT_EQ(tail_k, std::string(tail_k.size(), '\0')) << "layer " << r.layer();
    EXPECT_EQ(tail_v, std::string(tail_v.size(), '\0')) << "layer " << r.layer();
  }
}

// A Put that stalls after its header pins its blocks only until the sweep finds it idle for longer
// than put_idle_timeout: then it is cancelled, stores nothing, and its blocks are free again. A
// stream that never sent its header is swept alike; both count as DEADLINE_EXCEEDED.
TEST(BadInputLimits, StalledPutIsCancelledAndItsBlocksFreed) {
  NamespaceConfig c = SmallNamespace("small", 0);
  c.capacity_bytes = 4 * BytesPerBlock(c);
  auto t = TestServer::Start(
      {c}, [](ServerOptions* o) { o->service.put_idle_timeout = absl::Minutes(1); });
  ASSERT_NE(t, nullptr);
  auto blocks_in_use = [&] {
    return FindNamespace(GetStats(t->stub.get()), "small")->blocks_in_use();
  };
  auto wait_for_blocks_in_use = [&](uint64_t n) {
    for (int i = 0; i < 500 && blocks_in_use() != n; ++i) absl::SleepFor(absl::Milliseconds(10));
    return blocks_in_use();
  };
  const Sequence stalled = MakeSequence(c, 64, 1, 13);  // 4 blocks: the whole namespace
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));  // not hang
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer = t->stub->Put(&ctx, &resp);
  v1::PutRequest header;
  header.mutable_header()->set_namespace_("small");
  for (int32_t id : stalled.tokens) header.mutable_header()->add_token_ids(id);
  // Opened first, so that the server has registered it by the time the header's blocks are in
  // use (the clock it was registered at must be the one the sweeps count from).
  grpc::ClientContext silent_ctx;
  silent_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::PutResponse silent_resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> silent =
      t->stub->Put(&silent_ctx, &silent_resp);
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(writer->Write(header));
  ASSERT_EQ(wait_for_blocks_in_use(4), 4u);

  t->clock.Advance(absl::Seconds(59));
  t->server->Sweep();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(blocks_in_use(), 4u) << "cancelled before put_idle_timeout";
  t->clock.Advance(absl::Seconds(2));
  t->server->Sweep();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(silent->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Counted when the server's reactions end, which may come after the client saw the cancel.
  const std::string swept =
      "kvpool_rpc_duration_seconds_count{method=\"Put\",code=\"DEADLINE_EXCEEDED\"} 2\n";
  bool counted = false;
  for (int i = 0; i < 500 && !counted; ++i) {
    counted = t->server->registry()->Serialize().find(swept) != std::string::npos;
    if (!counted) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(counted) << t->server->registry()->Serialize();
  EXPECT_EQ(wait_for_blocks_in_use(0), 0u);
  EXPECT_EQ(FindNamespace(GetStats(t->stub.get()), "small")->tokens_stored(), 0u);

  const Sequence next = MakeSequence(c, 64, 5000, 14);
  v1::PutResponse r;
  EXPECT_TRUE(PutSequence(t->stub.get(), "small", next, c.num_kv_heads * c.head_dim, 16, &r).ok());
}

TEST(BadInputLimits, PoolFullOfPinnedBlocksIsResourceExhaustedAndSaysSo) {
  NamespaceConfig c = SmallNamespace("small", 0);
  c.capacity_bytes = 4 * BytesPerBlock(c);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence held = MakeSequence(c, 64, 1, 10);
  v1::PutResponse r;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", held, pt, 16, &r).ok());
  ASSERT_EQ(MatchSmall(t->stub.get(), held).cached_tokens(), 64u);

  const Sequence other = MakeSequence(c, 32, 5000, 11);
  const grpc::Status st = PutSequence(t->stub.get(), "small", other, pt, 16, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("pinned"), std::string::npos) << st.error_message();
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
