// Bandwidth of the fused rotate-quantize-append kernel against a streaming-copy ceiling.
//
// In one run: StreamingCopy over the same bytes as the input (bytes read + written), then
// cuda::QuantizeAppend per dtype and rotation block {0, 16, 32, 64, 128} over >= 1 GiB of fp16
// K+V (Llama geometry: 8 KV heads x head_dim 128, block_tokens 16, contiguous slot mapping).
// Each case: CUDA events, warm-up, median of --runs. Bytes counted = fp16 read + page bytes
// written (codes + meta) + slot mapping read. The rotation overhead (INT4 rot128 against rot0)
// comes from those cases, measured one after the other, and again from --pairs pairs of the two
// launched in turn (the median of the per-pair ratios), where both see the same clocks and power.
// Prints a table; --out writes JSON with the date, --commit, GPU name and command line.
//
// usage: quantize_bench --out=results.json --commit=$(git rev-parse HEAD) [--gib=1] [--runs=25]
//        [--pairs=100]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/streaming_copy.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(std::string, out, "", "JSON output path (none: table only)");
ABSL_FLAG(std::string, commit, "unknown", "git commit of the build");
ABSL_FLAG(double, gib, 1.0, "GiB of fp16 K+V input per kernel call");
ABSL_FLAG(int, runs, 25, "timed runs per case (median reported)");
ABSL_FLAG(int, pairs, 100,
          "pairs of INT4 rot0 and rot128 launches, one after the other, for the interleaved "
          "rotation overhead");

namespace kvpool {
namespace {

constexpr int kHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kBlockTokens = 16;
constexpr int kWarmup = 3;

#define BENCH_CHECK(expr)                                                       \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    if (err_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

// Medians of `pairs` pairs of launches of a then b, each timed, after warm-up, and the median of
// the per-pair ratios b / a.
struct Interleaved {
  int pairs;
  double a_ms, b_ms, ratio;
};
Interleaved TimeInterleaved(int pairs, const QuantizeAppendParams& a,
                            const QuantizeAppendParams& b) {
  cudaEvent_t e[3];
  for (cudaEvent_t& x : e) BENCH_CHECK(cudaEventCreate(&x));
  auto launch = [](const QuantizeAppendParams& p) {
    if (cuda::QuantizeAppend(p, nullptr) != KernelStatus::kOk) {
      std::fprintf(stderr, "kernel failed: %s\n", cuda::LastErrorMessage());
      std::exit(1);
    }
  };
  for (int i = 0; i < kWarmup; ++i) {
    launch(a);
    launch(b);
  }
  std::vector<double> a_ms, b_ms, ratio;
  for (int i = 0; i < pairs; ++i) {
    BENCH_CHECK(cudaEventRecord(e[0]));
    launch(a);
    BENCH_CHECK(cudaEventRecord(e[1]));
    launch(b);
    BENCH_CHECK(cudaEventRecord(e[2]));
    BENCH_CHECK(cudaEventSynchronize(e[2]));
    float ta = 0, tb = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ta, e[0], e[1]));
    BENCH_CHECK(cudaEventElapsedTime(&tb, e[1], e[2]));
    a_ms.push_back(ta);
    b_ms.push_back(tb);
    ratio.push_back(tb / ta);
  }
  for (cudaEvent_t& x : e) cudaEventDestroy(x);
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  return {pairs, median(a_ms), median(b_ms), median(ratio)};
}

// Median milliseconds of `runs` timed calls of `fn` after warm-up.
double MedianMs(int runs, const std::function<KernelStatus()>& fn) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < kWarmup; ++i) {
    if (fn() != KernelStatus::kOk) {
      std::fprintf(stderr, "kernel failed: %s\n", cuda::LastErrorMessage());
      std::exit(1);
    }
  }
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    BENCH_CHECK(cudaEventRecord(start));
    const KernelStatus s = fn();
    BENCH_CHECK(cudaEventRecord(stop));
    BENCH_CHECK(cudaEventSynchronize(stop));
    if (s != KernelStatus::kOk) {
      std::fprintf(stderr, "kernel failed: %s\n", cuda::LastErrorMessage());
      std::exit(1);
    }
    float t = 0;
    BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

const char* DtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kFp16:
      return "fp16";
    case KvDtype::kFp8E4M3:
      return "fp8_e4m3";
    case KvDtype::kInt8:
      return "int8";
    case KvDtype::kInt4:
      return "int4";
  }
  return "?";
}

struct Result {
  KvDtype dtype;
  int rot_block;
  double ms;
  double gbps;
};

int Main(int argc, char** argv) {
  const std::vector<char*> args(argv, argv + argc);
  absl::ParseCommandLine(argc, argv);
  if (!cuda::Available()) {
    std::fprintf(stderr, "no CUDA device visible\n");
    return 1;
  }
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  const size_t token_bytes = size_t{2} * kHeads * kHeadDim * sizeof(uint16_t);  // K + V
  const int num_tokens = static_cast<int>(absl::GetFlag(FLAGS_gib) * (1 << 30) / token_bytes);
  const int64_t num_blocks = num_tokens / kBlockTokens + 1;
  const size_t kv_bytes = static_cast<size_t>(num_tokens) * kHeads * kHeadDim * 2;

  // Inputs: a random chunk with outlier channels, tiled over the whole buffer.
  uint16_t *k, *v;
  int64_t* slots;
  uint8_t* pages;
  PageLayout fp16_layout{kHeads, kHeadDim, kBlockTokens, KvDtype::kFp16, kHeadDim};
  const size_t pages_bytes = std::max(num_blocks * fp16_layout.layer_page_bytes(), 2 * kv_bytes);
  BENCH_CHECK(cudaMalloc(&k, kv_bytes));
  BENCH_CHECK(cudaMalloc(&v, kv_bytes));
  BENCH_CHECK(cudaMalloc(&slots, num_tokens * sizeof(int64_t)));
  BENCH_CHECK(cudaMalloc(&pages, pages_bytes));
  const int chunk_tokens = std::min(num_tokens, 4096);
  const testing::KvData d =
      testing::MakeKv(chunk_tokens, kHeads, kHeadDim, testing::Outliers::kSpikes, 42);
  const std::vector<uint16_t> hk = testing::ToHalf(d.k), hv = testing::ToHalf(d.v);
  const size_t chunk_bytes = hk.size() * 2;
  for (size_t off = 0; off < kv_bytes; off += chunk_bytes) {
    const size_t n = std::min(chunk_bytes, kv_bytes - off);
    BENCH_CHECK(
        cudaMemcpy(reinterpret_cast<uint8_t*>(k) + off, hk.data(), n, cudaMemcpyHostToDevice));
    BENCH_CHECK(
        cudaMemcpy(reinterpret_cast<uint8_t*>(v) + off, hv.data(), n, cudaMemcpyHostToDevice));
  }
  std::vector<int64_t> host_slots(num_tokens);
  for (int t = 0; t < num_tokens; ++t) host_slots[t] = t;
  BENCH_CHECK(
      cudaMemcpy(slots, host_slots.data(), num_tokens * sizeof(int64_t), cudaMemcpyHostToDevice));

  // Ceiling: the same K+V bytes copied (K then V into the page buffer), read + written.
  const double copy_ms = MedianMs(runs, [&] {
    const KernelStatus s = cuda::StreamingCopy(pages, k, kv_bytes, nullptr);
    return s != KernelStatus::kOk ? s : cuda::StreamingCopy(pages + kv_bytes, v, kv_bytes, nullptr);
  });
  const double copy_gbps = 4.0 * kv_bytes / copy_ms / 1e6;

  auto params = [&](KvDtype dtype, int rot) {
    QuantizeAppendParams p;
    p.layout = PageLayout{kHeads, kHeadDim, kBlockTokens, dtype, kHeadDim, rot, 0x1234};
    p.k = k;
    p.v = v;
    p.slot_mapping = slots;
    p.num_tokens = num_tokens;
    p.pages = pages;
    p.num_blocks = num_blocks;
    return p;
  };
  std::vector<Result> results;
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3, KvDtype::kFp16}) {
    for (int rot : {0, 16, 32, 64, 128}) {
      if (dtype == KvDtype::kFp16 && rot > 0) continue;
      const QuantizeAppendParams p = params(dtype, rot);
      const double ms = MedianMs(runs, [&] { return cuda::QuantizeAppend(p, nullptr); });
      const PageLayout& l = p.layout;
      const double bytes =
          2.0 * kv_bytes +
          num_tokens * (2.0 * kHeads * (l.code_bytes_per_token() + l.meta_bytes_per_token()) +
                        sizeof(int64_t));
      results.push_back(Result{dtype, rot, ms, bytes / ms / 1e6});
    }
  }
  // The same two kernels launched in turn, each pair timed back to back: both see the same state
  // of the GPU (clocks, power), which the cases above, measured one after the other, need not.
  const Interleaved interleaved =
      TimeInterleaved(std::max(1, absl::GetFlag(FLAGS_pairs)), params(KvDtype::kInt4, 0),
                      params(KvDtype::kInt4, 128));
  cudaFree(k);
  cudaFree(v);
  cudaFree(slots);
  cudaFree(pages);

  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  double int4_rot0 = 0, int4_rot128 = 0;
  for (const Result& r : results) {
    if (r.dtype != KvDtype::kInt4) continue;
    if (r.rot_block == 0) int4_rot0 = r.ms;
    if (r.rot_block == 128) int4_rot128 = r.ms;
  }
  const double rotation_overhead = int4_rot128 / int4_rot0 - 1.0;

  std::printf("GPU %s, %d tokens x %d heads x %d (%.2f GiB fp16 K+V), median of %d\n", prop.name,
              num_tokens, kHeads, kHeadDim, 2.0 * kv_bytes / (1 << 30), runs);
  std::printf("%-10s %4s %10s %10s %9s\n", "kernel", "rot", "ms", "GB/s", "of copy");
  std::printf("%-10s %4s %10.3f %10.1f %8.1f%%\n", "copy", "-", copy_ms, copy_gbps, 100.0);
  for (const Result& r : results) {
    std::printf("%-10s %4d %10.3f %10.1f %8.1f%%\n", DtypeName(r.dtype), r.rot_block, r.ms, r.gbps,
                100.0 * r.gbps / copy_gbps);
  }
  std::printf("rotation overhead (int4 rot128 vs rot0 time): %+.2f%%\n", 100.0 * rotation_overhead);
  std::printf(
      "rotation overhead, %d interleaved pairs: rot0 %.3f ms, rot128 %.3f ms (medians), median "
      "per-pair ratio %+.2f%%\n",
      interleaved.pairs, interleaved.a_ms, interleaved.b_ms, 100.0 * (interleaved.ratio - 1.0));

  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return 0;
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::vector<std::string> cases;
  for (const Result& r : results) {
    cases.push_back(
        absl::StrFormat("    {\"dtype\": \"%s\", \"rot_block\": %d, \"ms\": %.4f, \"gbps\": %.1f, "
                        "\"fraction_of_copy\": %.4f}",
                        DtypeName(r.dtype), r.rot_block, r.ms, r.gbps, r.gbps / copy_gbps));
  }
  std::vector<std::string> cmd(args.begin(), args.end());
  std::string command = absl::StrJoin(cmd, " ");
  std::replace(command.begin(), command.end(), '"', '\'');
  const std::string json = absl::StrFormat(
      "{\n  \"date\": \"%s\",\n  \"commit\": \"%s\",\n  \"gpu\": \"%s\",\n  \"command\": \"%s\",\n"
      "  \"geometry\": {\"tokens\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"block_tokens\": %d,"
      " \"input_bytes\": %d},\n  \"runs\": %d,\n"
      "  \"streaming_copy\": {\"ms\": %.4f, \"gbps\": %.1f},\n"
      "  \"rotation_overhead_int4_rot128_vs_rot0\": %.4f,\n"
      "  \"rotation_overhead_interleaved\": {\"pairs\": %d, \"rot0_ms\": %.4f, "
      "\"rot128_ms\": %.4f, \"overhead\": %.4f},\n  \"cases\": [\n%s\n  ]\n}\n",
      date, absl::GetFlag(FLAGS_commit), prop.name, command, num_tokens, kHeads, kHeadDim,
      kBlockTokens, 2 * kv_bytes, runs, copy_ms, copy_gbps, rotation_overhead, interleaved.pairs,
      interleaved.a_ms, interleaved.b_ms, interleaved.ratio - 1.0, absl::StrJoin(cases, ",\n"));
  std::FILE* f = std::fopen(out.c_str(), "w");
  if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
    std::fprintf(stderr, "cannot write %s\n", out.c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) { return kvpool::Main(argc, argv); }
