// AttendSocket sessions with a shared-memory region (proto/kvpool/v1/attend_region.h) over the
// server's Unix socket, CPU backend: the same answers as AttendStream, appends and both output
// dtypes included; attaches beyond the limits, over TCP, twice or missing, and region steps that
// do not fit or carry bulk bytes in the message each get their status and change nothing; a
// session's region is given back when it ends.
#include "kvpool/v1/attend_region.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "client/attend_socket_session.h"
#include "client/kvpool_client.h"
#include "gtest/gtest.h"
#include "kvpool/v1/attend_socket.h"
#include "tests/integration/attend_fixture.h"

namespace kvpool::testing {
namespace {

using attend_socket::FrameConnection;
using attend_socket::FrameType;

struct RegionFixture {
  AttendFixture f;
  std::string path;  // the server's Unix socket
  std::unique_ptr<client::KvPoolClient> region_client;
};

std::string SocketPath() {
  static int counter = 0;
  return "/tmp/kvpool-region-test-" + std::to_string(getpid()) + "-" + std::to_string(++counter);
}

RegionFixture StartRegion(int sequences, uint64_t max_region = 1 << 20,
                          uint64_t total_region = 4 << 20) {
  RegionFixture r;
  r.path = SocketPath();
  r.f = StartAttendFixture(sequences, [&](ServerOptions* o) {
    o->grpc_address = "127.0.0.1:0";
    o->attend_socket.address = "127.0.0.1:0";
    o->attend_socket.unix_path = r.path;
    o->attend_socket.max_region_bytes = max_region;
    o->attend_socket.total_region_bytes = total_region;
  });
  if (r.f.server == nullptr) return r;
  client::ClientOptions options;
  options.attend_unix_socket = r.path;
  options.attend_region_bytes = 256 << 10;
  r.region_client = client::KvPoolClient::Create(
      "127.0.0.1:" + std::to_string(r.f.server->server->port()), options);
  return r;
}

// A raw connection to the Unix socket that has attached a region of `bytes`, or the status.
struct RawRegion {
  std::unique_ptr<FrameConnection> conn;
  std::unique_ptr<attend_socket::SharedRegion> region;
};
absl::StatusOr<RawRegion> AttachRaw(const std::string& address, uint64_t bytes) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<FrameConnection>> conn = attend_socket::Connect(address, deadline);
  if (!conn.ok()) return conn.status();
  absl::StatusOr<std::unique_ptr<attend_socket::SharedRegion>> region =
      attend_socket::AttachRegion(**conn, bytes, deadline);
  if (!region.ok()) return region.status();
  return RawRegion{*std::move(conn), *std::move(region)};
}

// Whether the server's pinned region memory drops to 0 within a second (a session's thread
// gives its region back once it has seen its client close).
bool RegionsReleased(const RegionFixture& r) {
  for (int i = 0; i < 500; ++i) {
    if (r.f.server->server->registry()->Serialize().find("kvpool_attend_region_bytes 0\n") !=
        std::string::npos) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  return false;
}

// Sends `request` as a frame of `type` and returns the status frame the server answers with.
absl::Status StatusOfFrame(FrameConnection& conn, FrameType type,
                           const v1::AttendRequest& request) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  if (absl::Status s = conn.WriteMessage(type, request, deadline); !s.ok()) return s;
  std::string payload;
  absl::StatusOr<FrameConnection::Frame> frame =
      conn.Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
  if (!frame.ok()) return frame.status();
  if (frame->type != FrameType::kStatus) return absl::OkStatus();
  return attend_socket::StatusFromFrame(frame->code, payload);
}

// Two leases on each of two prompts: a decode loop of two-item steps (the first item appends
// every step, the second every other step; fp32 with lse and fp16 outputs alternate) runs over
// AttendStream on one pair and over a region session on the other: equal answers.
TEST(AttendRegion, DecodeLoopMatchesAttendStream) {
  RegionFixture r = StartRegion(/*sequences=*/2);
  ASSERT_NE(r.f.server, nullptr);
  ASSERT_EQ(r.f.leases.size(), 2u);
  std::vector<uint64_t> second;
  for (int i = 0; i < 2; ++i) {
    const Sequence prompt = MakeSequence(r.f.config, kAttendPromptTokens, 1000 * (i + 1), 50 + i);
    absl::StatusOr<v1::MatchResponse> m = r.f.client->Match("small", prompt.tokens);
    ASSERT_TRUE(m.ok()) << m.status();
    second.push_back(m->lease_id());
  }
  auto stream = r.f.client->OpenAttendStream();
  auto region = r.region_client->OpenAttendStream();
  ASSERT_TRUE(stream.ok() && region.ok()) << stream.status() << " " << region.status();
  const int per_token = r.f.config.num_kv_heads * r.f.config.head_dim;
  // Each session steps into one message, reused: outputs of alternating sizes and lse present
  // every other step must not leave stale values behind.
  v1::AttendResponse a, b;
  for (int step = 0; step < 12; ++step) {
    v1::AttendRequest req = AttendRequestFor(r.f, r.f.leases[0], 7 + step);
    req.set_layer(0);
    req.add_items()->CopyFrom(AttendRequestFor(r.f, r.f.leases[1], 70 + step).items(0));
    req.set_output_dtype(step % 2 == 0 ? v1::OUTPUT_DTYPE_FP32 : v1::OUTPUT_DTYPE_FP16);
    req.set_return_lse(step % 2 == 0);
    for (int i = 0; i < 2; ++i) {
      if (i == 1 && step % 2 == 1) continue;
      const std::vector<uint16_t> k = ToHalf(MakeNormal(per_token, 900 + 10 * step + i));
      const std::vector<uint16_t> v = ToHalf(MakeNormal(per_token, 1900 + 10 * step + i));
      v1::AttendItem* item = req.mutable_items(i);
      item->set_new_k(reinterpret_cast<const char*>(k.data()), k.size() * 2);
      item->set_new_v(reinterpret_cast<const char*>(v.data()), v.size() * 2);
      item->set_new_token_id(5000 + step);
    }
    const absl::Status sa = (*stream)->Step(req, &a);
    for (int i = 0; i < 2; ++i) req.mutable_items(i)->set_lease_id(second[i]);
    const absl::Status sb = (*region)->Step(req, &b);
    ASSERT_TRUE(sa.ok() && sb.ok()) << sa << " " << sb;
    EXPECT_EQ(a.out(), b.out()) << "step " << step;
    EXPECT_EQ(b.out().size(), 2u * kAttendQHeads * r.f.config.head_dim * (step % 2 == 0 ? 4 : 2));
    EXPECT_EQ(b.lse_size(), step % 2 == 0 ? 2 * kAttendQHeads : 0);
    ASSERT_EQ(a.lse_size(), b.lse_size());
    for (int i = 0; i < a.lse_size(); ++i) EXPECT_EQ(a.lse(i), b.lse(i));
    ASSERT_EQ(b.context_tokens_size(), 2);
    EXPECT_EQ(b.context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens + step + 1));
    EXPECT_EQ(b.context_tokens(1), static_cast<uint32_t>(kAttendPromptTokens + step / 2 + 1));
    EXPECT_EQ(a.context_tokens(1), b.context_tokens(1));
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  EXPECT_TRUE((*region)->Finish().ok());
}

TEST(AttendRegion, AttachesOutsideTheRulesAreRefused) {
  RegionFixture r = StartRegion(/*sequences=*/1, /*max_region=*/1 << 20, /*total_region=*/1 << 20);
  ASSERT_NE(r.f.server, nullptr);
  const std::string unix_address = "unix:" + r.path;
  EXPECT_EQ(AttachRaw(unix_address, (1 << 20) + 1).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(AttachRaw(unix_address, 0).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string tcp_address =
      "127.0.0.1:" + std::to_string(r.f.server->server->attend_socket_port());
  EXPECT_EQ(AttachRaw(tcp_address, 4096).status().code(), absl::StatusCode::kFailedPrecondition);
  {
    absl::StatusOr<RawRegion> first = AttachRaw(unix_address, 1 << 20);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_NE(
        r.f.server->server->registry()->Serialize().find("kvpool_attend_region_bytes 1048576\n"),
        std::string::npos);
    // The total is taken: another session's attach is refused.
    EXPECT_EQ(AttachRaw(unix_address, 4096).status().code(), absl::StatusCode::kResourceExhausted);
    // A second attach in the same session ends it.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    ASSERT_TRUE(
        first->conn
            ->WriteBytes(FrameType::kAttach, attend_socket::EncodeRegionSize(4096), -1, deadline)
            .ok());
    std::string payload;
    absl::StatusOr<FrameConnection::Frame> frame =
        first->conn->Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
    ASSERT_TRUE(frame.ok()) << frame.status();
    EXPECT_EQ(attend_socket::StatusFromFrame(frame->code, payload).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  // The ended session's region is given back (its thread ends after the status): the total
  // fits a new one.
  absl::Status attached = absl::UnknownError("not tried");
  for (int i = 0; i < 500 && !attached.ok(); ++i) {
    attached = AttachRaw(unix_address, 1 << 20).status();
    if (!attached.ok()) absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_TRUE(attached.ok()) << attached;
  // That region goes with its session too, once the session's thread has seen the close.
  EXPECT_TRUE(RegionsReleased(r));
  // A region request without a region.
  absl::StatusOr<std::unique_ptr<FrameConnection>> bare =
      attend_socket::Connect(unix_address, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(bare.ok());
  v1::AttendRequest req = AttendRequestFor(r.f, r.f.leases[0], 1);
  req.mutable_items(0)->clear_q();
  EXPECT_EQ(StatusOfFrame(**bare, FrameType::kRegionRequest, req).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(AttendRegion, BadRegionStepsChangeNothing) {
  RegionFixture r = StartRegion(/*sequences=*/1);
  ASSERT_NE(r.f.server, nullptr);
  const std::string unix_address = "unix:" + r.path;
  const int per_token = r.f.config.num_kv_heads * r.f.config.head_dim;
  const size_t q_bytes = size_t{kAttendQHeads} * r.f.config.head_dim * 2;
  // A region request that still carries q in the message.
  {
    absl::StatusOr<RawRegion> raw = AttachRaw(unix_address, 64 << 10);
    ASSERT_TRUE(raw.ok()) << raw.status();
    EXPECT_EQ(StatusOfFrame(*raw->conn, FrameType::kRegionRequest,
                            AttendRequestFor(r.f, r.f.leases[0], 1))
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  // More items than the region holds.
  {
    absl::StatusOr<RawRegion> raw = AttachRaw(unix_address, 4096);
    ASSERT_TRUE(raw.ok()) << raw.status();
    v1::AttendRequest req = AttendRequestFor(r.f, r.f.leases[0], 1);
    req.mutable_items(0)->clear_q();
    req.set_region_q_bytes(q_bytes);
    for (size_t i = 1; i * q_bytes <= 4096; ++i) req.add_items()->CopyFrom(req.items(0));
    EXPECT_EQ(StatusOfFrame(*raw->conn, FrameType::kRegionRequest, req).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A NaN in the new K in the region: refused, nothing appended.
  {
    absl::StatusOr<RawRegion> raw = AttachRaw(unix_address, 64 << 10);
    ASSERT_TRUE(raw.ok()) << raw.status();
    v1::AttendRequest req = AttendRequestFor(r.f, r.f.leases[0], 1);
    const std::string q = req.items(0).q();
    req.mutable_items(0)->clear_q();
    req.mutable_items(0)->set_append_in_region(true);
    const std::optional<attend_socket::RegionStepLayout> layout =
        attend_socket::LayoutRegionStep(1, 1, q_bytes, per_token * 2, q_bytes * 2);
    ASSERT_TRUE(layout.has_value());
    uint8_t* base = raw->region->data();
    std::memcpy(base + layout->q, q.data(), q.size());
    std::vector<uint16_t> k = ToHalf(MakeNormal(per_token, 5));
    k[3] = 0x7e00;  // NaN
    const std::vector<uint16_t> v = ToHalf(MakeNormal(per_token, 6));
    std::memcpy(base + layout->new_k, k.data(), k.size() * 2);
    std::memcpy(base + layout->new_v, v.data(), v.size() * 2);
    req.set_region_q_bytes(layout->q_bytes);
    req.set_region_kv_bytes(layout->kv_bytes);
    EXPECT_EQ(StatusOfFrame(*raw->conn, FrameType::kRegionRequest, req).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // An appending step laid out with sizes other than the namespace's (q of half the heads, or
  // new K/V of one KV head; or no sizes at all): the server cannot see it in the region, so the
  // request says them; refused before anything is read, nothing appended.
  for (const auto& [region_q, region_kv] : std::vector<std::pair<size_t, size_t>>{
           {q_bytes / 2, size_t(per_token) * 2}, {q_bytes, size_t(per_token)}, {0, 0}}) {
    absl::StatusOr<RawRegion> raw = AttachRaw(unix_address, 64 << 10);
    ASSERT_TRUE(raw.ok()) << raw.status();
    v1::AttendRequest req = AttendRequestFor(r.f, r.f.leases[0], 1);
    req.mutable_items(0)->clear_q();
    req.mutable_items(0)->set_append_in_region(true);
    req.set_region_q_bytes(region_q);
    req.set_region_kv_bytes(region_kv);
    const absl::Status s = StatusOfFrame(*raw->conn, FrameType::kRegionRequest, req);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << region_q << " " << region_kv;
    EXPECT_NE(s.message().find("laid out with"), std::string::npos) << s;
  }
  // append_in_region outside a region request.
  auto session = r.region_client->OpenAttendStream();
  ASSERT_TRUE(session.ok());
  absl::StatusOr<v1::AttendResponse> fine =
      (*session)->Step(AttendRequestFor(r.f, r.f.leases[0], 2));
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(fine->context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens));
  v1::AttendRequest flagged = AttendRequestFor(r.f, r.f.leases[0], 3);
  flagged.mutable_items(0)->set_append_in_region(true);
  EXPECT_EQ(r.f.client->Attend(flagged).status().code(), absl::StatusCode::kInvalidArgument);
  // A step the client's region cannot hold fails the session before anything is sent.
  v1::AttendRequest big = AttendRequestFor(r.f, r.f.leases[0], 4);
  for (int i = 0; i < 200; ++i) big.add_items()->CopyFrom(big.items(0));
  EXPECT_EQ((*session)->Step(big).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<v1::AttendResponse> after =
      r.f.client->Attend(AttendRequestFor(r.f, r.f.leases[0], 5));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens));
}

// A caller that writes q into the region itself and reads the output there gets the unary
// Attend's answers.
TEST(AttendRegion, InPlaceStepsMatchUnaryAttend) {
  RegionFixture r = StartRegion(/*sequences=*/2);
  ASSERT_NE(r.f.server, nullptr);
  absl::StatusOr<std::unique_ptr<client::InPlaceAttendSession>> session =
      client::OpenInPlaceAttendSession(r.path, 256 << 10, absl::Now() + absl::Seconds(30),
                                       absl::ZeroDuration(), 1 << 20);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_EQ((*session)->region_bytes(), 256u << 10);
  for (int step = 0; step < 4; ++step) {
    v1::AttendRequest request = AttendRequestFor(r.f, r.f.leases[0], 30 + step);
    request.add_items()->CopyFrom(AttendRequestFor(r.f, r.f.leases[1], 40 + step).items(0));
    absl::StatusOr<v1::AttendResponse> want = r.f.client->Attend(request);
    ASSERT_TRUE(want.ok()) << want.status();
    const size_t q_bytes = request.items(0).q().size();
    const std::optional<attend_socket::RegionStepLayout> layout =
        attend_socket::LayoutRegionStep(2, 0, q_bytes, 0, 2 * q_bytes);  // fp32 output
    ASSERT_TRUE(layout.has_value());
    uint8_t* region = (*session)->region();
    for (int i = 0; i < 2; ++i) {
      std::memcpy(region + layout->q + i * q_bytes, request.items(i).q().data(), q_bytes);
      request.mutable_items(i)->clear_q();
    }
    request.set_region_q_bytes(layout->q_bytes);
    absl::StatusOr<v1::AttendResponse> got = (*session)->StepInPlace(request);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->out().empty());
    EXPECT_EQ(std::memcmp(region + layout->out, want->out().data(), want->out().size()), 0)
        << "step " << step;
    EXPECT_EQ(got->context_tokens(0), static_cast<uint32_t>(kAttendPromptTokens));
  }
  EXPECT_TRUE((*session)->Finish().ok());
}

// A socket file left behind by a server that died is replaced, one a live server listens on is
// not; a file that is not a socket is left alone and the listen fails; a path too long for a Unix
// address is refused.
TEST(AttendRegion, StaleSocketFilesAreReplacedAndOtherFilesAreNot) {
  int port = 0;
  const std::string path = SocketPath();
  absl::StatusOr<int> first = attend_socket::Listen("unix:" + path, &port);
  ASSERT_TRUE(first.ok()) << first.status();
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u) << "the server's user and group may connect, others not";
  EXPECT_EQ(attend_socket::Listen("unix:" + path, &port).status().code(),
            absl::StatusCode::kUnavailable);  // the first one still listens
  close(*first);                              // its file stays, stale
  ASSERT_EQ(access(path.c_str(), F_OK), 0);
  absl::StatusOr<int> again = attend_socket::Listen("unix:" + path, &port);
  EXPECT_TRUE(again.ok()) << again.status();
  if (again.ok()) close(*again);
  unlink(path.c_str());

  const std::string regular = SocketPath();
  FILE* file = std::fopen(regular.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs("not a socket", file);
  std::fclose(file);
  EXPECT_EQ(attend_socket::Listen("unix:" + regular, &port).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(access(regular.c_str(), F_OK), 0);
  unlink(regular.c_str());

  EXPECT_EQ(attend_socket::Listen("unix:/tmp/" + std::string(200, 'a'), &port).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// On the Unix socket: a bad header gets its status and ends only that session; a descriptor a
// client passes along with a request is not kept, and the step runs; a client that attaches and
// leaves gives its region back.
TEST(AttendRegion, UnixSessionsSurviveBadFramesPassedDescriptorsAndAbruptClients) {
  RegionFixture r = StartRegion(/*sequences=*/1);
  ASSERT_NE(r.f.server, nullptr);
  const std::string unix_address = "unix:" + r.path;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  {
    absl::StatusOr<std::unique_ptr<FrameConnection>> conn =
        attend_socket::Connect(unix_address, deadline);
    ASSERT_TRUE(conn.ok()) << conn.status();
    // A status frame sent by a client: not a request or attach frame.
    ASSERT_TRUE((*conn)->WriteStatus(absl::InternalError("from a client"), deadline).ok());
    std::string payload;
    absl::StatusOr<FrameConnection::Frame> frame =
        (*conn)->Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
    ASSERT_TRUE(frame.ok()) << frame.status();
    EXPECT_EQ(frame->type, FrameType::kStatus);
    EXPECT_EQ(attend_socket::StatusFromFrame(frame->code, payload).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    absl::StatusOr<std::unique_ptr<FrameConnection>> conn =
        attend_socket::Connect(unix_address, deadline);
    ASSERT_TRUE(conn.ok()) << conn.status();
    int pipe_fds[2];
    ASSERT_EQ(pipe(pipe_fds), 0);
    std::string request;
    ASSERT_TRUE(AttendRequestFor(r.f, r.f.leases[0], 1).SerializeToString(&request));
    ASSERT_TRUE((*conn)->WriteBytes(FrameType::kRequest, request, pipe_fds[0], deadline).ok());
    close(pipe_fds[0]);
    std::string payload;
    absl::StatusOr<FrameConnection::Frame> frame =
        (*conn)->Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
    ASSERT_TRUE(frame.ok()) << frame.status();
    EXPECT_EQ(frame->type, FrameType::kResponse);
    // The server closed its copy of the pipe's read end: the write end sees no reader.
    std::signal(SIGPIPE, SIG_IGN);
    bool closed = false;
    for (int i = 0; i < 500 && !closed; ++i) {
      closed = write(pipe_fds[1], "x", 1) < 0 && errno == EPIPE;
      if (!closed) absl::SleepFor(absl::Milliseconds(2));
    }
    EXPECT_TRUE(closed);
    close(pipe_fds[1]);
  }
  // Attached, then gone without a word.
  ASSERT_TRUE(AttachRaw(unix_address, 64 << 10).ok());
  EXPECT_TRUE(RegionsReleased(r));
  auto session = r.region_client->OpenAttendStream();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE((*session)->Step(AttendRequestFor(r.f, r.f.leases[0], 2)).ok());
}

TEST(AttendRegion, LayoutPlacesArraysOnCacheLinesAndRefusesOverflow) {
  const std::optional<attend_socket::RegionStepLayout> l =
      attend_socket::LayoutRegionStep(3, 2, 1000, 100, 2000);
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->q, 0u);
  EXPECT_EQ(l->new_k, 3008u);
  EXPECT_EQ(l->new_v, 3264u);
  EXPECT_EQ(l->out, 3520u);
  EXPECT_EQ(l->end, 3520u + 6000u);
  EXPECT_FALSE(
      attend_socket::LayoutRegionStep(uint64_t{1} << 40, 0, uint64_t{1} << 30, 0, 1).has_value());
  EXPECT_EQ(attend_socket::DecodeRegionSize(attend_socket::EncodeRegionSize(123456789)),
            std::optional<uint64_t>(123456789));
  EXPECT_FALSE(attend_socket::DecodeRegionSize("1234567").has_value());
}

TEST(AttendRegion, ARegionsPagesAreFreedWhenTheServerDropsItWhateverThePeerKeeps) {
  constexpr uint64_t kBytes = 4 << 20;
  absl::StatusOr<std::unique_ptr<attend_socket::SharedRegion>> region =
      attend_socket::SharedRegion::Create(kBytes);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memset((*region)->data(), 0x5a, kBytes);
  // The peer's descriptor and mapping, as a client that never closes them keeps them.
  const int kept = dup((*region)->fd());
  ASSERT_GE(kept, 0);
  absl::StatusOr<std::unique_ptr<attend_socket::SharedRegion>> peer =
      attend_socket::SharedRegion::Map(dup(kept), kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  struct stat st;
  ASSERT_EQ(fstat(kept, &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kBytes);
  region->reset();
  ASSERT_EQ(fstat(kept, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "the pages outlive the server's region";
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBytes);
  EXPECT_EQ((*peer)->data()[kBytes - 1], 0) << "the peer's mapping reads zeros, not a fault";
  close(kept);
}

}  // namespace
}  // namespace kvpool::testing
