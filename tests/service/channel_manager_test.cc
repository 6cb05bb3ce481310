// ChannelManager (service/transport/channel_manager.h) over the CPU fake of the NCCL transport:
// opens under way count against the channel limit, and a failed transfer forgets its channel at
// once but keeps its transport until the transfer ends.
#include "service/transport/channel_manager.h"

#include <atomic>
#include <memory>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/store/clock.h"
#include "service/transport/fake_peer_transport.h"
#include "service/transport/peer_transport.h"

namespace kvpool::testing {
namespace {

// The fake network, except that the first Open waits until released.
class FirstOpenWaits final : public PeerTransportFactory {
 public:
  explicit FirstOpenWaits(FakePeerNetwork* inner) : inner_(inner) {}
  absl::StatusOr<OpenedTransport> Open(absl::Time join_deadline) override {
    if (!first_.exchange(false)) return inner_->Open(join_deadline);
    entered_.Notify();
    release_.WaitForNotification();
    return inner_->Open(join_deadline);
  }
  absl::Notification entered_, release_;

 private:
  FakePeerNetwork* const inner_;
  std::atomic<bool> first_{true};
};

// Opens still under way count against max_channels: the factory runs outside the manager's lock,
// and a second open racing the first used to pass the check too.
TEST(ChannelManager, OpensUnderWayCountAgainstTheLimit) {
  FakeClock clock;
  FakePeerNetwork network(&clock);
  FirstOpenWaits factory(&network);
  ChannelOptions options;
  options.max_channels = 1;
  ChannelManager manager(&factory, &clock, options);
  absl::StatusOr<ChannelManager::Opened> first;
  std::thread opener([&] { first = manager.Open(absl::Seconds(1)); });
  factory.entered_.WaitForNotification();
  EXPECT_EQ(manager.Open(absl::Seconds(1)).status().code(), absl::StatusCode::kResourceExhausted);
  factory.release_.Notify();
  opener.join();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(manager.Open(absl::Seconds(1)).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(manager.Close(first->channel_id).ok());
  EXPECT_TRUE(manager.Open(absl::Seconds(1)).ok());
}

// The fake network's transports, each setting *destroyed when it is destroyed.
class TrackedTransports final : public PeerTransportFactory {
 public:
  class Transport final : public PeerTransport {
   public:
    Transport(std::unique_ptr<PeerTransport> inner, bool* destroyed)
        : inner_(std::move(inner)), destroyed_(destroyed) {}
    ~Transport() override { *destroyed_ = true; }
    absl::Status QueueSend(absl::Span<const SendSegment> s, absl::Time deadline) override {
      return inner_->QueueSend(s, deadline);
    }
    absl::Status WaitSends(size_t pending, absl::Time deadline) override {
      return inner_->WaitSends(pending, deadline);
    }
    absl::Status Recv(absl::Span<const RecvSegment> s, absl::Time deadline) override {
      return inner_->Recv(s, deadline);
    }
    void Abort() override { inner_->Abort(); }

   private:
    const std::unique_ptr<PeerTransport> inner_;
    bool* const destroyed_;
  };
  explicit TrackedTransports(FakePeerNetwork* inner) : inner_(inner) {}
  absl::StatusOr<OpenedTransport> Open(absl::Time join_deadline) override {
    absl::StatusOr<OpenedTransport> opened = inner_->Open(join_deadline);
    if (opened.ok()) {
      opened->transport = std::make_unique<Transport>(std::move(opened->transport), &destroyed);
    }
    return opened;
  }
  bool destroyed = false;

 private:
  FakePeerNetwork* const inner_;
};

// A transfer that fails forgets its channel at once but keeps the transport until it ends: its
// cancel hook (the client's cancel racing the failure) may still abort it.
TEST(ChannelManager, AFailedUseKeepsItsTransportUntilItEnds) {
  FakeClock clock;
  FakePeerNetwork network(&clock);
  TrackedTransports factory(&network);
  ChannelManager manager(&factory, &clock, ChannelOptions{});
  absl::StatusOr<ChannelManager::Opened> opened = manager.Open(absl::Seconds(1));
  ASSERT_TRUE(opened.ok()) << opened.status();
  {
    absl::StatusOr<ChannelManager::Use> use = manager.Acquire(opened->channel_id);
    ASSERT_TRUE(use.ok()) << use.status();
    use->Fail();
    EXPECT_EQ(manager.size(), 0u);
    EXPECT_FALSE(factory.destroyed);
    use->transport().Abort();  // what a late cancel hook does
    EXPECT_EQ(manager.Acquire(opened->channel_id).status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_TRUE(factory.destroyed);
}

}  // namespace
}  // namespace kvpool::testing
