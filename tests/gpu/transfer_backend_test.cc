// The CUDA backend's transfer paths (GatherArena, DequantizeToArena, QuantizeAppendFromArena:
// inputs and outputs in device memory, used by the NCCL data plane; CheckHalfRangeArena in
// half_range_arena_test.cc), and
// ReadRuns (the runs to host memory), against the CPU backend on the same data, and against the
// CUDA backend's own host-memory paths; the store's arena read behind a RAW NcclGet.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/quantize_layer_runs.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/transfer_test_util.h"

namespace kvpool {
namespace {

using namespace transfer_test;  // NOLINT: the CUDA backend helpers of transfer_test_util.h

constexpr int64_t kNumBlocks = 12;
constexpr int kTokens = 16 * 9 + 5;  // nine full blocks and a partial one

PageLayout TestLayout(KvDtype dtype) {
  PageLayout l;
  l.num_kv_heads = 4;
  l.head_dim = 128;
  l.block_tokens = 16;
  l.dtype = dtype;
  l.group_size = 32;
  l.rot_block = 64;
  l.sign_seed = 77;
  l.sink_tokens = 4;
  return l;
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Slots of kTokens tokens spread over the arena's blocks in a shuffled order, with every 7th
// token skipped (slot -1), and their positions in the sequence.
void MakeSlots(std::vector<int64_t>* slots, std::vector<int32_t>* positions) {
  std::vector<int64_t> blocks(kNumBlocks);
  for (int64_t b = 0; b < kNumBlocks; ++b) blocks[b] = b;
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(11));
  for (int t = 0; t < kTokens; ++t) {
    slots->push_back(t % 7 == 3 ? -1 : blocks[t / 16] * 16 + t % 16);
    positions->push_back(t);
  }
}

TEST(CudaTransferBackend, GatherArenaAndReadRunsCopyEveryRunInOrderLikeTheCpuBackend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  constexpr size_t kSourceBytes = size_t{24} << 20;
  const std::vector<uint8_t> source = RandomBytes(kSourceBytes, 3);
  uint8_t* gpu_src = Upload(*gpu, source.data(), kSourceBytes);
  absl::StatusOr<uint8_t*> cpu_src = cpu->AllocateArena(kSourceBytes);
  ASSERT_TRUE(gpu_src != nullptr && cpu_src.ok());
  std::memcpy(*cpu_src, source.data(), kSourceBytes);

  // More runs than the grid has warps; most 16-byte aligned page-sized runs, some of odd size
  // or offset (the byte path), some empty, some of zeros (a null source).
  std::mt19937_64 rng(5);
  std::vector<size_t> offsets, sizes;
  size_t total = 0;
  for (int i = 0; i < 20000; ++i) {
    const bool odd = i % 97 == 0;
    const size_t bytes = i % 501 == 0 ? 0 : odd ? 1 + rng() % 3000 : 16 * (1 + rng() % 600);
    const size_t offset = (rng() % (kSourceBytes - bytes)) & (odd ? ~size_t{0} : ~size_t{15});
    offsets.push_back(offset);
    sizes.push_back(bytes);
    total += bytes;
  }
  auto zeros = [](size_t i) { return i % 89 == 0 || i % 89 == 1; };
  std::vector<ComputeBackend::ArenaRun> gpu_runs, cpu_runs;
  for (size_t i = 0; i < offsets.size(); ++i) {
    gpu_runs.push_back({zeros(i) ? nullptr : gpu_src + offsets[i], sizes[i]});
    cpu_runs.push_back({zeros(i) ? nullptr : *cpu_src + offsets[i], sizes[i]});
  }
  // Destinations of 0xff bytes, which the zero runs must overwrite.
  const std::vector<uint8_t> ones(total, 0xff);
  uint8_t* gpu_dst = Upload(*gpu, ones.data(), total);
  absl::StatusOr<uint8_t*> cpu_dst = cpu->AllocateArena(total);
  ASSERT_TRUE(gpu_dst != nullptr && cpu_dst.ok());
  std::memset(*cpu_dst, 0xff, total);
  ASSERT_TRUE(gpu->GatherArena(gpu_runs, gpu_dst).ok());
  ASSERT_TRUE(cpu->GatherArena(cpu_runs, *cpu_dst).ok());
  const std::vector<uint8_t> got = Download(*gpu, gpu_dst, total);
  ASSERT_EQ(std::memcmp(got.data(), *cpu_dst, total), 0);
  // The same runs read to host memory in one call (the store's raw reads) land the same.
  std::vector<uint8_t> host(total, 0xff);
  ASSERT_TRUE(gpu->ReadRuns(gpu_runs, host.data()).ok());
  EXPECT_EQ(host, got);
  size_t at = 0;
  const std::vector<uint8_t> no_bytes(kSourceBytes, 0);
  for (size_t i = 0; i < offsets.size(); at += sizes[i], ++i) {
    const uint8_t* want = zeros(i) ? no_bytes.data() : source.data() + offsets[i];
    ASSERT_EQ(std::memcmp(got.data() + at, want, sizes[i]), 0) << "run " << i;
  }
  EXPECT_TRUE(gpu->GatherArena({}, gpu_dst).ok());
  EXPECT_EQ(gpu->GatherArena(gpu_runs, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaTransferBackend, GatherArenaSeesAppendsQueuedBeforeIt) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  const PageLayout l = TestLayout(KvDtype::kInt4);
  absl::StatusOr<uint8_t*> pages = gpu->AllocateArena(kNumBlocks * l.layer_page_bytes());
  ASSERT_TRUE(pages.ok());
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  MakeSlots(&slots, &positions);
  const testing::KvData d =
      testing::MakeKv(kTokens, l.num_kv_heads, l.head_dim, testing::Outliers::kSpikes, 9);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  const size_t row = static_cast<size_t>(l.num_kv_heads) * l.head_dim;
  // One asynchronous append per token, spread over the backend's lanes.
  for (int t = 0; t < kTokens; ++t) {
    QuantizeAppendParams p;
    p.layout = l;
    p.layout.sink_tokens = 0;
    p.k = k.data() + t * row;
    p.v = v.data() + t * row;
    p.slot_mapping = &slots[t];
    p.num_tokens = 1;
    p.pages = *pages;
    p.num_blocks = kNumBlocks;
    ASSERT_TRUE(gpu->QuantizeAppend(p).ok());
  }
  const size_t bytes = kNumBlocks * l.layer_page_bytes();
  absl::StatusOr<uint8_t*> gathered = gpu->AllocateArena(bytes);
  ASSERT_TRUE(gathered.ok());
  const ComputeBackend::ArenaRun run{*pages, bytes};
  ASSERT_TRUE(gpu->GatherArena(absl::MakeConstSpan(&run, 1), *gathered).ok());
  ASSERT_TRUE(gpu->Synchronize().ok());
  EXPECT_EQ(Download(*gpu, *gathered, bytes), Download(*gpu, *pages, bytes));
}

class CudaTransferDtype : public ::testing::TestWithParam<KvDtype> {};

TEST_P(CudaTransferDtype, DequantizeToArenaMatchesHostPathAndCpuBackend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  const PageLayout l = TestLayout(GetParam());
  const size_t page_bytes = kNumBlocks * l.layer_page_bytes();
  absl::StatusOr<uint8_t*> cpu_pages = cpu->AllocateArena(page_bytes);
  ASSERT_TRUE(cpu_pages.ok());
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  MakeSlots(&slots, &positions);
  const testing::KvData d =
      testing::MakeKv(kTokens, l.num_kv_heads, l.head_dim, testing::Outliers::kRope, 21);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  QuantizeAppendParams q;
  q.layout = l;
  q.layout.sink_tokens = 0;
  q.k = k.data();
  q.v = v.data();
  q.slot_mapping = slots.data();
  q.num_tokens = kTokens;
  q.pages = *cpu_pages;
  q.num_blocks = kNumBlocks;
  ASSERT_TRUE(cpu->QuantizeAppend(q).ok());
  // The same pages on the GPU, so both backends dequantize identical bytes.
  uint8_t* gpu_pages = Upload(*gpu, *cpu_pages, page_bytes);
  ASSERT_NE(gpu_pages, nullptr);

  const std::vector<int32_t> ids = {7, 0, 11, 3, 3, 5};
  const int head_begin = 1, head_end = 4;
  const size_t elems =
      ids.size() * l.block_tokens * static_cast<size_t>(head_end - head_begin) * l.head_dim;
  DequantizeParams p;
  p.layout = l;
  p.block_ids = ids.data();
  p.num_out_blocks = static_cast<int>(ids.size());
  p.head_begin = head_begin;
  p.head_end = head_end;
  p.num_blocks = kNumBlocks;

  std::vector<uint16_t> cpu_k(elems), cpu_v(elems), host_k(elems), host_v(elems);
  p.pages = *cpu_pages;
  p.k_out = cpu_k.data();
  p.v_out = cpu_v.data();
  ASSERT_TRUE(cpu->Dequantize(p).ok());
  p.pages = gpu_pages;
  p.k_out = host_k.data();
  p.v_out = host_v.data();
  ASSERT_TRUE(gpu->Dequantize(p).ok());
  // Two elements in one call, each with its own block ids (the ids above, then reversed), into
  // one arena buffer: element e's K at 2e, its V at 2e + 1 (in units of elems).
  const std::vector<int32_t> reversed(ids.rbegin(), ids.rend());
  std::vector<uint16_t> host_k2(elems), host_v2(elems);
  DequantizeParams p2 = p;
  p2.block_ids = reversed.data();
  p2.k_out = host_k2.data();
  p2.v_out = host_v2.data();
  ASSERT_TRUE(gpu->Dequantize(p2).ok());
  const size_t out_bytes = 4 * elems * sizeof(uint16_t);
  absl::StatusOr<uint8_t*> out = gpu->AllocateArena(out_bytes);
  ASSERT_TRUE(out.ok());
  auto* base = reinterpret_cast<uint16_t*>(*out);
  p.k_out = base;
  p.v_out = base + elems;
  p2.k_out = base + 2 * elems;
  p2.v_out = base + 3 * elems;
  ASSERT_TRUE(gpu->DequantizeToArena({p, p2}).ok());
  const std::vector<uint8_t> got = Download(*gpu, *out, out_bytes);
  std::vector<uint16_t> arena[4];
  for (int i = 0; i < 4; ++i) {
    arena[i].resize(elems);
    std::memcpy(arena[i].data(), got.data() + i * elems * sizeof(uint16_t),
                elems * sizeof(uint16_t));
  }
  const std::vector<uint16_t>& arena_k = arena[0];
  const std::vector<uint16_t>& arena_v = arena[1];

  EXPECT_EQ(arena_k, host_k);
  EXPECT_EQ(arena_v, host_v);
  EXPECT_EQ(arena[2], host_k2);
  EXPECT_EQ(arena[3], host_v2);
  for (size_t i = 0; i < elems; ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      const float a = HalfToFloat((kv == 0 ? cpu_k : cpu_v)[i]);
      const float b = HalfToFloat((kv == 0 ? arena_k : arena_v)[i]);
      ASSERT_LE(std::fabs(a - b), 2e-3f * std::fabs(a) + 1e-3f)
          << (kv == 0 ? "k" : "v") << " element " << i << ": cpu " << a << " gpu " << b;
    }
  }

  // A bad id in the second element: rejected before anything runs, the buffer unchanged.
  std::vector<int32_t> bad_ids = ids;
  bad_ids[2] = kNumBlocks;
  DequantizeParams bad = p2;
  bad.block_ids = bad_ids.data();
  p.k_out = base + 2 * elems;  // would overwrite element 1's output if it ran
  p.v_out = base + 3 * elems;
  EXPECT_EQ(gpu->DequantizeToArena({p, bad}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Download(*gpu, *out, out_bytes), got);
}

TEST_P(CudaTransferDtype, QuantizeAppendFromArenaMatchesHostPathAndCpuBackend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  const PageLayout l = TestLayout(GetParam());
  const size_t page_bytes = kNumBlocks * l.layer_page_bytes();
  const size_t sink_bytes = kNumBlocks * l.sink_page_bytes();
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  MakeSlots(&slots, &positions);
  const testing::KvData d =
      testing::MakeKv(kTokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 33);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  const size_t kv_bytes = k.size() * sizeof(uint16_t);

  QuantizeAppendParams p;
  p.layout = l;
  p.slot_mapping = slots.data();
  p.positions = positions.data();
  p.num_tokens = kTokens;
  p.num_blocks = kNumBlocks;
  p.num_sink_blocks = kNumBlocks;
  // Three targets: the CPU backend, the CUDA host path, the CUDA arena path.
  absl::StatusOr<uint8_t*> cpu_pages = cpu->AllocateArena(page_bytes);
  absl::StatusOr<uint8_t*> cpu_sinks = cpu->AllocateArena(sink_bytes);
  absl::StatusOr<uint8_t*> host_pages = gpu->AllocateArena(page_bytes);
  absl::StatusOr<uint8_t*> host_sinks = gpu->AllocateArena(sink_bytes);
  absl::StatusOr<uint8_t*> arena_pages = gpu->AllocateArena(page_bytes);
  absl::StatusOr<uint8_t*> arena_sinks = gpu->AllocateArena(sink_bytes);
  ASSERT_TRUE(cpu_pages.ok() && cpu_sinks.ok() && host_pages.ok() && host_sinks.ok() &&
              arena_pages.ok() && arena_sinks.ok());
  p.k = k.data();
  p.v = v.data();
  p.pages = *cpu_pages;
  p.sink_pages = *cpu_sinks;
  ASSERT_TRUE(cpu->QuantizeAppend(p).ok());
  p.pages = *host_pages;
  p.sink_pages = *host_sinks;
  ASSERT_TRUE(gpu->QuantizeAppend(p).ok());
  uint8_t* gpu_k = Upload(*gpu, k.data(), kv_bytes);
  uint8_t* gpu_v = Upload(*gpu, v.data(), kv_bytes);
  ASSERT_TRUE(gpu_k != nullptr && gpu_v != nullptr);
  p.k = reinterpret_cast<const uint16_t*>(gpu_k);
  p.v = reinterpret_cast<const uint16_t*>(gpu_v);
  p.pages = *arena_pages;
  p.sink_pages = *arena_sinks;
  // In one call of two elements, the first and the rest of the tokens: each element's slots and
  // positions staged apart.
  const int first = kTokens / 3;
  const size_t per_token = static_cast<size_t>(l.num_kv_heads) * l.head_dim;
  QuantizeAppendParams rest = p;
  rest.k += first * per_token;
  rest.v += first * per_token;
  rest.slot_mapping += first;
  rest.positions += first;
  rest.num_tokens = kTokens - first;
  QuantizeAppendParams head = p;
  head.num_tokens = first;
  ASSERT_TRUE(gpu->QuantizeAppendFromArena({head, rest}).ok());
  ASSERT_TRUE(gpu->Synchronize().ok());

  const std::vector<uint8_t> arena = Download(*gpu, *arena_pages, page_bytes);
  EXPECT_EQ(arena, Download(*gpu, *host_pages, page_bytes));
  const std::vector<uint8_t> sinks = Download(*gpu, *arena_sinks, sink_bytes);
  EXPECT_EQ(sinks, Download(*gpu, *host_sinks, sink_bytes));
  // Sinks are fp16 copies: exact. Pages: the CUDA kernel may round a rare tie the other way
  // (one code step, one fp16 ulp of a scale), so only a few bytes may differ from the CPU's.
  EXPECT_EQ(std::memcmp(sinks.data(), *cpu_sinks, sink_bytes), 0);
  size_t differing = 0;
  for (size_t i = 0; i < page_bytes; ++i) differing += arena[i] != (*cpu_pages)[i];
  EXPECT_LE(differing, page_bytes / 100) << differing << " of " << page_bytes << " bytes";
  if (GetParam() == KvDtype::kFp16) {
    EXPECT_EQ(differing, 0u);
  }

  // A bad element refuses the whole call: nothing written, the good element before it included.
  std::vector<int64_t> bad_slots = slots;
  bad_slots[4] = kNumBlocks * l.block_tokens;
  std::vector<int64_t> other_slots = slots;
  std::reverse(other_slots.begin(), other_slots.end());
  QuantizeAppendParams good = p, bad = p;
  good.slot_mapping = other_slots.data();
  bad.slot_mapping = bad_slots.data();
  EXPECT_EQ(gpu->QuantizeAppendFromArena({good, bad}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Download(*gpu, *arena_pages, page_bytes), arena);
}

// A transfer round: the layers' K and V back to back in one staging arena, their pages layer-major
// in one arena, a sign seed each, and then a layer of another dtype (a call the backend serves in
// two launches, QuantizeLayerRuns). Every layer's pages and sink pages are the host path's, one
// QuantizeAppend per layer, byte for byte.
TEST_P(CudaTransferDtype, QuantizeAppendFromArenaOfARoundMatchesTheHostPathPerLayer) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  constexpr int kLayers = 4;  // the last of another dtype
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  MakeSlots(&slots, &positions);
  std::vector<PageLayout> layouts(kLayers, TestLayout(GetParam()));
  layouts[kLayers - 1] = TestLayout(GetParam() == KvDtype::kInt4 ? KvDtype::kInt8 : KvDtype::kInt4);
  const size_t elems = static_cast<size_t>(kTokens) * layouts[0].num_kv_heads * layouts[0].head_dim;
  const size_t kv_bytes = elems * sizeof(uint16_t);
  size_t page_bytes = 0, sink_bytes = 0;
  for (const PageLayout& l : layouts) {
    page_bytes = std::max(page_bytes, kNumBlocks * l.layer_page_bytes());
    sink_bytes = std::max(sink_bytes, kNumBlocks * l.sink_page_bytes());
  }
  std::vector<uint16_t> staged(2 * kLayers * elems);
  for (int i = 0; i < kLayers; ++i) {
    layouts[i].sign_seed = 500 + i;
    const testing::KvData d = testing::MakeKv(kTokens, layouts[i].num_kv_heads, layouts[i].head_dim,
                                              testing::Outliers::kSpikes, 60 + i);
    const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
    std::copy(k.begin(), k.end(), staged.begin() + 2 * i * elems);
    std::copy(v.begin(), v.end(), staged.begin() + (2 * i + 1) * elems);
  }
  uint8_t* staging = Upload(*gpu, staged.data(), staged.size() * sizeof(uint16_t));
  absl::StatusOr<uint8_t*> arena_pages = gpu->AllocateArena(kLayers * page_bytes);
  absl::StatusOr<uint8_t*> arena_sinks = gpu->AllocateArena(kLayers * sink_bytes);
  absl::StatusOr<uint8_t*> host_pages = gpu->AllocateArena(kLayers * page_bytes);
  absl::StatusOr<uint8_t*> host_sinks = gpu->AllocateArena(kLayers * sink_bytes);
  ASSERT_TRUE(staging != nullptr && arena_pages.ok() && arena_sinks.ok() && host_pages.ok() &&
              host_sinks.ok());
  std::vector<QuantizeAppendParams> round(kLayers);
  for (int i = 0; i < kLayers; ++i) {
    QuantizeAppendParams& p = round[i];
    p.layout = layouts[i];
    p.slot_mapping = slots.data();
    p.positions = positions.data();
    p.num_tokens = kTokens;
    p.num_blocks = kNumBlocks;
    p.num_sink_blocks = kNumBlocks;
    QuantizeAppendParams host = p;
    host.k = staged.data() + 2 * i * elems;
    host.v = host.k + elems;
    host.pages = *host_pages + i * page_bytes;
    host.sink_pages = *host_sinks + i * sink_bytes;
    ASSERT_TRUE(gpu->QuantizeAppend(host).ok());
    p.k = reinterpret_cast<const uint16_t*>(staging) + 2 * i * elems;
    p.v = p.k + elems;
    p.pages = *arena_pages + i * page_bytes;
    p.sink_pages = *arena_sinks + i * sink_bytes;
  }
  ASSERT_EQ(store_internal::QuantizeLayerRuns(round).size(), 2u);
  ASSERT_TRUE(gpu->QuantizeAppendFromArena(round).ok());
  ASSERT_TRUE(gpu->Synchronize().ok());
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_EQ(Download(*gpu, *arena_pages + i * page_bytes, page_bytes),
              Download(*gpu, *host_pages + i * page_bytes, page_bytes))
        << "layer " << i;
    EXPECT_EQ(Download(*gpu, *arena_sinks + i * sink_bytes, sink_bytes),
              Download(*gpu, *host_sinks + i * sink_bytes, sink_bytes))
        << "layer " << i;
  }
  for (uint8_t* a : {staging, *arena_pages, *arena_sinks, *host_pages, *host_sinks}) {
    gpu->FreeArena(a);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CudaTransferDtype,
                         ::testing::Values(KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3,
                                           KvDtype::kFp16));

// The store's raw read into device memory behind a RAW NcclGet, on the CUDA backend, from a
// namespace with sink tokens: each layer's K and V pages, then its sink rows, K then V, as ReadRaw
// and ReadRawSinks return them (heads 1 and 2 of 4), the sink rows the fp16 K/V put, bit for bit.
TEST(CudaTransferBackend, StoreArenaRawReadWithSinksMatchesItsHostReads) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  KvStore::Options options;
  options.pool_bytes = 16 << 20;
  options.backend = gpu.get();
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Create(options);
  ASSERT_TRUE(store.ok()) << store.status();
  const PageLayout l = TestLayout(KvDtype::kInt4);
  NamespaceConfig c;
  c.name = "sinks";
  c.num_layers = 2;
  c.num_kv_heads = l.num_kv_heads;
  c.head_dim = l.head_dim;
  c.block_tokens = l.block_tokens;
  c.layer_dtypes = {KvDtype::kInt4, KvDtype::kFp8E4M3};
  c.rotation_block = l.rot_block;
  c.group_size = l.group_size;
  c.sink_tokens = l.sink_tokens;
  c.capacity_bytes = 8 << 20;
  ASSERT_TRUE((*store)->CreateNamespace(c).ok());
  constexpr uint32_t kPut = 48;  // three blocks
  std::vector<int32_t> ids(kPut);
  for (uint32_t t = 0; t < kPut; ++t) ids[t] = static_cast<int32_t>(1000 + t);
  auto put = (*store)->BeginPut("sinks", ids);
  ASSERT_TRUE(put.ok()) << put.status();
  const size_t dim = l.head_dim, heads = l.num_kv_heads, sink_rows = l.sink_tokens;
  std::vector<std::vector<uint16_t>> k(2), v(2);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const testing::KvData kv =
        testing::MakeKv(kPut, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 30 + layer);
    k[layer] = testing::ToHalf(kv.k);
    v[layer] = testing::ToHalf(kv.v);
    ASSERT_TRUE((*put)->AddChunk(layer, 0, kPut, k[layer].data(), v[layer].data()).ok());
  }
  ASSERT_TRUE((*put)->Commit().ok());
  auto lease = (*store)->Match("sinks", ids, absl::ZeroDuration());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const uint32_t blocks = kPut / l.block_tokens;
  ASSERT_EQ(lease->num_blocks, blocks);
  constexpr uint32_t kHeadBegin = 1, kHeadEnd = 3;
  const size_t sink_bytes = (kHeadEnd - kHeadBegin) * sink_rows * dim * sizeof(uint16_t);
  std::vector<uint8_t> want;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const size_t pages = size_t{blocks} * (kHeadEnd - kHeadBegin) *
                         LayerLayout(c, static_cast<int>(layer)).head_page_bytes();
    std::vector<uint8_t> pk(pages), pv(pages), sk(sink_bytes), sv(sink_bytes);
    ASSERT_TRUE(
        (*store)
            ->ReadRaw(lease->lease_id, layer, 0, blocks, kHeadBegin, kHeadEnd, pk.data(), pv.data())
            .ok());
    ASSERT_TRUE(
        (*store)
            ->ReadRawSinks(lease->lease_id, layer, kHeadBegin, kHeadEnd, sk.data(), sv.data())
            .ok());
    // The sink rows are the rows put: [heads][sink_rows][dim] from [tokens][heads][dim].
    for (size_t h = kHeadBegin; h < kHeadEnd; ++h) {
      for (size_t t = 0; t < sink_rows; ++t) {
        const size_t at = ((h - kHeadBegin) * sink_rows + t) * dim * sizeof(uint16_t);
        const size_t from = (t * heads + h) * dim;
        EXPECT_EQ(std::memcmp(sk.data() + at, &k[layer][from], dim * sizeof(uint16_t)), 0);
        EXPECT_EQ(std::memcmp(sv.data() + at, &v[layer][from], dim * sizeof(uint16_t)), 0);
      }
    }
    for (const std::vector<uint8_t>* part : {&pk, &pv, &sk, &sv}) {
      want.insert(want.end(), part->begin(), part->end());
    }
  }
  const std::vector<uint8_t> ones(want.size(), 0xff);
  uint8_t* arena = Upload(*gpu, ones.data(), ones.size());
  ASSERT_NE(arena, nullptr);
  ASSERT_TRUE((*store)
                  ->ReadRawToArena(lease->lease_id, 0, 2, 0, blocks, kHeadBegin, kHeadEnd,
                                   /*sinks=*/true, arena)
                  .ok());
  EXPECT_EQ(Download(*gpu, arena, want.size()), want);
  gpu->FreeArena(arena);
  ASSERT_TRUE((*store)->Release(lease->lease_id).ok());
}

}  // namespace
}  // namespace kvpool
