// KvPoolClient against an in-process fake KvPool service (framing: chunking, reassembly,
// deadlines, status mapping, AttendStream), and rendezvous placement of ShardedKvPoolClient.
#include "client/kvpool_client.h"

#include <atomic>
#include <cctype>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace kvpool::client {
namespace {

constexpr uint32_t kHeads = 2, kDim = 16;
constexpr uint32_t kBlockingLayer = 99;

// Records Put chunks; serves scripted Get messages; echoes Attend and AttendStream (a unary
// Attend without items fails with INVALID_ARGUMENT, one on layer kBlockingLayer blocks like
// Stats); blocks Stats until released (for deadlines); fails Match with INVALID_ARGUMENT.
class FakeKvPool final : public v1::KvPool::Service {
 public:
  grpc::Status Put(grpc::ServerContext*, grpc::ServerReader<v1::PutRequest>* reader,
                   v1::PutResponse* response) override {
    v1::PutRequest msg;
    absl::MutexLock lock(&mu_);
    while (reader->Read(&msg)) {
      if (msg.has_header()) {
        header_ = msg.header();
        continue;
      }
      chunks_.push_back(msg.chunk());
      response->set_bytes_received(response->bytes_received() + msg.chunk().k().size() +
                                   msg.chunk().v().size());
    }
    return grpc::Status::OK;
  }
  grpc::Status Get(grpc::ServerContext*, const v1::GetRequest*,
                   grpc::ServerWriter<v1::GetResponse>* writer) override {
    for (const v1::GetResponse& m : get_script_) writer->Write(m);
    return grpc::Status::OK;
  }
  grpc::Status Match(grpc::ServerContext*, const v1::MatchRequest* req,
                     v1::MatchResponse*) override {
    match_ttl_ms = req->ttl_ms();
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "token ids must be non-negative");
  }
  grpc::Status Attend(grpc::ServerContext*, const v1::AttendRequest* req,
                      v1::AttendResponse* resp) override {
    if (req->items_size() == 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "Attend needs at least one item");
    }
    if (req->layer() == kBlockingLayer) stats_release_.WaitForNotification();
    resp->add_context_tokens(req->layer());
    resp->set_out(req->items(0).q());
    return grpc::Status::OK;
  }
  grpc::Status AttendStream(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream) override {
    v1::AttendRequest req;
    while (stream->Read(&req)) {
      v1::AttendResponse resp;
      resp.add_context_tokens(req.layer());
      resp.set_out(req.items(0).q());
      stream->Write(resp);
    }
    return grpc::Status::OK;
  }
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse*) override {
    stats_release_.WaitForNotification();
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  v1::PutHeader header_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::PutChunk> chunks_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GetResponse> get_script_;  // set before the call
  absl::Notification stats_release_;
  std::atomic<uint32_t> match_ttl_ms{0};  // of the last Match
};

class KvPoolClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    fake_.stats_release_.Notify();
    server_->Shutdown();
  }
  std::unique_ptr<KvPoolClient> Client(size_t max_chunk_bytes) {
    ClientOptions options;
    options.max_chunk_bytes = max_chunk_bytes;
    return KvPoolClient::Create(server_->InProcessChannel(grpc::ChannelArguments()), options);
  }

  FakeKvPool fake_;
  std::unique_ptr<grpc::Server> server_;
};

SequenceKv RandomKv(uint32_t layers, uint32_t token_begin, uint32_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  SequenceKv kv{layers, token_begin, tokens, kHeads, kDim, {}, {}};
  kv.k.resize(kv.LayerElements() * layers);
  kv.v.resize(kv.k.size());
  for (uint16_t& x : kv.k) x = static_cast<uint16_t>(rng());
  for (uint16_t& x : kv.v) x = static_cast<uint16_t>(rng());
  return kv;
}

TEST_F(KvPoolClientTest, PutSplitsEveryLayerIntoBoundedChunksCoveringItsTokens) {
  const size_t token_bytes = 2 * kHeads * kDim * 2;
  const size_t max_chunk = 3 * token_bytes + token_bytes / 2;  // 3 tokens per chunk
  const SequenceKv kv = RandomKv(3, 16, 10, 7);
  std::vector<int32_t> ids(26);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(1000 + i);

  absl::StatusOr<v1::PutResponse> r = Client(max_chunk)->Put("ns", ids, kv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_received(), (kv.k.size() + kv.v.size()) * 2);

  absl::MutexLock lock(&fake_.mu_);
  EXPECT_EQ(fake_.header_.namespace_(), "ns");
  EXPECT_THAT(fake_.header_.token_ids(), ::testing::ElementsAreArray(ids));
  ASSERT_EQ(fake_.chunks_.size(), 3u * 4u);  // ceil(10 / 3) chunks per layer
  std::vector<uint16_t> k(kv.k.size()), v(kv.v.size());
  for (const v1::PutChunk& c : fake_.chunks_) {
    EXPECT_LE(c.k().size() + c.v().size(), max_chunk);
    ASSERT_GE(c.token_begin(), 16u);
    ASSERT_LE(c.token_begin() + c.num_tokens(), 26u);
    const size_t at = c.layer() * kv.LayerElements() + (c.token_begin() - 16) * kHeads * kDim;
    ASSERT_EQ(c.k().size(), c.num_tokens() * kHeads * kDim * 2);
    std::memcpy(&k[at], c.k().data(), c.k().size());
    std::memcpy(&v[at], c.v().data(), c.v().size());
  }
  EXPECT_EQ(k, kv.k);
  EXPECT_EQ(v, kv.v);
}

// A chunk limit of more than 2^32 tokens (an "unbounded" setting) sends each layer whole.
TEST_F(KvPoolClientTest, PutWithAChunkLimitPastTwoToThe32TokensSendsLayersWhole) {
  const size_t token_bytes = 2 * kHeads * kDim * 2;
  const SequenceKv kv = RandomKv(3, 0, 10, 9);
  std::vector<int32_t> ids(10, 1);
  absl::StatusOr<v1::PutResponse> r =
      Client((token_bytes << 32) + 3 * token_bytes)->Put("", ids, kv);
  ASSERT_TRUE(r.ok()) << r.status();
  absl::MutexLock lock(&fake_.mu_);
  ASSERT_EQ(fake_.chunks_.size(), 3u);
  for (const v1::PutChunk& c : fake_.chunks_) EXPECT_EQ(c.num_tokens(), 10u);
}

TEST_F(KvPoolClientTest, PutRejectsKvWhoseSizeDoesNotMatchItsShape) {
  SequenceKv kv = RandomKv(2, 0, 4, 3);
  kv.v.pop_back();
  absl::StatusOr<v1::PutResponse> r = Client(1 << 20)->Put("", std::vector<int32_t>(4, 1), kv);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  absl::MutexLock lock(&fake_.mu_);
  EXPECT_TRUE(fake_.chunks_.empty());
}

// A Get message of fp16 blocks of one token of one head of head_dim 1 (2 bytes each), one block
// per letter: K holds the letter twice, V its lower case twice. Block 0 carries the layout.
v1::GetResponse Part(uint32_t layer, uint32_t begin, const std::string& letters) {
  v1::GetResponse m;
  m.set_layer(layer);
  m.set_block_begin(begin);
  m.set_num_blocks(static_cast<uint32_t>(letters.size()));
  m.set_valid_tokens(static_cast<uint32_t>(letters.size()));
  for (char c : letters) {
    m.mutable_k()->append(2, c);
    m.mutable_v()->append(2, static_cast<char>(std::tolower(c)));
  }
  if (begin == 0) {
    m.mutable_layout()->set_block_tokens(1);
    m.mutable_layout()->set_head_dim(1);
  }
  return m;
}

TEST_F(KvPoolClientTest, GetReassemblesOutOfOrderMessagesPerLayerInBlockOrder) {
  fake_.get_script_ = {Part(1, 2, "F"), Part(0, 0, "AB"), Part(1, 0, "DE"), Part(0, 2, "C")};
  v1::GetRequest req;
  req.set_lease_id(5);
  absl::StatusOr<GetResult> r = Client(1 << 20)->Get(req);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->layers.size(), 2u);
  EXPECT_EQ(r->layers[0].layer, 0u);
  EXPECT_EQ(r->layers[0].k, "AABBCC");
  EXPECT_EQ(r->layers[0].v, "aabbcc");
  EXPECT_EQ(r->layers[0].num_blocks, 3u);
  EXPECT_EQ(r->layers[0].valid_tokens, 3u);
  EXPECT_EQ(r->layers[1].k, "DDEEFF");
  EXPECT_EQ(r->payload_bytes, 2u * (6 + 6));
}

// Blocks missing at the start or inside a layer or sent twice, layers not asked for, K and V of
// other sizes than the blocks hold, and more tokens than the blocks hold are DATA_LOSS, not a
// result shaped by the server's word.
TEST_F(KvPoolClientTest, GetReportsMissingBlocksAndBadSizesAsDataLoss) {
  v1::GetResponse short_v = Part(0, 0, "AB");
  short_v.mutable_v()->pop_back();
  v1::GetResponse two_claimed_one_sent = Part(0, 0, "A");
  two_claimed_one_sent.set_num_blocks(2);
  v1::GetResponse too_many_tokens = Part(0, 0, "A");
  too_many_tokens.set_valid_tokens(2);
  for (const std::vector<v1::GetResponse>& script :
       {std::vector<v1::GetResponse>{Part(0, 0, "A"), Part(0, 2, "C")},
        std::vector<v1::GetResponse>{Part(0, 1, "B")}, std::vector<v1::GetResponse>{short_v},
        std::vector<v1::GetResponse>{two_claimed_one_sent},
        std::vector<v1::GetResponse>{too_many_tokens},
        std::vector<v1::GetResponse>{Part(0, 0, "AB"), Part(0, 0, "CD")}}) {
    fake_.get_script_ = script;
    absl::StatusOr<GetResult> r = Client(1 << 20)->Get(v1::GetRequest());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << script.front().DebugString();
  }
  // A layer outside the one asked for.
  v1::GetRequest second_layer;
  second_layer.set_layer_begin(1);
  second_layer.set_layer_end(2);
  fake_.get_script_ = {Part(0, 0, "A")};
  EXPECT_EQ(Client(1 << 20)->Get(second_layer).status().code(), absl::StatusCode::kDataLoss);
  fake_.get_script_ = {Part(1, 0, "A")};
  EXPECT_TRUE(Client(1 << 20)->Get(second_layer).ok());
}

// A layer's sink rows (sent with block 0) come back with it; sink rows that are not sink_tokens
// rows of every head the blocks hold are DATA_LOSS.
TEST_F(KvPoolClientTest, GetKeepsALayersSinkRowsAndChecksTheirSize) {
  v1::GetResponse first = Part(0, 0, "AB");
  first.mutable_layout()->set_sink_tokens(2);
  first.set_sink_k("WWXX");  // 2 rows of the one head, 2 bytes each
  first.set_sink_v("wwxx");
  fake_.get_script_ = {Part(0, 2, "C"), first};
  absl::StatusOr<GetResult> r = Client(1 << 20)->Get(v1::GetRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->layers[0].sink_k, "WWXX");
  EXPECT_EQ(r->layers[0].sink_v, "wwxx");
  for (const char* sink_v : {"wwx", "wwxxyy"}) {
    first.set_sink_v(sink_v);
    fake_.get_script_ = {first};
    EXPECT_EQ(Client(1 << 20)->Get(v1::GetRequest()).status().code(), absl::StatusCode::kDataLoss)
        << sink_v;
  }
  first.set_sink_k("WWXXYY");  // three rows where the layout says two
  first.set_sink_v("wwxxyy");
  fake_.get_script_ = {first};
  EXPECT_EQ(Client(1 << 20)->Get(v1::GetRequest()).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(KvPoolClientTest, ServerStatusCodeAndMessageReachTheCaller) {
  absl::StatusOr<v1::MatchResponse> r = Client(1 << 20)->Match("ns", {-1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "token ids must be non-negative");
}

// A lease TTL reaches the server's uint32 milliseconds clamped, not wrapped; a negative one is
// refused before the call.
TEST_F(KvPoolClientTest, MatchTtlIsClampedAndNeverNegative) {
  EXPECT_EQ(Client(1 << 20)->Match("ns", {1}, absl::Hours(24 * 60)).status().code(),
            absl::StatusCode::kInvalidArgument);  // the fake's answer: the call went out
  EXPECT_EQ(fake_.match_ttl_ms.load(), UINT32_MAX);
  fake_.match_ttl_ms = 7;
  EXPECT_EQ(Client(1 << 20)->Match("ns", {1}, absl::Seconds(-1)).status().message(),
            "lease ttl is negative");
  EXPECT_EQ(fake_.match_ttl_ms.load(), 7u);
}

TEST_F(KvPoolClientTest, CallDeadlineEndsACallTheServerNeverAnswers) {
  CallOptions call;
  call.deadline = absl::Milliseconds(20);
  absl::StatusOr<v1::StatsResponse> r = Client(1 << 20)->Stats(call);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
}

// Unary Attend polls its own completion queue (ClientOptions::attend_spin) or blocks at once:
// either way the response, the server's status and the call's deadline reach the caller.
void ExpectUnaryAttend(KvPoolClient& client) {
  for (uint32_t layer = 0; layer < 3; ++layer) {
    v1::AttendRequest req;
    req.set_layer(layer);
    req.add_items()->set_q("q of layer " + std::to_string(layer));
    absl::StatusOr<v1::AttendResponse> r = client.Attend(req);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->out(), req.items(0).q());
    EXPECT_THAT(r->context_tokens(), ::testing::ElementsAre(layer));
  }
  absl::StatusOr<v1::AttendResponse> bad = client.Attend(v1::AttendRequest());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "Attend needs at least one item");
  v1::AttendRequest blocking;
  blocking.set_layer(kBlockingLayer);
  blocking.add_items();
  CallOptions call;
  call.deadline = absl::Milliseconds(20);
  EXPECT_EQ(client.Attend(blocking, call).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(KvPoolClientTest, UnaryAttendPollingAnswersAndEndsAtItsDeadline) {
  ExpectUnaryAttend(*Client(1 << 20));
}

TEST_F(KvPoolClientTest, UnaryAttendBlockingAnswersAndEndsAtItsDeadline) {
  ClientOptions options;
  options.attend_spin = absl::ZeroDuration();
  ExpectUnaryAttend(
      *KvPoolClient::Create(server_->InProcessChannel(grpc::ChannelArguments()), options));
}

// A port nothing listens on: taken from a server that is shut down again.
int FreePort() {
  int port = 0;
  FakeKvPool fake;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return 0;
  server->Shutdown();
  return port;
}

TEST(KvPoolClientConnect, WaitForReadyWaitsForALateServerAndFailFastDoesNot) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string target = "127.0.0.1:" + std::to_string(port);
  CallOptions call;
  call.deadline = absl::Seconds(10);
  ClientOptions fail_fast;
  EXPECT_EQ(KvPoolClient::Create(target, fail_fast)->Match("ns", {1}, absl::ZeroDuration(), call)
                .status()
                .code(),
            absl::StatusCode::kUnavailable);

  ClientOptions waiting;
  waiting.wait_for_ready = true;
  std::unique_ptr<KvPoolClient> client = KvPoolClient::Create(target, waiting);
  FakeKvPool fake;
  std::unique_ptr<grpc::Server> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    grpc::ServerBuilder builder;
    builder.AddListeningPort(target, grpc::InsecureServerCredentials());
    builder.RegisterService(&fake);
    server = builder.BuildAndStart();
  });
  // The fake answers Match with INVALID_ARGUMENT: the call reached the server started late.
  EXPECT_EQ(client->Match("ns", {1}, absl::ZeroDuration(), call).status().code(),
            absl::StatusCode::kInvalidArgument);
  starter.join();
  ASSERT_NE(server, nullptr);
  fake.stats_release_.Notify();
  server->Shutdown();
}

// Steps layers 0..steps-1 of `session` (the fake echoes q as out and the layer as the context
// length), then finishes it; a step after Finish fails.
void ExpectStepsInOrder(AttendSession& session, uint32_t steps) {
  for (uint32_t layer = 0; layer < steps; ++layer) {
    v1::AttendRequest req;
    req.set_layer(layer);
    req.add_items()->set_q("q" + std::to_string(layer));
    absl::StatusOr<v1::AttendResponse> resp = session.Step(req);
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(resp->context_tokens(0), layer);
    EXPECT_EQ(resp->out(), "q" + std::to_string(layer));
  }
  EXPECT_TRUE(session.Finish().ok());
  EXPECT_FALSE(session.Step(v1::AttendRequest()).ok());
}

TEST_F(KvPoolClientTest, AttendSessionAnswersEachStepInOrderOnOneStream) {
  absl::StatusOr<std::unique_ptr<AttendSession>> session = Client(1 << 20)->OpenAttendStream();
  ASSERT_TRUE(session.ok()) << session.status();
  ExpectStepsInOrder(**session, 5);
}

// With spinning off (block at once) the session behaves the same.
TEST_F(KvPoolClientTest, AttendSessionWithoutSpinningAnswersInOrder) {
  ClientOptions options;
  options.attend_spin = absl::ZeroDuration();
  auto client = KvPoolClient::Create(server_->InProcessChannel(grpc::ChannelArguments()), options);
  absl::StatusOr<std::unique_ptr<AttendSession>> session = client->OpenAttendStream();
  ASSERT_TRUE(session.ok()) << session.status();
  ExpectStepsInOrder(**session, 3);
}

// A session dropped mid-stream (no Finish) cancels its call and returns; one that is opened and
// dropped without a step does too.
TEST_F(KvPoolClientTest, AttendSessionDroppedWithoutFinishDoesNotHang) {
  std::unique_ptr<KvPoolClient> client = Client(1 << 20);
  {
    absl::StatusOr<std::unique_ptr<AttendSession>> session = client->OpenAttendStream();
    ASSERT_TRUE(session.ok());
    v1::AttendRequest req;
    req.add_items()->set_q("q");
    ASSERT_TRUE((*session)->Step(req).ok());
  }
  {
    absl::StatusOr<std::unique_ptr<AttendSession>> idle = client->OpenAttendStream();
    ASSERT_TRUE(idle.ok());
  }
  // The server still serves new streams.
  absl::StatusOr<std::unique_ptr<AttendSession>> again = client->OpenAttendStream();
  ASSERT_TRUE(again.ok());
  v1::AttendRequest req;
  req.add_items()->set_q("r");
  absl::StatusOr<v1::AttendResponse> resp = (*again)->Step(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->out(), "r");
}

// No server behind the target: the first Step fails with UNAVAILABLE (wait_for_ready off) and
// every later one returns the same error.
TEST(KvPoolClientNoServer, AttendSessionStepFailsUnavailable) {
  ClientOptions options;
  options.wait_for_ready = false;
  auto client = KvPoolClient::Create("127.0.0.1:1", options);
  absl::StatusOr<std::unique_ptr<AttendSession>> session = client->OpenAttendStream();
  ASSERT_TRUE(session.ok());
  v1::AttendRequest req;
  req.add_items()->set_q("q");
  absl::StatusOr<v1::AttendResponse> first = (*session)->Step(req);
  EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable) << first.status();
  EXPECT_EQ((*session)->Step(req).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*session)->Finish().code(), absl::StatusCode::kUnavailable);
}

std::vector<int32_t> RandomIds(std::mt19937_64& rng, int n) {
  std::vector<int32_t> ids(n);
  for (int32_t& x : ids) x = static_cast<int32_t>(rng() % 128000);
  return ids;
}

TEST(RendezvousShard, SequencesSharingTheFirstBlockLandOnOneShard) {
  const std::vector<std::string> targets = {"a:1", "b:1", "c:1", "d:1"};
  std::mt19937_64 rng(11);
  const std::vector<int32_t> system = RandomIds(rng, 16);
  for (int r = 0; r < 20; ++r) {
    std::vector<int32_t> ids = system;
    const std::vector<int32_t> user = RandomIds(rng, 40);
    ids.insert(ids.end(), user.begin(), user.end());
    EXPECT_EQ(RendezvousShard(targets, "ns", absl::MakeConstSpan(ids).subspan(0, 16)),
              RendezvousShard(targets, "ns", system));
  }
}

TEST(RendezvousShard, IsStableAcrossBuildsForAFixedInput) {
  const std::vector<std::string> t3 = {"kvpool-0:50051", "kvpool-1:50051", "kvpool-2:50051"};
  std::vector<std::string> t8;
  for (int i = 1; i <= 8; ++i) t8.push_back(absl::StrCat("10.0.0.", i, ":50051"));
  std::vector<int32_t> a, b;
  for (int i = 0; i < 16; ++i) {
    a.push_back(i + 1);
    b.push_back(128000 - 7 * i);
  }
  const std::vector<int32_t> c = {2147483647, 0, 5, 99999, 42};
  // Pinned: a changed hash would move every cached prefix of a running fleet. The Python client's
  // rendezvous_shard is checked against the same table (tests/python/test_sharding.py).
  EXPECT_EQ(RendezvousShard(t3, "other", a), 1u);
  EXPECT_EQ(RendezvousShard(t3, "", a), 0u);
  EXPECT_EQ(RendezvousShard(t3, "default", b), 0u);
  EXPECT_EQ(RendezvousShard(t8, "llama", a), 2u);
  EXPECT_EQ(RendezvousShard(t8, "llama", b), 3u);
  EXPECT_EQ(RendezvousShard(t8, "qwen", c), 6u);
  EXPECT_EQ(RendezvousShard(t8, "", {}), 0u);
  EXPECT_EQ(RendezvousShard(t8, "llama", c), 5u);
}

TEST(RendezvousShard, SpreadsPrefixesEvenlyAndRemovingAShardMovesOnlyItsOwn) {
  const std::vector<std::string> four = {"a:1", "b:1", "c:1", "d:1"};
  const std::vector<std::string> three = {"a:1", "b:1", "d:1"};  // c:1 removed
  std::mt19937_64 rng(5);
  std::map<size_t, int> count;
  for (int i = 0; i < 4000; ++i) {
    const std::vector<int32_t> ids = RandomIds(rng, 16);
    const size_t s4 = RendezvousShard(four, "ns", ids);
    ++count[s4];
    const std::string& before = four[s4];
    const std::string& after = three[RendezvousShard(three, "ns", ids)];
    if (before != "c:1") {
      EXPECT_EQ(after, before);
    }
  }
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_GT(count[s], 800) << "shard " << s;
    EXPECT_LT(count[s], 1200) << "shard " << s;
  }
}

TEST(RendezvousShard, NamespaceIsPartOfThePlacement) {
  const std::vector<std::string> targets = {"a:1", "b:1", "c:1", "d:1", "e:1", "f:1"};
  std::mt19937_64 rng(9);
  int differ = 0;
  for (int i = 0; i < 200; ++i) {
    const std::vector<int32_t> ids = RandomIds(rng, 16);
    differ += RendezvousShard(targets, "llama", ids) != RendezvousShard(targets, "qwen", ids);
  }
  EXPECT_GT(differ, 100);
}

// "" names the servers' default namespace: it places a sequence as "default" does.
TEST(RendezvousShard, TheDefaultNamespaceSpelledEitherWayPlacesAlike) {
  const std::vector<std::string> targets = {"a:1", "b:1", "c:1", "d:1", "e:1", "f:1"};
  std::mt19937_64 rng(13);
  for (int i = 0; i < 200; ++i) {
    const std::vector<int32_t> ids = RandomIds(rng, 16);
    EXPECT_EQ(RendezvousShard(targets, "", ids), RendezvousShard(targets, "default", ids));
  }
}

TEST(ShardedKvPoolClient, RejectsNoTargetsAndDuplicateTargets) {
  EXPECT_EQ(ShardedKvPoolClient::Create({}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardedKvPoolClient::Create({"a:1", "a:1"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// AttendSocket options that would send one shard's sessions to another shard's server.
TEST(ShardedKvPoolClient, RejectsAttendSocketsTheShardsWouldShare) {
  ClientOptions unix_socket;
  unix_socket.attend_unix_socket = "/run/kvpool/kvpool-0.sock";
  EXPECT_EQ(ShardedKvPoolClient::Create({"a:1", "b:1"}, unix_socket).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ShardedKvPoolClient::Create({"a:1"}, unix_socket).ok());
  ClientOptions port;
  port.attend_socket_port = 50052;
  EXPECT_EQ(ShardedKvPoolClient::Create({"a:50051", "a:50061"}, port).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ShardedKvPoolClient::Create({"a:50051", "b:50051"}, port).ok());
  // Targets the port cannot be joined to are left to fail when a session opens, as before.
  EXPECT_TRUE(ShardedKvPoolClient::Create({"unix:/p"}, port).ok());
  EXPECT_TRUE(ShardedKvPoolClient::Create({"unix:/a", "unix:/b"}, port).ok());
}

TEST(ShardedKvPoolClient, PlacesASequenceByItsFirstBlockOnly) {
  absl::StatusOr<std::unique_ptr<ShardedKvPoolClient>> c =
      ShardedKvPoolClient::Create({"a:1", "b:1", "c:1"});
  ASSERT_TRUE(c.ok()) << c.status();
  std::mt19937_64 rng(3);
  const std::vector<int32_t> ids = RandomIds(rng, 64);
  const size_t shard = (*c)->ShardFor("ns", ids, 16);
  EXPECT_EQ(shard, RendezvousShard({"a:1", "b:1", "c:1"}, "ns",
                                   absl::MakeConstSpan(ids).subspan(0, 16)));
  EXPECT_EQ(&(*c)->ForSequence("ns", ids, 16), &(*c)->shard(shard));
}

}  // namespace
}  // namespace kvpool::client
