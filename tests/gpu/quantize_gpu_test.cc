// CUDA QuantizeAppend / Dequantize against the CPU reference (kvpool::cpu) on fresh random K/V
// with outlier channels, over dtype x rot block x head_dim x block_tokens, with scattered slot
// mappings, skipped slots, odd token counts, many sequences and sinks, and on rows that need the
// clamp or have a scale of 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/page_codec.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/quantize_test_util.h"

namespace kvpool {
namespace {

using namespace quantize_test;  // NOLINT: the shared inputs and checks of quantize_test_util.h

// Runs one case's inputs on both backends and checks every byte of the arena (and sink arena).
// gpu_sink_blocks >= 0: the CUDA kernel is told that only blocks below it have a sink page, so
// it must leave the others' untouched (the host refuses such appends; the kernel still stays
// inside its sink arena).
void CheckInputs(const Case& c, const Inputs& in, CodeStats* stats, int64_t gpu_sink_blocks = -1) {
  SCOPED_TRACE(Name(c));
  const PageLayout& l = in.layout;
  const size_t page_bytes = in.num_blocks * l.layer_page_bytes();
  const size_t sink_bytes = in.num_blocks * l.sink_page_bytes();

  std::vector<uint8_t> cpu_pages(page_bytes, kPoison), cpu_sinks(sink_bytes, kPoison);
  QuantizeAppendParams p;
  p.layout = l;
  p.k = in.k.data();
  p.v = in.v.data();
  p.slot_mapping = in.slots.data();
  p.positions = in.positions.data();
  p.num_tokens = c.num_tokens;
  p.pages = cpu_pages.data();
  p.sink_pages = l.sink_tokens > 0 ? cpu_sinks.data() : nullptr;
  p.num_blocks = in.num_blocks;
  p.num_sink_blocks = l.sink_tokens > 0 ? in.num_blocks : 0;
  ASSERT_EQ(cpu::QuantizeAppend(p), KernelStatus::kOk);

  DeviceBuffer k(in.k.size() * 2), v(in.v.size() * 2), slots(in.slots.size() * 8),
      positions(in.positions.size() * 4), pages(page_bytes), sinks(sink_bytes);
  k.Upload(in.k.data());
  v.Upload(in.v.data());
  slots.Upload(in.slots.data());
  positions.Upload(in.positions.data());
  ASSERT_EQ(cudaMemset(pages.as<void>(), kPoison, page_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(sinks.as<void>(), kPoison, std::max<size_t>(sink_bytes, 1)), cudaSuccess);
  QuantizeAppendParams d = p;
  d.k = k.as<uint16_t>();
  d.v = v.as<uint16_t>();
  d.slot_mapping = slots.as<int64_t>();
  d.positions = positions.as<int32_t>();
  d.pages = pages.as<uint8_t>();
  d.sink_pages = l.sink_tokens > 0 ? sinks.as<uint8_t>() : nullptr;
  if (gpu_sink_blocks >= 0) {
    d.num_sink_blocks = gpu_sink_blocks;
    std::fill(cpu_sinks.begin() + gpu_sink_blocks * l.sink_page_bytes(), cpu_sinks.end(), kPoison);
  }
  ASSERT_EQ(cuda::QuantizeAppend(d, nullptr), KernelStatus::kOk) << cuda::LastErrorMessage();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> gpu_pages(page_bytes), gpu_sinks(sink_bytes);
  pages.Download(gpu_pages.data());
  sinks.Download(gpu_sinks.data());

  ExpectPagesMatch(in, cpu_pages, gpu_pages, cpu_sinks, gpu_sinks, stats);
  if (::testing::Test::HasFatalFailure()) return;

  // Dequantize: the GPU over the CPU's pages matches the reference within fp16 rounding; the
  // GPU round trip reconstructs the inputs within the dtype's error.
  std::vector<int32_t> ids(in.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(l.sign_seed));
  const int head_begin = l.num_kv_heads > 1 ? 1 : 0;
  const int heads = l.num_kv_heads - head_begin;
  const size_t out_elems = ids.size() * l.block_tokens * heads * l.head_dim;
  std::vector<uint16_t> cpu_k(out_elems), cpu_v(out_elems), gpu_k(out_elems), gpu_v(out_elems);
  DequantizeParams dq;
  dq.layout = l;
  dq.pages = cpu_pages.data();
  dq.block_ids = ids.data();
  dq.num_out_blocks = static_cast<int>(ids.size());
  dq.head_begin = head_begin;
  dq.head_end = l.num_kv_heads;
  dq.k_out = cpu_k.data();
  dq.v_out = cpu_v.data();
  dq.num_blocks = in.num_blocks;

  DeviceBuffer dev_ids(ids.size() * 4), dev_k(out_elems * 2), dev_v(out_elems * 2);
  dev_ids.Upload(ids.data());
  pages.Upload(cpu_pages.data());
  DequantizeParams gq = dq;
  gq.pages = pages.as<uint8_t>();
  gq.block_ids = dev_ids.as<int32_t>();
  gq.k_out = dev_k.as<uint16_t>();
  gq.v_out = dev_v.as<uint16_t>();
  // Both sides' outputs: elements of rows below `valid_tokens` agree within fp16 rounding
  // (unwritten rows decode the same poison bytes on both sides, so every such element is compared),
  // and every element from there on is zero bits.
  auto compare = [&](int64_t valid_tokens) {
    dq.valid_tokens = gq.valid_tokens = valid_tokens;
    ASSERT_EQ(cpu::Dequantize(dq), KernelStatus::kOk);
    ASSERT_EQ(cuda::Dequantize(gq, nullptr), KernelStatus::kOk) << cuda::LastErrorMessage();
    dev_k.Download(gpu_k.data());
    dev_v.Download(gpu_v.data());
    const size_t valid_elems =
        std::min<size_t>(valid_tokens, ids.size() * l.block_tokens) * heads * l.head_dim;
    for (size_t i = 0; i < out_elems; ++i) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint16_t a = (kv == 0 ? cpu_k : cpu_v)[i];
        const uint16_t b = (kv == 0 ? gpu_k : gpu_v)[i];
        if (i >= valid_elems) {
          ASSERT_TRUE(a == 0 && b == 0) << "element " << i << " past valid_tokens " << valid_tokens;
          continue;
        }
        ASSERT_LE(std::fabs(HalfToFloat(a) - HalfToFloat(b)),
                  2e-3f * std::fabs(HalfToFloat(a)) + 1e-3f)
            << "dequantized element " << i << ": cpu " << HalfToFloat(a) << " gpu "
            << HalfToFloat(b);
      }
    }
  };
  compare(static_cast<int64_t>(ids.size()) * l.block_tokens - l.block_tokens / 2 - 1);
  compare(INT64_MAX);
  // Out block 0 read as a sequence's first block: its sink rows are its sink page's bytes, on
  // both sides (the GPU's sink arena equals the CPU's, checked above).
  if (l.sink_tokens > 0 && (gpu_sink_blocks < 0 || ids[0] < gpu_sink_blocks)) {
    const size_t page = static_cast<size_t>(ids[0]) * l.sink_page_bytes();
    dq.first_sink_page = cpu_sinks.data() + page;
    gq.first_sink_page = sinks.as<uint8_t>() + page;
    compare(INT64_MAX);
    for (int t = 0; t < l.sink_tokens; ++t) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = head_begin; h < l.num_kv_heads; ++h) {
          const size_t at = (static_cast<size_t>(t) * heads + (h - head_begin)) * l.head_dim;
          const uint8_t* want = cpu_sinks.data() + page + l.sink_offset(kv, h, t);
          for (const std::vector<uint16_t>* out :
               {kv == 0 ? &cpu_k : &cpu_v, kv == 0 ? &gpu_k : &gpu_v}) {
            ASSERT_EQ(std::memcmp(out->data() + at, want, l.head_dim * 2), 0)
                << "sink row " << t << " kv " << kv << " head " << h;
          }
        }
      }
    }
    dq.first_sink_page = gq.first_sink_page = nullptr;
  }

  // Round trip of the GPU's own pages: the relative L2 error of the written K rows is that of
  // the CPU round trip (codes differ only at rare ties).
  pages.Upload(gpu_pages.data());
  ASSERT_EQ(cuda::Dequantize(gq, nullptr), KernelStatus::kOk) << cuda::LastErrorMessage();
  dev_k.Download(gpu_k.data());
  const size_t row_elems = static_cast<size_t>(heads) * l.head_dim;
  auto rel_error = [&](const std::vector<uint16_t>& out) {
    double err = 0, norm = 0;
    for (size_t r = 0; r < ids.size() * l.block_tokens; ++r) {
      const int64_t slot = ids[r / l.block_tokens] * l.block_tokens + r % l.block_tokens;
      const auto it = std::find(in.slots.begin(), in.slots.end(), slot);
      if (it == in.slots.end()) continue;
      const size_t t = it - in.slots.begin();
      for (size_t e = 0; e < row_elems; ++e) {
        const double x = HalfToFloat(in.k[(t * l.num_kv_heads + head_begin) * l.head_dim + e]);
        const double y = HalfToFloat(out[r * row_elems + e]);
        err += (x - y) * (x - y);
        norm += x * x;
      }
    }
    return std::sqrt(err / norm);
  };
  const double cpu_error = rel_error(cpu_k);
  const double gpu_error = rel_error(gpu_k);
  EXPECT_LE(gpu_error, cpu_error * 1.02 + 1e-6) << "round-trip relative L2 error";
  if (l.dtype == KvDtype::kFp16) {
    EXPECT_EQ(gpu_error, 0.0);
  }
}

void CheckCase(const Case& c, uint64_t seed, CodeStats* stats) {
  CheckInputs(c, MakeInputs(c, seed), stats);
}

TEST(QuantizeGpu, MatchesCpuReferenceOverDtypeRotHeadDimBlockTokens) {
  KVPOOL_SKIP_WITHOUT_GPU();
  uint64_t seed = 1;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3, KvDtype::kFp16}) {
    CodeStats stats;
    for (int rot : {0, 16, 32, 64, 128}) {
      for (int head_dim : {64, 128, 256}) {
        if (rot > head_dim) continue;
        for (int block_tokens : {16, 32, 64}) {
          CheckCase(Case{dtype, rot, head_dim, block_tokens}, seed++, &stats);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
    if (dtype != KvDtype::kFp16) ExpectFewTies(stats, "all cases");
  }
}

TEST(QuantizeGpu, WritesNoSinkPagePastTheSinkBlocks) {
  KVPOOL_SKIP_WITHOUT_GPU();
  CodeStats stats;
  const Case c{KvDtype::kInt4,     128, 128, 16, 0, /*sink_tokens=*/4, /*num_kv_heads=*/8,
               /*num_tokens=*/1023};
  const Inputs in = MakeInputs(c, 77);
  CheckInputs(c, in, &stats, /*gpu_sink_blocks=*/in.num_blocks / 2);
}

TEST(QuantizeGpu, MatchesCpuReferenceWithGroupsSinksAndManyTokens) {
  KVPOOL_SKIP_WITHOUT_GPU();
  CodeStats stats;
  uint64_t seed = 1000;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3, KvDtype::kFp16}) {
    for (int group : {8, 32, 64}) {
      Case c{dtype,
             64,
             128,
             16,
             group,
             /*sink_tokens=*/4,
             /*num_kv_heads=*/8,
             /*num_tokens=*/1023};
      CheckCase(c, seed++, &stats);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  ExpectFewTies(stats, "groups and sinks");
}

// Groups at every head_dim: 16 channels (its own branch), groups spanning several lanes (head_dim
// / 2), with every rotation block from none to 128.
TEST(QuantizeGpu, MatchesCpuReferenceWithGroupsAtEveryHeadDimAndRotation) {
  KVPOOL_SKIP_WITHOUT_GPU();
  CodeStats stats;
  uint64_t seed = 1100;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3}) {
    for (int head_dim : {64, 128, 256}) {
      for (int group : {16, 32, head_dim / 2}) {
        for (int rot : {0, 16, 32, 128}) {
          if (rot > head_dim) continue;
          CheckCase(Case{dtype, rot, head_dim, 16, group, 0, 4, 257}, seed++, &stats);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
  ExpectFewTies(stats, "groups at every head_dim");
}

// The kernel gives each lane group up to 4 items one after the other, fewer when the grid would
// not fill two blocks per SM (a decode step's append): token counts whose 8 KV heads take 1, 1,
// 2, 3 and 4 items per lane group on the H200's 132 SMs.
TEST(QuantizeGpu, MatchesCpuReferenceFromOneTokenToRoundsOfManyItems) {
  KVPOOL_SKIP_WITHOUT_GPU();
  CodeStats stats;
  uint64_t seed = 2000;
  for (int tokens : {1, 32, 2500, 4500, 9001}) {
    for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kFp16}) {
      Case c{dtype, dtype == KvDtype::kFp16 ? 0 : 128, 128, 16};
      c.num_kv_heads = 8;
      c.num_tokens = tokens;
      SCOPED_TRACE(::testing::Message() << tokens << " tokens");
      CheckCase(c, seed++, &stats);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  ExpectFewTies(stats, "one token to many rounds");
}

// Rows that take the encoder's rare paths. A row whose rotated values sit far from zero with a
// spread of a few fp16 steps of its minimum per code step rounds its fp16 zero by up to a large
// part of a code step, which puts q below 128 (the clamp); a row of zeros (or, unrotated, of one
// repeated value) has scale 0 (every code 0); rows of -0 and +0 in varying orders store a zero
// point of +0, whatever order the kernels' min reduction takes them in. The far rows are built in
// the rotated domain and mapped back through the inverse rotation, so that the kernels' rotation
// lands on them; their spread keeps one fp16 step of the zero below a code step, so that where the
// kernels' fp32 rotation and the reference's double one round the zero apart, codes still differ by
// at most one. Besides matching the CPU reference, a rotated case must actually need the clamp:
// some rows' zero lies more than 1/8 of a step above their minimum (the kernels clamp from there).
// Unrotated rows never do (their minimum is an fp16 value, so the zero is exact): those cases
// check the rows of scale 0.
TEST(QuantizeGpu, MatchesCpuReferenceOnClampedAndConstantRows) {
  KVPOOL_SKIP_WITHOUT_GPU();
  CodeStats stats;
  uint64_t seed = 3000;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8}) {
    for (int rot : {0, 16, 128}) {
      Case c{dtype, rot, 128, 16};
      c.num_kv_heads = 8;
      c.num_tokens = 300;
      Inputs in = MakeInputs(c, seed++);
      const PageLayout& l = in.layout;
      const float levels = dtype == KvDtype::kInt4 ? 15.0f : 255.0f;
      std::mt19937_64 rng(seed);
      std::uniform_real_distribution<double> unit(-1.0, 1.0);
      const BlockHadamard rotation(l.head_dim, rot > 0 ? rot : l.head_dim, l.sign_seed);
      int clamped_rows = 0;
      std::vector<double> y(l.head_dim);
      for (size_t row = 0; row < in.k.size() / l.head_dim; ++row) {
        std::vector<uint16_t>& kv = row % 2 == 0 ? in.k : in.v;
        uint16_t* x = kv.data() + row * l.head_dim;
        switch (row % 5) {
          case 0:
          case 1: {
            // The minimum's magnitude 300-480 (fp16 steps of 0.25; up to 0.5 for negative rows),
            // the spread 2-4 of those steps per code step.
            const double spread = levels * 0.25 * (2.0 + 2.0 * std::abs(unit(rng)));
            const double magnitude = 300.0 + 180.0 * std::abs(unit(rng));
            const double low = unit(rng) < 0 ? -magnitude - spread : magnitude;
            for (double& v : y) v = low + spread * (0.5 + 0.5 * unit(rng));
            if (rot > 0) rotation.Inverse(y.data());
            for (int i = 0; i < l.head_dim; ++i) x[i] = FloatToHalf(static_cast<float>(y[i]));
            break;
          }
          case 2:  // zeros; unrotated, one repeated value
            std::fill(x, x + l.head_dim, rot > 0 ? uint16_t{0} : FloatToHalf(-3.25f));
            break;
          case 3:  // zeros of both signs in an order that varies by row, then ones in half the rows
            for (int i = 0; i < l.head_dim; ++i) {
              x[i] = (i * 7 + row) % 3 == 0 ? uint16_t{0x8000} : uint16_t{0};
              if (row % 2 == 0 && i >= l.head_dim / 2) x[i] = FloatToHalf(1.0f);
            }
            break;
          default:
            break;
        }
        // The rotated row as the reference computes it, and whether its zero needs the clamp.
        for (int i = 0; i < l.head_dim; ++i) y[i] = HalfToFloat(x[i]);
        if (rot > 0) rotation.Forward(y.data());
        float mn = static_cast<float>(y[0]), mx = mn;
        for (double v : y) {
          mn = std::min(mn, static_cast<float>(v));
          mx = std::max(mx, static_cast<float>(v));
        }
        const float scale = HalfToFloat(cpu::ScaleBits((mx - mn) / levels, FloatToHalf));
        const float zero = HalfToFloat(FloatToHalf(mn));
        clamped_rows += scale > 0.0f && zero - mn > 0.125f * scale;
      }
      SCOPED_TRACE(::testing::Message() << clamped_rows << " rows need the clamp");
      if (rot > 0) {
        EXPECT_GT(clamped_rows, 0) << "the rows do not exercise the clamp";
      }
      CheckInputs(c, in, &stats);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  ExpectFewTies(stats, "clamped and constant rows");
}

// Rows of tiny values, whose group scales fall below fp16's smallest normal (rounded up there,
// ScaleBits): the same bytes as the CPU reference, unrotated (rotated rows would differ in the
// last bit of the scale's input, fp32 against double, a whole step of a scale of a few steps).
TEST(QuantizeGpu, MatchesCpuReferenceOnRowsWithSubnormalScales) {
  KVPOOL_SKIP_WITHOUT_GPU();
  CodeStats stats;
  uint64_t seed = 3100;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3}) {
    for (int group : {16, 128}) {
      for (float factor : {3e-6f, 1.2e-5f, 4e-5f, 1e-4f}) {
        Case c{dtype, 0, 128, 16, group};
        Inputs in = MakeInputs(c, seed++);
        for (std::vector<uint16_t>* kv : {&in.k, &in.v}) {  // values of order 1, scaled down
          for (uint16_t& x : *kv) x = FloatToHalf(HalfToFloat(x) * factor / 8.0f);
        }
        SCOPED_TRACE(::testing::Message() << "factor " << factor);
        CheckInputs(c, in, &stats);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  EXPECT_EQ(stats.off_by_one, 0u) << "unrotated codes are bit-exact";
}

TEST(QuantizeGpu, RejectsBadArgumentsAndUnsupportedSizes) {
  KVPOOL_SKIP_WITHOUT_GPU();
  const Inputs in = MakeInputs(Case{KvDtype::kInt4, 128, 128, 16}, 7);
  DeviceBuffer pages(in.num_blocks * in.layout.layer_page_bytes()), k(in.k.size() * 2),
      slots(in.slots.size() * 8);
  QuantizeAppendParams p;
  p.layout = in.layout;
  p.k = k.as<uint16_t>();
  p.v = k.as<uint16_t>();
  p.slot_mapping = slots.as<int64_t>();
  p.num_tokens = 4;
  p.pages = pages.as<uint8_t>();
  p.num_blocks = in.num_blocks;

  QuantizeAppendParams bad = p;
  bad.pages = nullptr;
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kInvalidArgument);
  bad = p;
  bad.layout.rot_block = 48;
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kInvalidArgument);
  bad = p;
  bad.layout.sink_tokens = 2;  // sinks need positions and a sink arena
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kInvalidArgument);
  bad = p;
  bad.layout.head_dim = 96;
  bad.layout.group_size = 96;
  bad.layout.rot_block = 32;
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kUnsupported);
  bad = p;
  bad.layout.group_size = 4;
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kUnsupported);
  bad = p;
  bad.layout.block_tokens = 8;
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kUnsupported);
  bad = p;
  bad.num_tokens = 0;
  EXPECT_EQ(cuda::QuantizeAppend(bad, nullptr), KernelStatus::kOk);
  // Layers of one launch: 1 to kMaxQuantizeLayers of them, 16-byte strides, a seed each.
  const uint64_t seeds[cuda::kMaxQuantizeLayers + 1] = {};
  EXPECT_EQ(cuda::QuantizeAppendLayers(p, 0, {}, seeds, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeAppendLayers(p, cuda::kMaxQuantizeLayers + 1, {}, seeds, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeAppendLayers(p, 2, {8, 0, 0}, seeds, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeAppendLayers(p, 2, {0, 8, 0}, seeds, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeAppendLayers(p, 2, {}, nullptr, nullptr), KernelStatus::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
