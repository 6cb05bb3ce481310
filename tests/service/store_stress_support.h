// What the store's threaded stress tests (tests/service/kv_store_content_stress_test.cc) run on:
// backend failures injected at a per-thread rate, a watchdog over the test's threads, and the
// consistency of a namespace's pool counts at any moment. Header-only.
#ifndef KVPOOL_TESTS_SERVICE_STORE_STRESS_SUPPORT_H_
#define KVPOOL_TESTS_SERVICE_STORE_STRESS_SUPPORT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "service/store/kv_store.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {

inline int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

// Failure injection: a thread sets its rate (per mille) and its generator; FlakyBackend then fails
// that share of its appends and of its attends that append. A failing QuantizeAppend first runs
// the thread's tl_before_append_failure, when set (other calls of the store while the append is
// in flight).
inline thread_local int tl_fail_permille = 0;
inline thread_local std::mt19937* tl_rng = nullptr;
inline thread_local const std::function<void()>* tl_before_append_failure = nullptr;
inline std::atomic<int> g_injected{0};

inline bool ShouldFail() {
  const bool f = tl_fail_permille > 0 && tl_rng != nullptr &&
                 static_cast<int>((*tl_rng)() % 1000) < tl_fail_permille;
  if (f) g_injected++;
  return f;
}

class FlakyBackend : public ForwardingBackend {
 public:
  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override {
    if (!ShouldFail()) return ForwardingBackend::QuantizeAppend(p);
    if (tl_before_append_failure != nullptr) (*tl_before_append_failure)();
    return absl::InternalError("injected QuantizeAppend failure");
  }
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override {
    if (append != nullptr && ShouldFail()) {
      if ((*tl_rng)() % 2 == 0) (void)inner().QuantizeAppend(*append);  // written, then failed
      return absl::InternalError("injected attend failure");
    }
    return ForwardingBackend::PagedDecodeAttention(p, append);
  }
};

// Runs work(t) for t in [0, threads) on threads of their own; aborts the process when they have
// not all ended within `watchdog_s` seconds (a deadlock would otherwise hang the test run).
inline void RunThreadsWithWatchdog(int threads, int watchdog_s,
                                   const std::function<void(int)>& work) {
  bool done = false;
  std::mutex mu;
  std::condition_variable cv;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(watchdog_s), [&] { return done; })) {
      std::fprintf(stderr, "WATCHDOG: no progress in %d s, deadlock?\n", watchdog_s);
      std::abort();
    }
  });
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&work, t] { work(t); });
  for (std::thread& t : pool) t.join();
  {
    std::lock_guard<std::mutex> l(mu);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
}

// Token ids of up to `max_len` tokens in one of three families, each of which branches at a random
// point into one of three continuations: prompts that share prefixes, as a cache sees them.
inline std::vector<int32_t> RandomIds(std::mt19937& rng, int max_len) {
  const int len = static_cast<int>(rng() % (max_len + 1));
  const int family = static_cast<int>(rng() % 3);
  const int split = static_cast<int>(rng() % (len + 1));
  const int branch = static_cast<int>(rng() % 3);
  std::vector<int32_t> ids(len);
  for (int i = 0; i < len; ++i) {
    ids[i] = i < split ? family * 10000 + i : family * 10000 + (branch + 1) * 1000 + i;
  }
  return ids;
}

// Empty when a namespace's pool counts hold together (as they must at any moment, whatever runs
// concurrently); otherwise what does not.
inline std::string PoolCountsInconsistency(const NamespaceStoreStats& ns, int block_tokens) {
  if (ns.blocks_free + ns.blocks_evictable > ns.blocks_total ||
      ns.sink_blocks_free > ns.sink_blocks_total || ns.sink_blocks_free > ns.blocks_free ||
      ns.tokens_stored % block_tokens != 0 || ns.tokens_stored / block_tokens > ns.blocks_total ||
      ns.tokens_stored / block_tokens < ns.blocks_evictable) {
    return absl::StrFormat(
        "stats inconsistent: total %d free %d evictable %d in_use %d sink %d/%d tokens %d",
        ns.blocks_total, ns.blocks_free, ns.blocks_evictable, ns.blocks_in_use, ns.sink_blocks_free,
        ns.sink_blocks_total, ns.tokens_stored);
  }
  return "";
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_SERVICE_STORE_STRESS_SUPPORT_H_
