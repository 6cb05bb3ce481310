// KvStore over NewCudaBackend against KvStore over NewCpuBackend: the same puts give nearly
// identical raw pages (codes equal but for rare round-half ties, scales/zeros within one fp16
// ulp) and fp16 reads within tolerance. Also the backend's own errors and stats.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cpu/page_codec.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvpool {
namespace {

constexpr int kTokens = 16 * 6 + 9;  // six full blocks and a partial one (ignored)

// An append of the first `tokens` of k and v (host fp16) at slots and positions, into `pages`.
QuantizeAppendParams AppendParams(const PageLayout& layout, const std::vector<uint16_t>& k,
                                  const std::vector<uint16_t>& v, const std::vector<int64_t>& slots,
                                  const std::vector<int32_t>& positions, int tokens, uint8_t* pages,
                                  int64_t num_blocks) {
  QuantizeAppendParams p;
  p.layout = layout;
  p.k = k.data();
  p.v = v.data();
  p.slot_mapping = slots.data();
  p.positions = positions.data();
  p.num_tokens = tokens;
  p.pages = pages;
  p.num_blocks = num_blocks;
  return p;
}

NamespaceConfig TestConfig() {
  NamespaceConfig c;
  c.name = "gpu-test";
  c.num_layers = 4;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.block_tokens = 16;
  c.layer_dtypes = {KvDtype::kFp8E4M3, KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp16};
  c.rotation_block = 64;
  c.rotation_seed = 77;
  c.group_size = 32;
  c.sink_tokens = 4;
  c.capacity_bytes = 32 << 20;
  return c;
}

// A store over `backend` holding one put of `tokens` with per-layer K/V `data`.
std::unique_ptr<KvStore> MakeStoreWithPut(ComputeBackend* backend,
                                          const std::vector<int32_t>& tokens,
                                          const std::vector<testing::KvData>& data) {
  KvStore::Options options;
  options.pool_bytes = 64 << 20;
  options.backend = backend;
  auto store = KvStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return nullptr;
  const auto info = (*store)->CreateNamespace(TestConfig());
  EXPECT_TRUE(info.ok()) << info.status();
  auto put = (*store)->BeginPut("gpu-test", tokens);
  EXPECT_TRUE(put.ok()) << put.status();
  if (!put.ok()) return nullptr;
  for (int layer = 0; layer < TestConfig().num_layers; ++layer) {
    const std::vector<uint16_t> k = testing::ToHalf(data[layer].k);
    const std::vector<uint16_t> v = testing::ToHalf(data[layer].v);
    // Two chunks per layer, the second starting mid-block.
    const uint32_t split = 37;
    const size_t row = static_cast<size_t>(TestConfig().num_kv_heads) * TestConfig().head_dim;
    EXPECT_TRUE((*put)->AddChunk(layer, 0, split, k.data(), v.data()).ok());
    EXPECT_TRUE((*put)
                    ->AddChunk(layer, split, kTokens - split, k.data() + split * row,
                               v.data() + split * row)
                    .ok());
  }
  const auto committed = (*put)->Commit();
  EXPECT_TRUE(committed.ok()) << committed.status();
  return std::move(*store);
}

// A store over the CUDA backend and one over the CPU backend holding the same put (kTokens
// random tokens, per-layer K/V with outliers from `outliers(layer)` and seed data_seed + layer),
// and a lease on each over its cached prefix. The parameter is the CUDA backend's
// kernel_host_io: on the H200 true takes the kernels' reads and writes of pinned host memory,
// false the DMA copies that devices without host pointer support use.
class CudaVsCpuStores : public ::testing::TestWithParam<bool> {
 protected:
  void PutBoth(uint32_t token_seed, testing::Outliers (*outliers)(int layer), int data_seed) {
    auto backend = NewCudaBackend(0, CudaBackendOptions{GetParam()});
    ASSERT_TRUE(backend.ok()) << backend.status();
    gpu_backend_ = std::move(*backend);
    cpu_backend_ = NewCpuBackend();
    std::mt19937 rng(token_seed);
    std::vector<int32_t> tokens(kTokens);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 32000);
    std::vector<testing::KvData> data;
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      data.push_back(testing::MakeKv(kTokens, config_.num_kv_heads, config_.head_dim,
                                     outliers(layer), data_seed + layer));
    }
    cpu_store_ = MakeStoreWithPut(cpu_backend_.get(), tokens, data);
    gpu_store_ = MakeStoreWithPut(gpu_backend_.get(), tokens, data);
    ASSERT_NE(cpu_store_, nullptr);
    ASSERT_NE(gpu_store_, nullptr);
    auto cpu_match = cpu_store_->Match("gpu-test", tokens, absl::ZeroDuration());
    auto gpu_match = gpu_store_->Match("gpu-test", tokens, absl::ZeroDuration());
    ASSERT_TRUE(cpu_match.ok() && gpu_match.ok());
    ASSERT_EQ(gpu_match->cached_tokens, 96u);
    ASSERT_EQ(gpu_match->num_blocks, cpu_match->num_blocks);
    cpu_match_ = *cpu_match;
    gpu_match_ = *gpu_match;
  }

  const NamespaceConfig config_ = TestConfig();
  std::unique_ptr<ComputeBackend> gpu_backend_, cpu_backend_;
  std::unique_ptr<KvStore> gpu_store_, cpu_store_;
  KvStore::MatchResult gpu_match_, cpu_match_;
};

TEST_P(CudaVsCpuStores, StoreMatchesCpuBackendForTheSamePuts) {
  KVPOOL_SKIP_WITHOUT_GPU();
  ASSERT_NO_FATAL_FAILURE(PutBoth(
      2024, [](int layer) { return static_cast<testing::Outliers>(1 + layer % 4); }, 100));
  EXPECT_EQ(gpu_backend_->name(), "cuda");
  const uint32_t blocks = gpu_match_.num_blocks;
  const uint32_t heads = config_.num_kv_heads;

  uint64_t codes = 0, off_by_one = 0;
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    SCOPED_TRACE(::testing::Message() << "layer " << layer);
    const PageLayout l = LayerLayout(config_, layer);
    const size_t raw_bytes = blocks * heads * l.head_page_bytes();
    std::vector<uint8_t> ck(raw_bytes), cv(raw_bytes), gk(raw_bytes), gv(raw_bytes);
    ASSERT_TRUE(
        cpu_store_->ReadRaw(cpu_match_.lease_id, layer, 0, blocks, 0, heads, ck.data(), cv.data())
            .ok());
    ASSERT_TRUE(
        gpu_store_->ReadRaw(gpu_match_.lease_id, layer, 0, blocks, 0, heads, gk.data(), gv.data())
            .ok());
    // Per (block, head) row: codes within one, meta within one ulp; the largest scale of the
    // row bounds how far its fp16 read may move when a code differs.
    std::vector<float> row_scale(blocks * l.block_tokens, 0.0f);
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<uint8_t>& c = kv == 0 ? ck : cv;
      const std::vector<uint8_t>& g = kv == 0 ? gk : gv;
      for (size_t page = 0; page < blocks * heads; ++page) {
        const uint8_t* cp = c.data() + page * l.head_page_bytes();
        const uint8_t* gp = g.data() + page * l.head_page_bytes();
        for (int t = 0; t < l.block_tokens; ++t) {
          const size_t row = t * l.code_bytes_per_token();
          if (!l.quantized()) {
            ASSERT_EQ(std::memcmp(cp + row, gp + row, l.code_bytes_per_token()), 0);
            continue;
          }
          for (int grp = 0; grp < l.groups(); ++grp) {
            const cpu::GroupMeta cm = cpu::ReadGroupMeta(l, cp, t, grp);
            const cpu::GroupMeta gm = cpu::ReadGroupMeta(l, gp, t, grp);
            ASSERT_LE(std::fabs(cm.scale - gm.scale), std::fabs(cm.scale) * 1e-3f + 1e-7f);
            ASSERT_LE(std::fabs(cm.zero - gm.zero), std::fabs(cm.zero) * 1e-3f + 1e-7f);
            float& s = row_scale[(page / heads) * l.block_tokens + t];
            s = std::max(s, std::max(cm.scale, gm.scale));
          }
          std::vector<float> cc(l.head_dim), gc(l.head_dim);
          cpu::UnpackCodes(l, cp, t, cc.data());
          cpu::UnpackCodes(l, gp, t, gc.data());
          for (int ch = 0; ch < l.head_dim; ++ch) {
            if (cc[ch] == gc[ch]) continue;
            ++off_by_one;
            if (l.dtype != KvDtype::kFp8E4M3) {
              ASSERT_EQ(std::fabs(cc[ch] - gc[ch]), 1.0f);
            }
          }
          codes += l.head_dim;
        }
      }
    }

    const size_t elems = static_cast<size_t>(blocks) * l.block_tokens * heads * l.head_dim;
    std::vector<uint16_t> cfk(elems), cfv(elems), gfk(elems), gfv(elems);
    ASSERT_TRUE(
        cpu_store_
            ->ReadFp16(cpu_match_.lease_id, layer, 0, blocks, 0, heads, cfk.data(), cfv.data())
            .ok());
    ASSERT_TRUE(
        gpu_store_
            ->ReadFp16(gpu_match_.lease_id, layer, 0, blocks, 0, heads, gfk.data(), gfv.data())
            .ok());
    const size_t token_elems = static_cast<size_t>(heads) * l.head_dim;
    for (size_t i = 0; i < elems; ++i) {
      const float tol = row_scale[i / token_elems];
      for (int kv = 0; kv < 2; ++kv) {
        const float a = HalfToFloat((kv == 0 ? cfk : cfv)[i]);
        const float b = HalfToFloat((kv == 0 ? gfk : gfv)[i]);
        ASSERT_LE(std::fabs(a - b), 2e-3f * std::fabs(a) + 1e-3f + tol)
            << "fp16 read element " << i << ": cpu " << a << " gpu " << b;
      }
    }
  }
  std::printf("%llu codes compared, %llu differ by one step\n",
              static_cast<unsigned long long>(codes), static_cast<unsigned long long>(off_by_one));
  EXPECT_GT(codes, 0u);
  EXPECT_LE(off_by_one, codes / 1000);

  const ComputeBackendStats stats = gpu_backend_->Stats();
  EXPECT_GT(stats.device_total_bytes, 0u);
  EXPECT_GT(stats.arena_bytes, 0u);
}

// Decode steps through KvStore::Attend with a new token each: the CUDA backend's outputs follow
// the CPU backend's at every layer (every dtype of TestConfig) and step. Each new key is aligned
// with the query, so the new token carries most of the softmax weight: an attention that ran
// before its append had landed would be far off.
TEST_P(CudaVsCpuStores, AttendAppendsEachNewTokenBeforeAttendingLikeTheCpuBackend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  ASSERT_NO_FATAL_FAILURE(PutBoth(
      77, [](int) { return testing::Outliers::kSpikes; }, 300));
  const int kv_heads = config_.num_kv_heads, dim = config_.head_dim, q_heads = 2 * kv_heads;
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " layer " << layer);
      const std::vector<float> q =
          testing::MakeNormal(static_cast<size_t>(q_heads) * dim, 1000 + 10 * step + layer);
      std::vector<float> k(static_cast<size_t>(kv_heads) * dim);
      for (int h = 0; h < kv_heads; ++h) {
        for (int c = 0; c < dim; ++c) k[h * dim + c] = 0.5f * q[(2 * h) * dim + c];
      }
      const std::vector<float> v =
          testing::MakeNormal(static_cast<size_t>(kv_heads) * dim, 2000 + 10 * step + layer);
      const std::vector<uint16_t> hq = testing::ToHalf(q), hk = testing::ToHalf(k),
                                  hv = testing::ToHalf(v);
      std::vector<float> cpu_out(q.size()), gpu_out(q.size());
      uint32_t cpu_ctx = 0, gpu_ctx = 0;
      const int32_t token = 5000 + step;
      const KvStore::AttendItem cpu_item{cpu_match_.lease_id, hq.data(), hk.data(), hv.data(),
                                         token};
      const KvStore::AttendItem gpu_item{gpu_match_.lease_id, hq.data(), hk.data(), hv.data(),
                                         token};
      ASSERT_TRUE(cpu_store_
                      ->Attend(layer, q_heads, 0.0f, {cpu_item},
                               {cpu_out.data(), nullptr, nullptr, &cpu_ctx})
                      .ok());
      ASSERT_TRUE(gpu_store_
                      ->Attend(layer, q_heads, 0.0f, {gpu_item},
                               {gpu_out.data(), nullptr, nullptr, &gpu_ctx})
                      .ok());
      ASSERT_EQ(gpu_ctx, cpu_ctx);
      ASSERT_EQ(gpu_ctx, 96u + step + 1);
      double err = 0, norm = 0;
      for (size_t i = 0; i < q.size(); ++i) {
        err += (gpu_out[i] - cpu_out[i]) * (gpu_out[i] - cpu_out[i]);
        norm += cpu_out[i] * cpu_out[i];
      }
      EXPECT_LE(std::sqrt(err / norm), 2e-3) << "relative L2 error of the GPU output";
    }
  }
}

// q and the output in host memory registered with the backend (an AttendSocket region) skip the
// staging copies. With kernel_host_io the kernels write the output there, and read q there when
// the call runs one split (40 items; with 3 items, two splits, q is uploaded from the region);
// without it the backend copies q from and the output to the region by DMA. The same lse and
// outputs, to the bit, as through the staging slot, for fp32 and fp16 outputs at every layer (the
// split kernels sum in a fixed order); the registered output is written whole.
TEST_P(CudaVsCpuStores, AttendWithRegisteredQueryAndOutputMatchesStagedCopies) {
  KVPOOL_SKIP_WITHOUT_GPU();
  ASSERT_NO_FATAL_FAILURE(PutBoth(
      78,
      [](int layer) {
        return layer % 2 == 0 ? testing::Outliers::kSpikes : testing::Outliers::kOffset;
      },
      400));
  const int q_heads = 2 * config_.num_kv_heads;
  const size_t q_elems = static_cast<size_t>(q_heads) * config_.head_dim;
  for (const int items : {3, 40}) {
    const size_t rows = items * static_cast<size_t>(q_heads);
    const size_t out_elems = rows * config_.head_dim;
    // q rows, then room for an fp32 output.
    std::vector<float> region(items * q_elems / 2 + out_elems);
    auto* region_q = reinterpret_cast<uint16_t*>(region.data());
    float* region_out = region.data() + items * q_elems / 2;
    ASSERT_TRUE(gpu_backend_->RegisterHostMemory(region.data(), region.size() * 4).ok());
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      for (const bool fp16 : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << items << " items, layer " << layer << (fp16 ? " fp16" : " fp32"));
        const std::vector<uint16_t> q =
            testing::ToHalf(testing::MakeNormal(items * q_elems, 3000 + 2 * layer + fp16));
        std::memcpy(region_q, q.data(), q.size() * 2);
        std::vector<KvStore::AttendItem> staged(items), pinned(items);
        for (int i = 0; i < items; ++i) {
          staged[i] = {gpu_match_.lease_id, q.data() + i * q_elems, nullptr, nullptr, -1};
          pinned[i] = {gpu_match_.lease_id, region_q + i * q_elems, nullptr, nullptr, -1};
        }
        std::vector<float> out(out_elems), lse(rows), pinned_lse(rows);
        std::vector<uint16_t> out16(out_elems);
        std::vector<uint32_t> ctx(items), pinned_ctx(items);
        std::fill(region_out, region_out + out_elems, NAN);
        auto* region_out16 = reinterpret_cast<uint16_t*>(region_out);
        const KvStore::AttendOutputs a{fp16 ? nullptr : out.data(), fp16 ? out16.data() : nullptr,
                                       lse.data(), ctx.data()};
        const KvStore::AttendOutputs b{fp16 ? nullptr : region_out, fp16 ? region_out16 : nullptr,
                                       pinned_lse.data(), pinned_ctx.data()};
        ASSERT_TRUE(gpu_store_->Attend(layer, q_heads, 0.0f, staged, a).ok());
        ASSERT_TRUE(gpu_store_->Attend(layer, q_heads, 0.0f, pinned, b).ok());
        EXPECT_EQ(lse, pinned_lse);
        EXPECT_EQ(ctx, pinned_ctx);
        for (size_t i = 0; i < out_elems; ++i) {
          const float want = fp16 ? HalfToFloat(out16[i]) : out[i];
          const float got = fp16 ? HalfToFloat(region_out16[i]) : region_out[i];
          ASSERT_TRUE(std::isfinite(got)) << i;
          ASSERT_EQ(got, want) << "element " << i;
        }
      }
    }
    gpu_backend_->UnregisterHostMemory(region.data());
  }
}

INSTANTIATE_TEST_SUITE_P(KernelHostIo, CudaVsCpuStores, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "HostPointers" : "DmaCopies";
                         });

// A store over the CUDA backend refuses a namespace its kernels do not serve, and creates the
// test's own.
TEST(CudaBackend, StoreRefusesNamespacesItsKernelsDoNotServe) {
  KVPOOL_SKIP_WITHOUT_GPU();
  auto backend = NewCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  KvStore::Options o;
  o.pool_bytes = 256 << 20;
  o.backend = backend->get();
  auto store = KvStore::Create(o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (auto change : std::vector<void (*)(NamespaceConfig&)>{
           [](NamespaceConfig& c) { c.head_dim = 32; },
           [](NamespaceConfig& c) { c.block_tokens = 8; },
           [](NamespaceConfig& c) { c.group_size = 8; },
           [](NamespaceConfig& c) { c.head_dim = c.rotation_block = 256; }}) {
    NamespaceConfig c = TestConfig();
    change(c);
    EXPECT_EQ((*store)->CreateNamespace(c).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE((*store)->ListNamespaces().empty());
  EXPECT_TRUE((*store)->CreateNamespace(TestConfig()).ok());
}

TEST(CudaBackend, RejectsBadAppendsAndStepsBeforeWriting) {
  KVPOOL_SKIP_WITHOUT_GPU();
  auto backend = NewCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const PageLayout l = LayerLayout(TestConfig(), 1);
  const int64_t num_blocks = 2;
  auto arena = (*backend)->AllocateArena(num_blocks * l.layer_page_bytes());
  ASSERT_TRUE(arena.ok()) << arena.status();
  const testing::KvData d =
      testing::MakeKv(2, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 5);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  const std::vector<int64_t> slots = {3, num_blocks * l.block_tokens};
  const std::vector<int32_t> positions = {0, 1};
  QuantizeAppendParams p = AppendParams(l, k, v, slots, positions, 2, *arena, num_blocks);
  p.layout.sink_tokens = 0;
  const absl::Status s = (*backend)->QuantizeAppend(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The same append riding in a decode step fails the step before its attention runs.
  const std::vector<uint16_t> q(static_cast<size_t>(l.num_kv_heads) * l.head_dim, 0x3c00);
  const int32_t table = 0, len = 1;
  std::vector<float> out(q.size(), -1.0f);
  PagedDecodeAttentionParams a;
  a.layout = p.layout;
  a.pages = *arena;
  a.q = q.data();
  a.num_seqs = 1;
  a.num_q_heads = l.num_kv_heads;
  a.block_tables = &table;
  a.max_blocks_per_seq = 1;
  a.seq_lens = &len;
  a.out = out.data();
  a.num_blocks = num_blocks;
  const absl::Status step = (*backend)->PagedDecodeAttention(a, &p);
  EXPECT_EQ(step.code(), absl::StatusCode::kInvalidArgument) << step;
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));
  // So does a valid append riding in a step that asks for more splits than the kernels take.
  const std::vector<int64_t> good_slots = {0, 1};
  QuantizeAppendParams good = AppendParams(l, k, v, good_slots, positions, 2, *arena, num_blocks);
  good.layout.sink_tokens = 0;
  a.num_splits = cuda::kMaxAttentionSplits + 1;
  const absl::Status split_step = (*backend)->PagedDecodeAttention(a, &good);
  EXPECT_EQ(split_step.code(), absl::StatusCode::kInvalidArgument) << split_step;
  ASSERT_TRUE((*backend)->Synchronize().ok());
  // Nothing was written: the arena is still zero.
  std::vector<uint8_t> host(l.layer_page_bytes(), 0xFF);
  ASSERT_TRUE((*backend)->ReadArena(*arena, host.size(), host.data()).ok());
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; }));
  (*backend)->FreeArena(*arena);
}

// Appends land in the order they were queued, whatever lanes they take: a large append and then a
// small one into the last block it also wrote (which its last CTAs reach last) leave the small
// one's codes there (a block freed and handed out again must not receive an older append's write
// after a newer one's). That block's pages must equal those of the small append alone, in each
// of 16 rounds.
TEST(CudaBackend, AppendsLandInTheOrderTheyWereQueued) {
  KVPOOL_SKIP_WITHOUT_GPU();
  auto backend = NewCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  PageLayout l = LayerLayout(TestConfig(), 1);
  l.sink_tokens = 0;
  // Long enough that the small append's kernel runs while the large one's is still writing.
  const int64_t num_blocks = 4096;
  const int big_tokens = static_cast<int>(num_blocks) * l.block_tokens;
  const testing::KvData big =
      testing::MakeKv(big_tokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 100);
  const std::vector<uint16_t> big_k = testing::ToHalf(big.k), big_v = testing::ToHalf(big.v);
  auto append = [&](uint8_t* pages, int first_slot, int tokens, uint64_t seed) {
    std::vector<uint16_t> k, v;
    if (tokens == big_tokens) {
      k = big_k;
      v = big_v;
    } else {
      const testing::KvData d =
          testing::MakeKv(tokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, seed);
      k = testing::ToHalf(d.k);
      v = testing::ToHalf(d.v);
    }
    std::vector<int64_t> slots(tokens);
    std::vector<int32_t> positions(tokens);
    for (int t = 0; t < tokens; ++t) {
      slots[t] = first_slot + t;
      positions[t] = first_slot + t;
    }
    // Its inputs are copied before it returns.
    return (*backend)->QuantizeAppend(
        AppendParams(l, k, v, slots, positions, tokens, pages, num_blocks));
  };
  auto arena = (*backend)->AllocateArena(num_blocks * l.layer_page_bytes());
  auto alone = (*backend)->AllocateArena(num_blocks * l.layer_page_bytes());
  ASSERT_TRUE(arena.ok() && alone.ok());
  const int last = big_tokens - l.block_tokens;  // the first slot of the last block
  const size_t at = static_cast<size_t>(num_blocks - 1) * l.layer_page_bytes();
  std::vector<uint8_t> got(l.layer_page_bytes()), want(l.layer_page_bytes());
  for (int round = 0; round < 16; ++round) {
    ASSERT_TRUE(append(*arena, 0, big_tokens, 100 + round).ok());
    ASSERT_TRUE(append(*arena, last, l.block_tokens, 200 + round).ok());
    ASSERT_TRUE(append(*alone, last, l.block_tokens, 200 + round).ok());
    ASSERT_TRUE((*backend)->Synchronize().ok());
    ASSERT_TRUE((*backend)->ReadArena(*arena + at, got.size(), got.data()).ok());
    ASSERT_TRUE((*backend)->ReadArena(*alone + at, want.size(), want.data()).ok());
    ASSERT_EQ(got, want) << "round " << round << ": the earlier, larger append landed last";
  }
  (*backend)->FreeArena(*arena);
  (*backend)->FreeArena(*alone);
}

// A call that grows a lane's staging buffers waits for no other stream's work: the buffers it
// outgrew are kept, not freed (a device free waits for every kernel on the device, such as an
// NCCL transfer stalled on its worker; here a stream held by a host function).
TEST(CudaBackend, GrowingStagingWaitsForNoOtherStream) {
  KVPOOL_SKIP_WITHOUT_GPU();
  auto backend = NewCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  PageLayout l = LayerLayout(TestConfig(), 1);
  l.sink_tokens = 0;
  const int max_tokens = 2048;  // 4 MiB of K and V, past the first 1 MiB buffers
  const int64_t num_blocks = max_tokens / l.block_tokens;
  auto arena = (*backend)->AllocateArena(num_blocks * l.layer_page_bytes());
  ASSERT_TRUE(arena.ok()) << arena.status();
  const testing::KvData d =
      testing::MakeKv(max_tokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 9);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  std::vector<int64_t> slots(max_tokens);
  std::vector<int32_t> positions(max_tokens);
  for (int t = 0; t < max_tokens; ++t) slots[t] = positions[t] = t;
  auto append = [&](int tokens) {
    return (*backend)->QuantizeAppend(
        AppendParams(l, k, v, slots, positions, tokens, *arena, num_blocks));
  };
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(append(16).ok());  // every slot has its first buffers
  ASSERT_TRUE((*backend)->Synchronize().ok());
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  absl::Notification release;
  ASSERT_EQ(
      cudaLaunchHostFunc(
          other,
          [](void* n) {
            static_cast<absl::Notification*>(n)->WaitForNotificationWithTimeout(absl::Seconds(10));
          },
          &release),
      cudaSuccess);
  const absl::Time start = absl::Now();
  const absl::Status grown = append(max_tokens);
  const absl::Duration took = absl::Now() - start;
  release.Notify();
  ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  cudaStreamDestroy(other);
  ASSERT_TRUE(grown.ok()) << grown;
  EXPECT_LT(took, absl::Seconds(2)) << "the append waited for the other stream";
  ASSERT_TRUE((*backend)->Synchronize().ok());
  (*backend)->FreeArena(*arena);
}

// A fresh arena's zeros land before any work on the lanes (the fill runs on the legacy stream,
// which the lanes' non-blocking streams do not wait for): an append into the last block of an
// 8 GiB arena, which the fill reaches last, is there when read back, in each of 4 rounds.
TEST(CudaBackend, AFreshArenasZerosLandBeforeItsFirstAppend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  auto backend = NewCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  PageLayout l = LayerLayout(TestConfig(), 1);
  l.sink_tokens = 0;
  const testing::KvData d =
      testing::MakeKv(l.block_tokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 6);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  std::vector<int32_t> positions(l.block_tokens);
  std::vector<int64_t> first(l.block_tokens), last(l.block_tokens);
  const int64_t num_blocks = (int64_t{8} << 30) / static_cast<int64_t>(l.layer_page_bytes());
  for (int t = 0; t < l.block_tokens; ++t) {
    positions[t] = t;
    first[t] = t;
    last[t] = (num_blocks - 1) * l.block_tokens + t;
  }
  // The same tokens into block 0 of a small arena, filled long before: the pages to expect.
  auto small = (*backend)->AllocateArena(l.layer_page_bytes());
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE(
      (*backend)
          ->QuantizeAppend(AppendParams(l, k, v, first, positions, l.block_tokens, *small, 1))
          .ok());
  ASSERT_TRUE((*backend)->Synchronize().ok());
  std::vector<uint8_t> want(l.layer_page_bytes()), got(l.layer_page_bytes());
  ASSERT_TRUE((*backend)->ReadArena(*small, want.size(), want.data()).ok());
  for (int round = 0; round < 4; ++round) {
    auto big = (*backend)->AllocateArena(static_cast<size_t>(num_blocks) * l.layer_page_bytes());
    ASSERT_TRUE(big.ok()) << big.status();
    ASSERT_TRUE((*backend)
                    ->QuantizeAppend(
                        AppendParams(l, k, v, last, positions, l.block_tokens, *big, num_blocks))
                    .ok());
    ASSERT_TRUE((*backend)->Synchronize().ok());
    const size_t at = static_cast<size_t>(num_blocks - 1) * l.layer_page_bytes();
    ASSERT_TRUE((*backend)->ReadArena(*big + at, got.size(), got.data()).ok());
    (*backend)->FreeArena(*big);
    ASSERT_EQ(got, want) << "round " << round << ": the arena's fill landed after the append";
  }
  (*backend)->FreeArena(*small);
}

TEST(CudaBackend, ReportsMissingDevice) {
  KVPOOL_SKIP_WITHOUT_GPU();
  const auto backend = NewCudaBackend(4096);
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
