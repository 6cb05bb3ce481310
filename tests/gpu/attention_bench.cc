// Paged decode attention on the GPU: time, effective bandwidth and accuracy per page format.
//
// For (batch, context) in {(1,32K), (8,8K), (8,32K), (32,4K), (32,16K), (64,8K)} (--shapes), 32
// query heads, 8 KV heads, head_dim 128 (--q_heads, --kv_heads, --head_dim: other models'
// geometries), block_tokens 16 (--block_tokens), scattered block tables (a random permutation of
// the arena; --block_order): INT4 rotated (rotation block min(128, head_dim)), INT4 naive (no
// rotation), INT8 and FP8 rotated, FP16 pages, all quantized by cuda::QuantizeAppend from the same
// synthetic K/V with outlier channels.
//
// Time: one cuda::PagedDecodeAttention call (all its kernels) between CUDA events, after
// warm-up, with L2 flushed before every run (--l2_flush); the median of --iters runs. Bytes: the
// kernel's own traffic, pages read (codes + scale/zero of every token) + q (fp16) + out (fp32); the
// split partials, a few percent, are not counted. The streaming-read ceiling is measured in the
// same run. Each case also records its plan (cuda::PlanAttention: the splits and the CTAs per SM
// of the split kernel's build).
//
// Accuracy: the FP16-page output is attention over the original fp16 K/V (fp32 accumulation) and
// is the reference; every other format reports the relative L2 error of each (sequence, head)
// output row against it, mean and max.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "tests/common/bench_output.h"
#include "tests/common/kv_test_data.h"
#include "tests/gpu/attention_bench_kernels.h"
#include "tests/gpu/attention_test_util.h"

ABSL_FLAG(std::string, out, "", "write the results as JSON to this path");
ABSL_FLAG(int, iters, 25, "timed runs per case; the median is reported");
ABSL_FLAG(std::string, commit, "", "source revision recorded in the JSON");
ABSL_FLAG(int, splits, 0,
          "split-K count per (sequence, KV head) for every case (0 = the kernel's automatic "
          "choice); for sweeps of the split heuristic");
ABSL_FLAG(std::vector<std::string>, formats, {},
          "formats to time (e.g. int4_rot128,fp8_rot128; default all): one kernel per process "
          "for A/B runs whose cases should not heat the GPU for each other; fp16, the accuracy "
          "reference, always runs");
ABSL_FLAG(std::string, l2_flush, "read",
          "the L2 flush before every timed run: read (a 256 MiB buffer read into the L2, which "
          "holds clean lines after it) or write (the buffer zeroed: the write-back of the dirty "
          "lines it leaves falls inside the timed run); bench::L2Flush");

ABSL_FLAG(int, block_tokens, 16, "tokens per block: 16 (vLLM's default), 32 or 64");
ABSL_FLAG(int, q_heads, 32, "query heads per sequence (a multiple of --kv_heads)");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, head_dim, 128, "channels per head: 64, 128 or 256");
ABSL_FLAG(
    std::vector<std::string>, shapes,
    [] {
      std::vector<std::string> shapes;
      for (const kvpool::bench::DecodeShape& s : kvpool::bench::kDecodeShapes) {
        shapes.push_back(absl::StrFormat("%dx%d", s.batch, s.context));
      }
      return shapes;
    }(),
    "cases as <batch>x<context tokens>, context a multiple of --block_tokens");
ABSL_FLAG(std::string, block_order, "shuffled",
          "block ids of the tables: shuffled (a random permutation of the arena, as a pool hands "
          "them out after churn) or sequential (each sequence's blocks consecutive in the arena)");

namespace kvpool {
namespace {

using testing::DeviceBuffer;
using testing::MedianMs;

constexpr int kFillChunk = 8192;  // tokens generated and quantized per step

// The model geometry every case shares (--q_heads, --kv_heads, --head_dim).
struct Geometry {
  int q_heads, kv_heads, head_dim;
};

using Shape = bench::DecodeShape;

struct Format {
  const char* dtype_name;
  KvDtype dtype;
  bool rotated;
};
// The FP16 format comes last: it is the accuracy reference of the others.
constexpr Format kFormats[] = {{"int4", KvDtype::kInt4, true},
                               {"int4", KvDtype::kInt4, false},
                               {"int8", KvDtype::kInt8, true},
                               {"fp8", KvDtype::kFp8E4M3, true},
                               {"fp16", KvDtype::kFp16, false}};

// Rotated formats use the largest rotation block the pool allows, min(128, head_dim).
int RotBlock(const Format& f, const Geometry& g) {
  return f.rotated ? std::min(128, g.head_dim) : 0;
}

// int4_rot128, int4_naive, ..., fp16: the names --formats selects and the results carry.
std::string FormatName(const Format& f, const Geometry& g) {
  if (f.dtype == KvDtype::kFp16) return f.dtype_name;
  return std::string(f.dtype_name) +
         (f.rotated ? "_rot" + std::to_string(RotBlock(f, g)) : std::string("_naive"));
}

PageLayout MakeLayout(const Format& f, const Geometry& g) {
  PageLayout l;
  l.num_kv_heads = g.kv_heads;
  l.head_dim = g.head_dim;
  l.block_tokens = absl::GetFlag(FLAGS_block_tokens);
  l.dtype = f.dtype;
  l.group_size = g.head_dim;
  l.rot_block = RotBlock(f, g);
  l.sign_seed = l.rot_block > 0 ? 0x5167ull : 0;
  return l;
}

struct Result {
  Shape shape;
  std::string format;
  double ms = 0, bytes = 0, tbps = 0, frac_stream = 0;
  double err_mean = 0, err_max = 0;  // vs the FP16 pages; 0 for FP16 itself
  cuda::AttentionPlan plan;          // the splits and split-kernel build the call ran
};

void Check(KernelStatus s, const char* what) {
  if (s != KernelStatus::kOk) {
    std::fprintf(stderr, "%s: %s %s\n", what, KernelStatusName(s), cuda::LastErrorMessage());
    std::exit(1);
  }
}

// Pages of one format for a whole batch: every sequence's tokens generated on the device and
// quantized into the scattered blocks of its table.
DeviceBuffer FillPages(const PageLayout& l, const Shape& shape, int64_t num_blocks,
                       const std::vector<int32_t>& tables, int blocks_per_seq) {
  DeviceBuffer pages(static_cast<size_t>(num_blocks) * l.layer_page_bytes());
  const size_t chunk_elems = static_cast<size_t>(kFillChunk) * l.num_kv_heads * l.head_dim;
  DeviceBuffer k(chunk_elems * 2), v(chunk_elems * 2), slots(kFillChunk * sizeof(int64_t));
  std::vector<int64_t> host_slots(kFillChunk);
  for (int s = 0; s < shape.batch; ++s) {
    for (int t0 = 0; t0 < shape.context; t0 += kFillChunk) {
      const int n = std::min(kFillChunk, shape.context - t0);
      for (int i = 0; i < n; ++i) {
        const int t = t0 + i;
        host_slots[i] =
            static_cast<int64_t>(tables[s * blocks_per_seq + t / l.block_tokens]) * l.block_tokens +
            t % l.block_tokens;
      }
      KVPOOL_CUDA_CHECK(
          cudaMemcpy(slots.get(), host_slots.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice));
      KVPOOL_CUDA_CHECK(bench::FillSyntheticKv(k.get<uint16_t>(), v.get<uint16_t>(), t0, n,
                                               l.num_kv_heads, l.head_dim, 1000 + s, nullptr));
      QuantizeAppendParams qp;
      qp.layout = l;
      qp.k = k.get<uint16_t>();
      qp.v = v.get<uint16_t>();
      qp.slot_mapping = slots.get<int64_t>();
      qp.num_tokens = n;
      qp.pages = pages.get<uint8_t>();
      qp.num_blocks = num_blocks;
      Check(cuda::QuantizeAppend(qp, nullptr), "cuda::QuantizeAppend");
    }
  }
  KVPOOL_CUDA_CHECK(cudaDeviceSynchronize());
  return pages;
}

// Relative L2 error of each output row against the reference: {mean, max}.
std::pair<double, double> RowErrors(const std::vector<float>& got, const std::vector<float>& ref,
                                    int head_dim) {
  double sum = 0, worst = 0;
  const size_t rows = ref.size() / head_dim;
  for (size_t r = 0; r < rows; ++r) {
    double num = 0, den = 0;
    for (int c = 0; c < head_dim; ++c) {
      const double d = got[r * head_dim + c] - ref[r * head_dim + c];
      num += d * d;
      den += static_cast<double>(ref[r * head_dim + c]) * ref[r * head_dim + c];
    }
    const double e = std::sqrt(num / den);
    sum += e;
    worst = std::max(worst, e);
  }
  return {sum / rows, worst};
}

void RunShape(const Geometry& g, const Shape& shape, int iters, double stream_tbps,
              bench::L2Flush& flush, std::vector<Result>* results) {
  const int blocks_per_seq = shape.context / absl::GetFlag(FLAGS_block_tokens);
  const int splits = absl::GetFlag(FLAGS_splits);
  const int64_t num_blocks = static_cast<int64_t>(shape.batch) * blocks_per_seq + 64;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  if (absl::GetFlag(FLAGS_block_order) == "shuffled") {
    std::mt19937_64 rng(shape.batch * 131 + shape.context);
    std::shuffle(ids.begin(), ids.end(), rng);
  }
  ids.resize(static_cast<size_t>(shape.batch) * blocks_per_seq);
  const std::vector<int32_t> lens(shape.batch, shape.context);
  const size_t rows = static_cast<size_t>(shape.batch) * g.q_heads;
  DeviceBuffer tables(ids), seq_lens(lens), out(rows * g.head_dim * sizeof(float));
  DeviceBuffer q(testing::ToHalf(testing::MakeNormal(rows * g.head_dim, shape.context + 7)));

  std::vector<std::vector<float>> outputs;
  const size_t first = results->size();
  const std::vector<std::string> wanted = absl::GetFlag(FLAGS_formats);
  for (const Format& f : kFormats) {
    const std::string name = FormatName(f, g);
    if (!wanted.empty() && f.dtype != KvDtype::kFp16 &&
        std::find(wanted.begin(), wanted.end(), name) == wanted.end()) {
      continue;
    }
    const PageLayout l = MakeLayout(f, g);
    const DeviceBuffer pages = FillPages(l, shape, num_blocks, ids, blocks_per_seq);
    DeviceBuffer workspace(
        cuda::AttentionWorkspaceBytes(l, shape.batch, g.q_heads, blocks_per_seq, splits));
    PagedDecodeAttentionParams p;
    p.layout = l;
    p.pages = pages.get<uint8_t>();
    p.q = q.get<uint16_t>();
    p.num_seqs = shape.batch;
    p.num_q_heads = g.q_heads;
    p.block_tables = tables.get<int32_t>();
    p.max_blocks_per_seq = blocks_per_seq;
    p.seq_lens = seq_lens.get<int32_t>();
    p.sm_scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
    p.out = out.get<float>();
    p.num_blocks = num_blocks;
    p.workspace = workspace.get();
    p.workspace_bytes = workspace.bytes();
    p.num_splits = splits;
    Result r;
    r.shape = shape;
    r.format = name;
    r.plan = cuda::PlanAttention(l, shape.batch, g.q_heads, blocks_per_seq, splits);
    r.ms = MedianMs(iters, flush,
                    [&] { Check(cuda::PagedDecodeAttention(p, nullptr), name.c_str()); });
    const double page_bytes = static_cast<double>(shape.batch) * shape.context * g.kv_heads * 2 *
                              (l.code_bytes_per_token() + l.meta_bytes_per_token());
    r.bytes = page_bytes + rows * g.head_dim * (2.0 + 4.0);
    r.tbps = r.bytes / (r.ms * 1e-3) / 1e12;
    r.frac_stream = r.tbps / stream_tbps;
    outputs.push_back(out.ToHost<float>());
    results->push_back(r);
  }
  for (size_t i = 0; i + 1 < outputs.size(); ++i) {
    const auto [mean, worst] = RowErrors(outputs[i], outputs.back(), g.head_dim);
    (*results)[first + i].err_mean = mean;
    (*results)[first + i].err_max = worst;
  }
}

bool WriteJson(const std::string& path, const std::string& device, const Geometry& g,
               double stream_tbps, double launch_floor_ms, int iters,
               const std::vector<Result>& results) {
  std::string json = absl::StrFormat(
      "{\n  \"benchmark\": \"attention_bench\",\n  \"device\": \"%s\",\n"
      "  \"commit\": \"%s\",\n  \"q_heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, "
      "\"block_tokens\": %d, \"block_order\": \"%s\",\n  \"iters\": %d,\n  \"splits\": %d,\n"
      "  \"l2_flush\": \"%s\",\n  \"stream_read_tbps\": %.4f,\n  \"launch_floor_ms\": %.5f,\n"
      "  \"cases\": [\n",
      device, absl::GetFlag(FLAGS_commit), g.q_heads, g.kv_heads, g.head_dim,
      absl::GetFlag(FLAGS_block_tokens), absl::GetFlag(FLAGS_block_order), iters,
      absl::GetFlag(FLAGS_splits), absl::GetFlag(FLAGS_l2_flush), stream_tbps, launch_floor_ms);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    absl::StrAppendFormat(&json,
                          "    {\"batch\": %d, \"context\": %d, \"format\": \"%s\", \"ms\": %.5f, "
                          "\"bytes\": %.0f, \"tbps\": %.4f, \"frac_stream\": %.4f, "
                          "\"rel_err_vs_fp16_mean\": %.6f, \"rel_err_vs_fp16_max\": %.6f, "
                          "\"splits\": %d, \"ctas_per_sm\": %d}%s\n",
                          r.shape.batch, r.shape.context, r.format, r.ms, r.bytes, r.tbps,
                          r.frac_stream, r.err_mean, r.err_max, r.plan.num_splits,
                          r.plan.ctas_per_sm, i + 1 < results.size() ? "," : "");
  }
  json += "  ]\n}\n";
  return bench::WriteResultFile(path, json);
}

// --shapes: "<batch>x<context>" items, each context a positive multiple of block_tokens.
bool ParseShapes(int block_tokens, std::vector<Shape>* shapes) {
  for (const std::string& item : absl::GetFlag(FLAGS_shapes)) {
    Shape s{};
    char rest = 0;
    if (std::sscanf(item.c_str(), "%dx%d%c", &s.batch, &s.context, &rest) != 2 || s.batch < 1 ||
        s.context < block_tokens || s.context % block_tokens != 0) {
      return false;
    }
    shapes->push_back(s);
  }
  return !shapes->empty();
}

int Main() {
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const int block_tokens = absl::GetFlag(FLAGS_block_tokens);
  const std::string order = absl::GetFlag(FLAGS_block_order);
  const Geometry g{absl::GetFlag(FLAGS_q_heads), absl::GetFlag(FLAGS_kv_heads),
                   absl::GetFlag(FLAGS_head_dim)};
  std::vector<Shape> shapes;
  if ((block_tokens != 16 && block_tokens != 32 && block_tokens != 64) ||
      (order != "shuffled" && order != "sequential") ||
      (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256) || g.kv_heads < 1 ||
      g.q_heads < g.kv_heads || g.q_heads % g.kv_heads != 0 ||
      !ParseShapes(block_tokens, &shapes)) {
    std::fprintf(stderr,
                 "attention_bench: --block_tokens is 16, 32 or 64, --block_order shuffled or "
                 "sequential, --head_dim 64, 128 or 256, --q_heads a multiple of --kv_heads, "
                 "--shapes <batch>x<context> items with contexts that are multiples of "
                 "--block_tokens\n");
    return 2;
  }
  if (!cuda::Available()) {
    std::fprintf(stderr, "attention_bench: no CUDA device visible\n");
    return 1;
  }
  cudaDeviceProp prop{};
  KVPOOL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string flush_mode = absl::GetFlag(FLAGS_l2_flush);
  bench::L2Flush flush(flush_mode);
  const double stream_tbps = bench::StreamingReadTbps(iters, flush);
  const double launch_floor_ms = bench::LaunchFloorMs(iters, flush);
  std::printf("device %s, streaming read %.3f TB/s, an empty launch %.1f µs (L2 flush: %s)\n",
              prop.name, stream_tbps, 1e3 * launch_floor_ms, flush_mode.c_str());
  std::vector<Result> results;
  std::printf("%d q heads, %d KV heads, head_dim %d\n", g.q_heads, g.kv_heads, g.head_dim);
  for (const Shape& shape : shapes) RunShape(g, shape, iters, stream_tbps, flush, &results);

  std::printf("%5s %6s %-12s %9s %8s %7s %10s %10s %6s %4s\n", "batch", "ctx", "format", "ms",
              "TB/s", "stream", "err_mean", "err_max", "splits", "ctas");
  for (const Result& r : results) {
    std::printf("%5d %6d %-12s %9.4f %8.3f %6.1f%% %10.2e %10.2e %6d %4d\n", r.shape.batch,
                r.shape.context, r.format.c_str(), r.ms, r.tbps, 100 * r.frac_stream, r.err_mean,
                r.err_max, r.plan.num_splits, r.plan.ctas_per_sm);
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty() && !WriteJson(out, prop.name, g, stream_tbps, launch_floor_ms, iters, results)) {
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvpool::Main();
}
