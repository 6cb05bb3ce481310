// Kernels of the page-copy benchmark (page_copy_bench_kernels.cu): three ways for the warps of a
// split CTA to bring the K and V pages of its tiles into the SM, the attention kernels' access
// pattern with the compute left out.
#ifndef KVPOOL_TESTS_GPU_PAGE_COPY_BENCH_KERNELS_H_
#define KVPOOL_TESTS_GPU_PAGE_COPY_BENCH_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvpool::bench {

enum class PageCopy {
  kCpAsync,  // 16-byte cp.async per lane into per-warp shared-memory stages (the kernels' way)
  kBulk,     // one cp.async.bulk per page by lane 0, completion on a per-stage mbarrier
  kLoad,     // 16-byte loads into registers, no shared memory or staging (a baseline)
};

// What one call reads: for each (sequence, KV head, split), the K and V head pages of the
// blocks of tokens [split * tokens_per_split, min(+tokens_per_split, context)) in block_tables,
// one 16-token block per tile; warp w of a CTA takes tiles w, w + 4, ... through `stages`
// stages (3 or 5; the attention kernels' FP16 and INT4 counts). block_tokens is 16; a head page is
// `head_page_bytes` (a multiple of 16) and the K and V pages of a block are num_kv_heads head pages
// apart. Every word read is folded into `sink` (one word per CTA, at least num_seqs * num_kv_heads
// * num_splits words).
struct PageCopyArgs {
  const uint8_t* pages = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs][context / 16]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int context = 0;
  int num_splits = 0;
  int head_page_bytes = 0;
  int stages = 0;
  uint32_t* sink = nullptr;
};

cudaError_t RunPageCopy(PageCopy how, const PageCopyArgs& args, cudaStream_t stream);

}  // namespace kvpool::bench

#endif  // KVPOOL_TESTS_GPU_PAGE_COPY_BENCH_KERNELS_H_
