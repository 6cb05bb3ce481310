// The KvPool service end to end over an in-process channel with the CPU backend: Put, Match,
// Get (fp16 and raw), Attend, AttendStream, eviction and lease expiry, checked against the CPU
// reference kernels.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kvpool/v1/attend_socket.h"
#include "tests/integration/reference_pages.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {
namespace {

constexpr int kQHeads = 4;

int PerToken(const NamespaceConfig& c) { return c.num_kv_heads * c.head_dim; }

int SharedFullBlocks(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int bt) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return static_cast<int>(n) / bt;
}

ReferencePages QuantizeReference(const NamespaceConfig& c, const Sequence& s, int tokens,
                                 int max_blocks) {
  ReferencePages ref(c, max_blocks);
  for (int l = 0; l < c.num_layers; ++l) {
    ref.Append(l, 0, tokens, s.k[l].data(), s.v[l].data());
  }
  return ref;
}

// Concatenates the k (or v) payloads of one layer's messages.
std::string LayerPayload(const std::vector<v1::GetResponse>& msgs, uint32_t layer, bool k) {
  std::string out;
  for (const auto& m : msgs) {
    if (m.layer() == layer) out += k ? m.k() : m.v();
  }
  return out;
}

// Checks fp16 and raw reads of the first `tokens` tokens of `s` under `lease`.
void ExpectReadBackMatchesReference(v1::KvPool::Stub* stub, const NamespaceConfig& c,
                                    const Sequence& s, uint64_t lease, int tokens) {
  const int blocks = tokens / c.block_tokens;
  ReferencePages ref = QuantizeReference(c, s, tokens, std::max(blocks, 1));
  const uint32_t chunk = 3000;  // several messages per layer
  v1::GetRequest req;
  req.set_lease_id(lease);
  req.set_max_chunk_bytes(chunk);
  req.set_format(v1::GET_FORMAT_FP16);
  std::vector<v1::GetResponse> fp16;
  ASSERT_TRUE(ReadAll(stub, req, &fp16).ok());
  req.set_format(v1::GET_FORMAT_RAW);
  std::vector<v1::GetResponse> raw;
  ASSERT_TRUE(ReadAll(stub, req, &raw).ok());
  for (const auto& m : fp16) {
    EXPECT_TRUE(m.k().size() + m.v().size() <= chunk || m.num_blocks() == 1);
  }
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<uint16_t> k, v;
    ref.Dequantize(l, blocks, &k, &v);
    const std::string gk = LayerPayload(fp16, l, true);
    const std::string gv = LayerPayload(fp16, l, false);
    ASSERT_EQ(gk.size(), k.size() * 2) << "layer " << l;
    EXPECT_EQ(std::memcmp(gk.data(), k.data(), gk.size()), 0) << "fp16 K differs, layer " << l;
    EXPECT_EQ(std::memcmp(gv.data(), v.data(), gv.size()), 0) << "fp16 V differs, layer " << l;

    // RAW: [blocks][heads] head pages of K, same for V, byte-identical to QuantizeAppend's.
    const PageLayout layout = LayerLayout(c, l);
    const std::string rk = LayerPayload(raw, l, true);
    const std::string rv = LayerPayload(raw, l, false);
    ASSERT_EQ(rk.size(), static_cast<size_t>(blocks) * c.num_kv_heads * layout.head_page_bytes());
    for (int b = 0; b < blocks; ++b) {
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const size_t got = (static_cast<size_t>(b) * c.num_kv_heads + h) * layout.head_page_bytes();
        const uint8_t* page = ref.pages(l).data() + b * layout.layer_page_bytes();
        EXPECT_EQ(std::memcmp(rk.data() + got, page + layout.head_page_offset(0, h),
                              layout.head_page_bytes()),
                  0)
            << "raw K block " << b << " head " << h;
        EXPECT_EQ(std::memcmp(rv.data() + got, page + layout.head_page_offset(1, h),
                              layout.head_page_bytes()),
                  0)
            << "raw V block " << b << " head " << h;
      }
    }
    bool described = false;
    for (const auto& m : raw) {
      if (m.layer() != static_cast<uint32_t>(l) || m.block_begin() != 0) continue;
      described = true;
      EXPECT_EQ(m.layout().head_page_bytes(), layout.head_page_bytes());
      EXPECT_EQ(m.layout().codes_bytes(), layout.codes_bytes());
      EXPECT_EQ(m.layout().rotation_block(), static_cast<uint32_t>(c.rotation_block));
      EXPECT_EQ(m.layout().rotation_sign_seed(), layout.sign_seed);
      EXPECT_EQ(m.layout().dtype(), l == 0 ? v1::KV_DTYPE_INT4 : v1::KV_DTYPE_INT8);
    }
    EXPECT_TRUE(described || blocks == 0);
  }
}

TEST(GrpcService, SharedPrefixSequencesRoundTripThroughPutMatchGetAndAttend) {
  const NamespaceConfig c = SmallNamespace("small", 4 << 20);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const int pt = PerToken(c);
  const Sequence base = MakeSequence(c, 96, 1000, 7);
  std::vector<Sequence> seqs;
  for (int i = 0; i < 6; ++i) {
    const Sequence suffix = MakeSequence(c, 16 * (1 + i % 3) + 5, 100000 * (i + 1), 100 + i);
    seqs.push_back(Concat(base, 16 * (i % 4 + 1), suffix, pt));
  }

  uint64_t distinct_blocks = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int n = static_cast<int>(seqs[i].tokens.size());
    int shared = 0;
    for (size_t j = 0; j < i; ++j) {
      shared = std::max(shared, SharedFullBlocks(seqs[i].tokens, seqs[j].tokens, c.block_tokens));
    }
    v1::PutResponse r;
    const grpc::Status st = PutSequence(t->stub.get(), "small", seqs[i], pt, 7, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(r.tokens_cached(), static_cast<uint32_t>(shared * c.block_tokens)) << "seq " << i;
    EXPECT_EQ(r.tokens_ignored(), static_cast<uint32_t>(n % c.block_tokens));
    EXPECT_EQ(r.tokens_cached() + r.tokens_stored() + r.tokens_ignored(), static_cast<uint32_t>(n));
    EXPECT_EQ(r.bytes_received(), 2ull * c.num_layers * n * pt * 2);
    distinct_blocks += n / c.block_tokens - shared;
  }
  const v1::StatsResponse stats = GetStats(t->stub.get());
  ASSERT_NE(FindNamespace(stats, "small"), nullptr);
  EXPECT_EQ(FindNamespace(stats, "small")->tokens_stored(), distinct_blocks * c.block_tokens);

  // Match and read every sequence back.
  std::vector<uint64_t> leases;
  for (const Sequence& s : seqs) {
    const v1::MatchResponse m = MatchOk(t->stub.get(), "small", s);
    const int full = static_cast<int>(s.tokens.size()) / c.block_tokens * c.block_tokens;
    EXPECT_EQ(m.cached_tokens(), static_cast<uint32_t>(full));
    leases.push_back(m.lease_id());
    ExpectReadBackMatchesReference(t->stub.get(), c, s, m.lease_id(), full);
  }

  // One batched Attend per layer, against the reference over the same pages and against fp16
  // attention over the original K/V.
  for (int l = 0; l < c.num_layers; ++l) {
    v1::AttendRequest req;
    req.set_layer(l);
    req.set_num_q_heads(kQHeads);
    req.set_output_dtype(v1::OUTPUT_DTYPE_FP32);
    req.set_return_lse(true);
    std::vector<std::vector<uint16_t>> qs;
    for (size_t i = 0; i < seqs.size(); ++i) {
      qs.push_back(ToHalf(MakeNormal(kQHeads * c.head_dim, 500 + i * 7 + l)));
      v1::AttendItem* item = req.add_items();
      item->set_lease_id(leases[i]);
      item->set_q(reinterpret_cast<const char*>(qs.back().data()), qs.back().size() * 2);
    }
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = t->stub->Attend(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    const size_t per_item = static_cast<size_t>(kQHeads) * c.head_dim;
    ASSERT_EQ(resp.out().size(), seqs.size() * per_item * sizeof(float));
    ASSERT_EQ(resp.lse_size(), static_cast<int>(seqs.size()) * kQHeads);
    const float* out = reinterpret_cast<const float*>(resp.out().data());
    const float sm_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    double worst_vs_fp16 = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int len = static_cast<int>(seqs[i].tokens.size()) / c.block_tokens * c.block_tokens;
      EXPECT_EQ(resp.context_tokens(i), static_cast<uint32_t>(len));
      ReferencePages ref = QuantizeReference(c, seqs[i], len, len / c.block_tokens);
      std::vector<float> want, want_lse;
      ref.Attend(l, len, kQHeads, sm_scale, qs[i].data(), &want, &want_lse);
      EXPECT_LT(RelativeL2(out + i * per_item, want.data(), per_item), 1e-5) << "item " << i;
      for (int h = 0; h < kQHeads; ++h) {
        EXPECT_NEAR(resp.lse(i * kQHeads + h), want_lse[h], 1e-5 * std::abs(want_lse[h]) + 1e-6);
      }
      const std::vector<float> exact =
          Fp16Attention(qs[i].data(), kQHeads, seqs[i].k[l].data(), seqs[i].v[l].data(), len,
                        c.num_kv_heads, c.head_dim, sm_scale);
      worst_vs_fp16 =
          std::max(worst_vs_fp16, RelativeL2(out + i * per_item, exact.data(), per_item));
    }
    std::printf("layer %d (%s): worst relative L2 error vs fp16 attention %.4f\n", l,
                l == 0 ? "int4" : "int8", worst_vs_fp16);
    // Measured with these seeds: 0.218 (INT4; K has offset outliers of 12) and 0.018 (INT8).
    EXPECT_LT(worst_vs_fp16, l == 0 ? 0.3 : 0.03);

    // The same call with the default (fp16) output: the fp32 output rounded, element for element.
    req.clear_output_dtype();
    grpc::ClientContext ctx16;
    v1::AttendResponse resp16;
    ASSERT_TRUE(t->stub->Attend(&ctx16, req, &resp16).ok());
    ASSERT_EQ(resp16.out().size(), seqs.size() * per_item * sizeof(uint16_t));
    const uint16_t* out16 = reinterpret_cast<const uint16_t*>(resp16.out().data());
    for (size_t i = 0; i < seqs.size() * per_item; ++i) {
      ASSERT_EQ(out16[i], FloatToHalf(out[i])) << "element " << i;
    }
  }
  for (uint64_t lease : leases) ReleaseOk(t->stub.get(), lease);
  EXPECT_EQ(GetStats(t->stub.get()).active_leases(), 0u);
}

TEST(GrpcService, AttendStreamAppendsEachStepAndMatchesReference) {
  const NamespaceConfig c = SmallNamespace("small", 4 << 20);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const int pt = PerToken(c);
  constexpr int kPrompt = 48;
  constexpr int kSteps = 20;  // crosses the block boundary at 64
  const Sequence s = MakeSequence(c, kPrompt + kSteps, 7000, 21);
  Sequence prompt = s;
  prompt.tokens.resize(kPrompt);
  for (int l = 0; l < c.num_layers; ++l) {
    prompt.k[l].resize(kPrompt * pt);
    prompt.v[l].resize(kPrompt * pt);
  }
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", prompt, pt, 16, &put).ok());
  const v1::MatchResponse m = MatchOk(t->stub.get(), "small", prompt);
  ASSERT_EQ(m.cached_tokens(), static_cast<uint32_t>(kPrompt));

  constexpr int kLayer = 0;
  ReferencePages ref(c, (kPrompt + kSteps + c.block_tokens - 1) / c.block_tokens);
  ref.Append(kLayer, 0, kPrompt, s.k[kLayer].data(), s.v[kLayer].data());
  grpc::ClientContext ctx;
  auto stream = t->stub->AttendStream(&ctx);
  const float sm_scale = 0.1f;
  for (int step = 0; step < kSteps; ++step) {
    const int pos = kPrompt + step;
    const std::vector<uint16_t> q = ToHalf(MakeNormal(kQHeads * c.head_dim, 900 + step));
    v1::AttendRequest req;
    req.set_layer(kLayer);
    req.set_num_q_heads(kQHeads);
    req.set_sm_scale(sm_scale);
    req.set_output_dtype(v1::OUTPUT_DTYPE_FP32);
    v1::AttendItem* item = req.add_items();
    item->set_lease_id(m.lease_id());
    item->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
    item->set_new_k(reinterpret_cast<const char*>(s.k[kLayer].data() + pos * pt), pt * 2);
    item->set_new_v(reinterpret_cast<const char*>(s.v[kLayer].data() + pos * pt), pt * 2);
    item->set_new_token_id(s.tokens[pos]);
    ASSERT_TRUE(stream->Write(req));
    v1::AttendResponse resp;
    ASSERT_TRUE(stream->Read(&resp)) << "step " << step;
    ASSERT_EQ(resp.context_tokens(0), static_cast<uint32_t>(pos + 1));

    ref.Append(kLayer, pos, 1, s.k[kLayer].data() + pos * pt, s.v[kLayer].data() + pos * pt);
    std::vector<float> want, want_lse;
    ref.Attend(kLayer, pos + 1, kQHeads, sm_scale, q.data(), &want, &want_lse);
    ASSERT_EQ(resp.out().size(), want.size() * sizeof(float));
    EXPECT_LT(
        RelativeL2(reinterpret_cast<const float*>(resp.out().data()), want.data(), want.size()),
        1e-5)
        << "step " << step;
  }
  stream->WritesDone();
  const grpc::Status st = stream->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
}

TEST(GrpcService, EvictionNeverTakesPinnedBlocksAndKeepsCachedPrefixesReadable) {
  NamespaceConfig c = SmallNamespace("tiny", 0);
  c.capacity_bytes = 12 * BytesPerBlock(c);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const int pt = PerToken(c);
  const Sequence pinned = MakeSequence(c, 64, 1, 3);
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "tiny", pinned, pt, 16, &put).ok());
  const v1::MatchResponse hold = MatchOk(t->stub.get(), "tiny", pinned);
  ASSERT_EQ(hold.cached_tokens(), 64u);

  // Ten sequences of 3 blocks sharing a 1-block root: 31 blocks through 8 free slots.
  const Sequence root = MakeSequence(c, 16, 50000, 4);
  std::vector<Sequence> others;
  for (int i = 0; i < 10; ++i) {
    others.push_back(Concat(root, 16, MakeSequence(c, 32, 60000 + 100 * i, 40 + i), pt));
    const grpc::Status st = PutSequence(t->stub.get(), "tiny", others.back(), pt, 16, &put);
    ASSERT_TRUE(st.ok()) << "put " << i << ": " << st.error_message();
    const v1::MatchResponse again = MatchOk(t->stub.get(), "tiny", pinned);
    EXPECT_EQ(again.cached_tokens(), 64u) << "a pinned block was evicted after put " << i;
    ReleaseOk(t->stub.get(), again.lease_id());
  }
  const v1::StatsResponse stats = GetStats(t->stub.get());
  ASSERT_NE(FindNamespace(stats, "tiny"), nullptr);
  EXPECT_GT(FindNamespace(stats, "tiny")->evictions(), 0u);

  ExpectReadBackMatchesReference(t->stub.get(), c, pinned, hold.lease_id(), 64);
  int still_cached = 0;
  for (const Sequence& s : others) {
    const v1::MatchResponse m = MatchOk(t->stub.get(), "tiny", s);
    still_cached += m.cached_tokens() > 0;
    ExpectReadBackMatchesReference(t->stub.get(), c, s, m.lease_id(),
                                   static_cast<int>(m.cached_tokens()));
    ReleaseOk(t->stub.get(), m.lease_id());
  }
  EXPECT_GT(still_cached, 0);
  // The last sequence put is the most recently used: it is whole.
  EXPECT_EQ(MatchOk(t->stub.get(), "tiny", others.back()).cached_tokens(), 48u);
}

// A server with namespace `c` that holds all of `s` (options changed by `tweak`).
void StartHolding(const NamespaceConfig& c, const Sequence& s, std::unique_ptr<TestServer>* t,
                  std::function<void(ServerOptions*)> tweak = {}) {
  *t = TestServer::Start({c}, std::move(tweak));
  ASSERT_NE(*t, nullptr);
  v1::PutResponse put;
  ASSERT_TRUE(
      PutSequence((*t)->stub.get(), c.name, s, PerToken(c), static_cast<int>(s.tokens.size()), &put)
          .ok());
}

TEST(GrpcService, LeasesExpireOnTheInjectedClock) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  std::unique_ptr<TestServer> t;
  const Sequence s = MakeSequence(c, 32, 1, 5);
  ASSERT_NO_FATAL_FAILURE(StartHolding(c, s, &t));
  const v1::MatchResponse short_lease = MatchOk(t->stub.get(), "small", s, 1000);
  const v1::MatchResponse default_lease = MatchOk(t->stub.get(), "small", s, 0);
  EXPECT_EQ(GetStats(t->stub.get()).active_leases(), 2u);

  v1::GetRequest get;
  get.set_lease_id(short_lease.lease_id());
  std::vector<v1::GetResponse> msgs;
  t->clock.Advance(absl::Milliseconds(999));
  EXPECT_TRUE(ReadAll(t->stub.get(), get, &msgs).ok());  // using a lease renews it
  t->clock.Advance(absl::Milliseconds(999));
  EXPECT_TRUE(ReadAll(t->stub.get(), get, &msgs).ok());
  t->clock.Advance(absl::Milliseconds(1001));
  msgs.clear();
  EXPECT_EQ(ReadAll(t->stub.get(), get, &msgs).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetStats(t->stub.get()).active_leases(), 1u);

  t->clock.Advance(absl::Seconds(30));  // past the 30 s default ttl
  grpc::ClientContext ctx;
  v1::ReleaseRequest rel;
  rel.set_lease_id(default_lease.lease_id());
  v1::ReleaseResponse rr;
  EXPECT_EQ(t->stub->Release(&ctx, rel, &rr).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetStats(t->stub.get()).active_leases(), 0u);
}

// One step over the AttendSocket on loopback `port`: OK for a response, else the status frame's
// status.
grpc::Status AttendSocketStep(int port, const v1::AttendRequest& request) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto conn = attend_socket::Connect(absl::StrCat("127.0.0.1:", port), deadline);
  if (!conn.ok()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, conn.status().ToString());
  absl::Status written =
      (*conn)->WriteMessage(attend_socket::FrameType::kRequest, request, deadline);
  if (!written.ok()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, written.ToString());
  std::string payload;
  auto frame = (*conn)->Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
  if (!frame.ok()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, frame.status().ToString());
  if (frame->type != attend_socket::FrameType::kStatus) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(frame->code), payload);
}

// A Get, Append, Attend, AttendStream step or AttendSocket step refused for bad input leaves the
// lease's expiry alone.
TEST(GrpcService, RefusedCallsDoNotRenewTheirLease) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  std::unique_ptr<TestServer> t;
  const Sequence s = MakeSequence(c, 32, 1, 5);
  ASSERT_NO_FATAL_FAILURE(
      StartHolding(c, s, &t, [](ServerOptions* o) { o->attend_socket.address = "127.0.0.1:0"; }));
  for (const char* refused : {"Get", "Append", "Attend", "AttendStream", "AttendSocket"}) {
    const uint64_t lease = MatchOk(t->stub.get(), "small", s, 1000).lease_id();
    t->clock.Advance(absl::Milliseconds(999));
    grpc::ClientContext ctx;
    grpc::Status status;
    if (std::string(refused) == "Get") {
      v1::GetRequest bad;
      bad.set_lease_id(lease);
      bad.set_layer_begin(c.num_layers);  // out of range
      std::vector<v1::GetResponse> msgs;
      status = ReadAll(t->stub.get(), bad, &msgs);
    } else if (std::string(refused) == "Append") {
      v1::AppendRequest bad;
      bad.set_lease_id(lease);
      bad.set_num_tokens(1);
      bad.set_k("short");
      bad.set_v("short");
      v1::AppendResponse r;
      status = t->stub->Append(&ctx, bad, &r);
    } else {
      v1::AttendRequest bad;
      bad.set_num_q_heads(2 * c.num_kv_heads);
      bad.add_items()->set_lease_id(lease);
      bad.mutable_items(0)->set_q("short");
      v1::AttendResponse r;
      if (std::string(refused) == "Attend") {
        status = t->stub->Attend(&ctx, bad, &r);
      } else if (std::string(refused) == "AttendStream") {
        auto stream = t->stub->AttendStream(&ctx);
        stream->Write(bad);
        stream->WritesDone();
        while (stream->Read(&r)) {
        }
        status = stream->Finish();
      } else {
        status = AttendSocketStep(t->server->attend_socket_port(), bad);
      }
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << refused << ": " << status.error_message();
    t->clock.Advance(absl::Milliseconds(2));
    v1::GetRequest get;
    get.set_lease_id(lease);
    std::vector<v1::GetResponse> msgs;
    EXPECT_EQ(ReadAll(t->stub.get(), get, &msgs).error_code(), grpc::StatusCode::NOT_FOUND)
        << "the refused " << refused << " renewed the lease";
  }
}

// A Get of a lease that holds no tokens reads nothing, and still renews the lease.
TEST(GrpcService, AGetThatReadsNothingRenewsItsLease) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const uint64_t lease =
      MatchOk(t->stub.get(), "small", MakeSequence(c, 32, 1, 5), 1000).lease_id();
  v1::GetRequest get;
  get.set_lease_id(lease);
  for (int i = 0; i < 3; ++i) {
    t->clock.Advance(absl::Milliseconds(999));
    std::vector<v1::GetResponse> msgs;
    const grpc::Status status = ReadAll(t->stub.get(), get, &msgs);
    ASSERT_TRUE(status.ok()) << i << ": " << status.error_message();
    EXPECT_TRUE(msgs.empty());
  }
}

// A Get is split into messages the server's own message limit lets out, whatever
// --get_chunk_bytes says.
TEST(GrpcService, GetMessagesFitTheMessageLimit) {
  const NamespaceConfig c = SmallNamespace("small", 4 << 20);
  auto t = TestServer::Start({c}, [](ServerOptions* o) {
    o->max_message_bytes = 64 << 10;
    o->service.get_chunk_bytes = 64 << 10;
  });
  ASSERT_NE(t, nullptr);
  const Sequence s = MakeSequence(c, 256, 1, 6);
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", s, PerToken(c), 64, &put).ok());
  v1::GetRequest get;
  get.set_lease_id(MatchOk(t->stub.get(), "small", s, 0).lease_id());
  std::vector<v1::GetResponse> msgs;
  const grpc::Status status = ReadAll(t->stub.get(), get, &msgs);
  ASSERT_TRUE(status.ok()) << status.error_message();
  size_t blocks = 0;
  for (const v1::GetResponse& m : msgs) {
    EXPECT_LE(m.ByteSizeLong(), size_t{64} << 10);
    blocks += m.num_blocks();
  }
  EXPECT_EQ(blocks, 256u / c.block_tokens * c.num_layers);
}

TEST(GrpcService, CreatedNamespaceIsListedWithDefaultsFilledIn) {
  auto t = TestServer::Start({SmallNamespace("small", 1 << 20)});
  ASSERT_NE(t, nullptr);
  grpc::ClientContext ctx;
  v1::CreateNamespaceRequest req;
  v1::NamespaceSpec* spec = req.mutable_spec();
  spec->set_name("llama.tiny-1");
  spec->set_num_layers(3);
  spec->set_num_kv_heads(1);
  spec->set_head_dim(32);
  spec->add_layer_dtypes(v1::KV_DTYPE_FP8_E4M3);
  spec->set_capacity_bytes(1 << 20);
  v1::CreateNamespaceResponse resp;
  const grpc::Status st = t->stub->CreateNamespace(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.info().spec().block_tokens(), 16u);
  EXPECT_EQ(resp.info().spec().default_dtype(), v1::KV_DTYPE_INT4);
  ASSERT_EQ(resp.info().spec().layer_dtypes_size(), 3);
  EXPECT_EQ(resp.info().spec().layer_dtypes(0), v1::KV_DTYPE_FP8_E4M3);
  EXPECT_EQ(resp.info().spec().layer_dtypes(2), v1::KV_DTYPE_INT4);
  EXPECT_EQ(resp.info().spec().rotation_block(), 32u);
  EXPECT_EQ(resp.info().spec().group_size(), 32u);
  EXPECT_GT(resp.info().num_blocks(), 0u);
  EXPECT_GT(resp.info().fp16_bytes_per_token(), resp.info().bytes_per_token());

  grpc::ClientContext ctx2;
  v1::ListNamespacesResponse list;
  ASSERT_TRUE(t->stub->ListNamespaces(&ctx2, v1::ListNamespacesRequest(), &list).ok());
  ASSERT_EQ(list.namespaces_size(), 2);
  EXPECT_EQ(list.namespaces(1).spec().name(), "llama.tiny-1");

  grpc::ClientContext ctx3;
  EXPECT_EQ(t->stub->CreateNamespace(&ctx3, req, &resp).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);

  // At head_dim 256 the default rotation block is 128, the largest the CUDA kernels serve.
  spec->set_name("wide");
  spec->set_head_dim(256);
  grpc::ClientContext ctx4;
  ASSERT_TRUE(t->stub->CreateNamespace(&ctx4, req, &resp).ok());
  EXPECT_EQ(resp.info().spec().rotation_block(), 128u);
  EXPECT_EQ(resp.info().spec().group_size(), 256u);
}

TEST(GrpcService, MetricsCountRpcsAndMirrorTheStore) {
  const NamespaceConfig c = SmallNamespace("small", 1 << 20);
  auto t = TestServer::Start({c});
  ASSERT_NE(t, nullptr);
  const Sequence s = MakeSequence(c, 40, 1, 6);
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", s, PerToken(c), 8, &put).ok());
  const v1::MatchResponse m = MatchOk(t->stub.get(), "small", s);
  v1::MatchRequest missing;
  missing.set_namespace_("nope");
  grpc::ClientContext ctx;
  v1::MatchResponse mr;
  EXPECT_EQ(t->stub->Match(&ctx, missing, &mr).error_code(), grpc::StatusCode::NOT_FOUND);

  const std::string text = t->server->registry()->Serialize();
  for (const char* want : {
           "kvpool_rpc_duration_seconds_count{method=\"Put\",code=\"OK\"} 1\n",
           "kvpool_rpc_duration_seconds_count{method=\"Match\",code=\"OK\"} 1\n",
           "kvpool_rpc_duration_seconds_count{method=\"Match\",code=\"NOT_FOUND\"} 1\n",
           "kvpool_tokens_stored{namespace=\"small\"} 32\n",
           "kvpool_active_leases 1\n",
           "kvpool_lease_token_ids 40\n",
           "kvpool_build_info{version=\"0.1.0\",backend=\"cpu\"} 1\n",
           "kvpool_pool_blocks{namespace=\"small\",state=\"in_use\"} 2\n",
           "kvpool_device_memory_bytes{state=\"arena\"}",
       }) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\nin:\n" << text;
  }
  // Every received byte of the Put stream is counted: at least the K/V payload.
  const std::string rx = "kvpool_rpc_received_bytes_total{method=\"Put\"} ";
  const size_t at = text.find(rx);
  ASSERT_NE(at, std::string::npos);
  EXPECT_GE(std::stod(text.substr(at + rx.size())), 2.0 * c.num_layers * 40 * PerToken(c) * 2);
  ReleaseOk(t->stub.get(), m.lease_id());
}

}  // namespace
}  // namespace kvpool::testing
