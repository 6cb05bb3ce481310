// kvpool::cuda::Dequantize: blocks back to fp16 in the original space. Decodes x' = code * s + z
// exactly like the CPU reference (kernels/cpu/page_codec.h), then un-rotates in fp32 (the
// reference un-rotates in double, so outputs may differ by a rounding).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;

struct DequantizeArgs {
  const uint8_t* pages;      // [num_blocks][layer_page_bytes]
  const int32_t* block_ids;  // [num_out_blocks]; ids outside [0, num_blocks) read as zeros
  uint16_t* k_out;           // [num_out_blocks * block_tokens][heads_out][head_dim] fp16
  uint16_t* v_out;           // same shape
  const uint8_t* first_sink_page;  // DequantizeParams::first_sink_page
  uint32_t sink_items;             // items of out block 0's sink rows, read from it (0: none)
  int sink_tokens;
  uint32_t num_items;        // num_out_blocks * block_tokens * heads_out
  uint32_t valid_items;      // items of rows below valid_tokens; the rest are written as zeros
  int heads_out;             // head_end - head_begin
  int head_begin;
  int num_kv_heads;
  int64_t num_blocks;
  int group_lanes;  // group_size / 8
  PageGeometry geo;
  RotationSigns signs;
};

// This lane's 8 decoded channels (rotated space) of token `t` of a head page.
template <KvDtype kDtype>
__device__ __forceinline__ void DecodeLane(const DequantizeArgs& a, const uint8_t* head_page, int t,
                                           int chunk, float (&x)[8]) {
  const uint8_t* row = head_page + static_cast<size_t>(t) * a.geo.code_bytes_per_token;
  if constexpr (kDtype == KvDtype::kFp16) {
    UnpackHalf8(*reinterpret_cast<const uint4*>(row + chunk * 16), x);
  } else {
    const uint32_t meta = *reinterpret_cast<const uint32_t*>(
        head_page + a.geo.codes_bytes + static_cast<size_t>(t) * a.geo.meta_bytes_per_token +
        (chunk / a.group_lanes) * 4);
    const float s = HalfBitsToFloat(static_cast<uint16_t>(meta & 0xffffu));
    const float z = HalfBitsToFloat(static_cast<uint16_t>(meta >> 16));
    float code[8];
    if constexpr (kDtype == KvDtype::kInt4) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(row + chunk * 4);
#pragma unroll
      for (int i = 0; i < 8; ++i) code[i] = static_cast<float>((w >> (4 * i)) & 0xfu);
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(row + chunk * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint8_t b = static_cast<uint8_t>(((i < 4 ? w.x : w.y) >> (8 * (i % 4))) & 0xffu);
        code[i] = kDtype == KvDtype::kInt8 ? static_cast<float>(b) : Fp8E4M3BitsToFloat(b);
      }
    }
    // Separate multiply and add (no fma), as the reference computes it.
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __fadd_rn(__fmul_rn(code[i], s), z);
  }
}

// One (output row, KV head) item per kHeadDim/8 consecutive lanes; each lane decodes channels
// [8 chunk, 8 chunk + 8) of K and V, un-rotates them with warp shuffles and stores 16 bytes each.
// Grid: ceil(num_items * kHeadDim / 8 / kThreads) blocks of kThreads threads (1-D).
template <KvDtype kDtype, int kHeadDim, int kRot>
__global__ void __launch_bounds__(kThreads) DequantizeKernel(const DequantizeArgs a) {
  constexpr int kLanes = kHeadDim / 8;
  const uint32_t tid = blockIdx.x * kThreads + threadIdx.x;
  const uint32_t item = tid / kLanes;
  const int chunk = static_cast<int>(tid % kLanes);
  const bool active = item < a.num_items;
  const uint32_t row = active ? item / static_cast<uint32_t>(a.heads_out) : 0;
  const int head = a.head_begin + static_cast<int>(item - row * a.heads_out);
  const int t = static_cast<int>(row & ((1u << a.geo.block_tokens_log2) - 1));
  const int64_t block = active ? a.block_ids[row >> a.geo.block_tokens_log2] : -1;
  const bool valid = block >= 0 && block < a.num_blocks;

  // Inactive lanes and invalid blocks keep going with zeros: the shuffles need every lane.
  float kx[8] = {}, vx[8] = {};
  if (valid) {
    const uint8_t* k_page = a.pages + static_cast<size_t>(block) * a.geo.layer_page_bytes +
                            static_cast<size_t>(head) * a.geo.head_page_bytes;
    const uint8_t* v_page = k_page + static_cast<size_t>(a.num_kv_heads) * a.geo.head_page_bytes;
    DecodeLane<kDtype>(a, k_page, t, chunk, kx);
    DecodeLane<kDtype>(a, v_page, t, chunk, vx);
  }
  if constexpr (kRot > 0) {
    const uint32_t signs = SignByte(a.signs, chunk);
    Hadamard8PerLane(kx, chunk, kRot);
    Hadamard8PerLane(vx, chunk, kRot);
    ApplySigns8(signs, kx);
    ApplySigns8(signs, vx);
  }
  if (active) {
    const size_t dst = static_cast<size_t>(item) * kHeadDim + chunk * 8;
    const bool real = item < a.valid_items;
    uint4 k8 = real ? PackHalf8(kx) : make_uint4(0, 0, 0, 0);
    uint4 v8 = real ? PackHalf8(vx) : make_uint4(0, 0, 0, 0);
    if (real && item < a.sink_items) {  // a sink row of a sequence's first block: exact fp16
      const size_t head_rows = static_cast<size_t>(a.num_kv_heads) * a.sink_tokens;
      const uint8_t* k_row = a.first_sink_page +
                             (static_cast<size_t>(head) * a.sink_tokens + t) * kHeadDim * 2 +
                             chunk * 16;
      k8 = *reinterpret_cast<const uint4*>(k_row);
      v8 = *reinterpret_cast<const uint4*>(k_row + head_rows * kHeadDim * 2);
    }
    *reinterpret_cast<uint4*>(a.k_out + dst) = k8;
    *reinterpret_cast<uint4*>(a.v_out + dst) = v8;
  }
}

template <KvDtype kDtype, int kHeadDim, int kRot>
KernelStatus LaunchDequantize(const DequantizeArgs& a, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(a.num_items) * (kHeadDim / 8);
  DequantizeKernel<kDtype, kHeadDim, kRot>
      <<<static_cast<unsigned>(CeilDiv(threads, kThreads)), kThreads, 0, stream>>>(a);
  return CheckLaunch("DequantizeKernel");
}

}  // namespace

// Requires (else kInvalidArgument): a valid layout, 0 <= head_begin < head_end <= num_kv_heads,
// valid_tokens >= 0, non-null 16-byte aligned pages and outputs (and first_sink_page, when set,
// 16-byte aligned, with sink_tokens > 0). Block ids live on the device and
// cannot be checked here: ids outside the arena produce zeros, and callers validate them (the CUDA
// backend does). kUnsupported: sizes outside DispatchLayout's, group_size not a multiple of 8, or
// more than 2^32 - 2^16 lanes of work.
KernelStatus Dequantize(const DequantizeParams& p, void* stream) {
  const PageLayout& l = p.layout;
  if (ValidatePageLayout(l) != nullptr || p.num_out_blocks < 0 || p.num_blocks < 0 ||
      p.head_begin < 0 || p.head_end <= p.head_begin || p.head_end > l.num_kv_heads ||
      p.valid_tokens < 0) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.num_out_blocks == 0) return KernelStatus::kOk;
  if (p.pages == nullptr || p.block_ids == nullptr || p.k_out == nullptr || p.v_out == nullptr ||
      !Aligned16(p.pages) || !Aligned16(p.k_out) || !Aligned16(p.v_out) ||
      (p.first_sink_page != nullptr && (l.sink_tokens == 0 || !Aligned16(p.first_sink_page)))) {
    return KernelStatus::kInvalidArgument;
  }
  if ((l.quantized() && l.group_size % 8 != 0) || !FitsPageGeometry(l)) {
    return KernelStatus::kUnsupported;
  }
  const int heads_out = p.head_end - p.head_begin;
  const int64_t items = static_cast<int64_t>(p.num_out_blocks) * l.block_tokens * heads_out;
  if (items * (l.head_dim / 8) > (int64_t{1} << 32) - (int64_t{1} << 16)) {
    return KernelStatus::kUnsupported;
  }

  DequantizeArgs a{};
  a.pages = p.pages;
  a.block_ids = p.block_ids;
  a.k_out = p.k_out;
  a.v_out = p.v_out;
  a.first_sink_page = p.first_sink_page;
  a.sink_items =
      p.first_sink_page != nullptr ? static_cast<uint32_t>(l.sink_tokens * heads_out) : 0;
  a.sink_tokens = l.sink_tokens;
  a.num_items = static_cast<uint32_t>(items);
  a.valid_items = static_cast<uint32_t>(
      std::min<int64_t>(p.valid_tokens, int64_t{p.num_out_blocks} * l.block_tokens) * heads_out);
  a.heads_out = heads_out;
  a.head_begin = p.head_begin;
  a.num_kv_heads = l.num_kv_heads;
  a.num_blocks = p.num_blocks;
  a.group_lanes = l.quantized() ? l.group_size / 8 : 1;
  a.geo = MakePageGeometry(l);
  a.signs = MakeRotationSigns(l);
  const auto s = static_cast<cudaStream_t>(stream);
  return DispatchLayout</*kWithBlockTokens=*/false>(
      l, [&](auto dtype, auto head_dim, auto rot, auto) {
        return LaunchDequantize<decltype(dtype)::value, decltype(head_dim)::value,
                                decltype(rot)::value>(a, s);
      });
}

}  // namespace kvpool::cuda
