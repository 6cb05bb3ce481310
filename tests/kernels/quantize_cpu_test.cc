#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/page_codec.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool {
namespace {

using testing::MakeLayout;

constexpr uint8_t kPoison = 0xA5;

// One layer's pages filled with kPoison, and the params to append `k`/`v` at `slots`.
struct Appender {
  Appender(const PageLayout& layout, int64_t num_blocks)
      : pages(num_blocks * layout.layer_page_bytes(), kPoison),
        sink_pages(num_blocks * layout.sink_page_bytes(), kPoison) {
    params.layout = layout;
    params.num_blocks = num_blocks;
    params.num_sink_blocks = layout.sink_tokens > 0 ? num_blocks : 0;
    params.pages = pages.data();
    params.sink_pages = layout.sink_tokens > 0 ? sink_pages.data() : nullptr;
  }
  KernelStatus Append(const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                      const std::vector<int64_t>& slots, const std::vector<int32_t>& positions) {
    params.k = k.data();
    params.v = v.data();
    params.slot_mapping = slots.data();
    params.positions = positions.empty() ? nullptr : positions.data();
    params.num_tokens = static_cast<int>(slots.size());
    return cpu::QuantizeAppend(params);
  }
  // Dequantize of blocks `ids` (which must outlive the params), heads [0, head_end), into
  // k_out / v_out.
  DequantizeParams Reader(const std::vector<int32_t>& ids, int head_end, uint16_t* k_out,
                          uint16_t* v_out) const {
    DequantizeParams dp;
    dp.layout = params.layout;
    dp.pages = pages.data();
    dp.block_ids = ids.data();
    dp.num_out_blocks = static_cast<int>(ids.size());
    dp.head_begin = 0;
    dp.head_end = head_end;
    dp.k_out = k_out;
    dp.v_out = v_out;
    dp.num_blocks = params.num_blocks;
    return dp;
  }
  std::vector<uint8_t> pages;
  std::vector<uint8_t> sink_pages;
  QuantizeAppendParams params;
};

// (dtype, rot_block, group_size)
class QuantizeCpuTest : public ::testing::TestWithParam<std::tuple<KvDtype, int, int>> {};

// Every element decoded in the rotated space lies within the quantization step of the exact
// rotated input: scale/2 for INT (plus fp16 rounding of scale and zero), half an e4m3 ulp for FP8.
// Every appended row of `a` decodes, in the rotated space, within the quantization step of the
// exact rotated input (see below).
void ExpectDecodedWithinStep(const PageLayout& l, const Appender& a, const std::vector<uint16_t>& k,
                             const std::vector<uint16_t>& v, const std::vector<int64_t>& slots) {
  const int group = l.group_size;
  const BlockHadamard rotation(l.head_dim, l.rot_block > 0 ? l.rot_block : 16, l.sign_seed);
  const double levels = l.dtype == KvDtype::kInt4 ? 15 : 255;
  std::vector<double> x(l.head_dim);
  std::vector<float> decoded(l.head_dim);
  for (size_t t = 0; t < slots.size(); ++t) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < l.num_kv_heads; ++h) {
        const uint16_t* src = (kv ? v : k).data() + (t * l.num_kv_heads + h) * l.head_dim;
        for (int c = 0; c < l.head_dim; ++c) x[c] = HalfToFloat(src[c]);
        if (l.rot_block > 0) rotation.Forward(x.data());
        const uint8_t* page = cpu::HeadPage(l, a.pages.data(), slots[t] / l.block_tokens, kv, h);
        const int off = static_cast<int>(slots[t] % l.block_tokens);
        cpu::DecodeRow(l, page, off, decoded.data());
        for (int c = 0; c < l.head_dim; ++c) {
          const cpu::GroupMeta m = cpu::ReadGroupMeta(l, page, off, c / group);
          double bound;
          if (l.dtype == KvDtype::kFp8E4M3) {
            EXPECT_EQ(m.zero, 0.0f);
            bound = std::fabs(x[c]) * (1.0 / 16 + 1.0 / 1024) + m.scale / 1024.0;
          } else {
            bound = m.scale / 2 + (levels * m.scale + std::fabs(m.zero) + std::fabs(x[c])) / 1024;
          }
          ASSERT_LE(std::fabs(decoded[c] - x[c]), bound + 1e-6)
              << "t " << t << " kv " << kv << " h " << h << " c " << c;
        }
      }
    }
  }
}

TEST_P(QuantizeCpuTest, DecodedRowsStayWithinTheQuantizationStep) {
  const auto [dtype, rot, group] = GetParam();
  const PageLayout l = MakeLayout(dtype, rot, group);
  const int tokens = 37;
  const int64_t num_blocks = 4;
  const testing::KvData d =
      testing::MakeKv(tokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 11);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  std::vector<int64_t> slots(tokens);
  for (int t = 0; t < tokens; ++t) slots[t] = (t * 5) % (num_blocks * l.block_tokens);
  Appender a(l, num_blocks);
  ASSERT_EQ(a.Append(k, v, slots, {}), KernelStatus::kOk);
  ExpectDecodedWithinStep(l, a, k, v, slots);
  if (::testing::Test::HasFatalFailure()) return;

  // Dequantize agrees with the exact decode up to fp16 rounding.
  std::vector<int32_t> ids(num_blocks);
  for (int b = 0; b < num_blocks; ++b) ids[b] = static_cast<int32_t>(num_blocks - 1 - b);
  const size_t out_elems = num_blocks * l.block_tokens * l.num_kv_heads * l.head_dim;
  std::vector<uint16_t> k_out(out_elems), v_out(out_elems);
  ASSERT_EQ(cpu::Dequantize(a.Reader(ids, l.num_kv_heads, k_out.data(), v_out.data())),
            KernelStatus::kOk);
  for (int t = 0; t < tokens; ++t) {
    const int block = static_cast<int>(slots[t] / l.block_tokens);
    const int off = static_cast<int>(slots[t] % l.block_tokens);
    const size_t out_token = static_cast<size_t>(num_blocks - 1 - block) * l.block_tokens + off;
    for (int h = 0; h < l.num_kv_heads; ++h) {
      const std::vector<double> exact =
          testing::DecodeOriginal(l, a.pages.data(), block, 1, h, off);
      for (int c = 0; c < l.head_dim; ++c) {
        const double got = HalfToFloat(v_out[(out_token * l.num_kv_heads + h) * l.head_dim + c]);
        ASSERT_NEAR(got, exact[c], std::fabs(exact[c]) / 1024 + 1e-7) << t << " " << h << " " << c;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DtypesRotationsGroups, QuantizeCpuTest,
    ::testing::Combine(::testing::Values(KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3),
                       ::testing::Values(0, 16, 64, 128), ::testing::Values(32, 128)),
    [](const auto& info) {
      return std::string(testing::DtypeName(std::get<0>(info.param))) + "_rot" +
             std::to_string(std::get<1>(info.param)) + "_g" +
             std::to_string(std::get<2>(info.param));
    });

// The largest |decoded - input| of a one-token append of `row` (as K and V, every head) read back
// through Dequantize, over the row's largest magnitude.
double RoundTripError(const PageLayout& l, const std::vector<uint16_t>& row) {
  std::vector<uint16_t> kv;
  for (int h = 0; h < l.num_kv_heads; ++h) kv.insert(kv.end(), row.begin(), row.end());
  Appender a(l, 1);
  EXPECT_EQ(a.Append(kv, kv, {0}, {}), KernelStatus::kOk);
  std::vector<uint16_t> k_out(l.block_tokens * kv.size()), v_out(k_out.size());
  const std::vector<int32_t> ids = {0};
  DequantizeParams dp = a.Reader(ids, l.num_kv_heads, k_out.data(), v_out.data());
  dp.valid_tokens = 1;
  EXPECT_EQ(cpu::Dequantize(dp), KernelStatus::kOk);
  double err = 0, amax = 0;
  for (size_t i = 0; i < kv.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(HalfToFloat(k_out[i])) - HalfToFloat(kv[i])));
    amax = std::max(amax, std::fabs(static_cast<double>(HalfToFloat(kv[i]))));
  }
  return err / amax;
}

// A group's scale below fp16's smallest normal is rounded up, never down nor to 0: rows whose
// values are all small (a layer whose V spans 1e-5) keep the error, relative to themselves, of
// rows of ordinary magnitude. Rounded to nearest, an INT8 row of +-1e-5 decoded 0.48 of its
// magnitude off, and FP8 rows of +-1.2e-5 decoded as zeros.
TEST(QuantizeCpu, RowsOfTinyValuesKeepTheirRelativeError) {
  for (const KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3}) {
    for (const int rot : {0, 128}) {
      for (const int group : {16, 128}) {
        const PageLayout l = MakeLayout(dtype, rot, group);
        auto row_of = [&l](double amax) {  // one draw of uniform [-amax, amax) per channel
          std::mt19937 rng(7);
          std::uniform_real_distribution<double> u(-1.0, 1.0);
          std::vector<uint16_t> row(l.head_dim);
          for (uint16_t& x : row) x = FloatToHalf(static_cast<float>(amax * u(rng)));
          return row;
        };
        const double ordinary = RoundTripError(l, row_of(1.0));
        for (const double amax : {3e-6, 1.2e-5, 3.98e-5, 1e-4, 1e-3}) {
          // Twice the ordinary error, plus four fp16 subnormal steps (2^-24): the granularity of
          // a subnormal scale (its half step) and zero, and the input's and output's rounding.
          EXPECT_LE(RoundTripError(l, row_of(amax)), 2 * ordinary + 4 * 0x1p-24 / amax)
              << testing::DtypeName(dtype) << " rot " << rot << " group " << group << " amax "
              << amax << " (ordinary rows: " << ordinary << ")";
        }
      }
    }
  }
}

// Rows at the layout's input bound (MaxInputHalfBits), alone in their row or against its
// negative, read back finite through Dequantize in every quantized format, rotated or not (an
// unrotated 65504 once decoded to 65520 through the scale's rounding: infinite in fp16).
TEST(QuantizeCpu, RowsAtTheInputBoundReadBackFinite) {
  for (const KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3}) {
    for (const int rot : {0, 16, 128}) {
      const PageLayout l = MakeLayout(dtype, rot, 128, /*num_kv_heads=*/1);
      const uint16_t bound = MaxInputHalfBits(l);
      const size_t row = l.head_dim;
      std::vector<uint16_t> k(4 * row, 0), v(4 * row, 0);  // tokens: +b / -b / +b,-b / -b,+b
      for (std::vector<uint16_t>* x : {&k, &v}) {
        (*x)[0] = bound;
        (*x)[row] = bound | 0x8000;
        (*x)[2 * row] = bound;
        (*x)[2 * row + 7] = bound | 0x8000;
        (*x)[3 * row] = bound | 0x8000;
        (*x)[3 * row + 7] = bound;
      }
      Appender a(l, 1);
      ASSERT_EQ(a.Append(k, v, {0, 1, 2, 3}, {}), KernelStatus::kOk);
      std::vector<uint16_t> k_out(l.block_tokens * row), v_out(l.block_tokens * row);
      ASSERT_EQ(cpu::Dequantize(a.Reader({0}, 1, k_out.data(), v_out.data())), KernelStatus::kOk);
      for (size_t i = 0; i < 4 * row; ++i) {
        ASSERT_LT(k_out[i] & 0x7FFF, 0x7C00)
            << testing::DtypeName(dtype) << " rot " << rot << " K " << i;
        ASSERT_LT(v_out[i] & 0x7FFF, 0x7C00)
            << testing::DtypeName(dtype) << " rot " << rot << " V " << i;
      }
    }
  }
}

// Rotated rows far from zero with a spread of under one fp16 step of their minimum per code step
// round their fp16 zero by up to more than a code step, so that q of their minimum falls below
// 127.5: the clamp must give code 0 there (not a wrapped code), which the decode bound checks.
// Built in the rotated domain and mapped back through the inverse rotation; some rows must
// actually need the clamp.
TEST(QuantizeCpu, RowsThatNeedTheClampDecodeWithinTheStep) {
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8}) {
    for (int rot : {16, 128}) {
      const PageLayout l = MakeLayout(dtype, rot, 128);
      const BlockHadamard rotation(l.head_dim, rot, l.sign_seed);
      const double levels = dtype == KvDtype::kInt4 ? 15 : 255;
      const int tokens = 64;
      std::mt19937_64 rng(rot * 7 + static_cast<int>(dtype));
      std::uniform_real_distribution<double> unit(-1.0, 1.0);
      std::vector<uint16_t> k(static_cast<size_t>(tokens) * l.num_kv_heads * l.head_dim), v;
      std::vector<double> y(l.head_dim);
      int clamped_rows = 0;
      for (size_t row = 0; row < k.size() / l.head_dim; ++row) {
        const double spread = levels * 0.25 * (0.3 + 0.7 * std::abs(unit(rng)));
        const double magnitude = 300.0 + 180.0 * std::abs(unit(rng));
        const double low = unit(rng) < 0 ? -magnitude - spread : magnitude;
        for (double& x : y) x = low + spread * (0.5 + 0.5 * unit(rng));
        rotation.Inverse(y.data());
        for (int c = 0; c < l.head_dim; ++c) {
          k[row * l.head_dim + c] = FloatToHalf(static_cast<float>(y[c]));
          y[c] = HalfToFloat(k[row * l.head_dim + c]);
        }
        rotation.Forward(y.data());
        const float mn = static_cast<float>(*std::min_element(y.begin(), y.end()));
        const float mx = static_cast<float>(*std::max_element(y.begin(), y.end()));
        const float scale = HalfToFloat(FloatToHalf((mx - mn) / static_cast<float>(levels)));
        clamped_rows += HalfToFloat(FloatToHalf(mn)) - mn > 0.5f * scale;
      }
      v = k;
      SCOPED_TRACE(::testing::Message() << testing::DtypeName(dtype) << " rot " << rot << ": "
                                        << clamped_rows << " rows need the clamp");
      EXPECT_GT(clamped_rows, 0);
      std::vector<int64_t> slots(tokens);
      for (int t = 0; t < tokens; ++t) slots[t] = t;
      Appender a(l, tokens / l.block_tokens + 1);
      ASSERT_EQ(a.Append(k, v, slots, {}), KernelStatus::kOk);
      ExpectDecodedWithinStep(l, a, k, v, slots);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(QuantizeCpu, PacksEvenChannelInLowNibble) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 0, 16, 1, 32);
  // Each group holds a permutation of 0..15: scale 1, zero 0, code = value.
  std::vector<float> x(l.head_dim);
  for (int c = 0; c < l.head_dim; ++c) x[c] = static_cast<float>((c * 7 + c / 16) % 16);
  const std::vector<uint16_t> k = testing::ToHalf(x), v = k;
  Appender a(l, 1);
  ASSERT_EQ(a.Append(k, v, {3}, {}), KernelStatus::kOk);
  const uint8_t* page = cpu::HeadPage(l, a.pages.data(), 0, 0, 0);
  const uint8_t* row = page + 3 * l.code_bytes_per_token();
  for (int j = 0; j < l.head_dim / 2; ++j) {
    EXPECT_EQ(row[j], static_cast<int>(x[2 * j]) | (static_cast<int>(x[2 * j + 1]) << 4)) << j;
  }
  for (int g = 0; g < 2; ++g) {
    const cpu::GroupMeta m = cpu::ReadGroupMeta(l, page, 3, g);
    EXPECT_EQ(m.scale, 1.0f);
    EXPECT_EQ(m.zero, 0.0f);
  }
}

TEST(QuantizeCpu, ConstantGroupStoresScaleZeroAndReproducesExactly) {
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8}) {
    const PageLayout l = MakeLayout(dtype, 0, 16, 1, 32);
    std::vector<float> x(l.head_dim, -3.25f);
    for (int c = 16; c < 32; ++c) x[c] = 1.5f + static_cast<float>(c);  // a varying group
    const std::vector<uint16_t> k = testing::ToHalf(x);
    Appender a(l, 1);
    ASSERT_EQ(a.Append(k, k, {0}, {}), KernelStatus::kOk);
    const uint8_t* page = cpu::HeadPage(l, a.pages.data(), 0, 0, 0);
    EXPECT_EQ(cpu::ReadGroupMeta(l, page, 0, 0).scale, 0.0f);
    EXPECT_GT(cpu::ReadGroupMeta(l, page, 0, 1).scale, 0.0f);
    std::vector<float> decoded(l.head_dim);
    cpu::DecodeRow(l, page, 0, decoded.data());
    for (int c = 0; c < 16; ++c) EXPECT_EQ(decoded[c], -3.25f) << c;
  }
}

// A group whose minimum is a zero stores +0 as its zero point whichever of -0 and +0 comes first,
// so that the stored meta does not depend on the order of a reduction (the GPU's differs).
TEST(QuantizeCpu, ASignedZeroMinimumIsStoredAsPositiveZero) {
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8}) {
    const PageLayout l = MakeLayout(dtype, 0, 16, 1, 32);
    std::vector<uint16_t> k(l.head_dim, 0x0000);
    k[0] = 0x8000;                                // group 0: -0 first, then +0s (a constant group)
    k[16] = 0x8000;                               // group 1: -0 first, then values above it
    for (int c = 18; c < 32; ++c) k[c] = 0x3c00;  // 1.0
    Appender a(l, 1);
    ASSERT_EQ(a.Append(k, k, {0}, {}), KernelStatus::kOk);
    const uint8_t* meta = cpu::HeadPage(l, a.pages.data(), 0, 0, 0) + l.codes_bytes();
    for (int g = 0; g < 2; ++g) {
      uint16_t scale = 0, zero = 0;
      std::memcpy(&scale, meta + 4 * g, 2);
      std::memcpy(&zero, meta + 4 * g + 2, 2);
      EXPECT_EQ(zero, 0x0000) << "group " << g;
      EXPECT_EQ(scale == 0, g == 0) << "group " << g;
    }
  }
}

TEST(QuantizeCpu, Fp16PagesHoldTheInputBits) {
  const PageLayout l = MakeLayout(KvDtype::kFp16, 0, 0);
  const testing::KvData d =
      testing::MakeKv(3, l.num_kv_heads, l.head_dim, testing::Outliers::kSpikes, 5);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  Appender a(l, 1);
  ASSERT_EQ(a.Append(k, v, {2, 0, 1}, {}), KernelStatus::kOk);
  const uint8_t* page = cpu::HeadPage(l, a.pages.data(), 0, 1, 1);
  EXPECT_EQ(std::memcmp(page + 2 * l.code_bytes_per_token(), &v[1 * l.head_dim], l.head_dim * 2),
            0);
}

TEST(QuantizeCpu, NegativeSlotIsSkippedAndLeavesEveryByteUntouched) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 64, 64);
  const testing::KvData d =
      testing::MakeKv(6, l.num_kv_heads, l.head_dim, testing::Outliers::kRope, 9);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  Appender with_skip(l, 2);
  ASSERT_EQ(with_skip.Append(k, v, {0, 1, -1, 3, -7, 17}, {}), KernelStatus::kOk);
  // The same tokens without the skipped ones give the very same pages.
  const auto pick = [&](const std::vector<uint16_t>& x, std::vector<int> tokens) {
    std::vector<uint16_t> out;
    const size_t n = static_cast<size_t>(l.num_kv_heads) * l.head_dim;
    for (int t : tokens) out.insert(out.end(), x.begin() + t * n, x.begin() + (t + 1) * n);
    return out;
  };
  Appender without(l, 2);
  ASSERT_EQ(without.Append(pick(k, {0, 1, 3, 5}), pick(v, {0, 1, 3, 5}), {0, 1, 3, 17}, {}),
            KernelStatus::kOk);
  EXPECT_EQ(with_skip.pages, without.pages);
  // Slot 2's codes and meta still hold the poison.
  const uint8_t* page = cpu::HeadPage(l, with_skip.pages.data(), 0, 1, 1);
  for (size_t i = 0; i < l.code_bytes_per_token(); ++i) {
    EXPECT_EQ(page[2 * l.code_bytes_per_token() + i], kPoison);
  }
  for (size_t i = 0; i < l.meta_bytes_per_token(); ++i) {
    EXPECT_EQ(page[l.codes_bytes() + 2 * l.meta_bytes_per_token() + i], kPoison);
  }
}

TEST(QuantizeCpu, OutOfRangeSlotIsRejectedBeforeAnyWrite) {
  const PageLayout l = MakeLayout(KvDtype::kInt4, 128, 128);
  const testing::KvData d =
      testing::MakeKv(3, l.num_kv_heads, l.head_dim, testing::Outliers::kVariance, 3);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  Appender a(l, 2);
  const std::vector<uint8_t> before = a.pages;
  EXPECT_EQ(a.Append(k, v, {0, 1, 2 * l.block_tokens}, {}), KernelStatus::kInvalidArgument);
  EXPECT_EQ(a.pages, before);
  PageLayout bad = l;
  bad.rot_block = 24;
  Appender b(bad, 2);
  EXPECT_EQ(b.Append(k, v, {0, 1, 2}, {}), KernelStatus::kInvalidArgument);
}

TEST(QuantizeCpu, SinkTokensAreAlsoKeptInFp16InTheirBlocksSinkPage) {
  const int sinks = 4;
  const PageLayout l = MakeLayout(KvDtype::kInt4, 128, 128, 2, 128, 16, sinks);
  const int tokens = 20;
  const testing::KvData d =
      testing::MakeKv(tokens, l.num_kv_heads, l.head_dim, testing::Outliers::kOffset, 21);
  const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
  // The sequence lives in blocks 2 then 0: positions t, slot of block 2 for t < 16.
  std::vector<int64_t> slots(tokens);
  std::vector<int32_t> positions(tokens);
  for (int t = 0; t < tokens; ++t) {
    positions[t] = t;
    slots[t] = t < 16 ? 2 * 16 + t : t - 16;
  }
  Appender a(l, 3);
  ASSERT_EQ(a.Append(k, v, slots, positions), KernelStatus::kOk);
  const size_t row_bytes = l.head_dim * 2;
  for (int kv = 0; kv < 2; ++kv) {
    for (int h = 0; h < l.num_kv_heads; ++h) {
      for (int t = 0; t < sinks; ++t) {
        const uint8_t* got =
            a.sink_pages.data() + 2 * l.sink_page_bytes() + l.sink_offset(kv, h, t);
        const uint16_t* want = (kv ? v : k).data() + (t * l.num_kv_heads + h) * l.head_dim;
        EXPECT_EQ(std::memcmp(got, want, row_bytes), 0) << kv << " " << h << " " << t;
      }
    }
  }
  // The other blocks' sink pages were not touched.
  for (int b : {0, 1}) {
    for (size_t i = 0; i < l.sink_page_bytes(); ++i) {
      ASSERT_EQ(a.sink_pages[b * l.sink_page_bytes() + i], kPoison);
    }
  }
  // With sink pages for blocks 0 and 1 only, block 2 cannot hold the sinks: refused before any
  // write. Tokens past the sinks may go anywhere.
  Appender few(l, 3);
  few.params.num_sink_blocks = 2;
  EXPECT_EQ(few.Append(k, v, slots, positions), KernelStatus::kInvalidArgument);
  EXPECT_TRUE(
      std::all_of(few.pages.begin(), few.pages.end(), [](uint8_t x) { return x == kPoison; }));
  const std::vector<int64_t> rest(slots.begin() + sinks, slots.end());
  const std::vector<int32_t> rest_positions(positions.begin() + sinks, positions.end());
  const std::vector<uint16_t> rest_k(k.begin() + sinks * l.num_kv_heads * l.head_dim, k.end());
  EXPECT_EQ(few.Append(rest_k, rest_k, rest, rest_positions), KernelStatus::kOk);
}

}  // namespace
}  // namespace kvpool
