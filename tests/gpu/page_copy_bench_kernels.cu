#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "tests/gpu/page_copy_bench_kernels.h"

namespace kvpool::bench {
namespace {

using cuda::CpAsync16;
using cuda::CpAsyncCommit;
using cuda::CpAsyncWait;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 16;  // one block of 16 tokens per tile

// The tiles of this CTA's split that warp `warp` takes, and the byte offsets of a tile's K and V
// head pages in the arena.
struct WarpTiles {
  const int32_t* table;
  int first_tile, end_tile;
  size_t head_offset, v_minus_k, block_bytes;

  __device__ WarpTiles(const PageCopyArgs& a, int warp) {
    const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const int tiles = a.context / kTileTokens;
    const int per_split = (tiles + a.num_splits - 1) / a.num_splits;
    table = a.block_tables + static_cast<size_t>(seq) * tiles;
    first_tile = split * per_split + warp;
    end_tile = min((split + 1) * per_split, tiles);
    head_offset = static_cast<size_t>(kv_head) * a.head_page_bytes;
    v_minus_k = static_cast<size_t>(a.num_kv_heads) * a.head_page_bytes;
    block_bytes = 2 * v_minus_k;
  }
  __device__ const uint8_t* KPage(const PageCopyArgs& a, int tile) const {
    return a.pages + static_cast<size_t>(__ldg(table + tile)) * block_bytes + head_offset;
  }
};

__device__ void FoldIntoSink(const PageCopyArgs& a, uint32_t acc) {
  for (int m = 16; m > 0; m >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, m);
  __shared__ uint32_t warp_acc[kWarps];
  if (threadIdx.x % 32 == 0) warp_acc[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    const size_t cta =
        (static_cast<size_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    a.sink[cta] = warp_acc[0] ^ warp_acc[1] ^ warp_acc[2] ^ warp_acc[3];
  }
}

// One 16-byte word of a stage per lane: what the attention kernels' fragment loads would read.
__device__ uint32_t Touch(const uint8_t* stage, int bytes, int lane) {
  const uint4 w = *reinterpret_cast<const uint4*>(stage + (lane * 16) % bytes);
  return w.x ^ w.y ^ w.z ^ w.w;
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Warp w's tiles through kStages stages of its own (kStages - 1 in flight), either by the
// lanes' 16-byte cp.async copies (cp.async groups) or by two bulk copies from lane 0 per tile,
// counted on the stage's mbarrier (kBulk). Shared memory: with kBulk the [kWarps][kStages]
// mbarriers, then the stages [kWarps][kStages][K page, V page].
template <int kStages, bool kBulk>
__global__ void __launch_bounds__(kThreads) StagedKernel(const PageCopyArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const WarpTiles wt(a, warp);
  const int page = a.head_page_bytes, tile_bytes = 2 * page;
  const size_t bar_bytes = kBulk ? kWarps * kStages * sizeof(uint64_t) : 0;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * kStages;
  uint8_t* stages = smem + bar_bytes + static_cast<size_t>(warp) * kStages * tile_bytes;
  if (kBulk && lane == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SharedAddress(bars + s)));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncwarp();
  auto issue = [&](int tile, int stage) {
    uint8_t* dst = stages + stage * tile_bytes;
    if constexpr (kBulk) {
      if (tile >= wt.end_tile || lane != 0) return;
      const uint8_t* k = wt.KPage(a, tile);
      const uint32_t bar = SharedAddress(bars + stage);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                   "r"(tile_bytes)
                   : "memory");
      for (int kv = 0; kv < 2; ++kv) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];\n" ::"r"(SharedAddress(dst + kv * page)),
            "l"(k + kv * wt.v_minus_k), "r"(page), "r"(bar)
            : "memory");
      }
    } else {
      if (tile < wt.end_tile) {
        const uint8_t* k = wt.KPage(a, tile);
        for (int off = lane * 16; off < page; off += 512) {
          CpAsync16(dst + off, k + off);
          CpAsync16(dst + page + off, k + wt.v_minus_k + off);
        }
      }
      CpAsyncCommit();
    }
  };
  // Until the warp's `local`-th tile has landed in stage `stage`.
  auto wait = [&](int stage, int local) {
    if constexpr (kBulk) {
      const uint32_t bar = SharedAddress(bars + stage);
      const uint32_t parity = (local / kStages) & 1;  // the stage's (local / kStages)-th fill
      uint32_t done = 0;
      while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
      }
    } else {
      CpAsyncWait<kStages - 1>();  // this tile's group; the kStages - 1 after it in flight
      __syncwarp();
    }
  };
  constexpr int kLead = kStages - 1;
  for (int i = 0; i < kLead; ++i) issue(wt.first_tile + i * kWarps, i);
  uint32_t acc = 0;
  int use = 0, local = 0;
  for (int tile = wt.first_tile; tile < wt.end_tile; tile += kWarps, ++local) {
    issue(tile + kLead * kWarps, (use + kLead) % kStages);
    wait(use, local);
    acc ^= Touch(stages + use * tile_bytes, tile_bytes, lane);
    __syncwarp();  // the stage is read before it is refilled
    use = use + 1 == kStages ? 0 : use + 1;
  }
  if constexpr (!kBulk) CpAsyncWait<0>();
  FoldIntoSink(a, acc);
}

__global__ void __launch_bounds__(kThreads) LoadKernel(const PageCopyArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const WarpTiles wt(a, warp);
  const int page = a.head_page_bytes;
  uint32_t acc = 0;
#pragma unroll 4
  for (int tile = wt.first_tile; tile < wt.end_tile; tile += kWarps) {
    const uint8_t* k = wt.KPage(a, tile);
    for (int off = lane * 16; off < page; off += 512) {
      const uint4 x = __ldcg(reinterpret_cast<const uint4*>(k + off));
      const uint4 y = __ldcg(reinterpret_cast<const uint4*>(k + wt.v_minus_k + off));
      acc ^= x.x ^ x.y ^ x.z ^ x.w ^ y.x ^ y.y ^ y.z ^ y.w;
    }
  }
  FoldIntoSink(a, acc);
}

template <int kStages, bool kBulk>
cudaError_t LaunchStaged(const PageCopyArgs& a, cudaStream_t stream) {
  const dim3 grid(a.num_splits, a.num_kv_heads, a.num_seqs);
  const size_t bytes = (kBulk ? kWarps * kStages * sizeof(uint64_t) : 0) +
                       static_cast<size_t>(kWarps) * kStages * 2 * a.head_page_bytes;
  const cudaError_t e =
      cudaFuncSetAttribute(StagedKernel<kStages, kBulk>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  StagedKernel<kStages, kBulk><<<grid, kThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <int kStages>
cudaError_t Launch(PageCopy how, const PageCopyArgs& a, cudaStream_t stream) {
  switch (how) {
    case PageCopy::kCpAsync:
      return LaunchStaged<kStages, false>(a, stream);
    case PageCopy::kBulk:
      return LaunchStaged<kStages, true>(a, stream);
    case PageCopy::kLoad:
      LoadKernel<<<dim3(a.num_splits, a.num_kv_heads, a.num_seqs), kThreads, 0, stream>>>(a);
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t RunPageCopy(PageCopy how, const PageCopyArgs& a, cudaStream_t stream) {
  switch (a.stages) {
    case 3:
      return Launch<3>(how, a, stream);
    case 5:
      return Launch<5>(how, a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kvpool::bench
