// Every limit on requests (message and stream sizes, batch, open streams, stalled streams, a pool
// full of pinned blocks) gets RESOURCE_EXHAUSTED or its documented status, changes nothing in the
// pool, and frees its slot when the offending call ends.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

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
  const v1::MatchResponse mr = MatchOk(t->stub.get(), "small", s);
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

// The CPU backend, whose Synchronize (a Put's commit calls it just before publishing) runs `hook`
// once when armed.
class HookedSynchronize final : public ForwardingBackend {
 public:
  std::function<void()> hook;
  std::atomic<bool> armed{false};

  absl::Status Synchronize() override {
    if (armed.exchange(false)) hook();
    return ForwardingBackend::Synchronize();
  }
};

// A sweep that runs while a Put commits (its last chunk came just under put_idle_timeout before
// its half-close) must not cancel it: the Put has published by the time the cancel would reach
// the client, which would see a failed Put that stored its blocks.
TEST(BadInputLimits, SweepDuringAPutsCommitLeavesItOk) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  auto backend = std::make_unique<HookedSynchronize>();
  HookedSynchronize* hooked = backend.get();
  auto t = TestServer::Start(
      {c},
      [](ServerOptions* o) {
        o->service.put_idle_timeout = absl::Minutes(1);
        o->store.quality_sample_every = 0;  // no read-back, so the commit's is the one Synchronize
      },
      std::move(backend));
  ASSERT_NE(t, nullptr);
  hooked->hook = [&] {
    t->clock.Advance(absl::Minutes(2));
    t->server->Sweep();
  };
  hooked->armed = true;
  const Sequence s = MakeSequence(c, 64, 1, 15);
  v1::PutResponse r;
  const grpc::Status st =
      PutSequence(t->stub.get(), "small", s, c.num_kv_heads * c.head_dim, 16, &r);
  EXPECT_FALSE(hooked->armed) << "the commit never synchronized";
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r.tokens_stored(), 64u);
  EXPECT_EQ(FindNamespace(GetStats(t->stub.get()), "small")->tokens_stored(), 64u);
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
  ASSERT_EQ(MatchOk(t->stub.get(), "small", held).cached_tokens(), 64u);

  const Sequence other = MakeSequence(c, 32, 5000, 11);
  const grpc::Status st = PutSequence(t->stub.get(), "small", other, pt, 16, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("pinned"), std::string::npos) << st.error_message();
}

}  // namespace
}  // namespace kvpool::testing
