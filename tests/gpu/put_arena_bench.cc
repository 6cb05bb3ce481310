// The store's side of an NcclPut on one GPU: the time of BeginPut, the chunks of every layer
// added from device (arena) memory in rounds as NcclTransfers::Put plans them (whole layers up to
// a staging buffer), and Commit, on the CUDA backend, for fresh sequences of --tokens tokens (the
// default namespace geometry, 32 INT4 layers). What it leaves out is the NCCL receive itself,
// which nccl_bench measures between two GPUs. Prints the median wall time of --reps Puts after
// two warm-up Puts, the medians of its three parts (BeginPut, the rounds, Commit), and the
// store's sampled quantization error, which reads the sampled chunks' input back.
//   put_arena_bench [--tokens=1024,4096] [--reps=20] [--staging_mib=256]
//                   [--quality_sample_every=8]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(std::vector<std::string>, tokens, std::vector<std::string>({"1024", "4096"}),
          "tokens per Put");
ABSL_FLAG(int, reps, 20, "timed Puts per token count");
ABSL_FLAG(int, staging_mib, 256, "staging buffer of a round (--nccl_staging_bytes), MiB");
ABSL_FLAG(int, quality_sample_every, 8,
          "the store's quality sample: every Nth chunk read back (0 = never)");

namespace kvpool {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run() {
  absl::StatusOr<std::unique_ptr<ComputeBackend>> backend = NewCudaBackend(0);
  if (!backend.ok()) {
    std::printf("put_arena_bench: %s: skipped\n", backend.status().ToString().c_str());
    return 0;
  }
  NamespaceConfig config = DefaultNamespaceConfig(0);
  config.name = "bench";
  config.num_layers = 32;
  config.layer_dtypes.assign(config.num_layers, KvDtype::kInt4);
  KvStore::Options options;
  options.backend = backend->get();
  options.pool_bytes = uint64_t{16} << 30;
  options.quality_sample_every = absl::GetFlag(FLAGS_quality_sample_every);
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Create(options);
  if (!store.ok() || !(*store)->CreateNamespace(config).ok()) {
    std::fprintf(stderr, "store setup failed\n");
    return 1;
  }
  const int reps = absl::GetFlag(FLAGS_reps);
  const uint64_t staging = uint64_t{static_cast<uint64_t>(absl::GetFlag(FLAGS_staging_mib))} << 20;
  int sequence = 0;
  std::printf("tokens  layers/round  rounds  Put median ms  min ms  BeginPut  rounds  Commit\n");
  for (const std::string& arg : absl::GetFlag(FLAGS_tokens)) {
    const int tokens = std::stoi(arg);
    // One layer's K and V (outlier channels), copied to every layer's place in device memory.
    const testing::KvData d = testing::MakeKv(tokens, config.num_kv_heads, config.head_dim,
                                              testing::Outliers::kOffset, 5);
    const std::vector<uint16_t> k = testing::ToHalf(d.k), v = testing::ToHalf(d.v);
    const size_t layer_bytes = k.size() * sizeof(uint16_t);
    absl::StatusOr<uint8_t*> arena = (*backend)->AllocateArena(2 * layer_bytes * config.num_layers);
    if (!arena.ok()) {
      std::fprintf(stderr, "%s\n", arena.status().ToString().c_str());
      return 1;
    }
    for (int l = 0; l < config.num_layers; ++l) {
      uint8_t* at = *arena + 2 * l * layer_bytes;
      if (cudaMemcpy(at, k.data(), layer_bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaMemcpy(at + layer_bytes, v.data(), layer_bytes, cudaMemcpyHostToDevice) !=
              cudaSuccess) {
        std::fprintf(stderr, "upload failed\n");
        return 1;
      }
    }
    const int per_round =
        static_cast<int>(std::clamp<uint64_t>(staging / (2 * layer_bytes), 1, config.num_layers));
    std::vector<double> ms, begin_ms, rounds_ms, commit_ms;
    for (int rep = 0; rep < reps + 2; ++rep) {
      std::vector<int32_t> ids(tokens);
      ++sequence;
      for (int t = 0; t < tokens; ++t) ids[t] = sequence * 1000003 + t;
      const absl::Time start = absl::Now();
      absl::StatusOr<std::unique_ptr<KvStore::PutSession>> put =
          (*store)->BeginPut(config.name, ids);
      absl::Status s = put.status();
      const absl::Time begun = absl::Now();
      for (int first = 0; s.ok() && first < config.num_layers; first += per_round) {
        std::vector<KvStore::PutSession::LayerChunk> chunks;
        for (int l = first; l < std::min(first + per_round, config.num_layers); ++l) {
          const auto* at = reinterpret_cast<const uint16_t*>(*arena + 2 * l * layer_bytes);
          chunks.push_back({static_cast<uint32_t>(l), at, at + k.size()});
        }
        s = (*put)->AddChunksFromArena(0, tokens, chunks);
      }
      const absl::Time stored = absl::Now();
      if (s.ok()) s = (*put)->Commit().status();
      if (!s.ok()) {
        std::fprintf(stderr, "Put: %s\n", s.ToString().c_str());
        return 1;
      }
      if (rep < 2) continue;
      const absl::Time end = absl::Now();
      ms.push_back(absl::ToDoubleMilliseconds(end - start));
      begin_ms.push_back(absl::ToDoubleMilliseconds(begun - start));
      rounds_ms.push_back(absl::ToDoubleMilliseconds(stored - begun));
      commit_ms.push_back(absl::ToDoubleMilliseconds(end - stored));
    }
    std::printf("%6d  %12d  %6d  %13.3f  %6.3f  %8.3f  %6.3f  %6.3f\n", tokens, per_round,
                (config.num_layers + per_round - 1) / per_round, Median(ms),
                *std::min_element(ms.begin(), ms.end()), Median(begin_ms), Median(rounds_ms),
                Median(commit_ms));
    std::printf("        sampled relative error of the stored K/V (EWMA): %.4f\n",
                (*store)->Stats().namespaces[0].quant_rel_error);
    (*backend)->FreeArena(*arena);
  }
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvpool::Run();
}
