// Appends that overlap on one lease and layer, and appends whose backend call fails: the store
// publishes and serves only positions that are written, in order.
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

// A ForwardingBackend whose decode steps run their append through QuantizeAppend, so that the
// test backends below, which override it, see both kinds of append.
class StepAppendsBackend : public ForwardingBackend {
 public:
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override {
    if (append != nullptr) {
      if (absl::Status s = QuantizeAppend(*append); !s.ok()) return s;
    }
    return inner().PagedDecodeAttention(p, nullptr);
  }
};

// The CPU backend, except that the QuantizeAppend call after Arm() waits until released, or
// fails without writing.
class GatedBackend final : public StepAppendsBackend {
 public:
  enum class Mode { kHold, kFail };

  void Arm(Mode mode) {
    mode_ = mode;
    armed_.store(true);
  }
  void Release() { release_.Notify(); }
  void WaitEntered() { entered_.WaitForNotification(); }

  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override {
    if (armed_.exchange(false)) {
      if (mode_ == Mode::kFail) return absl::InternalError("injected backend failure");
      entered_.Notify();
      release_.WaitForNotification();
    }
    return inner().QuantizeAppend(p);
  }

 private:
  Mode mode_ = Mode::kHold;  // written before armed_ is set
  std::atomic<bool> armed_{false};
  absl::Notification entered_, release_;
};

// A store over a `Backend` holding tokens [0, 8) of a 16-token sequence (blocks of 4), and a
// lease on them, matched with all 16 ids or the first 8.
template <typename Backend>
class CachedHalfTest : public StoreTest {
 protected:
  void SetUpLease(bool match_all_ids) {
    store_.reset();  // before the backend it uses
    auto backend = std::make_unique<Backend>();
    gate_ = backend.get();
    backend_ = std::move(backend);
    MakeStore(16);
    ids_ = TokenIds(16, 7);
    kv_ = MakeSequenceKv(config_, 16, 31);
    ASSERT_TRUE(Put(std::vector<int32_t>(ids_.begin(), ids_.begin() + 8), kv_).ok());
    auto lease = store_->Match(
        "main", std::vector<int32_t>(ids_.begin(), ids_.begin() + (match_all_ids ? 16 : 8)),
        absl::ZeroDuration());
    ASSERT_TRUE(lease.ok()) << lease.status();
    lease_ = lease->lease_id;
  }

  // Appends the sequence's tokens [first, first + n) to `layer`, naming `named` (or none).
  absl::Status Append(uint32_t layer, int first, int n, absl::Span<const int32_t> named = {}) {
    const size_t pt = PerToken();
    return store_
        ->Append(lease_, layer, named, n, kv_.k[layer].data() + first * pt,
                 kv_.v[layer].data() + first * pt)
        .status();
  }
  // The same, naming the tokens' own ids.
  absl::Status AppendTokens(uint32_t layer, int first, int n) {
    return Append(layer, first, n, absl::MakeConstSpan(ids_).subspan(first, n));
  }

  Backend* gate_ = nullptr;
  std::vector<int32_t> ids_;
  SequenceKv kv_;
  uint64_t lease_ = 0;
};

class AppendOrderTest : public CachedHalfTest<GatedBackend> {
 protected:
  // CachedHalfTest's lease and (with `layer_one_ahead`) tokens [8, 16) appended to layer 1, so
  // that blocks 2 and 3 are complete once layer 0 has them too.
  void SetUpLease(bool layer_one_ahead = true, bool match_all_ids = false) {
    CachedHalfTest::SetUpLease(match_all_ids);
    if (layer_one_ahead) {
      ASSERT_TRUE(AppendTokens(1, 8, 8).ok());
    }
  }

  // Tokens another lease finds cached for the whole sequence.
  uint32_t CachedTokens() {
    auto probe = store_->Match("main", ids_, absl::ZeroDuration());
    EXPECT_TRUE(probe.ok()) << probe.status();
    if (!probe.ok()) return 0;
    EXPECT_TRUE(store_->Release(probe->lease_id).ok());
    return probe->cached_tokens;
  }

  uint32_t WrittenTokens(uint32_t layer) {
    auto view = store_->DescribeLease(lease_);
    EXPECT_TRUE(view.ok()) << view.status();
    return view.ok() ? view->layer_tokens[layer] : 0;
  }
};

TEST_F(AppendOrderTest, AnAppendFinishingFirstWaitsForTheOneBeforeIt) {
  ASSERT_NO_FATAL_FAILURE(SetUpLease());
  gate_->Arm(GatedBackend::Mode::kHold);
  std::thread first([&] { EXPECT_TRUE(AppendTokens(0, 8, 2).ok()); });
  gate_->WaitEntered();
  // Tokens 10 to 15 land while 8 and 9 are still being written: 14 tokens' worth of appends
  // have finished, but only the first 8 positions are written.
  ASSERT_TRUE(AppendTokens(0, 10, 6).ok());
  EXPECT_EQ(WrittenTokens(0), 8u);
  EXPECT_EQ(CachedTokens(), 8u) << "block 2 published before tokens 8 and 9 were written";
  // A decode step on that layer would read the unwritten slots: refused.
  const std::vector<uint16_t> q = ToHalf(MakeNormal(2 * config_.head_dim, 5));
  std::vector<float> out(q.size());
  uint32_t context = 0;
  KvStore::AttendItem item;
  item.lease_id = lease_;
  item.q = q.data();
  EXPECT_EQ(store_->Attend(0, 2, 0.f, {item}, {out.data(), nullptr, nullptr, &context}).code(),
            absl::StatusCode::kFailedPrecondition);
  gate_->Release();
  first.join();
  EXPECT_EQ(WrittenTokens(0), 16u);
  EXPECT_EQ(CachedTokens(), 16u);
  ASSERT_TRUE(store_->Attend(0, 2, 0.f, {item}, {out.data(), nullptr, nullptr, &context}).ok());
  EXPECT_EQ(context, 16u);
}

TEST_F(AppendOrderTest, AFailedAppendGivesItsSlotsBack) {
  ASSERT_NO_FATAL_FAILURE(SetUpLease());
  gate_->Arm(GatedBackend::Mode::kFail);
  EXPECT_EQ(AppendTokens(0, 8, 8).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(WrittenTokens(0), 8u);
  EXPECT_EQ(CachedTokens(), 8u);
  // The retry takes the same positions, and the blocks published then hold what it wrote.
  ASSERT_TRUE(AppendTokens(0, 8, 8).ok());
  EXPECT_EQ(WrittenTokens(0), 16u);
  EXPECT_EQ(CachedTokens(), 16u);
  const size_t pt = PerToken();
  std::vector<uint16_t> k(16 * pt), v(16 * pt);
  ASSERT_TRUE(store_->ReadFp16(lease_, 0, 0, 4, 0, 2, k.data(), v.data()).ok());
  const auto [rk, rv] = ReferenceFp16(kv_, 0, 16);
  EXPECT_EQ(k, rk);
  EXPECT_EQ(v, rv);
}

// The ids a failed append named are forgotten where no layer holds the tokens: appends of unnamed
// tokens there later publish nothing (before, the failed append's ids stayed and named them).
TEST_F(AppendOrderTest, AFailedAppendForgetsTheIdsItNamed) {
  ASSERT_NO_FATAL_FAILURE(SetUpLease(/*layer_one_ahead=*/false));
  gate_->Arm(GatedBackend::Mode::kFail);
  EXPECT_EQ(AppendTokens(0, 8, 4).code(), absl::StatusCode::kInternal);
  for (uint32_t layer = 0; layer < 2; ++layer) ASSERT_TRUE(Append(layer, 8, 4).ok());
  EXPECT_EQ(WrittenTokens(0), 12u);
  EXPECT_EQ(WrittenTokens(1), 12u);
  EXPECT_EQ(CachedTokens(), 8u) << "tokens 8-11 published under the failed append's ids";
}

// The ids the lease got at Match stay when an append that named none fails: the retried tokens
// publish under them (before, the failure forgot every id at the positions it had reserved).
TEST_F(AppendOrderTest, AFailedUnnamedAppendKeepsTheIdsOfTheMatch) {
  ASSERT_NO_FATAL_FAILURE(SetUpLease(/*layer_one_ahead=*/false, /*match_all_ids=*/true));
  gate_->Arm(GatedBackend::Mode::kFail);
  EXPECT_EQ(Append(0, 8, 4).code(), absl::StatusCode::kInternal);
  for (uint32_t layer = 0; layer < 2; ++layer) ASSERT_TRUE(Append(layer, 8, 4).ok());
  EXPECT_EQ(CachedTokens(), 12u);
}

// The ids the lease got at Match come back when an append that named the same ids fails: the
// retried tokens publish under them (before, the failure forgot them).
TEST_F(AppendOrderTest, AFailedNamedAppendGivesBackTheIdsOfTheMatch) {
  ASSERT_NO_FATAL_FAILURE(SetUpLease(/*layer_one_ahead=*/false, /*match_all_ids=*/true));
  gate_->Arm(GatedBackend::Mode::kFail);
  EXPECT_EQ(AppendTokens(0, 8, 4).code(), absl::StatusCode::kInternal);
  for (uint32_t layer = 0; layer < 2; ++layer) ASSERT_TRUE(Append(layer, 8, 4).ok());
  EXPECT_EQ(CachedTokens(), 12u);
}

// The CPU backend, except that every append while `armed` (QuantizeAppend, or the append of a
// decode step) waits until released, then fails without writing: the i-th such call (from 0)
// once Release(n) has let n > i fail.
class OrderedFailBackend final : public StepAppendsBackend {
 public:
  std::atomic<bool> armed{false};
  // Whether `n` armed calls have begun within 10 s; if not, every armed call is let fail, so
  // that the test's threads end.
  bool WaitEntered(int n) {
    std::unique_lock<std::mutex> l(mu_);
    if (cv_.wait_for(l, std::chrono::seconds(10), [&] { return entered_ >= n; })) return true;
    released_ = INT_MAX;
    cv_.notify_all();
    return false;
  }
  void Release(int n) {
    {
      std::lock_guard<std::mutex> l(mu_);
      released_ = n;
    }
    cv_.notify_all();
  }
  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override {
    if (!armed.load()) return inner().QuantizeAppend(p);
    std::unique_lock<std::mutex> l(mu_);
    const int index = entered_++;
    cv_.notify_all();
    cv_.wait(l, [&] { return released_ > index; });
    return absl::InternalError("injected backend failure");
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int entered_ = 0, released_ = 0;
};

// CachedHalfTest over an OrderedFailBackend.
class FailedAppendTest : public CachedHalfTest<OrderedFailBackend> {
 protected:
  // A decode step over `layer` without a new token: its status, and the context it attended.
  absl::Status Attend(uint32_t layer, uint32_t* context) {
    return AttendBatch(layer, 1, -1, context);
  }

  // A decode step over `layer` with the lease as `items` items, each appending the sequence's next
  // token from `first` on (none when `first` < 0).
  absl::Status AttendBatch(uint32_t layer, int items, int first, uint32_t* context) {
    const std::vector<uint16_t> q = ToHalf(MakeNormal(2 * config_.head_dim, 5));
    const size_t pt = PerToken();
    std::vector<float> out(items * q.size());
    std::vector<uint32_t> contexts(items);
    std::vector<KvStore::AttendItem> batch(items);
    for (int i = 0; i < items; ++i) {
      batch[i].lease_id = lease_;
      batch[i].q = q.data();
      if (first < 0) continue;
      batch[i].new_k = kv_.k[layer].data() + (first + i) * pt;
      batch[i].new_v = kv_.v[layer].data() + (first + i) * pt;
      batch[i].new_token_id = -1;
    }
    const absl::Status s =
        store_->Attend(layer, 2, 0.f, batch, {out.data(), nullptr, nullptr, contexts.data()});
    *context = contexts.back();
    return s;
  }
};

// Layer 0's append naming wrong ids fails after layer 1's append at the same positions began:
// layer 1's names the same wrong ids and fails after it, or names none and completes. The tokens
// appended there later, unnamed, publish under the Match's ids when it gave some, and under none
// otherwise. Before, the second failure put back the first one's wrong ids, and the block was
// published under them; and a completed unnamed append held the positions, so the wrong ids
// stayed.
TEST_F(FailedAppendTest, AFailedAppendsIdsNameNothingWhateverTheOtherLayerDid) {
  for (const bool layer_one_completes : {false, true}) {
    for (const bool match_all_ids : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "layer_one_completes " << layer_one_completes
                                        << ", match_all_ids " << match_all_ids);
      ASSERT_NO_FATAL_FAILURE(SetUpLease(match_all_ids));
      const std::vector<int32_t> wrong = {90001, 90002, 90003, 90004};
      gate_->armed = true;
      std::thread first([&] { EXPECT_FALSE(Append(0, 8, 4, wrong).ok()); });
      EXPECT_TRUE(gate_->WaitEntered(1));
      if (layer_one_completes) {
        gate_->armed = false;
        EXPECT_TRUE(Append(1, 8, 4).ok());  // not ASSERT: the first thread must be released
        gate_->Release(1);
        first.join();
      } else {
        std::thread second([&] { EXPECT_FALSE(Append(1, 8, 4, wrong).ok()); });
        EXPECT_TRUE(gate_->WaitEntered(2));
        gate_->Release(1);
        first.join();
        gate_->Release(2);
        second.join();
      }
      gate_->armed = false;
      for (uint32_t layer = 0; layer < (layer_one_completes ? 1u : 2u); ++layer) {
        ASSERT_TRUE(Append(layer, 8, 4).ok());
      }
      std::vector<int32_t> under_wrong(ids_.begin(), ids_.begin() + 8);
      under_wrong.insert(under_wrong.end(), wrong.begin(), wrong.end());
      for (const auto& [probe_ids, want] :
           {std::pair{under_wrong, 8u}, std::pair{ids_, match_all_ids ? 12u : 8u}}) {
        auto probe = store_->Match("main", probe_ids, absl::ZeroDuration());
        ASSERT_TRUE(probe.ok()) << probe.status();
        EXPECT_EQ(probe->cached_tokens, want);
        ASSERT_TRUE(store_->Release(probe->lease_id).ok());
      }
    }
  }
}

// An append that fails after a later one on its layer completed leaves positions nothing will
// write: Append and Attend on that layer then say so (FAILED_PRECONDITION, "lost"), and the other
// layer goes on. Before, Append went on taking positions that never became readable, and Attend
// said an append was in flight, for the rest of the lease.
TEST_F(FailedAppendTest, AFailedAppendBeforeACompletedOneLosesItsLayer) {
  ASSERT_NO_FATAL_FAILURE(SetUpLease(/*match_all_ids=*/false));
  gate_->armed = true;
  std::thread first([&] { EXPECT_EQ(Append(0, 8, 2).code(), absl::StatusCode::kInternal); });
  EXPECT_TRUE(gate_->WaitEntered(1));
  gate_->armed = false;
  EXPECT_TRUE(Append(0, 10, 6).ok());
  gate_->Release(1);
  first.join();
  const absl::Status append = Append(0, 8, 1);
  EXPECT_EQ(append.code(), absl::StatusCode::kFailedPrecondition) << append;
  EXPECT_THAT(append.message(), ::testing::HasSubstr("lost layer 0's tokens from position 8"));
  uint32_t context = 0;
  const absl::Status attend = Attend(0, &context);
  EXPECT_EQ(attend.code(), absl::StatusCode::kFailedPrecondition) << attend;
  EXPECT_THAT(attend.message(), ::testing::HasSubstr("lost layer 0's tokens"));
  auto view = store_->DescribeLease(lease_);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->layer_tokens[0], 8u);
  ASSERT_TRUE(Append(1, 8, 8).ok());
  ASSERT_TRUE(Attend(1, &context).ok());
  EXPECT_EQ(context, 16u);
}

// An append of tokens 8 and 9, or a decode step whose two items append them to one lease, fails
// after an append of tokens 10 to 15 took the positions after them: their positions are lost.
// When that append fails too, all are given back, and the layer goes on from position 8.
TEST_F(FailedAppendTest, FailedAppendsGiveTheLayerBackWhenTheLaterOnesFailToo) {
  for (const bool first_is_a_step : {false, true}) {
    SCOPED_TRACE(first_is_a_step ? "a decode step first" : "an append first");
    ASSERT_NO_FATAL_FAILURE(SetUpLease(/*match_all_ids=*/false));
    gate_->armed = true;
    std::thread first([&] {
      uint32_t c = 0;
      const absl::Status s = first_is_a_step ? AttendBatch(0, 2, 8, &c) : Append(0, 8, 2);
      EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    });
    EXPECT_TRUE(gate_->WaitEntered(1));
    std::thread second([&] { EXPECT_EQ(Append(0, 10, 6).code(), absl::StatusCode::kInternal); });
    EXPECT_TRUE(gate_->WaitEntered(2));
    gate_->armed = false;
    gate_->Release(1);
    first.join();
    uint32_t context = 0;
    const absl::Status lost = Attend(0, &context);
    EXPECT_EQ(lost.code(), absl::StatusCode::kFailedPrecondition) << lost;
    EXPECT_THAT(lost.message(), ::testing::HasSubstr("lost layer 0's tokens from position 8"));
    EXPECT_EQ(Append(0, 8, 1).code(), absl::StatusCode::kFailedPrecondition);
    gate_->Release(2);
    second.join();
    ASSERT_TRUE(Append(0, 8, 8).ok());
    ASSERT_TRUE(Attend(0, &context).ok());
    EXPECT_EQ(context, 16u);
  }
}

}  // namespace
}  // namespace kvpool::testing
