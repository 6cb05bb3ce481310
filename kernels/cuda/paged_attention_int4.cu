// Instantiates the paged decode attention split kernels for INT4 pages, every compiled head_dim.
#include "kernels/cuda/paged_attention_launch.cuh"

namespace kvpool::cuda {

template KernelStatus LaunchAttentionSplits<KvDtype::kInt4, 64>(const AttnSplitArgs&, int,
                                                                cudaStream_t);
template KernelStatus LaunchAttentionSplits<KvDtype::kInt4, 128>(const AttnSplitArgs&, int,
                                                                 cudaStream_t);
template KernelStatus LaunchAttentionSplits<KvDtype::kInt4, 256>(const AttnSplitArgs&, int,
                                                                 cudaStream_t);

}  // namespace kvpool::cuda
