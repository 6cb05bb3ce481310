#include "service/transport/fake_peer_transport.h"

#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvpool {

// Segments in flight in each direction (index = sending rank) and whether the channel broke.
struct FakePeerNetwork::Wire {
  absl::Mutex mu;
  std::deque<std::vector<uint8_t>> in_flight[2] ABSL_GUARDED_BY(mu);
  bool broken ABSL_GUARDED_BY(mu) = false;
  std::string why ABSL_GUARDED_BY(mu);

  void BreakLocked(std::string reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (broken) return;
    broken = true;
    why = std::move(reason);
  }
};

namespace {

class FakeEnd final : public PeerTransport {
 public:
  FakeEnd(FakePeerNetwork* network, std::shared_ptr<FakePeerNetwork::Wire> wire, int rank)
      : network_(network), wire_(std::move(wire)), rank_(rank) {}
  ~FakeEnd() override { Abort(); }

  absl::Status QueueSend(absl::Span<const SendSegment> segments, absl::Time deadline) override {
    if (absl::Status s = Spend(deadline); !s.ok()) return s;
    absl::MutexLock l(&wire_->mu);
    if (wire_->broken) return Broken();
    for (const SendSegment& seg : segments) {
      const auto* p = static_cast<const uint8_t*>(seg.data);
      wire_->in_flight[rank_].emplace_back(p, p + seg.bytes);
    }
    return absl::OkStatus();
  }

  // Queued sends were copied onto the wire: delivered as far as the sender is concerned.
  absl::Status WaitSends(size_t /*pending*/, absl::Time /*deadline*/) override {
    absl::MutexLock l(&wire_->mu);
    return wire_->broken ? Broken() : absl::OkStatus();
  }

  absl::Status Recv(absl::Span<const RecvSegment> segments, absl::Time deadline) override {
    if (absl::Status s = Spend(deadline); !s.ok()) return s;
    absl::MutexLock l(&wire_->mu);
    for (const RecvSegment& seg : segments) {
      wire_->mu.Await(absl::Condition(this, &FakeEnd::ReadyLocked));
      if (wire_->broken) return Broken();
      std::vector<uint8_t> sent = std::move(incoming().front());
      incoming().pop_front();
      if (sent.size() != seg.bytes) {
        wire_->BreakLocked(absl::StrFormat("rank %d received %d bytes into a %d-byte segment",
                                           rank_, sent.size(), seg.bytes));
        return absl::InternalError(absl::StrCat("fake channel broken: ", wire_->why));
      }
      if (!sent.empty()) std::memcpy(seg.data, sent.data(), sent.size());
    }
    return absl::OkStatus();
  }

  void Abort() override {
    absl::MutexLock l(&wire_->mu);
    wire_->BreakLocked(absl::StrCat("rank ", rank_, " aborted"));
  }

 private:
  // Segments the peer sent to this end.
  std::deque<std::vector<uint8_t>>& incoming() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wire_->mu) {
    return wire_->in_flight[1 - rank_];
  }
  bool ReadyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wire_->mu) {
    return wire_->broken || !incoming().empty();
  }
  absl::Status Broken() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wire_->mu) {
    return absl::UnavailableError(absl::StrCat("fake channel broken: ", wire_->why));
  }
  // Charges the network's op latency to the clock; breaks the channel past the deadline.
  absl::Status Spend(absl::Time deadline) {
    const absl::Duration latency = network_->op_latency();
    if (latency > absl::ZeroDuration()) network_->clock()->Advance(latency);
    if (network_->clock()->Now() <= deadline) return absl::OkStatus();
    absl::MutexLock l(&wire_->mu);
    wire_->BreakLocked(absl::StrCat("rank ", rank_, " timed out"));
    return absl::DeadlineExceededError(
        absl::StrFormat("fake transfer on rank %d not done by its deadline", rank_));
  }

  FakePeerNetwork* const network_;
  const std::shared_ptr<FakePeerNetwork::Wire> wire_;
  const int rank_;
};

}  // namespace

absl::StatusOr<OpenedTransport> FakePeerNetwork::Open(absl::Time /*join_deadline*/) {
  auto wire = std::make_shared<Wire>();
  OpenedTransport opened;
  opened.transport = std::make_unique<FakeEnd>(this, wire, 0);
  absl::MutexLock l(&mu_);
  opened.join_id = absl::StrCat("fake-", next_id_++);
  unjoined_[opened.join_id] = std::make_unique<FakeEnd>(this, wire, 1);
  return opened;
}

absl::StatusOr<std::unique_ptr<PeerTransport>> FakePeerNetwork::Join(const std::string& join_id) {
  absl::MutexLock l(&mu_);
  auto it = unjoined_.find(join_id);
  if (it == unjoined_.end()) {
    return absl::NotFoundError(absl::StrCat("no fake channel to join with id ", join_id));
  }
  std::unique_ptr<PeerTransport> end = std::move(it->second);
  unjoined_.erase(it);
  return end;
}

}  // namespace kvpool
