// C++ client of the kvpool gRPC service (proto/kvpool/v1/kvpool.proto): one method per RPC,
// absl::Status results (the gRPC code and message carried over unchanged), a deadline on every
// call, Put split into chunks of bounded size, Get reassembled per layer, an AttendStream
// session for decode loops, and a sharded client placing sequences over several servers.
//
// Thread safety: KvPoolClient and ShardedKvPoolClient are thread-safe (calls share one channel
// per target). An AttendSession is driven by one thread at a time.
#ifndef KVPOOL_CLIENT_KVPOOL_CLIENT_H_
#define KVPOOL_CLIENT_KVPOOL_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/security/credentials.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::client {

struct ClientOptions {
  // Deadline of a call whose CallOptions leave it unset: unary RPCs and whole streams.
  absl::Duration default_deadline = absl::Seconds(60);
  // Largest gRPC message sent or received (channel arguments of both directions).
  int max_message_bytes = 64 << 20;
  // Payload bytes (k + v) per Put message; a chunk always holds at least one token.
  size_t max_chunk_bytes = 4 << 20;
  // Channels with different indices to one target use different connections (parallel streams).
  int channel_index = 0;
  // gRPC wait_for_ready: a call made while the channel cannot connect waits for a connection
  // until its deadline instead of failing with UNAVAILABLE at once.
  bool wait_for_ready = false;
  // How long a unary Attend or an AttendSession::Step polls for its response without sleeping
  // before it blocks: a decode step's response then lands without a thread wake-up. 0 = block at
  // once.
  absl::Duration attend_spin = absl::Microseconds(500);
  // 0: AttendSessions are gRPC AttendStreams. Otherwise OpenAttendStream connects to this port
  // on the host of the client's "host:port" target (the server's --attend_socket_port) and runs
  // the steps over the AttendSocket format, without gRPC (no TLS: refused with credentials).
  int attend_socket_port = 0;
  // Not empty: OpenAttendStream connects to the server's Unix socket at this path (its
  // --attend_unix_socket; the client must run on the server's host) and runs the steps in a
  // shared-memory region of attend_region_bytes, which must hold a step's q, new K/V and output
  // (the server's --attend_region_max_bytes bounds it). Takes precedence over attend_socket_port.
  std::string attend_unix_socket;
  uint64_t attend_region_bytes = uint64_t{16} << 20;
  // Channel credentials; null = insecure.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

struct CallOptions {
  absl::Duration deadline = absl::ZeroDuration();  // 0 = ClientOptions::default_deadline
};

// fp16 K and V of tokens [token_begin, token_begin + num_tokens) of a sequence, for all layers.
// k and v are [num_layers][num_tokens][num_kv_heads][head_dim] IEEE binary16.
struct SequenceKv {
  uint32_t num_layers = 0;
  uint32_t token_begin = 0;
  uint32_t num_tokens = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  std::vector<uint16_t> k, v;

  size_t LayerElements() const { return size_t{num_tokens} * num_kv_heads * head_dim; }
};

// One layer of a Get, reassembled from its messages in block order.
struct GetLayer {
  uint32_t layer = 0;
  uint32_t num_blocks = 0;
  // Real tokens: the sum of the messages' valid_tokens. FP16: k/v are
  // [num_blocks * block_tokens][heads][head_dim], tokens from valid_tokens on are zeros padding
  // a partial tail block. RAW: k/v are [num_blocks][heads] head pages (rows past valid_tokens
  // zero codes and meta).
  uint32_t valid_tokens = 0;
  std::string k, v;
  v1::PageLayoutDescriptor layout;  // the layer's page layout (needed to read RAW pages)
  // RAW from block 0 of a namespace with sink tokens: the exact sink rows,
  // [heads][layout.sink_tokens][head_dim] fp16 (GetResponse.sink_k / sink_v); else empty.
  std::string sink_k, sink_v;
};
struct GetResult {
  v1::GetFormat format = v1::GET_FORMAT_FP16;
  std::vector<GetLayer> layers;  // ascending layer order
  uint64_t payload_bytes = 0;    // k + v (and sink row) bytes received
};

// One open AttendStream: a decode loop sends one AttendRequest per step and layer and gets its
// AttendResponse back in order. Finish (or destruction) closes the stream.
class AttendSession {
 public:
  virtual ~AttendSession() = default;
  // Sends `request` and waits for its response, parsed into `*response`. The message's buffers
  // are reused: a decode loop that passes the same one every step allocates nothing for its
  // output (a new message per step made AttendSocket steps at batch 32 ~100 µs slower,
  // tests/bench/results/attend_client_reuse_h200.txt). After an error the session is finished
  // and every later Step returns that error.
  virtual absl::Status Step(const v1::AttendRequest& request, v1::AttendResponse* response) = 0;
  // Step into a new message.
  absl::StatusOr<v1::AttendResponse> Step(const v1::AttendRequest& request) {
    v1::AttendResponse response;
    if (absl::Status s = Step(request, &response); !s.ok()) return s;
    return response;
  }
  // Half-closes the stream and returns its final status.
  virtual absl::Status Finish() = 0;
};

class KvPoolClient {
 public:
  // Connects lazily to `target` ("host:port", any gRPC target URI).
  static std::unique_ptr<KvPoolClient> Create(const std::string& target,
                                              const ClientOptions& options = {});
  // Over an existing channel (tests: in-process channels).
  static std::unique_ptr<KvPoolClient> Create(std::shared_ptr<grpc::Channel> channel,
                                              const ClientOptions& options = {});
  virtual ~KvPoolClient() = default;

  virtual const ClientOptions& options() const = 0;

  virtual absl::StatusOr<v1::NamespaceInfo> CreateNamespace(const v1::NamespaceSpec& spec,
                                                            const CallOptions& call = {}) = 0;
  virtual absl::StatusOr<std::vector<v1::NamespaceInfo>> ListNamespaces(
      const CallOptions& call = {}) = 0;
  // The namespace `name` ("" = the server's default, the first one listed). NOT_FOUND if absent.
  virtual absl::StatusOr<v1::NamespaceInfo> GetNamespace(std::string_view name,
                                                         const CallOptions& call = {}) = 0;

  // Streams a sequence's K/V: a header with all `token_ids`, then per layer chunks of at most
  // max_chunk_bytes covering kv's token range. Requires kv's shape to match its vectors and
  // kv.token_begin + kv.num_tokens <= token_ids.size(); INVALID_ARGUMENT otherwise.
  virtual absl::StatusOr<v1::PutResponse> Put(std::string_view ns,
                                              absl::Span<const int32_t> token_ids,
                                              const SequenceKv& kv,
                                              const CallOptions& call = {}) = 0;

  virtual absl::StatusOr<v1::MatchResponse> Match(std::string_view ns,
                                                  absl::Span<const int32_t> token_ids,
                                                  absl::Duration ttl = absl::ZeroDuration(),
                                                  const CallOptions& call = {}) = 0;
  virtual absl::Status Release(uint64_t lease_id, const CallOptions& call = {}) = 0;

  // Reads request.lease_id's blocks and reassembles them per layer.
  virtual absl::StatusOr<GetResult> Get(const v1::GetRequest& request,
                                        const CallOptions& call = {}) = 0;

  // Appends fp16 K/V [num_tokens][num_kv_heads][head_dim] to `layer` of the lease's tail;
  // token_ids is empty or num_tokens long. Returns the tokens now held for that layer.
  virtual absl::StatusOr<uint32_t> Append(uint64_t lease_id, uint32_t layer,
                                          absl::Span<const int32_t> token_ids,
                                          uint32_t num_tokens, absl::Span<const uint16_t> k,
                                          absl::Span<const uint16_t> v,
                                          const CallOptions& call = {}) = 0;

  virtual absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                                    const CallOptions& call = {}) = 0;
  // Opens an AttendStream (or an AttendSocket session: ClientOptions::attend_socket_port); the
  // deadline covers the whole session.
  virtual absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttendStream(
      const CallOptions& call = {}) = 0;

  virtual absl::StatusOr<v1::StatsResponse> Stats(const CallOptions& call = {}) = 0;
};

// Milliseconds of `d` (not negative) for the protocol's uint32 fields (ttl_ms, timeout_ms), where
// 0 means the server's default: rounded up (a positive duration is never sent as 0) and clamped
// at UINT32_MAX (about 49.7 days), never wrapped.
uint32_t ProtocolMilliseconds(absl::Duration d);

// Index in `targets` of the shard for a sequence, by rendezvous (highest random weight) hashing
// of the namespace and the token ids of its first block (all ids when shorter). The hash is
// stable across processes and builds, so every client places a shared system prompt on the same
// shard, and removing a target moves only the sequences it held. "" hashes as "default", the
// name kvpool-server gives its default namespace, so either spelling places a sequence alike.
// Requires non-empty targets.
size_t RendezvousShard(absl::Span<const std::string> targets, std::string_view ns,
                       absl::Span<const int32_t> first_block_token_ids);

// One KvPoolClient per target. A lease lives on the shard that issued it: keep the shard that
// ForSequence gave for the ids the lease was matched with, for every later call about the lease
// (a sequence shorter than one block is placed by all its ids, so as it grows it may hash to
// another shard). The Python client's shard_for places sequences alike.
class ShardedKvPoolClient {
 public:
  // INVALID_ARGUMENT when `targets` is empty or has duplicates, or when the options' AttendSocket
  // would send some shard's sessions to another shard's server: an attend_unix_socket with more
  // than one target, or an attend_socket_port with two targets that name the same host (as
  // written: "localhost" and "127.0.0.1" are not resolved to one host, and such a pair's
  // sessions get NOT_FOUND for the other shard's leases at their first step).
  static absl::StatusOr<std::unique_ptr<ShardedKvPoolClient>> Create(
      std::vector<std::string> targets, const ClientOptions& options = {});

  size_t num_shards() const { return shards_.size(); }
  const std::string& target(size_t shard) const { return targets_[shard]; }
  KvPoolClient& shard(size_t shard) { return *shards_[shard]; }

  // The shard of a sequence of namespace `ns` whose blocks hold block_tokens tokens.
  size_t ShardFor(std::string_view ns, absl::Span<const int32_t> token_ids,
                  uint32_t block_tokens) const;
  KvPoolClient& ForSequence(std::string_view ns, absl::Span<const int32_t> token_ids,
                            uint32_t block_tokens) {
    return shard(ShardFor(ns, token_ids, block_tokens));
  }

 private:
  ShardedKvPoolClient(std::vector<std::string> targets,
                      std::vector<std::unique_ptr<KvPoolClient>> shards);

  std::vector<std::string> targets_;
  std::vector<std::unique_ptr<KvPoolClient>> shards_;
};

}  // namespace kvpool::client

#endif  // KVPOOL_CLIENT_KVPOOL_CLIENT_H_
