// Host block-diagonal Walsh-Hadamard rotation of one head vector, in double (DESIGN.md section 1).
//
// For channels split into blocks of B = rot_block:
//   forward  x' = H_B (s . x)   per block, H_B the normalized (1/sqrt(B)) Walsh-Hadamard matrix,
//                               s_c = RotationSign(sign_seed, c) for channel c of the head
//   inverse  x  = s . (H_B x')  (H_B is symmetric and orthogonal, so this undoes forward)
// Both run the in-place fast transform, O(head_dim log B).
#ifndef KVPOOL_KERNELS_HADAMARD_H_
#define KVPOOL_KERNELS_HADAMARD_H_

#include <cstdint>
#include <vector>

namespace kvpool {

class BlockHadamard {
 public:
  // Requires head_dim > 0, rot_block a power of two dividing head_dim.
  BlockHadamard(int head_dim, int rot_block, uint64_t sign_seed);

  int head_dim() const { return head_dim_; }

  // x: [head_dim], rotated in place.
  void Forward(double* x) const;
  void Inverse(double* x) const;

 private:
  // Normalized fast Walsh-Hadamard transform of every block of x, in place.
  void TransformBlocks(double* x) const;

  int head_dim_;
  int rot_block_;
  double norm_;                // 1 / sqrt(rot_block)
  std::vector<double> signs_;  // [head_dim] s_c
};

}  // namespace kvpool

#endif  // KVPOOL_KERNELS_HADAMARD_H_
