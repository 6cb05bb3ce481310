// Bandwidth of the fused rotate-quantize-append kernel against a streaming-copy ceiling.
//
// In one run: StreamingCopy over the same bytes as the input (bytes read + written), then
// cuda::QuantizeAppend per dtype and rotation block {0, 16, 32, 64, 128} over >= 1 GiB of fp16
// K+V (Llama geometry: 8 KV heads x head_dim 128, block_tokens 16, contiguous slot mapping).
// Each case: CUDA events, warm-up, median of --runs. Bytes counted = fp16 read + page bytes
// written (codes + meta) + slot mapping read. The rotation overhead (INT4 rot128 against rot0)
// comes from those cases, measured one after the other, and again from --pairs pairs of the two
// launched in turn (the median of the per-pair ratios), where both see the same clocks and power.
// An SM clock probe (quantize_bench_kernels.h) runs before and after each case and around each
// kernel of a pair (outside the timed ranges): the rotated kernel, bound by its instructions,
// slows when the clock drops under sustained load, so the pairs' overhead is also reported
// separately for the pairs whose rot128 launch ran at full clock (probes before and after it at
// >= --full_clock_fraction of the device's rated SM clock) and for the others.
// Prints a table; --out writes JSON with the date, --commit, GPU name and command line.
//
// usage: quantize_bench --out=results.json --commit=$(git rev-parse HEAD) [--gib=1] [--runs=25]
//        [--pairs=100] [--heat_ms=0]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cuda/streaming_copy.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/bench_output.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/quantize_bench_kernels.h"

ABSL_FLAG(std::string, out, "", "JSON output path (none: table only)");
ABSL_FLAG(std::string, commit, "unknown", "git commit of the build");
ABSL_FLAG(double, gib, 1.0, "GiB of fp16 K+V input per kernel call");
ABSL_FLAG(int, runs, 25, "timed runs per case (median reported)");
ABSL_FLAG(int, pairs, 100,
          "pairs of INT4 rot0 and rot128 launches, one after the other, for the interleaved "
          "rotation overhead");
ABSL_FLAG(double, full_clock_fraction, 0.97,
          "a pair's rot128 launch counts as run at full clock when the SM clock probes before "
          "and after it read at least this fraction of the device's rated SM clock");
ABSL_FLAG(int, clock_probe_ns, 20000, "window of each SM clock probe, ns of the global timer");
ABSL_FLAG(int, heat_ms, 0,
          "INT4 rot128 launches back to back for this long before the pairs: the sustained load "
          "under which the SM clock may drop");

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

double Median(std::vector<double> x) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Exits with the kernel's error unless `s` is kOk.
void ExitIfFailed(KernelStatus s) {
  if (s != KernelStatus::kOk) {
    std::fprintf(stderr, "kernel failed: %s\n", cuda::LastErrorMessage());
    std::exit(1);
  }
}

// Slots in device memory for SM clock probes, enqueued on the default stream between timed
// ranges and read back together.
class ClockProbes {
 public:
  ClockProbes(int capacity, int window_ns) : capacity_(capacity), window_ns_(window_ns) {
    BENCH_CHECK(cudaMalloc(&mhz_, capacity * sizeof(float)));
  }
  ~ClockProbes() { cudaFree(mhz_); }
  ClockProbes(const ClockProbes&) = delete;
  ClockProbes& operator=(const ClockProbes&) = delete;

  // Enqueues a probe; returns its slot.
  int Probe() {
    if (used_ == capacity_) {
      std::fprintf(stderr, "out of SM clock probe slots\n");
      std::exit(1);
    }
    BENCH_CHECK(bench::ProbeSmClock(mhz_ + used_, window_ns_, nullptr));
    return used_++;
  }
  // The probes' readings in MHz, by slot (waits for them).
  std::vector<float> Read() const {
    std::vector<float> out(used_);
    BENCH_CHECK(cudaMemcpy(out.data(), mhz_, used_ * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  float* mhz_ = nullptr;
  int capacity_, window_ns_, used_ = 0;
};

// Pairs of launches of a then b, each timed, after warm-up: the medians of the times and of the
// per-pair ratios b / a, over all pairs and split by whether b ran at full clock.
struct PairClass {
  int pairs = 0;
  double b_ms = 0, ratio = 0;
};
struct Interleaved {
  int pairs;
  double a_ms, b_ms, ratio;
  double a_mhz, b_mhz;  // medians of the probes before a and before b
  PairClass full_clock, lower_clock;
};
Interleaved TimeInterleaved(int pairs, const QuantizeAppendParams& a, const QuantizeAppendParams& b,
                            double full_clock_mhz, int probe_window_ns) {
  cudaEvent_t e[4];
  for (cudaEvent_t& x : e) BENCH_CHECK(cudaEventCreate(&x));
  auto launch = [](const QuantizeAppendParams& p) { ExitIfFailed(cuda::QuantizeAppend(p, nullptr)); };
  for (int i = 0; i < kWarmup; ++i) {
    launch(a);
    launch(b);
  }
  ClockProbes probes(3 * pairs, probe_window_ns);
  std::vector<double> a_ms, b_ms;
  for (int i = 0; i < pairs; ++i) {
    probes.Probe();  // slot 3 i: before a
    BENCH_CHECK(cudaEventRecord(e[0]));
    launch(a);
    BENCH_CHECK(cudaEventRecord(e[1]));
    probes.Probe();  // 3 i + 1: before b
    BENCH_CHECK(cudaEventRecord(e[2]));
    launch(b);
    BENCH_CHECK(cudaEventRecord(e[3]));
    probes.Probe();  // 3 i + 2: after b
    BENCH_CHECK(cudaEventSynchronize(e[3]));
    float ta = 0, tb = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ta, e[0], e[1]));
    BENCH_CHECK(cudaEventElapsedTime(&tb, e[2], e[3]));
    a_ms.push_back(ta);
    b_ms.push_back(tb);
  }
  for (cudaEvent_t& x : e) cudaEventDestroy(x);
  const std::vector<float> mhz = probes.Read();
  std::vector<double> ratio, a_mhz, b_mhz;
  std::vector<double> class_b_ms[2], class_ratio[2];  // [0] full clock, [1] lower
  for (int i = 0; i < pairs; ++i) {
    ratio.push_back(b_ms[i] / a_ms[i]);
    a_mhz.push_back(mhz[3 * i]);
    b_mhz.push_back(mhz[3 * i + 1]);
    const int c = std::min(mhz[3 * i + 1], mhz[3 * i + 2]) >= full_clock_mhz ? 0 : 1;
    class_b_ms[c].push_back(b_ms[i]);
    class_ratio[c].push_back(ratio.back());
  }
  auto pair_class = [&](int c) {
    return PairClass{static_cast<int>(class_ratio[c].size()), Median(class_b_ms[c]),
                     Median(class_ratio[c])};
  };
  return Interleaved{pairs,         Median(a_ms),  Median(b_ms),  Median(ratio),
                     Median(a_mhz), Median(b_mhz), pair_class(0), pair_class(1)};
}

// Median milliseconds of `runs` timed calls of `fn` after warm-up.
double MedianMs(int runs, const std::function<KernelStatus()>& fn) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < kWarmup; ++i) ExitIfFailed(fn());
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    BENCH_CHECK(cudaEventRecord(start));
    const KernelStatus s = fn();
    BENCH_CHECK(cudaEventRecord(stop));
    BENCH_CHECK(cudaEventSynchronize(stop));
    ExitIfFailed(s);
    float t = 0;
    BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(ms);
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
  int probe_before, probe_after;  // ClockProbes slots around the case
};

int Main(int argc, char** argv) {
  const std::vector<char*> args(argv, argv + argc);
  absl::ParseCommandLine(argc, argv);
  if (!cuda::Available()) {
    std::fprintf(stderr, "no CUDA device visible\n");
    return 1;
  }
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  const int probe_window_ns = std::max(1000, absl::GetFlag(FLAGS_clock_probe_ns));
  int rated_khz = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&rated_khz, cudaDevAttrClockRate, 0));
  const double full_clock_mhz = absl::GetFlag(FLAGS_full_clock_fraction) * rated_khz / 1e3;
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
  ClockProbes case_probes(64, probe_window_ns);
  for (KvDtype dtype : {KvDtype::kInt4, KvDtype::kInt8, KvDtype::kFp8E4M3, KvDtype::kFp16}) {
    for (int rot : {0, 16, 32, 64, 128}) {
      if (dtype == KvDtype::kFp16 && rot > 0) continue;
      const QuantizeAppendParams p = params(dtype, rot);
      const int before = case_probes.Probe();
      const double ms = MedianMs(runs, [&] { return cuda::QuantizeAppend(p, nullptr); });
      const int after = case_probes.Probe();
      const PageLayout& l = p.layout;
      const double bytes =
          2.0 * kv_bytes +
          num_tokens * (2.0 * kHeads * (l.code_bytes_per_token() + l.meta_bytes_per_token()) +
                        sizeof(int64_t));
      results.push_back(Result{dtype, rot, ms, bytes / ms / 1e6, before, after});
    }
  }
  // The same two kernels launched in turn, each pair timed back to back: both see the same state
  // of the GPU (clocks, power), which the cases above, measured one after the other, need not.
  if (const int heat_ms = absl::GetFlag(FLAGS_heat_ms); heat_ms > 0) {
    const QuantizeAppendParams p = params(KvDtype::kInt4, 128);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(heat_ms);
    while (std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 32; ++i) ExitIfFailed(cuda::QuantizeAppend(p, nullptr));
      BENCH_CHECK(cudaDeviceSynchronize());
    }
  }
  const Interleaved interleaved =
      TimeInterleaved(std::max(1, absl::GetFlag(FLAGS_pairs)), params(KvDtype::kInt4, 0),
                      params(KvDtype::kInt4, 128), full_clock_mhz, probe_window_ns);
  const std::vector<float> case_mhz = case_probes.Read();
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
  std::printf("%-10s %4s %10s %10s %9s %16s\n", "kernel", "rot", "ms", "GB/s", "of copy",
              "SM MHz (around)");
  std::printf("%-10s %4s %10.3f %10.1f %8.1f%%\n", "copy", "-", copy_ms, copy_gbps, 100.0);
  for (const Result& r : results) {
    std::printf("%-10s %4d %10.3f %10.1f %8.1f%% %8.0f %7.0f\n", DtypeName(r.dtype), r.rot_block,
                r.ms, r.gbps, 100.0 * r.gbps / copy_gbps, case_mhz[r.probe_before],
                case_mhz[r.probe_after]);
  }
  std::printf("rotation overhead (int4 rot128 vs rot0 time): %+.2f%%\n", 100.0 * rotation_overhead);
  std::printf(
      "rotation overhead, %d interleaved pairs: rot0 %.3f ms, rot128 %.3f ms (medians), median "
      "per-pair ratio %+.2f%%; median SM clock before rot0 %.0f MHz, before rot128 %.0f MHz\n",
      interleaved.pairs, interleaved.a_ms, interleaved.b_ms, 100.0 * (interleaved.ratio - 1.0),
      interleaved.a_mhz, interleaved.b_mhz);
  auto print_class = [&](const char* name, const PairClass& c) {
    std::printf("  %s (%d pairs): rot128 %.3f ms, median per-pair ratio %+.2f%%\n", name, c.pairs,
                c.b_ms, c.pairs > 0 ? 100.0 * (c.ratio - 1.0) : 0.0);
  };
  std::printf("  rated SM clock %.0f MHz; full clock: probes around rot128 >= %.0f MHz\n",
              rated_khz / 1e3, full_clock_mhz);
  print_class("rot128 at full clock", interleaved.full_clock);
  print_class("rot128 at a lower clock", interleaved.lower_clock);

  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return 0;
  const std::string date = absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
  std::vector<std::string> cases;
  for (const Result& r : results) {
    cases.push_back(absl::StrFormat(
        "    {\"dtype\": \"%s\", \"rot_block\": %d, \"ms\": %.4f, \"gbps\": %.1f, "
        "\"fraction_of_copy\": %.4f, \"sm_mhz_before\": %.0f, \"sm_mhz_after\": %.0f}",
        DtypeName(r.dtype), r.rot_block, r.ms, r.gbps, r.gbps / copy_gbps, case_mhz[r.probe_before],
        case_mhz[r.probe_after]));
  }
  auto class_json = [](const PairClass& c) {
    return c.pairs > 0 ? absl::StrFormat("{\"pairs\": %d, \"rot128_ms\": %.4f, \"overhead\": %.4f}",
                                         c.pairs, c.b_ms, c.ratio - 1.0)
                       : std::string("{\"pairs\": 0}");
  };
  std::vector<std::string> cmd(args.begin(), args.end());
  std::string command = absl::StrJoin(cmd, " ");
  std::replace(command.begin(), command.end(), '"', '\'');
  const std::string json = absl::StrFormat(
      "{\n  \"date\": \"%s\",\n  \"commit\": \"%s\",\n  \"gpu\": \"%s\",\n  \"command\": \"%s\",\n"
      "  \"geometry\": {\"tokens\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"block_tokens\": %d,"
      " \"input_bytes\": %d},\n  \"runs\": %d,\n"
      "  \"streaming_copy\": {\"ms\": %.4f, \"gbps\": %.1f},\n"
      "  \"rotation_overhead_int4_rot128_vs_rot0\": %.4f,\n"
      "  \"rated_sm_mhz\": %.0f,\n"
      "  \"rotation_overhead_interleaved\": {\"pairs\": %d, \"rot0_ms\": %.4f, "
      "\"rot128_ms\": %.4f, \"overhead\": %.4f, \"rot0_sm_mhz\": %.0f, \"rot128_sm_mhz\": %.0f,\n"
      "    \"full_clock_mhz\": %.0f, \"full_clock\": %s, \"lower_clock\": %s},\n"
      "  \"cases\": [\n%s\n  ]\n}\n",
      date, absl::GetFlag(FLAGS_commit), prop.name, command, num_tokens, kHeads, kHeadDim,
      kBlockTokens, 2 * kv_bytes, runs, copy_ms, copy_gbps, rotation_overhead, rated_khz / 1e3,
      interleaved.pairs, interleaved.a_ms, interleaved.b_ms, interleaved.ratio - 1.0,
      interleaved.a_mhz, interleaved.b_mhz, full_clock_mhz, class_json(interleaved.full_clock),
      class_json(interleaved.lower_clock), absl::StrJoin(cases, ",\n"));
  return bench::WriteResultFile(out, json) ? 0 : 1;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) { return kvpool::Main(argc, argv); }
