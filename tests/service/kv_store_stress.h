// A store under many threads at once, shared by the CPU test (tests/service/kv_store_stress_test)
// and the CUDA one (tests/gpu/cuda_store_stress_test): Puts, Matches, Appends with and without
// token ids, Attends with and without a new token, reads, Releases and expiry on overlapping
// prefixes, in a random order per thread. Every call must get OK or a status its contract names,
// and once every lease is gone the pool and the counters must be back where they started.
#ifndef KVPOOL_TESTS_SERVICE_KV_STORE_STRESS_H_
#define KVPOOL_TESTS_SERVICE_KV_STORE_STRESS_H_

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/store/clock.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {

// Runs `threads` threads of `steps` random calls each on namespace `c` (2 layers or more) of
// `store`, with `clock` as the store's clock; returns the calls whose status the contract does
// not name. Attends use as many query heads as KV heads.
inline std::vector<std::string> RunConcurrentCalls(KvStore& store, const NamespaceConfig& c,
                                                   FakeClock& clock, int threads, int steps) {
  constexpr int kMaxTokens = 24;
  constexpr int kMaxItems = 4;
  const size_t pt = static_cast<size_t>(c.num_kv_heads) * c.head_dim;
  const SequenceKv kv = MakeSequenceKv(c, kMaxTokens, 40);
  const std::vector<uint16_t> q = ToHalf(MakeNormal(kMaxItems * pt, 41));
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
    auto pick = [&](size_t n) { return static_cast<int>(rng() % n); };
    // Three families of prompts sharing prefixes: ids first, first + 3, ...
    auto prompt = [&] { return TokenIds(4 + pick(kMaxTokens - 3), 1 + pick(3)); };
    std::vector<uint64_t> leases;
    for (int step = 0; step < steps; ++step) {
      const int op = pick(100);
      if (op < 15) {
        expect(PutIntoStore(store, c.name, prompt(), kv).status(), {C::kResourceExhausted}, "Put");
      } else if (op < 35 && leases.size() < kMaxItems) {
        auto m = store.Match(c.name, prompt(), absl::Seconds(1 + pick(10)));
        expect(m.status(), {C::kResourceExhausted}, "Match");
        if (m.ok()) leases.push_back(m->lease_id);
      } else if (op < 55 && !leases.empty()) {
        const uint64_t lease = leases[pick(leases.size())];
        const uint32_t n = 1 + pick(3);
        const std::vector<int32_t> ids = pick(2) == 0 ? std::vector<int32_t>{} : TokenIds(n, 500);
        for (uint32_t layer = 0; layer < 2; ++layer) {
          expect(
              store.Append(lease, layer, ids, n, kv.k[layer].data(), kv.v[layer].data()).status(),
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
        // An empty lease has nothing to attend to (INVALID_ARGUMENT); an append on the layer may
        // be in flight (FAILED_PRECONDITION).
        expect(store.Attend(0, c.num_kv_heads, 0.f, items,
                            {out.data(), nullptr, nullptr, context.data()}),
               {C::kResourceExhausted, C::kNotFound, C::kFailedPrecondition, C::kInvalidArgument},
               "Attend");
      } else if (op < 85 && !leases.empty()) {
        const uint64_t lease = leases[pick(leases.size())];
        auto view = store.DescribeLease(lease);
        expect(view.status(), {C::kNotFound}, "DescribeLease");
        const uint32_t blocks = view.ok() ? view->layer_tokens[1] / c.block_tokens : 0;
        if (blocks > 0) {
          std::vector<uint16_t> k(blocks * c.block_tokens * pt), v(k.size());
          expect(store.ReadFp16(lease, 1, 0, blocks, 0, c.num_kv_heads, k.data(), v.data()),
                 {C::kNotFound}, "ReadFp16");
        }
      } else if (op < 97 && !leases.empty()) {
        const size_t i = pick(leases.size());
        expect(store.Release(leases[i]), {C::kNotFound}, "Release");
        leases.erase(leases.begin() + i);
      } else {
        clock.Advance(absl::Seconds(1));
        store.ExpireLeases();
      }
    }
    for (uint64_t lease : leases) expect(store.Release(lease), {C::kNotFound}, "Release");
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
  for (std::thread& t : pool) t.join();
  return unexpected;
}

// After RunConcurrentCalls: with every lease expired, nothing is pinned or counted, every block
// is free or cached, and the store still stores and finds a sequence.
inline void ExpectSettled(KvStore& store, const NamespaceConfig& c, FakeClock& clock) {
  clock.Advance(absl::Hours(1));
  store.ExpireLeases();
  const StoreStats stats = store.Stats();
  EXPECT_EQ(stats.active_leases, 0u);
  EXPECT_EQ(stats.lease_token_ids, 0u);
  ASSERT_EQ(stats.namespaces.size(), 1u);
  const NamespaceStoreStats& ns = stats.namespaces[0];
  EXPECT_EQ(ns.blocks_in_use, 0u);
  EXPECT_EQ(ns.blocks_free + ns.blocks_evictable, ns.blocks_total);
  EXPECT_EQ(ns.tokens_stored, ns.blocks_evictable * c.block_tokens);
  const std::vector<int32_t> ids = TokenIds(2 * c.block_tokens, 5000);
  ASSERT_TRUE(PutIntoStore(store, c.name, ids, MakeSequenceKv(c, ids.size(), 42)).ok());
  auto m = store.Match(c.name, ids, absl::ZeroDuration());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->cached_tokens, ids.size());
  ASSERT_TRUE(store.Release(m->lease_id).ok());
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_SERVICE_KV_STORE_STRESS_H_
