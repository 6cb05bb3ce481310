// The store's own work per Attend call, without a GPU: KvStore::Attend over a backend whose
// PagedDecodeAttention and QuantizeAppend return at once (arena and the rest from the CPU
// backend), so what is timed is the store's locks, lease lookups, NaN/Inf checks, copies of q and
// new K/V, block tables and append bookkeeping. One INT4 layer of the default namespace geometry
// (8 KV heads x head_dim 128), 32 query heads, --batch sequences of --context tokens each (every
// sequence its own prompt, pages all-ones fp16: their values do not matter here). With --append
// each call appends a token per item, on fresh leases every 256 calls so that contexts stay near
// --context. Prints the mean wall time per call over --iters calls after 100 warm-up calls.
//   store_attend_bench [--batch=32] [--context=4096] [--iters=5000] [--append]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(int, batch, 32, "items per Attend call");
ABSL_FLAG(int, context, 4096, "tokens per sequence");
ABSL_FLAG(int, iters, 5000, "timed calls");
ABSL_FLAG(bool, append, false, "append a new token per item in every call");

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
  std::vector<KvStore::AttendItem> items(batch);
  for (KvStore::AttendItem& item : items) {
    item.q = q.data();
    if (append) {
      item.new_k = item.new_v = new_kv.data();
      item.new_token_id = 7;
    }
  }
  std::vector<uint16_t> out(static_cast<size_t>(batch) * kQHeads * config.head_dim);
  std::vector<uint32_t> attended(batch);
  const KvStore::AttendOutputs outputs{nullptr, out.data(), nullptr, attended.data()};
  double seconds = 0;
  for (int i = 0; i < kWarmup + iters; ++i) {
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
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = (*store)->Attend(0, kQHeads, 0.0f, items, outputs);
    const auto end = std::chrono::steady_clock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "attend: %s\n", s.ToString().c_str());
      return 1;
    }
    if (i >= kWarmup) seconds += std::chrono::duration<double>(end - start).count();
  }
  std::printf("store Attend, batch %d x %d context tokens%s, host-only backend: %.1f us per call\n",
              batch, context, append ? " with a new token each" : "", seconds / iters * 1e6);
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) { return kvpool::Main(argc, argv); }
