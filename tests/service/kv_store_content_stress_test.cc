// Randomized multi-threaded stress of the KvStore on the CPU backend that checks content, not just
// statuses: every token's K/V is a deterministic function of the ids of its prefix, so anything a
// lease reads (matched prefix, appended tail, published blocks of others) has exactly one right
// value. Appends and Attends on a (lease, layer) are serialized by the test (as the contract
// asks), so the test also knows every lease's token count per layer. Backend failures are
// injected into appends and attends.
//
// Env: STRESS_THREADS (6), STRESS_STEPS (1500), STRESS_SEED (1), STRESS_WATCHDOG_S (600).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/service/kv_store_test_util.h"
#include "tests/service/store_content_oracle.h"
#include "tests/service/store_content_stress_record.h"
#include "tests/service/store_stress_support.h"

namespace kvpool::testing {
namespace {

class ContentStress : public StoreTest {
 protected:
  void Run(uint64_t blocks, int sink_tokens, int bpsp) {
    backend_ = std::make_unique<FlakyBackend>();
    store_options_.max_leases = 16;
    MakeStore(blocks, sink_tokens, bpsp);
    if (HasFatalFailure()) return;
    oracle_ = std::make_unique<Oracle>(config_);
    const int threads = EnvInt("STRESS_THREADS", 6);
    const int steps = EnvInt("STRESS_STEPS", 1500);
    const int seed = EnvInt("STRESS_SEED", 1);
    const auto t0 = std::chrono::steady_clock::now();
    RunThreadsWithWatchdog(threads, EnvInt("STRESS_WATCHDOG_S", 600),
                           [&](int t) { Work(seed * 1000 + t, steps); });
    std::fprintf(stderr,
                 "ran %d threads x %d steps in %.1f s; ops ok: put %d match %d append %d "
                 "attend %d read %d\n",
                 threads, steps,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 n_put_.load(), n_match_.load(), n_append_.load(), n_attend_.load(),
                 n_read_.load());
    // Settle.
    for (const auto& r : record_.TakeLeases()) (void)store_->Release(r->id);
    clock_.Advance(absl::Hours(1));
    store_->ExpireLeases();
    const StoreStats st = store_->Stats();
    EXPECT_EQ(st.active_leases, 0u);
    EXPECT_EQ(st.lease_token_ids, 0u);
    const NamespaceStoreStats& ns = st.namespaces[0];
    EXPECT_EQ(ns.blocks_in_use, 0u);
    EXPECT_EQ(ns.blocks_free + ns.blocks_evictable, ns.blocks_total);
    EXPECT_EQ(ns.tokens_stored, ns.blocks_evictable * config_.block_tokens);
    // Every sequence ever used, chaos ones included: whatever of it is cached reads back right.
    int checked_blocks = 0, chaos_blocks = 0;
    auto check_cached = [&](const std::vector<int32_t>& ids, LeaseRec& rec, int* blocks) {
      auto m = store_->Match(config_.name, ids, absl::Seconds(5));
      ASSERT_TRUE(m.ok()) << m.status();
      rec.id = m->lease_id;
      for (int layer = 0; layer < 2; ++layer) {
        CheckRead(rec, layer, m->cached_tokens, rec.chaos ? "final chaos" : "final");
      }
      *blocks += m->cached_tokens / config_.block_tokens;
      ASSERT_TRUE(store_->Release(m->lease_id).ok());
    };
    const std::vector<std::vector<int32_t>> seqs = record_.Sequences();
    for (const auto& ids : seqs) {
      LeaseRec rec;
      rec.plan = ids;
      rec.hashes = PrefixHashes(ids);
      check_cached(ids, rec, &checked_blocks);
    }
    for (const auto& [cid, ch] : record_.Chaos()) {
      LeaseRec rec;
      rec.chaos = true;
      rec.chaos_hash = ch;
      check_cached(std::vector<int32_t>(64, cid), rec, &chaos_blocks);
    }
    std::fprintf(stderr, "final: %d published chaos blocks verified; during run %d; injected %d\n",
                 chaos_blocks, n_chaos_hits_.load(), g_injected.load());
    for (const std::string& u : record_.Failures()) ADD_FAILURE() << u;
    std::fprintf(stderr, "final: %zu sequences, %d cached blocks verified, evictions %llu\n",
                 seqs.size(), checked_blocks,
                 (unsigned long long)store_->Stats().namespaces[0].evictions);
  }

  // ReadFp16 of blocks [0, ceil(w/bt)) of `layer`; rows < w must be the oracle's, rows past
  // either the oracle's (written since) or zeros.
  void CheckRead(LeaseRec& r, int layer, uint32_t w, const char* what) {
    if (w == 0) return;
    const int bt = config_.block_tokens;
    const size_t pt = oracle_->pt();
    const uint32_t blocks = (w + bt - 1) / bt;
    std::vector<uint16_t> k(size_t(blocks) * bt * pt), v(k.size());
    absl::Status s =
        store_->ReadFp16(r.id, layer, 0, blocks, 0, config_.num_kv_heads, k.data(), v.data());
    if (s.code() == absl::StatusCode::kNotFound) return;
    if (!s.ok()) {
      record_.Bad(absl::StrFormat("%s ReadFp16: %s", what, s.ToString()));
      return;
    }
    n_read_++;
    const uint32_t rows = blocks * bt;
    if (!r.chaos && rows > r.plan.size()) {
      record_.Bad(
          absl::StrFormat("%s: rows up to %d, past the plan's %d", what, rows, r.plan.size()));
      return;
    }
    const std::string diff = oracle_->ReadDifference(
        k.data(), v.data(), rows, w, layer,
        [&](uint32_t row) { return r.chaos ? r.chaos_hash : r.hashes[row]; });
    if (diff.empty()) return;
    record_.Bad(
        absl::StrFormat("%s: lease %d layer %d (written %d, matched %d, match ids %d, plan len %d) "
                        "content wrong at %s",
                        what, r.id, layer, w, r.matched, r.match_ids, r.plan.size(), diff));
  }

  void DoPut(std::mt19937& rng) {
    std::vector<int32_t> ids = RandomIds(rng, 28);
    if (ids.empty()) ids.push_back(1);
    const std::vector<uint64_t> h = PrefixHashes(ids);
    const size_t pt = oracle_->pt();
    const int n = static_cast<int>(ids.size());
    std::vector<std::vector<uint16_t>> k(2), v(2);
    for (int layer = 0; layer < 2; ++layer) {
      std::tie(k[layer], v[layer]) = oracle_->InputRows(h.data(), n, layer);
    }
    auto session = store_->BeginPut(config_.name, ids);
    if (!session.ok()) {
      if (session.status().code() != absl::StatusCode::kResourceExhausted)
        record_.Bad("BeginPut: " + session.status().ToString());
      return;
    }
    struct Chunk {
      int layer, begin, len;
    };
    std::vector<Chunk> chunks;
    for (int layer = 0; layer < 2; ++layer) {
      int at = 0;
      while (at < n) {
        const int len = 1 + static_cast<int>(rng() % n);
        chunks.push_back({layer, at, std::min(len, n - at)});
        at += len;
      }
    }
    std::shuffle(chunks.begin(), chunks.end(), rng);
    const bool nan = rng() % 10 == 0;
    const size_t nan_chunk = rng() % chunks.size();
    const bool abandon = rng() % 20 == 0;
    tl_fail_permille = 10;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const Chunk& c = chunks[i];
      std::vector<uint16_t> ck(k[c.layer].begin() + c.begin * pt,
                               k[c.layer].begin() + (c.begin + c.len) * pt);
      if (nan && i == nan_chunk) ck[rng() % ck.size()] = 0x7E00;
      absl::Status s = (*session)->AddChunk(c.layer, c.begin, c.len, ck.data(),
                                            v[c.layer].data() + c.begin * pt);
      if (nan && i == nan_chunk) {
        if (s.code() != absl::StatusCode::kInvalidArgument)
          record_.Bad("NaN chunk: " + s.ToString());
        tl_fail_permille = 0;
        return;
      }
      if (!s.ok()) {
        if (s.code() != absl::StatusCode::kInternal) record_.Bad("AddChunk: " + s.ToString());
        tl_fail_permille = 0;
        return;
      }
    }
    tl_fail_permille = 0;
    if (abandon) return;
    auto r = (*session)->Commit();
    if (!r.ok()) {
      record_.Bad("Commit: " + r.status().ToString());
      return;
    }
    n_put_++;
    record_.Remember(ids);
  }

  void DoMatch(std::mt19937& rng) {
    auto rec = std::make_shared<LeaseRec>();
    std::vector<int32_t> ids = RandomIds(rng, 28);
    if (rng() % 20 == 0) ids.clear();
    bool rejoin = false;
    if (rng() % 4 == 0) {
      ids.clear();
      rec->chaos = true;
      const auto earlier = rng() % 2 == 0 ? record_.PickChaos(rng) : std::nullopt;
      if (earlier.has_value()) {  // an earlier chaos sequence, maybe published
        std::tie(rec->chaos_id, rec->chaos_hash) = *earlier;
        ids.assign(4 + rng() % 20, rec->chaos_id);
        rejoin = true;
      }
    }
    // Plan: a deterministic continuation of the ids' family (so that leases share tails), or
    // a private one.
    rec->plan = ids;
    const bool shared_tail = rng() % 2 == 0;
    const int32_t base = ids.empty() ? 50000 : ids.back() + 1;
    const int32_t salt = shared_tail ? 0 : static_cast<int32_t>(rng() % 1000) * 100000;
    for (int i = 0; rec->plan.size() < 40; ++i) rec->plan.push_back(base + salt + i);
    rec->hashes = PrefixHashes(rec->plan);
    rec->match_ids = static_cast<uint32_t>(ids.size());
    auto m = store_->Match(config_.name, ids, absl::Seconds(1 + rng() % 5));
    if (!m.ok()) {
      if (m.status().code() != absl::StatusCode::kResourceExhausted)
        record_.Bad("Match: " + m.status().ToString());
      return;
    }
    n_match_++;
    rec->id = m->lease_id;
    rec->matched = m->cached_tokens;
    if (rejoin) {
      n_chaos_hits_ += m->cached_tokens / config_.block_tokens;
    } else if (rec->chaos) {
      rec->chaos_id = 100000000 + static_cast<int32_t>(Mix(rec->id) % 1000000000);
      rec->chaos_hash = Mix(rec->id ^ 0xC4A05);
      record_.AddChaos(rec->chaos_id, rec->chaos_hash);
    }
    rec->count[0] = rec->count[1] = m->cached_tokens;
    if (!rec->chaos) {
      record_.Remember(ids);
      record_.Remember(rec->plan);
    }
    for (int layer = 0; layer < 2; ++layer) CheckRead(*rec, layer, rec->matched, "match");
    record_.AddLease(std::move(rec));
  }

  void ChaosAppend(std::mt19937& rng, LeaseRec& rec, int layer) {
    auto view = store_->DescribeLease(rec.id);
    if (!view.ok() || view->num_blocks >= 6) return;
    const uint32_t k = 1 + rng() % 3;
    const std::vector<uint64_t> hashes(k, rec.chaos_hash);
    auto [kk, vv] = oracle_->InputRows(hashes.data(), k, layer);
    std::vector<int32_t> ids;
    if (rng() % 8 != 0) {
      for (uint32_t i = 0; i < k; ++i) ids.push_back(rng() % 32 == 0 ? -1 : rec.chaos_id);
    }
    const bool nan = rng() % 20 == 0;
    if (nan) kk[rng() % kk.size()] = 0xFC00;
    tl_fail_permille = 100;
    auto r = store_->Append(rec.id, layer, ids, k, kk.data(), vv.data());
    tl_fail_permille = 0;
    if (r.ok()) {
      if (nan) record_.Bad("chaos Append with -Inf accepted");
      if (*r < k) record_.Bad(absl::StrFormat("chaos Append returned %d < %d", *r, k));
      n_append_++;
      return;
    }
    AppendFailed(rec, r.status(), nan, "chaos Append");
  }

  // After an append to `rec` failed with `s`: forgets the lease when it is gone, and reports a
  // code no append may fail with. It may: its lease gone, its Inf (`nan`), a full pool, an
  // injected failure, and on a chaos lease a layer lost (appends in flight together on one layer,
  // one failing before a later one).
  void AppendFailed(const LeaseRec& rec, const absl::Status& s, bool nan, const char* what) {
    using C = absl::StatusCode;
    const C c = s.code();
    if (c == C::kNotFound) record_.Forget(rec.id);
    const bool lost =
        rec.chaos && c == C::kFailedPrecondition && absl::StrContains(s.message(), "lost layer");
    if (c == C::kNotFound || (nan && c == C::kInvalidArgument) || c == C::kResourceExhausted ||
        c == C::kInternal || lost) {
      return;
    }
    record_.Bad(absl::StrCat(what, ": ", s.ToString()));
  }

  void DoAppend(std::mt19937& rng) {
    auto rec = record_.PickLease(rng);
    if (rec == nullptr) return;
    const int layer = static_cast<int>(rng() % 2);
    if (rec->chaos) return ChaosAppend(rng, *rec, layer);
    std::lock_guard<std::mutex> l(rec->layer_mu[layer]);
    const uint32_t n = rec->count[layer];
    if (n < rec->plan.size() && rng() % 16 == 0) return WrongIdsAppend(*rec, layer, n);
    uint32_t k = 1 + rng() % 3;
    if (n + k > rec->plan.size()) k = static_cast<uint32_t>(rec->plan.size()) - n;
    if (k == 0) return;
    auto [kk, vv] = oracle_->InputRows(rec->hashes.data() + n, k, layer);
    std::vector<int32_t> ids;
    if (rng() % 2 == 0) {
      for (uint32_t i = 0; i < k; ++i) ids.push_back(rng() % 5 == 0 ? -1 : rec->plan[n + i]);
    }
    const bool nan = rng() % 20 == 0;
    if (nan) vv[rng() % vv.size()] = 0x7C00;
    tl_fail_permille = 100;
    auto r = store_->Append(rec->id, layer, ids, k, kk.data(), vv.data());
    tl_fail_permille = 0;
    if (r.ok()) {
      if (nan) record_.Bad("Append with Inf accepted");
      if (*r != n + k) {
        record_.Bad(absl::StrFormat("Append returned %d, expected %d (lease %d layer %d)", *r,
                                    n + k, rec->id, layer));
      }
      rec->count[layer] = *r;
      n_append_++;
      return;
    }
    AppendFailed(*rec, r.status(), nan, "Append");
  }

  // An append of tokens [n, end of n's block) that names wrong ids (another sequence's) and that
  // the backend fails, after the other layer's unnamed append of the same tokens completed from
  // inside the failing call. Retried unnamed, the tokens fill their block on both layers: nothing
  // may be cached under the wrong ids then, nor at the final check (which matches them too).
  void WrongIdsAppend(LeaseRec& rec, int layer, uint32_t n) {
    const uint32_t bt = static_cast<uint32_t>(config_.block_tokens);
    const uint32_t k = std::min<uint32_t>(static_cast<uint32_t>(rec.plan.size()) - n, bt - n % bt);
    const auto [kk, vv] = oracle_->InputRows(rec.hashes.data() + n, k, layer);
    std::vector<int32_t> named = rec.plan;
    for (uint32_t i = n; i < n + k; ++i) named[i] |= 0x40000000;
    record_.Remember(named);
    bool other_done = false;
    const std::function<void()> other_layer = [&] {
      other_done = AppendOtherLayer(rec, 1 - layer, n, k);
    };
    tl_fail_permille = 1000;
    tl_before_append_failure = &other_layer;
    auto r = store_->Append(rec.id, layer, absl::MakeConstSpan(named).subspan(n, k), k, kk.data(),
                            vv.data());
    tl_fail_permille = 0;
    tl_before_append_failure = nullptr;
    if (r.ok()) {
      record_.Bad("Append with an injected failure succeeded");
      rec.count[layer] = *r;
      return;
    }
    AppendFailed(rec, r.status(), false, "wrong-ids Append");
    if (!other_done) return;
    r = store_->Append(rec.id, layer, {}, k, kk.data(), vv.data());
    if (!r.ok()) return AppendFailed(rec, r.status(), false, "retried Append");
    rec.count[layer] = *r;
    n_append_++;
    auto probe = store_->Match(config_.name, named, absl::Seconds(5));
    if (!probe.ok()) {
      if (probe.status().code() != absl::StatusCode::kResourceExhausted)
        record_.Bad("Match: " + probe.status().ToString());
      return;
    }
    if (probe->cached_tokens > n - n % bt) {
      record_.Bad(
          absl::StrFormat("lease %d: %d tokens cached under a failed append's ids at [%d, %d)",
                          rec.id, probe->cached_tokens, n, n + k));
    }
    (void)store_->Release(probe->lease_id);
  }

  // Appends tokens [n, n + k) of `rec`'s plan to `layer`, unnamed, when that layer holds n tokens
  // and no other append of the test is on it: whether it did.
  bool AppendOtherLayer(LeaseRec& rec, int layer, uint32_t n, uint32_t k) {
    std::unique_lock<std::mutex> l(rec.layer_mu[layer], std::try_to_lock);
    if (!l.owns_lock() || rec.count[layer] != n) return false;
    const auto [kk, vv] = oracle_->InputRows(rec.hashes.data() + n, k, layer);
    const int permille = std::exchange(tl_fail_permille, 0);
    auto r = store_->Append(rec.id, layer, {}, k, kk.data(), vv.data());
    tl_fail_permille = permille;
    if (!r.ok()) {
      AppendFailed(rec, r.status(), false, "Append beside a failing one");
      return false;
    }
    rec.count[layer] = *r;
    n_append_++;
    return true;
  }

  void DoAttend(std::mt19937& rng) {
    const int m = 1 + static_cast<int>(rng() % 4);
    std::vector<std::shared_ptr<LeaseRec>> recs;
    for (int i = 0; i < m; ++i) {
      auto r = record_.PickLease(rng);
      if (r == nullptr) return;
      recs.push_back(r);
    }
    const int layer = static_cast<int>(rng() % 2);
    std::vector<LeaseRec*> distinct;
    bool any_chaos = false;
    for (auto& r : recs) {
      distinct.push_back(r.get());
      any_chaos |= r->chaos;
    }
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    std::vector<std::unique_lock<std::mutex>> locks;
    for (LeaseRec* r : distinct) {
      if (!r->chaos) locks.emplace_back(r->layer_mu[layer]);
    }
    const size_t pt = oracle_->pt();
    const int qh = config_.num_kv_heads;
    std::vector<uint16_t> q(m * pt), nk(m * pt), nv(m * pt);
    for (auto& x : q) x = FloatToHalf(std::normal_distribution<float>(0.f, 1.f)(rng));
    std::vector<KvStore::AttendItem> items(m);
    std::vector<uint32_t> pos(m);
    std::vector<bool> has_new(m);
    // count after the batch, per distinct lease
    std::vector<uint32_t> before(distinct.size()), after(distinct.size());
    for (size_t d = 0; d < distinct.size(); ++d) before[d] = after[d] = distinct[d]->count[layer];
    auto di = [&](LeaseRec* r) {
      return std::lower_bound(distinct.begin(), distinct.end(), r) - distinct.begin();
    };
    const int mode = static_cast<int>(rng() % 3);  // 0 none new, 1 all new, 2 mixed
    bool any_new = false;
    for (int i = 0; i < m; ++i) {
      LeaseRec* r = recs[i].get();
      items[i].lease_id = r->id;
      items[i].q = q.data() + i * pt;
      has_new[i] = mode == 1 || (mode == 2 && rng() % 2 == 0);
      if (has_new[i] && r->chaos) {
        oracle_->Input(r->chaos_hash, layer, nk.data() + i * pt, nv.data() + i * pt);
        items[i].new_k = nk.data() + i * pt;
        items[i].new_v = nv.data() + i * pt;
        items[i].new_token_id = rng() % 16 == 0 ? -1 : r->chaos_id;
        any_new = true;
      } else if (has_new[i]) {
        uint32_t& a = after[di(r)];
        if (a >= r->plan.size()) return;
        pos[i] = a++;
        oracle_->Input(r->hashes[pos[i]], layer, nk.data() + i * pt, nv.data() + i * pt);
        items[i].new_k = nk.data() + i * pt;
        items[i].new_v = nv.data() + i * pt;
        items[i].new_token_id = rng() % 3 == 0 ? -1 : r->plan[pos[i]];
        any_new = true;
      }
    }
    bool expect_invalid = false;
    for (int i = 0; i < m; ++i) {
      if (!has_new[i] && (recs[i]->chaos || before[di(recs[i].get())] == 0)) {
        expect_invalid = true;  // a chaos lease may hold nothing
      }
    }
    std::vector<float> out(m * pt), lse(m * qh);
    std::vector<uint32_t> ctx(m);
    tl_fail_permille = 100;
    absl::Status s =
        store_->Attend(layer, qh, 0.f, items, {out.data(), nullptr, lse.data(), ctx.data()});
    tl_fail_permille = 0;
    if (!s.ok()) {
      // A lease gone, an item on an empty lease, a chaos lease's layer busy with an append, or
      // (with new tokens) a full pool or an injected failure.
      const absl::StatusCode c = s.code();
      const bool may_fail = c == absl::StatusCode::kNotFound ||
                            (c == absl::StatusCode::kInvalidArgument && expect_invalid) ||
                            (c == absl::StatusCode::kFailedPrecondition && any_chaos) ||
                            (any_new && (c == absl::StatusCode::kResourceExhausted ||
                                         c == absl::StatusCode::kInternal));
      if (!may_fail) {
        record_.Bad(absl::StrFormat("Attend (mode %d, %d items, layer %d): %s", mode, m, layer,
                                    s.ToString()));
      }
      return;
    }
    if (expect_invalid && !any_chaos) record_.Bad("Attend on an empty lease succeeded");
    n_attend_++;
    for (size_t d = 0; d < distinct.size(); ++d) {
      if (!distinct[d]->chaos) distinct[d]->count[layer] = after[d];
    }
    // Against fp64 attention over the oracle's rows.
    for (int i = 0; i < m; ++i) {
      LeaseRec* r = recs[i].get();
      const uint32_t len = r->chaos ? ctx[i] : has_new[i] ? pos[i] + 1 : after[di(r)];
      if (ctx[i] != len || len == 0) {
        record_.Bad(absl::StrFormat("Attend item %d: context %d, expected %d", i, ctx[i], len));
        continue;
      }
      const double worst = oracle_->AttentionError(
          q.data() + i * pt, out.data() + i * pt, layer, len,
          [&](uint32_t t) { return r->chaos ? r->chaos_hash : r->hashes[t]; });
      if (worst > 0.02) {
        record_.Bad(
            absl::StrFormat("Attend item %d (lease %d, layer %d, len %d, new %d): output off by "
                            "%.4f",
                            i, r->id, layer, len, int(has_new[i]), worst));
      }
    }
  }

  void DoRead(std::mt19937& rng) {
    auto rec = record_.PickLease(rng);
    if (rec == nullptr) return;
    const int layer = static_cast<int>(rng() % 2);
    auto view = store_->DescribeLease(rec->id);
    if (!view.ok()) {
      if (view.status().code() == absl::StatusCode::kNotFound) {
        record_.Forget(rec->id);
      } else {
        record_.Bad("DescribeLease: " + view.status().ToString());
      }
      return;
    }
    const uint32_t w = view->layer_tokens[layer];
    const int kind = static_cast<int>(rng() % 4);
    if (kind <= 1 || w == 0) {
      CheckRead(*rec, layer, w, "read");
    } else if (kind == 2) {
      const PageLayout l = LayerLayout(config_, layer);
      const uint32_t blocks = (w + config_.block_tokens - 1) / config_.block_tokens;
      std::vector<uint8_t> k(blocks * l.num_kv_heads * l.head_page_bytes()), v(k.size());
      absl::Status s =
          store_->ReadRaw(rec->id, layer, 0, blocks, 0, config_.num_kv_heads, k.data(), v.data());
      if (!s.ok() && s.code() != absl::StatusCode::kNotFound)
        record_.Bad("ReadRaw: " + s.ToString());
    } else if (config_.sink_tokens > 0) {
      const size_t hd = config_.head_dim;
      std::vector<uint16_t> k(config_.num_kv_heads * config_.sink_tokens * hd), v(k.size());
      absl::Status s = store_->ReadRawSinks(rec->id, layer, 0, config_.num_kv_heads,
                                            reinterpret_cast<uint8_t*>(k.data()),
                                            reinterpret_cast<uint8_t*>(v.data()));
      if (s.code() == absl::StatusCode::kNotFound) return;
      if (!s.ok()) {
        record_.Bad("ReadRawSinks: " + s.ToString());
        return;
      }
      std::vector<uint16_t> ik(oracle_->pt()), iv(oracle_->pt());
      for (int t = 0; t < config_.sink_tokens && t < static_cast<int>(w); ++t) {
        oracle_->Input(rec->chaos ? rec->chaos_hash : rec->hashes[t], layer, ik.data(), iv.data());
        for (int h = 0; h < config_.num_kv_heads; ++h) {
          const uint16_t* g = k.data() + (h * config_.sink_tokens + t) * hd;
          if (!std::equal(g, g + hd, ik.data() + h * hd)) {
            record_.Bad(
                absl::StrFormat("ReadRawSinks lease %d layer %d token %d head %d wrong (w %d)",
                                rec->id, layer, t, h, w));
            return;
          }
        }
      }
    }
  }

  void Work(int seed, int steps) {
    std::mt19937 rng(seed);
    tl_rng = &rng;
    for (int step = 0; step < steps; ++step) {
      const int op = static_cast<int>(rng() % 100);
      if (op < 14) {
        DoPut(rng);
      } else if (op < 30) {
        DoMatch(rng);
      } else if (op < 50) {
        DoAppend(rng);
      } else if (op < 68) {
        DoAttend(rng);
      } else if (op < 85) {
        DoRead(rng);
      } else if (op < 95) {
        auto rec = record_.PickLease(rng);
        if (rec != nullptr) {
          record_.Forget(rec->id);
          absl::Status s = store_->Release(rec->id);
          if (!s.ok() && s.code() != absl::StatusCode::kNotFound)
            record_.Bad("Release: " + s.ToString());
        }
      } else if (op < 98) {
        clock_.Advance(absl::Seconds(1));
        store_->ExpireLeases();
      } else {
        const std::string why =
            PoolCountsInconsistency(store_->Stats().namespaces[0], config_.block_tokens);
        if (!why.empty()) record_.Bad(why);
      }
    }
    tl_rng = nullptr;
  }

  std::unique_ptr<Oracle> oracle_;
  StressRecord record_;
  std::atomic<int> n_chaos_hits_{0};
  std::atomic<int> n_put_{0}, n_match_{0}, n_append_{0}, n_attend_{0}, n_read_{0};
};

TEST_F(ContentStress, NoSinks) { Run(24, 0, 16); }
TEST_F(ContentStress, Sinks) { Run(24, 2, 4); }
TEST_F(ContentStress, SinksTinyPool) { Run(10, 2, 2); }

}  // namespace
}  // namespace kvpool::testing
