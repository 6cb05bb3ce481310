// Bandwidth of the NCCL data plane on a two-GPU machine, against NCCL's own point-to-point
// bandwidth measured in the same run and against the gRPC streaming Get:
//   raw      ncclSend (server process, GPU 0) -> ncclRecv (worker process, GPU 1)
//   get      NcclGet FP16 and RAW of a lease (gather/dequantize + send), timed by the worker
//   put      NcclPut of fresh sequences (send + validate + fused quantize + publish)
//   grpc_get KvPoolClient::Get FP16 and RAW over TCP loopback
// The server is the real kvpool Server (CUDA backend, KvPoolTransport registered) on GPU 0; the
// worker is this binary started again with --worker on GPU 1. GB/s = payload bytes / median
// wall time of --reps runs after one warm-up. Writes JSON to --out and prints a table.
//
//   nccl_bench --out=tests/bench/results/nccl_<date>.json --commit=$(git rev-parse --short HEAD)
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvpool_client.h"
#include "client/nccl_channel.h"
#include "grpcpp/grpcpp.h"
#include "service/server.h"
#include "service/store/compute_backend.h"
#include "tests/common/bench_output.h"
#include "tests/gpu/nccl_test_util.h"

ABSL_FLAG(std::string, out, "", "JSON results file (written by the worker)");
ABSL_FLAG(std::string, commit, "unknown", "commit recorded in the results");
ABSL_FLAG(int, reps, 10, "timed runs per point (after one warm-up)");
ABSL_FLAG(int, grpc_reps, 3, "timed runs per gRPC point");
ABSL_FLAG(bool, worker, false, "internal: run as the worker process");
ABSL_FLAG(std::string, target, "", "internal: the server's address");
ABSL_FLAG(uint64_t, lease, 0, "internal: the lease to read");
ABSL_FLAG(std::string, nccl_id, "", "internal: hex ncclUniqueId of the raw point-to-point comm");
ABSL_FLAG(std::string, command, "", "internal: the parent's command line");

namespace kvpool {
namespace {

constexpr int kServerDevice = 0;
constexpr int kWorkerDevice = 1;
constexpr uint32_t kTokens = 16384;  // 32 layers: 2 GiB of fp16 K+V, 544 MiB of INT4 pages
constexpr uint64_t kSeed = 7;
constexpr char kNs[] = "bench";
// Gets of the first 1, 4, 16 and 32 layers of the lease.
constexpr uint32_t kGetLayers[] = {1, 4, 16, 32};
constexpr uint32_t kPutTokens[] = {1024, 4096};
constexpr uint32_t kGrpcGetLayers[] = {1, 4};

uint64_t Fp16LayerBytes(const NamespaceConfig& c) {
  return uint64_t{kTokens} * c.num_kv_heads * c.head_dim * 2 * 2;  // K and V
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "nccl_bench: %s\n", what.c_str());
  return 1;
}

#define BENCH_CHECK_NCCL(expr)                                                          \
  do {                                                                                  \
    const ncclResult_t r_ = (expr);                                                     \
    if (r_ != ncclSuccess) return Fail(absl::StrCat(#expr, ": ", ncclGetErrorString(r_))); \
  } while (0)

#define BENCH_CHECK_CUDA(expr)                                                          \
  do {                                                                                  \
    const cudaError_t e_ = (expr);                                                      \
    if (e_ != cudaSuccess) return Fail(absl::StrCat(#expr, ": ", cudaGetErrorString(e_))); \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Point {
  std::string path;
  std::string format;
  uint64_t bytes = 0;
  double median_ms = 0;
  double gbps = 0;
};

// One barrier on a 2-rank communicator (a 1-element all-reduce), so the timed transfer that
// follows starts on both sides together.
ncclResult_t Barrier(ncclComm_t comm, float* scratch, cudaStream_t stream) {
  const ncclResult_t r = ncclAllReduce(scratch, scratch, 1, ncclFloat, ncclSum, comm, stream);
  if (r == ncclSuccess) cudaStreamSynchronize(stream);
  return r;
}

// Both processes run the same loop: rank 0 sends, rank 1 receives; rank 1 records the times.
int RawPointToPoint(const ncclUniqueId& id, int rank, uint64_t max_bytes,
                    const std::vector<uint64_t>& sizes, std::vector<Point>* points) {
  const int reps = absl::GetFlag(FLAGS_reps);
  BENCH_CHECK_CUDA(cudaSetDevice(rank == 0 ? kServerDevice : kWorkerDevice));
  ncclComm_t comm = nullptr;
  BENCH_CHECK_NCCL(ncclCommInitRank(&comm, 2, id, rank));
  cudaStream_t stream = nullptr;
  uint8_t* buffer = nullptr;
  float* scratch = nullptr;
  BENCH_CHECK_CUDA(cudaStreamCreate(&stream));
  BENCH_CHECK_CUDA(cudaMalloc(&buffer, max_bytes));
  BENCH_CHECK_CUDA(cudaMalloc(&scratch, sizeof(float)));
  BENCH_CHECK_CUDA(cudaMemset(buffer, 0x3c, max_bytes));
  for (uint64_t bytes : sizes) {
    std::vector<double> ms;
    for (int i = 0; i <= reps; ++i) {
      BENCH_CHECK_NCCL(Barrier(comm, scratch, stream));
      const absl::Time start = absl::Now();
      BENCH_CHECK_NCCL(rank == 0 ? ncclSend(buffer, bytes, ncclUint8, 1, comm, stream)
                                 : ncclRecv(buffer, bytes, ncclUint8, 0, comm, stream));
      BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
      if (i > 0) ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    }
    if (rank == 1) {
      const double median = Median(ms);
      points->push_back({"raw", "bytes", bytes, median, bytes / median / 1e6});
    }
  }
  ncclCommDestroy(comm);
  cudaFree(buffer);
  cudaFree(scratch);
  cudaStreamDestroy(stream);
  return 0;
}

std::string GpuName(int device) {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "unknown";
}

bool WriteResults(const std::vector<Point>& points) {
  std::vector<std::string> rows;
  for (const Point& p : points) {
    rows.push_back(absl::StrFormat(
        R"(    {"path": "%s", "format": "%s", "bytes": %d, "median_ms": %.3f, "gbps": %.2f})",
        p.path, p.format, p.bytes, p.median_ms, p.gbps));
  }
  // NcclGet efficiency: each Get point against the raw point of the same size.
  std::vector<std::string> ratios;
  std::printf("%-9s %-6s %12s %10s %8s\n", "path", "format", "bytes", "ms", "GB/s");
  for (const Point& p : points) {
    std::printf("%-9s %-6s %12llu %10.3f %8.2f\n", p.path.c_str(), p.format.c_str(),
                static_cast<unsigned long long>(p.bytes), p.median_ms, p.gbps);
    if (p.path != "get") continue;
    for (const Point& raw : points) {
      if (raw.path == "raw" && raw.bytes == p.bytes) {
        ratios.push_back(absl::StrFormat(
            R"(    {"format": "%s", "bytes": %d, "get_over_raw": %.3f})", p.format, p.bytes,
            p.gbps / raw.gbps));
        std::printf("  NcclGet %s %llu B: %.1f%% of raw ncclSend/Recv\n", p.format.c_str(),
                    static_cast<unsigned long long>(p.bytes), 100 * p.gbps / raw.gbps);
      }
    }
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return true;
  return bench::WriteResultFile(
      out, absl::StrCat(
               "{\n  \"date\": \"",
               absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone()),
               "\",\n  \"commit\": \"", absl::GetFlag(FLAGS_commit), "\",\n  \"server_gpu\": \"",
               GpuName(kServerDevice), "\",\n  \"worker_gpu\": \"", GpuName(kWorkerDevice),
               "\",\n  \"command\": \"", absl::CEscape(absl::GetFlag(FLAGS_command)),
               "\",\n  \"tokens\": ", kTokens, ",\n  \"reps\": ", absl::GetFlag(FLAGS_reps),
               ",\n  \"results\": [\n", absl::StrJoin(rows, ",\n"), "\n  ],\n  \"get_vs_raw\": [\n",
               absl::StrJoin(ratios, ",\n"), "\n  ]\n}\n"));
}

// Times `run` (which returns the bytes it moved, or 0 on failure): one warm-up, then `reps`.
template <typename Run>
bool TimePoint(const std::string& path, const std::string& format, int reps, Run&& run,
               std::vector<Point>* points) {
  std::vector<double> ms;
  uint64_t bytes = 0;
  for (int i = 0; i <= reps; ++i) {
    const absl::Time start = absl::Now();
    bytes = run();
    if (bytes == 0) return false;
    if (i > 0) ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  const double median = Median(ms);
  points->push_back({path, format, bytes, median, bytes / median / 1e6});
  return true;
}

int RunWorker(const std::vector<uint64_t>& raw_sizes) {
  const NamespaceConfig config = nccl_test::TestNamespace(kNs, 0);
  const uint64_t max_bytes = Fp16LayerBytes(config) * config.num_layers;
  const std::string id_bytes = absl::HexStringToBytes(absl::GetFlag(FLAGS_nccl_id));
  ncclUniqueId id;
  if (id_bytes.size() != sizeof(id.internal)) return Fail("bad --nccl_id");
  std::copy(id_bytes.begin(), id_bytes.end(), id.internal);
  std::vector<Point> points;
  if (int rc = RawPointToPoint(id, 1, max_bytes, raw_sizes, &points); rc != 0) return rc;

  const std::string target = absl::GetFlag(FLAGS_target);
  client::ClientOptions options;
  options.max_message_bytes = 64 << 20;
  std::unique_ptr<client::KvPoolClient> kv = client::KvPoolClient::Create(target, options);
  absl::StatusOr<std::unique_ptr<client::NcclChannel>> channel = client::NcclChannel::Open(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()), kWorkerDevice,
      absl::Seconds(60));
  if (!channel.ok()) return Fail(channel.status().ToString());
  BENCH_CHECK_CUDA(cudaSetDevice(kWorkerDevice));
  uint8_t* buffer = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&buffer, max_bytes));
  const int reps = absl::GetFlag(FLAGS_reps);

  for (const v1::GetFormat format : {v1::GET_FORMAT_FP16, v1::GET_FORMAT_RAW}) {
    for (uint32_t layers : kGetLayers) {
      v1::NcclGetRequest request;
      request.set_lease_id(absl::GetFlag(FLAGS_lease));
      request.set_layer_end(layers);
      request.set_format(format);
      const bool ok = TimePoint(
          "get", format == v1::GET_FORMAT_RAW ? "raw" : "fp16", reps,
          [&]() -> uint64_t {
            auto d = (*channel)->Get(request, buffer, max_bytes, absl::Seconds(60));
            if (!d.ok()) std::fprintf(stderr, "NcclGet: %s\n", d.status().ToString().c_str());
            return d.ok() ? d->total_bytes() : 0;
          },
          &points);
      if (!ok) return Fail("NcclGet failed");
    }
  }

  std::vector<uint16_t> k, v;
  const uint32_t max_put = *std::max_element(std::begin(kPutTokens), std::end(kPutTokens));
  nccl_test::FillSequenceKv(kSeed + 1, config, max_put, &k, &v);
  const uint64_t put_bytes = k.size() * sizeof(uint16_t);
  BENCH_CHECK_CUDA(cudaMemcpy(buffer, k.data(), put_bytes, cudaMemcpyHostToDevice));
  BENCH_CHECK_CUDA(cudaMemcpy(buffer + put_bytes, v.data(), put_bytes, cudaMemcpyHostToDevice));
  uint64_t sequence = 1000;
  for (uint32_t tokens : kPutTokens) {
    // The buffers hold max_put tokens per layer; a Put of fewer reads the first `tokens` rows
    // of each layer as its own [layers][tokens] layout, which is just other valid data.
    const bool ok = TimePoint(
        "put", "fp16", reps,
        [&]() -> uint64_t {
          const std::vector<int32_t> ids = nccl_test::SequenceTokens(++sequence, tokens);
          auto r = (*channel)->Put(kNs, ids, config.num_layers, buffer, buffer + put_bytes,
                                   static_cast<uint64_t>(config.num_kv_heads) * config.head_dim * 2,
                                   absl::Seconds(60));
          if (!r.ok()) std::fprintf(stderr, "NcclPut: %s\n", r.status().ToString().c_str());
          return r.ok() && r->tokens_stored() == tokens ? r->bytes_received() : 0;
        },
        &points);
    if (!ok) return Fail("NcclPut failed");
  }

  for (const v1::GetFormat format : {v1::GET_FORMAT_FP16, v1::GET_FORMAT_RAW}) {
    for (uint32_t layers : kGrpcGetLayers) {
      v1::GetRequest request;
      request.set_lease_id(absl::GetFlag(FLAGS_lease));
      request.set_layer_end(layers);
      request.set_format(format);
      const bool ok = TimePoint(
          "grpc_get", format == v1::GET_FORMAT_RAW ? "raw" : "fp16", absl::GetFlag(FLAGS_grpc_reps),
          [&]() -> uint64_t {
            client::CallOptions call;
            call.deadline = absl::Seconds(120);
            auto r = kv->Get(request, call);
            if (!r.ok()) std::fprintf(stderr, "gRPC Get: %s\n", r.status().ToString().c_str());
            return r.ok() ? r->payload_bytes : 0;
          },
          &points);
      if (!ok) return Fail("gRPC Get failed");
    }
  }
  cudaFree(buffer);
  return WriteResults(points) ? 0 : 1;
}

int RunServer(int argc, char** argv, const std::vector<uint64_t>& raw_sizes) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::printf("nccl_bench: needs 2 GPUs (server on GPU 0, worker process on GPU 1); %d "
                "visible: skipped\n", count);
    return 0;
  }
  absl::StatusOr<std::unique_ptr<ComputeBackend>> backend = NewCudaBackend(kServerDevice);
  if (!backend.ok()) return Fail(backend.status().ToString());
  const NamespaceConfig config = nccl_test::TestNamespace(kNs, uint64_t{6} << 30);
  ServerOptions options;
  options.grpc_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.store.pool_bytes = uint64_t{8} << 30;
  options.namespaces = {config};
  options.nccl_device = kServerDevice;
  absl::StatusOr<std::unique_ptr<Server>> server =
      Server::Start(std::move(options), *std::move(backend));
  if (!server.ok()) return Fail(server.status().ToString());

  std::vector<uint16_t> k, v;
  nccl_test::FillSequenceKv(kSeed, config, kTokens, &k, &v);
  const std::vector<int32_t> ids = nccl_test::SequenceTokens(kSeed, kTokens);
  KvStore* store = (*server)->store();
  auto put = store->BeginPut(kNs, ids);
  if (!put.ok()) return Fail(put.status().ToString());
  const size_t layer = size_t{kTokens} * config.num_kv_heads * config.head_dim;
  for (int l = 0; l < config.num_layers; ++l) {
    if (absl::Status s = (*put)->AddChunk(l, 0, kTokens, k.data() + l * layer,
                                          v.data() + l * layer);
        !s.ok()) {
      return Fail(s.ToString());
    }
  }
  if (auto committed = (*put)->Commit(); !committed.ok()) {
    return Fail(committed.status().ToString());
  }
  auto match = store->Match(kNs, ids, absl::Minutes(30));
  if (!match.ok()) return Fail(match.status().ToString());

  ncclUniqueId id;
  BENCH_CHECK_NCCL(ncclGetUniqueId(&id));
  std::vector<std::string> args = {
      "--worker", absl::StrCat("--target=127.0.0.1:", (*server)->port()),
      absl::StrCat("--lease=", match->lease_id),
      absl::StrCat("--nccl_id=",
                   absl::BytesToHexString(std::string(id.internal, sizeof(id.internal)))),
      absl::StrCat("--out=", absl::GetFlag(FLAGS_out)),
      absl::StrCat("--commit=", absl::GetFlag(FLAGS_commit)),
      absl::StrCat("--reps=", absl::GetFlag(FLAGS_reps)),
      absl::StrCat("--grpc_reps=", absl::GetFlag(FLAGS_grpc_reps)),
      absl::StrCat("--command=", absl::StrJoin(argv, argv + argc, " "))};
  auto worker = nccl_test::WorkerProcess::Spawn(args, {});
  if (!worker.ok()) return Fail(worker.status().ToString());
  std::vector<Point> unused;
  if (int rc = RawPointToPoint(id, 0, raw_sizes.back(), raw_sizes, &unused); rc != 0) return rc;
  absl::StatusOr<int> code = (*worker)->Wait(absl::Minutes(20));
  if (!code.ok()) return Fail(code.status().ToString());
  (*server)->Shutdown(absl::Seconds(5));
  return *code;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const kvpool::NamespaceConfig config = kvpool::nccl_test::TestNamespace(kvpool::kNs, 0);
  // The payload sizes of the FP16 and RAW Gets, so each Get has a raw point of its size.
  const uint64_t raw_layer_bytes = uint64_t{kvpool::kTokens} / config.block_tokens *
                                   config.num_kv_heads *
                                   kvpool::LayerLayout(config, 0).head_page_bytes() * 2;
  std::vector<uint64_t> raw_sizes;
  for (uint32_t layers : kvpool::kGetLayers) {
    raw_sizes.push_back(layers * kvpool::Fp16LayerBytes(config));
    raw_sizes.push_back(layers * raw_layer_bytes);
  }
  std::sort(raw_sizes.begin(), raw_sizes.end());
  return absl::GetFlag(FLAGS_worker) ? kvpool::RunWorker(raw_sizes)
                                     : kvpool::RunServer(argc, argv, raw_sizes);
}
