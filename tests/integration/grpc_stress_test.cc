// Many clients at once over gRPC, some of them giving up mid-call: Puts, Matches, Gets, Appends,
// unary Attends, AttendStream sessions and Releases on overlapping prompts, each call with a
// deadline that is often too short (so streams are cancelled between messages and unary calls
// while they run). Every call ends with OK or a status its contract names, and once the sweep
// has run with every lease past its TTL, no block is pinned and no lease or token id is left.
// The server runs the backend KVPOOL_TEST_BACKEND names (default cpu; the GPU runs set cuda).
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/store/compute_backend.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {
namespace {

constexpr int kThreads = 8;
constexpr int kStepsPerThread = 120;

TEST(GrpcStress, ClientsThatGiveUpMidCallLeaveNothingBehind) {
  // 14 blocks of 16 tokens: the prompts and tails below fill it, so refusals happen too.
  const NamespaceConfig c = SmallNamespace("small", 14 * BytesPerBlock(SmallNamespace("x", 0)));
  std::unique_ptr<ComputeBackend> backend;
  if (const char* name = std::getenv("KVPOOL_TEST_BACKEND");
      name != nullptr && std::string(name) == "cuda") {
    absl::StatusOr<std::unique_ptr<ComputeBackend>> cuda = NewCudaBackend(0);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    backend = *std::move(cuda);
  }
  auto t = TestServer::Start({c}, {}, std::move(backend));
  ASSERT_NE(t, nullptr);
  const int pt = c.num_kv_heads * c.head_dim;
  // Three prompt families sharing their first blocks.
  std::vector<Sequence> prompts;
  for (int f = 0; f < 3; ++f) prompts.push_back(MakeSequence(c, 64, 1 + 1000 * f, 50 + f));
  const std::vector<uint16_t> q = ToHalf(MakeNormal(size_t{4} * pt, 51));

  absl::Mutex mu;
  std::vector<std::string> unexpected;  // guarded by mu
  auto expect = [&](const grpc::Status& s, const char* what) {
    switch (s.error_code()) {
      case grpc::StatusCode::OK:
      case grpc::StatusCode::DEADLINE_EXCEEDED:    // the client's deadline
      case grpc::StatusCode::CANCELLED:            // the same, seen by a stream
      case grpc::StatusCode::RESOURCE_EXHAUSTED:   // the pool full of pinned blocks
      case grpc::StatusCode::NOT_FOUND:            // a lease expired or released meanwhile
      case grpc::StatusCode::FAILED_PRECONDITION:  // a Put cut short; an append in flight
      case grpc::StatusCode::INVALID_ARGUMENT:     // an Attend on a lease with no tokens yet
        return;
      default: {
        absl::MutexLock l(&mu);
        unexpected.push_back(std::string(what) + ": " + std::to_string(s.error_code()) + " " +
                             s.error_message());
      }
    }
  };
  auto with_deadline = [](grpc::ClientContext* ctx, absl::Duration d) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
  };

  auto work = [&](int thread) {
    std::mt19937 rng(77 + thread);
    auto pick = [&](size_t n) { return static_cast<int>(rng() % n); };
    // Half the calls may be cut short: 0-2 ms leaves a call mid-way here, 5 s does not.
    auto deadline = [&] {
      return pick(2) == 0 ? absl::Microseconds(pick(2000)) : absl::Seconds(5);
    };
    std::vector<uint64_t> leases;
    for (int step = 0; step < kStepsPerThread; ++step) {
      const Sequence& s = prompts[pick(prompts.size())];
      const int op = pick(100);
      if (op < 15) {
        v1::PutResponse put;
        expect(PutSequence(t->stub.get(), "small", s, pt, 16, &put, deadline()), "Put");
      } else if (op < 35 && leases.size() < 4) {
        grpc::ClientContext ctx;
        with_deadline(&ctx, deadline());
        v1::MatchRequest m;
        m.set_namespace_("small");
        for (int i = 0; i < 16 * (1 + pick(4)); ++i) m.add_token_ids(s.tokens[i]);
        m.set_ttl_ms(1000 * (5 + pick(56)));
        v1::MatchResponse r;
        const grpc::Status st = t->stub->Match(&ctx, m, &r);
        expect(st, "Match");
        // A Match that timed out may still have made its lease: the TTL drops it.
        if (st.ok()) leases.push_back(r.lease_id());
      } else if (op < 45 && !leases.empty()) {
        v1::GetRequest g;
        g.set_lease_id(leases[pick(leases.size())]);
        std::vector<v1::GetResponse> got;
        expect(ReadAll(t->stub.get(), g, &got, deadline()), "Get");
      } else if (op < 60 && !leases.empty()) {
        for (uint32_t layer = 0; layer < 2; ++layer) {
          grpc::ClientContext ctx;
          with_deadline(&ctx, deadline());
          v1::AppendRequest a;
          a.set_lease_id(leases[pick(leases.size())]);
          a.set_layer(layer);
          a.set_num_tokens(1);
          if (pick(2) == 0) a.add_token_ids(9000 + step);
          a.set_k(reinterpret_cast<const char*>(s.k[layer].data()), pt * 2);
          a.set_v(reinterpret_cast<const char*>(s.v[layer].data()), pt * 2);
          v1::AppendResponse r;
          expect(t->stub->Append(&ctx, a, &r), "Append");
        }
      } else if (op < 80 && !leases.empty()) {
        v1::AttendRequest a;
        a.set_layer(0);
        a.set_num_q_heads(c.num_kv_heads);
        const int items = 1 + pick(leases.size());
        const bool append = pick(2) == 0;  // each item's new token first
        for (int i = 0; i < items; ++i) {
          v1::AttendItem* item = a.add_items();
          item->set_lease_id(leases[i]);
          item->set_q(reinterpret_cast<const char*>(q.data() + i * pt), pt * 2);
          item->set_new_token_id(append ? 9500 + i : -1);
          if (append) {
            item->set_new_k(reinterpret_cast<const char*>(s.k[0].data() + i * pt), pt * 2);
            item->set_new_v(reinterpret_cast<const char*>(s.v[0].data() + i * pt), pt * 2);
          }
        }
        grpc::ClientContext ctx;
        with_deadline(&ctx, deadline());
        if (pick(2) == 0) {
          v1::AttendResponse r;
          expect(t->stub->Attend(&ctx, a, &r), "Attend");
        } else {  // a short decode loop on one stream
          auto stream = t->stub->AttendStream(&ctx);
          v1::AttendResponse r;
          for (int i = 0; i < 3 && stream->Write(a) && stream->Read(&r); ++i) {
          }
          stream->WritesDone();
          expect(stream->Finish(), "AttendStream");
        }
      } else if (op < 95 && !leases.empty()) {
        const size_t i = pick(leases.size());
        grpc::ClientContext ctx;
        with_deadline(&ctx, deadline());
        v1::ReleaseRequest r;
        r.set_lease_id(leases[i]);
        v1::ReleaseResponse resp;
        expect(t->stub->Release(&ctx, r, &resp), "Release");
        leases.erase(leases.begin() + i);
      } else {
        t->clock.Advance(absl::Seconds(1));
        t->server->Sweep();
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(work, i);
  for (std::thread& th : threads) th.join();
  for (const std::string& u : unexpected) ADD_FAILURE() << u;

  // Calls cut short may still be finishing on the server: sweep until it settles.
  t->clock.Advance(absl::Hours(1));
  v1::StatsResponse stats;
  const v1::NamespaceStats* ns = nullptr;
  for (int i = 0; i < 100; ++i) {
    t->server->Sweep();
    stats = GetStats(t->stub.get());
    ns = FindNamespace(stats, "small");
    ASSERT_NE(ns, nullptr);
    if (stats.active_leases() == 0 && ns->blocks_in_use() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(stats.active_leases(), 0u);
  EXPECT_EQ(ns->blocks_in_use(), 0u);
  EXPECT_EQ(ns->blocks_free() + ns->blocks_evictable(), ns->blocks_total());
  EXPECT_EQ(t->server->store()->Stats().lease_token_ids, 0u);
  // Still serving: a fresh prompt is stored and found.
  const Sequence fresh = MakeSequence(c, 32, 50000, 60);
  v1::PutResponse put;
  ASSERT_TRUE(PutSequence(t->stub.get(), "small", fresh, pt, 16, &put).ok());
  EXPECT_EQ(put.tokens_stored(), 32u);
}

}  // namespace
}  // namespace kvpool::testing
