// Attend and AttendStream on their own threads (service/attend_server.h), driven through the C++
// client (unary Attend and AttendSession) over an in-process channel with the CPU backend: more
// streams and concurrent unary callers than threads, spinning and blocking queues, a bad step
// that ends only its own stream, a stream cancelled between steps, a bad unary call that leaves
// its queue serving, and a server shutdown with streams still open.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvpool_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/attend_fixture.h"

namespace kvpool::testing {
namespace {

// A server with `threads` AttendStream threads spinning for `spin_us`, and `sequences` cached
// prompts, each under its own lease.
AttendFixture Start(int threads, int spin_us, int sequences) {
  return StartAttendFixture(sequences, [&](ServerOptions* o) {
    o->attend.threads = threads;
    o->attend.spin = absl::Microseconds(spin_us);
  });
}

// Whether the registry's text holds the line `series` within 5 s: a stream that ends OK is counted
// once its status has gone out, which its client may see first.
bool AwaitSeries(const AttendFixture& f, const std::string& series) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (f.server->server->registry()->Serialize().find(series) == std::string::npos) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// Expects each of `series` (kvpool_rpc_duration_seconds_count's labels and value) within 5 s.
void ExpectSeries(const AttendFixture& f, std::initializer_list<std::string> series) {
  for (const std::string& labels : series) {
    EXPECT_TRUE(AwaitSeries(f, std::string("kvpool_rpc_duration_seconds_count") + labels))
        << labels << "\nin:\n"
        << f.server->server->registry()->Serialize();
  }
}

// Every stream's every step, and every unary call made from other threads at the same time,
// equals the unary Attend of the same request made alone (no append, so the context does not
// change): responses are neither mixed up between calls nor reordered.
void ExpectStreamsMatchUnary(int threads, int spin_us) {
  constexpr int kStreams = 6;
  constexpr int kSteps = 12;
  AttendFixture f = Start(threads, spin_us, kStreams);
  ASSERT_NE(f.server, nullptr);
  ASSERT_EQ(f.leases.size(), static_cast<size_t>(kStreams));
  std::vector<std::vector<std::string>> want(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    for (int step = 0; step < kSteps; ++step) {
      absl::StatusOr<v1::AttendResponse> r =
          f.client->Attend(AttendRequestFor(f, f.leases[s], 100 * s + step));
      ASSERT_TRUE(r.ok()) << r.status();
      want[s].push_back(r->out());
    }
  }
  std::vector<std::thread> workers;
  std::atomic<int> mismatches{0}, failures{0};
  for (int s = 0; s < kStreams; ++s) {
    workers.emplace_back([&, s] {
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<v1::AttendResponse> r =
            f.client->Attend(AttendRequestFor(f, f.leases[s], 100 * s + step));
        if (!r.ok()) {
          ++failures;
          return;
        }
        if (r->out() != want[s][step] || r->context_tokens(0) != kAttendPromptTokens) ++mismatches;
      }
    });
    workers.emplace_back([&, s] {
      absl::StatusOr<std::unique_ptr<client::AttendSession>> session = f.client->OpenAttendStream();
      if (!session.ok()) {
        ++failures;
        return;
      }
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<v1::AttendResponse> r =
            (*session)->Step(AttendRequestFor(f, f.leases[s], 100 * s + step));
        if (!r.ok()) {
          ++failures;
          return;
        }
        if (r->out() != want[s][step] || r->context_tokens(0) != kAttendPromptTokens) ++mismatches;
      }
      if (!(*session)->Finish().ok()) ++failures;
    });
  }
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  ExpectSeries(
      f,
      {
          "{method=\"AttendStream\",code=\"OK\"} " + std::to_string(kStreams) + "\n",
          "{method=\"AttendStream.step\",code=\"OK\"} " + std::to_string(kStreams * kSteps) + "\n",
          "{method=\"Attend\",code=\"OK\"} " + std::to_string(2 * kStreams * kSteps) + "\n",
      });
}

TEST(AttendServer, MoreStreamsThanSpinningThreadsEachGetTheirOwnAnswers) {
  ExpectStreamsMatchUnary(/*threads=*/2, /*spin_us=*/500);
}

TEST(AttendServer, BlockingQueuesServeTheSameAnswers) {
  ExpectStreamsMatchUnary(/*threads=*/1, /*spin_us=*/0);
}

TEST(AttendServer, BadStepEndsOnlyItsOwnStream) {
  AttendFixture f = Start(/*threads=*/1, /*spin_us=*/500, /*sequences=*/1);
  ASSERT_NE(f.server, nullptr);
  auto good = f.client->OpenAttendStream();
  auto bad = f.client->OpenAttendStream();
  ASSERT_TRUE(good.ok() && bad.ok());
  ASSERT_TRUE((*good)->Step(AttendRequestFor(f, f.leases[0], 1)).ok());
  v1::AttendRequest wrong = AttendRequestFor(f, f.leases[0], 2);
  wrong.mutable_items(0)->set_q("short");
  absl::StatusOr<v1::AttendResponse> r = (*bad)->Step(wrong);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ((*bad)->Step(AttendRequestFor(f, f.leases[0], 3)).status().code(),
            absl::StatusCode::kInvalidArgument);  // the session stays finished
  v1::AttendRequest unknown = AttendRequestFor(f, f.leases[0] + 1000, 4);
  auto other = f.client->OpenAttendStream();
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE((*other)->Step(unknown).ok());
  // The good stream, served by the same thread, goes on.
  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<v1::AttendResponse> g =
        (*good)->Step(AttendRequestFor(f, f.leases[0], 10 + step));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens));
  }
  EXPECT_TRUE((*good)->Finish().ok());
  const std::string text = f.server->server->registry()->Serialize();
  EXPECT_NE(text.find("kvpool_rpc_duration_seconds_count{method=\"AttendStream\",code=\"INVALID_"
                      "ARGUMENT\"} 1\n"),
            std::string::npos)
      << text;
}

// A stream the client cancels between steps ends CANCELLED on the server, not OK like a stream
// the client half-closed.
TEST(AttendServer, StreamCancelledBetweenStepsCountsAsCancelled) {
  AttendFixture f = Start(/*threads=*/1, /*spin_us=*/500, /*sequences=*/1);
  ASSERT_NE(f.server, nullptr);
  auto closed = f.client->OpenAttendStream();
  auto cancelled = f.client->OpenAttendStream();
  ASSERT_TRUE(closed.ok() && cancelled.ok());
  ASSERT_TRUE((*closed)->Step(AttendRequestFor(f, f.leases[0], 1)).ok());
  ASSERT_TRUE((*cancelled)->Step(AttendRequestFor(f, f.leases[0], 2)).ok());
  EXPECT_TRUE((*closed)->Finish().ok());
  cancelled->reset();  // an unfinished session cancels its call
  ExpectSeries(f, {"{method=\"AttendStream\",code=\"OK\"} 1\n",
                   "{method=\"AttendStream\",code=\"CANCELLED\"} 1\n"});
}

// A unary call whose client gives up while the server runs it (its deadline passes) counts as
// CANCELLED, not OK: its response never went out.
TEST(AttendServer, UnaryCallPastItsDeadlineCountsAsCancelled) {
  AttendFixture f = Start(/*threads=*/1, /*spin_us=*/0, /*sequences=*/1);
  ASSERT_NE(f.server, nullptr);
  // A call the CPU backend takes long over: 8 items of 4096 query heads.
  constexpr int kHeads = 4096;
  v1::AttendRequest slow = AttendRequestFor(f, f.leases[0], 1);
  slow.set_num_q_heads(kHeads);
  const std::vector<uint16_t> q = ToHalf(MakeNormal(kHeads * f.config.head_dim, 9));
  slow.mutable_items(0)->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
  for (int i = 1; i < 8; ++i) *slow.add_items() = slow.items(0);
  const absl::Time begin = absl::Now();
  ASSERT_TRUE(f.client->Attend(slow).ok());
  const absl::Duration run = absl::Now() - begin;
  client::CallOptions call;
  call.deadline = run / 4;
  EXPECT_EQ(f.client->Attend(slow, call).status().code(), absl::StatusCode::kDeadlineExceeded);
  ExpectSeries(
      f, {"{method=\"Attend\",code=\"CANCELLED\"} 1\n", "{method=\"Attend\",code=\"OK\"} 1\n"});
}

TEST(AttendServer, BadUnaryCallLeavesItsQueueServing) {
  AttendFixture f = Start(/*threads=*/1, /*spin_us=*/500, /*sequences=*/2);
  ASSERT_NE(f.server, nullptr);
  absl::StatusOr<v1::AttendResponse> want = f.client->Attend(AttendRequestFor(f, f.leases[1], 5));
  ASSERT_TRUE(want.ok()) << want.status();
  v1::AttendRequest wrong = AttendRequestFor(f, f.leases[0], 2);
  wrong.mutable_items(0)->set_q("short");
  EXPECT_EQ(f.client->Attend(wrong).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.client->Attend(AttendRequestFor(f, f.leases[0] + 1000, 3)).status().code(),
            absl::StatusCode::kNotFound);
  // The queue's one thread serves the next calls, for either lease, as before.
  absl::StatusOr<v1::AttendResponse> again = f.client->Attend(AttendRequestFor(f, f.leases[1], 5));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->out(), want->out());
  EXPECT_TRUE(f.client->Attend(AttendRequestFor(f, f.leases[0], 4)).ok());
  ExpectSeries(
      f, {"{method=\"Attend\",code=\"INVALID_ARGUMENT\"} 1\n",
          "{method=\"Attend\",code=\"NOT_FOUND\"} 1\n", "{method=\"Attend\",code=\"OK\"} 3\n"});
}

// Attend and AttendStream requests of more items than --max_attend_batch get RESOURCE_EXHAUSTED
// from their count on the wire, before any item is built (the first does not parse), and the
// queue serves on.
TEST(AttendServer, ItemsOverTheBatchLimitAreRefusedBeforeParsing) {
  AttendFixture f = Start(/*threads=*/1, /*spin_us=*/500, /*sequences=*/1);
  ASSERT_NE(f.server, nullptr);
  const std::string wire = UnparsedItemsBytes(100000);
  const grpc::Slice slice(wire);
  grpc::GenericStub stub(f.server->server->InProcessChannel());
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto next = [&] { return cq.Next(&tag, &ok) && ok; };
  {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request(&slice, 1), response;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&ctx, "/kvpool.v1.KvPool/Attend", request, &cq);
    grpc::Status status;
    call->StartCall();
    call->Finish(&response, &status, &tag);
    ASSERT_TRUE(next());
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  }
  {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request(&slice, 1), response;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        stub.PrepareCall(&ctx, "/kvpool.v1.KvPool/AttendStream", &cq);
    call->StartCall(&tag);
    ASSERT_TRUE(next());
    call->Write(request, &tag);
    ASSERT_TRUE(next());
    call->Read(&response, &tag);
    EXPECT_FALSE(next());  // no response: the stream ends with the status
    grpc::Status status;
    call->Finish(&status, &tag);
    ASSERT_TRUE(next());
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  EXPECT_TRUE(f.client->Attend(AttendRequestFor(f, f.leases[0], 2)).ok());
}

// Unknown fields are kept by the parse, one allocation each (2 bytes on the wire): a request
// may carry a few, at the top or in an item, but not over 1024, nor a group (which nests more).
TEST(AttendServer, RequestsWithManyUnknownFieldsOrAGroupAreRefusedBeforeParsing) {
  AttendFixture f = Start(/*threads=*/1, /*spin_us=*/500, /*sequences=*/1);
  ASSERT_NE(f.server, nullptr);
  grpc::GenericStub stub(f.server->server->InProcessChannel());
  auto attend = [&](const std::string& wire) {
    const grpc::Slice slice(wire);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&ctx, "/kvpool.v1.KvPool/Attend", request, &cq);
    grpc::Status status;
    void* tag = nullptr;
    bool ok = false;
    call->StartCall();
    call->Finish(&response, &status, &tag);
    EXPECT_TRUE(cq.Next(&tag, &ok) && ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return status;
  };
  // Field 9 (varint) is no field of AttendRequest, field 15 none of AttendItem.
  auto unknown = [](const char* field, int n) {
    std::string bytes;
    for (int i = 0; i < n; ++i) bytes.append(field, 2);
    return bytes;
  };
  // The request with `top` after its other fields and `in_item` inside its one item.
  auto request = [&](const std::string& top, const std::string& in_item) {
    v1::AttendRequest r = AttendRequestFor(f, f.leases[0], 3);
    const std::string item = r.items(0).SerializeAsString() + in_item;
    r.clear_items();
    std::string wire = r.SerializeAsString() + "\x22";
    for (size_t n = item.size(); n > 0; n >>= 7) {
      wire += static_cast<char>((n & 0x7F) | (n >= 0x80 ? 0x80 : 0));
    }
    return wire + item + top;
  };
  const std::string valid = request("", "");
  EXPECT_TRUE(attend(request(unknown("\x48\x01", 3), unknown("\x78\x01", 3))).ok());
  const grpc::Status many = attend(request(unknown("\x48\x01", 2000), ""));
  EXPECT_EQ(many.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << many.error_message();
  const grpc::Status in_item = attend(request("", unknown("\x78\x01", 2000)));
  EXPECT_EQ(in_item.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << in_item.error_message();
  const grpc::Status group = attend(valid + "\x4b\x4c");  // an empty group, field 9
  EXPECT_EQ(group.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << group.error_message();
  EXPECT_TRUE(f.client->Attend(AttendRequestFor(f, f.leases[0], 4)).ok());
}

TEST(AttendServer, ShutdownEndsOpenStreamsWithoutHanging) {
  AttendFixture f = Start(/*threads=*/2, /*spin_us=*/500, /*sequences=*/2);
  ASSERT_NE(f.server, nullptr);
  std::vector<std::unique_ptr<client::AttendSession>> sessions;
  for (uint64_t lease : f.leases) {
    auto s = f.client->OpenAttendStream();
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Step(AttendRequestFor(f, lease, 7)).ok());
    sessions.push_back(*std::move(s));
  }
  auto idle = f.client->OpenAttendStream();  // opened, never stepped
  ASSERT_TRUE(idle.ok());
  f.server->server->Shutdown(absl::ZeroDuration());
  for (size_t i = 0; i < sessions.size(); ++i) {
    EXPECT_FALSE(sessions[i]->Step(AttendRequestFor(f, f.leases[i], 8)).ok());
  }
  EXPECT_FALSE((*idle)->Finish().ok());
}

}  // namespace
}  // namespace kvpool::testing
