// CUDA QuantizeAppendLayers (a transfer round's layers in one launch) against the CPU reference
// (kvpool::cpu::QuantizeAppend) of each layer's own sign seed, on fresh random K/V with outlier
// channels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/quantize_test_util.h"

namespace kvpool {
namespace {

using namespace quantize_test;  // NOLINT: the shared inputs and checks of quantize_test_util.h

// Layers in one launch (QuantizeAppendLayers), as a transfer round stores them: each layer's
// K and V, pages and sink pages one stride (with padding) past the layer before's, its own
// inputs and sign seed, one slot mapping and positions for all. Each layer matches the CPU
// reference of its own seed, and the layer past the count stays untouched.
TEST(QuantizeGpu, LayersOfOneLaunchMatchTheCpuReferenceOfTheirSeeds) {
  KVPOOL_SKIP_WITHOUT_GPU();
  constexpr int kLayers = 5;
  uint64_t seed = 2000;
  for (const Case& c :
       {Case{KvDtype::kInt4, 128, 128, 16, 0, /*sink_tokens=*/4, /*num_kv_heads=*/8, 300},
        Case{KvDtype::kInt8, 64, 128, 32, /*group_size=*/32, 0, 3, 157},
        Case{KvDtype::kFp16, 0, 64, 16, 0, /*sink_tokens=*/2, 2, 90}}) {
    SCOPED_TRACE(Name(c));
    std::vector<Inputs> in;
    for (int i = 0; i <= kLayers; ++i) in.push_back(MakeInputs(c, seed++));
    const Inputs& first = in[0];
    const PageLayout& l = first.layout;
    const size_t kv_bytes = first.k.size() * sizeof(uint16_t);
    const size_t page_bytes = first.num_blocks * l.layer_page_bytes();
    const size_t sink_bytes = first.num_blocks * l.sink_page_bytes();
    const cuda::QuantizeLayerStrides stride{static_cast<int64_t>(AlignUp16(2 * kv_bytes) + 32),
                                            static_cast<int64_t>(AlignUp16(page_bytes) + 48),
                                            static_cast<int64_t>(AlignUp16(sink_bytes) + 16)};
    DeviceBuffer kv((kLayers + 1) * stride.kv), pages((kLayers + 1) * stride.pages),
        sinks((kLayers + 1) * stride.sink_pages), slots(first.slots.size() * 8),
        positions(first.positions.size() * 4);
    slots.Upload(first.slots.data());
    positions.Upload(first.positions.data());
    for (int i = 0; i <= kLayers; ++i) {
      uint8_t* at = kv.as<uint8_t>() + i * stride.kv;
      ASSERT_EQ(cudaMemcpy(at, in[i].k.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(at + kv_bytes, in[i].v.data(), kv_bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    ASSERT_EQ(cudaMemset(pages.as<void>(), kPoison, (kLayers + 1) * stride.pages), cudaSuccess);
    ASSERT_EQ(cudaMemset(sinks.as<void>(), kPoison, (kLayers + 1) * stride.sink_pages),
              cudaSuccess);
    QuantizeAppendParams d;
    d.layout = l;
    d.k = kv.as<uint16_t>();
    d.v = reinterpret_cast<const uint16_t*>(kv.as<uint8_t>() + kv_bytes);
    d.slot_mapping = slots.as<int64_t>();
    d.positions = positions.as<int32_t>();
    d.num_tokens = c.num_tokens;
    d.pages = pages.as<uint8_t>();
    d.sink_pages = l.sink_tokens > 0 ? sinks.as<uint8_t>() : nullptr;
    d.num_blocks = first.num_blocks;
    d.num_sink_blocks = l.sink_tokens > 0 ? first.num_blocks : 0;
    uint64_t seeds[kLayers];
    for (int i = 0; i < kLayers; ++i) seeds[i] = in[i].layout.sign_seed;
    ASSERT_EQ(cuda::QuantizeAppendLayers(d, kLayers, stride, seeds, nullptr), KernelStatus::kOk)
        << cuda::LastErrorMessage();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> all_pages((kLayers + 1) * stride.pages);
    std::vector<uint8_t> all_sinks((kLayers + 1) * stride.sink_pages);
    pages.Download(all_pages.data());
    sinks.Download(all_sinks.data());

    CodeStats stats;
    for (int i = 0; i < kLayers; ++i) {
      SCOPED_TRACE("layer " + std::to_string(i));
      std::vector<uint8_t> cpu_pages(page_bytes, kPoison), cpu_sinks(sink_bytes, kPoison);
      QuantizeAppendParams p = d;
      p.layout.sign_seed = seeds[i];
      p.k = in[i].k.data();
      p.v = in[i].v.data();
      p.slot_mapping = first.slots.data();
      p.positions = first.positions.data();
      p.pages = cpu_pages.data();
      p.sink_pages = l.sink_tokens > 0 ? cpu_sinks.data() : nullptr;
      ASSERT_EQ(cpu::QuantizeAppend(p), KernelStatus::kOk);
      const auto page_at = all_pages.begin() + i * stride.pages;
      const auto sink_at = all_sinks.begin() + i * stride.sink_pages;
      ExpectPagesMatch(first, cpu_pages, std::vector<uint8_t>(page_at, page_at + page_bytes),
                       cpu_sinks, std::vector<uint8_t>(sink_at, sink_at + sink_bytes), &stats);
      if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_TRUE(std::all_of(all_pages.begin() + kLayers * stride.pages, all_pages.end(),
                            [](uint8_t b) { return b == kPoison; }))
        << "the layer past the count was written";
    if (c.dtype != KvDtype::kFp16) ExpectFewTies(stats, "layers of one launch");
  }
}

}  // namespace
}  // namespace kvpool
