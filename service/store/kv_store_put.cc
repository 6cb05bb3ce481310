// KvStore's Put path: a session allocates and pins the blocks to store, quantizes chunks into
// them outside the store lock, and publishes them on Commit.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "service/store/kv_store_impl.h"

namespace kvpool::store_internal {
namespace {

class PutSessionImpl final : public KvStore::PutSession {
 public:
  // `cached` leading blocks of `chain` are published and pinned by this session; `blocks` are
  // allocated for the rest of `chain`.
  PutSessionImpl(StoreImpl* store, NamespaceState* ns, std::vector<int32_t> token_ids,
                 std::vector<BlockHash> chain, size_t cached, std::vector<int32_t> blocks)
      : store_(store), ns_(ns), token_ids_(std::move(token_ids)), chain_(std::move(chain)),
        cached_(cached), blocks_(std::move(blocks)),
        covered_(blocks_.size() * ns->num_layers() * ns->block_tokens(), false) {}

  ~PutSessionImpl() override {
    if (done_) return;
    absl::MutexLock l(&store_->mu());
    ReleaseLocked(/*free_blocks=*/true);
  }

  const NamespaceInfo& info() const override { return ns_->info; }
  uint32_t tokens_cached() const override {
    return static_cast<uint32_t>(cached_ * ns_->block_tokens());
  }
  uint32_t tokens_to_store() const override {
    return static_cast<uint32_t>(blocks_.size() * ns_->block_tokens());
  }
  uint32_t tokens_ignored() const override {
    return static_cast<uint32_t>(token_ids_.size() - chain_.size() * ns_->block_tokens());
  }

  absl::Status AddChunk(uint32_t layer, uint32_t token_begin, uint32_t num_tokens,
                        const uint16_t* k, const uint16_t* v) override {
    const LayerChunk chunk{layer, k, v};
    return AddChunksFrom(Src::kHost, token_begin, num_tokens, {&chunk, 1});
  }
  absl::Status AddChunksFromArena(uint32_t token_begin, uint32_t num_tokens,
                                  absl::Span<const LayerChunk> chunks) override {
    return AddChunksFrom(Src::kArena, token_begin, num_tokens, chunks);
  }
  absl::StatusOr<KvStore::PutResult> Commit() override;

 private:
  // Where a chunk's k and v live: host memory, or arena memory (AddChunksFromArena).
  enum class Src { kHost, kArena };
  absl::Status AddChunksFrom(Src src, uint32_t token_begin, uint32_t num_tokens,
                             absl::Span<const LayerChunk> chunks);
  // Tokens [first, first + count) of session block `block` of `layer` whose quantization error
  // a quality sample measures; k and v are their fp16 input (host or arena memory).
  struct Sample {
    uint32_t layer;
    size_t block;
    size_t first;
    size_t count;
    const uint16_t* k;
    const uint16_t* v;
  };
  // Records `chunk`'s quantized tokens [begin, end); every quality_sample_every chunks, the
  // sample of their first block to measure.
  std::optional<Sample> FinishChunk(const LayerChunk& chunk, uint32_t token_begin, size_t begin,
                                    size_t end);
  // Measures every sample of one AddChunksFrom call, the arena inputs read in one call.
  absl::Status MeasureSamples(Src src, absl::Span<const Sample> samples);
  size_t CoverIndex(size_t block, uint32_t layer, size_t offset) const {
    return (block * ns_->num_layers() + layer) * ns_->block_tokens() + offset;
  }
  // Unpins the cached prefix and, when asked, frees the session's blocks.
  void ReleaseLocked(bool free_blocks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_->mu()) {
    for (size_t b = 0; b < cached_; ++b) ns_->index.Unpin(chain_[b]);
    if (free_blocks) ns_->pool->Free(blocks_);
    done_ = true;
  }
  // Reads back block `block` (session-relative) of `layer` and measures the error of its tokens
  // [first, first + count), whose fp16 input starts at k/v.
  absl::Status SampleError(uint32_t layer, size_t block, size_t first, size_t count,
                           const uint16_t* k, const uint16_t* v);

  StoreImpl* const store_;
  NamespaceState* const ns_;
  const std::vector<int32_t> token_ids_;
  const std::vector<BlockHash> chain_;  // hashes of every full block
  const size_t cached_;
  const std::vector<int32_t> blocks_;   // ids of chain_[cached_ ..]
  std::vector<bool> covered_;           // [block][layer][token] written
  bool done_ = false;                   // committed, or released after a failed commit
};

absl::Status PutSessionImpl::AddChunksFrom(Src src, uint32_t token_begin, uint32_t num_tokens,
                                           absl::Span<const LayerChunk> chunks) {
  if (done_) return absl::FailedPreconditionError("put session already committed");
  const NamespaceConfig& config = ns_->info.config;
  if (num_tokens == 0) return absl::InvalidArgumentError("empty chunk payload");
  if (static_cast<uint64_t>(token_begin) + num_tokens > token_ids_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("chunk tokens [%d, %d) outside the sequence of %d tokens", token_begin,
                        static_cast<uint64_t>(token_begin) + num_tokens, token_ids_.size()));
  }
  const size_t per_token = static_cast<size_t>(config.num_kv_heads) * config.head_dim;
  const size_t elems = num_tokens * per_token;
  std::vector<ComputeBackend::HalfRangeCheck> checks;
  std::vector<bool> named(config.num_layers);
  for (const LayerChunk& c : chunks) {
    if (c.layer >= static_cast<uint32_t>(config.num_layers)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d out of range [0, %d)", c.layer, config.num_layers));
    }
    if (named[c.layer]) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d named twice", c.layer));
    }
    named[c.layer] = true;
    if (c.k == nullptr || c.v == nullptr) return absl::InvalidArgumentError("empty chunk payload");
    const uint16_t bound = MaxInputHalfBits(ns_->pool->layout(c.layer));
    checks.push_back({c.k, elems, bound, "k"});
    checks.push_back({c.v, elems, bound, "v"});
  }
  ComputeBackend* backend = store_->backend();
  if (src == Src::kArena) {
    if (absl::Status s = backend->CheckHalfRangeArena(checks); !s.ok()) return s;
  } else {
    for (const ComputeBackend::HalfRangeCheck& c : checks) {
      if (absl::Status s = CheckHalfRange(c.x, c.n, c.max_abs_bits, c.what); !s.ok()) return s;
    }
  }

  const size_t bt = config.block_tokens;
  const size_t store_begin = cached_ * bt;
  const size_t store_end = chain_.size() * bt;
  const size_t begin = std::max<size_t>(token_begin, store_begin);
  const size_t end = std::min<size_t>(token_begin + num_tokens, store_end);
  if (begin >= end) return absl::OkStatus();  // only cached or trailing tokens

  const size_t n = end - begin;
  std::vector<int64_t> slots(n);
  std::vector<int32_t> positions(n);
  for (size_t i = 0; i < n; ++i) {
    const size_t t = begin + i;
    slots[i] = static_cast<int64_t>(blocks_[t / bt - cached_]) * bt + t % bt;
    positions[i] = static_cast<int32_t>(t);
  }
  std::vector<QuantizeAppendParams> ps;
  for (const LayerChunk& c : chunks) {
    QuantizeAppendParams& p = ps.emplace_back(ns_->pool->AppendParams(c.layer));
    p.k = c.k + (begin - token_begin) * per_token;
    p.v = c.v + (begin - token_begin) * per_token;
    p.slot_mapping = slots.data();
    p.positions = positions.data();
    p.num_tokens = static_cast<int>(n);
  }
  if (src == Src::kArena) {
    if (absl::Status s = backend->QuantizeAppendFromArena(ps); !s.ok()) return s;
  } else {
    for (const QuantizeAppendParams& p : ps) {
      if (absl::Status s = backend->QuantizeAppend(p); !s.ok()) return s;
    }
  }
  std::vector<Sample> samples;
  for (const LayerChunk& c : chunks) {
    if (std::optional<Sample> sample = FinishChunk(c, token_begin, begin, end)) {
      samples.push_back(*sample);
    }
  }
  return MeasureSamples(src, samples);
}

std::optional<PutSessionImpl::Sample> PutSessionImpl::FinishChunk(const LayerChunk& chunk,
                                                                  uint32_t token_begin,
                                                                  size_t begin, size_t end) {
  const size_t bt = ns_->block_tokens();
  const PageLayout& layout = ns_->pool->layout(chunk.layer);
  for (size_t t = begin; t < end; ++t) {
    covered_[CoverIndex(t / bt - cached_, chunk.layer, t % bt)] = true;
  }
  const int every = store_->options().quality_sample_every;
  bool sample = false;
  {
    absl::MutexLock l(&store_->mu());
    ns_->quantized_bytes += QuantizedBytes(layout, end - begin);
    sample = every > 0 && ns_->put_chunks++ % every == 0;
  }
  if (!sample || !layout.quantized()) return std::nullopt;
  const NamespaceConfig& config = ns_->info.config;
  const size_t per_token = static_cast<size_t>(config.num_kv_heads) * config.head_dim;
  const size_t first_block_end = (begin / bt + 1) * bt;
  return Sample{chunk.layer,
                begin / bt - cached_,
                begin % bt,
                std::min(end, first_block_end) - begin,
                chunk.k + (begin - token_begin) * per_token,
                chunk.v + (begin - token_begin) * per_token};
}

absl::Status PutSessionImpl::MeasureSamples(Src src, absl::Span<const Sample> samples) {
  const NamespaceConfig& config = ns_->info.config;
  const size_t per_token = static_cast<size_t>(config.num_kv_heads) * config.head_dim;
  // Arena inputs: every sample's K rows then V rows, brought to the host in one read.
  std::vector<uint16_t> inputs;
  if (src == Src::kArena && !samples.empty()) {
    std::vector<ComputeBackend::ArenaRun> runs;
    for (const Sample& s : samples) {
      const size_t bytes = s.count * per_token * sizeof(uint16_t);
      runs.push_back({reinterpret_cast<const uint8_t*>(s.k), bytes});
      runs.push_back({reinterpret_cast<const uint8_t*>(s.v), bytes});
      inputs.resize(inputs.size() + 2 * s.count * per_token);
    }
    if (absl::Status s = store_->backend()->ReadRuns(runs, inputs.data()); !s.ok()) return s;
  }
  size_t offset = 0;
  for (const Sample& s : samples) {
    const size_t len = s.count * per_token;
    const uint16_t* k = src == Src::kArena ? inputs.data() + offset : s.k;
    const uint16_t* v = src == Src::kArena ? inputs.data() + offset + len : s.v;
    offset += 2 * len;
    if (absl::Status e = SampleError(s.layer, s.block, s.first, s.count, k, v); !e.ok()) return e;
  }
  return absl::OkStatus();
}

absl::Status PutSessionImpl::SampleError(uint32_t layer, size_t block, size_t first,
                                         size_t count, const uint16_t* k, const uint16_t* v) {
  const NamespaceConfig& config = ns_->info.config;
  const size_t per_token = static_cast<size_t>(config.num_kv_heads) * config.head_dim;
  if (absl::Status s = store_->backend()->Synchronize(); !s.ok()) return s;
  const int32_t id = blocks_[block];
  std::vector<uint16_t> k_out(config.block_tokens * per_token);
  std::vector<uint16_t> v_out(k_out.size());
  DequantizeParams d;
  d.layout = ns_->pool->layout(layer);
  d.pages = ns_->pool->layer_base(layer);
  d.block_ids = &id;
  d.num_out_blocks = 1;
  d.head_begin = 0;
  d.head_end = config.num_kv_heads;
  d.k_out = k_out.data();
  d.v_out = v_out.data();
  d.num_blocks = ns_->pool->num_blocks();
  if (absl::Status s = store_->backend()->Dequantize(d); !s.ok()) return s;
  const size_t len = count * per_token;
  std::vector<uint16_t> approx(k_out.begin() + first * per_token,
                               k_out.begin() + first * per_token + len);
  approx.insert(approx.end(), v_out.begin() + first * per_token,
                v_out.begin() + first * per_token + len);
  std::vector<uint16_t> exact(k, k + len);
  exact.insert(exact.end(), v, v + len);
  const double err = RelativeL2Error(approx, exact);
  absl::MutexLock l(&store_->mu());
  store_->RecordQuantErrorLocked(*ns_, err);
  return absl::OkStatus();
}

absl::StatusOr<KvStore::PutResult> PutSessionImpl::Commit() {
  if (done_) return absl::FailedPreconditionError("put session already committed");
  const int layers = ns_->num_layers();
  const size_t bt = ns_->block_tokens();
  for (size_t b = 0; b < blocks_.size(); ++b) {
    for (int l = 0; l < layers; ++l) {
      for (size_t t = 0; t < bt; ++t) {
        if (!covered_[CoverIndex(b, l, t)]) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "put incomplete: layer %d of tokens [%d, %d) not fully written", l,
              (cached_ + b) * bt, (cached_ + b + 1) * bt));
        }
      }
    }
  }
  if (absl::Status s = store_->backend()->Synchronize(); !s.ok()) return s;
  absl::MutexLock l(&store_->mu());
  // Only a committed Put counts its lookup and refreshes its cached prefix: one that fails changes
  // nothing (its prefix stayed pinned, so unevictable, until now).
  for (size_t b = 0; b < cached_; ++b) ns_->index.Touch(chain_[b]);
  ns_->prefix_query_tokens += token_ids_.size();
  ns_->prefix_hit_tokens += tokens_cached();
  size_t duplicates = 0;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const size_t i = cached_ + b;
    const BlockHash& parent = i == 0 ? ns_->index.root() : chain_[i - 1];
    // The parent is pinned by this session or was published just before.
    absl::StatusOr<int32_t> published = ns_->index.Insert(parent, chain_[i], blocks_[b]);
    // A concurrent put published the same block first: ours is a duplicate.
    if (!published.ok() || *published != blocks_[b]) {
      ns_->pool->Free({blocks_[b]});
      ++duplicates;
    }
  }
  ReleaseLocked(/*free_blocks=*/false);
  const uint32_t duplicate_tokens = static_cast<uint32_t>(duplicates * bt);
  KvStore::PutResult r;
  r.tokens_cached = tokens_cached() + duplicate_tokens;
  r.tokens_stored = tokens_to_store() - duplicate_tokens;
  r.tokens_ignored = tokens_ignored();
  return r;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvStore::PutSession>> StoreImpl::BeginPut(
    std::string_view ns_name, absl::Span<const int32_t> token_ids, uint64_t max_payload_bytes) {
  if (absl::Status s = CheckTokenIds(token_ids, /*allow_empty=*/false); !s.ok()) return s;
  absl::StatusOr<Chained> chained = ChainIn(ns_name, token_ids);
  if (!chained.ok()) return chained.status();
  NamespaceState& ns = *chained->ns;
  std::vector<BlockHash>& chain = chained->chain;
  std::vector<int32_t> ids(token_ids.begin(), token_ids.end());  // copied outside mu_ too
  absl::MutexLock l(&mu_);
  ExpireLocked();
  const size_t cached = ns.index.LongestPrefix(chain);
  const uint64_t new_tokens = (chain.size() - cached) * static_cast<uint64_t>(ns.block_tokens());
  const uint64_t payload = new_tokens * static_cast<uint64_t>(Fp16BytesPerToken(ns.info.config));
  if (payload > max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "Put of %d new tokens needs %d bytes of fp16 K/V, more than the %d its stream may still "
        "carry (--max_put_stream_bytes); nothing evicted",
        new_tokens, payload, max_payload_bytes));
  }
  // Pin the cached prefix first so that eviction for our blocks cannot take it.
  for (size_t b = 0; b < cached; ++b) ns.index.Pin(chain[b]);
  // Without a cached prefix the first new block starts the sequence.
  absl::StatusOr<std::vector<int32_t>> blocks =
      AllocateLocked(ns, chain.size() - cached, cached == 0 && !chain.empty() ? 1 : 0);
  if (!blocks.ok()) {
    for (size_t b = 0; b < cached; ++b) ns.index.Unpin(chain[b]);
    return blocks.status();
  }
  return std::unique_ptr<PutSession>(
      new PutSessionImpl(this, &ns, std::move(ids), std::move(chain), cached, *std::move(blocks)));
}

absl::StatusOr<NamespaceInfo> StoreImpl::CheckPut(std::string_view ns_name,
                                                  absl::Span<const int32_t> token_ids) const {
  if (absl::Status s = CheckTokenIds(token_ids, /*allow_empty=*/false); !s.ok()) return s;
  return GetNamespace(ns_name);
}

}  // namespace kvpool::store_internal
