// Shared set-up of the KvStore tests: a small namespace on the CPU backend with a FakeClock,
// random K/V with outliers per layer, and the CPU reference pages of a sequence.
#ifndef KVPOOL_TESTS_SERVICE_KV_STORE_TEST_UTIL_H_
#define KVPOOL_TESTS_SERVICE_KV_STORE_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/kv_kernels.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/kv_test_data.h"

namespace kvpool::testing {

// 2 layers (INT4, INT8), 2 KV heads, head_dim 32, 4-token blocks, rotation 16, groups of 16.
inline NamespaceConfig SmallConfig(const std::string& name, int sink_tokens = 0) {
  NamespaceConfig c;
  c.name = name;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.block_tokens = 4;
  c.layer_dtypes = {KvDtype::kInt4, KvDtype::kInt8};
  c.rotation_block = 16;
  c.rotation_seed = 11;
  c.group_size = 16;
  c.sink_tokens = sink_tokens;
  return c;
}

// fp16 K/V of one sequence, per layer: [layer][tokens][heads][head_dim].
struct SequenceKv {
  std::vector<std::vector<uint16_t>> k, v;
};

inline SequenceKv MakeSequenceKv(const NamespaceConfig& c, int tokens, uint64_t seed) {
  SequenceKv s;
  for (int l = 0; l < c.num_layers; ++l) {
    KvData d = MakeKv(tokens, c.num_kv_heads, c.head_dim, Outliers::kOffset, seed + l);
    s.k.push_back(ToHalf(d.k));
    s.v.push_back(ToHalf(d.v));
  }
  return s;
}

inline std::vector<int32_t> TokenIds(int n, int32_t first) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = first + 3 * i;
  return ids;
}

// Puts tokens [0, ids.size()) of `kv` into namespace `ns` (every layer, one chunk per layer) and
// commits.
inline absl::StatusOr<KvStore::PutResult> PutIntoStore(KvStore& store, const std::string& ns,
                                                       const std::vector<int32_t>& ids,
                                                       const SequenceKv& kv) {
  auto session = store.BeginPut(ns, ids);
  if (!session.ok()) return session.status();
  for (size_t l = 0; l < kv.k.size(); ++l) {
    absl::Status s =
        (*session)->AddChunk(static_cast<uint32_t>(l), 0, static_cast<uint32_t>(ids.size()),
                             kv.k[l].data(), kv.v[l].data());
    if (!s.ok()) return s;
  }
  return (*session)->Commit();
}

// The CPU backend behind calls a test's backend can override.
class ForwardingBackend : public ComputeBackend {
 public:
  std::string name() const override { return inner_->name(); }
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    return inner_->AllocateArena(bytes);
  }
  void FreeArena(uint8_t* arena) override { inner_->FreeArena(arena); }
  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override {
    return inner_->QuantizeAppend(p);
  }
  absl::Status Dequantize(const DequantizeParams& p) override { return inner_->Dequantize(p); }
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override {
    return inner_->PagedDecodeAttention(p, append);
  }
  absl::Status ReadArena(const uint8_t* src, size_t bytes, void* dst) override {
    return inner_->ReadArena(src, bytes, dst);
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  absl::Status ReadRuns(absl::Span<const ArenaRun> runs, void* dst) override {
    return inner_->ReadRuns(runs, dst);
  }
  absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) override {
    return inner_->GatherArena(runs, dst);
  }
  absl::Status DequantizeToArena(absl::Span<const DequantizeParams> ps) override {
    return inner_->DequantizeToArena(ps);
  }
  absl::Status QuantizeAppendFromArena(absl::Span<const QuantizeAppendParams> ps) override {
    return inner_->QuantizeAppendFromArena(ps);
  }
  absl::Status CheckHalfRangeArena(absl::Span<const HalfRangeCheck> checks) override {
    return inner_->CheckHalfRangeArena(checks);
  }
  ComputeBackendStats Stats() const override { return inner_->Stats(); }
  absl::Status CheckAttentionShape(size_t num_seqs, size_t num_q_heads) const override {
    return inner_->CheckAttentionShape(num_seqs, num_q_heads);
  }

 protected:
  ComputeBackend& inner() { return *inner_; }

 private:
  const std::unique_ptr<ComputeBackend> inner_ = NewCpuBackend();
};

class StoreTest : public ::testing::Test {
 protected:
  // A store whose pool holds exactly `blocks` blocks of SmallConfig("main", sink_tokens) with a
  // sink page per `blocks_per_sink_page`, with store_options_'s limits.
  void MakeStore(uint64_t blocks, int sink_tokens = 0,
                 int blocks_per_sink_page = NamespaceConfig{}.blocks_per_sink_page) {
    config_ = SmallConfig("main", sink_tokens);
    config_.blocks_per_sink_page = blocks_per_sink_page;
    KvStore::Options o = store_options_;
    o.pool_bytes = ArenaBytes(config_, blocks);
    o.backend = backend_.get();
    o.clock = &clock_;
    o.quality_sample_every = 1;
    auto store = KvStore::Create(o);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    auto info = store_->CreateNamespace(config_);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->num_blocks, blocks);
  }

  size_t PerToken() const { return static_cast<size_t>(config_.num_kv_heads) * config_.head_dim; }

  // Puts tokens [0, ids.size()) of `kv` (every layer, one chunk per layer) and commits.
  absl::StatusOr<KvStore::PutResult> Put(const std::vector<int32_t>& ids, const SequenceKv& kv) {
    return PutIntoStore(*store_, "main", ids, kv);
  }

  // Pages of `layer` holding tokens [0, tokens) of `kv` in blocks 0, 1, ... as the CPU
  // reference writes them.
  std::vector<uint8_t> ReferencePages(const SequenceKv& kv, int layer, int tokens) {
    const PageLayout layout = LayerLayout(config_, layer);
    const int blocks = (tokens + config_.block_tokens - 1) / config_.block_tokens;
    std::vector<uint8_t> pages(layout.layer_page_bytes() * blocks);
    std::vector<uint8_t> sinks(std::max<size_t>(1, layout.sink_page_bytes() * blocks));
    std::vector<int64_t> slots(tokens);
    std::vector<int32_t> positions(tokens);
    for (int t = 0; t < tokens; ++t) slots[t] = positions[t] = t;
    QuantizeAppendParams p;
    p.layout = layout;
    p.k = kv.k[layer].data();
    p.v = kv.v[layer].data();
    p.slot_mapping = slots.data();
    p.positions = positions.data();
    p.num_tokens = tokens;
    p.pages = pages.data();
    p.sink_pages = layout.sink_tokens > 0 ? sinks.data() : nullptr;
    p.num_blocks = blocks;
    p.num_sink_blocks = layout.sink_tokens > 0 ? blocks : 0;
    EXPECT_EQ(cpu::QuantizeAppend(p), KernelStatus::kOk);
    return pages;
  }

  // The reference pages of `layer` read back as fp16 K (first) and V, as the store reads a
  // sequence from its first block: its sink tokens exact.
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> ReferenceFp16(const SequenceKv& kv,
                                                                       int layer, int tokens) {
    const PageLayout layout = LayerLayout(config_, layer);
    const int blocks = tokens / config_.block_tokens;
    std::vector<uint8_t> pages = ReferencePages(kv, layer, tokens);
    std::vector<int32_t> ids(blocks);
    for (int b = 0; b < blocks; ++b) ids[b] = b;
    std::vector<uint16_t> k(tokens * PerToken()), v(tokens * PerToken());
    DequantizeParams d;
    d.layout = layout;
    d.pages = pages.data();
    d.block_ids = ids.data();
    d.num_out_blocks = blocks;
    d.head_begin = 0;
    d.head_end = config_.num_kv_heads;
    d.k_out = k.data();
    d.v_out = v.data();
    d.num_blocks = blocks;
    EXPECT_EQ(cpu::Dequantize(d), KernelStatus::kOk);
    const size_t sink = static_cast<size_t>(std::min(layout.sink_tokens, tokens)) * PerToken();
    std::copy(kv.k[layer].begin(), kv.k[layer].begin() + sink, k.begin());
    std::copy(kv.v[layer].begin(), kv.v[layer].begin() + sink, v.begin());
    return {k, v};
  }

  FakeClock clock_;
  std::unique_ptr<ComputeBackend> backend_ = NewCpuBackend();
  KvStore::Options store_options_;  // MakeStore sets the pool, backend, clock and sampling
  NamespaceConfig config_;
  std::unique_ptr<KvStore> store_;
};

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_SERVICE_KV_STORE_TEST_UTIL_H_
