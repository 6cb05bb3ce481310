// What the CUDA quantize tests share (quantize_gpu_test, quantize_layers_gpu_test): device
// buffers, random inputs with outlier channels and scattered slots, and the byte-by-byte check of
// the CUDA kernel's pages against the CPU reference's.
#ifndef KVPOOL_TESTS_GPU_QUANTIZE_TEST_UTIL_H_
#define KVPOOL_TESTS_GPU_QUANTIZE_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/page_codec.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"

namespace kvpool::quantize_test {

inline constexpr uint8_t kPoison = 0xAB;

// Device memory for the duration of a test.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void Upload(const void* src) {
    ASSERT_EQ(cudaMemcpy(ptr_, src, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Download(void* dst) const {
    ASSERT_EQ(cudaMemcpy(dst, ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

struct Case {
  KvDtype dtype;
  int rot_block;
  int head_dim;
  int block_tokens;
  int group_size = 0;  // 0 = head_dim
  int sink_tokens = 0;
  int num_kv_heads = 3;
  int num_tokens = 157;
};

inline std::string Name(const Case& c) {
  return "dtype=" + std::to_string(static_cast<int>(c.dtype)) +
         " rot=" + std::to_string(c.rot_block) + " head_dim=" + std::to_string(c.head_dim) +
         " block_tokens=" + std::to_string(c.block_tokens) +
         " group=" + std::to_string(c.group_size) + " sinks=" + std::to_string(c.sink_tokens);
}

// Codes compared over all cases of a test.
struct CodeStats {
  uint64_t codes = 0;
  uint64_t off_by_one = 0;
};

// The inputs of one QuantizeAppend: several sequences of random lengths, their tokens given
// slots scattered over the arena (some skipped with -1).
struct Inputs {
  PageLayout layout;
  std::vector<uint16_t> k, v;
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  int64_t num_blocks = 0;
};

inline Inputs MakeInputs(const Case& c, uint64_t seed) {
  Inputs in;
  PageLayout& l = in.layout;
  l.num_kv_heads = c.num_kv_heads;
  l.head_dim = c.head_dim;
  l.block_tokens = c.block_tokens;
  l.dtype = c.dtype;
  l.group_size = c.group_size > 0 ? c.group_size : c.head_dim;
  l.rot_block = c.rot_block;
  l.sign_seed = seed * 7919 + 1;
  l.sink_tokens = c.sink_tokens;
  const auto kind = static_cast<testing::Outliers>(1 + seed % 4);
  const testing::KvData d = testing::MakeKv(c.num_tokens, c.num_kv_heads, c.head_dim, kind, seed);
  in.k = testing::ToHalf(d.k);
  in.v = testing::ToHalf(d.v);

  // Sequences of random lengths, each on its own blocks (as a store allocates them), the blocks
  // scattered randomly over an arena with spare blocks; 5% of the tokens are skipped (slot -1).
  std::mt19937_64 rng(seed ^ 0x5eed);
  std::uniform_int_distribution<int> seq_len(1, 3 * c.block_tokens);
  std::uniform_int_distribution<int> percent(0, 99);
  std::vector<int64_t> logical_block;
  int position = 0, remaining = seq_len(rng), blocks_used = 0;
  for (int t = 0; t < c.num_tokens; ++t) {
    if (remaining-- == 0) {
      position = 0;
      remaining = seq_len(rng) - 1;
    }
    if (position % c.block_tokens == 0) ++blocks_used;
    in.positions.push_back(position++);
    logical_block.push_back(blocks_used - 1);
  }
  in.num_blocks = blocks_used + 5;
  std::vector<int64_t> block_of(in.num_blocks);
  std::iota(block_of.begin(), block_of.end(), 0);
  std::shuffle(block_of.begin(), block_of.end(), rng);
  for (int t = 0; t < c.num_tokens; ++t) {
    const int64_t slot =
        block_of[logical_block[t]] * c.block_tokens + in.positions[t] % c.block_tokens;
    in.slots.push_back(percent(rng) < 5 ? -1 : slot);
  }
  return in;
}

// Every byte of the CUDA kernel's arena (and sink arena) for `in` against the CPU reference's:
// sink pages identical, codes within one step and meta within one fp16 ulp on written slots,
// unwritten slots and padding still poisoned.
inline void ExpectPagesMatch(const Inputs& in, const std::vector<uint8_t>& cpu_pages,
                             const std::vector<uint8_t>& gpu_pages,
                             const std::vector<uint8_t>& cpu_sinks,
                             const std::vector<uint8_t>& gpu_sinks, CodeStats* stats) {
  const PageLayout& l = in.layout;
  // Sinks are fp16 copies: identical bytes, untouched ones still poisoned in both.
  EXPECT_TRUE(gpu_sinks == cpu_sinks) << "sink pages differ";

  std::vector<bool> written(in.num_blocks * l.block_tokens, false);
  for (int64_t s : in.slots) {
    if (s >= 0) written[s] = true;
  }
  for (int64_t b = 0; b < in.num_blocks; ++b) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < l.num_kv_heads; ++h) {
        const uint8_t* cp = cpu::HeadPage(l, cpu_pages.data(), b, kv, h);
        const uint8_t* gp = cpu::HeadPage(l, gpu_pages.data(), b, kv, h);
        for (int t = 0; t < l.block_tokens; ++t) {
          const size_t row = t * l.code_bytes_per_token();
          if (!written[b * l.block_tokens + t]) {
            for (size_t i = 0; i < l.code_bytes_per_token(); ++i) {
              ASSERT_EQ(gp[row + i], kPoison) << "unwritten slot touched, block " << b;
            }
            continue;
          }
          if (!l.quantized()) {
            ASSERT_EQ(std::memcmp(cp + row, gp + row, l.code_bytes_per_token()), 0);
            continue;
          }
          for (int g = 0; g < l.groups(); ++g) {
            const size_t meta = l.codes_bytes() + (static_cast<size_t>(t) * l.groups() + g) * 4;
            for (int half = 0; half < 2; ++half) {
              uint16_t ch, gh;
              std::memcpy(&ch, cp + meta + 2 * half, 2);
              std::memcpy(&gh, gp + meta + 2 * half, 2);
              ASSERT_LE(std::abs(int{ch} - int{gh}), 1)
                  << (half == 0 ? "scale" : "zero") << " differs by more than 1 ulp";
            }
          }
          // Raw bytes for FP8 (adjacent e4m3 values are adjacent bytes of the same sign).
          for (size_t i = 0; i < l.code_bytes_per_token(); ++i) {
            if (cp[row + i] == gp[row + i]) continue;
            if (l.dtype == KvDtype::kInt4) {
              const int lo = std::abs((cp[row + i] & 15) - (gp[row + i] & 15));
              const int hi = std::abs((cp[row + i] >> 4) - (gp[row + i] >> 4));
              ASSERT_LE(std::max(lo, hi), 1) << "INT4 code differs by more than one";
              stats->off_by_one += (lo != 0) + (hi != 0);
            } else {
              ASSERT_EQ(std::abs(int{cp[row + i]} - int{gp[row + i]}), 1)
                  << "code differs by more than one";
              ++stats->off_by_one;
            }
          }
          stats->codes += l.head_dim;
        }
        // Padding after the codes and the meta stays poisoned.
        const size_t codes_used = l.block_tokens * l.code_bytes_per_token();
        for (size_t i = codes_used; i < l.codes_bytes(); ++i) ASSERT_EQ(gp[i], kPoison);
        const size_t meta_used = l.codes_bytes() + l.block_tokens * l.meta_bytes_per_token();
        for (size_t i = meta_used; i < l.head_page_bytes(); ++i) ASSERT_EQ(gp[i], kPoison);
      }
    }
  }
}

inline void ExpectFewTies(const CodeStats& s, const char* what) {
  std::printf("%s: %llu codes, %llu off by one (%.2e)\n", what,
              static_cast<unsigned long long>(s.codes),
              static_cast<unsigned long long>(s.off_by_one),
              s.codes ? static_cast<double>(s.off_by_one) / s.codes : 0.0);
  EXPECT_GT(s.codes, 0u);
  EXPECT_LE(s.off_by_one, s.codes / 1000) << what << ": too many codes differ from the reference";
}

}  // namespace kvpool::quantize_test

#endif  // KVPOOL_TESTS_GPU_QUANTIZE_TEST_UTIL_H_
