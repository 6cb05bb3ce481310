// The NCCL data plane's protocol (KvPoolTransport) end to end over in-process gRPC, with the
// transport faked on the CPU: a test worker drives the RPCs and the fake worker end exactly as a
// real worker drives ncclRecv/ncclSend.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/proto_convert.h"
#include "tests/service/transport_test_util.h"

namespace kvpool::testing {
namespace {

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
  v1::NcclGetRequest req = NcclGetOf(PutAndMatch(8, 1));
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
    StartWithStaging(staging);
    const uint64_t lease = PutAndMatch(13, 7);  // 3 full blocks
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req = NcclGetOf(lease, v1::GET_FORMAT_RAW);
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

// RAW from a namespace with sink tokens: each layer's K and V pages (as ReadRaw reads them) are
// followed by two segments of its first block's sink rows, the selected heads' fp16 rows that were
// Put, exact, [heads][sink_tokens][head_dim]. Layers [0, 2) and [1, 2) of KV head 1; rounds of
// one layer and one round.
TEST_F(TransportProtocolTest, RawGetSendsEachLayersExactSinkRowsAfterItsPages) {
  for (uint64_t staging : {uint64_t{1}, uint64_t{64} << 20}) {
    MakeStore(32, /*sink_tokens=*/3);
    StartWithStaging(staging);
    SequenceKv kv;
    const uint64_t lease = PutAndMatch(13, 8, &kv);  // 3 full blocks
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    const size_t dim = config_.head_dim, heads = config_.num_kv_heads;
    for (uint32_t layer_begin : {0u, 1u}) {
      v1::NcclGetRequest req = NcclGetOf(lease, v1::GET_FORMAT_RAW);
      req.set_layer_begin(layer_begin);
      req.set_layer_end(2);
      req.set_head_begin(1);
      req.set_head_end(2);
      v1::NcclGetDescriptor header;
      std::vector<uint8_t> buf;
      ASSERT_TRUE(w.Get(req, &header, &buf).ok());
      ASSERT_EQ(header.layers_size(), static_cast<int>(2 - layer_begin));
      uint64_t offset = 0;
      for (const v1::NcclLayerSegments& l : header.layers()) {
        EXPECT_EQ(l.layout().sink_tokens(), 3u);
        ASSERT_EQ(l.sink_bytes(), 3 * dim * sizeof(uint16_t));
        EXPECT_EQ(l.k_offset(), offset);
        EXPECT_EQ(l.v_offset(), offset + l.bytes());
        EXPECT_EQ(l.sink_k_offset(), offset + 2 * l.bytes());
        EXPECT_EQ(l.sink_v_offset(), l.sink_k_offset() + l.sink_bytes());
        offset += 2 * (l.bytes() + l.sink_bytes());
        std::vector<uint8_t> k(l.bytes()), v(l.bytes());
        ASSERT_TRUE(store_->ReadRaw(lease, l.layer(), 0, 3, 1, 2, k.data(), v.data()).ok());
        EXPECT_EQ(std::memcmp(buf.data() + l.k_offset(), k.data(), k.size()), 0);
        EXPECT_EQ(std::memcmp(buf.data() + l.v_offset(), v.data(), v.size()), 0);
        for (size_t t = 0; t < 3; ++t) {
          const size_t put = (t * heads + 1) * dim;  // token t, head 1 of [tokens][heads][dim]
          EXPECT_EQ(std::memcmp(buf.data() + l.sink_k_offset() + t * dim * 2,
                                kv.k[l.layer()].data() + put, dim * 2),
                    0)
              << "layer " << l.layer() << " K token " << t;
          EXPECT_EQ(std::memcmp(buf.data() + l.sink_v_offset() + t * dim * 2,
                                kv.v[l.layer()].data() + put, dim * 2),
                    0)
              << "layer " << l.layer() << " V token " << t;
        }
      }
      EXPECT_EQ(header.total_bytes(), offset);
    }
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

// Without sink rows to send the layout is as it always was, K and V per layer back to back and no
// sink segment: RAW from a namespace without sinks, FP16 from one with them (an fp16 read has its
// sink tokens exact in its rows), and RAW with sinks to a worker that does not ask for them.
TEST_F(TransportProtocolTest, GetsWithoutSinkRowsListNoSinkSegments) {
  struct Case {
    int sink_tokens;
    v1::GetFormat format;
    bool sink_rows;  // false: a worker built before sink segments existed
  };
  for (const Case c : {Case{0, v1::GET_FORMAT_RAW, true}, Case{3, v1::GET_FORMAT_FP16, true},
                       Case{3, v1::GET_FORMAT_RAW, false}}) {
    MakeStore(32, c.sink_tokens);
    StartService();
    const uint64_t lease = PutAndMatch(13, 7);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req = NcclGetOf(lease, c.format);
    req.set_sink_rows(c.sink_rows);
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    ASSERT_TRUE(w.Get(req, &header, &buf).ok());
    ASSERT_EQ(header.layers_size(), config_.num_layers);
    uint64_t offset = 0;
    for (const v1::NcclLayerSegments& l : header.layers()) {
      EXPECT_EQ(l.k_offset(), offset);
      EXPECT_EQ(l.v_offset(), offset + l.bytes());
      EXPECT_EQ(l.sink_k_offset(), 0u);
      EXPECT_EQ(l.sink_v_offset(), 0u);
      EXPECT_EQ(l.sink_bytes(), 0u);
      offset += 2 * l.bytes();
    }
    EXPECT_EQ(header.total_bytes(), offset);
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
    StartWithStaging(staging);
    const uint64_t lease = PutAndMatch(12, 3);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req = NcclGetOf(lease, v1::GET_FORMAT_FP16);
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
  v1::NcclGetRequest req = NcclGetOf(lease);
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  EXPECT_EQ(w.Get(req, &header, &buf, 16).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(w.Get(req, &header, &buf).ok());
  EXPECT_TRUE(Counted("OpenChannel", "OK", 1));
  EXPECT_TRUE(Counted("NcclGet", "RESOURCE_EXHAUSTED", 1));
  EXPECT_TRUE(Counted("NcclGet", "OK", 1));
}

// A lease holding no block (a Match that hit nothing) gets what a Get of it gets: nothing, and OK,
// with no data moved and the channel as it was.
TEST_F(TransportProtocolTest, GetOfALeaseWithoutBlocksSendsNoLayerAndSucceeds) {
  MakeStore(32);
  StartService();
  auto empty = store_->Match("main", TokenIds(8, 77), absl::Milliseconds(1000));
  ASSERT_TRUE(empty.ok()) << empty.status();
  ASSERT_EQ(empty->num_blocks, 0u);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  // Each Get renews the lease (1 s TTL), as the gRPC Get that reads nothing does: 2 s pass.
  for (const v1::GetFormat format : {v1::GET_FORMAT_RAW, v1::GET_FORMAT_FP16}) {
    clock_.Advance(absl::Milliseconds(999));
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    const absl::Status s = w.Get(NcclGetOf(empty->lease_id, format), &header, &buf);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(header.num_blocks(), 0u);
    EXPECT_EQ(header.total_bytes(), 0u);
    EXPECT_EQ(header.layers_size(), 0);
  }
  const uint64_t lease = PutAndMatch(8, 4);  // the channel still carries data
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  EXPECT_TRUE(w.Get(NcclGetOf(lease), &header, &buf).ok());
  EXPECT_TRUE(Counted("NcclGet", "OK", 3));
}

// The pages an NcclPut stores equal those of the gRPC path's Put (PutSession::AddChunk).
// Run with rounds of one layer (each received while the previous one is quantized) and one round.
TEST_F(TransportProtocolTest, PutStoresWhatTheGrpcPathStores) {
  for (uint64_t staging : {uint64_t{1}, uint64_t{64} << 20}) {
    MakeStore(32);
    StartWithStaging(staging);
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

// A transfer slower than its deadline aborts the channel; the lease and staging survive intact,
// with rounds of one layer and with one round (the fake's first queued send passes the deadline).
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
    v1::NcclGetRequest req = NcclGetOf(lease);
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
  v1::NcclGetRequest req = NcclGetOf(lease);
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
        v1::NcclGetRequest req = NcclGetOf(lease, v1::GET_FORMAT_RAW);
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
