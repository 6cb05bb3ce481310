// KvStore: the pool's paths of DESIGN.md section 4 (Put, Match/lease, Get, Append, Attend,
// Release), over per-namespace block pools, a prefix index and a lease table. No gRPC here:
// the RPC layer validates framing and converts statuses; this class validates content
// (namespace, lease, layer/head ranges, sizes, NaN/Inf) before it changes anything.
//
// Error model: absl::Status. NOT_FOUND unknown namespace/lease; INVALID_ARGUMENT bad shape,
// range or values; RESOURCE_EXHAUSTED pool full of pinned blocks (the message says so) or a
// limit exceeded; FAILED_PRECONDITION a Put committed before every needed chunk arrived.
//
// Thread safety: all methods are thread-safe. Reads of pinned blocks run without the store lock.
#ifndef KVPOOL_SERVICE_STORE_KV_STORE_H_
#define KVPOOL_SERVICE_STORE_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/namespace_config.h"

namespace kvpool {

struct NamespaceInfo {
  NamespaceConfig config;
  uint64_t num_blocks = 0;
  uint64_t num_sink_blocks = 0;  // blocks with a sink page (ids below it); 0 without sinks
  uint64_t bytes_per_block = 0;  // a block's pages, sink pages apart
  double bytes_per_token = 0;
  double fp16_bytes_per_token = 0;
};

struct NamespaceStoreStats {
  std::string name;
  uint64_t blocks_total = 0;
  uint64_t blocks_free = 0;
  uint64_t blocks_in_use = 0;     // pinned or being written
  uint64_t blocks_evictable = 0;  // published, unpinned
  uint64_t sink_blocks_total = 0;  // blocks with a sink page (0 without sinks)
  uint64_t sink_blocks_free = 0;
  uint64_t bytes_per_block = 0;
  uint64_t tokens_stored = 0;    // tokens in published blocks now
  uint64_t evictions = 0;        // blocks evicted, total
  uint64_t quantized_bytes = 0;  // page bytes written by QuantizeAppend, total
  uint64_t prefix_query_tokens = 0;
  uint64_t prefix_hit_tokens = 0;
  double bytes_per_token = 0;
  double fp16_bytes_per_token = 0;
  double quant_rel_error = 0;  // sampled relative L2 error of recent puts (EWMA), 0 if none
};

struct StoreStats {
  std::string backend;
  uint64_t active_leases = 0;
  // Kept by the leases together: live ones, and released or expired ones a call still uses.
  uint64_t lease_token_ids = 0;
  std::vector<NamespaceStoreStats> namespaces;
  ComputeBackendStats memory;
};

class KvStore {
 public:
  struct Options {
    uint64_t pool_bytes = uint64_t{1} << 30;  // total arena budget over all namespaces
    ComputeBackend* backend = nullptr;        // not owned; must outlive the store
    Clock* clock = nullptr;                   // not owned; null = SystemClock()
    absl::Duration default_lease_ttl = absl::Seconds(30);
    absl::Duration max_lease_ttl = absl::Minutes(10);
    uint64_t max_leases = 1 << 16;
    uint32_t max_sequence_tokens = 1 << 20;  // tokens per Put / lease sequence
    // Token ids all live leases keep together (4 bytes each: a Match's ids and those appends
    // name, for publishing the leases' tail blocks).
    uint64_t max_lease_token_ids = uint64_t{1} << 28;
    uint32_t max_attend_batch = 1024;        // items per Attend
    int max_namespaces = 64;
    // Every Nth Put chunk is read back to measure quantization error (0 = never).
    int quality_sample_every = 8;
  };

  // The store with no namespaces; the caller creates the default one.
  static absl::StatusOr<std::unique_ptr<KvStore>> Create(const Options& options);
  virtual ~KvStore() = default;

  // Reserves config.capacity_bytes of the pool (0 = all that is unreserved) and allocates the
  // namespace's arena. ALREADY_EXISTS for a taken name; RESOURCE_EXHAUSTED over the budget.
  virtual absl::StatusOr<NamespaceInfo> CreateNamespace(const NamespaceConfig& config) = 0;
  // "" names the first namespace created (the default one).
  virtual absl::StatusOr<NamespaceInfo> GetNamespace(std::string_view name) const = 0;
  virtual std::vector<NamespaceInfo> ListNamespaces() const = 0;

  // ---- Put ------------------------------------------------------------------------------------
  struct PutResult {
    uint32_t tokens_cached = 0;
    uint32_t tokens_stored = 0;
    uint32_t tokens_ignored = 0;
  };
  // One Put of a sequence. Blocks needed are allocated (evicting if needed) when the session
  // begins and pinned by it; they are published by Commit and freed if the session is destroyed
  // uncommitted. Not thread-safe itself: one stream drives one session.
  class PutSession {
   public:
    virtual ~PutSession() = default;
    virtual const NamespaceInfo& info() const = 0;
    virtual uint32_t tokens_cached() const = 0;  // leading tokens already in the pool
    virtual uint32_t tokens_to_store() const = 0;
    virtual uint32_t tokens_ignored() const = 0;  // trailing partial block
    // fp16 K and V [num_tokens][num_kv_heads][head_dim] of tokens [token_begin, +num_tokens)
    // of `layer`. Tokens outside the blocks to store are ignored. Validates all before writing.
    [[nodiscard]] virtual absl::Status AddChunk(uint32_t layer, uint32_t token_begin,
                                                uint32_t num_tokens, const uint16_t* k,
                                                const uint16_t* v) = 0;
    // One layer's K and V of a chunk, for AddChunksFromArena.
    struct LayerChunk {
      uint32_t layer = 0;
      const uint16_t* k = nullptr;
      const uint16_t* v = nullptr;
    };
    // AddChunk of tokens [token_begin, +num_tokens) of each chunk's layer (each layer at most
    // once), with k and v in backend (arena) memory, e.g. a transfer staging buffer the fused
    // kernel reads directly.
    // The NaN/Inf checks of every chunk run on the backend before any write; the backend
    // synchronizes once for the checks and once for the writes (a chunk sampled for the quality
    // metric, one in Options::quality_sample_every, is then read back). Returns after k and v
    // were consumed.
    [[nodiscard]] virtual absl::Status AddChunksFromArena(uint32_t token_begin,
                                                          uint32_t num_tokens,
                                                          absl::Span<const LayerChunk> chunks) = 0;
    // Publishes every stored block. FAILED_PRECONDITION (and nothing published) if some
    // (block, layer) was not fully written.
    [[nodiscard]] virtual absl::StatusOr<PutResult> Commit() = 0;
  };
  // `max_payload_bytes`: the fp16 K/V the caller can still take for this Put (a gRPC Put
  // stream's room left under --max_put_stream_bytes). A Put whose new blocks need more, every
  // layer's K and V of their tokens, is RESOURCE_EXHAUSTED before anything is evicted.
  virtual absl::StatusOr<std::unique_ptr<PutSession>> BeginPut(
      std::string_view ns, absl::Span<const int32_t> token_ids,
      uint64_t max_payload_bytes = UINT64_MAX) = 0;
  // BeginPut's checks of the namespace and the token ids, changing nothing: the namespace's info.
  // A Put stores at most the ids' whole blocks, so a caller that takes resources of its own
  // for it (a transfer's staging) can size them before BeginPut evicts cached blocks.
  virtual absl::StatusOr<NamespaceInfo> CheckPut(std::string_view ns,
                                                 absl::Span<const int32_t> token_ids) const = 0;

  // ---- Match / leases -------------------------------------------------------------------------
  struct MatchResult {
    uint64_t lease_id = 0;
    uint32_t cached_tokens = 0;
    uint32_t num_blocks = 0;
    absl::Time expires;
  };
  // Longest cached prefix of token_ids; the new lease pins its blocks. ttl 0 = default.
  virtual absl::StatusOr<MatchResult> Match(std::string_view ns,
                                            absl::Span<const int32_t> token_ids,
                                            absl::Duration ttl) = 0;
  virtual absl::Status Release(uint64_t lease_id) = 0;
  // Drops leases past their expiry (also done lazily by every call). Returns how many.
  virtual size_t ExpireLeases() = 0;

  struct LeaseView {
    NamespaceInfo info;
    uint32_t num_blocks = 0;             // matched + tail blocks
    std::vector<uint32_t> layer_tokens;  // tokens written per layer (appends in flight excluded)
  };
  // A lease's state, for a call to check its request against. Does not renew the lease: a call
  // refused for bad input leaves its expiry alone (the reads, appends and attends that pass
  // their checks renew it).
  virtual absl::StatusOr<LeaseView> DescribeLease(uint64_t lease_id) = 0;
  // Renews a lease (ttl from now), for a call whose checks passed but that reads nothing (a Get
  // of layers holding no tokens). NOT_FOUND when it is unknown or expired.
  virtual absl::Status RenewLease(uint64_t lease_id) = 0;

  // ---- Get ------------------------------------------------------------------------------------
  // Blocks [block_begin, +num_blocks) of a lease, one layer, KV heads [head_begin, head_end).
  // Fp16: k/v are [num_blocks*block_tokens][heads][head_dim]. Raw: [num_blocks][heads] head pages.
  // Every read returns zeros for the tokens past those written at its layer (a partial tail
  // block's rows: fp16 zeros, or zero codes and meta), whatever the block held before.
  virtual absl::Status ReadFp16(uint64_t lease_id, uint32_t layer, uint32_t block_begin,
                                uint32_t num_blocks, uint32_t head_begin, uint32_t head_end,
                                uint16_t* k, uint16_t* v) = 0;
  virtual absl::Status ReadRaw(uint64_t lease_id, uint32_t layer, uint32_t block_begin,
                               uint32_t num_blocks, uint32_t head_begin, uint32_t head_end,
                               uint8_t* k, uint8_t* v) = 0;
  // The sink rows of the lease's first block at `layer`, as its sink page stores them (a
  // namespace with NamespaceSpec.sink_tokens): k and v are [head_end - head_begin][sink_tokens]
  // [head_dim] fp16, the first sink_tokens tokens exact; rows at or past the tokens the layer
  // holds are zeros. FAILED_PRECONDITION when the namespace keeps no sinks; otherwise the checks
  // of ReadRaw (of block 0).
  virtual absl::Status ReadRawSinks(uint64_t lease_id, uint32_t layer, uint32_t head_begin,
                                    uint32_t head_end, uint8_t* k, uint8_t* v) = 0;
  // ReadFp16 of layers [layer_begin, layer_end) in one backend call into backend (arena) memory
  // at `dst`, e.g. a transfer staging buffer: for each layer ascending, K then V, each
  // [num_blocks*block_tokens][heads][head_dim]. Same checks as ReadFp16; synchronous.
  virtual absl::Status ReadFp16ToArena(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                                       uint32_t block_begin, uint32_t num_blocks,
                                       uint32_t head_begin, uint32_t head_end, uint8_t* dst) = 0;
  // The raw pages of layers [layer_begin, layer_end) gathered, in one backend call, into
  // backend (arena) memory at `dst`: for each layer ascending, K then V, each
  // [num_blocks][heads] head pages of that layer's layout, and with `sinks` then the layer's sink
  // rows, K then V, as ReadRawSinks returns them. `sinks` takes block_begin 0 and a namespace
  // that keeps sink tokens (FAILED_PRECONDITION otherwise). Synchronous.
  virtual absl::Status ReadRawToArena(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                                      uint32_t block_begin, uint32_t num_blocks,
                                      uint32_t head_begin, uint32_t head_end, bool sinks,
                                      uint8_t* dst) = 0;

  // ---- Decode ---------------------------------------------------------------------------------
  // Appends fp16 K/V [num_tokens][num_kv_heads][head_dim] to `layer` of the lease's tail.
  // token_ids (empty or num_tokens long) name the tokens, for publishing full tail blocks.
  // Returns the tokens now reserved for that layer (appends in flight included).
  // FAILED_PRECONDITION on a layer that lost tokens to a failed append (Lease::lost).
  virtual absl::StatusOr<uint32_t> Append(uint64_t lease_id, uint32_t layer,
                                          absl::Span<const int32_t> token_ids, uint32_t num_tokens,
                                          const uint16_t* k, const uint16_t* v) = 0;

  struct AttendItem {
    uint64_t lease_id = 0;
    const uint16_t* q = nullptr;      // [num_q_heads][head_dim] fp16
    const uint16_t* new_k = nullptr;  // optional [num_kv_heads][head_dim], appended first
    const uint16_t* new_v = nullptr;
    int32_t new_token_id = -1;
  };
  // Where Attend writes its results.
  struct AttendOutputs {
    float* out = nullptr;                // [items][num_q_heads][head_dim] fp32, or
    uint16_t* out_fp16 = nullptr;        // the same in fp16: exactly one of the two
    float* lse = nullptr;                // [items][num_q_heads] natural log, or null
    uint32_t* context_tokens = nullptr;  // [items] tokens attended
  };
  // One decode step at `layer` for a batch of leases of one namespace, in one kernel launch.
  // All items are validated before any append.
  virtual absl::Status Attend(uint32_t layer, uint32_t num_q_heads, float sm_scale,
                              absl::Span<const AttendItem> items, const AttendOutputs& outputs) = 0;
  // RESOURCE_EXHAUSTED for an Attend batch over Options::max_attend_batch items, the check
  // Attend makes first: a caller that builds a batch from a request runs it before sizing
  // anything by the request's item count.
  virtual absl::Status CheckAttendBatch(size_t items) const = 0;

  // Leases past their TTL are expired first, as by every other call, so that they are not counted.
  virtual StoreStats Stats() = 0;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_KV_STORE_H_
