#include "kernels/hadamard.h"

#include <cmath>

#include "kernels/page_layout.h"

namespace kvpool {

BlockHadamard::BlockHadamard(int head_dim, int rot_block, uint64_t sign_seed)
    : head_dim_(head_dim),
      rot_block_(rot_block),
      norm_(1.0 / std::sqrt(static_cast<double>(rot_block))),
      signs_(head_dim) {
  for (int c = 0; c < head_dim; ++c) signs_[c] = RotationSign(sign_seed, c);
}

void BlockHadamard::TransformBlocks(double* x) const {
  for (int base = 0; base < head_dim_; base += rot_block_) {
    double* blk = x + base;
    for (int half = 1; half < rot_block_; half *= 2) {
      for (int i = 0; i < rot_block_; i += 2 * half) {
        for (int j = i; j < i + half; ++j) {
          const double a = blk[j];
          const double b = blk[j + half];
          blk[j] = a + b;
          blk[j + half] = a - b;
        }
      }
    }
    for (int j = 0; j < rot_block_; ++j) blk[j] *= norm_;
  }
}

void BlockHadamard::Forward(double* x) const {
  for (int c = 0; c < head_dim_; ++c) x[c] *= signs_[c];
  TransformBlocks(x);
}

void BlockHadamard::Inverse(double* x) const {
  TransformBlocks(x);
  for (int c = 0; c < head_dim_; ++c) x[c] *= signs_[c];
}

}  // namespace kvpool
