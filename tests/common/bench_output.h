// What the benchmarks share: the decode shapes of the attention benchmarks, and the writing of
// their result files.
#ifndef KVPOOL_TESTS_COMMON_BENCH_OUTPUT_H_
#define KVPOOL_TESTS_COMMON_BENCH_OUTPUT_H_

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

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
