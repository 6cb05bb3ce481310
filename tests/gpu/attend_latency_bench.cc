// Where an Attend call's time goes on the server, without gRPC: for batch x context shapes over
// an in-process KvStore on the CUDA backend (one INT4 layer, rotation 128, 8 KV heads x head_dim
// 128, 32 query heads; fp16 output, the service's default), the wall-clock p50/p99 of
//   runner  AttendRunner::Run on a prepared AttendRequest: what the gRPC handler does;
//   store   KvStore::Attend on the same items: locks, lease lookup, checks, block tables, the
//           backend's staging copies, the kernels and the synchronization;
//   append  the same with a new token's K/V per item, appended (fused quantize) before attention:
//           a decode step;
//   pinned  the store call as an AttendSocket region step makes it: q back to back and the output
//           in host memory registered with the backend (ComputeBackend::RegisterHostMemory), so
//           the backend copies them straight to and from the device; "pinned append" the same
//           with each item's new K/V in that memory too (a region decode step). With
//           --rewrite_region another thread rewrites that memory (q, output and new K/V) before
//           each call, as the region's client does: the call then reads what another core wrote;
//   backend ComputeBackend::PagedDecodeAttention of the CUDA backend on host q, block tables and
//           lengths of the same shape over a synthetic arena: staging copies, kernels, copy back;
//           "backend pinned" the same with q and out in registered host memory, "backend
//           append" that with a new token per sequence appended first (fused quantize);
//   kernel  cuda::PagedDecodeAttention alone on device-resident inputs of that arena (CUDA
//           events, L2 as warm as in a decode loop); "kernel append" the same after the
//           append's cuda::QuantizeAppend, as the backend launches both for a decode step;
//           "layers in turn" that over --kernel_layers layers of pages, one per call, as a
//           model's decode steps visit its layers (`kvpool bench attend` does too).
// The gRPC share is the client's p50 (`kvpool bench attend`) minus the runner's.
//
// usage: attend_latency_bench [--iters=300] [--kernel_host_io=false] [--rewrite_region]
//        [--kernel_layers=32] [--out=results.json --commit=<sha>]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/kv_kernels.h"
#include "service/attend_runner.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/bench_output.h"
#include "tests/common/kv_test_data.h"
#include "tests/common/region_writer.h"
#include "tests/gpu/attention_test_util.h"

ABSL_FLAG(int, iters, 300, "timed calls per shape and path (after 20 warm-up calls)");
ABSL_FLAG(std::string, out, "", "write the results as JSON to this path");
ABSL_FLAG(std::string, commit, "unknown", "git commit of the build");
ABSL_FLAG(int, kernel_layers, 32,
          "layers of the synthetic arena that the 'kernels with the append, layers in turn' column "
          "visits one per call, as a model's decode steps (and `kvpool bench attend`) do");
ABSL_FLAG(bool, rewrite_region, false,
          "the pinned columns' q and new K/V rewritten by another thread before each call, as an "
          "AttendSocket client rewrites its region");
ABSL_FLAG(bool, kernel_host_io, true,
          "CudaBackendOptions::kernel_host_io: false times the DMA copies around the kernels");

namespace kvpool {
namespace {

constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kQHeads = 32;
constexpr int kBlockTokens = 16;
constexpr int kWarmup = 20;

struct Shape {
  int batch, context;
};
constexpr Shape kShapes[] = {{1, 16}, {1, 32768}, {32, 16}, {32, 4096}, {32, 32768}};

struct Times {
  double p50_us, p99_us;
};

Times Percentiles(const std::vector<double>& us) {
  return {bench::Percentile(us, 0.5), bench::Percentile(us, 0.99)};
}

// `before` runs ahead of each call, outside the timed span.
template <typename F>
Times TimeWall(int iters, F&& call, const std::function<void()>& before = nullptr) {
  std::vector<double> us;
  for (int i = 0; i < kWarmup + iters; ++i) {
    if (before) before();
    const absl::Time start = absl::Now();
    if (!call()) std::exit(1);
    if (i >= kWarmup) us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
  }
  return Percentiles(us);
}

struct ArenaTimes {
  Times backend, backend_pinned, backend_append, kernel, kernel_append, kernel_append_layers;
};

// The backend call and the bare kernel of `shape` over a synthetic arena: constant INT4 pages
// (finite meta), contiguous block tables.
ArenaTimes TimeArena(ComputeBackend* backend, const PageLayout& layout, const Shape& shape,
                     int iters) {
  const int blocks_per_seq = (shape.context + kBlockTokens - 1) / kBlockTokens;
  const int num_blocks = shape.batch * blocks_per_seq;
  std::vector<int32_t> tables(num_blocks), lens(shape.batch, shape.context);
  for (int b = 0; b < num_blocks; ++b) tables[b] = b;
  const std::vector<uint16_t> q = testing::ToHalf(
      testing::MakeNormal(static_cast<size_t>(shape.batch) * kQHeads * kHeadDim, 7));
  PagedDecodeAttentionParams p;
  p.layout = layout;
  p.num_seqs = shape.batch;
  p.num_q_heads = kQHeads;
  p.max_blocks_per_seq = blocks_per_seq;
  p.sm_scale = 0.088f;
  p.num_blocks = num_blocks;
  const size_t page_bytes = static_cast<size_t>(num_blocks) * layout.layer_page_bytes();
  const size_t ws_bytes =
      cuda::AttentionWorkspaceBytes(layout, shape.batch, kQHeads, blocks_per_seq, 0);
  // --kernel_layers layers of pages; every column but the last uses the first.
  const int layers = std::max(1, absl::GetFlag(FLAGS_kernel_layers));
  const testing::DeviceBuffer pages(page_bytes * layers), dq(q), dtables(tables), dlens(lens),
      dout(static_cast<size_t>(shape.batch) * kQHeads * kHeadDim * sizeof(uint16_t)), ws(ws_bytes);
  // Codes 1 and meta 0x1111 (a small finite fp16) everywhere.
  KVPOOL_CUDA_CHECK(cudaMemset(pages.get(), 0x11, page_bytes * layers));
  p.pages = pages.get<const uint8_t>();
  p.q = dq.get<const uint16_t>();
  p.block_tables = dtables.get<const int32_t>();
  p.seq_lens = dlens.get<const int32_t>();
  p.out_fp16 = dout.get<uint16_t>();
  p.workspace = ws.get();
  p.workspace_bytes = ws_bytes;
  PagedDecodeAttentionParams host = p;
  std::vector<uint16_t> out(static_cast<size_t>(shape.batch) * kQHeads * kHeadDim);
  host.q = q.data();
  host.block_tables = tables.data();
  host.seq_lens = lens.data();
  host.out_fp16 = out.data();
  const Times backend_times = TimeWall(iters, [&] {
    const absl::Status s = backend->PagedDecodeAttention(host, nullptr);
    if (!s.ok()) std::fprintf(stderr, "backend: %s\n", s.ToString().c_str());
    return s.ok();
  });
  // The same call with q and out in one registered buffer (an AttendSocket region's case).
  const size_t q_elems = q.size();
  std::vector<uint16_t> region(2 * q_elems);
  std::copy(q.begin(), q.end(), region.begin());
  if (absl::Status s = backend->RegisterHostMemory(region.data(), region.size() * 2); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  PagedDecodeAttentionParams pinned_host = host;
  pinned_host.q = region.data();
  pinned_host.out_fp16 = region.data() + q_elems;
  const Times pinned_times = TimeWall(iters, [&] {
    const absl::Status s = backend->PagedDecodeAttention(pinned_host, nullptr);
    if (!s.ok()) std::fprintf(stderr, "backend pinned: %s\n", s.ToString().c_str());
    return s.ok();
  });
  // And with a new token per sequence appended first (the last slot of each sequence, rewritten):
  // the backend's share of a decode step's append.
  const std::vector<uint16_t> new_kv = testing::ToHalf(
      testing::MakeNormal(static_cast<size_t>(shape.batch) * kKvHeads * kHeadDim, 13));
  std::vector<int64_t> slots(shape.batch);
  for (int b = 0; b < shape.batch; ++b) {
    const int pos = shape.context - 1;
    slots[b] =
        static_cast<int64_t>(tables[b * blocks_per_seq + pos / kBlockTokens]) * kBlockTokens +
        pos % kBlockTokens;
  }
  QuantizeAppendParams append;
  append.layout = layout;
  append.k = new_kv.data();
  append.v = new_kv.data();
  append.slot_mapping = slots.data();
  append.num_tokens = shape.batch;
  append.pages = pages.get<uint8_t>();
  append.num_blocks = num_blocks;
  const Times append_times = TimeWall(iters, [&] {
    const absl::Status s = backend->PagedDecodeAttention(pinned_host, &append);
    if (!s.ok()) std::fprintf(stderr, "backend append: %s\n", s.ToString().c_str());
    return s.ok();
  });
  backend->UnregisterHostMemory(region.data());
  // The bare kernels on device-resident inputs, in a non-blocking stream like the backend's lanes
  // (the launches overlap as they do there): the attention alone, and after the same append's
  // quantize kernel as the backend launches them for a decode step.
  cudaStream_t stream;
  KVPOOL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const testing::DeviceBuffer dnew_kv(new_kv), dslots(slots);
  QuantizeAppendParams dappend = append;
  dappend.k = dnew_kv.get<const uint16_t>();
  dappend.v = dappend.k;
  dappend.slot_mapping = dslots.get<const int64_t>();
  // `cycle_layers`: call i works on layer i % layers of the arena.
  auto time_kernels = [&](bool with_append, bool cycle_layers) {
    cudaEvent_t start, stop;
    KVPOOL_CUDA_CHECK(cudaEventCreate(&start));
    KVPOOL_CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<double> us;
    PagedDecodeAttentionParams lp = p;
    QuantizeAppendParams la = dappend;
    for (int i = 0; i < kWarmup + iters; ++i) {
      const size_t layer_offset = cycle_layers ? (i % layers) * page_bytes : 0;
      lp.pages = p.pages + layer_offset;
      la.pages = dappend.pages + layer_offset;
      KVPOOL_CUDA_CHECK(cudaEventRecord(start, stream));
      if ((with_append && cuda::QuantizeAppend(la, stream) != KernelStatus::kOk) ||
          cuda::PagedDecodeAttention(lp, stream) != KernelStatus::kOk) {
        std::fprintf(stderr, "kernel failed: %s\n", cuda::LastErrorMessage());
        std::exit(1);
      }
      KVPOOL_CUDA_CHECK(cudaEventRecord(stop, stream));
      KVPOOL_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      KVPOOL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (i >= kWarmup) us.push_back(ms * 1e3);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return Percentiles(us);
  };
  const Times kernel_times = time_kernels(false, false);
  const Times kernel_append_times = time_kernels(true, false);
  const Times kernel_append_layers_times = time_kernels(true, true);
  cudaStreamDestroy(stream);
  return {backend_times, pinned_times,        append_times,
          kernel_times,  kernel_append_times, kernel_append_layers_times};
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  auto backend = NewCudaBackend(0, CudaBackendOptions{absl::GetFlag(FLAGS_kernel_host_io)});
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  NamespaceConfig config = DefaultNamespaceConfig(0);
  config.name = "latency";
  config.num_layers = 1;
  config.layer_dtypes = {KvDtype::kInt4};
  KvStore::Options options;
  options.pool_bytes = uint64_t{4} << 30;
  options.backend = backend->get();
  options.quality_sample_every = 0;
  auto store = KvStore::Create(options);
  if (!store.ok() || !(*store)->CreateNamespace(config).ok()) {
    std::fprintf(stderr, "store setup failed\n");
    return 1;
  }
  const PageLayout layout = LayerLayout(config, 0);
  const std::vector<uint16_t> q =
      testing::ToHalf(testing::MakeNormal(static_cast<size_t>(kQHeads) * kHeadDim, 3));

  std::string json = absl::StrFormat(
      "{\n  \"benchmark\": \"attend_latency_bench\",\n  \"commit\": \"%s\",\n  \"iters\": %d,\n"
      "  \"kernel_host_io\": %s,\n  \"rewrite_region\": %s,\n  \"kernel_layers\": %d,\n"
      "  \"cases\": [\n",
      absl::GetFlag(FLAGS_commit), iters, absl::GetFlag(FLAGS_kernel_host_io) ? "true" : "false",
      absl::GetFlag(FLAGS_rewrite_region) ? "true" : "false",
      std::max(1, absl::GetFlag(FLAGS_kernel_layers)));
  std::printf("%-12s %14s %14s %14s %14s %14s %14s %14s %14s %10s %10s %10s\n", "batch x ctx",
              "runner p50/99", "store p50/99", "append p50/99", "pinned p50/99", "p.append p50/99",
              "backend p50/99", "b.pinned p50/99", "b.append p50/99", "kernel p50", "k.append",
              "k.app.lay.");
  int seq = 0;
  for (const Shape& shape : kShapes) {
    // One K/V for every sequence of the shape (their token ids differ, so no blocks are shared):
    // generating 32 x 32K tokens of it per sequence took most of a run.
    const testing::KvData kv =
        testing::MakeKv(shape.context, kKvHeads, kHeadDim, testing::Outliers::kSpikes, seq);
    const std::vector<uint16_t> k = testing::ToHalf(kv.k), v = testing::ToHalf(kv.v);
    std::vector<uint64_t> leases;
    for (int b = 0; b < shape.batch; ++b, ++seq) {
      std::vector<int32_t> ids(shape.context);
      for (int t = 0; t < shape.context; ++t) ids[t] = seq * 1000003 + t;
      auto put = (*store)->BeginPut(config.name, ids);
      if (!put.ok() || !(*put)->AddChunk(0, 0, shape.context, k.data(), v.data()).ok() ||
          !(*put)->Commit().ok()) {
        std::fprintf(stderr, "put failed\n");
        return 1;
      }
      auto m = (*store)->Match(config.name, ids, absl::Minutes(5));
      if (!m.ok()) {
        std::fprintf(stderr, "match: %s\n", m.status().ToString().c_str());
        return 1;
      }
      leases.push_back(m->lease_id);
    }
    v1::AttendRequest request;
    request.set_layer(0);
    request.set_num_q_heads(kQHeads);
    std::vector<KvStore::AttendItem> items;
    for (uint64_t lease : leases) {
      v1::AttendItem* item = request.add_items();
      item->set_lease_id(lease);
      item->set_q(q.data(), q.size() * 2);
      items.push_back({lease, q.data()});
    }
    AttendRunner runner(store->get());
    v1::AttendResponse response;
    const Times run = TimeWall(iters, [&] {
      const absl::Status s = runner.Run(request, &response);
      if (!s.ok()) std::fprintf(stderr, "runner: %s\n", s.ToString().c_str());
      return s.ok();
    });
    std::vector<uint16_t> out(static_cast<size_t>(shape.batch) * kQHeads * kHeadDim);
    std::vector<uint32_t> attended(shape.batch);
    const KvStore::AttendOutputs outputs{nullptr, out.data(), nullptr, attended.data()};
    const Times st = TimeWall(iters, [&] {
      const absl::Status s = (*store)->Attend(0, kQHeads, 0.0f, items, outputs);
      if (!s.ok()) std::fprintf(stderr, "store: %s\n", s.ToString().c_str());
      return s.ok();
    });
    const std::vector<uint16_t> new_kv =
        testing::ToHalf(testing::MakeNormal(static_cast<size_t>(kKvHeads) * kHeadDim, 11));
    std::vector<KvStore::AttendItem> append_items = items;
    for (KvStore::AttendItem& item : append_items) {
      item.new_k = item.new_v = new_kv.data();
      item.new_token_id = 7;
    }
    const Times app = TimeWall(iters, [&] {
      const absl::Status s = (*store)->Attend(0, kQHeads, 0.0f, append_items, outputs);
      if (!s.ok()) std::fprintf(stderr, "append: %s\n", s.ToString().c_str());
      return s.ok();
    });
    const size_t q_elems = static_cast<size_t>(kQHeads) * kHeadDim;
    const size_t kv_elems = static_cast<size_t>(kKvHeads) * kHeadDim;
    // q rows, the output, then each item's new K and V rows (a region decode step's layout).
    std::vector<uint16_t> region(2 * shape.batch * (q_elems + kv_elems));
    uint16_t* const region_kv = region.data() + 2 * shape.batch * q_elems;
    const std::vector<uint16_t> region_new_kv =
        testing::ToHalf(testing::MakeNormal(2 * shape.batch * kv_elems, 17));
    std::copy(region_new_kv.begin(), region_new_kv.end(), region_kv);
    for (int b = 0; b < shape.batch; ++b) {
      std::memcpy(region.data() + b * q_elems, q.data(), q_elems * 2);
    }
    if (absl::Status s = (*backend)->RegisterHostMemory(region.data(), region.size() * 2);
        !s.ok()) {
      std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
      return 1;
    }
    // With --rewrite_region the whole region is rewritten from a copy before each call.
    const std::vector<uint16_t> region_source(region.begin(), region.end());
    std::optional<testing::RegionWriter> writer;
    std::function<void()> rewrite;
    if (absl::GetFlag(FLAGS_rewrite_region)) {
      writer.emplace(region.data(), region_source.data(), region.size() * 2);
      rewrite = [&writer] { writer->Rewrite(); };
    }
    std::vector<KvStore::AttendItem> region_items = items;
    for (int b = 0; b < shape.batch; ++b) region_items[b].q = region.data() + b * q_elems;
    const KvStore::AttendOutputs region_outputs{nullptr, region.data() + shape.batch * q_elems,
                                                nullptr, attended.data()};
    const Times pinned = TimeWall(
        iters,
        [&] {
          const absl::Status s = (*store)->Attend(0, kQHeads, 0.0f, region_items, region_outputs);
          if (!s.ok()) std::fprintf(stderr, "pinned: %s\n", s.ToString().c_str());
          return s.ok();
        },
        rewrite);
    std::vector<KvStore::AttendItem> region_append_items = region_items;
    for (int b = 0; b < shape.batch; ++b) {
      region_append_items[b].new_k = region_kv + 2 * b * kv_elems;
      region_append_items[b].new_v = region_kv + (2 * b + 1) * kv_elems;
      region_append_items[b].new_token_id = 7;
    }
    const Times pinned_append = TimeWall(
        iters,
        [&] {
          const absl::Status s =
              (*store)->Attend(0, kQHeads, 0.0f, region_append_items, region_outputs);
          if (!s.ok()) std::fprintf(stderr, "pinned append: %s\n", s.ToString().c_str());
          return s.ok();
        },
        rewrite);
    writer.reset();
    (*backend)->UnregisterHostMemory(region.data());
    const ArenaTimes arena = TimeArena(backend->get(), layout, shape, iters);
    std::printf(
        "%3d x %-6d %6.0f / %5.0f %6.0f / %5.0f %6.0f / %5.0f %6.0f / %5.0f %6.0f / %5.0f "
        "%6.0f / %5.0f %6.0f / %5.0f %6.0f / %5.0f %8.1f us %8.1f us %8.1f us\n",
        shape.batch, shape.context, run.p50_us, run.p99_us, st.p50_us, st.p99_us, app.p50_us,
        app.p99_us, pinned.p50_us, pinned.p99_us, pinned_append.p50_us, pinned_append.p99_us,
        arena.backend.p50_us, arena.backend.p99_us, arena.backend_pinned.p50_us,
        arena.backend_pinned.p99_us, arena.backend_append.p50_us, arena.backend_append.p99_us,
        arena.kernel.p50_us, arena.kernel_append.p50_us, arena.kernel_append_layers.p50_us);
    json += absl::StrFormat(
        "    {\"batch\": %d, \"context\": %d, \"runner_p50_us\": %.1f, \"runner_p99_us\": %.1f, "
        "\"store_p50_us\": %.1f, \"store_p99_us\": %.1f, \"append_p50_us\": %.1f, "
        "\"append_p99_us\": %.1f, \"pinned_p50_us\": %.1f, \"pinned_p99_us\": %.1f, "
        "\"pinned_append_p50_us\": %.1f, \"pinned_append_p99_us\": %.1f, \"backend_p50_us\": %.1f, "
        "\"backend_p99_us\": %.1f, \"backend_pinned_p50_us\": %.1f, "
        "\"backend_pinned_p99_us\": %.1f, \"backend_append_p50_us\": %.1f, "
        "\"backend_append_p99_us\": %.1f, \"kernel_p50_us\": %.1f, \"kernel_append_p50_us\": "
        "%.1f, \"kernel_append_layers_p50_us\": %.1f}%s\n",
        shape.batch, shape.context, run.p50_us, run.p99_us, st.p50_us, st.p99_us, app.p50_us,
        app.p99_us, pinned.p50_us, pinned.p99_us, pinned_append.p50_us, pinned_append.p99_us,
        arena.backend.p50_us, arena.backend.p99_us, arena.backend_pinned.p50_us,
        arena.backend_pinned.p99_us, arena.backend_append.p50_us, arena.backend_append.p99_us,
        arena.kernel.p50_us, arena.kernel_append.p50_us, arena.kernel_append_layers.p50_us,
        &shape == &kShapes[std::size(kShapes) - 1] ? "" : ",");
    for (uint64_t lease : leases) (*store)->Release(lease).IgnoreError();
  }
  json += "  ]\n}\n";
  const std::string path = absl::GetFlag(FLAGS_out);
  return path.empty() || bench::WriteResultFile(path, json) ? 0 : 1;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) { return kvpool::Main(argc, argv); }
