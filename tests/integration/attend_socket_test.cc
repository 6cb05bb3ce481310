// Attend over the AttendSocket (service/attend_socket_server.h, client/attend_socket_session.h)
// with the CPU backend on loopback: sessions give the same answers as gRPC, appends included; a
// bad step, a bad frame, a refused connection and an idle session each get their status and end
// only their own session; an ended session closes its descriptor; shutdown with sessions open does
// not hang; target parsing.
#include "kvpool/v1/attend_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/attend_socket_session.h"
#include "client/kvpool_client.h"
#include "gtest/gtest.h"
#include "tests/integration/attend_fixture.h"
#include "tests/integration/attend_socket_raw.h"

namespace kvpool::testing {
namespace {

using attend_socket::FrameConnection;
using attend_socket::FrameType;
using attend_socket::kMagic;

struct SocketFixture {
  AttendFixture f;
  std::unique_ptr<client::KvPoolClient> socket_client;  // sessions over the AttendSocket
};

// A server listening for gRPC and AttendSocket on loopback, with `sequences` cached prompts.
SocketFixture StartSocket(int sequences, std::function<void(AttendSocketOptions*)> tweak = {},
                          absl::Duration client_spin = absl::Microseconds(500)) {
  SocketFixture s;
  s.f = StartAttendFixture(sequences, [&](ServerOptions* o) {
    o->grpc_address = "127.0.0.1:0";
    o->attend_socket.address = "127.0.0.1:0";
    if (tweak) tweak(&o->attend_socket);
  });
  if (s.f.server == nullptr) return s;
  client::ClientOptions options;
  options.attend_socket_port = s.f.server->server->attend_socket_port();
  options.attend_spin = client_spin;
  s.socket_client = client::KvPoolClient::Create(
      "127.0.0.1:" + std::to_string(s.f.server->server->port()), options);
  return s;
}

// Sends `bytes` on a raw connection and returns the status frame the server answers with; the
// server then closes the connection.
absl::Status StatusAfterSending(int port, const std::string& bytes) {
  const int fd = RawConnect(port);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  EXPECT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  FrameConnection conn(fd);
  std::string payload;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<FrameConnection::Frame> frame =
      conn.Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
  if (!frame.ok()) return frame.status();
  EXPECT_EQ(frame->type, FrameType::kStatus);
  // Closed after the status.
  EXPECT_TRUE(
      absl::IsOutOfRange(conn.Read(&payload, 1 << 20, deadline, absl::ZeroDuration()).status()));
  return attend_socket::StatusFromFrame(frame->code, payload);
}

int MetricCount(const SocketFixture& s, const std::string& method, const std::string& code) {
  const std::string text = s.f.server->server->registry()->Serialize();
  const std::string key =
      "kvpool_rpc_duration_seconds_count{method=\"" + method + "\",code=\"" + code + "\"} ";
  const size_t at = text.find(key);
  return at == std::string::npos ? 0 : std::stoi(text.substr(at + key.size()));
}

// Sessions on several threads give, step for step, the unary Attend's answers.
void ExpectSessionsMatchUnary(absl::Duration server_spin, absl::Duration client_spin,
                              int max_spinning) {
  constexpr int kSessions = 4;
  constexpr int kSteps = 10;
  SocketFixture s = StartSocket(
      kSessions,
      [&](AttendSocketOptions* o) {
        o->spin = server_spin;
        o->max_spinning = max_spinning;
      },
      client_spin);
  ASSERT_NE(s.f.server, nullptr);
  ASSERT_EQ(s.f.leases.size(), static_cast<size_t>(kSessions));
  std::vector<std::vector<std::string>> want(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    for (int step = 0; step < kSteps; ++step) {
      absl::StatusOr<v1::AttendResponse> r =
          s.f.client->Attend(AttendRequestFor(s.f, s.f.leases[i], 100 * i + step));
      ASSERT_TRUE(r.ok()) << r.status();
      want[i].push_back(r->out());
    }
  }
  std::atomic<int> mismatches{0}, failures{0};
  std::vector<std::thread> workers;
  for (int i = 0; i < kSessions; ++i) {
    workers.emplace_back([&, i] {
      absl::StatusOr<std::unique_ptr<client::AttendSession>> session =
          s.socket_client->OpenAttendStream();
      if (!session.ok()) {
        ++failures;
        return;
      }
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<v1::AttendResponse> r =
            (*session)->Step(AttendRequestFor(s.f, s.f.leases[i], 100 * i + step));
        if (!r.ok()) {
          ++failures;
          return;
        }
        if (r->out() != want[i][step] || r->context_tokens(0) != kAttendPromptTokens) {
          ++mismatches;
        }
      }
      if (!(*session)->Finish().ok()) ++failures;
    });
  }
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  // A session is counted once its thread has seen the close, after its steps.
  for (int i = 0; i < 1000 && MetricCount(s, "AttendSocket", "OK") < kSessions; ++i) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(MetricCount(s, "AttendSocket", "OK"), kSessions);
  EXPECT_EQ(MetricCount(s, "AttendSocket.step", "OK"), kSessions * kSteps);
}

TEST(AttendSocket, SpinningSessionsMatchUnaryAttend) {
  ExpectSessionsMatchUnary(absl::Microseconds(500), absl::Microseconds(500), /*max_spinning=*/4);
}

// One session at a time may spin; the others block: the same answers.
TEST(AttendSocket, SessionsBeyondTheSpinningLimitBlockAndMatch) {
  ExpectSessionsMatchUnary(absl::Microseconds(500), absl::Microseconds(500), /*max_spinning=*/1);
}

// The process's CPU time, user and system.
absl::Duration CpuTime() {
  rusage r;
  getrusage(RUSAGE_SELF, &r);
  return absl::DurationFromTimeval(r.ru_utime) + absl::DurationFromTimeval(r.ru_stime);
}

// An idle connection gives its spinning slot back once its spin is over, though its read blocks
// on: with one slot, a session stepping after it spins through the gaps between its steps (it
// burns CPU there; the client does not spin). Its slot was kept until the idle read returned.
TEST(AttendSocket, AnIdleSessionGivesItsSpinningSlotBack) {
  SocketFixture s = StartSocket(
      /*sequences=*/1,
      [](AttendSocketOptions* o) {
        o->spin = absl::Milliseconds(200);
        o->max_spinning = 1;
      },
      /*client_spin=*/absl::ZeroDuration());
  ASSERT_NE(s.f.server, nullptr);
  const int idle = RawConnect(s.f.server->server->attend_socket_port());
  ASSERT_GE(idle, 0) << std::strerror(errno);
  absl::SleepFor(absl::Milliseconds(400));  // its session has spun and blocks in its read
  auto session = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).ok());
  const absl::Duration start = CpuTime();
  for (int i = 0; i < 10; ++i) {
    absl::SleepFor(absl::Milliseconds(50));  // the server's session spins through this gap
    ASSERT_TRUE((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 2 + i)).ok());
  }
  EXPECT_GE(CpuTime() - start, absl::Milliseconds(150)) << "the stepping session did not spin";
  close(idle);
  EXPECT_TRUE((*session)->Finish().ok());
}

TEST(AttendSocket, BlockingSessionsMatchUnaryAttend) {
  ExpectSessionsMatchUnary(absl::ZeroDuration(), absl::ZeroDuration(), /*max_spinning=*/4);
}

// A layer-0 step of `lease` that appends new token `step` (K and V drawn from `step`).
v1::AttendRequest AppendingRequest(const AttendFixture& f, uint64_t lease, int step) {
  v1::AttendRequest req = AttendRequestFor(f, lease, 7 + step);
  req.set_layer(0);
  v1::AttendItem* item = req.mutable_items(0);
  const int per_token = f.config.num_kv_heads * f.config.head_dim;
  const std::vector<uint16_t> k = ToHalf(MakeNormal(per_token, 900 + step));
  const std::vector<uint16_t> v = ToHalf(MakeNormal(per_token, 1900 + step));
  item->set_new_k(reinterpret_cast<const char*>(k.data()), k.size() * 2);
  item->set_new_v(reinterpret_cast<const char*>(v.data()), v.size() * 2);
  item->set_new_token_id(5000 + step);
  return req;
}

// The same decode loop, appending a new token every step, over AttendStream on one lease and
// over the AttendSocket on another lease of the same prompt: equal outputs and lengths.
TEST(AttendSocket, AppendingDecodeLoopMatchesAttendStream) {
  SocketFixture s = StartSocket(/*sequences=*/1);
  ASSERT_NE(s.f.server, nullptr);
  const Sequence prompt = MakeSequence(s.f.config, kAttendPromptTokens, 1000, 50);
  absl::StatusOr<v1::MatchResponse> second = s.f.client->Match("small", prompt.tokens);
  ASSERT_TRUE(second.ok()) << second.status();
  auto stream = s.f.client->OpenAttendStream();
  auto socket = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(stream.ok() && socket.ok());
  v1::AttendResponse a, b;  // each session's, reused every step
  for (int step = 0; step < 20; ++step) {
    v1::AttendRequest req = AppendingRequest(s.f, s.f.leases[0], step);
    const absl::Status sa = (*stream)->Step(req, &a);
    req.mutable_items(0)->set_lease_id(second->lease_id());
    const absl::Status sb = (*socket)->Step(req, &b);
    ASSERT_TRUE(sa.ok() && sb.ok()) << sa << " " << sb;
    EXPECT_EQ(a.out(), b.out()) << "step " << step;
    EXPECT_EQ(b.out().size(), static_cast<size_t>(kAttendQHeads) * s.f.config.head_dim * 4);
    ASSERT_EQ(b.context_tokens_size(), 1);
    EXPECT_EQ(b.context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens + step + 1));
    EXPECT_EQ(a.context_tokens(0), b.context_tokens(0));
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  EXPECT_TRUE((*socket)->Finish().ok());
  EXPECT_EQ((*socket)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(AttendSocket, BadStepEndsOnlyItsOwnSessionAndAppendsNothing) {
  SocketFixture s = StartSocket(/*sequences=*/1);
  ASSERT_NE(s.f.server, nullptr);
  auto good = s.socket_client->OpenAttendStream();
  auto bad = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(good.ok() && bad.ok());
  ASSERT_TRUE((*good)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).ok());
  // A new token with a short query: refused before anything is appended.
  v1::AttendRequest wrong = AttendRequestFor(s.f, s.f.leases[0], 2);
  const std::vector<uint16_t> kv(s.f.config.num_kv_heads * s.f.config.head_dim, 0x3c00);
  wrong.mutable_items(0)->set_new_k(reinterpret_cast<const char*>(kv.data()), kv.size() * 2);
  wrong.mutable_items(0)->set_new_v(reinterpret_cast<const char*>(kv.data()), kv.size() * 2);
  wrong.mutable_items(0)->set_q("short");
  absl::StatusOr<v1::AttendResponse> r = (*bad)->Step(wrong);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ((*bad)->Step(AttendRequestFor(s.f, s.f.leases[0], 3)).status().code(),
            absl::StatusCode::kInvalidArgument);  // the session stays finished
  auto unknown = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ((*unknown)->Step(AttendRequestFor(s.f, s.f.leases[0] + 1000, 4)).status().code(),
            absl::StatusCode::kNotFound);
  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<v1::AttendResponse> g =
        (*good)->Step(AttendRequestFor(s.f, s.f.leases[0], 10 + step));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens));
  }
  EXPECT_TRUE((*good)->Finish().ok());
}

// A client that writes a whole frame over the limit (a batch too large for
// --max_message_bytes) finishes its write and reads RESOURCE_EXHAUSTED, rather than blocking
// until its deadline once the socket buffers fill.
TEST(AttendSocket, AClientWritingAFrameOverTheLimitReadsTheStatus) {
  SocketFixture s =
      StartSocket(/*sequences=*/0, [](AttendSocketOptions* o) { o->max_frame_bytes = 1 << 20; });
  ASSERT_NE(s.f.server, nullptr);
  const int fd = RawConnect(s.f.server->server->attend_socket_port());
  ASSERT_GE(fd, 0) << std::strerror(errno);
  FrameConnection conn(fd);                // which makes the socket non-blocking
  constexpr uint32_t kPayload = 64 << 20;  // far past what the socket buffers hold
  const std::string frame = RawFrameHeader(kMagic, 1, 0, kPayload) + std::string(kPayload, '\0');
  const absl::Time start = absl::Now();
  size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t n = send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    pollfd writable{fd, POLLOUT, 0};
    if (n < 0 && errno == EAGAIN && poll(&writable, 1, /*timeout_ms=*/10000) == 1) continue;
    break;
  }
  EXPECT_EQ(sent, frame.size()) << std::strerror(errno);
  std::string payload;
  absl::StatusOr<FrameConnection::Frame> status =
      conn.Read(&payload, 1 << 20, absl::Now() + absl::Seconds(10), absl::ZeroDuration());
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->type, FrameType::kStatus);
  EXPECT_EQ(attend_socket::StatusFromFrame(status->code, payload).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(AttendSocket, BadFramesGetAStatusAndTheServerGoesOn) {
  SocketFixture s =
      StartSocket(/*sequences=*/1, [](AttendSocketOptions* o) { o->max_frame_bytes = 1 << 20; });
  ASSERT_NE(s.f.server, nullptr);
  const int port = s.f.server->server->attend_socket_port();
  EXPECT_EQ(StatusAfterSending(port, RawFrameHeader(0x12345678, 1, 0, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StatusAfterSending(port, RawFrameHeader(kMagic, 9, 0, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StatusAfterSending(port, RawFrameHeader(kMagic, 1, 0, (1 << 20) + 1)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(StatusAfterSending(port, RawFrameHeader(kMagic, 2, 0, 0)).code(),
            absl::StatusCode::kInvalidArgument);  // a response frame from a client
  EXPECT_EQ(StatusAfterSending(port, RawFrameHeader(kMagic, 1, 0, 3) + "\xff\xff\xff").code(),
            absl::StatusCode::kInvalidArgument);  // not an AttendRequest
  // A client that leaves inside a frame, and one that connects and leaves.
  {
    const int fd = RawConnect(port);
    const std::string half = RawFrameHeader(kMagic, 1, 0, 100) + "abc";
    EXPECT_EQ(send(fd, half.data(), half.size(), MSG_NOSIGNAL), static_cast<ssize_t>(half.size()));
    FrameConnection closing(fd);
  }
  { FrameConnection closing(RawConnect(port)); }
  auto session = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(session.ok());
  EXPECT_TRUE((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 5)).ok());
  EXPECT_TRUE((*session)->Finish().ok());
  // Each refused session was counted before its client saw the status.
  EXPECT_EQ(MetricCount(s, "AttendSocket", "INVALID_ARGUMENT"), 4);
  EXPECT_EQ(MetricCount(s, "AttendSocket", "RESOURCE_EXHAUSTED"), 1);
  // Of those frames only the request that does not parse was a step; the response frame was not.
  EXPECT_EQ(MetricCount(s, "AttendSocket.step", "INVALID_ARGUMENT"), 1);
}

// A request of more items than --max_attend_batch gets RESOURCE_EXHAUSTED from their count on the
// wire, before any item is built (the first does not parse).
TEST(AttendSocket, ItemsOverTheBatchLimitAreRefusedBeforeParsing) {
  SocketFixture s = StartSocket(/*sequences=*/0);
  ASSERT_NE(s.f.server, nullptr);
  const std::string wire = UnparsedItemsBytes(100000);
  const absl::Status status = StatusAfterSending(
      s.f.server->server->attend_socket_port(),
      RawFrameHeader(kMagic, static_cast<uint16_t>(FrameType::kRequest), 0, wire.size()) + wire);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
}

TEST(AttendSocket, ConnectionsBeyondTheLimitAreRefused) {
  SocketFixture s =
      StartSocket(/*sequences=*/1, [](AttendSocketOptions* o) { o->max_connections = 1; });
  ASSERT_NE(s.f.server, nullptr);
  auto first = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).ok());
  auto second = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(second.ok());  // the connection is accepted, then refused with a status
  absl::StatusOr<v1::AttendResponse> refused =
      (*second)->Step(AttendRequestFor(s.f, s.f.leases[0], 2));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("max_connections"), absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(MetricCount(s, "AttendSocket", "RESOURCE_EXHAUSTED"), 1);
  EXPECT_TRUE((*first)->Step(AttendRequestFor(s.f, s.f.leases[0], 3)).ok());
  EXPECT_TRUE((*first)->Finish().ok());
  // Once the first session's thread has seen its close, its slot is free again.
  absl::Status third = absl::UnknownError("not tried");
  for (int i = 0; i < 500 && !third.ok(); ++i) {
    auto session = s.socket_client->OpenAttendStream();
    ASSERT_TRUE(session.ok());
    third = (*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 4)).status();
    if (!third.ok()) absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_TRUE(third.ok()) << third;
}

int OpenDescriptors() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += fcntl(fd, F_GETFD) != -1 ? 1 : 0;
  return n;
}

// An ended session's descriptor is closed when it ends, not when the next connection comes.
TEST(AttendSocket, AnEndedSessionClosesItsDescriptor) {
  SocketFixture s = StartSocket(/*sequences=*/1);
  ASSERT_NE(s.f.server, nullptr);
  const int before = OpenDescriptors();
  for (int i = 0; i < 3; ++i) {
    auto session = s.socket_client->OpenAttendStream();
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], i)).ok());
    EXPECT_TRUE((*session)->Finish().ok());
  }
  for (int i = 0; i < 1000 && MetricCount(s, "AttendSocket", "OK") < 3; ++i) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(MetricCount(s, "AttendSocket", "OK"), 3);
  int open = OpenDescriptors();
  for (int i = 0; i < 500 && open > before; ++i) {
    absl::SleepFor(absl::Milliseconds(2));
    open = OpenDescriptors();
  }
  EXPECT_EQ(open, before);
}

TEST(AttendSocket, IdleSessionIsClosedWithDeadlineExceeded) {
  SocketFixture s = StartSocket(
      /*sequences=*/1, [](AttendSocketOptions* o) { o->idle_timeout = absl::Milliseconds(50); });
  ASSERT_NE(s.f.server, nullptr);
  auto session = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 2)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// A step after the session's deadline is not sent, with or without the client's spin: the
// session ends with DEADLINE_EXCEEDED and the step's token is not appended.
TEST(AttendSocket, StepPastTheSessionDeadlineIsNotSent) {
  for (const absl::Duration client_spin : {absl::Microseconds(500), absl::ZeroDuration()}) {
    SocketFixture s = StartSocket(/*sequences=*/1, {}, client_spin);
    ASSERT_NE(s.f.server, nullptr);
    auto session = s.socket_client->OpenAttendStream({.deadline = absl::Seconds(1)});
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE((*session)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).ok());
    absl::SleepFor(absl::Milliseconds(1200));
    EXPECT_EQ((*session)->Step(AppendingRequest(s.f, s.f.leases[0], 0)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
    v1::AttendRequest check = AttendRequestFor(s.f, s.f.leases[0], 2);
    check.set_layer(0);
    absl::StatusOr<v1::AttendResponse> r = s.f.client->Attend(check);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens));
  }
}

// A graceful shutdown takes no new connection, lets an open session (and a gRPC AttendStream) go
// on stepping, with every response saying the server drains, and returns as soon as the last
// session ends, well within its grace.
TEST(AttendSocket, ShutdownDrainsOpenSessions) {
  SocketFixture s = StartSocket(/*sequences=*/1);
  ASSERT_NE(s.f.server, nullptr);
  auto open = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(open.ok());
  // Over TCP: the fixture's in-process channel closes when the server begins to shut down.
  std::unique_ptr<client::KvPoolClient> grpc_client =
      client::KvPoolClient::Create("127.0.0.1:" + std::to_string(s.f.server->server->port()));
  auto stream = grpc_client->OpenAttendStream();
  ASSERT_TRUE(stream.ok());
  for (client::AttendSession* session : {open->get(), stream->get()}) {
    absl::StatusOr<v1::AttendResponse> r = session->Step(AttendRequestFor(s.f, s.f.leases[0], 1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->server_draining());
  }
  std::thread shutdown([&] { s.f.server->server->Shutdown(absl::Seconds(20)); });
  // Once the listener is closed a new session cannot start.
  absl::Status refused;
  for (int i = 0; i < 1000 && refused.ok(); ++i) {
    auto late = s.socket_client->OpenAttendStream();
    refused =
        late.ok() ? (*late)->Step(AttendRequestFor(s.f, s.f.leases[0], 2)).status() : late.status();
    if (refused.ok()) absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  for (int step = 0; step < 5; ++step) {
    for (client::AttendSession* session : {open->get(), stream->get()}) {
      absl::StatusOr<v1::AttendResponse> r =
          session->Step(AttendRequestFor(s.f, s.f.leases[0], 10 + step));
      ASSERT_TRUE(r.ok()) << "step " << step << " while draining: " << r.status();
      EXPECT_TRUE(r->server_draining()) << "step " << step;
    }
  }
  EXPECT_TRUE((*open)->Finish().ok());
  EXPECT_TRUE((*stream)->Finish().ok());
  const absl::Time stepped_last = absl::Now();
  shutdown.join();
  EXPECT_LT(absl::Now() - stepped_last, absl::Seconds(5));
}

// A session still open when the grace ends is cut then, and counted CANCELLED (not as a client
// that closed its session).
TEST(AttendSocket, ShutdownCutsSessionsOpenPastTheGrace) {
  SocketFixture s = StartSocket(/*sequences=*/1);
  ASSERT_NE(s.f.server, nullptr);
  auto open = s.socket_client->OpenAttendStream();
  ASSERT_TRUE(open.ok());
  ASSERT_TRUE((*open)->Step(AttendRequestFor(s.f, s.f.leases[0], 1)).ok());
  const absl::Time start = absl::Now();
  s.f.server->server->Shutdown(absl::Milliseconds(300));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE((*open)->Step(AttendRequestFor(s.f, s.f.leases[0], 2)).ok());
  EXPECT_EQ(MetricCount(s, "AttendSocket", "CANCELLED"), 1);
  EXPECT_EQ(MetricCount(s, "AttendSocket", "OK"), 0);
}

TEST(AttendSocket, ShutdownEndsOpenSessionsWithoutHanging) {
  SocketFixture s = StartSocket(/*sequences=*/2);
  ASSERT_NE(s.f.server, nullptr);
  std::vector<std::unique_ptr<client::AttendSession>> sessions;
  for (uint64_t lease : s.f.leases) {
    auto session = s.socket_client->OpenAttendStream();
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->Step(AttendRequestFor(s.f, lease, 7)).ok());
    sessions.push_back(*std::move(session));
  }
  auto idle = s.socket_client->OpenAttendStream();  // connected, never stepped
  ASSERT_TRUE(idle.ok());
  s.f.server->server->Shutdown(absl::ZeroDuration());
  for (size_t i = 0; i < sessions.size(); ++i) {
    EXPECT_FALSE(sessions[i]->Step(AttendRequestFor(s.f, s.f.leases[i], 8)).ok());
  }
  EXPECT_FALSE((*idle)->Step(AttendRequestFor(s.f, s.f.leases[0], 9)).ok());
}

// A frame several times the reader's growth step and the socket buffers, written and read on two
// threads: the payload arrives whole and unchanged.
TEST(AttendSocket, LargeFramesArriveWhole) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  FrameConnection writer(fds[0]), reader(fds[1]);
  v1::AttendRequest big;
  std::string q(5 << 20, '\0');
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<char>(i * 131 % 251);
  big.add_items()->set_q(q);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::thread send(
      [&] { EXPECT_TRUE(writer.WriteMessage(FrameType::kRequest, big, deadline).ok()); });
  std::string payload;
  absl::StatusOr<FrameConnection::Frame> frame =
      reader.Read(&payload, 8 << 20, deadline, absl::ZeroDuration());
  send.join();
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->type, FrameType::kRequest);
  v1::AttendRequest got;
  ASSERT_TRUE(got.ParseFromString(payload));
  EXPECT_EQ(got.items(0).q(), q);
}

TEST(AttendSocket, SessionTargetsAndRefusals) {
  EXPECT_EQ(*client::AttendSocketAddress("localhost:50051", 7), "localhost:7");
  EXPECT_EQ(*client::AttendSocketAddress("dns:///pool-0.kvpool:50051", 7), "pool-0.kvpool:7");
  EXPECT_EQ(*client::AttendSocketAddress("ipv4:10.0.0.2:1", 7), "10.0.0.2:7");
  EXPECT_EQ(*client::AttendSocketAddress("ipv6:[::1]:1", 7), "[::1]:7");
  for (const char* bad :
       {"unix:/tmp/kvpool.sock", "localhost", "ipv4:1.2.3.4:1,5.6.7.8:1", ":50051", "::1:50051"}) {
    EXPECT_EQ(client::AttendSocketAddress(bad, 7).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  client::ClientOptions options;
  options.attend_socket_port = 7;
  options.credentials = grpc::SslCredentials(grpc::SslCredentialsOptions());
  EXPECT_EQ(
      client::KvPoolClient::Create("localhost:50051", options)->OpenAttendStream().status().code(),
      absl::StatusCode::kFailedPrecondition);
  // Nothing listens on a port the kernel just handed out and took back.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  EXPECT_EQ(
      client::OpenAttendSocketSession("127.0.0.1:" + std::to_string(ntohs(a.sin_port)),
                                      absl::Now() + absl::Seconds(5), absl::ZeroDuration(), 1 << 20)
          .status()
          .code(),
      absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvpool::testing
