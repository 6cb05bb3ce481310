// KvStore: namespaces, Match/leases and stats. Put sessions are in kv_store_put.cc, Get and
// Append in kv_store_decode.cc, Attend in kv_store_attend.cc.
#include "service/store/kv_store.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/fp16.h"
#include "service/store/kv_store_impl.h"

namespace kvpool {
namespace store_internal {
namespace {

// Weight of a new quantization-error sample in the EWMA.
constexpr double kQuantErrorEwmaWeight = 0.1;

KvStore::Options WithDefaults(KvStore::Options o) {
  if (o.clock == nullptr) o.clock = SystemClock();
  return o;
}

// The magnitude bits of fp16 values (sign cleared) order like their magnitudes, NaN and Inf
// above every finite one. Whole blocks run a loop of a fixed count that the compiler vectorizes
// at -O2, built for AVX-512 and AVX2 as well on x86-64 (picked at load time); a block whose
// largest magnitude is past the bound is scanned again for the first such value.
constexpr size_t kBlock = 256;
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
uint16_t
MaxMagnitudeBits(const uint16_t* x) {
  uint16_t m = 0;
  for (size_t i = 0; i < kBlock; ++i) m = std::max<uint16_t>(m, x[i] & 0x7FFFu);
  return m;
}

// Adds sum (a - x)^2 to *err and sum x^2 to *norm over one block of kSquaresBlock values, in 8
// independent double sums (a single sum is a chain of dependent adds), vectorized like
// MaxMagnitudeBits.
constexpr size_t kSquaresBlock = 1024;
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void AddSquares(const float* a, const float* x, double* err, double* norm) {
  double e8[8] = {}, n8[8] = {};
  for (size_t i = 0; i < kSquaresBlock; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const double e = x[i + j];
      const double d = a[i + j] - e;
      e8[j] += d * d;
      n8[j] += e * e;
    }
  }
  for (int j = 0; j < 8; ++j) {
    *err += e8[j];
    *norm += n8[j];
  }
}

}  // namespace

absl::Status HalfRangeError(const char* what, size_t index, uint16_t max_abs_bits) {
  if (max_abs_bits >= kHalfMaxFiniteBits) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s holds NaN or Inf at element %d", what, index));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s holds NaN, Inf or a magnitude over %g at element %d: the layer's rotation (for q, times "
      "sm_scale) could carry it past fp16",
      what, HalfToFloat(max_abs_bits), index));
}

absl::Status CheckHalfRange(const uint16_t* x, size_t n, uint16_t max_abs_bits, const char* what) {
  for (size_t begin = 0; begin < n; begin += kBlock) {
    uint16_t m = 0;
    if (n - begin >= kBlock) {
      m = MaxMagnitudeBits(x + begin);
    } else {
      for (size_t i = begin; i < n; ++i) m = std::max<uint16_t>(m, x[i] & 0x7FFFu);
    }
    if (m <= max_abs_bits) continue;
    for (size_t i = begin; i < n; ++i) {
      if ((x[i] & 0x7FFFu) > max_abs_bits) return HalfRangeError(what, i, max_abs_bits);
    }
  }
  return absl::OkStatus();
}

double RelativeL2Error(absl::Span<const uint16_t> approx, absl::Span<const uint16_t> exact) {
  float a[kSquaresBlock], x[kSquaresBlock];
  double err = 0, norm = 0;
  for (size_t begin = 0; begin < exact.size(); begin += kSquaresBlock) {
    const size_t n = std::min(kSquaresBlock, exact.size() - begin);
    HalvesToFloats(approx.data() + begin, a, n);
    HalvesToFloats(exact.data() + begin, x, n);
    if (n == kSquaresBlock) {
      AddSquares(a, x, &err, &norm);
      continue;
    }
    for (size_t i = 0; i < n; ++i) {
      const double e = x[i];
      const double d = a[i] - e;
      err += d * d;
      norm += e * e;
    }
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

uint64_t QuantizedBytes(const PageLayout& layout, uint64_t tokens) {
  return tokens * 2 * layout.num_kv_heads *
         (layout.code_bytes_per_token() + layout.meta_bytes_per_token());
}

StoreImpl::StoreImpl(const Options& options)
    : options_(WithDefaults(options)), leases_(options.max_leases) {}

StoreImpl::~StoreImpl() {
  absl::MutexLock l(&mu_);
  for (const std::shared_ptr<Lease>& lease : leases_.Expire(absl::InfiniteFuture())) {
    FinishLeaseLocked(*lease);
  }
}

absl::StatusOr<NamespaceInfo> StoreImpl::CreateNamespace(const NamespaceConfig& config) {
  if (absl::Status s = ValidateNamespaceConfig(config); !s.ok()) return s;
  for (int layer = 0; layer < config.num_layers; ++layer) {
    if (absl::Status s = backend()->CheckLayout(LayerLayout(config, layer)); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrFormat("namespace %s, layer %d: %s", config.name, layer, s.message()));
    }
  }
  absl::MutexLock l(&mu_);
  if (FindNamespaceLocked(config.name) != nullptr ||
      std::find(creating_.begin(), creating_.end(), config.name) != creating_.end()) {
    return absl::AlreadyExistsError(absl::StrFormat("namespace %s exists", config.name));
  }
  if (namespaces_.size() + creating_.size() >= static_cast<size_t>(options_.max_namespaces)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "namespace limit of %d reached (--max_namespaces)", options_.max_namespaces));
  }
  const uint64_t unreserved = options_.pool_bytes - reserved_bytes_;
  const uint64_t capacity = config.capacity_bytes == 0 ? unreserved : config.capacity_bytes;
  if (capacity > unreserved) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "namespace %s asks for %d bytes, %d of the pool's %d are unreserved", config.name,
        capacity, unreserved, options_.pool_bytes));
  }
  const uint64_t bytes_per_block = BytesPerBlock(config);
  const ArenaBlocks blocks = PlanArena(config, capacity);
  if (blocks.blocks == 0) {
    // A capacity_bytes asked for that holds no block is bad input, which no retry mends; the
    // unreserved rest of the pool (capacity_bytes 0) holding none is the pool's limit.
    const std::string what =
        absl::StrFormat("namespace %s: %d bytes hold no block (%d bytes, with a sink page %d)",
                        config.name, capacity, bytes_per_block, ArenaBytes(config, 1));
    return config.capacity_bytes != 0 ? absl::InvalidArgumentError(what)
                                      : absl::ResourceExhaustedError(what);
  }
  // The arena is allocated and zero-filled without mu_ (that takes long for a large one, and every
  // other call would wait), its name and capacity held meanwhile.
  reserved_bytes_ += capacity;
  creating_.push_back(config.name);
  mu_.Unlock();
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      BlockPool::Create(config, blocks, options_.backend);
  mu_.Lock();
  creating_.erase(std::find(creating_.begin(), creating_.end(), config.name));
  if (!pool.ok()) {
    reserved_bytes_ -= capacity;
    return pool.status();
  }
  NamespaceInfo info;
  info.config = config;
  info.config.capacity_bytes = capacity;
  info.num_blocks = blocks.blocks;
  info.num_sink_blocks = blocks.sink_blocks;
  info.bytes_per_block = bytes_per_block;
  info.bytes_per_token = BytesPerToken(config);
  info.fp16_bytes_per_token = Fp16BytesPerToken(config);
  namespaces_.push_back(std::make_unique<NamespaceState>(
      static_cast<int>(namespaces_.size()), info, *std::move(pool)));
  return info;
}

absl::StatusOr<NamespaceInfo> StoreImpl::GetNamespace(std::string_view name) const {
  absl::MutexLock l(&mu_);
  absl::StatusOr<NamespaceState*> ns = ResolveLocked(name);
  if (!ns.ok()) return ns.status();
  return (*ns)->info;
}

std::vector<NamespaceInfo> StoreImpl::ListNamespaces() const {
  absl::MutexLock l(&mu_);
  std::vector<NamespaceInfo> out;
  for (const auto& ns : namespaces_) out.push_back(ns->info);
  return out;
}

NamespaceState* StoreImpl::FindNamespaceLocked(std::string_view name) const {
  if (name.empty()) return namespaces_.empty() ? nullptr : namespaces_.front().get();
  for (const auto& ns : namespaces_) {
    if (ns->info.config.name == name) return ns.get();
  }
  return nullptr;
}

absl::StatusOr<StoreImpl::Chained> StoreImpl::ChainIn(std::string_view name,
                                                      absl::Span<const int32_t> token_ids) const {
  Chained c;
  {
    absl::MutexLock l(&mu_);
    absl::StatusOr<NamespaceState*> resolved = ResolveLocked(name);
    if (!resolved.ok()) return resolved.status();
    c.ns = *resolved;
  }
  c.chain = HashChain(c.ns->index.root(), token_ids, c.ns->block_tokens());
  return c;
}

absl::StatusOr<NamespaceState*> StoreImpl::ResolveLocked(std::string_view name) const {
  NamespaceState* ns = FindNamespaceLocked(name);
  if (ns == nullptr) {
    return absl::NotFoundError(
        name.empty() ? std::string("no default namespace")
                     : absl::StrFormat("unknown namespace %s", name));
  }
  return ns;
}

absl::Status StoreImpl::CheckTokenIds(absl::Span<const int32_t> token_ids,
                                      bool allow_empty) const {
  if (token_ids.empty() && !allow_empty) {
    return absl::InvalidArgumentError("token_ids is empty");
  }
  if (token_ids.size() > options_.max_sequence_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%d token ids, over the limit of %d (--max_sequence_tokens)",
                        token_ids.size(), options_.max_sequence_tokens));
  }
  for (size_t i = 0; i < token_ids.size(); ++i) {
    if (token_ids[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("token id %d at position %d is negative", token_ids[i], i));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> StoreImpl::AllocateLocked(NamespaceState& ns, size_t n,
                                                               size_t firsts) {
  BlockPool& pool = *ns.pool;
  if (pool.num_sink_blocks() == 0) firsts = 0;
  const size_t evictable = ns.index.size() - ns.index.pinned_nodes();
  if (n > static_cast<size_t>(pool.num_blocks())) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("namespace %s needs %d blocks at once but holds only %d",
                        ns.info.config.name, n, pool.num_blocks()));
  }
  if (pool.num_free() + evictable < n) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "pool full: all %d blocks are pinned by leases or in-flight puts (namespace %s needs "
        "%d, %d free or evictable)",
        pool.num_blocks(), ns.info.config.name, n, pool.num_free() + evictable));
  }
  if (pool.num_free_sink() + ns.index.unpinned_sink_nodes() < firsts) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "namespace %s: %d new sequences need a first block with a sink page, but only %d of its "
        "%d such blocks are free or evictable (the others are pinned by leases or in-flight "
        "puts, or hold lease tails; one per %d blocks, blocks_per_sink_page)",
        ns.info.config.name, firsts, pool.num_free_sink() + ns.index.unpinned_sink_nodes(),
        pool.num_sink_blocks(), ns.info.config.blocks_per_sink_page));
  }
  auto free_blocks = [&](absl::Span<const int32_t> ids) {
    pool.Free(ids);
    ns.evictions += ids.size();
  };
  // Every unpinned node can be evicted: a pinned node's ancestors are pinned too. First blocks
  // free the least recently used block with a sink page, with its subtree.
  const absl::Status broken = absl::InternalError(
      absl::StrFormat("namespace %s: the prefix index has fewer evictable blocks than it counts",
                      ns.info.config.name));
  while (pool.num_free_sink() < firsts) {
    const std::vector<int32_t> freed = ns.index.EvictSinkTree();
    if (freed.empty()) return broken;
    free_blocks(freed);
  }
  // The other blocks take blocks without a sink page, evicting least recently used leaves
  // without one for them; free blocks with a sink page are kept for first blocks while such a
  // leaf can be evicted, and taken before evicting any leaf with a sink page (evicting those to
  // reach blocks without one deeper in their chains took unrelated cached sequences first).
  while (pool.num_free() < n ||
         (pool.num_free() - pool.num_free_sink() < n - firsts && ns.index.evictable_other() > 0)) {
    const std::optional<int32_t> victim = ns.index.EvictOne(/*spare_sink_pages=*/true);
    if (!victim.has_value()) return broken;
    free_blocks({*victim});
  }
  return pool.Allocate(n, firsts);
}

void StoreImpl::RecordQuantErrorLocked(NamespaceState& ns, double rel_error) {
  ns.quant_rel_error = ns.has_quant_error ? (1 - kQuantErrorEwmaWeight) * ns.quant_rel_error +
                                                kQuantErrorEwmaWeight * rel_error
                                          : rel_error;
  ns.has_quant_error = true;
}

// ---- Match / leases ------------------------------------------------------------------------------

absl::StatusOr<KvStore::MatchResult> StoreImpl::Match(std::string_view ns_name,
                                                      absl::Span<const int32_t> token_ids,
                                                      absl::Duration ttl) {
  if (absl::Status s = CheckTokenIds(token_ids, /*allow_empty=*/true); !s.ok()) return s;
  if (ttl < absl::ZeroDuration()) return absl::InvalidArgumentError("negative lease ttl");
  if (ttl == absl::ZeroDuration()) ttl = options_.default_lease_ttl;
  ttl = std::min(ttl, options_.max_lease_ttl);
  absl::StatusOr<Chained> chained = ChainIn(ns_name, token_ids);
  if (!chained.ok()) return chained.status();
  NamespaceState& ns = *chained->ns;
  const std::vector<BlockHash>& chain = chained->chain;
  const int bt = ns.block_tokens();
  auto lease = std::make_shared<Lease>();
  lease->token_ids.assign(token_ids.begin(), token_ids.end());  // copied outside mu_ too

  absl::MutexLock l(&mu_);
  ExpireLocked();
  if (absl::Status s = CheckLeaseTokenIdsLocked(token_ids.size()); !s.ok()) return s;
  const size_t matched = ns.index.LongestPrefix(chain);
  lease->namespace_index = ns.ordinal;
  lease->ttl = ttl;
  lease->matched_tokens = static_cast<uint32_t>(matched * bt);
  lease->layer_tokens.assign(ns.num_layers(), lease->matched_tokens);
  lease->layer_written = lease->layer_tokens;
  lease->written_ahead.resize(ns.num_layers());
  lease->lost.resize(ns.num_layers());
  for (size_t b = 0; b < matched; ++b) {
    Lease::Block block;
    block.id = *ns.index.Find(chain[b]);
    block.hash = chain[b];
    block.pinned = true;
    lease->AddBlock(block);
  }
  lease->hashed_blocks = matched;
  absl::StatusOr<std::shared_ptr<Lease>> added = leases_.Add(lease, options_.clock->Now());
  if (!added.ok()) return added.status();
  lease_token_ids_ += lease->token_ids.size();
  for (const Lease::Block& block : lease->blocks) {
    ns.index.Pin(block.hash);
    ns.index.Touch(block.hash);
  }
  ns.prefix_query_tokens += token_ids.size();
  ns.prefix_hit_tokens += lease->matched_tokens;
  MatchResult r;
  r.lease_id = lease->id;
  r.cached_tokens = lease->matched_tokens;
  r.num_blocks = static_cast<uint32_t>(matched);
  r.expires = lease->expires;
  return r;
}

absl::Status StoreImpl::Release(uint64_t lease_id) {
  absl::MutexLock l(&mu_);
  ExpireLocked();
  std::shared_ptr<Lease> lease = leases_.Remove(lease_id);
  if (lease == nullptr) {
    return absl::NotFoundError(absl::StrFormat("unknown or expired lease %d", lease_id));
  }
  DropLeaseLocked(lease);
  return absl::OkStatus();
}

size_t StoreImpl::ExpireLeases() {
  absl::MutexLock l(&mu_);
  return ExpireLocked();
}

size_t StoreImpl::ExpireLocked() {
  const std::vector<std::shared_ptr<Lease>> expired = leases_.Expire(options_.clock->Now());
  for (const std::shared_ptr<Lease>& lease : expired) DropLeaseLocked(lease);
  return expired.size();
}

void StoreImpl::DropLeaseLocked(const std::shared_ptr<Lease>& lease) {
  lease->dropped = true;
  if (lease->users == 0) FinishLeaseLocked(*lease);
}

void StoreImpl::FinishLeaseLocked(Lease& lease) {
  NamespaceState& ns = *namespaces_[lease.namespace_index];
  for (const Lease::Block& block : lease.blocks) {
    if (block.pinned) {
      // Used until now: a sequence decoded for long ranks by its end, not by its start.
      ns.index.Touch(block.hash);
      ns.index.Unpin(block.hash);
    }
    if (block.owned) ns.pool->Free({block.id});
  }
  lease.blocks.clear();
  lease.block_ids.clear();
  lease_token_ids_ -= lease.token_ids.size();
  lease.token_ids = {};
}

absl::Status StoreImpl::CheckLeaseTokenIdsLocked(uint64_t more) const {
  if (more <= options_.max_lease_token_ids - lease_token_ids_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "leases keep %d token ids; %d more would pass the limit of %d (--max_lease_token_ids)",
      lease_token_ids_, more, options_.max_lease_token_ids));
}

absl::StatusOr<std::shared_ptr<Lease>> StoreImpl::FindLeaseLocked(uint64_t id) {
  std::shared_ptr<Lease> lease = leases_.Find(id, options_.clock->Now());
  if (lease == nullptr) {
    return absl::NotFoundError(absl::StrFormat("unknown or expired lease %d", id));
  }
  return lease;
}

void StoreImpl::RenewLeaseLocked(Lease& lease) { leases_.Renew(lease, options_.clock->Now()); }

absl::StatusOr<KvStore::LeaseView> StoreImpl::DescribeLease(uint64_t lease_id) {
  absl::MutexLock l(&mu_);
  ExpireLocked();
  absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(lease_id);
  if (!lease.ok()) return lease.status();
  LeaseView view;
  view.info = namespaces_[(*lease)->namespace_index]->info;
  view.num_blocks = static_cast<uint32_t>((*lease)->blocks.size());
  view.layer_tokens = (*lease)->layer_written;
  return view;
}

absl::Status StoreImpl::RenewLease(uint64_t lease_id) {
  absl::MutexLock l(&mu_);
  ExpireLocked();
  absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(lease_id);
  if (!lease.ok()) return lease.status();
  RenewLeaseLocked(**lease);
  return absl::OkStatus();
}

StoreStats StoreImpl::Stats() {
  absl::MutexLock l(&mu_);
  ExpireLocked();
  StoreStats s;
  s.backend = options_.backend->name();
  s.active_leases = leases_.size();
  s.lease_token_ids = lease_token_ids_;
  s.memory = options_.backend->Stats();
  for (const auto& ns : namespaces_) {
    NamespaceStoreStats n;
    n.name = ns->info.config.name;
    n.blocks_total = ns->pool->num_blocks();
    n.blocks_free = ns->pool->num_free();
    n.blocks_evictable = ns->index.size() - ns->index.pinned_nodes();
    n.blocks_in_use = n.blocks_total - n.blocks_free - n.blocks_evictable;
    n.sink_blocks_total = ns->pool->num_sink_blocks();
    n.sink_blocks_free = ns->pool->num_free_sink();
    n.bytes_per_block = ns->info.bytes_per_block;
    n.tokens_stored = static_cast<uint64_t>(ns->index.size()) * ns->block_tokens();
    n.evictions = ns->evictions;
    n.quantized_bytes = ns->quantized_bytes;
    n.prefix_query_tokens = ns->prefix_query_tokens;
    n.prefix_hit_tokens = ns->prefix_hit_tokens;
    n.bytes_per_token = ns->info.bytes_per_token;
    n.fp16_bytes_per_token = ns->info.fp16_bytes_per_token;
    n.quant_rel_error = ns->quant_rel_error;
    s.namespaces.push_back(std::move(n));
  }
  return s;
}

}  // namespace store_internal

absl::StatusOr<std::unique_ptr<KvStore>> KvStore::Create(const Options& options) {
  if (options.backend == nullptr) return absl::InvalidArgumentError("no compute backend");
  if (options.pool_bytes == 0) return absl::InvalidArgumentError("pool_bytes is 0");
  if (options.max_leases == 0 || options.max_namespaces <= 0 || options.max_sequence_tokens == 0 ||
      options.max_attend_batch == 0 || options.max_lease_token_ids == 0) {
    return absl::InvalidArgumentError("store limits must be positive");
  }
  if (options.default_lease_ttl <= absl::ZeroDuration() ||
      options.max_lease_ttl < options.default_lease_ttl) {
    return absl::InvalidArgumentError(
        "lease ttls must satisfy 0 < default_lease_ttl <= max_lease_ttl");
  }
  if (options.quality_sample_every < 0) {
    return absl::InvalidArgumentError("quality_sample_every must not be negative");
  }
  return std::unique_ptr<KvStore>(new store_internal::StoreImpl(options));
}

}  // namespace kvpool
