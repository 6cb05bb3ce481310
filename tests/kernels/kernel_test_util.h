// Helpers shared by the CPU kernel tests: layouts and exact (double) decoding of page rows.
#ifndef KVPOOL_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define KVPOOL_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <vector>

#include "kernels/cpu/page_codec.h"
#include "kernels/hadamard.h"
#include "kernels/page_layout.h"

namespace kvpool::testing {

inline PageLayout MakeLayout(KvDtype dtype, int rot_block, int group_size, int num_kv_heads = 2,
                             int head_dim = 128, int block_tokens = 16, int sink_tokens = 0) {
  PageLayout l;
  l.num_kv_heads = num_kv_heads;
  l.head_dim = head_dim;
  l.block_tokens = block_tokens;
  l.dtype = dtype;
  l.group_size = group_size;
  l.rot_block = rot_block;
  l.sign_seed = rot_block > 0 ? 0x9E3779B9ull : 0;
  l.sink_tokens = sink_tokens;
  return l;
}

// Row `token` of the head page of (block, kv, head) decoded without fp16 rounding: code * s + z
// (DecodeRow) taken back to the original space by the inverse rotation in double.
inline std::vector<double> DecodeOriginal(const PageLayout& l, const uint8_t* pages, int block,
                                          int kv, int head, int token) {
  std::vector<float> row(l.head_dim);
  cpu::DecodeRow(l, cpu::HeadPage(l, pages, block, kv, head), token, row.data());
  std::vector<double> x(row.begin(), row.end());
  if (l.rotated()) BlockHadamard(l.head_dim, l.rot_block, l.sign_seed).Inverse(x.data());
  return x;
}

inline const char* DtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kFp16:
      return "fp16";
    case KvDtype::kFp8E4M3:
      return "fp8";
    case KvDtype::kInt8:
      return "int8";
    case KvDtype::kInt4:
      return "int4";
  }
  return "?";
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
