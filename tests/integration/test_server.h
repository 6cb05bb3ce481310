// In-process kvpool server for integration tests: the CPU backend, a FakeClock, no network
// listener, and helpers that drive the generated stub. Header-only.
#ifndef KVPOOL_TESTS_INTEGRATION_TEST_SERVER_H_
#define KVPOOL_TESTS_INTEGRATION_TEST_SERVER_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/server.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/namespace_config.h"
#include "tests/common/kv_test_data.h"

namespace kvpool::testing {

// 2 layers (INT4, then INT8), 2 KV heads, head_dim 64, 16-token blocks, rotation block 32 with
// signs, 2 groups per token: small, but every path of the layout is exercised.
inline NamespaceConfig SmallNamespace(const std::string& name, uint64_t capacity_bytes) {
  NamespaceConfig c;
  c.name = name;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.block_tokens = 16;
  c.layer_dtypes = {KvDtype::kInt4, KvDtype::kInt8};
  c.rotation_block = 32;
  c.rotation_seed = 0x5eed;
  c.group_size = 32;
  c.capacity_bytes = capacity_bytes;
  return c;
}

struct TestServer {
  FakeClock clock;
  std::unique_ptr<Server> server;
  std::unique_ptr<v1::KvPool::Stub> stub;

  // `tweak` may change the options before the server starts; `backend` null = the CPU one.
  static std::unique_ptr<TestServer> Start(std::vector<NamespaceConfig> namespaces,
                                           std::function<void(ServerOptions*)> tweak = {},
                                           std::unique_ptr<ComputeBackend> backend = nullptr) {
    auto t = std::make_unique<TestServer>();
    ServerOptions o;
    o.grpc_address = "";
    o.metrics_address = "";
    o.store.pool_bytes = 8 << 20;
    o.store.clock = &t->clock;
    o.namespaces = std::move(namespaces);
    o.lease_sweep_interval = absl::ZeroDuration();
    if (tweak) tweak(&o);
    absl::StatusOr<std::unique_ptr<Server>> s =
        Server::Start(std::move(o), backend != nullptr ? std::move(backend) : NewCpuBackend());
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    t->server = *std::move(s);
    t->stub = v1::KvPool::NewStub(t->server->InProcessChannel());
    return t;
  }
};

// One sequence: token ids and fp16 K/V per layer, [tokens][kv_heads][head_dim].
struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<std::vector<uint16_t>> k, v;  // [layer]
};

// `tokens` tokens of fresh K/V with outlier channels; ids start at `first_id`.
inline Sequence MakeSequence(const NamespaceConfig& c, int tokens, int32_t first_id,
                             uint64_t seed) {
  Sequence s;
  for (int t = 0; t < tokens; ++t) s.tokens.push_back(first_id + t);
  for (int l = 0; l < c.num_layers; ++l) {
    const KvData d = MakeKv(tokens, c.num_kv_heads, c.head_dim,
                            l % 2 == 0 ? Outliers::kOffset : Outliers::kRope, seed * 31 + l);
    s.k.push_back(ToHalf(d.k));
    s.v.push_back(ToHalf(d.v));
  }
  return s;
}

// `a`'s first `prefix` tokens followed by all of `b`.
inline Sequence Concat(const Sequence& a, int prefix, const Sequence& b, int per_token) {
  Sequence s;
  s.tokens.assign(a.tokens.begin(), a.tokens.begin() + prefix);
  s.tokens.insert(s.tokens.end(), b.tokens.begin(), b.tokens.end());
  for (size_t l = 0; l < a.k.size(); ++l) {
    std::vector<uint16_t> k(a.k[l].begin(), a.k[l].begin() + prefix * per_token);
    std::vector<uint16_t> v(a.v[l].begin(), a.v[l].begin() + prefix * per_token);
    k.insert(k.end(), b.k[l].begin(), b.k[l].end());
    v.insert(v.end(), b.v[l].begin(), b.v[l].end());
    s.k.push_back(std::move(k));
    s.v.push_back(std::move(v));
  }
  return s;
}

// Streams a header then, per layer, chunks of `chunk_tokens` tokens (last layer first, so the
// server sees chunks out of order), within `timeout` when one is given.
inline grpc::Status PutSequence(v1::KvPool::Stub* stub, const std::string& ns, const Sequence& s,
                                int per_token, int chunk_tokens, v1::PutResponse* response,
                                absl::Duration timeout = absl::InfiniteDuration()) {
  grpc::ClientContext ctx;
  if (timeout != absl::InfiniteDuration()) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  auto writer = stub->Put(&ctx, response);
  v1::PutRequest req;
  req.mutable_header()->set_namespace_(ns);
  for (int32_t t : s.tokens) req.mutable_header()->add_token_ids(t);
  writer->Write(req);
  const int n = static_cast<int>(s.tokens.size());
  for (int l = static_cast<int>(s.k.size()) - 1; l >= 0; --l) {
    for (int b = 0; b < n; b += chunk_tokens) {
      const int m = std::min(chunk_tokens, n - b);
      v1::PutChunk* c = req.mutable_chunk();
      c->set_layer(l);
      c->set_token_begin(b);
      c->set_num_tokens(m);
      c->set_k(reinterpret_cast<const char*>(s.k[l].data() + b * per_token), m * per_token * 2);
      c->set_v(reinterpret_cast<const char*>(s.v[l].data() + b * per_token), m * per_token * 2);
      if (!writer->Write(req)) break;
    }
  }
  writer->WritesDone();
  return writer->Finish();
}

// A lease on `s`'s tokens (a Match that must succeed).
inline v1::MatchResponse MatchOk(v1::KvPool::Stub* stub, const std::string& ns, const Sequence& s,
                                 uint32_t ttl_ms = 0) {
  grpc::ClientContext ctx;
  v1::MatchRequest req;
  req.set_namespace_(ns);
  for (int32_t t : s.tokens) req.add_token_ids(t);
  req.set_ttl_ms(ttl_ms);
  v1::MatchResponse r;
  const grpc::Status st = stub->Match(&ctx, req, &r);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return r;
}

inline void ReleaseOk(v1::KvPool::Stub* stub, uint64_t lease) {
  grpc::ClientContext ctx;
  v1::ReleaseRequest req;
  req.set_lease_id(lease);
  v1::ReleaseResponse r;
  EXPECT_TRUE(stub->Release(&ctx, req, &r).ok());
}

// A new lease of namespace `ns` (nothing matched) holding `s`'s first `tokens` tokens, appended
// at every layer without token ids (one Append per layer, which must succeed).
inline uint64_t LeaseWithAppends(v1::KvPool::Stub* stub, const std::string& ns, const Sequence& s,
                                 int per_token, int tokens) {
  const uint64_t lease = MatchOk(stub, ns, Sequence{}).lease_id();
  for (size_t layer = 0; layer < s.k.size(); ++layer) {
    grpc::ClientContext ctx;
    v1::AppendRequest a;
    a.set_lease_id(lease);
    a.set_layer(static_cast<uint32_t>(layer));
    a.set_num_tokens(tokens);
    a.set_k(reinterpret_cast<const char*>(s.k[layer].data()), size_t{2} * tokens * per_token);
    a.set_v(reinterpret_cast<const char*>(s.v[layer].data()), size_t{2} * tokens * per_token);
    v1::AppendResponse r;
    const grpc::Status st = stub->Append(&ctx, a, &r);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  return lease;
}

inline grpc::Status ReadAll(v1::KvPool::Stub* stub, const v1::GetRequest& request,
                            std::vector<v1::GetResponse>* out,
                            absl::Duration timeout = absl::InfiniteDuration()) {
  grpc::ClientContext ctx;
  if (timeout != absl::InfiniteDuration()) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  auto reader = stub->Get(&ctx, request);
  v1::GetResponse r;
  while (reader->Read(&r)) out->push_back(r);
  return reader->Finish();
}

inline v1::StatsResponse GetStats(v1::KvPool::Stub* stub) {
  grpc::ClientContext ctx;
  v1::StatsResponse r;
  EXPECT_TRUE(stub->Stats(&ctx, v1::StatsRequest(), &r).ok());
  return r;
}

inline const v1::NamespaceStats* FindNamespace(const v1::StatsResponse& s, const std::string& n) {
  for (const auto& ns : s.namespaces()) {
    if (ns.name() == n) return &ns;
  }
  return nullptr;
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_INTEGRATION_TEST_SERVER_H_
