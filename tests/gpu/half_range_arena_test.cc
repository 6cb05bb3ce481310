// The CUDA backend's CheckHalfRangeArena (the range screen of an NcclPut round's K and V in device
// memory, one launch for every check) against the CPU backend's on the same values: the first
// check in order that holds NaN, Inf or a magnitude past its bound, and that element's index.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/page_layout.h"
#include "service/store/compute_backend.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/transfer_test_util.h"

namespace kvpool {
namespace {

using namespace transfer_test;  // NOLINT: the CUDA backend helpers of transfer_test_util.h

// The first NaN or Inf, and with a rotation's bound (MaxInputHalfBits at rot_block 128, 5788) the
// first value past it, are the CPU backend's.
TEST(CudaTransferBackend, CheckHalfRangeArenaFindsTheFirstBadValueLikeTheCpuBackend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  // Odd length, several grid strides, outlier channels; checked from an aligned and from an
  // unaligned start (the scalar path).
  const testing::KvData d = testing::MakeKv(3001, 8, 128, testing::Outliers::kVariance, 44);
  std::vector<uint16_t> x = testing::ToHalf(d.k);
  x.pop_back();
  const size_t n = x.size();
  // Per case, the indices made bad (NaN, +Inf, -Inf, then -6000 and 6000: finite, past the
  // rotation's bound).
  const std::vector<std::vector<size_t>> cases = {
      {}, {n - 1}, {n / 2 + 3, 17}, {123457, 900001, 5}, {0}, {777, 2, 40000, 31, 9}};
  const uint16_t specials[5] = {0x7e00, 0x7c00, 0xfc00, 0xeddc, 0x6ddc};
  PageLayout rotated;
  rotated.num_kv_heads = 8;
  rotated.head_dim = 128;
  rotated.block_tokens = 16;
  rotated.group_size = 128;
  rotated.rot_block = 128;
  const uint16_t rotation_bound = MaxInputHalfBits(rotated);
  ASSERT_LT(rotation_bound, 0x6ddc);
  for (uint16_t bound : {kHalfMaxFiniteBits, rotation_bound}) {
    for (size_t shift : {size_t{0}, size_t{1}}) {
      for (const std::vector<size_t>& bad : cases) {
        std::vector<uint16_t> y = x;
        for (size_t i = 0; i < bad.size(); ++i) y[bad[i]] = specials[i % 5];
        uint8_t* arena = Upload(*gpu, y.data(), n * sizeof(uint16_t));
        ASSERT_NE(arena, nullptr);
        const auto* values = reinterpret_cast<const uint16_t*>(arena) + shift;
        const absl::Status got = gpu->CheckHalfRangeArena({{values, n - shift, bound, "k"}});
        const absl::Status want =
            cpu->CheckHalfRangeArena({{y.data() + shift, n - shift, bound, "k"}});
        EXPECT_EQ(got, want) << "shift " << shift << ", " << bad.size() << " bad values, bound "
                             << bound;
        gpu->FreeArena(arena);
      }
    }
  }
  EXPECT_TRUE(gpu->CheckHalfRangeArena({{nullptr, 0, kHalfMaxFiniteBits, "v"}}).ok());

  // Several checks in one call: the first check (in order) with a bad value is reported, with
  // its own name, bound and index, whatever the later checks hold.
  std::vector<uint16_t> clean = x, past_bound = x, nan_early = x;
  past_bound[4321] = 0x6ddc;  // finite, past the rotation's bound only
  nan_early[3] = 0x7e00;
  std::vector<uint8_t*> arenas;
  std::vector<ComputeBackend::HalfRangeCheck> on_gpu, on_cpu;
  const std::vector<uint16_t>* inputs[] = {&clean, &past_bound, &nan_early};
  const char* names[] = {"k", "v", "k"};
  for (int i = 0; i < 3; ++i) {
    arenas.push_back(Upload(*gpu, inputs[i]->data(), n * sizeof(uint16_t)));
    ASSERT_NE(arenas.back(), nullptr);
    on_gpu.push_back(
        {reinterpret_cast<const uint16_t*>(arenas.back()), n, rotation_bound, names[i]});
    on_cpu.push_back({inputs[i]->data(), n, rotation_bound, names[i]});
  }
  const absl::Status got = gpu->CheckHalfRangeArena(on_gpu);
  EXPECT_EQ(got, cpu->CheckHalfRangeArena(on_cpu));
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(got.message().substr(0, 7), "v holds") << got;
  EXPECT_NE(got.message().find("element 4321"), absl::string_view::npos) << got;
  on_gpu[1].max_abs_bits = kHalfMaxFiniteBits;  // 6000 within it: the NaN of the third is next
  on_cpu[1].max_abs_bits = kHalfMaxFiniteBits;
  EXPECT_EQ(gpu->CheckHalfRangeArena(on_gpu), cpu->CheckHalfRangeArena(on_cpu));
  EXPECT_FALSE(gpu->CheckHalfRangeArena(on_gpu).ok());
  for (uint8_t* a : arenas) gpu->FreeArena(a);
}

// Many checks in one call, more than a launch's 65,535 grid rows (rows then take several checks):
// short checks at random, often unaligned starts, every 97th empty, two bounds, and one over the
// whole input last; the first failing check (in order) is the CPU backend's as bad values are
// planted one by one, from late checks to early ones.
TEST(CudaTransferBackend, CheckHalfRangeArenaTakesManyChecksLikeTheCpuBackend) {
  KVPOOL_SKIP_WITHOUT_GPU();
  std::unique_ptr<ComputeBackend> gpu = GpuBackend();
  ASSERT_NE(gpu, nullptr);
  std::unique_ptr<ComputeBackend> cpu = NewCpuBackend();
  const testing::KvData d = testing::MakeKv(1024, 8, 128, testing::Outliers::kVariance, 45);
  std::vector<uint16_t> x = testing::ToHalf(d.k);
  PageLayout rotated;
  rotated.num_kv_heads = 8;
  rotated.head_dim = 128;
  rotated.block_tokens = 16;
  rotated.group_size = 128;
  rotated.rot_block = 128;
  const uint16_t bounds[2] = {kHalfMaxFiniteBits, MaxInputHalfBits(rotated)};
  constexpr size_t kChecks = 70000;
  std::mt19937_64 rng(46);
  std::vector<size_t> offsets(kChecks + 1), lengths(kChecks + 1);
  for (size_t i = 0; i < kChecks; ++i) {
    lengths[i] = i % 97 == 0 ? 0 : 1 + rng() % 40;
    offsets[i] = rng() % (x.size() - 40);
  }
  offsets[kChecks] = 0;
  lengths[kChecks] = x.size();
  // Planted in turn: +Inf as the last check's last value, then 6000 (past the rotated bound of the
  // odd checks) inside check 69999, +Inf inside check 65536 (past the grid's rows), 6000 inside
  // checks 40001 and 5 (none of them empty).
  const std::vector<std::pair<size_t, uint16_t>> planted = {
      {x.size() - 1, 0x7c00},
      {offsets[69999] + lengths[69999] / 2, 0x6ddc},
      {offsets[65536] + lengths[65536] / 2, 0x7c00},
      {offsets[40001] + lengths[40001] / 2, 0x6ddc},
      {offsets[5] + lengths[5] / 2, 0x6ddc}};
  for (size_t round = 0; round <= planted.size(); ++round) {
    if (round > 0) x[planted[round - 1].first] = planted[round - 1].second;
    uint8_t* arena = Upload(*gpu, x.data(), x.size() * sizeof(uint16_t));
    ASSERT_NE(arena, nullptr);
    std::vector<ComputeBackend::HalfRangeCheck> on_gpu, on_cpu;
    for (size_t i = 0; i <= kChecks; ++i) {
      const uint16_t bound = bounds[i % 2];
      const char* what = i % 2 ? "v" : "k";
      on_gpu.push_back(
          {reinterpret_cast<const uint16_t*>(arena) + offsets[i], lengths[i], bound, what});
      on_cpu.push_back({x.data() + offsets[i], lengths[i], bound, what});
    }
    const absl::Status want = cpu->CheckHalfRangeArena(on_cpu);
    EXPECT_EQ(gpu->CheckHalfRangeArena(on_gpu), want) << "round " << round;
    EXPECT_EQ(want.ok(), round == 0) << want;
    gpu->FreeArena(arena);
  }
}

}  // namespace
}  // namespace kvpool
