// Internal to the store library: the KvStore implementation behind KvStore::Create, shared by
// kv_store.cc (namespaces, leases, stats), kv_store_put.cc (Put sessions), kv_store_decode.cc
// (Get, Append, lease tails) and kv_store_attend.cc (Attend). Nothing outside service/store
// includes this.
//
// Locking: one mutex, StoreImpl::mu_, guards every namespace's BlockPool free list, PrefixIndex
// and counters, the LeaseTable and every Lease. Kernels run without it, on blocks that a lease
// or a put session keeps pinned. Lock order: mu_, then any lock internal to the backend (under
// mu_ the store calls only AllocateArena, FreeArena, name and Stats) or the clock's.
#ifndef KVPOOL_SERVICE_STORE_KV_STORE_IMPL_H_
#define KVPOOL_SERVICE_STORE_KV_STORE_IMPL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "service/store/block_pool.h"
#include "service/store/kv_store.h"
#include "service/store/lease_table.h"
#include "service/store/prefix_index.h"

namespace kvpool::store_internal {

// One namespace: geometry (immutable after creation), blocks, index and counters.
struct NamespaceState {
  NamespaceState(int i, const NamespaceInfo& in, std::unique_ptr<BlockPool> p)
      : ordinal(i),
        info(in),
        pool(std::move(p)),
        index(RootHash(in.config.name), pool->num_sink_blocks()) {}

  const int ordinal;  // position in the store's namespace list (Lease::namespace_index)
  const NamespaceInfo info;
  const std::unique_ptr<BlockPool> pool;  // free list guarded by StoreImpl::mu_
  PrefixIndex index;                      // guarded by StoreImpl::mu_
  // Counters, guarded by StoreImpl::mu_.
  uint64_t evictions = 0;
  uint64_t quantized_bytes = 0;
  uint64_t prefix_query_tokens = 0;
  uint64_t prefix_hit_tokens = 0;
  uint64_t put_chunks = 0;
  double quant_rel_error = 0;  // EWMA of sampled relative L2 errors
  bool has_quant_error = false;

  int block_tokens() const { return info.config.block_tokens; }
  int num_layers() const { return info.config.num_layers; }
};

// INVALID_ARGUMENT naming `what` when one of the n fp16 values is NaN, Inf or of a magnitude
// whose fp16 bits (sign cleared) pass max_abs_bits: kHalfMaxFiniteBits for NaN and Inf alone, a
// layer's MaxInputHalfBits for K and V, MaxQueryHalfBits for q. The first such value is named.
absl::Status CheckHalfRange(const uint16_t* x, size_t n, uint16_t max_abs_bits, const char* what);
// CheckHalfRange's error for element `index`.
absl::Status HalfRangeError(const char* what, size_t index, uint16_t max_abs_bits);
// Relative L2 error ||a - b|| / ||b|| of fp16 `approx` against fp16 `exact`.
double RelativeL2Error(absl::Span<const uint16_t> approx, absl::Span<const uint16_t> exact);
// Page bytes QuantizeAppend writes for `tokens` tokens of one layer (codes + meta, K and V).
uint64_t QuantizedBytes(const PageLayout& layout, uint64_t tokens);

class StoreImpl final : public KvStore {
 public:
  explicit StoreImpl(const Options& options);
  ~StoreImpl() override;

  absl::StatusOr<NamespaceInfo> CreateNamespace(const NamespaceConfig& config) override;
  absl::StatusOr<NamespaceInfo> GetNamespace(std::string_view name) const override;
  std::vector<NamespaceInfo> ListNamespaces() const override;
  absl::StatusOr<std::unique_ptr<PutSession>> BeginPut(
      std::string_view ns, absl::Span<const int32_t> token_ids,
      uint64_t max_payload_bytes = UINT64_MAX) override;
  absl::StatusOr<NamespaceInfo> CheckPut(std::string_view ns,
                                         absl::Span<const int32_t> token_ids) const override;
  absl::StatusOr<MatchResult> Match(std::string_view ns, absl::Span<const int32_t> token_ids,
                                    absl::Duration ttl) override;
  absl::Status Release(uint64_t lease_id) override;
  size_t ExpireLeases() override;
  absl::StatusOr<LeaseView> DescribeLease(uint64_t lease_id) override;
  absl::Status RenewLease(uint64_t lease_id) override;
  absl::Status ReadFp16(uint64_t lease_id, uint32_t layer, uint32_t block_begin,
                        uint32_t num_blocks, uint32_t head_begin, uint32_t head_end, uint16_t* k,
                        uint16_t* v) override;
  absl::Status ReadRaw(uint64_t lease_id, uint32_t layer, uint32_t block_begin, uint32_t num_blocks,
                       uint32_t head_begin, uint32_t head_end, uint8_t* k, uint8_t* v) override;
  absl::Status ReadRawSinks(uint64_t lease_id, uint32_t layer, uint32_t head_begin,
                            uint32_t head_end, uint8_t* k, uint8_t* v) override;
  absl::Status ReadFp16ToArena(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                               uint32_t block_begin, uint32_t num_blocks, uint32_t head_begin,
                               uint32_t head_end, uint8_t* dst) override;
  absl::Status ReadRawToArena(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                              uint32_t block_begin, uint32_t num_blocks, uint32_t head_begin,
                              uint32_t head_end, bool sinks, uint8_t* dst) override;
  absl::StatusOr<uint32_t> Append(uint64_t lease_id, uint32_t layer,
                                  absl::Span<const int32_t> token_ids, uint32_t num_tokens,
                                  const uint16_t* k, const uint16_t* v) override;
  absl::Status Attend(uint32_t layer, uint32_t num_q_heads, float sm_scale,
                      absl::Span<const AttendItem> items, const AttendOutputs& outputs) override;
  absl::Status CheckAttendBatch(size_t items) const override;
  StoreStats Stats() override;

  // ---- shared with the Put session and the decode paths ----------------------------------------
  const Options& options() const { return options_; }
  ComputeBackend* backend() const { return options_.backend; }
  absl::Mutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // `n` blocks of `ns`, the first `firsts` of them for sequences' first blocks (BlockPool::
  // Allocate), evicting unpinned published blocks LRU-first when the free lists are short.
  // RESOURCE_EXHAUSTED, with nothing changed, when pins leave too few.
  absl::StatusOr<std::vector<int32_t>> AllocateLocked(NamespaceState& ns, size_t n, size_t firsts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Folds one sampled relative error into the namespace's EWMA.
  void RecordQuantErrorLocked(NamespaceState& ns, double rel_error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  // Leases in use by one call outside mu_: they stay pinned until the use ends.
  class LeaseUse;
  friend class LeaseUse;

  // The namespace `name` ("" = the first one), or null.
  NamespaceState* FindNamespaceLocked(std::string_view name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The namespace `name` ("" = the first one); NOT_FOUND when there is none.
  absl::StatusOr<NamespaceState*> ResolveLocked(std::string_view name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The namespace `name` names and the hash chain of `token_ids` in it. The chain is hashed
  // outside mu_ (a long sequence's takes milliseconds, which every other call would wait for):
  // namespaces are never removed, and their config and root hash never change.
  struct Chained {
    NamespaceState* ns = nullptr;
    std::vector<BlockHash> chain;
  };
  absl::StatusOr<Chained> ChainIn(std::string_view name, absl::Span<const int32_t> token_ids) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // INVALID_ARGUMENT for a token id list the store cannot hash (empty when !allow_empty, or with
  // a negative id); RESOURCE_EXHAUSTED over max_sequence_tokens.
  absl::Status CheckTokenIds(absl::Span<const int32_t> token_ids, bool allow_empty) const;
  // RESOURCE_EXHAUSTED when the live leases' token ids and `more` of them would pass
  // max_lease_token_ids.
  absl::Status CheckLeaseTokenIdsLocked(uint64_t more) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops leases past their expiry.
  size_t ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `lease` dropped and, unless a call still uses it, unpins and frees its blocks.
  void DropLeaseLocked(const std::shared_ptr<Lease>& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLeaseLocked(Lease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live lease `id`, or NOT_FOUND. Not renewed: a call renews the leases it names once their
  // checks passed (RenewLeaseLocked), so that bad input changes nothing, not even an expiry.
  absl::StatusOr<std::shared_ptr<Lease>> FindLeaseLocked(uint64_t id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RenewLeaseLocked(Lease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Validates a read of lease blocks [block_begin, +num_blocks), heads [head_begin, head_end)
  // of `layer` and returns the block ids.
  absl::StatusOr<std::vector<int32_t>> CheckReadLocked(const Lease& lease, uint32_t layer,
                                                       uint32_t block_begin, uint32_t num_blocks,
                                                       uint32_t head_begin, uint32_t head_end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // What a read outside mu_ needs: the pool, the block ids, and for each layer of the read (from
  // layer_begin) how many of its rows (tokens from the first block's first) hold written tokens.
  // Rows past that keep what their block held before (another sequence's tokens, or an append in
  // flight): reads return zeros there.
  struct ReadPlan {
    const BlockPool* pool = nullptr;
    std::vector<int32_t> ids;
    std::vector<uint32_t> valid_rows;
    bool from_first_block = false;  // ids[0] is the sequence's first block
  };
  // Pins lease `lease_id` in `use`, validates the read for every layer of
  // [layer_begin, layer_end) (CheckReadLocked) and returns its plan.
  absl::StatusOr<ReadPlan> BeginRead(LeaseUse& use, uint64_t lease_id, uint32_t layer_begin,
                                     uint32_t layer_end, uint32_t block_begin, uint32_t num_blocks,
                                     uint32_t head_begin, uint32_t head_end)
      ABSL_LOCKS_EXCLUDED(mu_);
  // BeginRead, then read(plan) outside mu_ while the lease stays pinned: BeginRead's error or
  // read's status. Defined in kv_store_decode.cc, its only user.
  template <typename ReadFn>
  absl::Status PinnedRead(uint64_t lease_id, uint32_t layer_begin, uint32_t layer_end,
                          uint32_t block_begin, uint32_t num_blocks, uint32_t head_begin,
                          uint32_t head_end, ReadFn&& read) ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION when lease `lease_id`'s namespace keeps no sink tokens (NOT_FOUND for no
  // such lease), checked before a read of sink rows, which would renew the lease.
  absl::Status CheckKeepsSinks(uint64_t lease_id) ABSL_LOCKS_EXCLUDED(mu_);

  // One append of `num_tokens` tokens to a lease's tail at one layer.
  struct AppendPlan {
    Lease* lease = nullptr;
    uint32_t num_tokens = 0;
    absl::Span<const int32_t> token_ids;  // empty or num_tokens long; -1 = unknown
    uint32_t begin = 0;                   // first position, set by ReserveAppendsLocked
  };
  // Reserves tail slots for every plan in order (a lease may appear more than once), allocating
  // tail blocks; fills the slot mapping and positions of all planned tokens, concatenated, and
  // each plan's begin. All or nothing: on error nothing changed.
  absl::Status ReserveAppendsLocked(NamespaceState& ns, uint32_t layer,
                                    absl::Span<AppendPlan> plans, std::vector<int64_t>* slots,
                                    std::vector<int32_t>* positions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the planned tokens written (the written watermark moves once the positions before them
  // are written too), takes the token ids the plans name and publishes every tail block that is
  // now complete.
  void CompleteAppendsLocked(NamespaceState& ns, uint32_t layer, absl::Span<const AppendPlan> plans)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a failed backend call: gives back the plans' reservations where nothing was reserved
  // after them (the tail blocks stay with the lease for the next append). A reservation followed
  // by another stays lost (Lease::lost), and the layer's written watermark stops below it, until
  // every reservation after it is given back too.
  void AbandonAppendsLocked(uint32_t layer, absl::Span<const AppendPlan> plans)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes, in order, the lease's tail blocks that every layer has filled and whose token
  // ids are known; a block already published by someone else is pinned there instead.
  void PublishTailLocked(NamespaceState& ns, Lease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  // Append-only, so pointers to NamespaceState stay valid for the store's lifetime.
  std::vector<std::unique_ptr<NamespaceState>> namespaces_ ABSL_GUARDED_BY(mu_);
  // Capacity of the namespaces, those being created included.
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Names of the namespaces whose arenas are being allocated, outside mu_.
  std::vector<std::string> creating_ ABSL_GUARDED_BY(mu_);
  LeaseTable leases_ ABSL_GUARDED_BY(mu_);
  // The token ids the leases in leases_, and those dropped but still in use, keep.
  uint64_t lease_token_ids_ ABSL_GUARDED_BY(mu_) = 0;
};

// Leases used by one call outside mu_. Add and EndLocked require mu_; the destructor takes it
// when the call did not end the use itself. A lease dropped meanwhile is finished by its last
// user.
class StoreImpl::LeaseUse {
 public:
  explicit LeaseUse(StoreImpl* store) : store_(store) {}
  ~LeaseUse() {
    if (leases_.empty()) return;
    absl::MutexLock l(&store_->mu_);
    EndLocked();
  }
  void Add(std::shared_ptr<Lease> lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_->mu_) {
    ++lease->users;
    leases_.push_back(std::move(lease));
  }
  void EndLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_->mu_) {
    for (const std::shared_ptr<Lease>& lease : leases_) {
      if (--lease->users == 0 && lease->dropped) store_->FinishLeaseLocked(*lease);
    }
    leases_.clear();
  }

 private:
  StoreImpl* const store_;
  std::vector<std::shared_ptr<Lease>> leases_;
};

}  // namespace kvpool::store_internal

#endif  // KVPOOL_SERVICE_STORE_KV_STORE_IMPL_H_
