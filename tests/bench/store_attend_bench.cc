// The store's own work per Attend call, without a GPU: KvStore::Attend over a backend whose
// PagedDecodeAttention and QuantizeAppend return at once (arena and the rest from the CPU
// backend), so what is timed is the store's locks, lease lookups, NaN/Inf checks, copies of q and
// new K/V, block tables and append bookkeeping. One INT4 layer of the default namespace geometry
// (8 KV heads x head_dim 128), 32 query heads, --batch sequences of --context tokens each (every
// sequence its own prompt, pages all-ones fp16: their values do not matter here). With --append
// each call appends a token per item, on fresh leases every 256 calls so that contexts stay near
// --context. With --region the items' q rows (and new K/V) lie back to back in one buffer, as in
// an AttendSocket region step, and another thread rewrites that buffer before every call, as the
// client of a region does: the store then reads data that another core has just written.
// Prints the mean wall time per call over --iters calls after 100 warm-up calls, and the minor
// page faults per call (fresh memory touched). With --probe another thread calls ListNamespaces
// (a call that only takes the store lock) back to back during the timed calls and prints its
// latency percentiles, and its time beyond its median per Attend call: how long the Attend calls
// keep other store calls waiting.
//   store_attend_bench [--batch=32] [--context=4096] [--iters=5000] [--append] [--region]
//                      [--probe]
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/bench_output.h"
#include "tests/common/kv_test_data.h"
#include "tests/common/region_writer.h"

ABSL_FLAG(int, batch, 32, "items per Attend call");
ABSL_FLAG(int, context, 4096, "tokens per sequence");
ABSL_FLAG(int, iters, 5000, "timed calls");
ABSL_FLAG(bool, append, false, "append a new token per item in every call");
ABSL_FLAG(bool, region, false,
          "q and new K/V back to back in one buffer that another thread rewrites before each call");
ABSL_FLAG(bool, probe, false,
          "time a ListNamespaces loop on another thread during the timed calls");

namespace kvpool {
namespace {

constexpr int kQHeads = 32;
constexpr int kWarmup = 100;
constexpr int kCallsPerLease = 256;

// The CPU backend's memory with kernels that do nothing.
class HostOnlyBackend final : public ComputeBackend {
 public:
  std::string name() const override { return "host-only"; }
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    return cpu_->AllocateArena(bytes);
  }
  void FreeArena(uint8_t* arena) override { cpu_->FreeArena(arena); }
  absl::Status QuantizeAppend(const QuantizeAppendParams&) override { return absl::OkStatus(); }
  absl::Status Dequantize(const DequantizeParams& p) override { return cpu_->Dequantize(p); }
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams&,
                                    const QuantizeAppendParams*) override {
    return absl::OkStatus();
  }
  absl::Status ReadArena(const uint8_t* src, size_t bytes, void* dst) override {
    return cpu_->ReadArena(src, bytes, dst);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  ComputeBackendStats Stats() const override { return cpu_->Stats(); }

 private:
  std::unique_ptr<ComputeBackend> cpu_ = NewCpuBackend();
};

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int batch = absl::GetFlag(FLAGS_batch);
  const int context = absl::GetFlag(FLAGS_context);
  const int iters = absl::GetFlag(FLAGS_iters);
  const bool append = absl::GetFlag(FLAGS_append);
  if (batch <= 0 || context <= 0 || iters <= 0) {
    std::fprintf(stderr, "--batch, --context and --iters must be positive\n");
    return 2;
  }
  HostOnlyBackend backend;
  NamespaceConfig config = DefaultNamespaceConfig(0);
  config.name = "bench";
  config.num_layers = 1;
  config.layer_dtypes = {KvDtype::kInt4};
  // The prompts' blocks, and the appended tails of two generations of leases (the old ones are
  // released after the new ones are matched).
  const uint64_t blocks =
      static_cast<uint64_t>(batch) * ((context + config.block_tokens - 1) / config.block_tokens +
                                      2 * (kCallsPerLease / config.block_tokens + 1));
  KvStore::Options options;
  options.backend = &backend;
  options.quality_sample_every = 0;
  options.pool_bytes =
      blocks * 2 * config.num_kv_heads * config.block_tokens * (config.head_dim / 2 + 4);
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Create(options);
  if (!store.ok() || !(*store)->CreateNamespace(config).ok()) {
    std::fprintf(stderr, "store setup failed\n");
    return 1;
  }
  const std::vector<uint16_t> kv(
      static_cast<size_t>(context) * config.num_kv_heads * config.head_dim, 0x3C00);
  std::vector<std::vector<int32_t>> prompts;
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> ids(context);
    for (int t = 0; t < context; ++t) ids[t] = b * 1000003 + t;
    absl::StatusOr<std::unique_ptr<KvStore::PutSession>> put = (*store)->BeginPut(config.name, ids);
    if (!put.ok() || !(*put)->AddChunk(0, 0, context, kv.data(), kv.data()).ok() ||
        !(*put)->Commit().ok()) {
      std::fprintf(stderr, "put failed\n");
      return 1;
    }
    prompts.push_back(std::move(ids));
  }
  const std::vector<uint16_t> q =
      testing::ToHalf(testing::MakeNormal(static_cast<size_t>(kQHeads) * config.head_dim, 3));
  const std::vector<uint16_t> new_kv = testing::ToHalf(
      testing::MakeNormal(static_cast<size_t>(config.num_kv_heads) * config.head_dim, 4));
  // --region: q rows, then each item's new K and V rows, rewritten from `source` by `writer`.
  const size_t q_elems = q.size(), kv_elems = new_kv.size();
  std::vector<uint16_t> source, region;
  if (absl::GetFlag(FLAGS_region)) {
    for (int b = 0; b < batch; ++b) source.insert(source.end(), q.begin(), q.end());
    for (int b = 0; b < 2 * batch; ++b) source.insert(source.end(), new_kv.begin(), new_kv.end());
    region = source;
  }
  std::vector<KvStore::AttendItem> items(batch);
  for (int b = 0; b < batch; ++b) {
    KvStore::AttendItem& item = items[b];
    item.q = region.empty() ? q.data() : region.data() + b * q_elems;
    if (append) {
      item.new_k =
          region.empty() ? new_kv.data() : region.data() + batch * q_elems + 2 * b * kv_elems;
      item.new_v = region.empty() ? new_kv.data() : item.new_k + kv_elems;
      item.new_token_id = 7;
    }
  }
  std::optional<testing::RegionWriter> writer;
  if (!region.empty()) writer.emplace(region.data(), source.data(), source.size() * 2);
  std::vector<uint16_t> out(static_cast<size_t>(batch) * kQHeads * config.head_dim);
  std::vector<uint32_t> attended(batch);
  const KvStore::AttendOutputs outputs{nullptr, out.data(), nullptr, attended.data()};
  double seconds = 0;
  long faults = 0;  // minor page faults of this thread inside the timed calls
  auto thread_faults = [] {
    rusage u;
    getrusage(RUSAGE_THREAD, &u);
    return u.ru_minflt;
  };
  // --probe: ListNamespaces latencies, in µs, while the timed calls run.
  std::atomic<bool> timing{false}, stop{false};
  std::vector<double> probe_us;
  std::thread probe;
  if (absl::GetFlag(FLAGS_probe)) {
    probe = std::thread([&] {
      while (!stop.load(std::memory_order_relaxed)) {
        const auto start = std::chrono::steady_clock::now();
        (*store)->ListNamespaces();
        const auto end = std::chrono::steady_clock::now();
        if (timing.load(std::memory_order_relaxed)) {
          probe_us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
        }
      }
    });
  }
  for (int i = 0; i < kWarmup + iters; ++i) {
    timing.store(i >= kWarmup, std::memory_order_relaxed);
    if (i % kCallsPerLease == 0) {  // fresh leases: appends would grow the contexts
      for (int b = 0; b < batch; ++b) {
        absl::StatusOr<KvStore::MatchResult> m =
            (*store)->Match(config.name, prompts[b], absl::Minutes(10));
        if (!m.ok()) {
          std::fprintf(stderr, "match: %s\n", m.status().ToString().c_str());
          return 1;
        }
        if (items[b].lease_id != 0) (*store)->Release(items[b].lease_id).IgnoreError();
        items[b].lease_id = m->lease_id;
      }
    }
    if (writer) writer->Rewrite();
    const long faults_before = thread_faults();
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = (*store)->Attend(0, kQHeads, 0.0f, items, outputs);
    const auto end = std::chrono::steady_clock::now();
    if (i >= kWarmup) faults += thread_faults() - faults_before;
    if (!s.ok()) {
      std::fprintf(stderr, "attend: %s\n", s.ToString().c_str());
      return 1;
    }
    if (i >= kWarmup) seconds += std::chrono::duration<double>(end - start).count();
  }
  stop.store(true);
  if (probe.joinable()) probe.join();
  std::printf(
      "store Attend, batch %d x %d context tokens%s%s, host-only backend: %.1f us per call, "
      "%.2f page faults per call\n",
      batch, context, append ? " with a new token each" : "",
      region.empty() ? "" : ", region rewritten by another thread", seconds / iters * 1e6,
      static_cast<double>(faults) / iters);
  if (!probe_us.empty()) {
    const double p50 = bench::Percentile(probe_us, 0.5);
    // The time the probe spent beyond its own median, per Attend call: about how long each call
    // held the store lock.
    double waited = 0;
    for (const double us : probe_us) waited += us - p50;
    std::printf(
        "ListNamespaces on another thread meanwhile: %zu calls, p50 %.1f us, p99 %.1f us, "
        "max %.1f us; waited %.1f us per Attend call\n",
        probe_us.size(), p50, bench::Percentile(probe_us, 0.99),
        *std::max_element(probe_us.begin(), probe_us.end()), waited / iters);
  }
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) { return kvpool::Main(argc, argv); }
