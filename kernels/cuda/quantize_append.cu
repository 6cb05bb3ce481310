// The fused rotate-quantize-append kernel (DESIGN.md section 5) and kvpool::cuda::QuantizeAppend.
// It reproduces the CPU reference's per-row math (kernels/cpu/page_codec.h) except that the
// rotation runs in fp32 instead of double (tensor-core sums, then butterflies: hadamard_mma.cuh),
// its 1/sqrt(rot_block) is folded into the reciprocal of the scale (meta stays exact), and for
// integer codes of wide groups its last butterfly stage is folded into the codes' fmas
// (kPairStride of EncodeLane, quantize_encode.cuh), so a code may differ by one where x' sits
// within a few fp32 roundings of a half-way point (measured: at most 1.3e-5 of codes,
// quantize_gpu_test). Unrotated rows match the reference bit for bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/hadamard_mma.cuh"
#include "kernels/cuda/quantize_encode.cuh"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool::cuda {
namespace {

using namespace quantize_internal;  // NOLINT: the encode math of quantize_encode.cuh

constexpr int kThreads = 256;
// Channels of a row per lane: hadamard blocks up to 32 need no shuffle, 64 and 128 one and two.
constexpr int kChannels = 32;
// Items (token, head) per lane group, one after the other (item g + u * lane_groups_in_grid):
// the sign masks and Hadamard fragments are set up once per block / thread.
constexpr int kItemsPerLaneGroup = 4;

// Layer y of a launch (grid y, QuantizeAppendLayers) reads k and v, and writes pages and
// sink_pages, y strides past layer 0's, with signs[y].
struct QuantizeArgs {
  const uint16_t* k;            // [num_tokens][num_kv_heads][head_dim] fp16, 16-byte aligned
  const uint16_t* v;            // same shape
  const int64_t* slot_mapping;  // [num_tokens]; < 0 skipped, >= num_slots skipped
  const int32_t* positions;     // [num_tokens]; read only when sink_tokens > 0
  uint8_t* pages;               // [num_blocks][layer_page_bytes], 16-byte aligned
  uint8_t* sink_pages;          // [num_sink_blocks][sink_page_bytes]; when sink_tokens > 0
  QuantizeLayerStrides stride;  // bytes from one layer's k / v, pages, sink_pages to the next
  uint32_t num_items;           // num_tokens * num_kv_heads, < 2^31
  int num_kv_heads;
  int64_t num_slots;  // num_blocks * block_tokens
  int64_t num_sink_blocks;
  int group_size;  // channels per {scale, zero}: a power of two >= 8 dividing head_dim
  int group_log2;  // log2(group_size)
  int sink_tokens;
  PageGeometry geo;
  RotationSigns signs[kMaxQuantizeLayers];
};

// Quantizes one row (K or V of an item) from its raw fp16 words, 32 consecutive channels per
// lane (lane `chunk` of kHeadDim / 32 consecutive lanes of the warp): sign flip (`sign_masks`,
// the masks of the lane's 16 raw words) and Hadamard (HadamardMma32PerLane with `hadamard_b` from
// HadamardMmaFragments<kRot>) when kRot > 0, per-group min / max (in-lane, then shuffles for groups
// wider than a lane), codes stored at `codes_dst` (the lane's bytes of the token's code row) and
// meta at `meta_dst` (the meta of the lane's first group) when `write`, the meta of a wide group by
// its first lane (`meta_lane`). kWideGroups: groups of at least 32 channels (one {scale, zero} over
// each lane's channels), else groups of 8 or 16. Every lane of the warp must call it.
template <KvDtype kDtype, int kHeadDim, int kRot, bool kWideGroups>
__device__ __forceinline__ void EncodeAndStore(const QuantizeArgs& a, const uint4 (&raw)[4],
                                               const uint4 (&sign_masks)[4],
                                               const uint32_t (&hadamard_b)[4], uint8_t* codes_dst,
                                               uint8_t* meta_dst, bool write, bool meta_lane) {
  constexpr int kLanes = kHeadDim / kChannels;
  constexpr bool kFp8 = kDtype == KvDtype::kFp8E4M3;
  // Integer codes of wide groups take the Hadamard's last butterfly stage into the encode
  // (EncodeLane's kPairStride): the pair (a, c) has extremes a + |c| and a - |c|, exact, so the
  // min / max tree starts from 16 pairs, and the codes take 3 fma per pair.
  constexpr int kPairStride = kRot > 0 && kWideGroups && !kFp8 ? HadamardLastStride(kRot) : 0;
  float x[32];
  // x holds the bare transform (no 1/sqrt(kRot)); x' = x * norm, and RN(x * norm) is monotonic
  // in x, so the group extremes of x' are the rounded extremes of x.
  float norm = 1.0f;
  if constexpr (kRot > 0) {
    uint4 flipped[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4 m = sign_masks[w];
      flipped[w] = make_uint4(raw[w].x ^ m.x, raw[w].y ^ m.y, raw[w].z ^ m.z, raw[w].w ^ m.w);
    }
    HadamardMma32PerLane<kRot, /*kSkipLast=*/(kPairStride > 0)>(flipped, hadamard_b, x);
    norm = HadamardNorm(kRot);
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float part[8];
      UnpackHalf8(raw[w], part);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[8 * w + i] = part[i];
    }
  }
  float mn[4], mx[4];  // of x, per 8 channels (FP8: mx = max |x|); with pairs [0] only
  if constexpr (kPairStride > 0) {
    float lo[16], hi[16];
#pragma unroll
    for (int p = 0; p < 16; ++p) {  // pair p: channel i (bit kPairStride clear) and i + stride
      const int i = (p & (kPairStride - 1)) | ((p & ~(kPairStride - 1)) << 1);
      lo[p] = __fsub_rn(x[i], fabsf(x[i + kPairStride]));
      hi[p] = __fadd_rn(x[i], fabsf(x[i + kPairStride]));
    }
    // Trees, not chains (a loop over the widths left the arrays in local memory).
    auto fold = [&](auto width) {
#pragma unroll
      for (int p = 0; p < decltype(width)::value; ++p) {
        lo[p] = fminf(lo[p], lo[p + decltype(width)::value]);
        hi[p] = fmaxf(hi[p], hi[p + decltype(width)::value]);
      }
    };
    fold(std::integral_constant<int, 8>{});
    fold(std::integral_constant<int, 4>{});
    fold(std::integral_constant<int, 2>{});
    fold(std::integral_constant<int, 1>{});
    mn[0] = lo[0];
    mx[0] = hi[0];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mn[j] = x[8 * j];
      mx[j] = kFp8 ? fabsf(x[8 * j]) : x[8 * j];
#pragma unroll
      for (int i = 8 * j + 1; i < 8 * j + 8; ++i) {
        if constexpr (kFp8) {
          mx[j] = fmaxf(mx[j], fabsf(x[i]));
        } else {
          mn[j] = fminf(mn[j], x[i]);
          mx[j] = fmaxf(mx[j], x[i]);
        }
      }
    }
  }
  GroupMeta meta[4];
  uint32_t codes[8];
  if constexpr (kWideGroups) {  // one group over the lane's channels: meta[0], mn[0], mx[0]
    if constexpr (kPairStride == 0) {
      mn[0] = fminf(fminf(mn[0], mn[1]), fminf(mn[2], mn[3]));
      mx[0] = fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3]));
    }
    GroupMinMax<kLanes, !kFp8>(1 << (a.group_log2 - 5), mn[0], mx[0]);
    meta[0] = MakeGroupMeta<kDtype>(__fmul_rn(mn[0], norm), __fmul_rn(mx[0], norm));
    EncodeLane<kDtype, /*kOneMeta=*/true, kPairStride>(x, meta, mn, mx, norm, codes);
  } else {
    if (a.group_size == 16) {
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        mn[j] = mn[j + 1] = fminf(mn[j], mn[j + 1]);
        mx[j] = mx[j + 1] = fmaxf(mx[j], mx[j + 1]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      meta[j] = MakeGroupMeta<kDtype>(__fmul_rn(mn[j], norm), __fmul_rn(mx[j], norm));
    }
    EncodeLane<kDtype, /*kOneMeta=*/false>(x, meta, mn, mx, norm, codes);
  }
  if (!write) return;
  *reinterpret_cast<uint4*>(codes_dst) = make_uint4(codes[0], codes[1], codes[2], codes[3]);
  if constexpr (kDtype != KvDtype::kInt4) {
    *reinterpret_cast<uint4*>(codes_dst + 16) = make_uint4(codes[4], codes[5], codes[6], codes[7]);
  }
  if constexpr (kWideGroups) {
    if (meta_lane) *reinterpret_cast<uint32_t*>(meta_dst) = meta[0].word;
  } else {
    const int chunks_per_group = a.group_size / 8;  // 1 or 2
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j % chunks_per_group == 0) {
        *reinterpret_cast<uint32_t*>(meta_dst + ((8 * j) >> a.group_log2) * 4) = meta[j].word;
      }
    }
  }
}

// Byte offset in an fp16 row of the lane's 16-byte word w. kContiguous: the lane's words are
// channels [32 chunk, 32 chunk + 32); else word w is channels [8 (w kLanes + chunk), + 8), so
// each load / store instruction of the warp covers whole rows (the fp16 copy: no rotation).
template <int kHeadDim, bool kContiguous>
__host__ __device__ constexpr int WordByte(int chunk, int w) {
  return kContiguous ? chunk * 64 + 16 * w : 16 * (w * (kHeadDim / kChannels) + chunk);
}

// Writes one item's fp16 K/V words to the sink page of its block when its position is a sink.
template <int kHeadDim, bool kContiguous>
__device__ __forceinline__ void StoreSinks(const QuantizeArgs& a, uint8_t* sink_pages,
                                           uint32_t token, int head, int64_t block, int chunk,
                                           const uint4 (&k)[4], const uint4 (&v)[4]) {
  const int pos = a.positions[token];
  // The host validated; never write past the sink arena.
  if (pos < 0 || pos >= a.sink_tokens || block >= a.num_sink_blocks) return;
  uint8_t* sink = sink_pages + static_cast<size_t>(block) * a.geo.sink_page_bytes;
  constexpr size_t kRowBytes = static_cast<size_t>(kHeadDim) * 2;
  uint8_t* k_row = sink + (static_cast<size_t>(head) * a.sink_tokens + pos) * kRowBytes;
  uint8_t* v_row =
      sink + (static_cast<size_t>(a.num_kv_heads + head) * a.sink_tokens + pos) * kRowBytes;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    *reinterpret_cast<uint4*>(k_row + WordByte<kHeadDim, kContiguous>(chunk, w)) = k[w];
    *reinterpret_cast<uint4*>(v_row + WordByte<kHeadDim, kContiguous>(chunk, w)) = v[w];
  }
}

// An item (token, KV head) of a lane group, advanced by the grid's lane groups without a division.
struct ItemPos {
  uint32_t item, token;
  int head;
};

// The ring: per warp and slot, the K rows then the V rows of the warp's items of one round,
// 2 KB each (32 lanes x 64 bytes, the items of consecutive lane groups being consecutive rows).
// Copies are coalesced: lane L copies 16-byte units 32 i + L. A lane then reads its own 4 words
// of each row from the units Unit() names, swizzled (unit j lives at j ^ ((j >> 3) & 3)) so that
// the 8 lanes of a quarter-warp hit 8 different bank groups.
constexpr int kRingSlots = 3;       // the round being encoded and the two in flight
constexpr int kWarpRowUnits = 128;  // 16-byte units of a warp's K (or V) rows
constexpr size_t kRingBytes =
    static_cast<size_t>(kRingSlots) * (kThreads / 32) * 2 * kWarpRowUnits * sizeof(uint4);

__host__ __device__ constexpr int Swizzle(int j) { return j ^ ((j >> 3) & 3); }

// The unit of lane `lane`'s word w within its warp's rows (WordByte's order).
template <int kHeadDim, bool kContiguous>
__host__ __device__ constexpr int Unit(int lane, int w) {
  constexpr int kLanes = kHeadDim / kChannels;
  const int group = lane / kLanes, chunk = lane % kLanes;
  return group * (kHeadDim / 8) + WordByte<kHeadDim, kContiguous>(chunk, w) / 16;
}

// Where word w of a lane lies in its warp's rows, Swizzle(Unit(lane, w)), is that of its word 0
// XOR a constant of w alone (the lane's and w's bits of a unit are disjoint, and so are their
// parts of the swizzle): the lane keeps one unit and the loop's reads need no swizzle arithmetic.
template <int kHeadDim, bool kContiguous>
__host__ __device__ constexpr int WordUnitXor(int w) {
  return Swizzle(Unit<kHeadDim, kContiguous>(0, w)) ^ Swizzle(Unit<kHeadDim, kContiguous>(0, 0));
}
template <int kHeadDim, bool kContiguous>
constexpr bool WordUnitXorHolds() {
  for (int lane = 0; lane < 32; ++lane) {
    for (int w = 0; w < 4; ++w) {
      if (Swizzle(Unit<kHeadDim, kContiguous>(lane, w)) !=
          (Swizzle(Unit<kHeadDim, kContiguous>(lane, 0)) ^ WordUnitXor<kHeadDim, kContiguous>(w))) {
        return false;
      }
    }
  }
  return true;
}

// Starts the copies of the warp's K and V rows (the layer's, at `k` and `v`) of the round whose
// first item is `first` (zeros past the end) into the warp's rows of a ring slot, `rows`, as one
// cp.async group per lane. Unit j = 32 i + lane holds fp16 values [8 j, 8 j + 8) from the
// round's first value on, of item first + j / (kHeadDim / 8), and lands at unit Swizzle(j) =
// 32 i + Swizzle(lane): copy i is 512 i bytes past the lane's first in both memories. A copy
// past the last item reads nothing (zero fill), so its address is formed like the others.
template <int kHeadDim>
__device__ __forceinline__ void IssueRound(const QuantizeArgs& a, const uint8_t* k,
                                           const uint8_t* v, uint32_t first, uint4* rows) {
  constexpr int kUnitsPerItem = kHeadDim / 8;
  const int lane = threadIdx.x % 32;
  uint4* k_dst = rows + Swizzle(lane);
  uint4* v_dst = k_dst + kWarpRowUnits;
  const size_t at = static_cast<size_t>(first) * (kHeadDim * 2) + lane * 16;  // bytes
  const uint8_t* k_src = k + at;
  const uint8_t* v_src = v + at;
  // Items from that of the lane's unit of pass 0 to the end (not positive: none). 32 bits hold
  // it: num_items < 2^31, and a round's first item is below 4 lane_groups, which
  // LaunchQuantizeAppend's grid keeps below num_items + 512, or below 8 x 128 per SM.
  const int32_t left = static_cast<int32_t>(a.num_items - first) - lane / kUnitsPerItem;
  auto copy = [&](auto i) {
    constexpr int kI = decltype(i)::value;
    const bool valid = 32 * kI / kUnitsPerItem < left;
    CpAsync16OrZero<512 * kI>(k_dst, k_src, valid);
    CpAsync16OrZero<512 * kI>(v_dst, v_src, valid);
  };
  static_assert(kWarpRowUnits / 32 == 4, "four copies per lane and round");
  copy(std::integral_constant<int, 0>{});
  copy(std::integral_constant<int, 1>{});
  copy(std::integral_constant<int, 2>{});
  copy(std::integral_constant<int, 3>{});
  CpAsyncCommit();
}

// The slot of `pos`; -1 (no write) past the end or outside the arena.
__device__ __forceinline__ int64_t LoadSlot(const QuantizeArgs& a, const ItemPos& pos) {
  if (pos.item >= a.num_items) return -1;
  const int64_t slot = a.slot_mapping[pos.token];
  return slot < a.num_slots ? slot : -1;  // the host validated; never write outside
}

// Each group of kHeadDim/32 consecutive lanes handles up to kItemsPerLaneGroup (token, KV head)
// items (item g + u * lane_groups_in_grid), one after the other, in rounds: a warp's items of a
// round are consecutive rows, which it copies into its ring slot (IssueRound) two rounds ahead of
// the one it encodes, so that loads stay in flight through the rotation's arithmetic without
// holding registers. Each lane owns 32 channels of K and V of an item: four 16-byte words each from
// the ring, sign flip on the raw fp16 words, rotation by tensor cores and butterflies in registers
// (no shuffles), quantize, packed stores.
// Grid: at least ceil(num_items / (kItemsPerLaneGroup * kThreads / (kHeadDim / 32))) blocks of
// kThreads along x per layer of the launch along y (LaunchQuantizeAppend), kRingBytes (96 KB) of
// dynamic shared memory each. 2 blocks per SM (<= 128 registers, no spills). Measured on the H200
// (tests/bench/results/experiments_2026-11-29.md): against loads into registers one item ahead,
// unrotated and INT8 / FP8 cases 5-14% faster, rotated INT4 1-5% (bound by its instructions now); 3
// blocks per SM with a 2-slot ring (80 registers) spilled and was slower, and so were 8 items per
// lane group. One build per group width (kWideGroups, EncodeAndStore) and per sink use (kSinks):
// with both encode paths in one kernel, INT4 rot128 took 0.408-0.412 ms for 1 GiB against
// 0.373-0.377 ms for the wide path alone (INT8 rot128 0.448 against 0.417-0.421); without the
// sink stores' code then 0.370-0.372 against 0.380-0.381 ms in one call.
template <KvDtype kDtype, int kHeadDim, int kRot, bool kWideGroups, bool kSinks>
__global__ void __launch_bounds__(kThreads, 2) QuantizeAppendKernel(const QuantizeArgs a) {
  constexpr int kLanes = kHeadDim / kChannels;
  constexpr bool kFp16 = kDtype == KvDtype::kFp16;
  // A decode step's attention, launched next as a programmatic dependent, may start its launch
  // now; it waits for this kernel's writes before it reads (GridDependencyWait).
  AllowDependentLaunch();
  const uint32_t lane_group = (blockIdx.x * kThreads + threadIdx.x) / kLanes;
  const uint32_t lane_groups = gridDim.x * (kThreads / kLanes);
  const int chunk = static_cast<int>(threadIdx.x % kLanes);
  // The lane's sign masks (HalfSignMasks32 of its chunk) in 16 registers (116 in all for INT4
  // rot128, no spills), kept: rebuilt or reloaded for every row they cost 8 or more instructions
  // per item.
  const int layer = static_cast<int>(blockIdx.y);
  // This layer's inputs and pages, computed once (left to itself the compiler recomputes the
  // offsets in the item loop: 12 more loop instructions and INT4 rot128 1-2% slower).
  const uint8_t* const k_in =
      KeepInRegister(reinterpret_cast<const uint8_t*>(a.k) + layer * a.stride.kv);
  const uint8_t* const v_in =
      KeepInRegister(reinterpret_cast<const uint8_t*>(a.v) + layer * a.stride.kv);
  uint8_t* const pages = KeepInRegister(a.pages + layer * a.stride.pages);
  uint4 lane_signs[4] = {};
  uint32_t hadamard_b[4] = {};
  if constexpr (kRot > 0) {
    uint32_t m[16];
    HalfSignMasks32(a.signs[layer], chunk, m);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      lane_signs[w] = make_uint4(KeepInRegister(m[4 * w]), KeepInRegister(m[4 * w + 1]),
                                 KeepInRegister(m[4 * w + 2]), KeepInRegister(m[4 * w + 3]));
    }
    HadamardMmaFragments<kRot>(hadamard_b);
  }

  const uint32_t heads = static_cast<uint32_t>(a.num_kv_heads);
  const uint32_t step_tokens = lane_groups / heads;
  const int step_heads = static_cast<int>(lane_groups - step_tokens * heads);
  ItemPos pos{lane_group, lane_group / heads, 0};
  pos.head = static_cast<int>(lane_group - pos.token * heads);
  // 128-byte aligned: a ring 16 bytes off (after a 16-byte static array) made every unrotated
  // kernel 12% slower (results/experiments_2026-11-29.md, "Thirteenth session").
  extern __shared__ __align__(128) uint4 ring[];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  // The warp's first item of round u: that of its lane 0.
  const uint32_t warp_first = lane_group - static_cast<uint32_t>(lane / kLanes);
  // The warp's rows in ring slot s: warp_rows + s * kSlotUnits (K, then V kWarpRowUnits on).
  constexpr int kSlotUnits = (kThreads / 32) * 2 * kWarpRowUnits;
  uint4* const warp_rows = ring + warp * 2 * kWarpRowUnits;
  // Rounds u + 1 .. u + kRingSlots - 1 are in flight while round u is encoded.
#pragma unroll
  for (int u = 0; u < kRingSlots - 1; ++u) {
    IssueRound<kHeadDim>(a, k_in, v_in, warp_first + u * lane_groups, warp_rows + u * kSlotUnits);
  }
  int read_slot = 0;  // the ring slot of round u, u % kRingSlots
  static_assert(WordUnitXorHolds<kHeadDim, !kFp16>() && kSlotUnits % kWarpRowUnits == 0,
                "word units are the lane's unit XOR a constant, within the warp's rows");
  const int lane_unit = static_cast<int>(KeepInRegister(Swizzle(Unit<kHeadDim, !kFp16>(lane, 0))));
  // The lane's bytes in a token's row of a head page: its codes, and the meta of its first group
  // (channel 32 chunk), which it stores when it is its group's first lane (wide groups).
  const uint32_t lane_codes = chunk * kChannels * DtypeBits(kDtype) / 8;
  const uint32_t lane_meta = a.geo.codes_bytes + ((chunk * kChannels) >> a.group_log2) * 4;
  const bool meta_lane = (chunk & ((1 << max(a.group_log2 - 5, 0)) - 1)) == 0;
  const size_t v_minus_k = static_cast<size_t>(a.num_kv_heads) * a.geo.head_page_bytes;
  int64_t slot = LoadSlot(a, pos);
#pragma unroll 1
  for (int u = 0; u < kItemsPerLaneGroup; ++u) {
    // Items grow with the lane and with u: once the whole warp is past the end, it is done.
    // Otherwise inactive lanes keep going with zeros: the shuffles need every lane of the warp.
    if (__all_sync(0xffffffffu, pos.item >= a.num_items)) break;
    const uint32_t token = pos.token;
    const int head = pos.head;
    pos.item += lane_groups;
    pos.token += step_tokens;
    pos.head += step_heads;
    if (pos.head >= a.num_kv_heads) {
      pos.head -= a.num_kv_heads;
      ++pos.token;
    }
    CpAsyncWait<kRingSlots - 2>();  // this lane's copies of round u have landed
    __syncwarp();                   // and every lane's; round u - 1's reads are all done
    const int word0 = read_slot * kSlotUnits + lane_unit;
    uint4 cur_k[4], cur_v[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int unit = word0 ^ WordUnitXor<kHeadDim, !kFp16>(w);
      cur_k[w] = warp_rows[unit];
      cur_v[w] = warp_rows[kWarpRowUnits + unit];
    }
    // The slot of round u - 1 takes round u + kRingSlots - 1 (an empty group past the lane
    // group's rounds keeps the wait count uniform).
    const int free_slot = read_slot == 0 ? kRingSlots - 1 : read_slot - 1;
    if (u + kRingSlots - 1 < kItemsPerLaneGroup) {
      IssueRound<kHeadDim>(a, k_in, v_in, warp_first + (u + kRingSlots - 1) * lane_groups,
                           warp_rows + free_slot * kSlotUnits);
    } else {
      CpAsyncCommit();
    }
    read_slot = read_slot == kRingSlots - 1 ? 0 : read_slot + 1;
    const int64_t next_slot = u + 1 < kItemsPerLaneGroup ? LoadSlot(a, pos) : -1;
    const bool write = slot >= 0;
    const int64_t block = slot >> a.geo.block_tokens_log2;
    const int offset = static_cast<int>(slot & ((1 << a.geo.block_tokens_log2) - 1));
    uint8_t* k_page = pages + static_cast<size_t>(block) * a.geo.layer_page_bytes +
                      static_cast<size_t>(head) * a.geo.head_page_bytes;
    uint8_t* v_page = k_page + v_minus_k;
    if (kSinks && write) {
      StoreSinks<kHeadDim, !kFp16>(a, a.sink_pages + layer * a.stride.sink_pages, token, head,
                                   block, chunk, cur_k, cur_v);
    }
    if constexpr (kFp16) {
      if (write) {
        uint8_t* k_row = k_page + static_cast<size_t>(offset) * a.geo.code_bytes_per_token;
        uint8_t* v_row = v_page + static_cast<size_t>(offset) * a.geo.code_bytes_per_token;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          *reinterpret_cast<uint4*>(k_row + WordByte<kHeadDim, false>(chunk, w)) = cur_k[w];
          *reinterpret_cast<uint4*>(v_row + WordByte<kHeadDim, false>(chunk, w)) = cur_v[w];
        }
      }
    } else {
      const uint32_t codes_at = offset * a.geo.code_bytes_per_token + lane_codes;
      const uint32_t meta_at = offset * a.geo.meta_bytes_per_token + lane_meta;
      EncodeAndStore<kDtype, kHeadDim, kRot, kWideGroups>(
          a, cur_k, lane_signs, hadamard_b, k_page + codes_at, k_page + meta_at, write, meta_lane);
      EncodeAndStore<kDtype, kHeadDim, kRot, kWideGroups>(
          a, cur_v, lane_signs, hadamard_b, v_page + codes_at, v_page + meta_at, write, meta_lane);
    }
    slot = next_slot;
  }
}

// Grid: enough blocks for kItemsPerLaneGroup items per lane group, or more, up to two per SM, where
// that leaves fewer items to each (a decode step's append of one token per sequence, which the
// attention waits for): the items then run side by side, their lane groups stopping early,
// instead of one after the other in a few blocks. The kernel's code does not change with it. The
// same grid for each of num_layers layers, along y.
template <KvDtype kDtype, int kHeadDim, int kRot, bool kWideGroups, bool kSinks>
KernelStatus LaunchQuantizeAppend(const QuantizeArgs& a, int num_layers, cudaStream_t stream) {
  constexpr int kLaneGroupsPerBlock = kThreads / (kHeadDim / kChannels);
  int sms = 0;
  KVPOOL_CUDA_RETURN_IF_ERROR(CurrentDeviceSms(&sms));
  const int64_t blocks =
      std::max(CeilDiv(a.num_items, kItemsPerLaneGroup * kLaneGroupsPerBlock),
               std::min(CeilDiv(a.num_items, kLaneGroupsPerBlock), int64_t{2} * sms));
  constexpr auto kernel = QuantizeAppendKernel<kDtype, kHeadDim, kRot, kWideGroups, kSinks>;
  KVPOOL_CUDA_RETURN_IF_ERROR((AllowDynamicSharedMemory<kernel, static_cast<int>(kRingBytes)>()));
  kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(num_layers)), kThreads,
           kRingBytes, stream>>>(a);
  return CheckLaunch("QuantizeAppendKernel");
}

}  // namespace

// Requires (else kInvalidArgument): a valid layout, 16-byte aligned k, v, pages and sink_pages
// (and strides), positions and sink_pages when sink_tokens > 0, 1 to kMaxQuantizeLayers layers.
// The device-side slot mapping cannot be checked here: slots outside the arena, and sink tokens
// in blocks from num_sink_blocks on, are skipped by the kernel, and callers validate them (the
// CUDA backend does, on its host copy). kUnsupported: sizes outside DispatchLayout's, group_size
// not a multiple of 8, or 2^31 items (tokens x KV heads) or more.
KernelStatus QuantizeAppendLayers(const QuantizeAppendParams& p, int num_layers,
                                  const QuantizeLayerStrides& stride, const uint64_t* sign_seeds,
                                  void* stream) {
  const PageLayout& l = p.layout;
  if (ValidatePageLayout(l) != nullptr || p.num_tokens < 0 || p.num_blocks < 0 || num_layers < 1 ||
      num_layers > kMaxQuantizeLayers || sign_seeds == nullptr) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.num_tokens == 0) return KernelStatus::kOk;
  auto aligned = [](int64_t bytes) { return bytes % 16 == 0; };
  if (p.k == nullptr || p.v == nullptr || p.slot_mapping == nullptr || p.pages == nullptr ||
      !Aligned16(p.k) || !Aligned16(p.v) || !Aligned16(p.pages) || !aligned(stride.kv) ||
      !aligned(stride.pages)) {
    return KernelStatus::kInvalidArgument;
  }
  if (l.sink_tokens > 0 && (p.positions == nullptr || p.sink_pages == nullptr ||
                            !Aligned16(p.sink_pages) || !aligned(stride.sink_pages))) {
    return KernelStatus::kInvalidArgument;
  }
  if ((l.quantized() && l.group_size % 8 != 0) || !FitsPageGeometry(l)) {
    return KernelStatus::kUnsupported;
  }
  const int64_t items = static_cast<int64_t>(p.num_tokens) * l.num_kv_heads;
  if (items >= (int64_t{1} << 31)) return KernelStatus::kUnsupported;

  QuantizeArgs a{};
  a.k = p.k;
  a.v = p.v;
  a.slot_mapping = p.slot_mapping;
  a.positions = p.positions;
  a.pages = p.pages;
  a.sink_pages = p.sink_pages;
  a.stride = stride;
  a.num_items = static_cast<uint32_t>(items);
  a.num_kv_heads = l.num_kv_heads;
  a.num_slots = p.num_blocks * l.block_tokens;
  a.num_sink_blocks = p.num_sink_blocks;
  a.group_size = l.quantized() ? l.group_size : 8;
  a.group_log2 = __builtin_ctz(static_cast<unsigned>(a.group_size));
  a.sink_tokens = l.sink_tokens;
  a.geo = MakePageGeometry(l);
  for (int i = 0; i < num_layers; ++i) {
    PageLayout seeded = l;
    seeded.sign_seed = sign_seeds[i];
    a.signs[i] = MakeRotationSigns(seeded);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  return DispatchLayout</*kWithBlockTokens=*/false>(
      l, [&](auto dtype, auto head_dim, auto rot, auto) {
        constexpr KvDtype kDtype = decltype(dtype)::value;
        constexpr int kHeadDim = decltype(head_dim)::value, kRot = decltype(rot)::value;
        auto launch = [&](auto wide) {
          constexpr bool kWide = decltype(wide)::value;
          return a.sink_tokens > 0
                     ? LaunchQuantizeAppend<kDtype, kHeadDim, kRot, kWide, true>(a, num_layers, s)
                     : LaunchQuantizeAppend<kDtype, kHeadDim, kRot, kWide, false>(a, num_layers, s);
        };
        if constexpr (kDtype == KvDtype::kFp16) {  // no groups
          return launch(std::true_type{});
        } else {
          return a.group_size >= kChannels ? launch(std::true_type{}) : launch(std::false_type{});
        }
      });
}

KernelStatus QuantizeAppend(const QuantizeAppendParams& p, void* stream) {
  return QuantizeAppendLayers(p, 1, QuantizeLayerStrides{}, &p.layout.sign_seed, stream);
}

}  // namespace kvpool::cuda
