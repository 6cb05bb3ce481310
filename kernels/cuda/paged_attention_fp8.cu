// Instantiates the paged decode attention split kernels for FP8 E4M3 pages, every head_dim.
#include "kernels/cuda/paged_attention_launch.cuh"

namespace kvpool::cuda {

template KernelStatus LaunchAttentionSplits<KvDtype::kFp8E4M3, 64>(const AttnSplitArgs&, int,
                                                                   cudaStream_t);
template KernelStatus LaunchAttentionSplits<KvDtype::kFp8E4M3, 128>(const AttnSplitArgs&, int,
                                                                    cudaStream_t);
template KernelStatus LaunchAttentionSplits<KvDtype::kFp8E4M3, 256>(const AttnSplitArgs&, int,
                                                                    cudaStream_t);

}  // namespace kvpool::cuda
