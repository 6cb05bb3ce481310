// PrefixIndex: the published blocks of one namespace, keyed by their prefix hash
// (DESIGN.md section 3): h_0 = RootHash(namespace name), h_i = ChainHash(h_{i-1}, token ids of
// block i). Every node but a chain's first has its parent in the index, and a parent is never
// evicted before its children, so every cached block stays reachable from h_0.
//
// Pins (leases, in-flight puts) keep a node from eviction. Only unpinned leaves are evictable,
// least recently used first; the LRU order is a logical tick bumped by Insert and Touch. Blocks
// with a sink page (ids below the namespace's sink blocks) can be freed on their own: the least
// recently used unpinned one goes with its subtree.
//
// Thread safety: not thread-safe; the owning store's lock guards every call.
#ifndef KVPOOL_SERVICE_STORE_PREFIX_INDEX_H_
#define KVPOOL_SERVICE_STORE_PREFIX_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool {

// A stable 128-bit hash: the same on every process, machine and run (two independent 64-bit
// mixes; never absl::Hash, which is salted per process).
struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;

  friend bool operator==(const BlockHash& a, const BlockHash& b) {
    return a.hi == b.hi && a.lo == b.lo;
  }
  friend bool operator!=(const BlockHash& a, const BlockHash& b) { return !(a == b); }
  friend bool operator<(const BlockHash& a, const BlockHash& b) {
    return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo;
  }
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& x) {
    return H::combine(std::move(h), x.hi, x.lo);
  }
};

// h_0 of a namespace.
BlockHash RootHash(std::string_view namespace_name);
// h_i from h_{i-1} and the token ids of block i.
BlockHash ChainHash(const BlockHash& parent, absl::Span<const int32_t> token_ids);
// The hashes of the full blocks of `token_ids` (trailing partial block dropped).
std::vector<BlockHash> HashChain(const BlockHash& root, absl::Span<const int32_t> token_ids,
                                 int block_tokens);

class PrefixIndex {
 public:
  // `root` is h_0 of the namespace: the parent of every chain's first block. Blocks below
  // `sink_blocks` are those with a sink page (BlockPool).
  explicit PrefixIndex(const BlockHash& root, int32_t sink_blocks = 0)
      : root_(root), sink_blocks_(sink_blocks) {}

  const BlockHash& root() const { return root_; }

  // The block published under `hash`, if any.
  std::optional<int32_t> Find(const BlockHash& hash) const;
  // How many leading hashes of `chain` are published (the longest cached prefix, in blocks).
  size_t LongestPrefix(absl::Span<const BlockHash> chain) const;

  // Publishes `block` under `hash` as a child of `parent` (root() or a published hash), unpinned
  // and most recently used. Returns the block now published under `hash`: `block`, or the block
  // already there (the caller keeps its own copy's ownership). FAILED_PRECONDITION when the
  // parent is not published.
  [[nodiscard]] absl::StatusOr<int32_t> Insert(const BlockHash& parent, const BlockHash& hash,
                                               int32_t block);

  // Pin/Unpin count; a pinned node is never evicted. Each requires `hash` to be published
  // (Unpin: and pinned).
  void Pin(const BlockHash& hash);
  void Unpin(const BlockHash& hash);
  // Marks `hash` (published) most recently used.
  void Touch(const BlockHash& hash);

  // Removes the least recently used unpinned leaf and returns its block, or nullopt when none.
  // Its parent may become an evictable leaf. With `spare_sink_pages`, the least recently used
  // such leaf whose block has no sink page, when there is one.
  std::optional<int32_t> EvictOne(bool spare_sink_pages = false);
  // Removes the least recently used unpinned node whose block has a sink page, and its subtree
  // (unpinned too: a pinned node's ancestors are pinned), and returns their blocks; empty when
  // there is no such node.
  std::vector<int32_t> EvictSinkTree();

  size_t size() const { return nodes_.size(); }
  size_t evictable() const { return evictable_.size(); }
  size_t pinned_nodes() const { return pinned_nodes_; }
  // Unpinned nodes whose block has a sink page.
  size_t unpinned_sink_nodes() const { return unpinned_sinks_.size(); }
  // Unpinned leaves whose block has no sink page: what EvictOne(true) takes first.
  size_t evictable_other() const { return evictable_other_.size(); }

 private:
  struct Node {
    int32_t block = -1;
    BlockHash parent;
    std::vector<BlockHash> children;
    uint32_t slot = 0;  // its position in its parent's children
    uint32_t pins = 0;
    uint64_t tick = 0;  // last use
  };
  bool IsEvictable(const Node& n) const { return n.pins == 0 && n.children.empty(); }
  bool HasSinkPage(const Node& n) const { return n.block < sink_blocks_; }
  // Whether `n` belongs in unpinned_sinks_.
  bool IsUnpinnedSink(const Node& n) const { return n.pins == 0 && HasSinkPage(n); }
  // Adds or removes `n` in the ordered sets it belongs in by its state and tick (only those: a
  // chain's inner nodes, the most of them, cost no set operation).
  void Index(const BlockHash& hash, const Node& n);
  void Unindex(const BlockHash& hash, const Node& n);
  // Removes `hash` (its subtree removed already) from the index and from its parent's children.
  void Erase(const BlockHash& hash);

  const BlockHash root_;
  const int32_t sink_blocks_;
  uint64_t tick_ = 0;
  size_t pinned_nodes_ = 0;  // nodes with pins > 0
  absl::flat_hash_map<BlockHash, Node> nodes_;
  // (tick, hash) of every unpinned leaf, oldest first, and of those without a sink page.
  std::set<std::pair<uint64_t, BlockHash>> evictable_;
  std::set<std::pair<uint64_t, BlockHash>> evictable_other_;
  // (tick, hash) of every unpinned node whose block has a sink page, oldest first.
  std::set<std::pair<uint64_t, BlockHash>> unpinned_sinks_;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_PREFIX_INDEX_H_
