// What the threads of the content stress test (tests/service/kv_store_content_stress_test.cc)
// share: the leases in use, every sequence used, the chaos sequences begun, and the failures
// seen. Thread-safe; header-only.
#ifndef KVPOOL_TESTS_SERVICE_STORE_CONTENT_STRESS_RECORD_H_
#define KVPOOL_TESTS_SERVICE_STORE_CONTENT_STRESS_RECORD_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace kvpool::testing {

struct LeaseRec {
  uint64_t id = 0;
  std::vector<int32_t> plan;
  std::vector<uint64_t> hashes;
  uint32_t matched = 0;
  uint32_t match_ids = 0;
  // A chaos lease: matched with no ids, every appended row is the same per layer (X), so that
  // many threads append and attend on one layer at once without the test knowing positions.
  bool chaos = false;
  int32_t chaos_id = 0;
  uint64_t chaos_hash = 0;
  std::mutex layer_mu[2];
  uint32_t count[2] = {0, 0};  // guarded by layer_mu[l]
};

class StressRecord {
 public:
  // A failure, kept (the first 50) for the test to report.
  void Bad(const std::string& what) {
    std::lock_guard<std::mutex> l(mu_);
    if (failures_.size() < 50) failures_.push_back(what);
  }
  std::vector<std::string> Failures() const {
    std::lock_guard<std::mutex> l(mu_);
    return failures_;
  }

  // A sequence of token ids used, for the final check of what is cached under it.
  void Remember(const std::vector<int32_t>& ids) {
    if (ids.empty()) return;
    std::lock_guard<std::mutex> l(mu_);
    sequences_.insert(ids);
  }
  std::vector<std::vector<int32_t>> Sequences() const {
    std::lock_guard<std::mutex> l(mu_);
    return {sequences_.begin(), sequences_.end()};
  }

  void AddLease(std::shared_ptr<LeaseRec> lease) {
    std::lock_guard<std::mutex> l(mu_);
    leases_.push_back(std::move(lease));
  }
  // A lease in use at random; null when none is.
  std::shared_ptr<LeaseRec> PickLease(std::mt19937& rng) const {
    std::lock_guard<std::mutex> l(mu_);
    if (leases_.empty()) return nullptr;
    return leases_[rng() % leases_.size()];
  }
  void Forget(uint64_t id) {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < leases_.size(); ++i) {
      if (leases_[i]->id == id) {
        leases_.erase(leases_.begin() + i);
        return;
      }
    }
  }
  // Every lease still in use, forgotten.
  std::vector<std::shared_ptr<LeaseRec>> TakeLeases() {
    std::lock_guard<std::mutex> l(mu_);
    return std::exchange(leases_, {});
  }

  // Chaos sequences: (id, hash) of each begun.
  void AddChaos(int32_t id, uint64_t hash) {
    std::lock_guard<std::mutex> l(mu_);
    chaos_.emplace_back(id, hash);
  }
  // One begun earlier, at random; none when there is none.
  std::optional<std::pair<int32_t, uint64_t>> PickChaos(std::mt19937& rng) const {
    std::lock_guard<std::mutex> l(mu_);
    if (chaos_.empty()) return std::nullopt;
    return chaos_[rng() % chaos_.size()];
  }
  std::vector<std::pair<int32_t, uint64_t>> Chaos() const {
    std::lock_guard<std::mutex> l(mu_);
    return chaos_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> failures_;
  std::set<std::vector<int32_t>> sequences_;
  std::vector<std::shared_ptr<LeaseRec>> leases_;
  std::vector<std::pair<int32_t, uint64_t>> chaos_;
};

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_SERVICE_STORE_CONTENT_STRESS_RECORD_H_
