// FlashInfer's batched paged decode attention as a peer of kvpool's kernels: time, effective
// bandwidth and accuracy for fp16 and fp8 (e4m3) KV pages, on the two kernel paths of FlashInfer's
// BatchDecodeWithPagedKVCacheWrapper.
//
// The kernels: FlashInfer 0.2.14.post1, header-only C++ (fetched by
// tests/bench/fetch_flashinfer.sh), each planned once per case as the wrapper's plan() does through
// FlashInfer's Torch binding (no CUDA graph, no PDL, no LSE output):
//  * "flashinfer_fp16" / "flashinfer_fp8": the CUDA-core decode kernel (the wrapper's default),
//    BatchDecodeWithPagedKVCacheDispatched, planned by DecodePlan with the kernel's work
//    estimation.
//  * "flashinfer_tc_fp16" / "flashinfer_tc_fp8": the wrapper's use_tensor_cores=True path (the one
//    FlashInfer recommends for GQA groups >= 4): the FA2 (sm80-style, tensor-core) batch prefill
//    kernel BatchPrefillWithPagedKVCacheDispatched with one query per request, planned by
//    PrefillPlan on qo_indptr = 0..batch and the pages' kv_indptr, at the CTA_TILE_Q the plan
//    picks, mask kNone (every key attended). fp8 pages take fp16 q and out (KV-only quantization,
//    which the FA2 kernel supports).
//
// Shapes as tests/gpu/attention_bench.cc: (batch, context) in {(1,32K), (8,8K), (8,32K), (32,4K),
// (32,16K), (64,8K)}, 32 q heads, 8 KV heads, head_dim 128 (--q_heads, --kv_heads, --head_dim:
// head_dim 64, 128 or 256, those both paths are built for here; the CUDA-core path runs only at
// the GQA groups its dispatch covers, 1, 2, 3, 4 and 8, the tensor-core path at any), 16-token
// pages in one NHD cache [pages][2 (K, V)][16][KV heads][head_dim] (the Python wrapper's default),
// every sequence full, page ids a random permutation of the cache; q and out fp16; q, K, V uniform
// random on the device. Both paths of one KV dtype run on the same batch (same q, pages and page
// ids), one after the other; the output is set to NaN before each path's plan, so a path that
// writes nothing fails the check.
//
// Time: one run call (host dispatch included) between CUDA events, L2 flushed (--l2_flush, as in
// attention_bench) before each, 3 warm-up runs, the median of --iters. Bytes: K and V of every
// token + q + out; split partials not counted.
//
// Accuracy: per (sequence, q head) row, the relative L2 error of the output against a CPU
// softmax(q K^T / sqrt(head_dim)) V (fp32 values, fp64 sums) over the q/K/V read back from the
// device; the max over rows (NaN if any row is NaN). Checked before timing on contexts {1000, 37,
// 512} (partial last pages) and on sequence 0 of every timed case, for every path and dtype; an
// error above 1e-2 fails the run (exit code 1).
//
// JSON per case: "flashinfer_{fp16,fp8}": {"ms", "bytes", "tbps", "seq0_max_rel_err", "split_kv",
// "padded_batch_size"}, "flashinfer_tc_{fp16,fp8}": {"ms", "bytes", "tbps", "seq0_max_rel_err",
// "cta_tile_q", "split_kv"}; the CUDA-core variants are absent at GQA groups its dispatch does not
// cover.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flashinfer/attention/decode.cuh"
#include "flashinfer/attention/default_decode_params.cuh"
#include "flashinfer/attention/default_prefill_params.cuh"
#include "flashinfer/attention/mask.cuh"
#include "flashinfer/attention/prefill.cuh"
#include "flashinfer/attention/scheduler.cuh"
#include "flashinfer/attention/variants.cuh"
#include "tests/common/bench_output.h"
#include "tests/gpu/attention_bench_kernels.h"
#include "tests/gpu/attention_test_util.h"

ABSL_FLAG(std::string, out, "", "write the results as JSON to this path");
ABSL_FLAG(int, iters, 25, "timed runs per case; the median is reported");
ABSL_FLAG(std::string, commit, "", "source revision recorded in the JSON");
ABSL_FLAG(std::string, l2_flush, "read",
          "the L2 flush before every timed run, as attention_bench's: read or write");
ABSL_FLAG(int, q_heads, 32, "query heads per sequence, as attention_bench's");
ABSL_FLAG(int, kv_heads, 8, "KV heads, dividing q_heads");
ABSL_FLAG(int, head_dim, 128, "64, 128 or 256");

namespace kvpool {
namespace {

using testing::DeviceBuffer;
using testing::MedianMs;

constexpr int kPageSize = 16;
constexpr size_t kFloatWsBytes = size_t{128} << 20, kIntWsBytes = size_t{8} << 20;  // as Python
constexpr double kMaxRelErr = 1e-2;
constexpr auto kNoRope = flashinfer::PosEncodingMode::kNone;

// No custom mask, sliding window, soft cap or ALiBi: the variant both paths instantiate.
using Variant =
    flashinfer::DefaultAttention</*use_custom_mask=*/false, /*use_sliding_window=*/false,
                                 /*use_logits_soft_cap=*/false, /*use_alibi=*/false>;

using Shape = bench::DecodeShape;

// The larger of two errors, NaN if either is (std::max would drop a NaN in its second argument).
double Worse(double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }

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

// A plan's buffers, sized as the Python wrapper's: float and int workspaces on the device and the
// pinned host copy of the int one that the plan fills and copies over.
struct Workspace {
  DeviceBuffer float_ws{kFloatWsBytes}, int_ws{kIntWsBytes};
  std::unique_ptr<void, FreeHost> pinned_int_ws;
  Workspace() {
    void* pinned = nullptr;
    KVPOOL_CUDA_CHECK(cudaMallocHost(&pinned, kIntWsBytes));
    pinned_int_ws.reset(pinned);
  }
  template <typename T>
  T* Int(int64_t offset) const {
    return flashinfer::GetPtrFromBaseOffset<T>(int_ws.get(), offset);
  }
  template <typename T>
  T* Float(int64_t offset) const {
    return flashinfer::GetPtrFromBaseOffset<T>(float_ws.get(), offset);
  }
};

// Query and KV heads per sequence and their head_dim (--q_heads, --kv_heads, --head_dim).
struct Heads {
  int q, kv, dim;
  int group() const { return q / kv; }
  // Whether the CUDA-core decode path's dispatch (DISPATCH_GQA_GROUP_SIZE) covers the group.
  bool cuda_core_group() const {
    const int g = group();
    return g == 1 || g == 2 || g == 3 || g == 4 || g == 8;
  }
  float sm_scale() const { return 1.0f / std::sqrt(static_cast<float>(dim)); }
  int64_t token_elems() const { return int64_t{kv} * dim; }             // one token's K (or V)
  int64_t page_elems() const { return 2 * kPageSize * token_elems(); }  // K then V
};

// One decode batch in FlashInfer's paged layout (q, pages, page table, out), shared by the kernel
// paths, and the CPU reference check of its output.
template <typename KV>
class PagedBatch {
 public:
  PagedBatch(const Heads& heads, const std::vector<int>& lens, uint64_t seed)
      : heads_(heads),
        lens_(lens),
        q_(lens.size() * heads.q * heads.dim * sizeof(__half)),
        o_(q_.bytes()) {
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
    cache_ = DeviceBuffer(indices_.size() * heads_.page_elems() * sizeof(KV));
    d_indptr_ = DeviceBuffer(indptr_);
    d_indices_ = DeviceBuffer(indices_);
    d_last_page_len_ = DeviceBuffer(last_page_len_);
    // K and V in [-2, 2) (a softmax that is not flat), the same values for fp16 and fp8.
    FillKernel<<<1024, 256>>>(cache_.get<KV>(), cache_.bytes() / sizeof(KV), seed, 2.0f);
    FillKernel<<<1024, 256>>>(q_.get<__half>(), q_.bytes() / sizeof(__half), seed + 1, 1.0f);
    KVPOOL_CUDA_CHECK(cudaGetLastError());
    KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  }

  uint32_t batch() const { return static_cast<uint32_t>(lens_.size()); }
  const Heads& heads() const { return heads_; }
  __half* q() const { return q_.get<__half>(); }
  __half* o() const { return o_.get<__half>(); }
  // The page-count indptr (what both plans take).
  const std::vector<int32_t>& indptr() const { return indptr_; }

  // The cache as FlashInfer's paged view: K (V) is cache[:, 0] (cache[:, 1]), strides
  // [page][token][head][dim], the same for K and V.
  flashinfer::paged_kv_t<KV, int32_t> PagedKv() const {
    const int64_t page_elems = heads_.page_elems();
    const int64_t strides[4] = {page_elems, heads_.token_elems(), heads_.dim, 1};
    KV* k = cache_.get<KV>();
    return flashinfer::paged_kv_t<KV, int32_t>(
        heads_.kv, kPageSize, heads_.dim, batch(), flashinfer::QKVLayout::kNHD, k,
        k + page_elems / 2, strides, d_indices_.get<int32_t>(), d_indptr_.get<int32_t>(),
        d_last_page_len_.get<int32_t>());
  }

  // Sets every output element to NaN (0xffff), so that a run that leaves a row unwritten fails.
  void PoisonOutput() const { KVPOOL_CUDA_CHECK(cudaMemset(o_.get(), 0xff, o_.bytes())); }

  // Max relative L2 error over the q heads of sequence `seq` (see the header comment).
  double MaxRelErr(int seq) const {
    const int len = lens_[seq];
    const int64_t page_elems = heads_.page_elems(), token_elems = heads_.token_elems();
    std::vector<KV> page(page_elems);
    std::vector<float> k(len * token_elems), v(len * token_elems);
    for (int t0 = 0, i = indptr_[seq]; t0 < len; t0 += kPageSize, ++i) {
      KVPOOL_CUDA_CHECK(cudaMemcpy(page.data(), cache_.get<KV>() + indices_[i] * page_elems,
                                   page_elems * sizeof(KV), cudaMemcpyDeviceToHost));
      const int64_t n = std::min(kPageSize, len - t0) * token_elems;
      for (int64_t e = 0; e < n; ++e) {
        k[t0 * token_elems + e] = static_cast<float>(page[e]);
        v[t0 * token_elems + e] = static_cast<float>(page[page_elems / 2 + e]);
      }
    }
    const std::vector<__half> q = q_.ToHost<__half>(), o = o_.ToHost<__half>();
    const int dim = heads_.dim;
    double worst = 0;
    std::vector<float> s(len), qf(dim);
    std::vector<double> acc(dim);
    for (int h = 0; h < heads_.q; ++h) {
      const size_t row = (static_cast<size_t>(seq) * heads_.q + h) * dim;
      const int64_t kv_off = (h / heads_.group()) * dim;
      for (int d = 0; d < dim; ++d) qf[d] = static_cast<float>(q[row + d]);
      for (int t = 0; t < len; ++t) {
        float dot = 0;
        for (int d = 0; d < dim; ++d) dot += qf[d] * k[t * token_elems + kv_off + d];
        s[t] = dot * heads_.sm_scale();
      }
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int t = 0; t < len; ++t) {
        const double p = std::exp(s[t] - m);
        sum += p;
        for (int d = 0; d < dim; ++d) acc[d] += p * v[t * token_elems + kv_off + d];
      }
      double num = 0, den = 0;
      for (int d = 0; d < dim; ++d) {
        const double ref = acc[d] / sum, diff = static_cast<float>(o[row + d]) - ref;
        num += diff * diff;
        den += ref * ref;
      }
      worst = Worse(worst, std::sqrt(num / den));
    }
    return worst;
  }

  double Bytes() const {
    const double tokens = std::accumulate(lens_.begin(), lens_.end(), 0.0);
    return tokens * 2 * heads_.token_elems() * sizeof(KV) + 2.0 * q_.bytes();
  }

 private:
  Heads heads_;
  std::vector<int> lens_;
  std::vector<int32_t> indptr_, indices_, last_page_len_;
  DeviceBuffer cache_, q_, o_, d_indptr_, d_indices_, d_last_page_len_;
};

// The CUDA-core decode path: DecodePlan on construction, then the run params from the plan (as
// csrc/batch_decode.cu does).
template <uint32_t kHeadDim, typename KV>
class CudaCoreDecode {
 public:
  using Params = flashinfer::BatchDecodeParams<__half, KV, __half, int32_t>;

  explicit CudaCoreDecode(const PagedBatch<KV>& b) {
    const int q_heads = b.heads().q;
    std::vector<int32_t> indptr = b.indptr();  // DecodePlan takes a non-const pointer
    cudaError_t planned = cudaErrorInvalidValue;
    // The work estimation is built per GQA group, as the run's dispatch is.
    DISPATCH_GQA_GROUP_SIZE(b.heads().group(), kGroup, {
      planned = flashinfer::DecodePlan<kHeadDim, kNoRope, Variant, Params>(
          ws_.float_ws.get(), ws_.float_ws.bytes(), ws_.int_ws.get(), ws_.pinned_int_ws.get(),
          ws_.int_ws.bytes(), plan_, indptr.data(), b.batch(), q_heads, kPageSize,
          /*enable_cuda_graph=*/false, /*stream=*/nullptr,
          flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<kGroup, kHeadDim, kNoRope,
                                                                          Variant, Params>);
    });
    KVPOOL_CUDA_CHECK(planned);
    KVPOOL_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the plan's copy from pinned memory

    params_ = Params(b.q(), /*q_rope_offset=*/nullptr, b.PagedKv(), b.o(), /*lse=*/nullptr,
                     /*maybe_alibi_slopes=*/nullptr, q_heads, /*q_stride_n=*/q_heads * kHeadDim,
                     /*q_stride_h=*/kHeadDim, /*window_left=*/-1, /*logits_soft_cap=*/0.f,
                     b.heads().sm_scale(), /*rope_scale=*/1.f, /*rope_theta=*/1e4f);
    params_.request_indices = ws_.Int<int32_t>(plan_.request_indices_offset);
    params_.kv_tile_indices = ws_.Int<int32_t>(plan_.kv_tile_indices_offset);
    params_.o_indptr = ws_.Int<int32_t>(plan_.o_indptr_offset);
    params_.kv_chunk_size_ptr = ws_.Int<int32_t>(plan_.kv_chunk_size_ptr_offset);
    params_.padded_batch_size = static_cast<uint32_t>(plan_.padded_batch_size);
    // Split KV: partial outputs and their log-sum-exps in the float workspace, merged by the run.
    // (block_valid_mask is only used with CUDA graphs.)
    if (plan_.split_kv) {
      tmp_v_ = ws_.Float<__half>(plan_.v_offset);
      tmp_s_ = ws_.Float<float>(plan_.s_offset);
    }
  }

  void Run() {
    const cudaError_t ran =
        flashinfer::BatchDecodeWithPagedKVCacheDispatched<kHeadDim, kNoRope, Variant>(
            params_, tmp_v_, tmp_s_, /*enable_pdl=*/false, /*stream=*/nullptr);
    KVPOOL_CUDA_CHECK(ran);
  }

  // The plan's fields in the JSON.
  std::string PlanJson() const {
    return std::string("\"split_kv\": ") + (plan_.split_kv ? "true" : "false") +
           ", \"padded_batch_size\": " + std::to_string(plan_.padded_batch_size);
  }

 private:
  Workspace ws_;
  flashinfer::DecodePlanInfo plan_;
  Params params_;
  __half* tmp_v_ = nullptr;
  float* tmp_s_ = nullptr;
};

// The tensor-core path (BatchDecodeWithPagedKVCacheWrapper with use_tensor_cores=True): the FA2
// batch prefill kernel with one query per request. Planned on construction as the wrapper's plan()
// does (decode.py: PrefillPlan on qo_indptr = arange(batch + 1), the page-count kv_indptr,
// total_num_rows = batch, enable_cuda_graph false, sizeof_dtype_o 2), then the run params from
// the plan as csrc/batch_prefill.cu's BatchPrefillWithPagedKVCacheRun sets them.
template <uint32_t kHeadDim, typename KV>
class TensorCoreDecode {
 public:
  using Params = flashinfer::BatchPrefillPagedParams<__half, KV, __half, int32_t>;

  explicit TensorCoreDecode(const PagedBatch<KV>& b) {
    const int q_heads = b.heads().q;
    std::vector<int32_t> qo_indptr(b.batch() + 1), kv_indptr = b.indptr();
    std::iota(qo_indptr.begin(), qo_indptr.end(), 0);
    d_qo_indptr_ = DeviceBuffer(qo_indptr);
    const cudaError_t planned = flashinfer::PrefillPlan<int32_t>(
        ws_.float_ws.get(), ws_.float_ws.bytes(), ws_.int_ws.get(), ws_.pinned_int_ws.get(),
        ws_.int_ws.bytes(), plan_, qo_indptr.data(), kv_indptr.data(),
        /*total_num_rows=*/b.batch(), b.batch(), q_heads, b.heads().kv, kHeadDim, kHeadDim,
        kPageSize,
        /*enable_cuda_graph=*/false, /*sizeof_dtype_o=*/sizeof(__half), /*stream=*/nullptr);
    KVPOOL_CUDA_CHECK(planned);
    KVPOOL_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the plan's copy from pinned memory

    params_ = Params(b.q(), b.PagedKv(), /*maybe_custom_mask=*/nullptr, d_qo_indptr_.get<int32_t>(),
                     /*maybe_mask_indptr=*/nullptr, /*maybe_q_rope_offset=*/nullptr, b.o(),
                     /*lse=*/nullptr, /*maybe_alibi_slopes=*/nullptr, q_heads,
                     /*q_stride_n=*/q_heads * kHeadDim, /*q_stride_h=*/kHeadDim,
                     /*window_left=*/-1, /*logits_soft_cap=*/0.f, b.heads().sm_scale(),
                     /*rope_scale=*/1.f, /*rope_theta=*/1e4f);
    params_.request_indices = ws_.Int<int32_t>(plan_.request_indices_offset);
    params_.qo_tile_indices = ws_.Int<int32_t>(plan_.qo_tile_indices_offset);
    params_.kv_tile_indices = ws_.Int<int32_t>(plan_.kv_tile_indices_offset);
    params_.o_indptr = ws_.Int<int32_t>(plan_.o_indptr_offset);
    params_.kv_chunk_size_ptr = ws_.Int<int32_t>(plan_.kv_chunk_size_ptr_offset);
    params_.padded_batch_size = static_cast<uint32_t>(plan_.padded_batch_size);
    params_.max_total_num_rows = static_cast<uint32_t>(plan_.total_num_rows);
    // Split KV: the kernel writes partials (fp16) and log-sum-exps to the float workspace, then
    // VariableLengthMergeStates merges them by merge_indptr. (block_valid_mask and total_num_rows
    // are only used with CUDA graphs.)
    if (plan_.split_kv) {
      params_.merge_indptr = ws_.Int<int32_t>(plan_.merge_indptr_offset);
      tmp_v_ = ws_.Float<__half>(plan_.v_offset);
      tmp_s_ = ws_.Float<float>(plan_.s_offset);
    }
    // The kernel is instantiated per CTA_TILE_Q (query rows per CTA: GQA-packed, so one request's
    // group of q heads of one KV head fills that many rows); the plan picks 16, 64 or 128
    // (FA2DetermineCtaTileQ: 16 for packed lengths up to 16).
    switch (plan_.cta_tile_q) {
      case 16:
        launch_ = &Launch<16>;
        break;
      case 64:
        launch_ = &Launch<64>;
        break;
      case 128:
        launch_ = &Launch<128>;
        break;
      default:
        throw std::runtime_error("PrefillPlan chose an unsupported cta_tile_q " +
                                 std::to_string(plan_.cta_tile_q));
    }
  }

  void Run() { KVPOOL_CUDA_CHECK(launch_(params_, tmp_v_, tmp_s_)); }

  // The plan's fields in the JSON.
  std::string PlanJson() const {
    return "\"cta_tile_q\": " + std::to_string(plan_.cta_tile_q) +
           ", \"split_kv\": " + (plan_.split_kv ? "true" : "false");
  }

 private:
  template <uint32_t kCtaTileQ>
  static cudaError_t Launch(const Params& params, __half* tmp_v, float* tmp_s) {
    return flashinfer::BatchPrefillWithPagedKVCacheDispatched<
        kCtaTileQ, kHeadDim, kHeadDim, kNoRope, /*USE_FP16_QK_REDUCTION=*/false,
        flashinfer::MaskMode::kNone, Variant, Params>(params, tmp_v, tmp_s, /*enable_pdl=*/false,
                                                      /*stream=*/nullptr);
  }

  Workspace ws_;
  DeviceBuffer d_qo_indptr_;
  flashinfer::PrefillPlanInfo plan_;
  Params params_;
  __half* tmp_v_ = nullptr;
  float* tmp_s_ = nullptr;
  cudaError_t (*launch_)(const Params&, __half*, float*) = nullptr;
};

struct Timing {
  double ms, bytes, tbps, err;  // err: the max relative error of sequence 0
  std::string plan_json;        // the path's plan fields
};

// One kernel path on one batch: output poisoned, planned once, timed, then sequence 0 checked.
template <template <uint32_t, typename> class Path, uint32_t kHeadDim, typename KV>
Timing TimeCase(const PagedBatch<KV>& b, int iters, bench::L2Flush& flush) {
  b.PoisonOutput();
  Path<kHeadDim, KV> path(b);
  const double ms = MedianMs(iters, flush, [&] { path.Run(); }), bytes = b.Bytes();
  return {ms, bytes, bytes / (ms * 1e-3) / 1e12, b.MaxRelErr(0), path.PlanJson()};
}

template <template <uint32_t, typename> class Path, uint32_t kHeadDim, typename KV>
double CheckSmall(const Heads& heads) {
  PagedBatch<KV> b(heads, {1000, 37, 512}, 7);
  b.PoisonOutput();
  Path<kHeadDim, KV> path(b);
  path.Run();
  KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  double worst = 0;
  for (int seq = 0; seq < 3; ++seq) worst = Worse(worst, b.MaxRelErr(seq));
  return worst;
}

// The variants in table and JSON order: path x KV dtype. The CUDA-core ones (the first two) run
// only where Heads::cuda_core_group().
constexpr int kVariants = 4;
const char* const kVariantNames[kVariants] = {"fp16", "fp8", "tc_fp16", "tc_fp8"};
bool IsTensorCore(int variant) { return variant >= 2; }

template <uint32_t kHeadDim, typename KV>
void TimeBothPaths(const Heads& heads, const Shape& shape, int iters, bench::L2Flush& flush,
                   Timing* cuda_core, Timing* tensor_core) {
  const PagedBatch<KV> b(heads, std::vector<int>(shape.batch, shape.context),
                         shape.batch * 131 + shape.context);
  if (heads.cuda_core_group()) *cuda_core = TimeCase<CudaCoreDecode, kHeadDim>(b, iters, flush);
  *tensor_core = TimeCase<TensorCoreDecode, kHeadDim>(b, iters, flush);
}

template <uint32_t kHeadDim>
int Run(const Heads& heads) {
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  cudaDeviceProp prop{};
  KVPOOL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  bool ran[kVariants];
  for (int v = 0; v < kVariants; ++v) ran[v] = IsTensorCore(v) || heads.cuda_core_group();
  double check[kVariants] = {NAN, NAN, CheckSmall<TensorCoreDecode, kHeadDim, __half>(heads),
                             CheckSmall<TensorCoreDecode, kHeadDim, __nv_fp8_e4m3>(heads)};
  if (heads.cuda_core_group()) {
    check[0] = CheckSmall<CudaCoreDecode, kHeadDim, __half>(heads);
    check[1] = CheckSmall<CudaCoreDecode, kHeadDim, __nv_fp8_e4m3>(heads);
  }
  bool ok = true;
  std::printf(
      "device %s, %d q heads, %d KV heads, head_dim %d; check (contexts 1000, 37, 512): "
      "max rel err",
      prop.name, heads.q, heads.kv, heads.dim);
  for (int v = 0; v < kVariants; ++v) {
    if (!ran[v]) continue;
    std::printf(" %s %.3e", kVariantNames[v], check[v]);
    ok = ok && check[v] <= kMaxRelErr;
  }
  std::printf("\n");
  if (!ok) {
    std::fprintf(stderr, "flashinfer_decode_bench: check failed (limit %.0e)\n", kMaxRelErr);
    return 1;
  }

  bench::L2Flush flush(absl::GetFlag(FLAGS_l2_flush));
  std::vector<std::vector<Timing>> timings;
  std::printf("%5s %6s", "batch", "ctx");
  for (int v = 0; v < kVariants; ++v) {
    if (ran[v]) std::printf(" | %7s ms %6s %8s", kVariantNames[v], "TB/s", "seq0 err");
  }
  std::printf("\n");
  for (const Shape& shape : bench::kDecodeShapes) {
    std::vector<Timing>& t = timings.emplace_back(kVariants);
    TimeBothPaths<kHeadDim, __half>(heads, shape, iters, flush, &t[0], &t[2]);
    TimeBothPaths<kHeadDim, __nv_fp8_e4m3>(heads, shape, iters, flush, &t[1], &t[3]);
    std::printf("%5d %6d", shape.batch, shape.context);
    for (int v = 0; v < kVariants; ++v) {
      if (!ran[v]) continue;
      std::printf(" | %10.4f %6.3f %8.2e", t[v].ms, t[v].tbps, t[v].err);
      ok = ok && t[v].err <= kMaxRelErr;
    }
    std::printf("\n");
  }

  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::string json = absl::StrFormat(
        "{\n  \"tool\": \"flashinfer_decode_bench\",\n  \"flashinfer\": \"0.2.14.post1\","
        "\n  \"device\": \"%s\",\n  \"commit\": \"%s\",\n  \"date\": \"%s\",\n"
        "  \"q_heads\": %d, \"kv_heads\": %d, \"head_dim\": %d,\n"
        "  \"iters\": %d,\n  \"l2_flush\": \"%s\",\n  \"check\": {",
        prop.name, absl::GetFlag(FLAGS_commit),
        absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone()), heads.q, heads.kv,
        heads.dim, iters, absl::GetFlag(FLAGS_l2_flush));
    const char* sep = "";
    for (int v = 0; v < kVariants; ++v) {
      if (!ran[v]) continue;
      absl::StrAppendFormat(&json, "%s\"%s_max_rel_err\": %.3e", sep, kVariantNames[v], check[v]);
      sep = ", ";
    }
    json += "},\n  \"cases\": [\n";
    for (size_t i = 0; i < timings.size(); ++i) {
      const Shape& shape = bench::kDecodeShapes[i];
      absl::StrAppendFormat(&json, "    {\"batch\": %d, \"context\": %d", shape.batch,
                            shape.context);
      for (int v = 0; v < kVariants; ++v) {
        if (!ran[v]) continue;
        const Timing& t = timings[i][v];
        absl::StrAppendFormat(&json,
                              ", \"flashinfer_%s\": {\"ms\": %.5f, \"bytes\": %.0f, "
                              "\"tbps\": %.4f, \"seq0_max_rel_err\": %.3e, %s}",
                              kVariantNames[v], t.ms, t.bytes, t.tbps, t.err, t.plan_json);
      }
      absl::StrAppendFormat(&json, "}%s\n", i + 1 < timings.size() ? "," : "");
    }
    json += "  ]\n}\n";
    if (!bench::WriteResultFile(out, json)) return 1;
  }
  if (!ok) {
    std::fprintf(stderr, "flashinfer_decode_bench: a case's error is above %.0e\n", kMaxRelErr);
    return 1;
  }
  return 0;
}

int Main() {
  const Heads heads{absl::GetFlag(FLAGS_q_heads), absl::GetFlag(FLAGS_kv_heads),
                    absl::GetFlag(FLAGS_head_dim)};
  if (heads.q <= 0 || heads.kv <= 0 || heads.q % heads.kv != 0) {
    std::fprintf(stderr, "flashinfer_decode_bench: --kv_heads must divide --q_heads\n");
    return 2;
  }
  if (heads.dim != 64 && heads.dim != 128 && heads.dim != 256) {
    std::fprintf(stderr, "flashinfer_decode_bench: --head_dim must be 64, 128 or 256\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "flashinfer_decode_bench: no CUDA device visible\n");
    return 1;
  }
  switch (heads.dim) {
    case 64:
      return Run<64>(heads);
    case 128:
      return Run<128>(heads);
    default:
      return Run<256>(heads);
  }
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    return kvpool::Main();
  } catch (const std::exception& e) {  // flashinfer::Error from a plan or a dispatch
    std::fprintf(stderr, "flashinfer_decode_bench: %s\n", e.what());
    return 1;
  }
}
