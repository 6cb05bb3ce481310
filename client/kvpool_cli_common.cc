#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/kvpool_cli.h"
#include "kernels/fp16.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(std::string, target, "localhost:50051", "kvpool server address (host:port)");
ABSL_FLAG(std::string, namespace, "", "namespace (\"\" = the server's default)");
ABSL_FLAG(int32_t, tokens, 512, "tokens of the generated sequence");
ABSL_FLAG(uint64_t, seed, 1, "seed of generated token ids and K/V");
ABSL_FLAG(int32_t, q_heads_per_kv_head, 4, "query heads per KV head (GQA group) for attend");
ABSL_FLAG(int32_t, deadline_ms, 60000,
          "deadline of each RPC (Put and Get streams: the whole stream)");
ABSL_FLAG(int32_t, session_deadline_ms, 3600000,
          "deadline of a whole AttendStream or AttendSocket session (its many steps); also the "
          "TTL `bench attend` asks for its leases (the server caps it at its --max_lease_ttl_ms)");
ABSL_FLAG(int64_t, attend_spin_us, 500,
          "how long an AttendStream step polls for its response before blocking (0 = block)");
ABSL_FLAG(int32_t, attend_socket_port, 0,
          "run AttendStream sessions over the server's AttendSocket on this port of the "
          "--target host instead of gRPC (0 = gRPC)");
ABSL_FLAG(std::string, attend_unix_socket, "",
          "run AttendStream sessions over the server's Unix socket at this path (its "
          "--attend_unix_socket; same host) in a shared-memory region instead of gRPC");
ABSL_FLAG(uint64_t, attend_region_bytes, uint64_t{16} << 20,
          "size of the shared-memory region of --attend_unix_socket sessions");
ABSL_FLAG(bool, wait_for_ready, true,
          "calls wait (up to their deadline: --deadline_ms, --session_deadline_ms for sessions) "
          "for the server to accept a connection instead of failing at the first connect error");

namespace kvpool::cli {

client::CallOptions Call() {
  client::CallOptions call;
  call.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  return call;
}

client::CallOptions SessionCall() {
  client::CallOptions call;
  call.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_session_deadline_ms));
  return call;
}

void ReleaseAll(client::KvPoolClient& c, absl::Span<const uint64_t> leases) {
  client::CallOptions call;
  call.deadline = std::min(absl::Seconds(2), absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms)));
  for (const uint64_t lease : leases) {
    const absl::Status s = c.Release(lease, call);
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) return;
  }
}

client::ClientOptions Options(int channel_index, size_t max_chunk_bytes) {
  client::ClientOptions options;
  options.default_deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  options.channel_index = channel_index;
  options.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  options.attend_spin = absl::Microseconds(absl::GetFlag(FLAGS_attend_spin_us));
  options.attend_socket_port = absl::GetFlag(FLAGS_attend_socket_port);
  options.attend_unix_socket = absl::GetFlag(FLAGS_attend_unix_socket);
  options.attend_region_bytes = absl::GetFlag(FLAGS_attend_region_bytes);
  if (max_chunk_bytes > 0) options.max_chunk_bytes = max_chunk_bytes;
  return options;
}

std::vector<int32_t> MakeTokenIds(int n, uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x746F6B656E73ull);
  std::uniform_int_distribution<int32_t> id(0, 127999);
  std::vector<int32_t> ids(n);
  for (int32_t& x : ids) x = id(rng);
  return ids;
}

LayeredKv MakeLayeredKv(int num_layers, int tokens, int heads, int head_dim, uint64_t seed) {
  LayeredKv kv;
  kv.num_layers = num_layers;
  kv.tokens = tokens;
  kv.heads = heads;
  kv.head_dim = head_dim;
  const size_t layer_elems = static_cast<size_t>(tokens) * heads * head_dim;
  kv.k.resize(layer_elems * num_layers);
  kv.v.resize(layer_elems * num_layers);
  for (int l = 0; l < num_layers; ++l) {
    testing::KvData d =
        testing::MakeKv(tokens, heads, head_dim, testing::Outliers::kRope, seed * 1009 + l);
    for (size_t i = 0; i < layer_elems; ++i) {
      kv.k[l * layer_elems + i] = HalfToFloat(FloatToHalf(d.k[i]));
      kv.v[l * layer_elems + i] = HalfToFloat(FloatToHalf(d.v[i]));
    }
  }
  return kv;
}

std::vector<uint16_t> LayerSliceFp16(const LayeredKv& kv, bool value, int layer,
                                     int token_begin, int num_tokens) {
  const float* src = value ? kv.V(layer, token_begin) : kv.K(layer, token_begin);
  std::vector<uint16_t> out(static_cast<size_t>(num_tokens) * kv.heads * kv.head_dim);
  for (size_t i = 0; i < out.size(); ++i) out[i] = FloatToHalf(src[i]);
  return out;
}

client::SequenceKv ToSequenceKv(const LayeredKv& kv, int token_begin, int num_tokens) {
  client::SequenceKv s;
  s.num_layers = kv.num_layers;
  s.token_begin = token_begin;
  s.num_tokens = num_tokens;
  s.num_kv_heads = kv.heads;
  s.head_dim = kv.head_dim;
  s.k.reserve(s.LayerElements() * kv.num_layers);
  s.v.reserve(s.LayerElements() * kv.num_layers);
  for (int l = 0; l < kv.num_layers; ++l) {
    std::vector<uint16_t> k = LayerSliceFp16(kv, false, l, token_begin, num_tokens);
    std::vector<uint16_t> v = LayerSliceFp16(kv, true, l, token_begin, num_tokens);
    s.k.insert(s.k.end(), k.begin(), k.end());
    s.v.insert(s.v.end(), v.begin(), v.end());
  }
  return s;
}

std::vector<double> ReferenceAttention(absl::Span<const float> q, int q_heads,
                                       const LayeredKv& kv, int layer, int tokens,
                                       double sm_scale) {
  const int d = kv.head_dim;
  const int group = q_heads / kv.heads;
  std::vector<double> out(static_cast<size_t>(q_heads) * d, 0.0);
  std::vector<double> score(tokens);
  for (int h = 0; h < q_heads; ++h) {
    const float* qh = &q[static_cast<size_t>(h) * d];
    const int kvh = h / group;
    double max_score = -INFINITY;
    for (int t = 0; t < tokens; ++t) {
      const float* k = kv.K(layer, t) + static_cast<size_t>(kvh) * d;
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(qh[c]) * k[c];
      score[t] = dot * sm_scale;
      max_score = std::max(max_score, score[t]);
    }
    double denom = 0;
    double* o = &out[static_cast<size_t>(h) * d];
    for (int t = 0; t < tokens; ++t) {
      const double p = std::exp(score[t] - max_score);
      denom += p;
      const float* v = kv.V(layer, t) + static_cast<size_t>(kvh) * d;
      for (int c = 0; c < d; ++c) o[c] += p * v[c];
    }
    for (int c = 0; c < d; ++c) o[c] /= denom;
  }
  return out;
}

void RelativeError::Add(absl::Span<const float> out, absl::Span<const double> ref) {
  for (size_t i = 0; i < ref.size() && i < out.size(); ++i) {
    const double e = out[i] - ref[i];
    err2 += e * e;
    ref2 += ref[i] * ref[i];
  }
}

double RelativeError::Value() const { return ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0; }

void FirstError::Set(const absl::Status& s, absl::string_view where) {
  absl::MutexLock lock(&mu_);
  if (!status_.ok() || s.ok()) return;
  status_ = where.empty() ? s : absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

absl::Status FirstError::Get() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

absl::StatusOr<v1::NamespaceInfo> ResolveNamespace(client::KvPoolClient& c) {
  return c.GetNamespace(absl::GetFlag(FLAGS_namespace), Call());
}

}  // namespace kvpool::cli
