// KvStore's Attend: one decode step for a batch of leases, in one attention launch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "service/store/kv_store_impl.h"

namespace kvpool::store_internal {

absl::Status StoreImpl::CheckAttendBatch(size_t items) const {
  if (items <= options_.max_attend_batch) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrFormat("attend batch of %d items, over the limit of %d (--max_attend_batch)", items,
                      options_.max_attend_batch));
}

namespace {

// The scale of the scores: sm_scale, or 1 / sqrt(head_dim) for 0.
float ScoreScale(float sm_scale, const NamespaceConfig& config) {
  return sm_scale > 0 ? sm_scale : 1.0f / std::sqrt(static_cast<float>(config.head_dim));
}

}  // namespace

absl::Status StoreImpl::Attend(uint32_t layer, uint32_t num_q_heads, float sm_scale,
                               absl::Span<const AttendItem> items, const AttendOutputs& outputs) {
  if (items.empty()) return absl::InvalidArgumentError("attend batch is empty");
  if (absl::Status s = CheckAttendBatch(items.size()); !s.ok()) return s;
  if ((outputs.out == nullptr) == (outputs.out_fp16 == nullptr) ||
      outputs.context_tokens == nullptr) {
    return absl::InvalidArgumentError("null output buffer, or not exactly one of out and out_fp16");
  }
  if (!std::isfinite(sm_scale) || sm_scale < 0) {
    return absl::InvalidArgumentError("sm_scale must be finite and not negative");
  }
  LeaseUse use(this);
  // The items' namespace and its layout never change once made: the inputs are checked against
  // them before the store lock is taken again, so that screening a large batch does not hold up
  // every other call. (The leases are looked up again then: one may be gone meanwhile.)
  NamespaceState* ns = nullptr;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked();
    for (size_t i = 0; i < items.size(); ++i) {
      absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(items[i].lease_id);
      if (!lease.ok()) return lease.status();
      if (i == 0) {
        ns = namespaces_[(*lease)->namespace_index].get();
      } else if ((*lease)->namespace_index != ns->ordinal) {
        return absl::InvalidArgumentError(
            absl::StrFormat("item %d: lease %d is not in namespace %s", i, items[i].lease_id,
                            ns->info.config.name));
      }
    }
  }
  const NamespaceConfig& config = ns->info.config;
  if (layer >= static_cast<uint32_t>(config.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d out of range [0, %d)", layer, config.num_layers));
  }
  if (num_q_heads == 0 || num_q_heads % config.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_q_heads %d is not a positive multiple of the %d KV heads", num_q_heads,
                        config.num_kv_heads));
  }
  if (absl::Status s = backend()->CheckAttentionShape(items.size(), num_q_heads); !s.ok()) {
    return s;
  }
  const size_t q_elems = static_cast<size_t>(num_q_heads) * config.head_dim;
  const size_t kv_elems = static_cast<size_t>(config.num_kv_heads) * config.head_dim;
  const uint16_t bound = MaxInputHalfBits(ns->pool->layout(layer));
  const uint16_t q_bound = MaxQueryHalfBits(ns->pool->layout(layer), ScoreScale(sm_scale, config));
  // The new tokens' K and V, copied before they are checked: the check then covers what the
  // kernel reads even when the caller's buffers change meanwhile (shared memory).
  std::vector<uint16_t> new_k, new_v;
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendItem& item = items[i];
    if (item.q == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("item %d: empty q", i));
    }
    if (absl::Status s = CheckHalfRange(item.q, q_elems, q_bound, "q"); !s.ok()) return s;
    if ((item.new_k == nullptr) != (item.new_v == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: new_k and new_v must come together", i));
    }
    if (item.new_k == nullptr) continue;
    if (item.new_token_id < -1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "item %d: new token id %d: ids are not negative (-1 = unknown)", i, item.new_token_id));
    }
    if (new_k.empty()) {  // sized once: growth item by item page-faulted at every decode step
      new_k.reserve(items.size() * kv_elems);
      new_v.reserve(items.size() * kv_elems);
    }
    new_k.insert(new_k.end(), item.new_k, item.new_k + kv_elems);
    new_v.insert(new_v.end(), item.new_v, item.new_v + kv_elems);
    if (absl::Status s =
            CheckHalfRange(new_k.data() + new_k.size() - kv_elems, kv_elems, bound, "new_k");
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            CheckHalfRange(new_v.data() + new_v.size() - kv_elems, kv_elems, bound, "new_v");
        !s.ok()) {
      return s;
    }
  }

  std::vector<AppendPlan> plans;
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  std::vector<int32_t> seq_lens(items.size());
  std::unique_ptr<int32_t[]> block_tables;  // [items][max_blocks], written row by row
  int max_blocks = 0;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked();
    std::vector<std::shared_ptr<Lease>> leases;
    for (const AttendItem& item : items) {
      absl::StatusOr<std::shared_ptr<Lease>> lease = FindLeaseLocked(item.lease_id);
      if (!lease.ok()) return lease.status();
      leases.push_back(*std::move(lease));
    }
    // Each lease's namespace was checked above and never changes.
    for (size_t i = 0; i < items.size(); ++i) {
      const AttendItem& item = items[i];
      const Lease& lease = *leases[i];
      if (absl::Status s = lease.CheckLayerUsable(layer); !s.ok()) {
        return absl::FailedPreconditionError(absl::StrFormat("item %d: %s", i, s.message()));
      }
      if (lease.layer_written[layer] != lease.layer_tokens[layer]) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "item %d: lease %d has an append in flight at layer %d (%d tokens reserved, %d "
            "written); a layer of a lease takes one append or decode step at a time",
            i, item.lease_id, layer, lease.layer_tokens[layer], lease.layer_written[layer]));
      }
      if (item.new_k != nullptr) {
        plans.push_back(
            AppendPlan{leases[i].get(), 1, absl::Span<const int32_t>(&item.new_token_id, 1)});
      } else if (lease.layer_tokens[layer] == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "item %d: lease %d holds no tokens at layer %d", i, item.lease_id, layer));
      }
    }
    if (absl::Status s =
            ReserveAppendsLocked(*ns, layer, absl::MakeSpan(plans), &slots, &positions);
        !s.ok()) {
      return s;
    }
    // An item attends to everything its lease holds up to and including its own new token.
    size_t next_append = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      seq_lens[i] = items[i].new_k != nullptr
                        ? positions[next_append++] + 1
                        : static_cast<int32_t>(leases[i]->layer_tokens[layer]);
      const int blocks = (seq_lens[i] + config.block_tokens - 1) / config.block_tokens;
      max_blocks = std::max(max_blocks, blocks);
    }
    // Rows shorter than max_blocks are padded with their first id (a valid block).
    block_tables.reset(new int32_t[items.size() * max_blocks]);
    for (size_t i = 0; i < items.size(); ++i) {
      const int blocks = (seq_lens[i] + config.block_tokens - 1) / config.block_tokens;
      int32_t* row = block_tables.get() + i * max_blocks;
      std::copy_n(leases[i]->block_ids.begin(), blocks, row);
      std::fill(row + blocks, row + max_blocks, row[0]);
    }
    for (std::shared_ptr<Lease>& lease : leases) {
      RenewLeaseLocked(*lease);
      use.Add(std::move(lease));
    }
  }

  const BlockPool& pool = *ns->pool;
  QuantizeAppendParams p = pool.AppendParams(layer);
  p.k = new_k.data();
  p.v = new_v.data();
  p.slot_mapping = slots.data();
  p.positions = positions.data();
  p.num_tokens = static_cast<int>(plans.size());
  // q goes to the backend in place when the items' rows are already back to back (an AttendSocket
  // region), else gathered.
  bool q_contiguous = true;
  for (size_t i = 1; i < items.size() && q_contiguous; ++i) {
    q_contiguous = items[i].q == items[0].q + i * q_elems;
  }
  std::vector<uint16_t> q;
  if (!q_contiguous) {
    q.reserve(items.size() * q_elems);
    for (const AttendItem& item : items) q.insert(q.end(), item.q, item.q + q_elems);
  }
  PagedDecodeAttentionParams a = pool.AttentionParams(layer);
  a.q = q_contiguous ? items[0].q : q.data();
  a.num_seqs = static_cast<int>(items.size());
  a.num_q_heads = static_cast<int>(num_q_heads);
  a.block_tables = block_tables.get();
  a.max_blocks_per_seq = max_blocks;
  a.seq_lens = seq_lens.data();
  a.sm_scale = ScoreScale(sm_scale, config);
  a.out = outputs.out;
  a.out_fp16 = outputs.out_fp16;
  a.lse = outputs.lse;
  // The new tokens are quantized into their slots in the same backend call, before the attention.
  const absl::Status s = backend()->PagedDecodeAttention(a, plans.empty() ? nullptr : &p);
  for (size_t i = 0; i < items.size(); ++i) {
    outputs.context_tokens[i] = static_cast<uint32_t>(seq_lens[i]);
  }
  absl::MutexLock l(&mu_);
  if (!plans.empty() && s.ok()) {
    ns->quantized_bytes += QuantizedBytes(pool.layout(layer), plans.size());
    CompleteAppendsLocked(*ns, layer, plans);
  } else if (!plans.empty()) {
    AbandonAppendsLocked(layer, plans);
  }
  use.EndLocked();
  return s;
}

}  // namespace kvpool::store_internal
