#include "service/store/prefix_index.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

constexpr int kBlockTokens = 4;

std::vector<int32_t> Tokens(int n, int32_t first) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = first + 7 * i;
  return t;
}

// Publishes the full blocks of `tokens` as blocks first_block, first_block+1, ...
std::vector<BlockHash> InsertChain(PrefixIndex& index, const std::vector<int32_t>& tokens,
                                   int32_t first_block) {
  std::vector<BlockHash> chain = HashChain(index.root(), tokens, kBlockTokens);
  for (size_t i = 0; i < chain.size(); ++i) {
    auto r = index.Insert(i == 0 ? index.root() : chain[i - 1], chain[i],
                          first_block + static_cast<int32_t>(i));
    EXPECT_TRUE(r.ok());
  }
  return chain;
}

TEST(BlockHashing, IsStableAcrossRuns) {
  // Fixed values: the hash must never depend on the process (no salted hashing).
  const BlockHash root = RootHash("default");
  const BlockHash again = RootHash(std::string("default"));
  EXPECT_EQ(root, again);
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  EXPECT_EQ(ChainHash(root, ids), ChainHash(again, ids));
  EXPECT_NE(ChainHash(root, ids), ChainHash(root, std::vector<int32_t>{1, 2, 4, 3}));
  EXPECT_NE(root.hi, root.lo);
}

TEST(PrefixIndex, LongestPrefixMatch) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<int32_t> stored = Tokens(12, 100);
  InsertChain(index, stored, 0);
  std::vector<int32_t> query = stored;
  query[9] = 5;  // third block differs
  query.push_back(42);
  EXPECT_EQ(index.LongestPrefix(HashChain(index.root(), query, kBlockTokens)), 2u);
  EXPECT_EQ(index.LongestPrefix(HashChain(index.root(), stored, kBlockTokens)), 3u);
  query[0] = 6;  // first block differs: nothing
  EXPECT_EQ(index.LongestPrefix(HashChain(index.root(), query, kBlockTokens)), 0u);
}

TEST(PrefixIndex, NamespaceSeparatesChains) {
  PrefixIndex a(RootHash("model-a"));
  PrefixIndex b(RootHash("model-b"));
  const std::vector<int32_t> tokens = Tokens(8, 3);
  const std::vector<BlockHash> chain_a = InsertChain(a, tokens, 0);
  const std::vector<BlockHash> chain_b = HashChain(b.root(), tokens, kBlockTokens);
  EXPECT_NE(chain_a[0], chain_b[0]);
  EXPECT_NE(chain_a[1], chain_b[1]);
  EXPECT_EQ(a.LongestPrefix(chain_b), 0u);
}

TEST(PrefixIndex, InsertOfExistingHashReturnsExistingBlock) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<BlockHash> chain = InsertChain(index, Tokens(4, 1), 10);
  auto r = index.Insert(index.root(), chain[0], 99);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 10);
  EXPECT_EQ(index.size(), 1u);
}

TEST(PrefixIndex, InsertRequiresPublishedParent) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<BlockHash> chain = HashChain(index.root(), Tokens(8, 1), kBlockTokens);
  EXPECT_FALSE(index.Insert(chain[0], chain[1], 1).ok());
  EXPECT_EQ(index.size(), 0u);
}

TEST(PrefixIndex, EvictsLeafBeforeParent) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<BlockHash> chain = InsertChain(index, Tokens(12, 1), 0);
  // The root of the chain is the least recently used, but it has a child.
  index.Touch(chain[2]);
  EXPECT_EQ(index.evictable(), 1u);
  EXPECT_EQ(index.EvictOne(), 2);
  EXPECT_EQ(index.EvictOne(), 1);
  EXPECT_EQ(index.EvictOne(), 0);
  EXPECT_EQ(index.EvictOne(), std::nullopt);
  EXPECT_EQ(index.size(), 0u);
}

TEST(PrefixIndex, NeverEvictsPinned) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<BlockHash> a = InsertChain(index, Tokens(8, 1), 0);
  const std::vector<BlockHash> b = InsertChain(index, Tokens(4, 500), 2);
  index.Pin(a[0]);
  index.Pin(a[1]);
  EXPECT_EQ(index.EvictOne(), 2);
  EXPECT_EQ(index.EvictOne(), std::nullopt);
  EXPECT_EQ(index.size(), 2u);
  index.Unpin(a[1]);
  EXPECT_EQ(index.EvictOne(), 1);
  EXPECT_EQ(index.EvictOne(), std::nullopt);  // a[0] is still pinned
  index.Unpin(a[0]);
  EXPECT_EQ(index.EvictOne(), 0);
}

TEST(PrefixIndex, LruOrder) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<BlockHash> x = InsertChain(index, Tokens(4, 1), 0);
  const std::vector<BlockHash> y = InsertChain(index, Tokens(4, 100), 1);
  const std::vector<BlockHash> z = InsertChain(index, Tokens(4, 200), 2);
  index.Touch(x[0]);  // order now y, z, x
  EXPECT_EQ(index.EvictOne(), 1);
  EXPECT_EQ(index.EvictOne(), 2);
  EXPECT_EQ(index.EvictOne(), 0);
}

TEST(PrefixIndex, PinCountsAreCounted) {
  PrefixIndex index(RootHash("ns"));
  const std::vector<BlockHash> x = InsertChain(index, Tokens(4, 1), 0);
  index.Pin(x[0]);
  index.Pin(x[0]);
  index.Unpin(x[0]);
  EXPECT_EQ(index.pinned_nodes(), 1u);
  EXPECT_EQ(index.EvictOne(), std::nullopt);
  index.Unpin(x[0]);
  EXPECT_EQ(index.pinned_nodes(), 0u);
  EXPECT_EQ(index.EvictOne(), 0);
}

// Blocks 0 and 1 have a sink page. The least recently used unpinned one goes with its subtree,
// children first; pinned ones, and those whose descendants a lease pins, stay.
TEST(PrefixIndex, EvictsTheLeastRecentlyUsedTreeWithASinkPage) {
  PrefixIndex index(RootHash("ns"), /*sink_blocks=*/2);
  const std::vector<int32_t> a = Tokens(12, 1), b = Tokens(8, 2);
  const std::vector<BlockHash> ca = InsertChain(index, a, 0);  // blocks 0, 1, 2
  // b's first block is 5, which has no sink page; its second 6.
  const std::vector<BlockHash> cb = InsertChain(index, b, 5);
  EXPECT_EQ(index.unpinned_sink_nodes(), 2u);  // blocks 0 and 1, both in a's chain
  EXPECT_EQ(index.evictable_other(), 2u);      // leaves 2 and 6
  index.Pin(ca[1]);  // a lease on a's first two blocks pins 0 and 1
  index.Pin(ca[0]);
  EXPECT_EQ(index.unpinned_sink_nodes(), 0u);
  EXPECT_TRUE(index.EvictSinkTree().empty());
  index.Unpin(ca[0]);
  index.Unpin(ca[1]);
  EXPECT_EQ(index.unpinned_sink_nodes(), 2u);
  EXPECT_EQ(index.EvictSinkTree(), (std::vector<int32_t>{2, 1, 0}));
  EXPECT_EQ(index.size(), 2u);
  EXPECT_EQ(index.unpinned_sink_nodes(), 0u);
  EXPECT_EQ(index.evictable_other(), 1u);  // leaf 6; 5 is its parent
  EXPECT_EQ(index.EvictOne(), 6);  // b's chain is whole and still evicts leaf first
  EXPECT_EQ(index.EvictOne(), 5);
  EXPECT_FALSE(index.EvictOne().has_value());
}

// A subtree with branches: the evicted tree's blocks come children first, and its parent's other
// children and the parent itself are left.
TEST(PrefixIndex, EvictsASubtreeWithBranchesAndLeavesItsParent) {
  PrefixIndex index(RootHash("ns"), /*sink_blocks=*/8);
  const std::vector<int32_t> trunk = Tokens(4, 1);
  const std::vector<BlockHash> t = InsertChain(index, trunk, 10);  // block 10: no sink page
  std::vector<int32_t> left = trunk, right = trunk;
  const std::vector<int32_t> l = Tokens(8, 50), r = Tokens(4, 60);
  left.insert(left.end(), l.begin(), l.end());
  right.insert(right.end(), r.begin(), r.end());
  const std::vector<BlockHash> cl = HashChain(index.root(), left, kBlockTokens);
  const std::vector<BlockHash> cr = HashChain(index.root(), right, kBlockTokens);
  ASSERT_TRUE(index.Insert(t[0], cl[1], 3).ok());  // sink page
  ASSERT_TRUE(index.Insert(cl[1], cl[2], 11).ok());
  ASSERT_TRUE(index.Insert(t[0], cr[1], 12).ok());
  index.Pin(cr[1]);  // and with it the trunk
  index.Pin(t[0]);
  EXPECT_EQ(index.EvictSinkTree(), (std::vector<int32_t>{11, 3}));
  EXPECT_EQ(index.size(), 2u);
  EXPECT_TRUE(index.EvictSinkTree().empty());
  index.Unpin(cr[1]);
  EXPECT_EQ(index.EvictOne(), 12);  // the trunk is a leaf again after its right child goes
  index.Unpin(t[0]);
  EXPECT_EQ(index.EvictOne(), 10);
}

// A node with many children loses them in any order (each child keeps its place in its parent's
// list, updated when the last one moves into a freed place), and EvictOne(spare_sink_pages)
// takes the least recently used leaf without a sink page first.
TEST(PrefixIndex, WideNodesLoseChildrenInAnyOrder) {
  PrefixIndex index(RootHash("ns"), /*sink_blocks=*/4);
  const std::vector<BlockHash> trunk = InsertChain(index, Tokens(4, 1), 100);
  std::vector<BlockHash> kids;
  for (int i = 0; i < 40; ++i) {
    std::vector<int32_t> t = Tokens(4, 1);
    const std::vector<int32_t> more = Tokens(4, 1000 + i);
    t.insert(t.end(), more.begin(), more.end());
    kids.push_back(HashChain(index.root(), t, kBlockTokens)[1]);
    // Blocks 0..3 have a sink page.
    ASSERT_TRUE(index.Insert(trunk[0], kids.back(), i < 4 ? i : 10 + i).ok());
  }
  // The oldest leaves have a sink page; sparing them takes block 14 first.
  EXPECT_EQ(index.EvictOne(/*spare_sink_pages=*/true), 14);
  EXPECT_EQ(index.EvictOne(), 0);
  // Touch some children out of order, then evict everything: each block exactly once, the trunk
  // last.
  for (int i : {30, 5, 17, 2}) index.Touch(kids[i]);
  std::vector<int32_t> evicted;
  while (std::optional<int32_t> b = index.EvictOne()) evicted.push_back(*b);
  ASSERT_EQ(evicted.size(), 39u);
  EXPECT_EQ(evicted.back(), 100);
  std::sort(evicted.begin(), evicted.end());
  EXPECT_EQ(std::adjacent_find(evicted.begin(), evicted.end()), evicted.end());
  EXPECT_EQ(index.size(), 0u);
}

}  // namespace
}  // namespace kvpool
