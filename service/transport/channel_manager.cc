#include "service/transport/channel_manager.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"

namespace kvpool {

struct ChannelManager::Channel {
  explicit Channel(std::unique_ptr<PeerTransport> t) : transport(std::move(t)) {}
  const std::unique_ptr<PeerTransport> transport;
  // Guarded by ChannelManager::mu_.
  bool busy = false;
  absl::Time last_used;
};

namespace {

void AbortAll(const std::vector<std::shared_ptr<ChannelManager::Channel>>& channels) {
  for (const auto& channel : channels) channel->transport->Abort();
}

}  // namespace

ChannelManager::ChannelManager(PeerTransportFactory* factory, Clock* clock,
                               const ChannelOptions& options)
    : factory_(factory), clock_(clock), options_(options) {}

ChannelManager::~ChannelManager() {
  std::vector<std::shared_ptr<Channel>> all;
  {
    absl::MutexLock l(&mu_);
    for (auto& [id, channel] : channels_) all.push_back(std::move(channel));
    channels_.clear();
  }
  AbortAll(all);
}

absl::StatusOr<ChannelManager::Opened> ChannelManager::Open(absl::Duration join_timeout) {
  if (join_timeout <= absl::ZeroDuration()) join_timeout = options_.default_join_timeout;
  join_timeout = std::min(join_timeout, options_.max_join_timeout);
  ExpireIdle();
  {
    absl::MutexLock l(&mu_);
    if (channels_.size() + opening_ >= options_.max_channels) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%d NCCL channels open or opening, the server's limit (--nccl_max_channels)",
          channels_.size() + opening_));
    }
    ++opening_;
  }
  absl::StatusOr<OpenedTransport> opened = factory_->Open(clock_->Now() + join_timeout);
  absl::MutexLock l(&mu_);
  --opening_;
  if (!opened.ok()) return opened.status();
  auto channel = std::make_shared<Channel>(std::move(opened->transport));
  // The join deadline is shorter than the idle timeout in any sane configuration; a channel is
  // never expired while its worker may still be joining.
  channel->last_used = clock_->Now() + join_timeout;
  const uint64_t id = next_id_++;
  channels_[id] = std::move(channel);
  return Opened{id, std::move(opened->join_id)};
}

absl::Status ChannelManager::Close(uint64_t channel_id) {
  std::shared_ptr<Channel> channel;
  {
    absl::MutexLock l(&mu_);
    channel = RemoveLocked(channel_id);
  }
  if (channel == nullptr) {
    return absl::NotFoundError(absl::StrFormat("no NCCL channel %d", channel_id));
  }
  channel->transport->Abort();
  return absl::OkStatus();
}

size_t ChannelManager::ExpireIdle() {
  std::vector<std::shared_ptr<Channel>> expired;
  {
    absl::MutexLock l(&mu_);
    expired = TakeExpiredLocked();
  }
  AbortAll(expired);
  return expired.size();
}

size_t ChannelManager::size() const {
  absl::MutexLock l(&mu_);
  return channels_.size();
}

absl::StatusOr<ChannelManager::Use> ChannelManager::Acquire(uint64_t channel_id) {
  std::vector<std::shared_ptr<Channel>> expired;
  std::shared_ptr<Channel> channel;
  bool busy = false;
  {
    absl::MutexLock l(&mu_);
    expired = TakeExpiredLocked();
    auto it = channels_.find(channel_id);
    if (it != channels_.end()) {
      channel = it->second;
      busy = channel->busy;
      channel->busy = true;
    }
  }
  AbortAll(expired);
  if (channel == nullptr) {
    return absl::UnavailableError(absl::StrFormat(
        "no NCCL channel %d (closed, idle-expired or failed): open a new one", channel_id));
  }
  if (busy) {
    return absl::AbortedError(absl::StrFormat(
        "NCCL channel %d is busy with another transfer (one at a time)", channel_id));
  }
  return Use(this, channel_id, std::move(channel));
}

std::shared_ptr<ChannelManager::Channel> ChannelManager::RemoveLocked(uint64_t id) {
  auto it = channels_.find(id);
  if (it == channels_.end()) return nullptr;
  std::shared_ptr<Channel> channel = std::move(it->second);
  channels_.erase(it);
  return channel;
}

std::vector<std::shared_ptr<ChannelManager::Channel>> ChannelManager::TakeExpiredLocked() {
  const absl::Time now = clock_->Now();
  std::vector<uint64_t> ids;
  for (const auto& [id, channel] : channels_) {
    if (!channel->busy && channel->last_used + options_.idle_timeout <= now) ids.push_back(id);
  }
  std::vector<std::shared_ptr<Channel>> expired;
  for (uint64_t id : ids) expired.push_back(RemoveLocked(id));
  return expired;
}

ChannelManager::Use::Use(Use&& other) noexcept
    : manager_(other.manager_),
      id_(other.id_),
      channel_(std::move(other.channel_)),
      failed_(other.failed_) {}

ChannelManager::Use::~Use() {
  if (channel_ == nullptr || failed_) return;
  absl::MutexLock l(&manager_->mu_);
  channel_->busy = false;
  channel_->last_used = manager_->clock_->Now();
}

PeerTransport& ChannelManager::Use::transport() const { return *channel_->transport; }

void ChannelManager::Use::Fail() {
  if (channel_ == nullptr || failed_) return;
  failed_ = true;
  {
    absl::MutexLock l(&manager_->mu_);
    auto it = manager_->channels_.find(id_);
    if (it != manager_->channels_.end() && it->second == channel_) manager_->channels_.erase(it);
  }
  channel_->transport->Abort();
}

}  // namespace kvpool
