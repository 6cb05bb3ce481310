// AttendStream on its own threads (service/attend_stream_server.h), driven through the C++
// client's AttendSession over an in-process channel with the CPU backend: more streams than
// threads, spinning and blocking queues, a bad step that ends only its own stream, and a server
// shutdown with streams still open.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/kvpool_client.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {
namespace {

constexpr int kQHeads = 4;
constexpr int kPromptTokens = 48;  // whole blocks: all of it is cached

struct Fixture {
  std::unique_ptr<TestServer> server;
  std::unique_ptr<client::KvPoolClient> client;
  std::vector<uint64_t> leases;  // one cached sequence each
  NamespaceConfig config;
};

// A server with `threads` AttendStream threads spinning for `spin_us`, and `sequences` cached
// prompts, each under its own lease.
Fixture Start(int threads, int spin_us, int sequences) {
  Fixture f;
  f.config = SmallNamespace("small", 4 << 20);
  f.server = TestServer::Start({f.config}, [&](ServerOptions* o) {
    o->attend_stream.threads = threads;
    o->attend_stream.spin = absl::Microseconds(spin_us);
  });
  if (f.server == nullptr) return f;
  f.client = client::KvPoolClient::Create(f.server->server->InProcessChannel());
  const int per_token = f.config.num_kv_heads * f.config.head_dim;
  for (int i = 0; i < sequences; ++i) {
    const Sequence s = MakeSequence(f.config, kPromptTokens, 1000 * (i + 1), 50 + i);
    v1::PutResponse put;
    EXPECT_TRUE(PutSequence(f.server->stub.get(), "small", s, per_token, 16, &put).ok());
    absl::StatusOr<v1::MatchResponse> m = f.client->Match("small", s.tokens);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) f.leases.push_back(m->lease_id());
  }
  return f;
}

v1::AttendRequest Request(const Fixture& f, uint64_t lease, uint64_t seed) {
  const std::vector<uint16_t> q = ToHalf(MakeNormal(kQHeads * f.config.head_dim, seed));
  v1::AttendRequest req;
  req.set_layer(static_cast<uint32_t>(seed % f.config.num_layers));
  req.set_num_q_heads(kQHeads);
  req.set_output_dtype(v1::OUTPUT_DTYPE_FP32);
  v1::AttendItem* item = req.add_items();
  item->set_lease_id(lease);
  item->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
  item->set_new_token_id(-1);
  return req;
}

// Every stream's every step equals the unary Attend of the same request (no append, so the
// context does not change): responses are neither mixed up between streams nor reordered.
void ExpectStreamsMatchUnary(int threads, int spin_us) {
  constexpr int kStreams = 6;
  constexpr int kSteps = 12;
  Fixture f = Start(threads, spin_us, kStreams);
  ASSERT_NE(f.server, nullptr);
  ASSERT_EQ(f.leases.size(), static_cast<size_t>(kStreams));
  std::vector<std::vector<std::string>> want(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    for (int step = 0; step < kSteps; ++step) {
      absl::StatusOr<v1::AttendResponse> r =
          f.client->Attend(Request(f, f.leases[s], 100 * s + step));
      ASSERT_TRUE(r.ok()) << r.status();
      want[s].push_back(r->out());
    }
  }
  std::vector<std::thread> workers;
  std::atomic<int> mismatches{0}, failures{0};
  for (int s = 0; s < kStreams; ++s) {
    workers.emplace_back([&, s] {
      absl::StatusOr<std::unique_ptr<client::AttendSession>> session = f.client->OpenAttendStream();
      if (!session.ok()) {
        ++failures;
        return;
      }
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<v1::AttendResponse> r =
            (*session)->Step(Request(f, f.leases[s], 100 * s + step));
        if (!r.ok()) {
          ++failures;
          return;
        }
        if (r->out() != want[s][step] || r->context_tokens(0) != kPromptTokens) ++mismatches;
      }
      if (!(*session)->Finish().ok()) ++failures;
    });
  }
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  const std::string text = f.server->server->registry()->Serialize();
  for (const std::string& want : {
           "kvpool_rpc_duration_seconds_count{method=\"AttendStream\",code=\"OK\"} " +
               std::to_string(kStreams) + "\n",
           "kvpool_rpc_duration_seconds_count{method=\"AttendStream.step\",code=\"OK\"} " +
               std::to_string(kStreams * kSteps) + "\n",
       }) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\nin:\n" << text;
  }
}

TEST(AttendStreamServer, MoreStreamsThanSpinningThreadsEachGetTheirOwnAnswers) {
  ExpectStreamsMatchUnary(/*threads=*/2, /*spin_us=*/500);
}

TEST(AttendStreamServer, BlockingQueuesServeTheSameAnswers) {
  ExpectStreamsMatchUnary(/*threads=*/1, /*spin_us=*/0);
}

TEST(AttendStreamServer, BadStepEndsOnlyItsOwnStream) {
  Fixture f = Start(/*threads=*/1, /*spin_us=*/500, /*sequences=*/1);
  ASSERT_NE(f.server, nullptr);
  auto good = f.client->OpenAttendStream();
  auto bad = f.client->OpenAttendStream();
  ASSERT_TRUE(good.ok() && bad.ok());
  ASSERT_TRUE((*good)->Step(Request(f, f.leases[0], 1)).ok());
  v1::AttendRequest wrong = Request(f, f.leases[0], 2);
  wrong.mutable_items(0)->set_q("short");
  absl::StatusOr<v1::AttendResponse> r = (*bad)->Step(wrong);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ((*bad)->Step(Request(f, f.leases[0], 3)).status().code(),
            absl::StatusCode::kInvalidArgument);  // the session stays finished
  v1::AttendRequest unknown = Request(f, f.leases[0] + 1000, 4);
  auto other = f.client->OpenAttendStream();
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE((*other)->Step(unknown).ok());
  // The good stream, served by the same thread, goes on.
  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<v1::AttendResponse> g = (*good)->Step(Request(f, f.leases[0], 10 + step));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->context_tokens(0), static_cast<uint32_t>(kPromptTokens));
  }
  EXPECT_TRUE((*good)->Finish().ok());
  const std::string text = f.server->server->registry()->Serialize();
  EXPECT_NE(text.find("kvpool_rpc_duration_seconds_count{method=\"AttendStream\",code=\"INVALID_"
                      "ARGUMENT\"} 1\n"),
            std::string::npos)
      << text;
}

TEST(AttendStreamServer, ShutdownEndsOpenStreamsWithoutHanging) {
  Fixture f = Start(/*threads=*/2, /*spin_us=*/500, /*sequences=*/2);
  ASSERT_NE(f.server, nullptr);
  std::vector<std::unique_ptr<client::AttendSession>> sessions;
  for (uint64_t lease : f.leases) {
    auto s = f.client->OpenAttendStream();
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Step(Request(f, lease, 7)).ok());
    sessions.push_back(*std::move(s));
  }
  auto idle = f.client->OpenAttendStream();  // opened, never stepped
  ASSERT_TRUE(idle.ok());
  f.server->server->Shutdown(absl::ZeroDuration());
  for (size_t i = 0; i < sessions.size(); ++i) {
    EXPECT_FALSE(sessions[i]->Step(Request(f, f.leases[i], 8)).ok());
  }
  EXPECT_FALSE((*idle)->Finish().ok());
}

}  // namespace
}  // namespace kvpool::testing
