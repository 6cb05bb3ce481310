// FlashInfer's batched paged decode attention as a peer of kvpool's kernels: time, effective
// bandwidth and accuracy for fp16 and fp8 (e4m3) KV pages.
//
// The kernel: FlashInfer 0.2.14.post1's CUDA-core decode (BatchDecodeWithPagedKVCacheDispatched,
// header-only C++, fetched by tests/bench/fetch_flashinfer.sh), planned once per case by
// DecodePlan with the kernel's work estimation as FlashInfer's Torch binding does (no CUDA graph,
// no PDL). Shapes as tests/gpu/attention_bench.cc: (batch, context) in {(1,32K), (8,8K), (8,32K),
// (32,4K), (32,16K), (64,8K)}, 32 q heads, 8 KV heads, head_dim 128, 16-token pages in one NHD
// cache [pages][2 (K, V)][16][8][128] (the Python wrapper's default), every sequence full, page
// ids a random permutation of the cache; q and out fp16; q, K, V uniform random on the device.
//
// Time: one run call between CUDA events, L2 flushed (256 MiB memset) before each, 3 warm-up
// runs, the median of --iters. Bytes: K and V of every token + q + out; split partials not counted.
//
// Accuracy: per (sequence, q head) row, the relative L2 error of the output against a CPU
// softmax(q K^T / sqrt(128)) V (fp32 values, fp64 sums) over the q/K/V read back from the device;
// the max over rows. Checked before timing on contexts {1000, 37, 512} (partial last pages) and
// on sequence 0 of every timed case; an error above 1e-2 fails the run (exit code 1).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <exception>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "flashinfer/attention/decode.cuh"
#include "flashinfer/attention/default_decode_params.cuh"
#include "flashinfer/attention/scheduler.cuh"
#include "flashinfer/attention/variants.cuh"
#include "tests/gpu/attention_test_util.h"

ABSL_FLAG(std::string, out, "", "write the results as JSON to this path");
ABSL_FLAG(int, iters, 25, "timed runs per case; the median is reported");
ABSL_FLAG(std::string, commit, "", "source revision recorded in the JSON");

namespace kvpool {
namespace {

using testing::DeviceBuffer;

constexpr int kQHeads = 32, kKvHeads = 8, kGroup = kQHeads / kKvHeads, kPageSize = 16;
constexpr uint32_t kHeadDim = 128;
constexpr int64_t kTokenElems = kKvHeads * kHeadDim;
constexpr int64_t kPageElems = 2 * kPageSize * kTokenElems;  // K then V
constexpr size_t kFlushBytes = size_t{256} << 20;
constexpr size_t kFloatWsBytes = size_t{128} << 20, kIntWsBytes = size_t{8} << 20;  // as Python
constexpr double kMaxRelErr = 1e-2;
constexpr auto kNoRope = flashinfer::PosEncodingMode::kNone;

using Variant =
    flashinfer::DefaultAttention</*use_custom_mask=*/false, /*use_sliding_window=*/false,
                                 /*use_logits_soft_cap=*/false, /*use_alibi=*/false>;
template <typename KV>
using Params = flashinfer::BatchDecodeParams<__half, KV, __half, int32_t>;

struct Shape {
  int batch, context;
};
constexpr Shape kShapes[] = {{1, 32768}, {8, 8192},   {8, 32768},
                             {32, 4096}, {32, 16384}, {64, 8192}};

// out[i] = scale * uniform[-1, 1) from a splitmix64 hash of (seed, i).
template <typename T>
__global__ void FillKernel(T* out, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    out[i] = T(scale * (static_cast<float>(z >> 40) * 0x1p-23f - 1.0f));
  }
}

struct FreeHost {
  void operator()(void* p) const { cudaFreeHost(p); }
};

// One decode batch in FlashInfer's paged layout, with its own workspaces and plan.
template <typename KV>
class Batch {
 public:
  Batch(const std::vector<int>& lens, uint64_t seed)
      : lens_(lens),
        q_(lens.size() * kQHeads * kHeadDim * sizeof(__half)),
        o_(q_.bytes()),
        float_ws_(kFloatWsBytes),
        int_ws_(kIntWsBytes) {
    indptr_.push_back(0);
    for (int len : lens) {
      const int pages = (len + kPageSize - 1) / kPageSize;
      indptr_.push_back(indptr_.back() + pages);
      last_page_len_.push_back(len - (pages - 1) * kPageSize);
    }
    indices_.resize(indptr_.back());
    std::iota(indices_.begin(), indices_.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(indices_.begin(), indices_.end(), rng);
    cache_ = DeviceBuffer(indices_.size() * kPageElems * sizeof(KV));
    d_indptr_ = DeviceBuffer(indptr_);
    d_indices_ = DeviceBuffer(indices_);
    d_last_page_len_ = DeviceBuffer(last_page_len_);
    void* pinned = nullptr;
    KVPOOL_CUDA_CHECK(cudaMallocHost(&pinned, kIntWsBytes));
    pinned_int_ws_.reset(pinned);
    // K and V in [-2, 2) (a softmax that is not flat), the same values for fp16 and fp8.
    FillKernel<<<1024, 256>>>(cache_.get<KV>(), cache_.bytes() / sizeof(KV), seed, 2.0f);
    FillKernel<<<1024, 256>>>(q_.get<__half>(), q_.bytes() / sizeof(__half), seed + 1, 1.0f);
    KVPOOL_CUDA_CHECK(cudaGetLastError());
    KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // DecodePlan, then the run params from the plan (as csrc/batch_decode.cu does).
  void Plan() {
    const uint32_t batch = static_cast<uint32_t>(lens_.size());
    auto estimate =
        flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<kGroup, kHeadDim, kNoRope,
                                                                        Variant, Params<KV>>;
    const cudaError_t planned = flashinfer::DecodePlan<kHeadDim, kNoRope, Variant, Params<KV>>(
        float_ws_.get(), float_ws_.bytes(), int_ws_.get(), pinned_int_ws_.get(), int_ws_.bytes(),
        plan_, indptr_.data(), batch, kQHeads, kPageSize, /*enable_cuda_graph=*/false,
        /*stream=*/nullptr, estimate);
    KVPOOL_CUDA_CHECK(planned);
    KVPOOL_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the plan's copy from pinned memory

    // Strides of the K (and V) view cache[:, 0] (cache[:, 1]): [page][token][head][dim].
    const int64_t strides[4] = {kPageElems, kTokenElems, kHeadDim, 1};
    KV* k = cache_.get<KV>();
    flashinfer::paged_kv_t<KV, int32_t> kv(
        kKvHeads, kPageSize, kHeadDim, batch, flashinfer::QKVLayout::kNHD, k, k + kPageElems / 2,
        strides, d_indices_.get<int32_t>(), d_indptr_.get<int32_t>(),
        d_last_page_len_.get<int32_t>());
    params_ = Params<KV>(q_.get<__half>(), /*q_rope_offset=*/nullptr, kv, o_.get<__half>(),
                         /*lse=*/nullptr, /*maybe_alibi_slopes=*/nullptr, kQHeads,
                         /*q_stride_n=*/kQHeads * kHeadDim, /*q_stride_h=*/kHeadDim,
                         /*window_left=*/-1, /*logits_soft_cap=*/0.f,
                         /*sm_scale=*/1.0f / std::sqrt(static_cast<float>(kHeadDim)),
                         /*rope_scale=*/1.f, /*rope_theta=*/1e4f);
    void* ints = int_ws_.get();
    params_.request_indices =
        flashinfer::GetPtrFromBaseOffset<int32_t>(ints, plan_.request_indices_offset);
    params_.kv_tile_indices =
        flashinfer::GetPtrFromBaseOffset<int32_t>(ints, plan_.kv_tile_indices_offset);
    params_.o_indptr = flashinfer::GetPtrFromBaseOffset<int32_t>(ints, plan_.o_indptr_offset);
    params_.kv_chunk_size_ptr =
        flashinfer::GetPtrFromBaseOffset<int32_t>(ints, plan_.kv_chunk_size_ptr_offset);
    params_.padded_batch_size = static_cast<uint32_t>(plan_.padded_batch_size);
    // Split KV: partial outputs and their log-sum-exps in the float workspace, merged by the run.
    // (block_valid_mask is only used with CUDA graphs.)
    tmp_v_ = nullptr;
    tmp_s_ = nullptr;
    if (plan_.split_kv) {
      tmp_v_ = flashinfer::GetPtrFromBaseOffset<__half>(float_ws_.get(), plan_.v_offset);
      tmp_s_ = flashinfer::GetPtrFromBaseOffset<float>(float_ws_.get(), plan_.s_offset);
    }
  }

  void Run() {
    const cudaError_t ran =
        flashinfer::BatchDecodeWithPagedKVCacheDispatched<kHeadDim, kNoRope, Variant>(
            params_, tmp_v_, tmp_s_, /*enable_pdl=*/false, /*stream=*/nullptr);
    KVPOOL_CUDA_CHECK(ran);
  }

  // Max relative L2 error over the q heads of sequence `seq` (see the header comment).
  double MaxRelErr(int seq) const {
    const int len = lens_[seq];
    std::vector<KV> page(kPageElems);
    std::vector<float> k(len * kTokenElems), v(len * kTokenElems);
    for (int t0 = 0, i = indptr_[seq]; t0 < len; t0 += kPageSize, ++i) {
      KVPOOL_CUDA_CHECK(cudaMemcpy(page.data(), cache_.get<KV>() + indices_[i] * kPageElems,
                                   kPageElems * sizeof(KV), cudaMemcpyDeviceToHost));
      const int64_t n = std::min(kPageSize, len - t0) * kTokenElems;
      for (int64_t e = 0; e < n; ++e) {
        k[t0 * kTokenElems + e] = static_cast<float>(page[e]);
        v[t0 * kTokenElems + e] = static_cast<float>(page[kPageElems / 2 + e]);
      }
    }
    const std::vector<__half> q = q_.ToHost<__half>(), o = o_.ToHost<__half>();
    const float sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    double worst = 0;
    std::vector<float> s(len);
    for (int h = 0; h < kQHeads; ++h) {
      const size_t row = (static_cast<size_t>(seq) * kQHeads + h) * kHeadDim;
      const int64_t kv_off = (h / kGroup) * kHeadDim;
      float qf[kHeadDim];
      for (uint32_t d = 0; d < kHeadDim; ++d) qf[d] = static_cast<float>(q[row + d]);
      for (int t = 0; t < len; ++t) {
        float dot = 0;
        for (uint32_t d = 0; d < kHeadDim; ++d) dot += qf[d] * k[t * kTokenElems + kv_off + d];
        s[t] = dot * sm_scale;
      }
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0, acc[kHeadDim] = {};
      for (int t = 0; t < len; ++t) {
        const double p = std::exp(s[t] - m);
        sum += p;
        for (uint32_t d = 0; d < kHeadDim; ++d) acc[d] += p * v[t * kTokenElems + kv_off + d];
      }
      double num = 0, den = 0;
      for (uint32_t d = 0; d < kHeadDim; ++d) {
        const double ref = acc[d] / sum, diff = static_cast<float>(o[row + d]) - ref;
        num += diff * diff;
        den += ref * ref;
      }
      worst = std::max(worst, std::sqrt(num / den));
    }
    return worst;
  }

  double Bytes() const {
    const double tokens = std::accumulate(lens_.begin(), lens_.end(), 0.0);
    return tokens * 2 * kTokenElems * sizeof(KV) + 2.0 * q_.bytes();
  }
  const flashinfer::DecodePlanInfo& plan() const { return plan_; }

 private:
  std::vector<int> lens_;
  std::vector<int32_t> indptr_, indices_, last_page_len_;
  DeviceBuffer cache_, q_, o_, d_indptr_, d_indices_, d_last_page_len_, float_ws_, int_ws_;
  std::unique_ptr<void, FreeHost> pinned_int_ws_;
  flashinfer::DecodePlanInfo plan_;
  Params<KV> params_;
  __half* tmp_v_ = nullptr;
  float* tmp_s_ = nullptr;
};

// Median of `iters` timings of `run`, each after an L2 flush, after 3 warm-up runs.
template <typename F>
double MedianMs(int iters, const DeviceBuffer& flush, F&& run) {
  cudaEvent_t start, stop;
  KVPOOL_CUDA_CHECK(cudaEventCreate(&start));
  KVPOOL_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) run();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    KVPOOL_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xff, flush.bytes()));
    KVPOOL_CUDA_CHECK(cudaEventRecord(start));
    run();
    KVPOOL_CUDA_CHECK(cudaEventRecord(stop));
    KVPOOL_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    KVPOOL_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  KVPOOL_CUDA_CHECK(cudaEventDestroy(start));
  KVPOOL_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Timing {
  double ms, bytes, tbps, err;  // err: the max relative error of sequence 0
  bool split_kv;
  int64_t padded_batch;
};

template <typename KV>
Timing TimeCase(const Shape& shape, int iters, const DeviceBuffer& flush) {
  Batch<KV> b(std::vector<int>(shape.batch, shape.context), shape.batch * 131 + shape.context);
  b.Plan();
  const double ms = MedianMs(iters, flush, [&] { b.Run(); }), bytes = b.Bytes();
  const flashinfer::DecodePlanInfo& plan = b.plan();
  return {
      ms, bytes, bytes / (ms * 1e-3) / 1e12, b.MaxRelErr(0), plan.split_kv, plan.padded_batch_size};
}

template <typename KV>
double CheckSmall() {
  Batch<KV> b({1000, 37, 512}, 7);
  b.Plan();
  b.Run();
  KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  double worst = 0;
  for (int seq = 0; seq < 3; ++seq) worst = std::max(worst, b.MaxRelErr(seq));
  return worst;
}

int Main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "flashinfer_decode_bench: no CUDA device visible\n");
    return 1;
  }
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  cudaDeviceProp prop{};
  KVPOOL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double err16 = CheckSmall<__half>(), err8 = CheckSmall<__nv_fp8_e4m3>();
  std::printf("device %s; check (contexts 1000, 37, 512): max rel err fp16 %.3e, fp8 %.3e\n",
              prop.name, err16, err8);
  if (!(err16 <= kMaxRelErr && err8 <= kMaxRelErr)) {
    std::fprintf(stderr, "flashinfer_decode_bench: check failed (limit %.0e)\n", kMaxRelErr);
    return 1;
  }

  DeviceBuffer flush(kFlushBytes);
  std::vector<Timing> t16, t8;
  bool ok = true;
  std::printf("%5s %6s | %9s %7s %9s | %9s %7s %9s\n", "batch", "ctx", "fp16 ms", "TB/s",
              "seq0 err", "fp8 ms", "TB/s", "seq0 err");
  for (const Shape& shape : kShapes) {
    t16.push_back(TimeCase<__half>(shape, iters, flush));
    t8.push_back(TimeCase<__nv_fp8_e4m3>(shape, iters, flush));
    const Timing &a = t16.back(), &b = t8.back();
    ok = ok && a.err <= kMaxRelErr && b.err <= kMaxRelErr;
    std::printf("%5d %6d | %9.4f %7.3f %9.2e | %9.4f %7.3f %9.2e\n", shape.batch, shape.context,
                a.ms, a.tbps, a.err, b.ms, b.tbps, b.err);
  }

  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f == nullptr) {
      std::perror(out.c_str());
      return 1;
    }
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &utc);
    std::fprintf(f,
                 "{\n  \"tool\": \"flashinfer_decode_bench\",\n  \"flashinfer\": \"0.2.14.post1\","
                 "\n  \"device\": \"%s\",\n  \"commit\": \"%s\",\n  \"date\": \"%s\",\n"
                 "  \"iters\": %d,\n  \"check\": {\"fp16_max_rel_err\": %.3e, "
                 "\"fp8_max_rel_err\": %.3e},\n  \"cases\": [\n",
                 prop.name, absl::GetFlag(FLAGS_commit).c_str(), date, iters, err16, err8);
    for (size_t i = 0; i < t16.size(); ++i) {
      std::fprintf(f, "    {\"batch\": %d, \"context\": %d", kShapes[i].batch, kShapes[i].context);
      for (const Timing* t : {&t16[i], &t8[i]}) {
        std::fprintf(f,
                     ", \"flashinfer_%s\": {\"ms\": %.5f, \"bytes\": %.0f, \"tbps\": %.4f, "
                     "\"seq0_max_rel_err\": %.3e, \"split_kv\": %s, \"padded_batch_size\": %lld}",
                     t == &t16[i] ? "fp16" : "fp8", t->ms, t->bytes, t->tbps, t->err,
                     t->split_kv ? "true" : "false", static_cast<long long>(t->padded_batch));
      }
      std::fprintf(f, "}%s\n", i + 1 < t16.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  if (!ok) {
    std::fprintf(stderr, "flashinfer_decode_bench: a case's error is above %.0e\n", kMaxRelErr);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    return kvpool::Main();
  } catch (const std::exception& e) {  // flashinfer::Error from the plan or the dispatch
    std::fprintf(stderr, "flashinfer_decode_bench: %s\n", e.what());
    return 1;
  }
}
