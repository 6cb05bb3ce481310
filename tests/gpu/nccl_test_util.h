// Shared by the two-GPU NCCL test and benchmark (tests/gpu/nccl_transfer_test.cc,
// tests/gpu/nccl_bench.cc): the server runs in the test process on GPU 0 and a worker is this
// same binary started again (posix_spawn of /proc/self/exe) on GPU 1, so the two NCCL ranks live
// in different processes as in production. Header-only.
#ifndef KVPOOL_TESTS_GPU_NCCL_TEST_UTIL_H_
#define KVPOOL_TESTS_GPU_NCCL_TEST_UTIL_H_

#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "service/store/namespace_config.h"

extern char** environ;

namespace kvpool::nccl_test {

// The namespace both processes use: the default (Llama-3-8B) geometry, INT4, rotated.
inline NamespaceConfig TestNamespace(const std::string& name, uint64_t capacity_bytes) {
  NamespaceConfig c = DefaultNamespaceConfig(capacity_bytes);
  c.name = name;
  return c;
}

inline uint64_t SplitMix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Deterministic fp16 K/V of a sequence, the same in every process: [layers][tokens][heads]
// [head_dim], never zero or non-finite, |x| in [1/16, 2) with a random sign and mantissa, and
// outlier channels (channel % 37 == 5) 16x larger. K and V use different streams.
inline void FillSequenceKv(uint64_t seed, const NamespaceConfig& c, uint32_t tokens,
                           std::vector<uint16_t>* k, std::vector<uint16_t>* v) {
  const size_t n = size_t{static_cast<uint32_t>(c.num_layers)} * tokens * c.num_kv_heads *
                   c.head_dim;
  k->resize(n);
  v->resize(n);
  for (int kv = 0; kv < 2; ++kv) {
    uint16_t* out = (kv == 0 ? k : v)->data();
    const uint64_t stream = SplitMix64(seed * 2 + kv);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t z = SplitMix64(stream ^ i);
      const bool outlier = (i % c.head_dim) % 37 == 5;
      const uint32_t exponent = 11 + static_cast<uint32_t>((z >> 1) % 5) + (outlier ? 4 : 0);
      out[i] = static_cast<uint16_t>(((z & 1) << 15) | (exponent << 10) | ((z >> 8) & 0x3ff));
    }
  }
}

// Token ids of a sequence, distinct per seed so sequences never share blocks.
inline std::vector<int32_t> SequenceTokens(uint64_t seed, uint32_t tokens) {
  std::vector<int32_t> ids(tokens);
  for (uint32_t i = 0; i < tokens; ++i) {
    ids[i] = static_cast<int32_t>(SplitMix64(seed * 0x100000001ull + i) % 120000);
  }
  return ids;
}

// A position-sensitive 64-bit digest of `bytes` (a misplaced block changes it).
inline uint64_t Digest(const uint8_t* data, size_t bytes) {
  uint64_t h = 0xcbf29ce484222325ull ^ bytes;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 32;
  }
  for (; i < bytes; ++i) h = (h ^ data[i]) * 0x100000001b3ull;
  return h;
}

// A worker process: this binary started again with `args` and `env` added to the environment.
class WorkerProcess {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerProcess>> Spawn(
      const std::vector<std::string>& args, const std::vector<std::string>& env) {
    std::vector<std::string> argv_s = {"/proc/self/exe"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s(env);
    for (char** e = environ; *e != nullptr; ++e) env_s.emplace_back(*e);
    std::vector<char*> envp;
    for (std::string& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    if (const int err = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(),
                                    envp.data());
        err != 0) {
      return absl::InternalError(absl::StrCat("posix_spawn: ", std::strerror(err)));
    }
    return std::unique_ptr<WorkerProcess>(new WorkerProcess(pid));
  }

  // Kills the worker if it still runs.
  ~WorkerProcess() {
    Kill();
    waiter_.join();
  }

  pid_t pid() const { return pid_; }
  void Kill() {
    if (!exited_.HasBeenNotified()) kill(pid_, SIGKILL);
  }
  // The worker's exit code (128 + signal when killed) once it ended, or DEADLINE_EXCEEDED.
  absl::StatusOr<int> Wait(absl::Duration timeout) {
    if (!exited_.WaitForNotificationWithTimeout(timeout)) {
      return absl::DeadlineExceededError("the worker did not finish in time");
    }
    return exit_code_;
  }

 private:
  explicit WorkerProcess(pid_t pid) : pid_(pid) {
    waiter_ = std::thread([this] {
      int status = 0;
      waitpid(pid_, &status, 0);
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      exited_.Notify();
    });
  }

  const pid_t pid_;
  int exit_code_ = -1;  // written by waiter_ before exited_ is notified
  absl::Notification exited_;
  std::thread waiter_;
};

}  // namespace kvpool::nccl_test

#endif  // KVPOOL_TESTS_GPU_NCCL_TEST_UTIL_H_
