// Shared by every CUDA kernel file of kvpool: error checking that records LastErrorMessage(),
// fp16/fp8 device conversions, 16-byte vector helpers, warp reductions, and the ONE dispatch
// helper that turns a layout's runtime (dtype, head_dim, rot_block, block_tokens) into template
// constants, with a kUnsupported default for every size the kernels were not compiled for.
#ifndef KVPOOL_KERNELS_CUDA_CUDA_COMMON_CUH_
#define KVPOOL_KERNELS_CUDA_CUDA_COMMON_CUH_

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool::cuda {

// ---- errors ------------------------------------------------------------------------------------

// Records "<what>: <cudaGetErrorString(err)>" as this thread's LastErrorMessage() (defined in
// cuda_runtime.cu). Returns kCudaError so callers can `return RecordCudaError(...)`.
KernelStatus RecordCudaError(cudaError_t err, const char* what);

// kOk when err == cudaSuccess, else records it and returns kCudaError.
inline KernelStatus CheckCuda(cudaError_t err, const char* what) {
  return err == cudaSuccess ? KernelStatus::kOk : RecordCudaError(err, what);
}

// Checks the launch just enqueued (configuration errors; asynchronous faults surface on the next
// synchronizing call, which is checked too).
inline KernelStatus CheckLaunch(const char* kernel_name) {
  return CheckCuda(cudaGetLastError(), kernel_name);
}

// Returns from the enclosing function (which returns KernelStatus) when a CUDA call fails.
#define KVPOOL_CUDA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                      \
    const ::kvpool::KernelStatus kvpool_status_ = ::kvpool::cuda::CheckCuda((expr), #expr); \
    if (kvpool_status_ != ::kvpool::KernelStatus::kOk) return kvpool_status_;               \
  } while (0)

// ---- fp16 / fp8 --------------------------------------------------------------------------------

__device__ __forceinline__ float HalfBitsToFloat(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
// Round-to-nearest-even, like kvpool::FloatToHalf on the host.
__device__ __forceinline__ uint16_t FloatToHalfBits(float f) {
  return __half_as_ushort(__float2half_rn(f));
}
__device__ __forceinline__ float Fp8E4M3BitsToFloat(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}
// 8 fp16 values (one 16-byte load) <-> 8 floats.
__device__ __forceinline__ void UnpackHalf8(const uint4& in, float (&out)[8]) {
  const uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ uint4 PackHalf8(const float (&in)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = static_cast<uint32_t>(FloatToHalfBits(in[2 * i])) |
           (static_cast<uint32_t>(FloatToHalfBits(in[2 * i + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Streaming 16-byte load of data read once (not kept in L1).
__device__ __forceinline__ uint4 LoadStreaming16(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// Returns x, computed once: the compiler cannot rebuild it inside a loop (from the kernel
// parameters, threadIdx or shared memory, which it prefers to holding a register), as the value
// comes out of an empty asm.
template <typename T>
__device__ __forceinline__ T* KeepInRegister(T* p) {
  asm volatile("" : "+l"(p));
  return p;
}
__device__ __forceinline__ uint32_t KeepInRegister(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// ---- asynchronous copies into shared memory
// ------------------------------------------------------

// 16-byte copies that bypass registers and L1, with the L2 told to fetch the whole 128-byte line:
// measured on the H200 (results/experiments_2026-11-29.md, "Seventh session"), 1-3.5% faster on
// every attention format and shape than without the hint, and faster than a 256-byte one.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
// Copies 16 bytes when `valid`, else writes 16 zero bytes and reads nothing: branch-free, so the
// source addresses of a tile's copies are computed once, not under each copy's predicate.
// kOffset bytes are added to both addresses inside the instruction, so copies at constant
// offsets from one pair of base addresses need no address arithmetic of their own.
template <int kOffset = 0>
__device__ __forceinline__ void CpAsync16OrZero(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0+%3], [%1+%3], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0), "n"(kOffset));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most kPending of this thread's committed groups are still in flight; the
// landed copies are then visible to this thread (to other threads after a barrier).
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- warp reductions ---------------------------------------------------------------------------

// Max / sum over aligned groups of kWidth lanes (a power of two <= 32); every lane of a
// group gets the group's result. All 32 lanes of the warp must call it.
template <int kWidth>
__device__ __forceinline__ float GroupMax(float x) {
#pragma unroll
  for (int m = 1; m < kWidth; m <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
template <int kWidth>
__device__ __forceinline__ float GroupSum(float x) {
#pragma unroll
  for (int m = 1; m < kWidth; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// ---- page addressing ---------------------------------------------------------------------------

// The byte sizes of a layout that kernels address pages with, computed once on the host
// (kernels/page_layout.h defines them). block_tokens must be a power of two.
struct PageGeometry {
  uint64_t layer_page_bytes;
  uint32_t head_page_bytes;
  uint32_t codes_bytes;  // codes part of a head page; meta follows
  uint32_t code_bytes_per_token;
  uint32_t meta_bytes_per_token;  // 4 per group
  uint32_t sink_page_bytes;
  int block_tokens_log2;
};

// Whether a layout's head and sink pages fit PageGeometry's 32-bit sizes (under 4 GiB each).
inline bool FitsPageGeometry(const PageLayout& l) {
  return l.head_page_bytes() <= UINT32_MAX && l.sink_page_bytes() <= UINT32_MAX;
}
inline PageGeometry MakePageGeometry(const PageLayout& l) {
  PageGeometry g{};
  g.layer_page_bytes = l.layer_page_bytes();
  g.head_page_bytes = static_cast<uint32_t>(l.head_page_bytes());
  g.codes_bytes = static_cast<uint32_t>(l.codes_bytes());
  g.code_bytes_per_token = static_cast<uint32_t>(l.code_bytes_per_token());
  g.meta_bytes_per_token = static_cast<uint32_t>(l.meta_bytes_per_token());
  g.sink_page_bytes = static_cast<uint32_t>(l.sink_page_bytes());
  while ((1 << g.block_tokens_log2) < l.block_tokens) ++g.block_tokens_log2;
  return g;
}

// ---- rotation ----------------------------------------------------------------------------------

// The layout's per-channel sign vector as a bitmask (bit c set = RotationSign(seed, c) < 0),
// computed once on the host and passed to kernels by value. head_dim <= 256.
struct RotationSigns {
  uint32_t bits[8];
};
inline RotationSigns MakeRotationSigns(const PageLayout& layout) {
  RotationSigns s{};
  for (int c = 0; c < layout.head_dim && c < 256; ++c) {
    if (RotationSign(layout.sign_seed, c) < 0.0f) s.bits[c / 32] |= 1u << (c % 32);
  }
  return s;
}
// The 8 sign bits of channels [8 * chunk, 8 * chunk + 8), bit i for channel 8 * chunk + i.
__device__ __forceinline__ uint32_t SignByte(const RotationSigns& s, int chunk) {
  return (s.bits[chunk >> 2] >> ((chunk & 3) * 8)) & 0xffu;
}
// The sign bits of channels [32 * chunk32, 32 * chunk32 + 32) as 16 xor masks on packed half2
// words: mask j flips the fp16 sign bit of channel 2j (bit 15) and 2j + 1 (bit 31) where the
// channel's sign is -1. Xor-ing the raw fp16 words is exact and costs one op per two channels.
__device__ __forceinline__ void HalfSignMasks32(const RotationSigns& s, int chunk32,
                                                uint32_t (&mask)[16]) {
  const uint32_t bits = s.bits[chunk32];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const uint32_t pair = (bits >> (2 * j)) & 3u;
    mask[j] = ((pair & 1u) << 15) | ((pair & 2u) << 30);
  }
}
// x[i] *= -1 where bit i of `sign_byte` is set (exact: flips the sign bit).
__device__ __forceinline__ void ApplySigns8(uint32_t sign_byte, float (&x)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = __uint_as_float(__float_as_uint(x[i]) ^ (((sign_byte >> i) & 1u) << 31));
  }
}

// 1/sqrt(rot) as a float: the normalization of a Hadamard block of rot (16..128) channels.
__host__ __device__ constexpr float HadamardNorm(int rot) {
  return rot == 16   ? 0.25f
         : rot == 32 ? 0.17677669529663687f
         : rot == 64 ? 0.125f
                     : 0.088388347648318440f;
}

// Normalized block-diagonal Walsh-Hadamard of block `rot` (0 = identity) over a vector spread as
// 8 consecutive channels per lane: lane `chunk` of the vector holds channels [8 chunk, 8 chunk+8)
// and the vector's lanes are aligned consecutive lanes of the warp. Butterflies run in the order
// h = 1, 2, 4, ... rot/2 as (a + b, a - b) in fp32 (the CPU reference's order), then every value
// is multiplied by 1/sqrt(rot). All 32 lanes of the warp must call it, with the same rot (a
// compile-time constant unrolls it). H is symmetric and orthogonal, so the same call also
// un-rotates.
__device__ __forceinline__ void Hadamard8PerLane(float (&x)[8], int chunk, int rot) {
  if (rot == 0) return;
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
  // Cross-lane stages: the lower lane computes x + other, the upper lane other - x, both as
  // one fma with a +-1 multiplier (exact product, one rounding: the same value as the add).
#pragma unroll
  for (int m = 1; m < rot / 8; m <<= 1) {
    const float sign = (chunk & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = __fmaf_rn(sign, x[i], __shfl_xor_sync(0xffffffffu, x[i], m));
    }
  }
  const float norm = HadamardNorm(rot);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] *= norm;
}

// ---- dispatch ----------------------------------------------------------------------------------

template <KvDtype kValue>
using DtypeConstant = std::integral_constant<KvDtype, kValue>;
template <int kValue>
using IntConstant = std::integral_constant<int, kValue>;

// The one dispatch helper. Calls `f(dtype, head_dim, rot_block, block_tokens)` with each
// argument a std::integral_constant (read it as `decltype(x)::value`) and returns what f returns
// (a KernelStatus). rot_block is the layout's effective rotation: 0 when !layout.rotated()
// (always for kFp16). Returns kUnsupported, without calling f, for a combination the kernels were
// not compiled for: head_dim not in {64, 128, 256}, block_tokens not in {16, 32, 64}, rot_block
// not in {0, 16, 32, 64, 128} or larger than head_dim.
//
// kWithBlockTokens = false passes block_tokens as IntConstant<0> (one instantiation for every
// block size) for kernels where it only affects addressing; the layout still must be one of the
// compiled sizes.
template <bool kWithBlockTokens = true, typename F>
KernelStatus DispatchLayout(const PageLayout& layout, F&& f) {
  // Innermost first: each level binds one constant and calls the next.
  auto with_block_tokens = [&](auto dtype, auto head_dim, auto rot) -> KernelStatus {
    if constexpr (!kWithBlockTokens) {
      switch (layout.block_tokens) {
        case 16:
        case 32:
        case 64:
          return f(dtype, head_dim, rot, IntConstant<0>{});
        default:
          return KernelStatus::kUnsupported;
      }
    } else {
      switch (layout.block_tokens) {
        case 16:
          return f(dtype, head_dim, rot, IntConstant<16>{});
        case 32:
          return f(dtype, head_dim, rot, IntConstant<32>{});
        case 64:
          return f(dtype, head_dim, rot, IntConstant<64>{});
        default:
          return KernelStatus::kUnsupported;
      }
    }
  };
  auto with_rot = [&](auto dtype, auto head_dim) -> KernelStatus {
    constexpr int kHeadDim = decltype(head_dim)::value;
    if constexpr (decltype(dtype)::value == KvDtype::kFp16) {
      return with_block_tokens(dtype, head_dim, IntConstant<0>{});
    } else {
      if (!layout.rotated()) return with_block_tokens(dtype, head_dim, IntConstant<0>{});
      if (layout.rot_block > kHeadDim) return KernelStatus::kUnsupported;
      switch (layout.rot_block) {
        case 16:
          return with_block_tokens(dtype, head_dim, IntConstant<16>{});
        case 32:
          return with_block_tokens(dtype, head_dim, IntConstant<32>{});
        case 64:
          return with_block_tokens(dtype, head_dim, IntConstant<64>{});
        case 128:
          if constexpr (kHeadDim >= 128) {
            return with_block_tokens(dtype, head_dim, IntConstant<128>{});
          }
          return KernelStatus::kUnsupported;
        default:
          return KernelStatus::kUnsupported;
      }
    }
  };
  auto with_head_dim = [&](auto dtype) -> KernelStatus {
    switch (layout.head_dim) {
      case 64:
        return with_rot(dtype, IntConstant<64>{});
      case 128:
        return with_rot(dtype, IntConstant<128>{});
      case 256:
        return with_rot(dtype, IntConstant<256>{});
      default:
        return KernelStatus::kUnsupported;
    }
  };
  switch (layout.dtype) {
    case KvDtype::kFp16:
      return with_head_dim(DtypeConstant<KvDtype::kFp16>{});
    case KvDtype::kFp8E4M3:
      return with_head_dim(DtypeConstant<KvDtype::kFp8E4M3>{});
    case KvDtype::kInt8:
      return with_head_dim(DtypeConstant<KvDtype::kInt8>{});
    case KvDtype::kInt4:
      return with_head_dim(DtypeConstant<KvDtype::kInt4>{});
  }
  return KernelStatus::kUnsupported;
}

// Programmatic dependent launch. A kernel launched by LaunchDependent may start once every CTA
// of the kernel before it on the stream has called AllowDependentLaunch (or exited); before it
// reads anything that kernel writes it must call GridDependencyWait, which returns once that
// kernel has completed and its writes are visible. Both are no-ops in a kernel launched plainly.
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                            cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Ceiling division for grid sizes.
__host__ __device__ constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The current device's SM count, for grid sizes.
inline cudaError_t CurrentDeviceSms(int* sms) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

// Tensor-core tiles, shared by the attention kernel and the Hadamard of the quantize kernel.
// d += a . b for one m16n8k16 tile (A row-major fp16, B column-major fp16, fp32 accumulators).
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// d = a . b + c for one m16n8k16 tile: starts an accumulation chain at c.
__device__ __forceinline__ void Mma16816From(float (&d)[4], const uint4& a, uint32_t b0,
                                             uint32_t b1, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

// The transpose of an 8 x 8 fp16 matrix held as m16n8k16 fragments (lane 4 r + c: row r, columns
// 2 c and 2 c + 1): lane 4 r + c gets rows 2 c and 2 c + 1 of column r.
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---- launches ---------------------------------------------------------------------------------

// Allows kKernel kBytes of dynamic shared memory on the current device. The attribute is set once
// per device (a bit per device ordinal below 64, set only after success), not on every launch.
template <auto kKernel, int kBytes>
cudaError_t AllowDynamicSharedMemory() {
  static std::atomic<uint64_t> done{0};
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if ((done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return e;
}

}  // namespace kvpool::cuda

#endif  // KVPOOL_KERNELS_CUDA_CUDA_COMMON_CUH_
