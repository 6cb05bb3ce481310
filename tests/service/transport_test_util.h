// The NCCL data plane's tests over in-process gRPC with the transport faked on the CPU
// (transport_protocol_test, transport_staging_test): a test worker that drives the RPCs and its
// fake transport end exactly as a real worker drives ncclRecv/ncclSend, and a fixture that serves
// KvPoolTransport (and KvPool, for the gRPC path) over a store.
#ifndef KVPOOL_TESTS_SERVICE_TRANSPORT_TEST_UTIL_H_
#define KVPOOL_TESTS_SERVICE_TRANSPORT_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/kvpool_service.h"
#include "service/metrics/metrics_registry.h"
#include "service/rpc_metrics.h"
#include "service/transport/channel_manager.h"
#include "service/transport/fake_peer_transport.h"
#include "service/transport/transport_service.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {

inline absl::Status FromGrpc(const grpc::Status& s) {
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
      if (l.sink_bytes() > 0) {
        segments.push_back({buffer->data() + l.sink_k_offset(), l.sink_bytes()});
        segments.push_back({buffer->data() + l.sink_v_offset(), l.sink_bytes()});
      }
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

// An NcclGet of every layer and head of `lease` in `format`, from a worker that takes sink
// segments (as NcclChannel).
inline v1::NcclGetRequest NcclGetOf(uint64_t lease,
                                    v1::GetFormat format = v1::GET_FORMAT_UNSPECIFIED) {
  v1::NcclGetRequest req;
  req.set_lease_id(lease);
  req.set_format(format);
  req.set_sink_rows(true);
  return req;
}

class TransportProtocolTest : public StoreTest {
 protected:
  void StartService(TransportOptions options = {}) {
    service_ = std::make_unique<KvPoolTransportService>(store_.get(), backend_.get(), &network_,
                                                        &clock_, &rpc_metrics_, options);
    kv_service_ =
        std::make_unique<KvPoolService>(store_.get(), &rpc_metrics_, ServiceOptions{}, &clock_);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    builder.RegisterService(kv_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::KvPoolTransport::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  // StartService with staging buffers of `staging` bytes (1: every buffer one of its own size,
  // a round per layer).
  void StartWithStaging(uint64_t staging) {
    TransportOptions options;
    options.staging_bytes = staging;
    StartService(options);
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
  std::unique_ptr<KvPoolService> kv_service_;  // KvPool's unary and streaming calls (not Attend)
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvPoolTransport::Stub> stub_;
};

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_SERVICE_TRANSPORT_TEST_UTIL_H_
