#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>
#include "gtest/gtest.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/kv_test_data.h"
namespace kvpool {
namespace {
class NullAttend : public ComputeBackend {
 public:
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  std::string name() const override { return "cpu"; }
  absl::StatusOr<uint8_t*> AllocateArena(size_t b) override { return cpu->AllocateArena(b); }
  void FreeArena(uint8_t* a) override { cpu->FreeArena(a); }
  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override { return absl::OkStatus(); }
  absl::Status Dequantize(const DequantizeParams& p) override { return cpu->Dequantize(p); }
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams&, const QuantizeAppendParams*) override { return absl::OkStatus(); }
  absl::Status ReadArena(const uint8_t* s, size_t b, void* d) override { return cpu->ReadArena(s, b, d); }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  ComputeBackendStats Stats() const override { return cpu->Stats(); }
};
TEST(Prof, StoreAttendBatch32) {
  NullAttend backend;
  NamespaceConfig config = DefaultNamespaceConfig(0);
  config.name = "latency";
  config.num_layers = 1;
  config.layer_dtypes = {KvDtype::kInt4};
  KvStore::Options options;
  options.pool_bytes = uint64_t{1} << 30;
  options.backend = &backend;
  options.quality_sample_every = 0;
  auto store = KvStore::Create(options);
  ASSERT_TRUE(store.ok() && (*store)->CreateNamespace(config).ok());
  const int ctx = 4096;
  std::vector<KvStore::AttendItem> items;
  std::vector<uint16_t> q = testing::ToHalf(testing::MakeNormal(32 * 32 * 128, 7));
  std::vector<uint16_t> k(size_t{ctx} * 8 * 128, 0x3c00);
  for (int b = 0; b < 32; ++b) {
    std::vector<int32_t> ids(ctx);
    for (int t = 0; t < ctx; ++t) ids[t] = b * 1000003 + t;
    auto put = (*store)->BeginPut(config.name, ids);
    ASSERT_TRUE(put.ok() && (*put)->AddChunk(0, 0, ctx, k.data(), k.data()).ok() && (*put)->Commit().ok());
    auto m = (*store)->Match(config.name, ids, absl::Minutes(5));
    ASSERT_TRUE(m.ok());
    items.push_back({m->lease_id, q.data() + b * 32 * 128});
  }
  std::vector<uint16_t> out(32 * 32 * 128);
  std::vector<uint32_t> attended(32);
  const KvStore::AttendOutputs outputs{nullptr, out.data(), nullptr, attended.data()};
  std::vector<double> us;
  for (int i = 0; i < 100000; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE((*store)->Attend(0, 32, 0.0f, items, outputs).ok());
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  std::printf("store overhead p50 %.1f us\n", us[us.size() / 2]);
}
}  // namespace
}  // namespace kvpool
