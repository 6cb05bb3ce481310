// TransferClient's two paths leave the caller's buffer in the same layout: checked against a real
// store served over KvPool and KvPoolTransport, the NCCL payload on the fake transport (CPU, no
// NCCL needed).
#include "client/transfer_client.h"

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/transport_test_util.h"

namespace kvpool::client {
namespace {

// An NcclChannel whose Get is a test worker's NcclGet over the fake transport, copied into the
// caller's (host) buffer.
class FakeTransportChannel final : public NcclChannel {
 public:
  explicit FakeTransportChannel(testing::TestWorker* worker) : worker_(worker) {}

  bool healthy() const override { return true; }
  uint64_t channel_id() const override { return worker_->channel_id(); }
  void SetCloseDeadline(absl::Time) override {}
  absl::StatusOr<v1::NcclGetDescriptor> Get(v1::NcclGetRequest request, void* dst,
                                            uint64_t capacity, absl::Duration) override {
    request.set_sink_rows(true);  // as NcclChannel's Get
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> payload;
    if (absl::Status s = worker_->Get(request, &header, &payload, capacity); !s.ok()) return s;
    std::memcpy(dst, payload.data(), payload.size());
    return header;
  }
  absl::StatusOr<v1::PutResponse> Put(std::string_view, absl::Span<const int32_t>, uint32_t,
                                      const void*, const void*, uint64_t, absl::Duration) override {
    return absl::UnimplementedError("not used");
  }

 private:
  testing::TestWorker* const worker_;
};

// TransferClient over a store that keeps 3 sink tokens: the same Get over NCCL and over gRPC fills
// the buffer with the same bytes and lists the same layers.
class TransferClientPathsTest : public testing::TransportProtocolTest {
 protected:
  void SetUp() override {
    MakeStore(32, /*sink_tokens=*/3);
    StartService();
    pool_ = KvPoolClient::Create(server_->InProcessChannel(grpc::ChannelArguments()));
    worker_ = std::make_unique<testing::TestWorker>(stub_.get(), &network_);
    ASSERT_TRUE(worker_->Open().ok());
    over_nccl_ = std::make_unique<TransferClient>(
        pool_.get(), HostBufferCopy(), std::make_unique<FakeTransportChannel>(worker_.get()));
    over_grpc_ = std::make_unique<TransferClient>(pool_.get(), HostBufferCopy());
  }

  // Runs `request` over both paths and expects the same result and bytes; the gRPC path's
  // result and buffer come back.
  void ExpectSameGets(const v1::GetRequest& request, TransferGetResult* result,
                      std::string* buffer) {
    std::string nccl_buffer(1 << 20, '\x5a');
    *buffer = nccl_buffer;
    absl::StatusOr<TransferGetResult> nccl =
        over_nccl_->Get(request, nccl_buffer.data(), nccl_buffer.size(), absl::Seconds(10));
    absl::StatusOr<TransferGetResult> grpc =
        over_grpc_->Get(request, buffer->data(), buffer->size(), absl::Seconds(10));
    ASSERT_TRUE(nccl.ok()) << nccl.status();
    ASSERT_TRUE(grpc.ok()) << grpc.status();
    EXPECT_EQ(nccl->path, TransferPath::kNccl);
    EXPECT_EQ(grpc->path, TransferPath::kGrpc);
    EXPECT_EQ(nccl->num_blocks, grpc->num_blocks);
    EXPECT_EQ(nccl->valid_tokens, grpc->valid_tokens);
    ASSERT_EQ(nccl->total_bytes, grpc->total_bytes);
    EXPECT_EQ(nccl_buffer, *buffer);
    ASSERT_EQ(nccl->layers.size(), grpc->layers.size());
    for (size_t i = 0; i < nccl->layers.size(); ++i) {
      EXPECT_EQ(nccl->layers[i].SerializeAsString(), grpc->layers[i].SerializeAsString())
          << "layer " << i;
    }
    *result = *std::move(grpc);
  }

  std::unique_ptr<KvPoolClient> pool_;
  std::unique_ptr<testing::TestWorker> worker_;
  std::unique_ptr<TransferClient> over_nccl_, over_grpc_;
};

// In RAW each layer's sink rows follow its V, the selected head's fp16 rows that were Put, exact.
TEST_F(TransferClientPathsTest, NcclAndGrpcGetsGiveTheSameBytesSinkRowsIncluded) {
  testing::SequenceKv kv;
  const uint64_t lease = PutAndMatch(13, 6, &kv);  // 3 full blocks
  const size_t dim = config_.head_dim, heads = config_.num_kv_heads;
  for (const v1::GetFormat format : {v1::GET_FORMAT_RAW, v1::GET_FORMAT_FP16}) {
    v1::GetRequest request;
    request.set_lease_id(lease);
    request.set_layer_begin(1);
    request.set_head_begin(1);
    request.set_format(format);
    TransferGetResult grpc;
    std::string grpc_buffer;
    ASSERT_NO_FATAL_FAILURE(ExpectSameGets(request, &grpc, &grpc_buffer));
    ASSERT_EQ(grpc.layers.size(), 1u);
    const v1::NcclLayerSegments& l = grpc.layers[0];
    if (format == v1::GET_FORMAT_FP16) {
      EXPECT_EQ(l.sink_bytes(), 0u);
      continue;
    }
    ASSERT_EQ(l.sink_bytes(), 3 * dim * sizeof(uint16_t));
    EXPECT_EQ(l.sink_k_offset(), l.v_offset() + l.bytes());
    EXPECT_EQ(l.sink_v_offset(), l.sink_k_offset() + l.sink_bytes());
    EXPECT_EQ(grpc.total_bytes, l.sink_v_offset() + l.sink_bytes());
    for (size_t t = 0; t < 3; ++t) {
      const size_t put = (t * heads + 1) * dim;  // token t, head 1 of [tokens][heads][dim]
      EXPECT_EQ(std::memcmp(grpc_buffer.data() + l.sink_k_offset() + t * dim * 2,
                            kv.k[1].data() + put, dim * 2),
                0)
          << "K token " << t;
      EXPECT_EQ(std::memcmp(grpc_buffer.data() + l.sink_v_offset() + t * dim * 2,
                            kv.v[1].data() + put, dim * 2),
                0)
          << "V token " << t;
    }
  }
}

// Layers holding different token counts (one layer's appends ahead of the other's): both paths
// lay every layer over the lease's blocks, a layer holding none included (before, the gRPC path
// gave each layer its own blocks and left out a layer holding none).
TEST_F(TransferClientPathsTest, LayersOfDifferentLengthsSpanTheLeasesBlocksOnBothPaths) {
  const uint64_t matched = PutAndMatch(13, 6);  // 3 full blocks on both layers
  auto empty = store_->Match("main", testing::TokenIds(8, 77), absl::ZeroDuration());
  ASSERT_TRUE(empty.ok()) << empty.status();
  ASSERT_EQ(empty->cached_tokens, 0u);
  // lease, layer appended to, tokens: layer 0 holds 18 tokens (5 blocks) and layer 1 12; layer 1
  // holds 3 tokens (1 block) and layer 0 none.
  for (const auto& [lease, layer, tokens] :
       {std::tuple{matched, 0u, 6u}, std::tuple{empty->lease_id, 1u, 3u}}) {
    const testing::SequenceKv kv = testing::MakeSequenceKv(config_, static_cast<int>(tokens), 9);
    ASSERT_TRUE(
        store_->Append(lease, layer, {}, tokens, kv.k[layer].data(), kv.v[layer].data()).ok());
    for (const v1::GetFormat format : {v1::GET_FORMAT_RAW, v1::GET_FORMAT_FP16}) {
      v1::GetRequest request;
      request.set_lease_id(lease);
      request.set_format(format);
      TransferGetResult grpc;
      std::string buffer;
      ASSERT_NO_FATAL_FAILURE(ExpectSameGets(request, &grpc, &buffer));
      EXPECT_EQ(grpc.num_blocks, lease == matched ? 5u : 1u);
      EXPECT_EQ(grpc.valid_tokens, lease == matched ? 12u : 0u);
      EXPECT_EQ(grpc.layers.size(), 2u);
    }
  }
}

}  // namespace
}  // namespace kvpool::client
