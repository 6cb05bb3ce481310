// The fused rotate-quantize-append kernel (DESIGN.md section 5) and kvpool::cuda::QuantizeAppend.
// It reproduces the CPU reference's per-row math (kernels/cpu/page_codec.h) except that the
// rotation runs in fp32 instead of double, so a code may differ by one where x' sits within an
// fp32 rounding of a half-way point.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool::cuda {
namespace {

constexpr int kThreads = 256;
// Items (token, head) per lane group: their loads are all issued before any is processed, which
// keeps enough bytes in flight to saturate HBM.
constexpr int kItemsPerLaneGroup = 2;

struct QuantizeArgs {
  const uint16_t* k;            // [num_tokens][num_kv_heads][head_dim] fp16, 16-byte aligned
  const uint16_t* v;            // same shape
  const int64_t* slot_mapping;  // [num_tokens]; < 0 skipped, >= num_slots skipped
  const int32_t* positions;     // [num_tokens]; read only when sink_tokens > 0
  uint8_t* pages;               // [num_blocks][layer_page_bytes], 16-byte aligned
  uint8_t* sink_pages;          // [num_blocks][sink_page_bytes]; used when sink_tokens > 0
  uint32_t num_items;           // num_tokens * num_kv_heads
  int num_kv_heads;
  int64_t num_slots;  // num_blocks * block_tokens
  int group_size;     // channels per {scale, zero}, a multiple of 8
  int sink_tokens;
  PageGeometry geo;
  RotationSigns signs;
};

// a / b, correctly rounded like IEEE division, from r = RN(1 / b): one fma correction of the
// product a * r (Markstein's theorem; holds for the normal, finite operands seen here). Cheaper
// than a full division per channel; r is computed once per group.
__device__ __forceinline__ float DivWithReciprocal(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  const float rem = __fmaf_rn(-q, b, a);
  return __fmaf_rn(rem, r, q);
}

// Max (and min when kWithMin) over aligned groups of `lanes` lanes (a power of two <= kLanes,
// the same in every lane of the warp, so the early exit is uniform).
template <int kLanes, bool kWithMin>
__device__ __forceinline__ void GroupMinMax(int lanes, float& mn, float& mx) {
#pragma unroll
  for (int m = 1; m < kLanes; m <<= 1) {
    if (m >= lanes) break;
    if constexpr (kWithMin) mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, m));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
  }
}

// {scale, zero} of one group (kernels/cpu/page_codec.h): s, z as floats, r = RN(1 / s), and the
// stored word (scale in the low half).
struct GroupMeta {
  float s, z, r;
  uint32_t word;
};

// mn, mx: the group's min and max (FP8: mx = max |x|, mn unused).
template <KvDtype kDtype>
__device__ __forceinline__ GroupMeta MakeGroupMeta(float mn, float mx) {
  GroupMeta m;
  if constexpr (kDtype == KvDtype::kFp8E4M3) {
    const uint16_t scale_h = FloatToHalfBits(DivWithReciprocal(mx, 448.0f, 1.0f / 448.0f));
    m.s = HalfBitsToFloat(scale_h);
    m.z = 0.0f;
    m.word = scale_h;
  } else {
    constexpr float kLevels = kDtype == KvDtype::kInt4 ? 15.0f : 255.0f;
    const uint16_t scale_h =
        FloatToHalfBits(DivWithReciprocal(__fsub_rn(mx, mn), kLevels, 1.0f / kLevels));
    const uint16_t zero_h = FloatToHalfBits(mn);
    m.s = HalfBitsToFloat(scale_h);
    m.z = HalfBitsToFloat(zero_h);
    m.word = static_cast<uint32_t>(scale_h) | (static_cast<uint32_t>(zero_h) << 16);
  }
  m.r = __frcp_rn(m.s);
  return m;
}

// 1.5 * 2^23: for |q| < 2^22, q + kRoundMagic rounds q to an integer (ties to even, like
// __float2int_rn) held in the low mantissa bits, and (q + kRoundMagic) - kRoundMagic is that
// integer as a float. Codes are rounded and packed this way in fp32 (no F2I, no integer work).
constexpr float kRoundMagic = 12582912.0f;

// Codes of the 8 channels x (consecutive) of one lane, packed as stored: INT4 in .x (channel 2j
// in the low nibble of byte j), INT8 / FP8 in .x (channels 0-3) and .y (4-7).
template <KvDtype kDtype>
__device__ __forceinline__ uint2 EncodeLane(const float (&x)[8], const GroupMeta& m, float mn,
                                            float mx) {
  if (!(m.s > 0.0f)) return make_uint2(0u, 0u);
  if constexpr (kDtype == KvDtype::kFp8E4M3) {
    uint32_t pair[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      pair[j] = __nv_cvt_float2_to_fp8x2(make_float2(DivWithReciprocal(x[2 * j], m.s, m.r),
                                                     DivWithReciprocal(x[2 * j + 1], m.s, m.r)),
                                         __NV_SATFINITE, __NV_E4M3);
    }
    return make_uint2(__byte_perm(pair[0], pair[1], 0x5410), __byte_perm(pair[2], pair[3], 0x5410));
  } else {
    constexpr float kLevels = kDtype == KvDtype::kInt4 ? 15.0f : 255.0f;
    // x -> (x - z) / s is monotonic, so the group's min and max bound every quotient: clamping
    // is needed only when they round outside [0, levels] (fp16 rounding of s and z).
    const float q_lo = DivWithReciprocal(__fsub_rn(mn, m.z), m.s, m.r);
    const float q_hi = DivWithReciprocal(__fsub_rn(mx, m.z), m.s, m.r);
    const bool clamp = q_lo < -0.5f || q_hi >= kLevels + 0.5f;
    float t[8];  // rounded code + kRoundMagic
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float q = DivWithReciprocal(__fsub_rn(x[i], m.z), m.s, m.r);
      if (clamp) q = fminf(fmaxf(q, 0.0f), kLevels);
      t[i] = __fadd_rn(q, kRoundMagic);
    }
    // Sums of codes times powers of two stay below 2^16: exact in fp32 next to kRoundMagic.
    auto code = [&](int i) { return __fsub_rn(t[i], kRoundMagic); };
    if constexpr (kDtype == KvDtype::kInt4) {
      float half[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * h;
        half[h] = __fmaf_rn(code(i + 3), 4096.0f,
                            __fmaf_rn(code(i + 2), 256.0f, __fmaf_rn(code(i + 1), 16.0f, t[i])));
      }
      return make_uint2(__byte_perm(__float_as_uint(half[0]), __float_as_uint(half[1]), 0x5410),
                        0u);
    } else {
      uint32_t pair[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pair[j] = __float_as_uint(__fmaf_rn(code(2 * j + 1), 256.0f, t[2 * j]));
      }
      return make_uint2(__byte_perm(pair[0], pair[1], 0x5410),
                        __byte_perm(pair[2], pair[3], 0x5410));
    }
  }
}

// Quantizes one rotated (or, for an unrotated layout, plain) row held 8 consecutive channels per
// lane, and stores this lane's codes and its group's meta into token `offset` of `head_page`
// when `write`. Every lane of the warp must call it.
template <KvDtype kDtype, int kHeadDim>
__device__ __forceinline__ void EncodeAndStore(const QuantizeArgs& a, const float (&x)[8],
                                               uint8_t* head_page, int offset, int chunk,
                                               bool write) {
  constexpr int kLanes = kHeadDim / 8;
  constexpr bool kFp8 = kDtype == KvDtype::kFp8E4M3;
  float mn = x[0], mx = kFp8 ? fabsf(x[0]) : x[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) {
    if constexpr (kFp8) {
      mx = fmaxf(mx, fabsf(x[i]));
    } else {
      mn = fminf(mn, x[i]);
      mx = fmaxf(mx, x[i]);
    }
  }
  const int group_lanes = a.group_size / 8;
  GroupMinMax<kLanes, !kFp8>(group_lanes, mn, mx);
  const GroupMeta meta = MakeGroupMeta<kDtype>(mn, mx);
  const uint2 codes = EncodeLane<kDtype>(x, meta, mn, mx);
  if (!write) return;
  uint8_t* row = head_page + static_cast<size_t>(offset) * a.geo.code_bytes_per_token;
  if constexpr (kDtype == KvDtype::kInt4) {
    *reinterpret_cast<uint32_t*>(row + chunk * 4) = codes.x;
  } else {
    *reinterpret_cast<uint2*>(row + chunk * 8) = codes;
  }
  if (chunk % group_lanes == 0) {
    *reinterpret_cast<uint32_t*>(head_page + a.geo.codes_bytes +
                                 static_cast<size_t>(offset) * a.geo.meta_bytes_per_token +
                                 (chunk / group_lanes) * 4) = meta.word;
  }
}

// Writes one item's fp16 K/V rows to the sink page of its block when its position is a sink.
template <int kHeadDim>
__device__ __forceinline__ void StoreSinks(const QuantizeArgs& a, uint32_t token, int head,
                                           int64_t block, int chunk, uint4 k, uint4 v) {
  const int pos = a.positions[token];
  if (pos < 0 || pos >= a.sink_tokens) return;
  uint8_t* sink = a.sink_pages + static_cast<size_t>(block) * a.geo.sink_page_bytes;
  constexpr size_t kRowBytes = static_cast<size_t>(kHeadDim) * 2;
  const size_t k_row = (static_cast<size_t>(head) * a.sink_tokens + pos) * kRowBytes;
  const size_t v_row =
      (static_cast<size_t>(a.num_kv_heads + head) * a.sink_tokens + pos) * kRowBytes;
  *reinterpret_cast<uint4*>(sink + k_row + chunk * 16) = k;
  *reinterpret_cast<uint4*>(sink + v_row + chunk * 16) = v;
}

// Each group of kHeadDim/8 consecutive lanes handles kItemsPerLaneGroup (token, KV head) items
// (item g + u * lane_groups_in_grid); each lane owns channels [8 chunk, 8 chunk + 8) of K and V
// of an item: 16-byte loads (all issued first), rotation in registers and warp shuffles, group
// min/max by shuffles, quantize, packed stores.
// Grid: ceil(num_items / (kItemsPerLaneGroup * kThreads / (kHeadDim / 8))) blocks of kThreads.
template <KvDtype kDtype, int kHeadDim, int kRot>
__global__ void __launch_bounds__(kThreads) QuantizeAppendKernel(const QuantizeArgs a) {
  constexpr int kLanes = kHeadDim / 8;
  const uint32_t lane_group = (blockIdx.x * kThreads + threadIdx.x) / kLanes;
  const uint32_t lane_groups = gridDim.x * (kThreads / kLanes);
  const int chunk = static_cast<int>(threadIdx.x % kLanes);
  float sign[8];  // the sign vector of this lane's channels, as +-1 multipliers
  SignMultipliers8(SignByte(a.signs, chunk), sign);

  // Inactive lanes keep going with zeros: the shuffles below need every lane of the warp.
  uint4 kraw[kItemsPerLaneGroup], vraw[kItemsPerLaneGroup];
  int64_t slot[kItemsPerLaneGroup];
  uint32_t token[kItemsPerLaneGroup];
#pragma unroll
  for (int u = 0; u < kItemsPerLaneGroup; ++u) {
    const uint32_t item = lane_group + u * lane_groups;
    token[u] = item / static_cast<uint32_t>(a.num_kv_heads);
    kraw[u] = vraw[u] = make_uint4(0, 0, 0, 0);
    slot[u] = -1;
    if (item < a.num_items) {
      const size_t src = static_cast<size_t>(item) * kHeadDim + chunk * 8;
      kraw[u] = LoadStreaming16(a.k + src);
      vraw[u] = LoadStreaming16(a.v + src);
      slot[u] = a.slot_mapping[token[u]];
      if (slot[u] >= a.num_slots) slot[u] = -1;  // the host validated; never write outside
    }
  }
#pragma unroll
  for (int u = 0; u < kItemsPerLaneGroup; ++u) {
    const uint32_t item = lane_group + u * lane_groups;
    const int head = static_cast<int>(item - token[u] * a.num_kv_heads);
    const bool write = slot[u] >= 0;
    const int64_t block = slot[u] >> a.geo.block_tokens_log2;
    const int offset = static_cast<int>(slot[u] & ((1 << a.geo.block_tokens_log2) - 1));
    uint8_t* k_page = a.pages + static_cast<size_t>(block) * a.geo.layer_page_bytes +
                      static_cast<size_t>(head) * a.geo.head_page_bytes;
    uint8_t* v_page = k_page + static_cast<size_t>(a.num_kv_heads) * a.geo.head_page_bytes;
    if (write && a.sink_tokens > 0) {
      StoreSinks<kHeadDim>(a, token[u], head, block, chunk, kraw[u], vraw[u]);
    }
    if constexpr (kDtype == KvDtype::kFp16) {
      if (write) {
        const size_t dst = static_cast<size_t>(offset) * a.geo.code_bytes_per_token + chunk * 16;
        *reinterpret_cast<uint4*>(k_page + dst) = kraw[u];
        *reinterpret_cast<uint4*>(v_page + dst) = vraw[u];
      }
    } else {
      float kx[8], vx[8];
      UnpackHalf8(kraw[u], kx);
      UnpackHalf8(vraw[u], vx);
      if constexpr (kRot > 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          kx[i] *= sign[i];
          vx[i] *= sign[i];
        }
        Hadamard8PerLane<kRot>(kx, chunk);
        Hadamard8PerLane<kRot>(vx, chunk);
      }
      EncodeAndStore<kDtype, kHeadDim>(a, kx, k_page, offset, chunk, write);
      EncodeAndStore<kDtype, kHeadDim>(a, vx, v_page, offset, chunk, write);
    }
  }
}

template <KvDtype kDtype, int kHeadDim, int kRot>
KernelStatus LaunchQuantizeAppend(const QuantizeArgs& a, cudaStream_t stream) {
  constexpr int kItemsPerBlock = kItemsPerLaneGroup * kThreads / (kHeadDim / 8);
  QuantizeAppendKernel<kDtype, kHeadDim, kRot>
      <<<static_cast<unsigned>(CeilDiv(a.num_items, kItemsPerBlock)), kThreads, 0, stream>>>(a);
  return CheckLaunch("QuantizeAppendKernel");
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

// Requires (else kInvalidArgument): a valid layout, 16-byte aligned k, v, pages and sink_pages,
// positions and sink_pages when sink_tokens > 0. The device-side slot mapping cannot be checked
// here: slots outside the arena are skipped by the kernel, and callers validate them (the CUDA
// backend does, on its host copy). kUnsupported: sizes outside DispatchLayout's, group_size not
// a multiple of 8, or more than 2^32 - 2^16 lanes of work.
KernelStatus QuantizeAppend(const QuantizeAppendParams& p, void* stream) {
  const PageLayout& l = p.layout;
  if (ValidatePageLayout(l) != nullptr || p.num_tokens < 0 || p.num_blocks < 0) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.num_tokens == 0) return KernelStatus::kOk;
  if (p.k == nullptr || p.v == nullptr || p.slot_mapping == nullptr || p.pages == nullptr ||
      !Aligned16(p.k) || !Aligned16(p.v) || !Aligned16(p.pages)) {
    return KernelStatus::kInvalidArgument;
  }
  if (l.sink_tokens > 0 &&
      (p.positions == nullptr || p.sink_pages == nullptr || !Aligned16(p.sink_pages))) {
    return KernelStatus::kInvalidArgument;
  }
  if (l.quantized() && l.group_size % 8 != 0) return KernelStatus::kUnsupported;
  const int64_t lanes = static_cast<int64_t>(p.num_tokens) * l.num_kv_heads * (l.head_dim / 8);
  if (lanes > (int64_t{1} << 32) - (int64_t{1} << 16)) return KernelStatus::kUnsupported;

  QuantizeArgs a{};
  a.k = p.k;
  a.v = p.v;
  a.slot_mapping = p.slot_mapping;
  a.positions = p.positions;
  a.pages = p.pages;
  a.sink_pages = p.sink_pages;
  a.num_items = static_cast<uint32_t>(static_cast<int64_t>(p.num_tokens) * l.num_kv_heads);
  a.num_kv_heads = l.num_kv_heads;
  a.num_slots = p.num_blocks * l.block_tokens;
  a.group_size = l.quantized() ? l.group_size : 8;
  a.sink_tokens = l.sink_tokens;
  a.geo = MakePageGeometry(l);
  a.signs = MakeRotationSigns(l);
  const auto s = static_cast<cudaStream_t>(stream);
  return DispatchLayout</*kWithBlockTokens=*/false>(
      l, [&](auto dtype, auto head_dim, auto rot, auto) {
        return LaunchQuantizeAppend<decltype(dtype)::value, decltype(head_dim)::value,
                                    decltype(rot)::value>(a, s);
      });
}

}  // namespace kvpool::cuda
