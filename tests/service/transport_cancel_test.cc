// A worker's call cancelled late in a transfer, driven on NcclTransfers directly (the fake
// transport): the channel is kept when its transport still works, and forgotten when the cancel
// aborted it, never kept idle with a dead transport.
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/transport/channel_manager.h"
#include "service/transport/fake_peer_transport.h"
#include "service/transport/nccl_transfers.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

// The CPU backend, running `after_quantize` after each quantize of received data.
class HookBackend final : public ForwardingBackend {
 public:
  std::function<void()> after_quantize;
  absl::Status QuantizeAppendFromArena(absl::Span<const QuantizeAppendParams> ps) override {
    absl::Status s = ForwardingBackend::QuantizeAppendFromArena(ps);
    if (after_quantize) after_quantize();
    return s;
  }
};

class TransportCancelTest : public StoreTest {
 protected:
  void SetUp() override {
    auto backend = std::make_unique<HookBackend>();
    hook_ = backend.get();
    backend_ = std::move(backend);
    MakeStore(16);
    channels_ = std::make_unique<ChannelManager>(&network_, &clock_, ChannelOptions{});
    transfers_ = std::make_unique<NcclTransfers>(store_.get(), backend_.get(), channels_.get(),
                                                 &clock_, TransportOptions{});
    absl::StatusOr<ChannelManager::Opened> opened = channels_->Open(absl::ZeroDuration());
    ASSERT_TRUE(opened.ok()) << opened.status();
    channel_ = opened->channel_id;
    absl::StatusOr<std::unique_ptr<PeerTransport>> worker = network_.Join(opened->join_id);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = *std::move(worker);
  }

  HookBackend* hook_ = nullptr;
  FakePeerNetwork network_{&clock_};
  std::unique_ptr<ChannelManager> channels_;
  std::unique_ptr<NcclTransfers> transfers_;
  uint64_t channel_ = 0;
  std::unique_ptr<PeerTransport> worker_;
};

// Cancelled while `done` is written, after every byte moved: the transport was not aborted, and
// the channel serves the next transfer.
TEST_F(TransportCancelTest, GetCancelledAfterItsDataKeepsAWorkingChannel) {
  const std::vector<int32_t> ids = TokenIds(8, 5);
  ASSERT_TRUE(Put(ids, MakeSequenceKv(config_, 8, 1)).ok());
  absl::StatusOr<KvStore::MatchResult> match = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(match.ok()) << match.status();
  v1::NcclGetRequest request;
  request.set_channel_id(channel_);
  request.set_lease_id(match->lease_id);
  request.set_buffer_bytes(1 << 30);
  TransferCancel cancel;
  const absl::Status s = transfers_->Get(
      request,
      [&](const v1::NcclGetResponse& r) -> absl::Status {
        if (r.has_header()) return absl::OkStatus();
        cancel.Cancel();  // the worker's call is gone: gRPC's OnCancel, then the write fails
        return absl::CancelledError("the worker's stream is gone");
      },
      &cancel);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(channels_->size(), 1u);
  absl::StatusOr<ChannelManager::Use> use = channels_->Acquire(channel_);
  ASSERT_TRUE(use.ok()) << use.status();
  std::vector<uint8_t> one(1);
  EXPECT_TRUE(use->transport().Send({SendSegment{one.data(), 1}}, absl::InfiniteFuture()).ok())
      << "the channel kept has an aborted transport";
}

// Cancelled after its bytes arrived, while they are stored: the put commits, and the channel,
// whose transport the cancel aborted, is forgotten.
TEST_F(TransportCancelTest, PutCancelledAfterItsDataForgetsTheAbortedChannel) {
  const std::vector<int32_t> ids = TokenIds(8, 5);
  const SequenceKv kv = MakeSequenceKv(config_, 8, 1);
  v1::NcclPutRequest request;
  request.set_channel_id(channel_);
  request.set_namespace_("main");
  request.mutable_token_ids()->Add(ids.begin(), ids.end());
  TransferCancel cancel;
  hook_->after_quantize = [&] { cancel.Cancel(); };
  bool committed = false;
  const absl::Status s = transfers_->Put(
      request,
      [&](const v1::NcclPutResponse& r) -> absl::Status {
        if (!r.has_plan()) {
          committed = true;
          return absl::OkStatus();
        }
        std::vector<SendSegment> segments;
        const size_t pt = PerToken();
        for (uint32_t l = 0; l < r.plan().num_layers(); ++l) {
          segments.push_back(
              {kv.k[l].data() + r.plan().token_begin() * pt, r.plan().layer_bytes()});
          segments.push_back(
              {kv.v[l].data() + r.plan().token_begin() * pt, r.plan().layer_bytes()});
        }
        return worker_->Send(segments, absl::InfiniteFuture());
      },
      &cancel);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(committed);
  EXPECT_EQ(channels_->size(), 0u) << "a channel with an aborted transport is kept";
  EXPECT_EQ(channels_->Acquire(channel_).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvpool::testing
