// Device helpers of the attention benchmark; see attention_bench_kernels.h.
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/gpu/attention_bench_kernels.h"

namespace kvpool::bench {
namespace {

constexpr int kStreamCtas = 4096;
constexpr int kStreamThreads = 512;
constexpr size_t kFlushBytes = size_t{256} << 20;  // several times the L2

__device__ __forceinline__ uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Approximately N(0,1): the sum of four 16-bit uniforms, centred and scaled to unit variance.
__device__ __forceinline__ float Normalish(uint64_t h) {
  float s = 0.0f;
  for (int i = 0; i < 4; ++i)
    s += static_cast<float>((h >> (16 * i)) & 0xFFFFu) * (1.0f / 65536.0f);
  return (s - 2.0f) * 1.7320508f;
}

// One thread per (token, head, channel). Grid-stride over num_tokens * num_heads * head_dim.
__global__ void FillSyntheticKvKernel(uint16_t* k, uint16_t* v, int first_token, int num_tokens,
                                      int num_heads, int head_dim, uint64_t seed) {
  const size_t n = static_cast<size_t>(num_tokens) * num_heads * head_dim;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % head_dim);
    const int h = static_cast<int>((i / head_dim) % num_heads);
    const int t = first_token + static_cast<int>(i / (static_cast<size_t>(head_dim) * num_heads));
    const uint64_t key = seed * 0x9E3779B97F4A7C15ull +
                         ((static_cast<uint64_t>(t) * num_heads + h) * head_dim + c) * 2;
    float kx = Normalish(Mix(key));
    float vx = Normalish(Mix(key + 1));
    const float theta = powf(10000.0f, -18.0f / head_dim);
    if (c == 5) kx += (seed & 1) ? 12.0f : -12.0f;
    if (c == 9) kx += 12.0f * cosf(t * theta);
    if (c == 9 + head_dim / 2) kx += 12.0f * sinf(t * theta);
    if (c == 17) kx *= 10.0f;
    if (c == 5 || c == 9) vx *= 5.0f;
    k[i] = __half_as_ushort(__float2half_rn(kx));
    v[i] = __half_as_ushort(__float2half_rn(vx));
  }
}

// Grid kStreamCtas x kStreamThreads, grid-stride 16-byte loads, streaming (evict first) or
// kept in L2; lane 0 of each CTA's first warp writes a checksum word.
template <bool kKeepInL2>
__global__ void StreamReadKernel(const uint4* data, size_t n, uint32_t* sink) {
  auto load = [](const uint4* p) { return kKeepInL2 ? __ldg(p) : __ldcs(p); };
  uint32_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = load(data + i), b = load(data + i + stride);
    const uint4 c = load(data + i + 2 * stride), d = load(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^
           d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = load(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  for (int m = 16; m > 0; m >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, m);
  if (threadIdx.x == 0) sink[blockIdx.x] = acc;
}

// Whether the L2Flush mode is "write"; exits on a mode other than "read" and "write".
bool IsWriteFlush(const std::string& mode) {
  if (mode != "read" && mode != "write") {
    std::fprintf(stderr, "--l2_flush must be read or write, not \"%s\"\n", mode.c_str());
    std::exit(2);
  }
  return mode == "write";
}

template <bool kKeepInL2>
cudaError_t LaunchStreamRead(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream) {
  StreamReadKernel<kKeepInL2><<<kStreamCtas, kStreamThreads, 0, stream>>>(
      static_cast<const uint4*>(data), bytes / 16, sink);
  return cudaGetLastError();
}

}  // namespace

cudaError_t FillSyntheticKv(uint16_t* k, uint16_t* v, int first_token, int num_tokens,
                            int num_heads, int head_dim, uint64_t seed, cudaStream_t stream) {
  FillSyntheticKvKernel<<<2048, 256, 0, stream>>>(k, v, first_token, num_tokens, num_heads,
                                                  head_dim, seed);
  return cudaGetLastError();
}

__global__ void EmptyKernel() {}

double LaunchFloorMs(int iters, L2Flush& flush) {
  return testing::MedianMs(iters, flush, [] {
    EmptyKernel<<<256, 128>>>();
    KVPOOL_CUDA_CHECK(cudaGetLastError());
  });
}

double StreamingReadTbps(int iters, L2Flush& flush) {
  const size_t bytes = size_t{2} << 30;
  testing::DeviceBuffer data(bytes), sink(kStreamCtas * sizeof(uint32_t));
  KVPOOL_CUDA_CHECK(cudaMemset(data.get(), 1, bytes));
  const double ms = testing::MedianMs(iters, flush, [&] {
    KVPOOL_CUDA_CHECK(LaunchStreamRead<false>(data.get(), bytes, sink.get<uint32_t>(), nullptr));
  });
  return bytes / (ms * 1e-3) / 1e12;
}

L2Flush::L2Flush(const std::string& mode)
    : write_(IsWriteFlush(mode)), buffer_(kFlushBytes), sink_(kStreamCtas * sizeof(uint32_t)) {
  KVPOOL_CUDA_CHECK(cudaMemset(buffer_.get(), 0, kFlushBytes));
}

void L2Flush::operator()() {
  if (write_) {
    KVPOOL_CUDA_CHECK(cudaMemsetAsync(buffer_.get(), ++round_ & 0xff, kFlushBytes));
  } else {
    KVPOOL_CUDA_CHECK(
        LaunchStreamRead<true>(buffer_.get(), kFlushBytes, sink_.get<uint32_t>(), nullptr));
  }
}

}  // namespace kvpool::bench
