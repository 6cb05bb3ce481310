// LaunchAttentionSplits: the split kernel of one call, AttentionSplitMmaKernel
// (paged_attention_mma.cuh) when args.plan.mma, else AttentionSplitKernel
// (paged_attention_split.cuh). Included only by the instantiation files paged_attention_<dtype>.cu.
#ifndef KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_LAUNCH_CUH_
#define KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_LAUNCH_CUH_

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/cuda/paged_attention_mma.cuh"
#include "kernels/cuda/paged_attention_mma_operands.cuh"
#include "kernels/cuda/paged_attention_split.cuh"

namespace kvpool::cuda {
namespace attention_internal {

template <KvDtype kDtype, int kHeadDim, int kPT, int kCtasPerSm>
KernelStatus LaunchAttentionSplitsMmaPT(const AttnSplitArgs& args, int num_seqs,
                                        cudaStream_t stream) {
  using T = MmaTraits<kDtype, kHeadDim, kCtasPerSm>;
  constexpr auto kernel = AttentionSplitMmaKernel<kDtype, kHeadDim, kPT, kCtasPerSm>;
  KVPOOL_CUDA_RETURN_IF_ERROR(
      (AllowDynamicSharedMemory<kernel, static_cast<int>(T::kSharedBytes)>()));
  const dim3 grid(args.plan.num_splits, args.num_kv_heads * args.plan.head_groups, num_seqs);
  return CheckCuda(LaunchDependent(kernel, grid, dim3(kAttnThreads), T::kSharedBytes, stream, args),
                   "AttentionSplitMmaKernel");
}

// The build for the plan's CTAs per SM (AttnMmaCtasPerSm, or the deep build's).
template <KvDtype kDtype, int kHeadDim, int kPT>
KernelStatus LaunchAttentionSplitsMmaBuild(const AttnSplitArgs& args, int num_seqs,
                                           cudaStream_t stream) {
  if constexpr (AttnHasDeepBuild(kDtype, kHeadDim)) {
    if (args.plan.ctas_per_sm == kAttnDeepCtasPerSm) {
      return LaunchAttentionSplitsMmaPT<kDtype, kHeadDim, kPT, kAttnDeepCtasPerSm>(args, num_seqs,
                                                                                   stream);
    }
  }
  return LaunchAttentionSplitsMmaPT<kDtype, kHeadDim, kPT, AttnMmaCtasPerSm(kDtype, kHeadDim)>(
      args, num_seqs, stream);
}

// One P^T tile when every CTA serves at most 4 query heads (GQA ratio <= 4), else two.
template <KvDtype kDtype, int kHeadDim>
KernelStatus LaunchAttentionSplitsMma(const AttnSplitArgs& args, int num_seqs,
                                      cudaStream_t stream) {
  return args.ratio <= 4
             ? LaunchAttentionSplitsMmaBuild<kDtype, kHeadDim, 1>(args, num_seqs, stream)
             : LaunchAttentionSplitsMmaBuild<kDtype, kHeadDim, 2>(args, num_seqs, stream);
}

}  // namespace attention_internal

template <KvDtype kDtype, int kHeadDim>
KernelStatus LaunchAttentionSplits(const AttnSplitArgs& args, int num_seqs, cudaStream_t stream) {
  return args.plan.mma
             ? attention_internal::LaunchAttentionSplitsMma<kDtype, kHeadDim>(args, num_seqs,
                                                                              stream)
             : attention_internal::LaunchAttentionSplitsGeneral<kDtype, kHeadDim>(args, num_seqs,
                                                                                  stream);
}

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_PAGED_ATTENTION_LAUNCH_CUH_
