// A thread that rewrites a buffer on request, as the client of an AttendSocket region rewrites q
// and the new K/V before every step: the step then reads memory that another core has just
// written (dirty in that core's caches), as the server does, instead of memory that stays in the
// caller's own caches between calls.
#ifndef KVPOOL_TESTS_COMMON_REGION_WRITER_H_
#define KVPOOL_TESTS_COMMON_REGION_WRITER_H_

#include <atomic>
#include <cstddef>
#include <cstring>
#include <thread>

namespace kvpool::testing {

class RegionWriter {
 public:
  // Copies `bytes` from `source` to `dst` on every Rewrite(); both outlive the writer.
  RegionWriter(void* dst, const void* source, size_t bytes)
      : thread_([this, dst, source, bytes] {
          for (int round = 1;; ++round) {
            int asked;
            while ((asked = asked_.load(std::memory_order_acquire)) >= 0 && asked < round) {
            }
            if (asked < 0) return;
            std::memcpy(dst, source, bytes);
            done_.store(round, std::memory_order_release);
          }
        }) {}
  ~RegionWriter() {
    asked_.store(-1, std::memory_order_release);
    thread_.join();
  }
  RegionWriter(const RegionWriter&) = delete;
  RegionWriter& operator=(const RegionWriter&) = delete;

  // Returns once the writer thread has copied the source again (both threads spin meanwhile).
  void Rewrite() {
    const int round = ++rounds_;
    asked_.store(round, std::memory_order_release);
    while (done_.load(std::memory_order_acquire) < round) {
    }
  }

 private:
  int rounds_ = 0;
  std::atomic<int> asked_{0}, done_{0};
  std::thread thread_;  // last: started once the counters exist
};

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_COMMON_REGION_WRITER_H_
