// Many threads on one store at once, on overlapping prefixes: Puts, Matches, Appends with and
// without token ids, Attends with and without a new token, reads, Releases and expiry, in a
// random order per thread. Every call gets OK or a status its contract names (never an internal
// error), and once every lease is gone the pool and the counters are back where they started:
// no block stays pinned or leaked, no token id stays counted, and the store still serves.
// (Built with sanitizers, this is also the store's race and lifetime test.)
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "service/store/kv_store.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

constexpr int kThreads = 8;
constexpr int kStepsPerThread = 250;
constexpr int kMaxTokens = 24;

TEST_F(StoreTest, ConcurrentCallsKeepThePoolAndCountersConsistent) {
  MakeStore(20);
  const size_t pt = PerToken();
  const SequenceKv kv = MakeSequenceKv(config_, kMaxTokens, 40);
  const std::vector<uint16_t> q = ToHalf(MakeNormal(4 * pt, 41));  // 4 items of 2 q heads

  absl::Mutex mu;
  std::vector<std::string> unexpected;  // guarded by mu
  auto expect = [&](const absl::Status& s, std::initializer_list<absl::StatusCode> allowed,
                    const char* what) {
    if (s.ok()) return;
    for (absl::StatusCode code : allowed) {
      if (s.code() == code) return;
    }
    absl::MutexLock l(&mu);
    unexpected.push_back(std::string(what) + ": " + s.ToString());
  };
  using C = absl::StatusCode;

  auto work = [&](int thread) {
    std::mt19937 rng(1000 + thread);
    auto pick = [&](int n) { return static_cast<int>(rng() % n); };
    // Three families of prompts sharing prefixes: ids first, first + 3, ...
    auto prompt = [&] { return TokenIds(4 + pick(kMaxTokens - 3), 1 + pick(3)); };
    std::vector<uint64_t> leases;
    for (int step = 0; step < kStepsPerThread; ++step) {
      const int op = pick(100);
      if (op < 15) {
        expect(Put(prompt(), kv).status(), {C::kResourceExhausted}, "Put");
      } else if (op < 35 && leases.size() < 4) {
        auto m = store_->Match("main", prompt(), absl::Seconds(1 + pick(10)));
        expect(m.status(), {C::kResourceExhausted}, "Match");
        if (m.ok()) leases.push_back(m->lease_id);
      } else if (op < 55 && !leases.empty()) {
        const uint64_t lease = leases[pick(leases.size())];
        const uint32_t n = 1 + pick(3);
        const std::vector<int32_t> ids = pick(2) == 0 ? std::vector<int32_t>{} : TokenIds(n, 500);
        for (uint32_t layer = 0; layer < 2; ++layer) {
          expect(
              store_->Append(lease, layer, ids, n, kv.k[layer].data(), kv.v[layer].data()).status(),
              {C::kResourceExhausted, C::kNotFound}, "Append");
        }
      } else if (op < 75 && !leases.empty()) {
        std::vector<KvStore::AttendItem> items(1 + pick(leases.size()));
        const bool append = pick(2) == 0;
        for (size_t i = 0; i < items.size(); ++i) {
          items[i].lease_id = leases[i];
          items[i].q = q.data() + i * pt;
          if (append) {
            items[i].new_k = kv.k[0].data() + i * pt;
            items[i].new_v = kv.v[0].data() + i * pt;
            items[i].new_token_id = 700 + static_cast<int32_t>(i);
          }
        }
        std::vector<float> out(items.size() * pt);
        std::vector<uint32_t> context(items.size());
        // An empty lease has nothing to attend to (INVALID_ARGUMENT); another thread's append
        // on the layer may be in flight (FAILED_PRECONDITION).
        expect(store_->Attend(0, 2, 0.f, items, {out.data(), nullptr, nullptr, context.data()}),
               {C::kResourceExhausted, C::kNotFound, C::kFailedPrecondition, C::kInvalidArgument},
               "Attend");
      } else if (op < 85 && !leases.empty()) {
        const uint64_t lease = leases[pick(leases.size())];
        auto view = store_->DescribeLease(lease);
        expect(view.status(), {C::kNotFound}, "DescribeLease");
        const uint32_t blocks = view.ok() ? view->layer_tokens[1] / config_.block_tokens : 0;
        if (blocks > 0) {
          std::vector<uint16_t> k(blocks * config_.block_tokens * pt), v(k.size());
          expect(store_->ReadFp16(lease, 1, 0, blocks, 0, 2, k.data(), v.data()), {C::kNotFound},
                 "ReadFp16");
        }
      } else if (op < 97 && !leases.empty()) {
        const size_t i = pick(leases.size());
        expect(store_->Release(leases[i]), {C::kNotFound}, "Release");
        leases.erase(leases.begin() + i);
      } else {
        clock_.Advance(absl::Seconds(1));
        store_->ExpireLeases();
      }
    }
    for (uint64_t lease : leases) expect(store_->Release(lease), {C::kNotFound}, "Release");
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (std::thread& t : threads) t.join();
  for (const std::string& u : unexpected) ADD_FAILURE() << u;

  clock_.Advance(absl::Hours(1));
  store_->ExpireLeases();
  const StoreStats stats = store_->Stats();
  EXPECT_EQ(stats.active_leases, 0u);
  EXPECT_EQ(stats.lease_token_ids, 0u);
  const NamespaceStoreStats& ns = stats.namespaces[0];
  EXPECT_EQ(ns.blocks_in_use, 0u);
  EXPECT_EQ(ns.blocks_free + ns.blocks_evictable, ns.blocks_total);
  EXPECT_EQ(ns.tokens_stored, ns.blocks_evictable * config_.block_tokens);
  // Still serving: a fresh sequence is stored and found whole.
  const std::vector<int32_t> ids = TokenIds(16, 5000);
  ASSERT_TRUE(Put(ids, kv).ok());
  auto m = store_->Match("main", ids, absl::ZeroDuration());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->cached_tokens, 16u);
  ASSERT_TRUE(store_->Release(m->lease_id).ok());
}

}  // namespace
}  // namespace kvpool::testing
