#include "service/store/prefix_index.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool {
namespace {

// splitmix64's finalizer.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t RotL(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Two independent 64-bit lanes over a stream of 64-bit words: different constants, one lane
// xor-then-mix, the other rotate-multiply-then-mix.
class Hasher128 {
 public:
  Hasher128(uint64_t hi, uint64_t lo) : a_(hi), b_(lo) {}
  void Add(uint64_t w) {
    a_ = Mix64(a_ ^ (w + 0x9E3779B97F4A7C15ull));
    b_ = Mix64((RotL(b_, 23) + w) * 0xD6E8FEB86659FD93ull + 0x632BE59BD9B4E019ull);
  }
  BlockHash Finish() const { return BlockHash{Mix64(a_ ^ 0xA0761D6478BD642Full), Mix64(b_)}; }

 private:
  uint64_t a_, b_;
};

}  // namespace

BlockHash RootHash(std::string_view namespace_name) {
  Hasher128 h(0x6B76706F6F6C2D31ull, 0x6E616D6573706163ull);
  h.Add(namespace_name.size());
  for (size_t i = 0; i < namespace_name.size(); i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, namespace_name.data() + i, std::min<size_t>(8, namespace_name.size() - i));
    h.Add(w);
  }
  return h.Finish();
}

BlockHash ChainHash(const BlockHash& parent, absl::Span<const int32_t> token_ids) {
  Hasher128 h(parent.hi, parent.lo);
  h.Add(token_ids.size());
  for (size_t i = 0; i < token_ids.size(); i += 2) {
    const uint64_t lo = static_cast<uint32_t>(token_ids[i]);
    const uint64_t hi = i + 1 < token_ids.size() ? static_cast<uint32_t>(token_ids[i + 1]) : 0;
    h.Add(lo | hi << 32);
  }
  return h.Finish();
}

std::vector<BlockHash> HashChain(const BlockHash& root, absl::Span<const int32_t> token_ids,
                                 int block_tokens) {
  std::vector<BlockHash> chain;
  const size_t full = token_ids.size() / block_tokens;
  chain.reserve(full);
  BlockHash h = root;
  for (size_t b = 0; b < full; ++b) {
    h = ChainHash(h, token_ids.subspan(b * block_tokens, block_tokens));
    chain.push_back(h);
  }
  return chain;
}

std::optional<int32_t> PrefixIndex::Find(const BlockHash& hash) const {
  auto it = nodes_.find(hash);
  if (it == nodes_.end()) return std::nullopt;
  return it->second.block;
}

size_t PrefixIndex::LongestPrefix(absl::Span<const BlockHash> chain) const {
  size_t n = 0;
  while (n < chain.size() && nodes_.contains(chain[n])) ++n;
  return n;
}

absl::StatusOr<int32_t> PrefixIndex::Insert(const BlockHash& parent, const BlockHash& hash,
                                            int32_t block) {
  if (auto it = nodes_.find(hash); it != nodes_.end()) return it->second.block;
  uint32_t slot = 0;
  if (parent != root_) {
    auto it = nodes_.find(parent);
    if (it == nodes_.end()) {
      return absl::FailedPreconditionError("parent block is not published");
    }
    Node& p = it->second;
    Unindex(parent, p);
    slot = static_cast<uint32_t>(p.children.size());
    p.children.push_back(hash);
    Index(parent, p);
  }
  Node n;
  n.block = block;
  n.parent = parent;
  n.slot = slot;
  n.tick = ++tick_;
  Index(hash, n);
  nodes_.emplace(hash, std::move(n));
  return block;
}

void PrefixIndex::Pin(const BlockHash& hash) {
  auto it = nodes_.find(hash);
  assert(it != nodes_.end());
  Node& n = it->second;
  Unindex(hash, n);
  if (n.pins++ == 0) ++pinned_nodes_;
  Index(hash, n);
}

void PrefixIndex::Unpin(const BlockHash& hash) {
  auto it = nodes_.find(hash);
  assert(it != nodes_.end() && it->second.pins > 0);
  Node& n = it->second;
  Unindex(hash, n);
  if (--n.pins == 0) --pinned_nodes_;
  Index(hash, n);
}

void PrefixIndex::Touch(const BlockHash& hash) {
  auto it = nodes_.find(hash);
  assert(it != nodes_.end());
  Node& n = it->second;
  Unindex(hash, n);
  n.tick = ++tick_;
  Index(hash, n);
}

std::optional<int32_t> PrefixIndex::EvictOne(bool spare_sink_pages) {
  const auto& leaves =
      spare_sink_pages && !evictable_other_.empty() ? evictable_other_ : evictable_;
  if (leaves.empty()) return std::nullopt;
  const BlockHash hash = leaves.begin()->second;
  const int32_t block = nodes_.find(hash)->second.block;
  Erase(hash);
  return block;
}

std::vector<int32_t> PrefixIndex::EvictSinkTree() {
  std::vector<int32_t> blocks;
  if (unpinned_sinks_.empty()) return blocks;
  // The subtree breadth first, erased in reverse: children before their parent.
  std::vector<BlockHash> order = {unpinned_sinks_.begin()->second};
  for (size_t i = 0; i < order.size(); ++i) {
    const Node& n = nodes_.find(order[i])->second;
    order.insert(order.end(), n.children.begin(), n.children.end());
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    blocks.push_back(nodes_.find(*it)->second.block);
    Erase(*it);
  }
  return blocks;
}

void PrefixIndex::Index(const BlockHash& hash, const Node& n) {
  if (IsEvictable(n)) evictable_.insert({n.tick, hash});
  if (IsEvictable(n) && !HasSinkPage(n)) evictable_other_.insert({n.tick, hash});
  if (IsUnpinnedSink(n)) unpinned_sinks_.insert({n.tick, hash});
}

void PrefixIndex::Unindex(const BlockHash& hash, const Node& n) {
  if (IsEvictable(n)) evictable_.erase({n.tick, hash});
  if (IsEvictable(n) && !HasSinkPage(n)) evictable_other_.erase({n.tick, hash});
  if (IsUnpinnedSink(n)) unpinned_sinks_.erase({n.tick, hash});
}

void PrefixIndex::Erase(const BlockHash& hash) {
  auto it = nodes_.find(hash);
  assert(it != nodes_.end() && it->second.pins == 0 && it->second.children.empty());
  Unindex(hash, it->second);
  const BlockHash parent = it->second.parent;
  const uint32_t slot = it->second.slot;
  nodes_.erase(it);
  if (parent == root_) return;
  Node& p = nodes_.find(parent)->second;
  Unindex(parent, p);
  // The last child takes the erased one's slot.
  std::vector<BlockHash>& siblings = p.children;
  if (slot + 1 != siblings.size()) {
    siblings[slot] = siblings.back();
    nodes_.find(siblings[slot])->second.slot = slot;
  }
  siblings.pop_back();
  Index(parent, p);
}

}  // namespace kvpool
