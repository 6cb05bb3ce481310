#include "service/store/prefix_index.h"

#include <cstdint>
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

}  // namespace
}  // namespace kvpool
