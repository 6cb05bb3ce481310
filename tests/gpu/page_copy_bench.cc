// How fast the split CTAs of paged decode attention can bring their pages into the SMs, with the
// compute left out: the tensor-core kernel's access pattern (per (sequence, KV head, split) CTA,
// four warps taking 16-token tiles w, w + 4, ...; the K and V head pages of each tile's block;
// scattered block tables, block_tokens 16, 8 KV heads) read three ways (page_copy_bench_kernels.h):
// 16-byte cp.async per lane into per-warp stages (the kernels' way), one cp.async.bulk per page
// completing on an mbarrier, and 16-byte loads into registers. Head pages of 1,088 bytes (INT4
// at head_dim 128: 16 x 64 bytes of codes + 16 x 4 of scale/zero; 5 stages) and 4,096 bytes
// (FP16; 3 stages); the split counts the attention kernels plan for each case
// (cuda::PlanAttention). Time: CUDA events around one
// launch after an L2 flush (--l2_flush), the median of --iters runs; the streaming-read ceiling
// in the same run.
#include <cuda_runtime.h>

#include <algorithm>
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
#include "tests/gpu/attention_bench_kernels.h"
#include "tests/gpu/attention_test_util.h"
#include "tests/gpu/page_copy_bench_kernels.h"

ABSL_FLAG(int, iters, 25, "timed runs per case; the median is reported");
ABSL_FLAG(std::string, l2_flush, "read", "the L2 flush before every timed run (bench::L2Flush)");
ABSL_FLAG(std::string, commit, "", "source revision recorded in the JSON");
ABSL_FLAG(std::string, out, "", "write the results as JSON to this path");

namespace kvpool {
namespace {

using bench::PageCopy;
using testing::DeviceBuffer;

constexpr int kKvHeads = 8;
constexpr int kBlockTokens = 16;

struct Pages {
  const char* name;
  KvDtype dtype;
  int stages;  // the tensor-core kernel's at head_dim 128
};
constexpr Pages kPages[] = {{"int4", KvDtype::kInt4, 5}, {"fp16", KvDtype::kFp16, 3}};

PageLayout Layout(KvDtype dtype) {
  PageLayout l;
  l.num_kv_heads = kKvHeads;
  l.head_dim = 128;
  l.block_tokens = kBlockTokens;
  l.dtype = dtype;
  l.group_size = 128;
  return l;
}

struct Way {
  const char* name;
  PageCopy how;
};
constexpr Way kWays[] = {
    {"cp_async", PageCopy::kCpAsync}, {"bulk", PageCopy::kBulk}, {"load", PageCopy::kLoad}};

struct Result {
  bench::DecodeShape shape;
  int splits;
  const char* pages;
  const char* way;
  double us, tbps, frac_stream;
};

int Main() {
  if (!cuda::Available()) {
    std::fprintf(stderr, "page_copy_bench: no CUDA device visible\n");
    return 1;
  }
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  bench::L2Flush flush(absl::GetFlag(FLAGS_l2_flush));
  cudaDeviceProp prop{};
  KVPOOL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double stream_tbps = bench::StreamingReadTbps(iters, flush);
  DeviceBuffer sink(size_t{1} << 20);  // a word per CTA
  std::printf("%s, streaming read %.3f TB/s\n", prop.name, stream_tbps);
  std::printf("%5s %6s %6s %-5s %-9s %9s %8s %7s\n", "batch", "ctx", "splits", "pages", "way", "us",
              "TB/s", "stream");
  std::vector<Result> results;
  for (const bench::DecodeShape& c : bench::kDecodeShapes) {
    const int blocks_per_seq = c.context / kBlockTokens;
    const int64_t num_blocks = static_cast<int64_t>(c.batch) * blocks_per_seq + 64;
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937_64 rng(c.batch * 131 + c.context);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<size_t>(c.batch) * blocks_per_seq);
    const DeviceBuffer tables(ids);
    for (const Pages& p : kPages) {
      const PageLayout l = Layout(p.dtype);
      const int head_page_bytes = static_cast<int>(l.head_page_bytes());
      const size_t block_bytes = l.layer_page_bytes();
      DeviceBuffer pages(static_cast<size_t>(num_blocks) * block_bytes);
      KVPOOL_CUDA_CHECK(cudaMemset(pages.get(), 0x5A, pages.bytes()));
      bench::PageCopyArgs a;
      a.pages = pages.get<uint8_t>();
      a.block_tables = tables.get<int32_t>();
      a.num_seqs = c.batch;
      a.num_kv_heads = kKvHeads;
      a.context = c.context;
      a.num_splits = cuda::PlanAttention(l, c.batch, 32, blocks_per_seq, 0).num_splits;
      a.head_page_bytes = head_page_bytes;
      a.stages = p.stages;
      a.sink = sink.get<uint32_t>();
      const double read_bytes = static_cast<double>(ids.size()) * block_bytes;
      for (const Way& w : kWays) {
        const double ms = testing::MedianMs(
            iters, flush, [&] { KVPOOL_CUDA_CHECK(bench::RunPageCopy(w.how, a, nullptr)); });
        const double tbps = read_bytes / (ms * 1e-3) / 1e12;
        results.push_back({c, a.num_splits, p.name, w.name, ms * 1e3, tbps, tbps / stream_tbps});
        const Result& r = results.back();
        std::printf("%5d %6d %6d %-5s %-9s %9.1f %8.3f %6.1f%%\n", c.batch, c.context, r.splits,
                    r.pages, r.way, r.us, r.tbps, 100 * r.frac_stream);
      }
    }
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::string json = absl::StrFormat(
        "{\n  \"benchmark\": \"page_copy_bench\",\n  \"device\": \"%s\",\n"
        "  \"commit\": \"%s\",\n  \"iters\": %d,\n  \"l2_flush\": \"%s\",\n"
        "  \"stream_read_tbps\": %.4f,\n  \"cases\": [\n",
        prop.name, absl::GetFlag(FLAGS_commit), iters, absl::GetFlag(FLAGS_l2_flush), stream_tbps);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      absl::StrAppendFormat(
          &json,
          "    {\"batch\": %d, \"context\": %d, \"splits\": %d, \"pages\": \"%s\", "
          "\"way\": \"%s\", \"us\": %.2f, \"tbps\": %.4f, \"frac_stream\": %.4f}%s\n",
          r.shape.batch, r.shape.context, r.splits, r.pages, r.way, r.us, r.tbps, r.frac_stream,
          i + 1 < results.size() ? "," : "");
    }
    json += "  ]\n}\n";
    if (!bench::WriteResultFile(out, json)) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvpool::Main();
}
