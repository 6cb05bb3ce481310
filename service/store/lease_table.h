// LeaseTable: the live leases of a store (DESIGN.md section 3). A lease pins the blocks of a
// matched prefix and owns the private tail that Append/Attend grow; it lives until Release or
// until its TTL passes without use.
//
// The table only keeps leases and their expiry; pinning and freeing blocks is the store's job
// (Remove and Expire hand the leases back so the store can unpin them).
//
// Thread safety: not thread-safe; the owning store's lock guards every call and every Lease.
#ifndef KVPOOL_SERVICE_STORE_LEASE_TABLE_H_
#define KVPOOL_SERVICE_STORE_LEASE_TABLE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "service/store/prefix_index.h"

namespace kvpool {

struct Lease {
  // One block of the lease's sequence: block i holds tokens [i*block_tokens, +block_tokens).
  struct Block {
    int32_t id = -1;
    BlockHash hash;  // the block's prefix hash, for blocks [0, hashed_blocks)
    // The lease holds a pin on `hash` in the prefix index (a matched block, a tail block it
    // published, or the published twin of its private copy). Pins cover a prefix of `blocks`,
    // so every pinned node's ancestors are pinned too.
    bool pinned = false;
    // `id` is a private tail block that the lease frees when it ends.
    bool owned = false;
  };

  uint64_t id = 0;          // set by LeaseTable::Add
  int namespace_index = 0;  // the store's namespace
  absl::Duration ttl;
  absl::Time expires;         // set by the table
  std::vector<Block> blocks;  // grown by AddBlock only
  // blocks[0, hashed_blocks) know their prefix hash: the matched ones, then tail blocks as they
  // are published, in order.
  size_t hashed_blocks = 0;
  // blocks[i].id for every i, back to back: copied whole into Attend's block tables.
  std::vector<int32_t> block_ids;
  void AddBlock(const Block& block) {
    blocks.push_back(block);
    block_ids.push_back(block.id);
  }
  uint32_t matched_tokens = 0;
  // Tokens reserved per layer (appends in flight included), and tokens written per layer: every
  // position below layer_written[l] is in the pages. Appends that finish out of order wait in
  // written_ahead[l] as [begin, end) ranges until the positions before them are written.
  std::vector<uint32_t> layer_tokens;
  std::vector<uint32_t> layer_written;
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> written_ahead;
  // Per layer, the [begin, end) ranges of failed appends that a later append had already
  // reserved past. Nothing writes them, so the layer's written watermark stops below them, and
  // CheckLayerUsable refuses Append and Attend on the layer; when every reservation after such a
  // range is given back too, so is the range (AbandonAppendsLocked).
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> lost;
  // FAILED_PRECONDITION when `layer` lost tokens to a failed append (`lost`), else OK.
  absl::Status CheckLayerUsable(uint32_t layer) const {
    if (lost[layer].empty()) return absl::OkStatus();
    uint32_t first = lost[layer][0].first;
    for (const auto& range : lost[layer]) first = std::min(first, range.first);
    return absl::FailedPreconditionError(absl::StrFormat(
        "lease %d lost layer %d's tokens from position %d: an append there failed after a later "
        "append had reserved the positions after it, so Append and Attend on the layer are "
        "refused; release the lease",
        id, layer, first));
  }
  // Token ids from position 0 as far as known (the Match's, then those named by appends that
  // completed); -1 = not given. Appends in flight have room reserved here for the ids they name.
  std::vector<int32_t> token_ids;
  // Calls using the lease's blocks outside the store lock right now. A lease dropped (released
  // or expired) while users > 0 is unpinned by its last user.
  int users = 0;
  bool dropped = false;
};

class LeaseTable {
 public:
  explicit LeaseTable(uint64_t max_leases) : max_leases_(max_leases) {}

  // Adds `lease` with a fresh id, expiring at now + lease->ttl. RESOURCE_EXHAUSTED (lease not
  // added) at max_leases. Ids are random, non-zero 64-bit numbers: a client cannot reach another's
  // lease by guessing its id from its own.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Lease>> Add(std::shared_ptr<Lease> lease,
                                                           absl::Time now);
  // The live lease `id`; null when unknown or past its expiry.
  std::shared_ptr<Lease> Find(uint64_t id, absl::Time now) const;
  // Renews `lease` (one of the table's) to expire at now + ttl.
  void Renew(Lease& lease, absl::Time now);
  // Removes lease `id`; null when unknown.
  std::shared_ptr<Lease> Remove(uint64_t id);
  // Removes and returns every lease whose expiry is <= now.
  std::vector<std::shared_ptr<Lease>> Expire(absl::Time now);

  size_t size() const { return leases_.size(); }

 private:
  const uint64_t max_leases_;
  absl::BitGen ids_;  // seeded from the OS's entropy
  absl::flat_hash_map<uint64_t, std::shared_ptr<Lease>> leases_;
  std::set<std::pair<absl::Time, uint64_t>> by_expiry_;  // (expires, id) of every lease
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_LEASE_TABLE_H_
