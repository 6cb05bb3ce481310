// ChannelManager: the server's open NCCL channels (one per worker), by channel id. A channel is
// used by one transfer at a time, dropped after an idle timeout, and aborted and forgotten as
// soon as a transfer on it fails, so a dead worker never holds the server.
//
// Thread safety: all methods are thread-safe. mu_ guards the channel map and every Channel's
// busy flag and last-use time; transports are driven outside mu_, by the one holder of a Use.
// Lock order: mu_, then nothing (transports are aborted after mu_ is released).
#ifndef KVPOOL_SERVICE_TRANSPORT_CHANNEL_MANAGER_H_
#define KVPOOL_SERVICE_TRANSPORT_CHANNEL_MANAGER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/store/clock.h"
#include "service/transport/peer_transport.h"

namespace kvpool {

struct ChannelOptions {
  absl::Duration idle_timeout = absl::Minutes(5);  // dropped after this long unused
  absl::Duration default_join_timeout = absl::Seconds(30);
  absl::Duration max_join_timeout = absl::Minutes(2);
  size_t max_channels = 256;  // RESOURCE_EXHAUSTED beyond
};

class ChannelManager {
 public:
  // `factory` and `clock` are not owned and must outlive the manager.
  ChannelManager(PeerTransportFactory* factory, Clock* clock, const ChannelOptions& options);
  ~ChannelManager();

  ChannelManager(const ChannelManager&) = delete;
  ChannelManager& operator=(const ChannelManager&) = delete;

  const ChannelOptions& options() const { return options_; }

  struct Opened {
    uint64_t channel_id = 0;
    std::string join_id;
  };
  // A new channel whose worker must join within `join_timeout` (0 = default, capped).
  absl::StatusOr<Opened> Open(absl::Duration join_timeout);
  // Aborts and forgets the channel; a transfer in flight on it fails. NOT_FOUND if unknown.
  absl::Status Close(uint64_t channel_id);
  // Drops channels idle for idle_timeout (also done by every Open and Acquire). Returns how many.
  size_t ExpireIdle();
  size_t size() const;

  struct Channel;
  // Exclusive use of one channel for one transfer. Destroying it marks the channel idle again
  // (now), unless Fail was called: then the channel was aborted and forgotten.
  class Use {
   public:
    Use(Use&& other) noexcept;
    Use& operator=(Use&&) = delete;
    ~Use();
    PeerTransport& transport() const;
    // Aborts the channel's transport and forgets the channel (after a failed send/receive). The
    // transport itself lives until the Use ends: a cancel hook may still call its Abort.
    void Fail();

   private:
    friend class ChannelManager;
    Use(ChannelManager* manager, uint64_t id, std::shared_ptr<Channel> channel)
        : manager_(manager), id_(id), channel_(std::move(channel)) {}
    ChannelManager* manager_;
    uint64_t id_;
    std::shared_ptr<Channel> channel_;  // null once moved from
    bool failed_ = false;
  };
  // UNAVAILABLE for an unknown (closed, expired or failed) channel; ABORTED while another
  // transfer uses it.
  absl::StatusOr<Use> Acquire(uint64_t channel_id);

 private:
  // Removes channel `id` if present and returns it, for the caller to abort outside mu_.
  std::shared_ptr<Channel> RemoveLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Idle channels past their timeout, removed from the map.
  std::vector<std::shared_ptr<Channel>> TakeExpiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  PeerTransportFactory* const factory_;
  Clock* const clock_;
  const ChannelOptions options_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Opens under way (the factory is called outside mu_): they count against max_channels.
  size_t opening_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_TRANSPORT_CHANNEL_MANAGER_H_
