// Instantiates the paged decode attention split kernels for FP16 pages, every compiled head_dim.
#include "kernels/cuda/paged_attention_launch.cuh"

namespace kvpool::cuda {

template KernelStatus LaunchAttentionSplits<KvDtype::kFp16, 64>(const AttnSplitArgs&, int,
                                                                cudaStream_t);
template KernelStatus LaunchAttentionSplits<KvDtype::kFp16, 128>(const AttnSplitArgs&, int,
                                                                 cudaStream_t);
template KernelStatus LaunchAttentionSplits<KvDtype::kFp16, 256>(const AttnSplitArgs&, int,
                                                                 cudaStream_t);

}  // namespace kvpool::cuda
