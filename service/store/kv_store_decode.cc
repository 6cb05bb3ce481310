// KvStore's decode paths: Get (ReadFp16, ReadRaw, and their arena variants), Append, and the
// lease tail that Append and Attend (kv_store_attend.cc) grow and publish.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "service/store/kv_store_impl.h"

namespace kvpool::store_internal {

absl::StatusOr<std::vector<int32_t>> StoreImpl::CheckReadLocked(
    const Lease& lease, uint32_t layer, uint32_t block_begin, uint32_t num_blocks,
    uint32_t head_begin, uint32_t head_end) {
  const NamespaceConfig& config = namespaces_[lease.namespace_index]->info.config;
  if (layer >= static_cast<uint32_t>(config.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d out of range [0, %d)", layer, config.num_layers));
  }
  if (head_begin >= head_end || head_end > static_cast<uint32_t>(config.num_kv_heads)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV heads [%d, %d) not a non-empty range of [0, %d)", head_begin, head_end,
        config.num_kv_heads));
  }
  if (num_blocks == 0 ||
      static_cast<uint64_t>(block_begin) + num_blocks > lease.blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("blocks [%d, %d) not a non-empty range of the lease's %d blocks",
                        block_begin, static_cast<uint64_t>(block_begin) + num_blocks,
                        lease.blocks.size()));
  }
  return std::vector<int32_t>(lease.block_ids.begin() + block_begin,
                              lease.block_ids.begin() + block_begin + num_blocks);
}

namespace {

// The runs of one half (kv: 0 = K, 1 = V) of heads [head_begin, head_end) of `layer`'s pages of
// blocks `ids`, appended to `runs`: a whole block's selected head pages (contiguous) as one run;
// in a block with rows past `valid_rows` (counted from the first block's first), each head
// page's codes and meta of those rows as zeros (null runs).
void AppendRawRuns(const BlockPool& pool, uint32_t layer, int kv, absl::Span<const int32_t> ids,
                   uint32_t head_begin, uint32_t head_end, uint32_t valid_rows,
                   std::vector<ComputeBackend::ArenaRun>* runs) {
  const PageLayout& l = pool.layout(layer);
  const uint32_t bt = static_cast<uint32_t>(l.block_tokens);
  auto add = [runs](const uint8_t* src, size_t bytes) {
    if (bytes > 0) runs->push_back({src, bytes});
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint8_t* page = pool.layer_base(layer) + ids[i] * l.layer_page_bytes();
    const uint64_t first = uint64_t{i} * bt;
    const uint32_t rows =
        valid_rows > first ? static_cast<uint32_t>(std::min<uint64_t>(bt, valid_rows - first)) : 0;
    if (rows == bt) {
      add(page + l.head_page_offset(kv, head_begin), (head_end - head_begin) * l.head_page_bytes());
      continue;
    }
    for (uint32_t h = head_begin; h < head_end; ++h) {
      const uint8_t* head_page = page + l.head_page_offset(kv, h);
      add(head_page, rows * l.code_bytes_per_token());
      add(nullptr, l.codes_bytes() - rows * l.code_bytes_per_token());
      add(head_page + l.codes_bytes(), rows * l.meta_bytes_per_token());
      add(nullptr, l.meta_bytes() - rows * l.meta_bytes_per_token());
    }
  }
}

// The runs of one half (kv: 0 = K, 1 = V) of the sink rows of heads [head_begin, head_end) of
// `layer` of a sequence's first block `first_id`, appended to `runs`: [heads][sink_tokens]
// [head_dim] fp16 as its sink page stores them, rows from `valid_rows` on as zeros (null runs).
// INTERNAL when the block has no sink page.
absl::Status AppendSinkRuns(const BlockPool& pool, uint32_t layer, int kv, int32_t first_id,
                            uint32_t head_begin, uint32_t head_end, uint32_t valid_rows,
                            std::vector<ComputeBackend::ArenaRun>* runs) {
  if (first_id >= pool.num_sink_blocks()) {
    return absl::InternalError("a sequence's first block without a sink page");
  }
  const PageLayout& l = pool.layout(layer);
  const uint8_t* page =
      pool.sink_base(static_cast<int>(layer)) + static_cast<size_t>(first_id) * l.sink_page_bytes();
  const size_t row = static_cast<size_t>(l.head_dim) * sizeof(uint16_t);
  const size_t rows = std::min<size_t>(l.sink_tokens, valid_rows);
  for (uint32_t h = head_begin; h < head_end; ++h) {
    if (rows > 0) runs->push_back({page + l.sink_offset(kv, static_cast<int>(h), 0), rows * row});
    if (rows < static_cast<size_t>(l.sink_tokens)) {
      runs->push_back({nullptr, (l.sink_tokens - rows) * row});
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StoreImpl::ReadPlan> StoreImpl::BeginRead(LeaseUse& use, uint64_t lease_id,
                                                         uint32_t layer_begin, uint32_t layer_end,
                                                         uint32_t block_begin, uint32_t num_blocks,
                                                         uint32_t head_begin, uint32_t head_end) {
  absl::MutexLock l(&mu_);
  ExpireLocked();
  absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(lease_id);
  if (!lease.ok()) return lease.status();
  if (layer_begin >= layer_end) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layers [%d, %d) empty", layer_begin, layer_end));
  }
  ReadPlan plan;
  const NamespaceState& ns = *namespaces_[(*lease)->namespace_index];
  plan.pool = ns.pool.get();
  plan.from_first_block = block_begin == 0;
  const uint64_t first_row = uint64_t{block_begin} * ns.block_tokens();
  for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
    absl::StatusOr<std::vector<int32_t>> checked =
        CheckReadLocked(**lease, layer, block_begin, num_blocks, head_begin, head_end);
    if (!checked.ok()) return checked.status();
    plan.ids = *std::move(checked);
    const uint64_t written = (*lease)->layer_written[layer];
    plan.valid_rows.push_back(static_cast<uint32_t>(written - std::min(written, first_row)));
  }
  RenewLeaseLocked(**lease);
  use.Add(*std::move(lease));
  return plan;
}

namespace {

// The fp16 read of `layer` of `ids` into k and v, rows from `valid_rows` on zeros; a read from a
// sequence's first block (`from_first_block`) takes its sink tokens exact from its sink page.
DequantizeParams Fp16Read(const BlockPool& pool, uint32_t layer, const std::vector<int32_t>& ids,
                          bool from_first_block, uint32_t valid_rows, uint32_t head_begin,
                          uint32_t head_end, uint16_t* k, uint16_t* v) {
  DequantizeParams p;
  p.layout = pool.layout(layer);
  if (from_first_block && p.layout.sink_tokens > 0 && !ids.empty() &&
      ids[0] < pool.num_sink_blocks()) {
    p.first_sink_page = pool.sink_base(static_cast<int>(layer)) +
                        static_cast<size_t>(ids[0]) * p.layout.sink_page_bytes();
  }
  p.pages = pool.layer_base(layer);
  p.block_ids = ids.data();
  p.num_out_blocks = static_cast<int>(ids.size());
  p.head_begin = static_cast<int>(head_begin);
  p.head_end = static_cast<int>(head_end);
  p.k_out = k;
  p.v_out = v;
  p.num_blocks = pool.num_blocks();
  p.valid_tokens = valid_rows;
  return p;
}

}  // namespace

template <typename ReadFn>
absl::Status StoreImpl::PinnedRead(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                                   uint32_t block_begin, uint32_t num_blocks, uint32_t head_begin,
                                   uint32_t head_end, ReadFn&& read) {
  LeaseUse use(this);
  auto begun = BeginRead(use, lease_id, layer_begin, layer_end, block_begin, num_blocks, head_begin,
                         head_end);
  if (!begun.ok()) return begun.status();
  return read(*begun);
}

absl::Status StoreImpl::ReadFp16(uint64_t lease_id, uint32_t layer, uint32_t block_begin,
                                 uint32_t num_blocks, uint32_t head_begin, uint32_t head_end,
                                 uint16_t* k, uint16_t* v) {
  if (k == nullptr || v == nullptr) return absl::InvalidArgumentError("null output buffer");
  return PinnedRead(
      lease_id, layer, layer + 1, block_begin, num_blocks, head_begin, head_end,
      [&](const ReadPlan& plan) {
        return backend()->Dequantize(Fp16Read(*plan.pool, layer, plan.ids, plan.from_first_block,
                                              plan.valid_rows[0], head_begin, head_end, k, v));
      });
}

absl::Status StoreImpl::ReadFp16ToArena(uint64_t lease_id, uint32_t layer_begin,
                                        uint32_t layer_end, uint32_t block_begin,
                                        uint32_t num_blocks, uint32_t head_begin,
                                        uint32_t head_end, uint8_t* dst) {
  if (dst == nullptr) return absl::InvalidArgumentError("null output buffer");
  return PinnedRead(lease_id, layer_begin, layer_end, block_begin, num_blocks, head_begin, head_end,
                    [&](const ReadPlan& plan) {
                      const PageLayout& first = plan.pool->layout(layer_begin);
                      const size_t half = plan.ids.size() * first.block_tokens *
                                          (head_end - head_begin) * first.head_dim;  // values
                      std::vector<DequantizeParams> layers;
                      auto* at = reinterpret_cast<uint16_t*>(dst);
                      for (uint32_t layer = layer_begin; layer < layer_end;
                           ++layer, at += 2 * half) {
                        layers.push_back(Fp16Read(*plan.pool, layer, plan.ids,
                                                  plan.from_first_block,
                                                  plan.valid_rows[layer - layer_begin], head_begin,
                                                  head_end, at, at + half));
                      }
                      return backend()->DequantizeToArena(layers);
                    });
}

absl::Status StoreImpl::ReadRaw(uint64_t lease_id, uint32_t layer, uint32_t block_begin,
                                uint32_t num_blocks, uint32_t head_begin, uint32_t head_end,
                                uint8_t* k, uint8_t* v) {
  if (k == nullptr || v == nullptr) return absl::InvalidArgumentError("null output buffer");
  return PinnedRead(lease_id, layer, layer + 1, block_begin, num_blocks, head_begin, head_end,
                    [&](const ReadPlan& plan) -> absl::Status {
                      for (int kv = 0; kv < 2; ++kv) {
                        std::vector<ComputeBackend::ArenaRun> runs;
                        AppendRawRuns(*plan.pool, layer, kv, plan.ids, head_begin, head_end,
                                      plan.valid_rows[0], &runs);
                        if (absl::Status s = backend()->ReadRuns(runs, kv == 0 ? k : v); !s.ok())
                          return s;
                      }
                      return absl::OkStatus();
                    });
}

absl::Status StoreImpl::CheckKeepsSinks(uint64_t lease_id) {
  absl::StatusOr<LeaseView> lease = DescribeLease(lease_id);
  if (!lease.ok()) return lease.status();
  if (lease->info.config.sink_tokens == 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("namespace %s keeps no sink tokens", lease->info.config.name));
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::ReadRawSinks(uint64_t lease_id, uint32_t layer, uint32_t head_begin,
                                     uint32_t head_end, uint8_t* k, uint8_t* v) {
  if (k == nullptr || v == nullptr) return absl::InvalidArgumentError("null output buffer");
  if (absl::Status s = CheckKeepsSinks(lease_id); !s.ok()) return s;
  return PinnedRead(
      lease_id, layer, layer + 1, 0, 1, head_begin, head_end,
      [&](const ReadPlan& plan) -> absl::Status {
        for (int kv = 0; kv < 2; ++kv) {
          std::vector<ComputeBackend::ArenaRun> runs;
          if (absl::Status s = AppendSinkRuns(*plan.pool, layer, kv, plan.ids[0], head_begin,
                                              head_end, plan.valid_rows[0], &runs);
              !s.ok()) {
            return s;
          }
          if (absl::Status s = backend()->ReadRuns(runs, kv == 0 ? k : v); !s.ok()) return s;
        }
        return absl::OkStatus();
      });
}

absl::Status StoreImpl::ReadRawToArena(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                                       uint32_t block_begin, uint32_t num_blocks,
                                       uint32_t head_begin, uint32_t head_end, bool sinks,
                                       uint8_t* dst) {
  if (dst == nullptr) return absl::InvalidArgumentError("null output buffer");
  if (sinks && block_begin != 0) {
    return absl::FailedPreconditionError("sink rows are read only from a sequence's first block");
  }
  if (sinks) {
    if (absl::Status s = CheckKeepsSinks(lease_id); !s.ok()) return s;
  }
  return PinnedRead(
      lease_id, layer_begin, layer_end, block_begin, num_blocks, head_begin, head_end,
      [&](const ReadPlan& plan) -> absl::Status {
        std::vector<ComputeBackend::ArenaRun> runs;
        runs.reserve(size_t{2} * (layer_end - layer_begin) * plan.ids.size());
        for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
          const uint32_t valid_rows = plan.valid_rows[layer - layer_begin];
          for (int kv = 0; kv < 2; ++kv) {
            AppendRawRuns(*plan.pool, layer, kv, plan.ids, head_begin, head_end, valid_rows, &runs);
          }
          for (int kv = 0; kv < 2 && sinks; ++kv) {
            if (absl::Status s = AppendSinkRuns(*plan.pool, layer, kv, plan.ids[0], head_begin,
                                                head_end, valid_rows, &runs);
                !s.ok()) {
              return s;
            }
          }
        }
        return backend()->GatherArena(runs, dst);
      });
}

absl::Status StoreImpl::ReserveAppendsLocked(NamespaceState& ns, uint32_t layer,
                                             absl::Span<AppendPlan> plans,
                                             std::vector<int64_t>* slots,
                                             std::vector<int32_t>* positions) {
  const size_t bt = ns.block_tokens();
  // Tokens each distinct lease grows by, in first-seen order, and one past the last position
  // its plans name an id for (-1 names none; 0: none named), which its token_ids grow to.
  struct Growth {
    Lease* lease;
    uint64_t tokens;
    uint64_t named_end;
  };
  std::vector<Growth> growth;
  absl::flat_hash_map<Lease*, size_t> slot_of;
  for (const AppendPlan& plan : plans) {
    auto [it, inserted] = slot_of.try_emplace(plan.lease, growth.size());
    if (inserted) growth.push_back({plan.lease, 0, 0});
    Growth& g = growth[it->second];
    const uint64_t begin = plan.lease->layer_tokens[layer] + g.tokens;
    for (size_t i = plan.token_ids.size(); i-- > 0;) {
      if (plan.token_ids[i] >= 0) {
        g.named_end = std::max(g.named_end, begin + i + 1);
        break;
      }
    }
    g.tokens += plan.num_tokens;
  }
  size_t needed = 0;
  size_t firsts = 0;      // leases that take their first block
  uint64_t more_ids = 0;  // at most what the leases' token_ids grow by below
  for (const auto& [lease, n, named_end] : growth) {
    const uint64_t after = lease->layer_tokens[layer] + n;
    if (after > options_.max_sequence_tokens) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "lease %d would hold %d tokens at layer %d, over the limit of %d (--max_sequence_tokens)",
          lease->id, after, layer, options_.max_sequence_tokens));
    }
    const size_t blocks_after = (after + bt - 1) / bt;
    if (blocks_after > lease->blocks.size()) needed += blocks_after - lease->blocks.size();
    if (blocks_after > 0 && lease->blocks.empty()) ++firsts;
    if (named_end > lease->token_ids.size()) more_ids += named_end - lease->token_ids.size();
  }
  if (absl::Status s = CheckLeaseTokenIdsLocked(more_ids); !s.ok()) return s;
  absl::StatusOr<std::vector<int32_t>> ids = AllocateLocked(ns, needed, firsts);
  if (!ids.ok()) return ids.status();
  size_t next_first = 0, next = firsts;  // ids [0, firsts) are for first blocks
  for (const auto& [lease, n, named_end] : growth) {
    const size_t blocks_after = (lease->layer_tokens[layer] + n + bt - 1) / bt;
    while (lease->blocks.size() < blocks_after) {
      Lease::Block block;
      block.id = (*ids)[lease->blocks.empty() ? next_first++ : next++];
      block.owned = true;
      lease->AddBlock(block);
    }
  }
  for (AppendPlan& plan : plans) {
    Lease& lease = *plan.lease;
    plan.begin = lease.layer_tokens[layer];
    for (uint32_t i = 0; i < plan.num_tokens; ++i) {
      const uint32_t pos = lease.layer_tokens[layer]++;
      slots->push_back(static_cast<int64_t>(lease.blocks[pos / bt].id) * bt + pos % bt);
      positions->push_back(static_cast<int32_t>(pos));
      // Room for the ids the plan names, taken now (the limit was checked above); they are
      // written when the append completes.
      if (!plan.token_ids.empty() && plan.token_ids[i] >= 0 && lease.token_ids.size() <= pos) {
        lease_token_ids_ += pos + 1 - lease.token_ids.size();
        lease.token_ids.resize(pos + 1, -1);
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// Moves `mark` over every range of `ranges` it meets, removing them: forward across a range that
// begins at it (to the range's end), or back across one that ends at it (to its begin).
void MoveAcrossRanges(std::vector<std::pair<uint32_t, uint32_t>>& ranges, uint32_t& mark,
                      bool forward) {
  for (auto it = ranges.begin(); it != ranges.end();) {
    if ((forward ? it->first : it->second) != mark) {
      ++it;
      continue;
    }
    mark = forward ? it->second : it->first;
    ranges.erase(it);
    it = ranges.begin();
  }
}

}  // namespace

void StoreImpl::CompleteAppendsLocked(NamespaceState& ns, uint32_t layer,
                                      absl::Span<const AppendPlan> plans) {
  for (const AppendPlan& plan : plans) {
    Lease& lease = *plan.lease;
    // The ids a plan names stand only once its tokens are written: a failed append leaves the
    // ids the lease had (its Match's, or those of a completed append), whatever other layers hold.
    for (uint32_t i = 0; i < plan.token_ids.size(); ++i) {
      if (plan.token_ids[i] >= 0) lease.token_ids[plan.begin + i] = plan.token_ids[i];
    }
    uint32_t& written = lease.layer_written[layer];
    std::vector<std::pair<uint32_t, uint32_t>>& ahead = lease.written_ahead[layer];
    ahead.emplace_back(plan.begin, plan.begin + plan.num_tokens);
    MoveAcrossRanges(ahead, written, /*forward=*/true);  // every finished range it now reaches
  }
  for (const AppendPlan& plan : plans) PublishTailLocked(ns, *plan.lease);
}

void StoreImpl::AbandonAppendsLocked(uint32_t layer, absl::Span<const AppendPlan> plans) {
  for (auto plan = plans.rbegin(); plan != plans.rend(); ++plan) {
    Lease& lease = *plan->lease;
    uint32_t& tokens = lease.layer_tokens[layer];
    std::vector<std::pair<uint32_t, uint32_t>>& lost = lease.lost[layer];
    lost.emplace_back(plan->begin, plan->begin + plan->num_tokens);
    // Failed ranges that end the layer are given back: this one when nothing was reserved after
    // it, and then those lost before it that end the layer.
    MoveAcrossRanges(lost, tokens, /*forward=*/false);
  }
}

void StoreImpl::PublishTailLocked(NamespaceState& ns, Lease& lease) {
  const size_t bt = ns.block_tokens();
  const size_t written =
      *std::min_element(lease.layer_written.begin(), lease.layer_written.end());
  // The walk starts after the blocks already published, so a decode step's append costs the same
  // at any context length.
  for (size_t j = lease.hashed_blocks; j < lease.blocks.size(); ++j) {
    Lease::Block& block = lease.blocks[j];
    const size_t end = (j + 1) * bt;
    if (end > written || lease.token_ids.size() < end) return;
    const absl::Span<const int32_t> ids(lease.token_ids.data() + j * bt, bt);
    if (std::any_of(ids.begin(), ids.end(), [](int32_t id) { return id < 0; })) return;
    // Blocks before j are pinned by this lease (pins cover a prefix), so the parent is
    // published and Insert succeeds.
    const BlockHash parent = j == 0 ? ns.index.root() : lease.blocks[j - 1].hash;
    const BlockHash hash = ChainHash(parent, ids);
    absl::StatusOr<int32_t> published = ns.index.Insert(parent, hash, block.id);
    if (!published.ok()) return;
    block.hash = hash;
    lease.hashed_blocks = j + 1;
    ns.index.Pin(hash);
    block.pinned = true;
    // Ours is now the index's; else the lease keeps its private copy and pins the twin.
    if (*published == block.id) block.owned = false;
  }
}

absl::StatusOr<uint32_t> StoreImpl::Append(uint64_t lease_id, uint32_t layer,
                                           absl::Span<const int32_t> token_ids,
                                           uint32_t num_tokens, const uint16_t* k,
                                           const uint16_t* v) {
  if (num_tokens == 0 || k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("empty append payload");
  }
  if (!token_ids.empty() && token_ids.size() != num_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "token count mismatch: %d token ids for %d tokens", token_ids.size(), num_tokens));
  }
  for (size_t i = 0; i < token_ids.size(); ++i) {
    if (token_ids[i] < -1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token id %d at position %d: ids are not negative (-1 = unknown)", token_ids[i], i));
    }
  }
  NamespaceState* ns = nullptr;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked();
    absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(lease_id);
    if (!lease.ok()) return lease.status();
    ns = namespaces_[(*lease)->namespace_index].get();
  }
  // The namespace's config never changes: the payload is checked outside mu_ (a large append
  // scanned under it held up every other call of the store).
  const NamespaceConfig& config = ns->info.config;
  if (layer >= static_cast<uint32_t>(config.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d out of range [0, %d)", layer, config.num_layers));
  }
  const size_t n = static_cast<size_t>(num_tokens) * config.num_kv_heads * config.head_dim;
  const uint16_t bound = MaxInputHalfBits(ns->pool->layout(layer));
  if (absl::Status s = CheckHalfRange(k, n, bound, "k"); !s.ok()) return s;
  if (absl::Status s = CheckHalfRange(v, n, bound, "v"); !s.ok()) return s;
  LeaseUse use(this);
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  AppendPlan plan;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked();
    absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(lease_id);
    if (!lease.ok()) return lease.status();
    if (absl::Status s = (*lease)->CheckLayerUsable(layer); !s.ok()) return s;
    plan = AppendPlan{lease->get(), num_tokens, token_ids};
    if (absl::Status s =
            ReserveAppendsLocked(*ns, layer, absl::MakeSpan(&plan, 1), &slots, &positions);
        !s.ok()) {
      return s;
    }
    RenewLeaseLocked(**lease);
    use.Add(*std::move(lease));
  }
  const BlockPool& pool = *ns->pool;
  QuantizeAppendParams p = pool.AppendParams(layer);
  p.k = k;
  p.v = v;
  p.slot_mapping = slots.data();
  p.positions = positions.data();
  p.num_tokens = static_cast<int>(num_tokens);
  absl::Status s = backend()->QuantizeAppend(p);
  if (s.ok()) s = backend()->Synchronize();
  absl::MutexLock l(&mu_);
  if (s.ok()) {
    ns->quantized_bytes += QuantizedBytes(p.layout, num_tokens);
    CompleteAppendsLocked(*ns, layer, {plan});
  } else {
    AbandonAppendsLocked(layer, {plan});
  }
  const uint32_t held = plan.lease->layer_tokens[layer];
  use.EndLocked();
  if (!s.ok()) return s;
  return held;
}

}  // namespace kvpool::store_internal
