#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"
#include "client/attend_socket_session.h"
#include "client/kvpool_client.h"

namespace kvpool::client {
namespace {

// splitmix64 finalizer: a fixed bijective mix, identical on every platform and build.
uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a over bytes, then mixed: a stable hash (std::hash and absl::Hash are not).
uint64_t HashBytes(std::string_view bytes, uint64_t seed) {
  uint64_t h = 0xCBF29CE484222325ull ^ seed;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return Mix(h);
}

}  // namespace

size_t RendezvousShard(absl::Span<const std::string> targets, std::string_view ns,
                       absl::Span<const int32_t> first_block_token_ids) {
  // The servers resolve "" to their default namespace, which kvpool-server names "default".
  uint64_t key = HashBytes(ns.empty() ? std::string_view("default") : ns, 0);
  for (int32_t id : first_block_token_ids) {
    key = Mix(key ^ static_cast<uint32_t>(id)) + 0x9E3779B97F4A7C15ull;
  }
  size_t best = 0;
  uint64_t best_weight = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    const uint64_t weight = Mix(HashBytes(targets[i], 0x6B76706F6F6Cull) ^ key);
    if (i == 0 || weight > best_weight) {
      best = i;
      best_weight = weight;
    }
  }
  return best;
}

absl::StatusOr<std::unique_ptr<ShardedKvPoolClient>> ShardedKvPoolClient::Create(
    std::vector<std::string> targets, const ClientOptions& options) {
  if (targets.empty()) return absl::InvalidArgumentError("no shard targets");
  // Every shard's AttendSocket sessions must reach that shard's server.
  if (targets.size() > 1 && !options.attend_unix_socket.empty()) {
    return absl::InvalidArgumentError(
        "attend_unix_socket names one server's socket: create each shard's KvPoolClient with its "
        "own");
  }
  std::set<std::string> seen, sockets;
  std::vector<std::unique_ptr<KvPoolClient>> shards;
  for (const std::string& t : targets) {
    if (!seen.insert(t).second) {
      return absl::InvalidArgumentError(absl::StrFormat("duplicate shard target %s", t));
    }
    // A target the port cannot be joined to fails when its session opens, as a lone target does.
    if (options.attend_socket_port != 0 && targets.size() > 1) {
      absl::StatusOr<std::string> socket = AttendSocketAddress(t, options.attend_socket_port);
      if (socket.ok() && !sockets.insert(*socket).second) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "two shards would share the AttendSocket %s (one attend_socket_port for servers on "
            "one host): create each shard's KvPoolClient with its own",
            *socket));
      }
    }
    shards.push_back(KvPoolClient::Create(t, options));
  }
  return std::unique_ptr<ShardedKvPoolClient>(
      new ShardedKvPoolClient(std::move(targets), std::move(shards)));
}

ShardedKvPoolClient::ShardedKvPoolClient(std::vector<std::string> targets,
                                         std::vector<std::unique_ptr<KvPoolClient>> shards)
    : targets_(std::move(targets)), shards_(std::move(shards)) {}

size_t ShardedKvPoolClient::ShardFor(std::string_view ns, absl::Span<const int32_t> token_ids,
                                     uint32_t block_tokens) const {
  const size_t n = std::min<size_t>(token_ids.size(), block_tokens == 0 ? 16 : block_tokens);
  return RendezvousShard(targets_, ns, token_ids.subspan(0, n));
}

}  // namespace kvpool::client
