// What the benchmarks share: the decode shapes of the attention benchmarks, percentiles, and the
// writing of their result files.
#ifndef KVPOOL_TESTS_COMMON_BENCH_OUTPUT_H_
#define KVPOOL_TESTS_COMMON_BENCH_OUTPUT_H_

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace kvpool::bench {

struct DecodeShape {
  int batch;    // sequences
  int context;  // tokens per sequence
};
// The (batch, context) cases of attention_bench, flashinfer_decode_bench and page_copy_bench
// (tests/bench/attention_peer.py times the same for the SDPA anchor; its merge refuses a kvpool
// case it has no anchor for).
inline constexpr DecodeShape kDecodeShapes[] = {{1, 32768}, {8, 8192},   {8, 32768},
                                                {32, 4096}, {32, 16384}, {64, 8192}};

// The p-th percentile (0 < p <= 1) of `values` by nearest rank: the smallest value that at least
// p of them do not exceed (p50 of 1..100 is 50, p99 is 99). `values` must not be empty.
inline double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  // ceil(p n) without the rounding of p n's product pushing an exact rank one up.
  const double rank = std::ceil(p * static_cast<double>(values.size()) - 1e-9);
  const size_t i = static_cast<size_t>(std::max(rank, 1.0)) - 1;
  return values[std::min(i, values.size() - 1)];
}

// Writes `text` to the file `path`. False, with the reason on stderr, when it cannot.
inline bool WriteResultFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  bool ok = f != nullptr && std::fputs(text.c_str(), f) >= 0;
  if (f != nullptr) ok = std::fclose(f) == 0 && ok;
  if (!ok) std::fprintf(stderr, "cannot write %s: %s\n", path.c_str(), std::strerror(errno));
  return ok;
}

}  // namespace kvpool::bench

#endif  // KVPOOL_TESTS_COMMON_BENCH_OUTPUT_H_
