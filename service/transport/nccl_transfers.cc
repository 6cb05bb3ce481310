#include "service/transport/nccl_transfers.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "kernels/page_layout.h"
#include "service/proto_convert.h"
#include "service/store/namespace_config.h"

namespace kvpool {

void TransferCancel::Set(std::function<void()> abort) {
  absl::MutexLock l(&mu_);
  if (cancelled_) {
    abort();
    return;
  }
  abort_ = std::move(abort);
}

void TransferCancel::Clear() {
  absl::MutexLock l(&mu_);
  abort_ = nullptr;
}

void TransferCancel::Cancel() {
  absl::MutexLock l(&mu_);
  cancelled_ = true;
  if (abort_) abort_();
}

// A staging buffer taken from the pool (or allocated for one oversized round); returned or
// freed on destruction.
class NcclTransfers::Staging {
 public:
  Staging(NcclTransfers* owner, uint8_t* data, uint64_t bytes)
      : owner_(owner), data_(data), bytes_(bytes) {}
  Staging(Staging&& o) noexcept
      : owner_(o.owner_), data_(o.data_), bytes_(o.bytes_), reusable_(o.reusable_) {
    o.data_ = nullptr;
  }
  Staging& operator=(Staging&&) = delete;
  ~Staging() {
    if (data_ != nullptr) owner_->ReturnStaging(data_, bytes_, reusable_);
  }
  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // Freed, never reused: an aborted transfer's kernels may still read it, and the device free
  // waits for them.
  void Discard() { reusable_ = false; }

 private:
  NcclTransfers* owner_;
  uint8_t* data_;
  uint64_t bytes_;
  bool reusable_ = true;
};

namespace {

// The data phase of a transfer on `use`: a cancel aborts its transport. Leaving the phase clears
// the hook; if a cancel aborted the transport, the channel is failed then (removed, not kept as
// an idle channel whose transport is dead), whatever the transfer's own status.
class CancelScope {
 public:
  CancelScope(TransferCancel* cancel, ChannelManager::Use* use) : cancel_(cancel), use_(use) {
    if (cancel_ != nullptr) {
      cancel_->Set([this] {
        aborted_.store(true);
        use_->transport().Abort();
      });
    }
  }
  ~CancelScope() {
    if (cancel_ == nullptr) return;
    cancel_->Clear();  // a running hook has finished once this returns
    if (aborted_.load()) use_->Fail();
  }

 private:
  TransferCancel* const cancel_;
  ChannelManager::Use* const use_;
  std::atomic<bool> aborted_{false};
};

// A Get's first round takes at most this share of a staging buffer.
constexpr uint64_t kFirstGetRoundShare = 8;

// Consecutive layers [begin, end) moved in one round.
struct Round {
  uint32_t begin = 0;
  uint32_t end = 0;
};

// Splits layers into rounds of at most `capacity` bytes, the first of at most `first_capacity`,
// each layer taking 2 * layer_bytes[i] (K and V, each with its sink rows if any); a layer larger
// than its round's capacity is a round of its own.
std::vector<Round> PlanRounds(uint32_t first_layer, const std::vector<uint64_t>& layer_bytes,
                              uint64_t first_capacity, uint64_t capacity) {
  std::vector<Round> rounds;
  uint64_t used = 0;
  for (uint32_t i = 0; i < layer_bytes.size(); ++i) {
    const uint64_t need = 2 * layer_bytes[i];
    if (rounds.empty() || used + need > (rounds.size() == 1 ? first_capacity : capacity)) {
      rounds.push_back({first_layer + i, first_layer + i});
      used = 0;
    }
    rounds.back().end++;
    used += need;
  }
  return rounds;
}

// Runs op(0), ..., op(rounds - 1) in order on a thread of its own, each once the caller has
// released it, so that the caller stores a round while the next one is received. The first
// failure stops the rest. The destructor waits for the operation in flight, if any.
class RoundWorker {
 public:
  RoundWorker(size_t rounds, std::function<absl::Status(size_t)> op)
      : rounds_(rounds), op_(std::move(op)), thread_([this] { Loop(); }) {}
  ~RoundWorker() {
    {
      absl::MutexLock l(&mu_);
      closed_ = true;
      cv_.SignalAll();
    }
    thread_.join();
  }

  // Rounds up to `round` may run.
  void Release(size_t round) {
    absl::MutexLock l(&mu_);
    released_ = std::max(released_, round + 1);
    cv_.SignalAll();
  }
  // Waits until op(round) has finished or an operation failed; returns the first failure.
  absl::Status WaitDone(size_t round) {
    absl::MutexLock l(&mu_);
    while (done_ <= round && status_.ok()) cv_.Wait(&mu_);
    return status_;
  }

 private:
  void Loop() {
    for (size_t i = 0; i < rounds_; ++i) {
      {
        absl::MutexLock l(&mu_);
        while (released_ <= i && !closed_) cv_.Wait(&mu_);
        if (released_ <= i) return;  // closed
      }
      const absl::Status s = op_(i);
      absl::MutexLock l(&mu_);
      done_ = i + 1;
      status_.Update(s);
      cv_.SignalAll();
      if (!s.ok()) return;
    }
  }

  const size_t rounds_;
  const std::function<absl::Status(size_t)> op_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  size_t released_ ABSL_GUARDED_BY(mu_) = 0;  // rounds [0, released_) may run
  size_t done_ ABSL_GUARDED_BY(mu_) = 0;      // rounds [0, done_) have finished
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace

absl::Status CheckTransportOptions(const TransportOptions& options) {
  const ChannelOptions& c = options.channels;
  const absl::Duration zero = absl::ZeroDuration();
  if (c.max_channels == 0 || options.staging_bytes == 0 ||
      options.max_staging_total_bytes < options.staging_bytes || c.idle_timeout <= zero ||
      c.default_join_timeout <= zero || c.max_join_timeout <= zero ||
      options.default_transfer_timeout <= zero || options.max_transfer_timeout <= zero) {
    return absl::InvalidArgumentError(
        "NCCL transport limits and timeouts must be positive, and the staging total at least one "
        "staging buffer");
  }
  return absl::OkStatus();
}

NcclTransfers::NcclTransfers(KvStore* store, ComputeBackend* backend, ChannelManager* channels,
                             Clock* clock, const TransportOptions& options)
    : store_(store),
      backend_(backend),
      channels_(channels),
      clock_(clock),
      options_(options),
      freer_([this] { FreeLoop(); }) {}

NcclTransfers::~NcclTransfers() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  freer_.join();
  for (uint8_t* buffer : idle_staging_) backend_->FreeArena(buffer);
}

void NcclTransfers::FreeLoop() {
  for (;;) {
    std::vector<std::pair<uint8_t*, uint64_t>> batch;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](NcclTransfers* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) {
            return t->stopping_ || !t->to_free_.empty();
          },
          this));
      if (to_free_.empty()) return;  // stopping, nothing left
      batch.swap(to_free_);
    }
    for (const auto& [buffer, bytes] : batch) backend_->FreeArena(buffer);
    absl::MutexLock l(&mu_);
    staging_allocated_ -= batch.size();
    for (const auto& [buffer, bytes] : batch) staging_total_bytes_ -= bytes;
  }
}

size_t NcclTransfers::staging_buffers() const {
  absl::MutexLock l(&mu_);
  return staging_allocated_;
}

absl::StatusOr<NcclTransfers::Staging> NcclTransfers::TakeStaging(uint64_t bytes) {
  const uint64_t size = std::max(bytes, options_.staging_bytes);
  if (size == options_.staging_bytes) {
    absl::MutexLock l(&mu_);
    if (!idle_staging_.empty()) {
      uint8_t* buffer = idle_staging_.back();
      idle_staging_.pop_back();
      return Staging(this, buffer, size);
    }
  }
  {
    absl::MutexLock l(&mu_);
    if (size > options_.max_staging_total_bytes - staging_total_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("NCCL staging buffers take %d bytes; %d more would pass the limit of %d "
                          "(--nccl_staging_total_bytes)",
                          staging_total_bytes_, size, options_.max_staging_total_bytes));
    }
    staging_total_bytes_ += size;  // counted before the allocation: concurrent takes see it
  }
  absl::StatusOr<uint8_t*> buffer = backend_->AllocateArena(size);
  absl::MutexLock l(&mu_);
  if (!buffer.ok()) {
    staging_total_bytes_ -= size;
    return buffer.status();
  }
  ++staging_allocated_;
  return Staging(this, *buffer, size);
}

absl::StatusOr<std::vector<NcclTransfers::Staging>> NcclTransfers::TakeBuffers(size_t rounds,
                                                                               uint64_t bytes) {
  std::vector<Staging> buffers;
  for (size_t i = 0; i < std::min<size_t>(rounds, 2); ++i) {
    absl::StatusOr<Staging> taken = TakeStaging(bytes);
    if (!taken.ok()) return taken.status();
    buffers.push_back(*std::move(taken));
  }
  return buffers;
}

void NcclTransfers::ReturnStaging(uint8_t* buffer, uint64_t bytes, bool reusable) {
  absl::MutexLock l(&mu_);
  if (reusable && bytes == options_.staging_bytes &&
      idle_staging_.size() < options_.max_idle_staging) {
    idle_staging_.push_back(buffer);
  } else {
    to_free_.emplace_back(buffer, bytes);
  }
}

absl::Time NcclTransfers::Deadline(uint32_t timeout_ms) const {
  absl::Duration t =
      timeout_ms == 0 ? options_.default_transfer_timeout : absl::Milliseconds(timeout_ms);
  return clock_->Now() + std::min(t, options_.max_transfer_timeout);
}

absl::Status NcclTransfers::Get(const v1::NcclGetRequest& request,
                                const Emit<v1::NcclGetResponse>& emit, TransferCancel* cancel) {
  const bool raw = request.format() == v1::GET_FORMAT_RAW;
  if (!raw && request.format() != v1::GET_FORMAT_FP16 &&
      request.format() != v1::GET_FORMAT_UNSPECIFIED) {
    return absl::InvalidArgumentError("unknown Get format");
  }
  absl::StatusOr<ChannelManager::Use> use = channels_->Acquire(request.channel_id());
  if (!use.ok()) return use.status();
  absl::StatusOr<KvStore::LeaseView> lease = store_->DescribeLease(request.lease_id());
  if (!lease.ok()) return lease.status();
  const NamespaceConfig& config = lease->info.config;
  const uint32_t layer_end = request.layer_end() == 0 ? config.num_layers : request.layer_end();
  const uint32_t head_end = request.head_end() == 0 ? config.num_kv_heads : request.head_end();
  const uint32_t layer_begin = request.layer_begin();
  const uint32_t head_begin = request.head_begin();
  if (layer_begin >= layer_end || layer_end > static_cast<uint32_t>(config.num_layers) ||
      head_begin >= head_end || head_end > static_cast<uint32_t>(config.num_kv_heads)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layers [%d, %d) / KV heads [%d, %d) not non-empty ranges of %d layers / %d heads",
        layer_begin, layer_end, head_begin, head_end, config.num_layers, config.num_kv_heads));
  }
  const uint32_t num_blocks = lease->num_blocks;
  const uint32_t heads = head_end - head_begin;

  v1::NcclGetResponse first;
  v1::NcclGetDescriptor& d = *first.mutable_header();
  d.set_num_blocks(num_blocks);
  d.set_block_tokens(config.block_tokens);
  d.set_num_heads(heads);
  if (num_blocks == 0) {  // nothing cached (a Match that hit nothing): no layer, no data moves
    // The checks passed: the lease is renewed here, as the reads renew it otherwise.
    if (absl::Status s = store_->RenewLease(request.lease_id()); !s.ok()) return s;
    if (absl::Status s = emit(first); !s.ok()) return s;
    v1::NcclGetResponse last;
    last.mutable_done()->set_bytes(0);
    return emit(last);
  }
  // RAW from a namespace with sink tokens, to a worker that takes them: each layer's sink rows of
  // the first block (always in the transfer, which spans the lease's blocks) follow its V, as a
  // RAW Get sends them.
  const bool sinks = raw && request.sink_rows() && config.sink_tokens > 0;
  const uint64_t sink_bytes =
      sinks ? uint64_t{heads} * config.sink_tokens * config.head_dim * sizeof(uint16_t) : 0;
  uint32_t valid = lease->layer_tokens.empty() ? 0 : lease->layer_tokens[layer_begin];
  std::vector<uint64_t> layer_bytes;  // K (or V) of each layer with its sink rows
  uint64_t offset = 0;
  for (uint32_t l = layer_begin; l < layer_end; ++l) {
    valid = std::min(valid, lease->layer_tokens[l]);
    const PageLayout layout = LayerLayout(config, static_cast<int>(l));
    const uint64_t bytes =
        raw ? uint64_t{num_blocks} * heads * layout.head_page_bytes()
            : uint64_t{num_blocks} * config.block_tokens * heads * config.head_dim * 2;
    v1::NcclLayerSegments* seg = d.add_layers();
    seg->set_layer(l);
    seg->set_k_offset(offset);
    seg->set_v_offset(offset + bytes);
    seg->set_bytes(bytes);
    if (raw) ToProtoLayout(layout, seg->mutable_layout());
    if (sinks) {
      seg->set_sink_k_offset(offset + 2 * bytes);
      seg->set_sink_v_offset(offset + 2 * bytes + sink_bytes);
      seg->set_sink_bytes(sink_bytes);
    }
    layer_bytes.push_back(bytes + sink_bytes);
    offset += 2 * (bytes + sink_bytes);
  }
  d.set_valid_tokens(valid);
  d.set_total_bytes(offset);
  if (offset > request.buffer_bytes()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the payload is %d bytes, the worker's buffer %d", offset, request.buffer_bytes()));
  }
  // The first round is gathered before any byte moves: it takes 1/kFirstGetRoundShare of a
  // buffer (or one layer), so that the data starts sooner. A payload that fits one staging
  // buffer has its rounds side by side in it; a larger one takes two buffers, round i + 1
  // gathered into one while round i is sent from the other. All are taken before the header
  // goes out.
  const uint64_t largest = 2 * *std::max_element(layer_bytes.begin(), layer_bytes.end());
  const uint64_t capacity = std::max(largest, options_.staging_bytes);
  const std::vector<Round> rounds =
      PlanRounds(layer_begin, layer_bytes, capacity / kFirstGetRoundShare, capacity);
  const bool one_buffer = offset <= capacity;
  absl::StatusOr<std::vector<Staging>> buffers =
      TakeBuffers(one_buffer ? 1 : rounds.size(), largest);
  if (!buffers.ok()) return buffers.status();
  std::vector<SendSegment> segments[2];
  // Gathers round i into its buffer and lists its segments.
  auto gather = [&](size_t i) -> absl::Status {
    const Round& r = rounds[i];
    uint8_t* base = (*buffers)[one_buffer ? 0 : i % 2].data();
    if (one_buffer) base += d.layers(static_cast<int>(r.begin - layer_begin)).k_offset();
    absl::Status s = raw ? store_->ReadRawToArena(request.lease_id(), r.begin, r.end, 0, num_blocks,
                                                  head_begin, head_end, sinks, base)
                         : store_->ReadFp16ToArena(request.lease_id(), r.begin, r.end, 0,
                                                   num_blocks, head_begin, head_end, base);
    std::vector<SendSegment>& round = segments[i % 2];
    round.clear();
    for (uint32_t l = r.begin; l < r.end; ++l) {
      const v1::NcclLayerSegments& seg = d.layers(static_cast<int>(l - layer_begin));
      round.push_back({base, seg.bytes()});
      round.push_back({base + seg.bytes(), seg.bytes()});
      if (seg.sink_bytes() > 0) {
        round.push_back({base + 2 * seg.bytes(), seg.sink_bytes()});
        round.push_back({base + 2 * seg.bytes() + seg.sink_bytes(), seg.sink_bytes()});
      }
      base += 2 * (seg.bytes() + seg.sink_bytes());
    }
    return s;
  };
  // Round 0 is read before the header goes out: a read that fails there (the lease released
  // since DescribeLease) gets its status and leaves the channel as it was.
  if (absl::Status s = gather(0); !s.ok()) return s;
  if (absl::Status s = emit(first); !s.ok()) return s;

  // From here the worker waits for data: any failure breaks the channel. A cancel after the data
  // moved (while done is emitted) leaves the channel as it is.
  const absl::Time deadline = Deadline(request.timeout_ms());
  {
    CancelScope scope(cancel, &*use);
    PeerTransport* transport = &use->transport();
    // Round i is gathered while round i - 1 is sent, and queued behind it: the link does not
    // wait for the host between rounds.
    absl::Status s;
    for (size_t i = 0; i < rounds.size() && s.ok(); ++i) {
      if (i >= 2 && !one_buffer) s = transport->WaitSends(1, deadline);  // round i - 2 is out
      if (s.ok() && i > 0) s = gather(i);
      if (s.ok()) s = transport->QueueSend(segments[i % 2], deadline);
    }
    if (s.ok()) s = transport->WaitSends(0, deadline);
    if (!s.ok()) {
      use->Fail();
      // Sends queued before the failure may still read the buffers until the aborted
      // communicator's kernels end.
      for (Staging& b : *buffers) b.Discard();
      return s;
    }
  }
  v1::NcclGetResponse last;
  last.mutable_done()->set_bytes(offset);
  return emit(last);
}

absl::Status NcclTransfers::Put(const v1::NcclPutRequest& request,
                                const Emit<v1::NcclPutResponse>& emit, TransferCancel* cancel) {
  absl::StatusOr<ChannelManager::Use> use = channels_->Acquire(request.channel_id());
  if (!use.ok()) return use.status();
  const std::vector<int32_t> ids(request.token_ids().begin(), request.token_ids().end());
  // The staging buffers are taken before BeginPut, which may evict cached blocks for the Put's
  // own: a Put refused its staging leaves the pool as it was. They are sized for the ids' whole
  // blocks, the most the Put can store; those the cached prefix leaves unneeded go back below.
  absl::StatusOr<NamespaceInfo> info = store_->CheckPut(request.namespace_(), ids);
  if (!info.ok()) return info.status();
  const NamespaceConfig& config = info->config;
  const uint64_t most_bytes =
      Fp16KvBytes(config, ids.size() / config.block_tokens * config.block_tokens);
  const uint64_t capacity = std::max(2 * most_bytes, options_.staging_bytes);
  // Two staging buffers when there is more than one round: round i + 1 is received into one
  // while round i is quantized from the other.
  auto plan_rounds = [&](uint64_t layer_bytes) {
    return layer_bytes > 0 ? PlanRounds(0, std::vector<uint64_t>(config.num_layers, layer_bytes),
                                        capacity, capacity)
                           : std::vector<Round>();
  };
  absl::StatusOr<std::vector<Staging>> buffers =
      TakeBuffers(plan_rounds(most_bytes).size(), 2 * most_bytes);
  if (!buffers.ok()) return buffers.status();
  absl::StatusOr<std::unique_ptr<KvStore::PutSession>> session =
      store_->BeginPut(request.namespace_(), ids);
  if (!session.ok()) return session.status();
  const uint32_t token_begin = (*session)->tokens_cached();
  const uint32_t num_tokens = (*session)->tokens_to_store();
  const uint64_t bytes = Fp16KvBytes(config, num_tokens);
  const std::vector<Round> rounds = plan_rounds(bytes);
  while (buffers->size() > rounds.size()) buffers->pop_back();

  v1::NcclPutResponse first;
  v1::NcclPutPlan& plan = *first.mutable_plan();
  plan.set_tokens_cached(token_begin);
  plan.set_token_begin(token_begin);
  plan.set_num_tokens(num_tokens);
  plan.set_num_layers(config.num_layers);
  plan.set_layer_bytes(bytes);
  if (absl::Status s = emit(first); !s.ok()) return s;

  absl::Status content;  // the first error of the store on the received data
  if (num_tokens > 0) {
    const absl::Time deadline = Deadline(request.timeout_ms());
    CancelScope scope(cancel, &*use);
    PeerTransport* transport = &use->transport();
    std::vector<RecvSegment> segments[2];
    // Receives round i into buffer i % 2.
    auto receive = [&](size_t i) {
      std::vector<RecvSegment>& round = segments[i % 2];
      round.clear();
      uint8_t* at = (*buffers)[i % buffers->size()].data();
      for (uint32_t l = rounds[i].begin; l < rounds[i].end; ++l, at += 2 * bytes) {
        round.push_back({at, bytes});
        round.push_back({at + bytes, bytes});
      }
      return transport->Recv(round, deadline);
    };
    // Stores round i (after a content error only receives, to stay in step with the worker).
    auto store = [&](size_t i) {
      if (!content.ok()) return;
      const std::vector<RecvSegment>& round = segments[i % 2];
      std::vector<KvStore::PutSession::LayerChunk> chunks;
      for (uint32_t l = rounds[i].begin; l < rounds[i].end; ++l) {
        chunks.push_back({l, static_cast<const uint16_t*>(round[2 * (l - rounds[i].begin)].data),
                          static_cast<const uint16_t*>(round[2 * (l - rounds[i].begin) + 1].data)});
      }
      content = (*session)->AddChunksFromArena(token_begin, num_tokens, chunks);
    };
    absl::Status s;
    if (rounds.size() == 1) {
      s = receive(0);
      if (s.ok()) store(0);
    } else {  // round i + 1 is received while round i is stored
      RoundWorker receiver(rounds.size(), receive);
      receiver.Release(1);
      for (size_t i = 0; i < rounds.size() && s.ok(); ++i) {
        s = receiver.WaitDone(i);
        if (!s.ok()) break;
        store(i);
        receiver.Release(i + 2);  // buffer i % 2 is free again
      }
    }
    if (!s.ok()) {
      use->Fail();
      // As in Get: an aborted receive's kernels may still write them.
      for (Staging& b : *buffers) b.Discard();
      return s;
    }
  }
  if (!content.ok()) return content;
  absl::StatusOr<KvStore::PutResult> result = (*session)->Commit();
  if (!result.ok()) return result.status();
  v1::NcclPutResponse last;
  v1::PutResponse& r = *last.mutable_result();
  r.set_tokens_cached(result->tokens_cached);
  r.set_tokens_stored(result->tokens_stored);
  r.set_tokens_ignored(result->tokens_ignored);
  r.set_bytes_received(2 * bytes * config.num_layers);
  return emit(last);
}

}  // namespace kvpool
