// store_internal::QuantizeLayerRuns: which elements of a QuantizeAppendFromArena call one
// QuantizeAppendLayers launch takes together (the CUDA backend's batching of a transfer round).
#include "service/store/quantize_layer_runs.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::store_internal {

// For EXPECT_EQ (found by argument-dependent lookup, so outside the anonymous namespace).
bool operator==(const QuantizeLayerRun& a, const QuantizeLayerRun& b) {
  return a.first == b.first && a.count == b.count && a.stride.kv == b.stride.kv &&
         a.stride.pages == b.stride.pages && a.stride.sink_pages == b.stride.sink_pages;
}

namespace {

// Layer i of a round: K and V at a staging stride, pages at an arena stride, its own seed.
std::vector<QuantizeAppendParams> Round(int layers, const int64_t* slots, uint8_t* base) {
  std::vector<QuantizeAppendParams> ps(layers);
  for (int i = 0; i < layers; ++i) {
    QuantizeAppendParams& p = ps[i];
    p.layout.num_kv_heads = 8;
    p.layout.head_dim = 128;
    p.layout.block_tokens = 16;
    p.layout.group_size = 128;
    p.layout.rot_block = 128;
    p.layout.sign_seed = 100 + i;
    p.k = reinterpret_cast<const uint16_t*>(base + i * 4096);
    p.v = reinterpret_cast<const uint16_t*>(base + i * 4096 + 2048);
    p.pages = base + (1 << 20) + i * 65536;
    p.slot_mapping = slots;
    p.num_tokens = 4;
    p.num_blocks = 16;
  }
  return ps;
}

TEST(QuantizeLayerRuns, TakesARoundsLayersTogetherWithTheirStrides) {
  std::vector<uint8_t> memory(4 << 20);
  const int64_t slots[4] = {0, 1, 2, 3};
  const std::vector<QuantizeAppendParams> ps = Round(6, slots, memory.data());
  EXPECT_EQ(QuantizeLayerRuns(ps), (std::vector<QuantizeLayerRun>{{0, 6, {4096, 65536, 0}}}));
  EXPECT_EQ(QuantizeLayerRuns({ps.data(), 1}), (std::vector<QuantizeLayerRun>{{0, 1, {}}}));
  EXPECT_TRUE(QuantizeLayerRuns({}).empty());
}

TEST(QuantizeLayerRuns, SplitsAtAnyDifferenceButTheSeed) {
  std::vector<uint8_t> memory(4 << 20);
  const int64_t slots[4] = {0, 1, 2, 3}, other_slots[4] = {0, 1, 2, 3};
  auto split_at_3 = [&](auto change) {
    std::vector<QuantizeAppendParams> ps = Round(5, slots, memory.data());
    change(ps[3]);
    return QuantizeLayerRuns(ps);
  };
  // Element 3 unlike its neighbours: a run of its own.
  const std::vector<QuantizeLayerRun> want = {{0, 3, {4096, 65536, 0}}, {3, 1, {}}, {4, 1, {}}};
  EXPECT_EQ(split_at_3([](QuantizeAppendParams& p) { p.layout.dtype = KvDtype::kInt8; }), want);
  EXPECT_EQ(split_at_3([](QuantizeAppendParams& p) { p.layout.rot_block = 64; }), want);
  EXPECT_EQ(split_at_3([&](QuantizeAppendParams& p) { p.slot_mapping = other_slots; }), want);
  EXPECT_EQ(split_at_3([](QuantizeAppendParams& p) { p.num_blocks = 17; }), want);
  // Element 3's K and V two strides on: a new run, which element 4 joins a stride back.
  EXPECT_EQ(split_at_3([](QuantizeAppendParams& p) {
              p.k += 4096;  // 8192 bytes
              p.v += 4096;
            }),
            (std::vector<QuantizeLayerRun>{{0, 3, {4096, 65536, 0}}, {3, 2, {-4096, 65536, 0}}}));
  // K and V at different strides: not one run.
  EXPECT_EQ(split_at_3([](QuantizeAppendParams& p) { p.v += 8; }), want);
}

TEST(QuantizeLayerRuns, KeepsElementsThatWriteTheSamePagesApart) {
  // One layer named three times, its K and V at the staging stride: three runs, which write in
  // order, never in one launch.
  std::vector<uint8_t> memory(4 << 20);
  const int64_t slots[4] = {0, 1, 2, 3};
  std::vector<QuantizeAppendParams> ps = Round(3, slots, memory.data());
  for (QuantizeAppendParams& p : ps) p.pages = ps[0].pages;
  EXPECT_EQ(QuantizeLayerRuns(ps),
            (std::vector<QuantizeLayerRun>{{0, 1, {}}, {1, 1, {}}, {2, 1, {}}}));
}

TEST(QuantizeLayerRuns, TakesAtMostTheLaunchsLayers) {
  std::vector<uint8_t> memory(8 << 20);
  const int64_t slots[4] = {0, 1, 2, 3};
  const std::vector<QuantizeAppendParams> ps =
      Round(cuda::kMaxQuantizeLayers + 3, slots, memory.data());
  EXPECT_EQ(QuantizeLayerRuns(ps),
            (std::vector<QuantizeLayerRun>{{0, cuda::kMaxQuantizeLayers, {4096, 65536, 0}},
                                           {cuda::kMaxQuantizeLayers, 3, {4096, 65536, 0}}}));
}

}  // namespace
}  // namespace kvpool::store_internal
