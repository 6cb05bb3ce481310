// The NCCL data plane's protocol (KvPoolTransport) end to end over in-process gRPC, with the
// transport faked on the CPU: a test worker drives the RPCs and the fake worker end exactly as a
// real worker drives ncclRecv/ncclSend.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/metrics/metrics_registry.h"
#include "service/proto_convert.h"
#include "service/rpc_metrics.h"
#include "service/transport/channel_manager.h"
#include "service/transport/fake_peer_transport.h"
#include "service/transport/transport_service.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// The worker side of one channel, in the test's thread.
class TestWorker {
 public:
  TestWorker(v1::KvPoolTransport::Stub* stub, FakePeerNetwork* network)
      : stub_(stub), network_(network) {}

  absl::Status Open() {
    grpc::ClientContext ctx;
    v1::OpenChannelRequest req;
    v1::OpenChannelResponse resp;
    if (grpc::Status s = stub_->OpenChannel(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
    EXPECT_EQ(resp.num_ranks(), 2u);
    EXPECT_EQ(resp.worker_rank(), 1u);
    channel_id_ = resp.channel_id();
    absl::StatusOr<std::unique_ptr<PeerTransport>> end = network_->Join(resp.nccl_unique_id());
    if (!end.ok()) return end.status();
    end_ = *std::move(end);
    return absl::OkStatus();
  }
  absl::Status Close() {
    grpc::ClientContext ctx;
    v1::CloseChannelRequest req;
    req.set_channel_id(channel_id_);
    v1::CloseChannelResponse resp;
    return FromGrpc(stub_->CloseChannel(&ctx, req, &resp));
  }

  // NcclGet into `buffer` (sized by the descriptor). `die_after_header` aborts the worker end
  // instead of receiving.
  absl::Status Get(v1::NcclGetRequest req, v1::NcclGetDescriptor* header,
                   std::vector<uint8_t>* buffer, uint64_t buffer_bytes = uint64_t{1} << 30) {
    req.set_channel_id(channel_id_);
    req.set_buffer_bytes(buffer_bytes);
    grpc::ClientContext ctx;
    auto reader = stub_->NcclGet(&ctx, req);
    v1::NcclGetResponse msg;
    if (!reader->Read(&msg)) return FromGrpc(reader->Finish());
    EXPECT_TRUE(msg.has_header());
    *header = msg.header();
    buffer->assign(header->total_bytes(), 0);
    std::vector<RecvSegment> segments;
    for (const v1::NcclLayerSegments& l : header->layers()) {
      segments.push_back({buffer->data() + l.k_offset(), l.bytes()});
      segments.push_back({buffer->data() + l.v_offset(), l.bytes()});
    }
    const absl::Status recv = end_->Recv(segments, absl::InfiniteFuture());
    const bool got_done = reader->Read(&msg) && msg.has_done();
    const absl::Status rpc = FromGrpc(reader->Finish());
    if (!rpc.ok()) return rpc;
    EXPECT_TRUE(got_done);
    EXPECT_EQ(msg.done().bytes(), header->total_bytes());
    return recv;
  }

  // NcclPut of a sequence whose fp16 K/V per layer are kv.k[l], kv.v[l] ([tokens][heads][dim]).
  // `die_after_plan` aborts the worker end instead of sending.
  absl::StatusOr<v1::PutResponse> Put(const std::vector<int32_t>& ids, const SequenceKv& kv,
                                      size_t per_token, bool die_after_plan = false,
                                      v1::NcclPutPlan* plan_out = nullptr) {
    v1::NcclPutRequest req;
    req.set_channel_id(channel_id_);
    req.set_namespace_("main");
    req.mutable_token_ids()->Add(ids.begin(), ids.end());
    grpc::ClientContext ctx;
    auto reader = stub_->NcclPut(&ctx, req);
    v1::NcclPutResponse msg;
    if (!reader->Read(&msg)) return FromGrpc(reader->Finish());
    const v1::NcclPutPlan plan = msg.plan();
    if (plan_out != nullptr) *plan_out = plan;
    if (die_after_plan) {
      end_->Abort();
    } else if (plan.num_tokens() > 0) {
      std::vector<SendSegment> segments;
      for (uint32_t l = 0; l < plan.num_layers(); ++l) {
        segments.push_back({kv.k[l].data() + plan.token_begin() * per_token, plan.layer_bytes()});
        segments.push_back({kv.v[l].data() + plan.token_begin() * per_token, plan.layer_bytes()});
      }
      if (absl::Status s = end_->Send(segments, absl::InfiniteFuture()); !s.ok()) return s;
    }
    const bool got_result = reader->Read(&msg) && msg.has_result();
    if (absl::Status s = FromGrpc(reader->Finish()); !s.ok()) return s;
    EXPECT_TRUE(got_result);
    return msg.result();
  }

  uint64_t channel_id() const { return channel_id_; }
  PeerTransport& end() { return *end_; }

 private:
  v1::KvPoolTransport::Stub* const stub_;
  FakePeerNetwork* const network_;
  uint64_t channel_id_ = 0;
  std::unique_ptr<PeerTransport> end_;
};

class TransportProtocolTest : public StoreTest {
 protected:
  void StartService(TransportOptions options = {}) {
    service_ = std::make_unique<KvPoolTransportService>(store_.get(), backend_.get(), &network_,
                                                        &clock_, &rpc_metrics_, options);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::KvPoolTransport::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // A cached sequence of `tokens` tokens and a lease on it.
  uint64_t PutAndMatch(int tokens, uint64_t seed, SequenceKv* kv_out = nullptr) {
    const std::vector<int32_t> ids = TokenIds(tokens, 5);
    SequenceKv kv = MakeSequenceKv(config_, tokens, seed);
    auto put = Put(ids, kv);
    EXPECT_TRUE(put.ok()) << put.status();
    auto match = store_->Match("main", ids, absl::ZeroDuration());
    EXPECT_TRUE(match.ok()) << match.status();
    if (kv_out != nullptr) *kv_out = kv;
    return match->lease_id;
  }

  uint64_t BlocksInUse() const { return store_->Stats().namespaces[0].blocks_in_use; }

  // Whether every staging buffer is freed within 2 s (a thread of the transfers frees them).
  bool StagingFreed() const {
    for (int i = 0; i < 200 && service_->transfers().staging_buffers() > 0; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return service_->transfers().staging_buffers() == 0;
  }

  // Whether the registry counts `calls` calls of `method` that ended with `code`.
  bool Counted(const std::string& method, const std::string& code, int calls) const {
    return registry_.Serialize().find(absl::StrCat("kvpool_rpc_duration_seconds_count{method=\"",
                                                   method, "\",code=\"", code, "\"} ", calls,
                                                   "\n")) != std::string::npos;
  }

  FakePeerNetwork network_{&clock_};
  metrics::Registry registry_;
  RpcMetrics rpc_metrics_{&registry_};
  std::unique_ptr<KvPoolTransportService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvPoolTransport::Stub> stub_;
};

TEST_F(TransportProtocolTest, OpensAndClosesChannels) {
  MakeStore(16);
  StartService();
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  EXPECT_EQ(service_->channels().size(), 1u);
  ASSERT_TRUE(w.Close().ok());
  EXPECT_EQ(service_->channels().size(), 0u);
  EXPECT_EQ(w.Close().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Counted("CloseChannel", "OK", 1));
  EXPECT_TRUE(Counted("CloseChannel", "NOT_FOUND", 1));
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  v1::NcclGetRequest req;
  req.set_lease_id(PutAndMatch(8, 1));
  EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kUnavailable);
}

TEST_F(TransportProtocolTest, IdleChannelExpires) {
  MakeStore(16);
  TransportOptions o;
  o.channels.idle_timeout = absl::Minutes(1);
  StartService(o);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  clock_.Advance(o.channels.default_join_timeout + absl::Minutes(1));
  EXPECT_EQ(service_->channels().ExpireIdle(), 1u);
  EXPECT_EQ(w.Close().code(), absl::StatusCode::kNotFound);
}

// Every layer's K and V segments equal ReadRaw's bytes; run with rounds of one layer (a tiny
// staging buffer) and with one round.
TEST_F(TransportProtocolTest, RawGetIsByteExactWithReadRaw) {
  for (uint64_t staging : {uint64_t{1}, uint64_t{64} << 20}) {
    MakeStore(32);
    TransportOptions o;
    o.staging_bytes = staging;
    StartService(o);
    const uint64_t lease = PutAndMatch(13, 7);  // 3 full blocks
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req;
    req.set_lease_id(lease);
    req.set_format(v1::GET_FORMAT_RAW);
    req.set_head_begin(1);
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    ASSERT_TRUE(w.Get(req, &header, &buf).ok());
    ASSERT_EQ(header.layers_size(), config_.num_layers);
    EXPECT_EQ(header.num_blocks(), 3u);
    EXPECT_EQ(header.num_heads(), 1u);
    for (const v1::NcclLayerSegments& l : header.layers()) {
      std::vector<uint8_t> k(l.bytes()), v(l.bytes());
      ASSERT_TRUE(store_->ReadRaw(lease, l.layer(), 0, 3, 1, 2, k.data(), v.data()).ok());
      EXPECT_EQ(std::memcmp(buf.data() + l.k_offset(), k.data(), k.size()), 0);
      EXPECT_EQ(std::memcmp(buf.data() + l.v_offset(), v.data(), v.size()), 0);
      EXPECT_EQ(l.layout().head_page_bytes(), LayerLayout(config_, l.layer()).head_page_bytes());
    }
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

// As above: rounds of one layer (two staging buffers, each round gathered while the previous
// one is sent) and one round.
TEST_F(TransportProtocolTest, Fp16GetMatchesReadFp16) {
  for (uint64_t staging : {uint64_t{1}, uint64_t{64} << 20}) {
    MakeStore(32);
    TransportOptions o;
    o.staging_bytes = staging;
    StartService(o);
    const uint64_t lease = PutAndMatch(12, 3);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req;
    req.set_lease_id(lease);
    req.set_format(v1::GET_FORMAT_FP16);
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    ASSERT_TRUE(w.Get(req, &header, &buf).ok());
    EXPECT_EQ(header.valid_tokens(), 12u);
    for (const v1::NcclLayerSegments& l : header.layers()) {
      std::vector<uint16_t> k(12 * PerToken()), v(12 * PerToken());
      ASSERT_TRUE(store_->ReadFp16(lease, l.layer(), 0, 3, 0, 2, k.data(), v.data()).ok());
      ASSERT_EQ(l.bytes(), k.size() * 2);
      EXPECT_EQ(std::memcmp(buf.data() + l.k_offset(), k.data(), l.bytes()), 0);
      EXPECT_EQ(std::memcmp(buf.data() + l.v_offset(), v.data(), l.bytes()), 0);
    }
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

TEST_F(TransportProtocolTest, GetRefusesTooSmallBufferWithoutBreakingChannel) {
  MakeStore(32);
  StartService();
  const uint64_t lease = PutAndMatch(8, 4);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  v1::NcclGetRequest req;
  req.set_lease_id(lease);
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  EXPECT_EQ(w.Get(req, &header, &buf, 16).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(w.Get(req, &header, &buf).ok());
  EXPECT_TRUE(Counted("OpenChannel", "OK", 1));
  EXPECT_TRUE(Counted("NcclGet", "RESOURCE_EXHAUSTED", 1));
  EXPECT_TRUE(Counted("NcclGet", "OK", 1));
}

// The CPU backend, with reads into an arena that fail on request.
class FailingGathers final : public ForwardingBackend {
 public:
  absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) override {
    if (fail) return absl::InternalError("read failed");
    return ForwardingBackend::GatherArena(runs, dst);
  }
  bool fail = false;
};

// A Get whose first read fails (the backend's here; in service also a lease released between
// the descriptor and the read) answers its status before the descriptor, so the worker waits for
// nothing and the channel stays usable. Run with one round and with rounds of one layer.
TEST_F(TransportProtocolTest, GetWhoseFirstReadFailsKeepsTheChannel) {
  for (uint64_t staging : {uint64_t{64} << 20, uint64_t{1}}) {
    store_.reset();  // before the backend it uses
    auto backend = std::make_unique<FailingGathers>();
    FailingGathers* failing = backend.get();
    backend_ = std::move(backend);
    MakeStore(32);
    TransportOptions options;
    options.staging_bytes = staging;
    StartService(options);
    const uint64_t lease = PutAndMatch(8, 4);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req;
    req.set_lease_id(lease);
    req.set_format(v1::GET_FORMAT_RAW);
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    failing->fail = true;
    EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kInternal);
    EXPECT_EQ(service_->channels().size(), 1u);
    failing->fail = false;
    const absl::Status again = w.Get(req, &header, &buf);
    EXPECT_TRUE(again.ok()) << again;
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

// The CPU backend, whose arena frees wait while `hold` is set, as a device free waits for a
// kernel of another channel's transfer stalled on its worker.
class HeldFrees final : public ForwardingBackend {
 public:
  void FreeArena(uint8_t* arena) override {
    absl::MutexLock l(&mu);
    mu.Await(absl::Condition(
        +[](bool* held) { return !*held; }, &hold));
    inner().FreeArena(arena);
  }
  absl::Mutex mu;
  bool hold ABSL_GUARDED_BY(mu) = false;
};

// A transfer ends without freeing its staging buffers itself: with staging of 1 byte every buffer
// is one of its own size, freed once the transfer is done, and a free that waits holds up no
// transfer.
TEST_F(TransportProtocolTest, TransfersDoNotWaitForStagingFrees) {
  auto backend = std::make_unique<HeldFrees>();
  HeldFrees* held = backend.get();
  backend_ = std::move(backend);
  MakeStore(32);
  TransportOptions options;
  options.staging_bytes = 1;
  StartService(options);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  {
    absl::MutexLock l(&held->mu);
    held->hold = true;
  }
  const std::vector<int32_t> ids = TokenIds(12, 5);
  const SequenceKv kv = MakeSequenceKv(config_, 12, 8);
  absl::Notification put_done;
  absl::StatusOr<v1::PutResponse> put;
  std::thread worker([&] {
    put = w.Put(ids, kv, PerToken());
    put_done.Notify();
  });
  const bool in_time = put_done.WaitForNotificationWithTimeout(absl::Seconds(20));
  {
    absl::MutexLock l(&held->mu);
    held->hold = false;
  }
  worker.join();
  EXPECT_TRUE(in_time) << "the Put waited for its staging buffers' frees";
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens_stored(), 12u);
  EXPECT_TRUE(Counted("NcclPut", "OK", 1));
  EXPECT_TRUE(StagingFreed());
}

// Staging buffers take at most max_staging_total_bytes together: a transfer past it gets
// RESOURCE_EXHAUSTED before anything moves, and the channel and the pool stay as they were.
TEST_F(TransportProtocolTest, TransfersPastTheStagingTotalAreRefused) {
  MakeStore(32);
  TransportOptions options;
  options.staging_bytes = 1;  // every buffer one of its own size, past the total
  options.max_staging_total_bytes = 1;
  StartService(options);
  const uint64_t lease = PutAndMatch(8, 4);
  const uint64_t in_use = BlocksInUse();
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  v1::NcclGetRequest req;
  req.set_lease_id(lease);
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kResourceExhausted);
  const std::vector<int32_t> ids = TokenIds(12, 900);
  EXPECT_EQ(w.Put(ids, MakeSequenceKv(config_, 12, 5), PerToken()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(service_->channels().size(), 1u);
  EXPECT_EQ(BlocksInUse(), in_use);
  EXPECT_EQ(service_->transfers().staging_buffers(), 0u);
}

// The pages an NcclPut stores equal those of the gRPC path's Put (PutSession::AddChunk).
// Run with rounds of one layer (each received while the previous one is quantized) and one round.
TEST_F(TransportProtocolTest, PutStoresWhatTheGrpcPathStores) {
  for (uint64_t staging : {uint64_t{1}, uint64_t{64} << 20}) {
    MakeStore(32);
    TransportOptions options;
    options.staging_bytes = staging;
    StartService(options);
    const int tokens = 14;
    const std::vector<int32_t> ids = TokenIds(tokens, 100);
    const SequenceKv kv = MakeSequenceKv(config_, tokens, 21);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    auto result = w.Put(ids, kv, PerToken());
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->tokens_stored(), 12u);
    EXPECT_EQ(result->tokens_ignored(), 2u);

    auto nccl_lease = store_->Match("main", ids, absl::ZeroDuration());
    ASSERT_TRUE(nccl_lease.ok());
    ASSERT_EQ(nccl_lease->cached_tokens, 12u);
    // The same sequence through the gRPC path's store API, in a second store.
    std::unique_ptr<ComputeBackend> other_backend = NewCpuBackend();
    KvStore::Options o;
    o.pool_bytes = BytesPerBlock(config_) * 32;
    o.backend = other_backend.get();
    o.clock = &clock_;
    auto other = KvStore::Create(o);
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE((*other)->CreateNamespace(config_).ok());
    auto session = (*other)->BeginPut("main", ids);
    ASSERT_TRUE(session.ok());
    for (int l = 0; l < config_.num_layers; ++l) {
      ASSERT_TRUE((*session)->AddChunk(l, 0, tokens, kv.k[l].data(), kv.v[l].data()).ok());
    }
    ASSERT_TRUE((*session)->Commit().ok());
    auto grpc_lease = (*other)->Match("main", ids, absl::ZeroDuration());
    ASSERT_TRUE(grpc_lease.ok());
    for (int l = 0; l < config_.num_layers; ++l) {
      const size_t run = config_.num_kv_heads * LayerLayout(config_, l).head_page_bytes() * 3;
      std::vector<uint8_t> k1(run), v1(run), k2(run), v2(run);
      ASSERT_TRUE(store_->ReadRaw(nccl_lease->lease_id, l, 0, 3, 0, 2, k1.data(), v1.data()).ok());
      ASSERT_TRUE(
          (*other)->ReadRaw(grpc_lease->lease_id, l, 0, 3, 0, 2, k2.data(), v2.data()).ok());
      EXPECT_EQ(k1, k2);
      EXPECT_EQ(v1, v2);
    }
    // A second put of the same prefix moves nothing.
    v1::NcclPutPlan plan;
    auto again = w.Put(ids, kv, PerToken(), false, &plan);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(plan.num_tokens(), 0u);
    EXPECT_EQ(again->tokens_cached(), 12u);
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

TEST_F(TransportProtocolTest, PutWithNanStoresNothingAndKeepsChannel) {
  MakeStore(32);
  StartService();
  const std::vector<int32_t> ids = TokenIds(8, 1);
  SequenceKv kv = MakeSequenceKv(config_, 8, 5);
  kv.k[1][37] = 0x7e00;  // NaN
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  EXPECT_EQ(w.Put(ids, kv, PerToken()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlocksInUse(), 0u);
  auto match = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok());
  EXPECT_EQ(match->cached_tokens, 0u);
  EXPECT_EQ(service_->channels().size(), 1u);
  kv.k[1][37] = 0x3c00;
  EXPECT_TRUE(w.Put(ids, kv, PerToken()).ok());
}

// A worker that dies after the plan: the server's receive fails at once, the channel is aborted
// and forgotten, and the put's blocks are freed.
TEST_F(TransportProtocolTest, DeadWorkerMidPutFailsCleanly) {
  MakeStore(32);
  StartService();
  const std::vector<int32_t> ids = TokenIds(16, 2);
  const SequenceKv kv = MakeSequenceKv(config_, 16, 8);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  auto result = w.Put(ids, kv, PerToken(), /*die_after_plan=*/true);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  EXPECT_EQ(service_->channels().size(), 0u);
  EXPECT_EQ(BlocksInUse(), 0u);
  EXPECT_EQ(store_->Stats().namespaces[0].blocks_free, 32u);
  EXPECT_EQ(store_->Stats().active_leases, 0u);
}

// A transfer slower than its deadline aborts the channel; the lease and staging survive intact.
// With rounds of one layer the send in flight fails while the next round is being gathered.
TEST_F(TransportProtocolTest, TimeoutAbortsChannel) {
  for (uint64_t staging : {uint64_t{1}, uint64_t{64} << 20}) {
    MakeStore(32);
    TransportOptions o;
    o.max_idle_staging = 0;
    o.staging_bytes = staging;
    StartService(o);
    const uint64_t lease = PutAndMatch(8, 9);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    network_.set_op_latency(absl::Seconds(2));
    v1::NcclGetRequest req;
    req.set_lease_id(lease);
    req.set_timeout_ms(1000);
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(service_->channels().size(), 0u);
    EXPECT_TRUE(StagingFreed());
    network_.set_op_latency(absl::ZeroDuration());
    ASSERT_TRUE(store_->Release(lease).ok());
    EXPECT_EQ(store_->Stats().active_leases, 0u);
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

TEST_F(TransportProtocolTest, SecondTransferOnBusyChannelIsRefused) {
  MakeStore(32);
  StartService();
  const uint64_t lease = PutAndMatch(8, 10);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  // A put whose plan was received but whose data was not sent yet holds the channel.
  v1::NcclPutRequest put;
  put.set_channel_id(w.channel_id());
  put.set_namespace_("main");
  const std::vector<int32_t> ids = TokenIds(8, 500);
  put.mutable_token_ids()->Add(ids.begin(), ids.end());
  grpc::ClientContext ctx;
  auto reader = stub_->NcclPut(&ctx, put);
  v1::NcclPutResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  v1::NcclGetRequest req;
  req.set_lease_id(lease);
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kAborted);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 11);
  std::vector<SendSegment> segments;
  for (int l = 0; l < config_.num_layers; ++l) {
    segments.push_back({kv.k[l].data(), msg.plan().layer_bytes()});
    segments.push_back({kv.v[l].data(), msg.plan().layer_bytes()});
  }
  ASSERT_TRUE(w.end().Send(segments, absl::InfiniteFuture()).ok());
  ASSERT_TRUE(reader->Read(&msg));
  EXPECT_EQ(msg.result().tokens_stored(), 8u);
  EXPECT_TRUE(reader->Finish().ok());
}

// Workers on their own channels transfer at the same time; every one gets exact bytes.
TEST_F(TransportProtocolTest, ConcurrentWorkersGetExactBytes) {
  MakeStore(64);
  StartService();
  const uint64_t lease = PutAndMatch(16, 12);
  std::vector<uint8_t> expect_k(2 * LayerLayout(config_, 0).head_page_bytes() * 4);
  std::vector<uint8_t> expect_v(expect_k.size());
  ASSERT_TRUE(store_->ReadRaw(lease, 0, 0, 4, 0, 2, expect_k.data(), expect_v.data()).ok());
  constexpr int kWorkers = 4;
  std::vector<std::thread> threads;
  std::vector<int> ok(kWorkers, 0);
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      TestWorker w(stub_.get(), &network_);
      if (!w.Open().ok()) return;
      for (int round = 0; round < 5; ++round) {
        v1::NcclGetRequest req;
        req.set_lease_id(lease);
        req.set_format(v1::GET_FORMAT_RAW);
        req.set_layer_end(1);
        v1::NcclGetDescriptor header;
        std::vector<uint8_t> buf;
        if (!w.Get(req, &header, &buf).ok()) return;
        const v1::NcclLayerSegments& l = header.layers(0);
        if (std::memcmp(buf.data() + l.k_offset(), expect_k.data(), expect_k.size()) != 0 ||
            std::memcmp(buf.data() + l.v_offset(), expect_v.data(), expect_v.size()) != 0) {
          return;
        }
      }
      ok[i] = 1;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kWorkers; ++i) EXPECT_EQ(ok[i], 1) << "worker " << i;
  EXPECT_EQ(service_->channels().size(), static_cast<size_t>(kWorkers));
}

}  // namespace
}  // namespace kvpool::testing
