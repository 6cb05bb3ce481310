// Randomized requests against an in-process CPU server (tests/fuzz/request_fuzzer.h): every
// KvPool RPC and raw AttendSocket frames, well formed or broken, checked against the status codes
// of the contract, a model of the leases' tokens and the pool's accounting.
//
//   RandomRequests  one fuzzer alone on a server: every reply and every lease checked
//   Concurrent      several fuzzers on one server, each with its own leases
//   Chaos           several fuzzers racing on shared leases: codes and accounting only
//
// The defaults take ~12 s on two cores. Environment, for longer runs:
//   FUZZ_SEED     first seed (1)
//   FUZZ_SEEDS    how many seeds each test runs, from FUZZ_SEED on (1)
//   FUZZ_ITERS    operations per fuzzer (RandomRequests 600, Concurrent and Chaos 300)
//   FUZZ_THREADS  fuzzers of Concurrent (3) and Chaos (4)
//   FUZZ_BAD_PCT  percentage of the generators' malformed-field rates (RandomRequests 100,
//                 Concurrent 30, Chaos 10)
//   FUZZ_CLOCK    1: RandomRequests also moves the server's clock, so that leases expire
//   FUZZ_VERBOSE  1: print every call that did not succeed, and (Concurrent, Chaos) each
//                 fuzzer's code counts (RandomRequests prints its own always)
// A failure names its fuzzer's seed (Concurrent and Chaos: FUZZ_SEED * 1000 + thread) and step.
// RandomRequests replays it with FUZZ_SEED=<seed> FUZZ_VERBOSE=1 (exactly, unless an AttendSocket
// session was closed as idle in one run and not the other); the threaded tests interleave
// differently on every run.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fuzz/request_fuzzer.h"
#include "tests/integration/attend_fixture.h"

namespace kvpool::testing {
namespace {

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::strtoull(value, nullptr, 10) : fallback;
}

// FUZZ_* settings shared by the tests; the per-test defaults are arguments.
FuzzOptions OptionsFromEnv(FuzzMode mode, uint64_t seed, uint64_t default_bad_pct) {
  FuzzOptions o;
  o.mode = mode;
  o.seed = seed;
  o.bad_fraction = EnvOr("FUZZ_BAD_PCT", default_bad_pct) / 100.0;
  o.verbose = EnvOr("FUZZ_VERBOSE", 0) != 0;
  return o;
}

std::vector<uint64_t> SeedsFromEnv() {
  std::vector<uint64_t> seeds;
  const uint64_t first = EnvOr("FUZZ_SEED", 1);
  for (uint64_t i = 0; i < EnvOr("FUZZ_SEEDS", 1); ++i) seeds.push_back(first + i);
  return seeds;
}

// The fixture's "small" namespace with `sequences` prompts cached under leases, and the
// AttendSocket on loopback TCP and on a Unix socket of its own, with limits low enough for the
// fuzzers to reach: 1 MiB regions, 4 MiB of them in all, 8 MiB frames, a 16 MiB pool (new
// namespaces exhaust it), and a 300 ms idle timeout (incomplete frames are answered quickly).
class FuzzServer {
 public:
  explicit FuzzServer(int sequences) {
    static std::atomic<int> servers{0};
    unix_socket_path_ = ::testing::TempDir() + "kvpool_fuzz_" + std::to_string(getpid()) + "_" +
                        std::to_string(servers++) + ".sock";
    fixture_ = StartAttendFixture(sequences, [&](ServerOptions* o) {
      o->store.pool_bytes = 16 << 20;
      o->attend_socket.address = "127.0.0.1:0";
      o->attend_socket.unix_path = unix_socket_path_;
      o->attend_socket.max_region_bytes = 1 << 20;
      o->attend_socket.total_region_bytes = 4 << 20;
      o->attend_socket.max_frame_bytes = 8 << 20;
      o->attend_socket.idle_timeout = absl::Milliseconds(300);
      target_.max_region_bytes = o->attend_socket.max_region_bytes;
      target_.socket_idle_timeout = o->attend_socket.idle_timeout;
      target_.default_lease_ttl = o->store.default_lease_ttl;
      target_.max_lease_ttl = o->store.max_lease_ttl;
    });
    target_.server = fixture_.server.get();
    target_.unix_socket_path = unix_socket_path_;
    target_.default_namespace = fixture_.config;
  }
  ~FuzzServer() {
    fixture_.client.reset();
    fixture_.server.reset();  // the server removes its socket file; a crashed run may not have
    unlink(unix_socket_path_.c_str());
  }
  FuzzServer(const FuzzServer&) = delete;
  FuzzServer& operator=(const FuzzServer&) = delete;

  bool ok() const { return fixture_.server != nullptr; }
  const FuzzTarget& target() const { return target_; }
  const std::vector<uint64_t>& leases() const { return fixture_.leases; }
  FuzzLease ModelOf(uint64_t lease) const {
    return {lease, fixture_.config.name,
            std::vector<int64_t>(fixture_.config.num_layers, kAttendPromptTokens)};
  }

 private:
  std::string unix_socket_path_;
  AttendFixture fixture_;
  FuzzTarget target_;
};

void PrintCodes(const RequestFuzzer& f) {
  std::printf("seed %lu: %d failures\n%s", static_cast<unsigned long>(f.seed()), f.failures(),
              f.CodeSummary().c_str());
}

// `threads` fuzzers on `server`, fuzzer i with `options(i)`, each on a thread of its own for
// `steps` steps; then every lease released, a round trip, and the idle server checked.
void RunThreaded(const FuzzServer& server, uint64_t threads, uint64_t steps, const FuzzOpMix& mix,
                 const std::function<FuzzOptions(uint64_t)>& options) {
  std::vector<std::unique_ptr<RequestFuzzer>> fuzzers;
  for (uint64_t i = 0; i < threads; ++i) {
    fuzzers.push_back(std::make_unique<RequestFuzzer>(server.target(), options(i), mix));
  }
  std::vector<std::thread> running;
  for (const auto& f : fuzzers) running.emplace_back([&f, steps] { f->Run(steps); });
  for (std::thread& t : running) t.join();
  for (const auto& f : fuzzers) f->ReleaseAll();
  fuzzers[0]->RoundTrip();
  fuzzers[0]->CheckIdleServer();
  if (EnvOr("FUZZ_VERBOSE", 0) != 0) {
    for (const auto& f : fuzzers) PrintCodes(*f);
  }
}

TEST(RequestFuzz, RandomRequests) {
  const uint64_t steps = EnvOr("FUZZ_ITERS", 600);
  for (uint64_t seed : SeedsFromEnv()) {
    FuzzServer server(3);
    ASSERT_TRUE(server.ok());
    FuzzOpMix mix;
    mix.advance_clock = EnvOr("FUZZ_CLOCK", 0) != 0 ? 1 : 0;
    RequestFuzzer fuzzer(server.target(), OptionsFromEnv(FuzzMode::kAlone, seed, 100), mix);
    for (uint64_t lease : server.leases()) fuzzer.AdoptLease(server.ModelOf(lease));
    fuzzer.Run(steps);
    fuzzer.ReleaseAll();
    fuzzer.RoundTrip();
    fuzzer.CheckIdleServer();
    PrintCodes(fuzzer);
  }
}

TEST(RequestFuzz, Concurrent) {
  const uint64_t steps = EnvOr("FUZZ_ITERS", 300);
  const uint64_t threads = EnvOr("FUZZ_THREADS", 3);
  for (uint64_t seed : SeedsFromEnv()) {
    FuzzServer server(0);
    ASSERT_TRUE(server.ok());
    FuzzOpMix mix;
    mix.create_namespace = 3;
    mix.put = 19;
    RunThreaded(server, threads, steps, mix, [seed](uint64_t i) {
      FuzzOptions o = OptionsFromEnv(FuzzMode::kOwnLeases, seed * 1000 + i, 30);
      o.max_leases = 10;
      return o;
    });
  }
}

TEST(RequestFuzz, Chaos) {
  const uint64_t steps = EnvOr("FUZZ_ITERS", 300);
  const uint64_t threads = EnvOr("FUZZ_THREADS", 4);
  for (uint64_t seed : SeedsFromEnv()) {
    FuzzServer server(4);
    ASSERT_TRUE(server.ok());
    SharedLeasePool pool(12);
    for (uint64_t lease : server.leases()) pool.Add(server.ModelOf(lease));
    FuzzOpMix mix;  // mostly decode steps, on few leases
    mix.create_namespace = 2;
    mix.put = 10;
    mix.match = 10;
    mix.append = 16;
    mix.attend = 16;
    mix.attend_stream = 8;
    mix.release = 6;
    mix.socket = 17;
    RunThreaded(server, threads, steps, mix, [seed, &pool](uint64_t i) {
      FuzzOptions o = OptionsFromEnv(FuzzMode::kSharedLeases, seed * 1000 + i, 10);
      o.shared_leases = &pool;
      return o;
    });
  }
}

}  // namespace
}  // namespace kvpool::testing
