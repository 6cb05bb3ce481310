// TransferClient's path choice (CPU, no NCCL needed): NCCL through an attached healthy channel
// (faked here), gRPC streaming through KvPoolClient against an in-process fake KvPool service
// otherwise, and the retry over gRPC when an NCCL transfer breaks its channel. That both paths
// leave the caller's buffer in the same layout is checked against a real store in
// transfer_client_paths_test.cc.
#include "client/transfer_client.h"

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/common/kv_test_data.h"

namespace kvpool::client {
namespace {

constexpr uint32_t kHeads = 2, kDim = 16, kBlockTokens = 16, kLayers = 3;
constexpr size_t kTokenBytes = kHeads * kDim * 2;

// Records Puts; serves one scripted message per layer on Get; counts calls.
class FakeKvPool final : public v1::KvPool::Service {
 public:
  grpc::Status Put(grpc::ServerContext*, grpc::ServerReader<v1::PutRequest>* reader,
                   v1::PutResponse* response) override {
    v1::PutRequest msg;
    absl::SleepFor(delay_);
    absl::MutexLock lock(&mu_);
    ++puts_;
    while (reader->Read(&msg)) {
      if (msg.has_header()) {
        header_ = msg.header();
        continue;
      }
      chunks_.push_back(msg.chunk());
    }
    response->set_tokens_stored(header_.token_ids_size());
    return grpc::Status::OK;
  }
  grpc::Status Get(grpc::ServerContext*, const v1::GetRequest*,
                   grpc::ServerWriter<v1::GetResponse>* writer) override {
    absl::SleepFor(delay_);
    absl::MutexLock lock(&mu_);
    ++gets_;
    for (const v1::GetResponse& m : get_script_) writer->Write(m);
    return grpc::Status::OK;
  }

  absl::Duration delay_;  // before each call is served; set before any call
  absl::Mutex mu_;
  int puts_ ABSL_GUARDED_BY(mu_) = 0;
  int gets_ ABSL_GUARDED_BY(mu_) = 0;
  v1::PutHeader header_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::PutChunk> chunks_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GetResponse> get_script_ ABSL_GUARDED_BY(mu_);
};

// What the fake channel saw, kept beyond the channel's life.
struct ChannelLog {
  int gets = 0;
  int puts = 0;
  uint32_t put_num_layers = 0;
  uint64_t put_token_bytes = 0;
  bool destroyed = false;
  absl::Time close_deadline = absl::InfiniteFuture();  // what SetCloseDeadline was given
};

// An NcclChannel that answers from a script: on success Get writes `payload` into the buffer
// and returns `descriptor`; a failure may break the channel (healthy() turns false).
class FakeNcclChannel final : public NcclChannel {
 public:
  explicit FakeNcclChannel(ChannelLog* log) : log_(log) {}
  ~FakeNcclChannel() override { log_->destroyed = true; }

  bool healthy() const override {
    absl::SleepFor(healthy_delay_);
    return healthy_;
  }
  uint64_t channel_id() const override { return 1; }
  void SetCloseDeadline(absl::Time deadline) override { log_->close_deadline = deadline; }

  absl::StatusOr<v1::NcclGetDescriptor> Get(v1::NcclGetRequest, void* dst, uint64_t capacity,
                                            absl::Duration) override {
    ++log_->gets;
    absl::SleepFor(delay_);
    if (!error_.ok()) {
      healthy_ = !breaks_;
      return error_;
    }
    if (payload_.size() > capacity) return absl::ResourceExhaustedError("too small");
    std::memcpy(dst, payload_.data(), payload_.size());
    return descriptor_;
  }
  absl::StatusOr<v1::PutResponse> Put(std::string_view, absl::Span<const int32_t> token_ids,
                                      uint32_t num_layers, const void*, const void*,
                                      uint64_t token_bytes, absl::Duration) override {
    ++log_->puts;
    absl::SleepFor(delay_);
    log_->put_num_layers = num_layers;
    log_->put_token_bytes = token_bytes;
    if (!error_.ok()) {
      healthy_ = !breaks_;
      return error_;
    }
    v1::PutResponse r;
    r.set_tokens_stored(static_cast<uint32_t>(token_ids.size()));
    return r;
  }

  bool healthy_ = true;
  absl::Status error_;    // returned by every transfer when not OK
  bool breaks_ = false;   // whether a failure breaks the channel
  absl::Duration delay_;  // before each transfer returns
  absl::Duration healthy_delay_;  // before healthy() returns
  std::string payload_;
  v1::NcclGetDescriptor descriptor_;

 private:
  ChannelLog* const log_;
};

// fp16 bytes of `blocks` blocks of one layer's K or V, random with outlier channels.
std::string LayerBytes(uint32_t blocks, uint64_t seed) {
  const testing::KvData d = testing::MakeKv(static_cast<int>(blocks * kBlockTokens), kHeads, kDim,
                                            testing::Outliers::kOffset, seed);
  const std::vector<uint16_t> h = testing::ToHalf(d.k);
  return std::string(reinterpret_cast<const char*>(h.data()), h.size() * sizeof(uint16_t));
}

class TransferClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    kv_ = KvPoolClient::Create(server_->InProcessChannel(grpc::ChannelArguments()));
    // Three layers of two blocks, the last layer shorter (a partial tail block).
    absl::MutexLock lock(&fake_.mu_);
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      v1::GetResponse m;
      m.set_layer(layer);
      m.set_num_blocks(2);
      m.set_valid_tokens(layer + 1 == kLayers ? 2 * kBlockTokens - 5 : 2 * kBlockTokens);
      m.set_k(LayerBytes(2, 10 + layer));
      m.set_v(LayerBytes(2, 20 + layer));
      m.mutable_layout()->set_block_tokens(kBlockTokens);
      m.mutable_layout()->set_head_dim(kDim);
      fake_.get_script_.push_back(m);
    }
  }
  void TearDown() override { server_->Shutdown(); }

  // The buffer both paths must produce: per layer K then V, back to back.
  std::string ExpectedBuffer() {
    absl::MutexLock lock(&fake_.mu_);
    std::string out;
    for (const v1::GetResponse& m : fake_.get_script_) out += m.k() + m.v();
    return out;
  }
  int GrpcGets() {
    absl::MutexLock lock(&fake_.mu_);
    return fake_.gets_;
  }
  int GrpcPuts() {
    absl::MutexLock lock(&fake_.mu_);
    return fake_.puts_;
  }
  // A healthy fake channel that serves the same data as the gRPC fake.
  std::unique_ptr<FakeNcclChannel> Channel(ChannelLog* log) {
    auto channel = std::make_unique<FakeNcclChannel>(log);
    channel->payload_ = ExpectedBuffer();
    channel->descriptor_.set_num_blocks(2);
    channel->descriptor_.set_total_bytes(channel->payload_.size());
    return channel;
  }

  FakeKvPool fake_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<KvPoolClient> kv_;
};

TEST_F(TransferClientTest, GetWithoutAChannelStreamsOverGrpcIntoTheNcclLayout) {
  TransferClient client(kv_.get(), HostBufferCopy());
  EXPECT_EQ(client.path(), TransferPath::kGrpc);
  const std::string want = ExpectedBuffer();
  std::string buffer(want.size() + 64, '\x5a');
  v1::GetRequest request;
  request.set_lease_id(9);
  absl::StatusOr<TransferGetResult> r =
      client.Get(request, buffer.data(), buffer.size(), absl::Seconds(10));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, TransferPath::kGrpc);
  EXPECT_TRUE(r->nccl_error.ok());
  EXPECT_EQ(r->total_bytes, want.size());
  EXPECT_EQ(r->num_blocks, 2u);
  EXPECT_EQ(r->valid_tokens, 2 * kBlockTokens - 5);
  ASSERT_EQ(r->layers.size(), kLayers);
  const uint64_t layer_bytes = 2 * kBlockTokens * kTokenBytes;
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_EQ(r->layers[l].layer(), l);
    EXPECT_EQ(r->layers[l].bytes(), layer_bytes);
    EXPECT_EQ(r->layers[l].k_offset(), 2 * l * layer_bytes);
    EXPECT_EQ(r->layers[l].v_offset(), (2 * l + 1) * layer_bytes);
  }
  EXPECT_EQ(buffer.substr(0, want.size()), want);
  EXPECT_EQ(buffer.substr(want.size()), std::string(64, '\x5a'));  // nothing past the payload
}

TEST_F(TransferClientTest, GrpcGetRefusesAPayloadLargerThanTheBuffer) {
  TransferClient client(kv_.get(), HostBufferCopy());
  const size_t need = ExpectedBuffer().size();
  std::string buffer(need - 1, '\x5a');
  absl::StatusOr<TransferGetResult> r =
      client.Get(v1::GetRequest(), buffer.data(), buffer.size(), absl::Seconds(10));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(buffer, std::string(need - 1, '\x5a'));
}

TEST_F(TransferClientTest, HealthyChannelCarriesGetAndPutWithoutGrpcData) {
  ChannelLog log;
  TransferClient client(kv_.get(), HostBufferCopy(), Channel(&log));
  EXPECT_EQ(client.path(), TransferPath::kNccl);
  const std::string want = ExpectedBuffer();
  std::string buffer(want.size(), '\0');
  absl::StatusOr<TransferGetResult> got =
      client.Get(v1::GetRequest(), buffer.data(), buffer.size(), absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->path, TransferPath::kNccl);
  EXPECT_EQ(buffer, want);

  const std::vector<int32_t> ids(40, 7);
  const std::vector<uint16_t> k(kLayers * ids.size() * kHeads * kDim, 0x3c00);
  PutSource src{kLayers, kHeads, kDim, k.data(), k.data()};
  absl::StatusOr<TransferPutResult> put = client.Put("ns", ids, src, absl::Seconds(10));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->path, TransferPath::kNccl);
  EXPECT_EQ(put->response.tokens_stored(), ids.size());
  EXPECT_EQ(log.gets, 1);
  EXPECT_EQ(log.puts, 1);
  EXPECT_EQ(log.put_num_layers, static_cast<uint32_t>(kLayers));
  EXPECT_EQ(log.put_token_bytes, kTokenBytes);
  EXPECT_EQ(GrpcGets(), 0);
  EXPECT_EQ(GrpcPuts(), 0);
}

TEST_F(TransferClientTest, NcclFailureThatBreaksTheChannelFallsBackToGrpcAndDropsIt) {
  ChannelLog log;
  std::unique_ptr<FakeNcclChannel> channel = Channel(&log);
  channel->error_ = absl::UnavailableError("NCCL transfer failed or timed out; channel aborted");
  channel->breaks_ = true;
  TransferClient client(kv_.get(), HostBufferCopy(), std::move(channel));
  const std::string want = ExpectedBuffer();
  std::string buffer(want.size(), '\0');
  absl::StatusOr<TransferGetResult> r =
      client.Get(v1::GetRequest(), buffer.data(), buffer.size(), absl::Seconds(10));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, TransferPath::kGrpc);
  EXPECT_EQ(r->nccl_error.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(buffer, want);
  EXPECT_TRUE(log.destroyed);
  EXPECT_EQ(client.path(), TransferPath::kGrpc);

  // Later calls go straight to gRPC.
  ASSERT_TRUE(client.Get(v1::GetRequest(), buffer.data(), buffer.size(), absl::Seconds(10)).ok());
  EXPECT_EQ(log.gets, 1);
  EXPECT_EQ(GrpcGets(), 2);
}

// The call's timeout covers the NCCL attempt and the gRPC retry together: the retry gets what
// the attempt left (here too little for the slow gRPC fake), and none when it used it all.
TEST_F(TransferClientTest, TheGrpcRetryGetsWhatTheNcclAttemptLeftOfTheTimeout) {
  // The old code took nccl_time + kTimeout; the slack leaves room for a loaded machine.
  fake_.delay_ = absl::Milliseconds(1500);
  constexpr absl::Duration kTimeout = absl::Milliseconds(1000);
  constexpr absl::Duration kSlack = absl::Milliseconds(250);
  std::string buffer(ExpectedBuffer().size(), '\0');
  const std::vector<int32_t> ids(3, 1);
  const std::vector<uint16_t> k(kLayers * ids.size() * kHeads * kDim, 0x3c00);
  const PutSource src{kLayers, kHeads, kDim, k.data(), k.data()};
  for (const absl::Duration nccl_time : {absl::Milliseconds(400), absl::Milliseconds(1100)}) {
    for (const bool get : {true, false}) {
      ChannelLog log;
      std::unique_ptr<FakeNcclChannel> channel = Channel(&log);
      channel->error_ = absl::UnavailableError("NCCL transfer timed out; channel aborted");
      channel->breaks_ = true;
      channel->delay_ = nccl_time;
      TransferClient client(kv_.get(), HostBufferCopy(), std::move(channel));
      const absl::Time start = absl::Now();
      const absl::Status s =
          get ? client.Get(v1::GetRequest(), buffer.data(), buffer.size(), kTimeout).status()
              : client.Put("ns", ids, src, kTimeout).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_LT(absl::Now() - start, std::max(kTimeout, nccl_time) + kSlack)
          << (get ? "Get" : "Put") << " after " << nccl_time << " of NCCL";
    }
  }
}

// The dropped channel's close (an RPC its destructor sends, after the retry) is bounded by the
// call's deadline, not by the channel's own 5 s: a server that no longer answers would otherwise
// hold the call that long past its timeout.
TEST_F(TransferClientTest, ADroppedChannelIsClosedWithinTheCallsDeadline) {
  constexpr absl::Duration kTimeout = absl::Seconds(3);
  std::string buffer(ExpectedBuffer().size(), '\0');
  const std::vector<int32_t> ids(3, 1);
  const std::vector<uint16_t> k(kLayers * ids.size() * kHeads * kDim, 0x3c00);
  const PutSource src{kLayers, kHeads, kDim, k.data(), k.data()};
  for (const bool get : {true, false}) {
    ChannelLog log;
    std::unique_ptr<FakeNcclChannel> channel = Channel(&log);
    channel->error_ = absl::UnavailableError("NCCL transfer failed; channel aborted");
    channel->breaks_ = true;
    TransferClient client(kv_.get(), HostBufferCopy(), std::move(channel));
    const absl::Time before = absl::Now();
    const absl::Status s =
        get ? client.Get(v1::GetRequest(), buffer.data(), buffer.size(), kTimeout).status()
            : client.Put("ns", ids, src, kTimeout).status();
    const absl::Time after = absl::Now();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(log.destroyed);
    EXPECT_GE(log.close_deadline, before + kTimeout) << (get ? "Get" : "Put");
    EXPECT_LE(log.close_deadline, after + kTimeout) << (get ? "Get" : "Put");
  }
}

TEST_F(TransferClientTest, NcclErrorThatLeavesTheChannelHealthyIsReturnedWithoutRetry) {
  ChannelLog log;
  std::unique_ptr<FakeNcclChannel> channel = Channel(&log);
  channel->error_ = absl::NotFoundError("unknown lease 9");
  TransferClient client(kv_.get(), HostBufferCopy(), std::move(channel));
  std::string buffer(ExpectedBuffer().size(), '\0');
  absl::StatusOr<TransferGetResult> r =
      client.Get(v1::GetRequest(), buffer.data(), buffer.size(), absl::Seconds(10));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  const std::vector<int32_t> ids(16, 3);
  const std::vector<uint16_t> k(kLayers * ids.size() * kHeads * kDim, 0x3c00);
  absl::StatusOr<TransferPutResult> put = client.Put(
      "ns", ids, PutSource{kLayers, kHeads, kDim, k.data(), k.data()}, absl::Seconds(10));
  EXPECT_EQ(put.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client.path(), TransferPath::kNccl);
  EXPECT_FALSE(log.destroyed);
  EXPECT_EQ(GrpcGets(), 0);
  EXPECT_EQ(GrpcPuts(), 0);
}

TEST_F(TransferClientTest, PutOverGrpcSendsTheWholeSequenceFromTheBuffer) {
  ChannelLog log;
  std::unique_ptr<FakeNcclChannel> channel = Channel(&log);
  channel->healthy_ = false;  // attached but already aborted: skipped
  TransferClient client(kv_.get(), HostBufferCopy(), std::move(channel));
  EXPECT_EQ(client.path(), TransferPath::kGrpc);
  const uint32_t tokens = 37;
  const testing::KvData d = testing::MakeKv(static_cast<int>(kLayers * tokens), kHeads, kDim,
                                            testing::Outliers::kSpikes, 77);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  std::vector<int32_t> ids(tokens);
  for (uint32_t i = 0; i < tokens; ++i) ids[i] = static_cast<int32_t>(500 + 3 * i);
  absl::StatusOr<TransferPutResult> r = client.Put(
      "ns", ids, PutSource{kLayers, kHeads, kDim, k.data(), v.data()}, absl::Seconds(10));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, TransferPath::kGrpc);
  EXPECT_EQ(log.puts, 0);

  absl::MutexLock lock(&fake_.mu_);
  EXPECT_EQ(fake_.header_.namespace_(), "ns");
  EXPECT_THAT(fake_.header_.token_ids(), ::testing::ElementsAreArray(ids));
  std::vector<uint16_t> got_k(k.size()), got_v(v.size());
  const size_t row = kHeads * kDim;
  for (const v1::PutChunk& c : fake_.chunks_) {
    const size_t at = (c.layer() * tokens + c.token_begin()) * row;
    ASSERT_LE((c.layer() * tokens + c.token_begin() + c.num_tokens()) * row, k.size());
    std::memcpy(&got_k[at], c.k().data(), c.k().size());
    std::memcpy(&got_v[at], c.v().data(), c.v().size());
  }
  EXPECT_EQ(got_k, k);
  EXPECT_EQ(got_v, v);
}

// A zero timeout would expire an NCCL attempt at once and abort the channel: refused up front.
// A channel's healthy() may wait (a real one once waited for another thread's transfer): the
// client asks it outside its own lock, so that attaching a new channel does not wait too.
TEST_F(TransferClientTest, AttachingAChannelDoesNotWaitForAnotherThreadsHealthCheck) {
  ChannelLog log, next_log;
  std::unique_ptr<FakeNcclChannel> slow = Channel(&log);
  slow->healthy_delay_ = absl::Seconds(1);
  TransferClient client(kv_.get(), HostBufferCopy(), std::move(slow));
  std::thread asking([&] { EXPECT_EQ(client.path(), TransferPath::kNccl); });
  absl::SleepFor(absl::Milliseconds(100));  // `asking` is inside healthy() by now
  const absl::Time start = absl::Now();
  client.SetChannel(Channel(&next_log));
  const absl::Duration took = absl::Now() - start;
  asking.join();
  EXPECT_LT(took, absl::Milliseconds(500));
  EXPECT_TRUE(log.destroyed);  // once `asking` let go of it
}

TEST_F(TransferClientTest, RejectsTimeoutsThatAreNotPositive) {
  ChannelLog log;
  TransferClient client(kv_.get(), HostBufferCopy(), Channel(&log));
  std::string buffer(ExpectedBuffer().size(), '\0');
  const std::vector<int32_t> ids(4, 1);
  const std::vector<uint16_t> k(kLayers * ids.size() * kHeads * kDim, 0x3c00);
  for (absl::Duration t : {absl::ZeroDuration(), absl::Seconds(-1)}) {
    EXPECT_EQ(client.Get(v1::GetRequest(), buffer.data(), buffer.size(), t).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(client.Put("ns", ids, PutSource{kLayers, kHeads, kDim, k.data(), k.data()}, t)
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(log.gets + log.puts, 0);
  EXPECT_FALSE(log.destroyed);
  EXPECT_EQ(GrpcGets() + GrpcPuts(), 0);
}

TEST_F(TransferClientTest, RejectsAPutSourceWithoutShapeOrBuffers) {
  TransferClient client(kv_.get(), HostBufferCopy());
  const std::vector<int32_t> ids(4, 1);
  EXPECT_EQ(client.Put("ns", ids, PutSource{}, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GrpcPuts(), 0);
}

// The worker's checks of the server's first NCCL answer: a descriptor whose segments leave the
// buffer, or a plan for tokens outside the sequence, is DATA_LOSS before anything moves; a plan
// for buffers of another shape is the caller's INVALID_ARGUMENT.
TEST(NcclChannelChecks, RefuseAnswersOutsideTheWorkersBuffers) {
  v1::NcclGetDescriptor d;
  v1::NcclLayerSegments* seg = d.add_layers();
  seg->set_k_offset(0);
  seg->set_v_offset(100);
  seg->set_bytes(100);
  EXPECT_TRUE(CheckGetDescriptor(d, 200).ok());
  EXPECT_EQ(CheckGetDescriptor(d, 199).code(), absl::StatusCode::kDataLoss);
  seg->set_v_offset(UINT64_MAX - 50);  // offset + bytes wraps
  EXPECT_EQ(CheckGetDescriptor(d, 200).code(), absl::StatusCode::kDataLoss);
  seg->set_v_offset(100);
  seg->set_sink_k_offset(200);  // sink segments of 10 bytes after V
  seg->set_sink_v_offset(210);
  seg->set_sink_bytes(10);
  EXPECT_TRUE(CheckGetDescriptor(d, 220).ok());
  EXPECT_EQ(CheckGetDescriptor(d, 219).code(), absl::StatusCode::kDataLoss);
  seg->set_sink_k_offset(UINT64_MAX - 5);
  EXPECT_EQ(CheckGetDescriptor(d, 220).code(), absl::StatusCode::kDataLoss);

  v1::NcclPutPlan plan;
  plan.set_num_layers(kLayers);
  plan.set_token_begin(16);
  plan.set_num_tokens(16);
  plan.set_layer_bytes(16 * kTokenBytes);
  EXPECT_TRUE(CheckPutPlan(plan, "main", 32, kLayers, kTokenBytes).ok());
  EXPECT_EQ(CheckPutPlan(plan, "main", 31, kLayers, kTokenBytes).code(),
            absl::StatusCode::kDataLoss);
  plan.set_token_begin(UINT32_MAX);
  EXPECT_EQ(CheckPutPlan(plan, "main", 32, kLayers, kTokenBytes).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(CheckPutPlan(plan, "main", 32, kLayers + 1, kTokenBytes).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckPutPlan(plan, "main", 32, kLayers, kTokenBytes + 2).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::client
