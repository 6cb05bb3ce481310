// Internals of the `kvpool` command-line tool shared by its subcommand files: common flags,
// generated workloads (token ids and K/V with outlier channels) and the fp64 reference
// attention the tool checks the server against.
#ifndef KVPOOL_CLIENT_KVPOOL_CLI_H_
#define KVPOOL_CLIENT_KVPOOL_CLI_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/kvpool_client.h"

ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(std::string, namespace);
ABSL_DECLARE_FLAG(int32_t, tokens);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int32_t, q_heads_per_kv_head);
ABSL_DECLARE_FLAG(int32_t, deadline_ms);
ABSL_DECLARE_FLAG(int32_t, session_deadline_ms);

namespace kvpool::cli {

// Call options from --deadline_ms.
client::CallOptions Call();
// Call options of an AttendStream or AttendSocket session, from --session_deadline_ms.
client::CallOptions SessionCall();
// Releases `leases` when a run ends, each within 2 s (or --deadline_ms if shorter), and stops at
// the first the server does not answer (UNAVAILABLE, DEADLINE_EXCEEDED): a server that is gone
// would otherwise hold the exit for a deadline per lease, and the leases expire on their own.
void ReleaseAll(client::KvPoolClient& c, absl::Span<const uint64_t> leases);
// Client options for --target (channel `channel_index`, max_chunk_bytes as given; 0 = default).
client::ClientOptions Options(int channel_index = 0, size_t max_chunk_bytes = 0);

// `n` token ids in [0, 128000) drawn from `seed`.
std::vector<int32_t> MakeTokenIds(int n, uint64_t seed);

// fp32 K/V [num_layers][tokens][heads][head_dim] with rotary-style outlier channels per layer
// (tests/common/kv_test_data.h), values already rounded to fp16 so they equal what is sent.
struct LayeredKv {
  int num_layers = 0, tokens = 0, heads = 0, head_dim = 0;
  std::vector<float> k, v;
  const float* K(int layer, int token) const { return &k[Offset(layer, token)]; }
  const float* V(int layer, int token) const { return &v[Offset(layer, token)]; }
  size_t Offset(int layer, int token) const {
    return ((static_cast<size_t>(layer) * tokens + token) * heads) * head_dim;
  }
};
LayeredKv MakeLayeredKv(int num_layers, int tokens, int heads, int head_dim, uint64_t seed);

// Tokens [token_begin, token_begin + num_tokens) of `kv` as fp16 for Put.
client::SequenceKv ToSequenceKv(const LayeredKv& kv, int token_begin, int num_tokens);
// Tokens [token_begin, +num_tokens) of one layer as fp16 [tokens][heads][head_dim] (k or v).
std::vector<uint16_t> LayerSliceFp16(const LayeredKv& kv, bool value, int layer,
                                     int token_begin, int num_tokens);

// Softmax attention of q [q_heads][head_dim] over tokens [0, tokens) of one layer of `kv`, in
// double, GQA (q head h reads KV head h / (q_heads / heads)). Returns [q_heads][head_dim].
std::vector<double> ReferenceAttention(absl::Span<const float> q, int q_heads,
                                       const LayeredKv& kv, int layer, int tokens,
                                       double sm_scale);

// Accumulates a relative L2 error ||out - ref|| / ||ref|| over many vectors.
struct RelativeError {
  double err2 = 0, ref2 = 0;
  void Add(absl::Span<const float> out, absl::Span<const double> ref);
  double Value() const;
};

// The first error any of several worker threads saw.
class FirstError {
 public:
  // Keeps `s`, its message prefixed with "`where`: " when `where` is not empty, unless an error
  // is already kept or `s` is OK.
  void Set(const absl::Status& s, absl::string_view where = {});
  absl::Status Get() const;

 private:
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// fp32 values of an AttendResponse.out requested as OUTPUT_DTYPE_FP32.
std::vector<float> Floats(const std::string& bytes);

// The namespace named by --namespace, or an error to print.
absl::StatusOr<v1::NamespaceInfo> ResolveNamespace(client::KvPoolClient& c);

// Subcommands; each returns the process exit status.
int RunBenchPut();
int RunBenchAttend();
int RunDemo();

}  // namespace kvpool::cli

#endif  // KVPOOL_CLIENT_KVPOOL_CLI_H_
