// RequestFuzzer's AttendSocket sessions: raw frames (kvpool/v1/attend_socket.h) over the TCP
// listener on loopback or the Unix one, with shared-memory regions (kvpool/v1/attend_region.h).
//
// Allowed answers (attend_socket.h, attend_region.h, README "API in brief"): a step (request or
// region request) gets a response frame or a status frame with an Attend code
// (request_fuzzer_attend.cc); every other frame the fuzzer sends here is wrong and gets a status
// frame: INVALID_ARGUMENT for a header that is not the format's, a payload that does not parse or
// an attach payload of the wrong length; RESOURCE_EXHAUSTED for a payload over the frame limit or
// a region over its limits; FAILED_PRECONDITION for a region over TCP, a second attach, or a
// region request without a region; DEADLINE_EXCEEDED for a frame that never completes (the idle
// timeout). The server closes the connection after any status frame.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvpool/v1/attend_region.h"
#include "kvpool/v1/attend_socket.h"
#include "tests/fuzz/request_fuzzer.h"
#include "tests/integration/attend_socket_raw.h"

namespace kvpool::testing {

using attend_socket::FrameConnection;
using attend_socket::FrameType;
using attend_socket::kMagic;
using grpc::StatusCode;

struct RequestFuzzer::SocketSession {
  bool is_unix = false;
  int fd = -1;  // owned by `conn`; written directly for frames FrameConnection never writes
  std::unique_ptr<FrameConnection> conn;
  std::unique_ptr<attend_socket::SharedRegion> region;
  // No later than the start of the server's idle timer: when the client began sending the last
  // frame the server answered (or connected).
  absl::Time idle_since;
};

// A frame sent and the answer it may get.
struct RequestFuzzer::SentFrame {
  std::string what;  // the kind of frame, for counts and messages
  std::string detail;
  bool is_step = false;  // a request or region request, checked as an Attend
  bool region_step = false;
  AttendPlan plan;                    // is_step
  std::set<StatusCode> status_codes;  // !is_step: the status frame's code must be one of these
  // The client waited long enough before sending for the server to close the session as idle:
  // DEADLINE_EXCEEDED is then an answer too.
  bool after_idle = false;
  bool written = true;  // false: the write failed
  absl::Time sending;   // when the client began making and sending it
};

namespace {

constexpr absl::Duration kFrameTimeout = absl::Seconds(20);
constexpr uint32_t kMaxAnswerBytes = 64 << 20;

const std::set<StatusCode> kBadFrameCodes = {
    StatusCode::INVALID_ARGUMENT, StatusCode::RESOURCE_EXHAUSTED, StatusCode::FAILED_PRECONDITION};

StatusCode CodeOf(const absl::Status& s) {
  return static_cast<StatusCode>(s.code());  // absl and gRPC number their codes alike
}

bool SendRaw(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

}  // namespace

void RequestFuzzer::Socket() {
  SocketSession session;
  session.is_unix = Chance(0.6);
  session.fd = RawConnect(target_.server->server->attend_socket_port(),
                          session.is_unix ? target_.unix_socket_path : "");
  if (session.fd < 0) {
    Fail(absl::StrCat("AttendSocket connect: ", std::strerror(errno)));
    return;
  }
  session.conn = std::make_unique<FrameConnection>(session.fd);
  session.idle_since = absl::Now();
  if (session.is_unix && Chance(0.5)) {  // a region for the region steps
    const uint64_t bytes = std::min<uint64_t>(uint64_t{4096} << Below(9), target_.max_region_bytes);
    auto region = attend_socket::AttachRegion(*session.conn, bytes, absl::Now() + kFrameTimeout);
    if (!region.ok()) {  // other sessions' regions fill the total
      CheckCode("AttendSocket attach", CodeOf(region.status()), {StatusCode::RESOURCE_EXHAUSTED},
                region.status().ToString());
      return;
    }
    session.region = *std::move(region);
  }
  const uint64_t frames = 1 + Below(5);
  for (uint64_t i = 0; i < frames; ++i) {
    if (!SendRandomFrame(session)) return;
  }
}

bool RequestFuzzer::MayBeClosedAsIdle(const SocketSession& session) const {
  // Half the timeout: a margin for the client's own pauses.
  return absl::Now() - session.idle_since > target_.socket_idle_timeout / 2;
}

bool RequestFuzzer::SendRandomFrame(SocketSession& session) {
  const uint64_t kind = session.region != nullptr && Chance(0.6) ? 8 : Below(10);
  const absl::Time sending = absl::Now();
  SentFrame sent;
  if (kind <= 3) {
    sent = SendStep(session);
  } else if (kind == 4) {
    sent = SendMalformedHeader(session);
  } else if (kind == 5) {
    sent = SendIncompleteFrame(session);
  } else if (kind <= 7) {
    return Attach(session);
  } else {
    sent = SendRegionStep(session);
  }
  sent.sending = sending;
  // Measured once the frame is written: making a large step takes a while.
  sent.after_idle = MayBeClosedAsIdle(session);
  if (!sent.written) {
    if (!sent.after_idle) Fail("AttendSocket: a write failed on a live session");
    return false;
  }
  return CheckAnswer(session, sent);
}

RequestFuzzer::SentFrame RequestFuzzer::SendStep(SocketSession& session) {
  SentFrame sent;
  sent.what = "step";
  sent.is_step = true;
  sent.plan = MakeAttendPlan(false);
  sent.written =
      session.conn
          ->WriteMessage(FrameType::kRequest, sent.plan.request, absl::Now() + kFrameTimeout)
          .ok();
  return sent;
}

// A region request: the plan's q, new K and new V written into the region at RegionStepLayout's
// offsets when the step fits; sometimes with region_q_bytes or region_kv_bytes not the
// namespace's. Without a region (TCP, or none attached), FAILED_PRECONDITION.
RequestFuzzer::SentFrame RequestFuzzer::SendRegionStep(SocketSession& session) {
  SentFrame sent;
  sent.what = "region step";
  sent.is_step = true;
  sent.region_step = true;
  sent.plan = MakeAttendPlan(true);
  v1::AttendRequest& req = sent.plan.request;
  const FuzzLease* first = req.items_size() > 0 ? FindLease(req.items(0).lease_id()) : nullptr;
  const NamespaceGeometry* g = Geometry(first != nullptr ? first->ns : "");
  const uint64_t q_bytes = uint64_t{req.num_q_heads()} * g->head_dim * 2;
  const uint64_t kv_bytes = uint64_t{g->kv_heads} * g->head_dim * 2;
  req.set_region_q_bytes(BadChance(0.1) ? q_bytes + 2 : q_bytes);
  req.set_region_kv_bytes(BadChance(0.1) ? EdgeU32() : kv_bytes);
  uint64_t appending = 0;
  for (const v1::AttendItem& item : req.items()) appending += item.append_in_region() ? 1 : 0;
  const uint64_t out_bytes = uint64_t{req.num_q_heads()} * g->head_dim *
                             (req.output_dtype() == v1::OUTPUT_DTYPE_FP32 ? 4 : 2);
  const std::optional<attend_socket::RegionStepLayout> layout =
      attend_socket::LayoutRegionStep(req.items_size(), appending, q_bytes, kv_bytes, out_bytes);
  if (session.region != nullptr && layout.has_value() && layout->end <= session.region->size()) {
    uint8_t* region = session.region->data();
    const std::string q = RandomHalves(req.items_size() * q_bytes / 2);
    const std::string k = RandomHalves(appending * kv_bytes / 2);
    const std::string v = RandomHalves(appending * kv_bytes / 2);
    std::memcpy(region + layout->q, q.data(), q.size());
    std::memcpy(region + layout->new_k, k.data(), k.size());
    std::memcpy(region + layout->new_v, v.data(), v.size());
  }
  sent.written =
      session.conn->WriteMessage(FrameType::kRegionRequest, req, absl::Now() + kFrameTimeout).ok();
  return sent;
}

// A header that is not the format's: bad magic, an unknown or client-illegal type, a status code
// or reserved bytes set, a length past the frame limit, or a payload that does not parse.
RequestFuzzer::SentFrame RequestFuzzer::SendMalformedHeader(SocketSession& session) {
  const uint16_t odd_type = Chance(0.5) ? static_cast<uint16_t>(Below(10)) : 0xffff;
  const std::string frames[] = {
      RawFrameHeader(0x12345678, 1, 0, 0),
      RawFrameHeader(kMagic, odd_type, 0, 0),  // as type 1: a request with no items
      RawFrameHeader(kMagic, 1, 13, 0),
      RawFrameHeader(kMagic, 1, 0, 0, 7),
      RawFrameHeader(kMagic, 1, 0, 0xffffffffu),
      RawFrameHeader(kMagic, 1, 0, 20) + std::string(20, '\xff'),
      RawFrameHeader(kMagic, 1, 0, 3) + "\x08\x01\x10",  // cut inside a field
  };
  const std::string& frame = frames[Below(std::size(frames))];
  SentFrame sent;
  sent.written = SendRaw(session.fd, frame);
  sent.what = "bad header";
  sent.detail = absl::StrCat(frame.size(), " bytes");
  sent.status_codes = kBadFrameCodes;
  return sent;
}

// Part of a header, or a header and part of its payload, then nothing: the idle timeout ends it.
RequestFuzzer::SentFrame RequestFuzzer::SendIncompleteFrame(SocketSession& session) {
  std::string frame = RawFrameHeader(kMagic, 1, 0, 100) + "abc";
  if (Chance(0.5)) frame.resize(Below(attend_socket::kHeaderBytes));
  SentFrame sent;
  sent.written = frame.empty() || SendRaw(session.fd, frame);
  sent.what = "incomplete frame";
  sent.detail = absl::StrCat(frame.size(), " bytes");
  sent.status_codes = {StatusCode::DEADLINE_EXCEEDED};
  return sent;
}

bool RequestFuzzer::Attach(SocketSession& session) {
  const uint64_t max = target_.max_region_bytes;
  const uint64_t sizes[] = {0, 1, 4096, 64 << 10, max, max + 1, ~uint64_t{0}, uint64_t{1} << 40};
  const uint64_t bytes = sizes[Below(std::size(sizes))];
  const absl::Time deadline = absl::Now() + kFrameTimeout;
  // Only a session's first attach, on the Unix socket, of (0, max] bytes gets a region, unless
  // other sessions' regions fill the total.
  const bool may_attach = session.is_unix && session.region == nullptr && bytes > 0 && bytes <= max;
  if (Chance(0.8)) {
    const absl::Time sending = absl::Now();
    auto region = attend_socket::AttachRegion(*session.conn, bytes, deadline);
    const bool after_idle = MayBeClosedAsIdle(session);
    if (region.ok()) {
      if (!may_attach) Fail(absl::StrCat("AttendSocket attached a region of ", bytes, " bytes"));
      session.region = *std::move(region);
      session.idle_since = sending;
      return true;
    }
    std::set<StatusCode> allowed =
        may_attach ? std::set<StatusCode>{StatusCode::RESOURCE_EXHAUSTED} : kBadFrameCodes;
    if (after_idle) {  // the status of the idle close, or a write to the closed socket
      allowed.insert({StatusCode::DEADLINE_EXCEEDED, StatusCode::UNAVAILABLE});
    }
    CheckCode("AttendSocket attach", CodeOf(region.status()), allowed,
              absl::StrCat(bytes, " bytes: ", region.status().ToString()));
    ExpectClosed(session);
    return false;
  }
  std::string payload = attend_socket::EncodeRegionSize(bytes);
  const size_t wrong_lengths[] = {0, 1, 7, 9, 11};
  payload.resize(wrong_lengths[Below(std::size(wrong_lengths))]);
  const bool written = session.conn->WriteBytes(FrameType::kAttach, payload, -1, deadline).ok();
  SentFrame sent;
  sent.after_idle = MayBeClosedAsIdle(session);
  if (!written) {
    if (!sent.after_idle) Fail("AttendSocket: a write failed on a live session");
    return false;
  }
  sent.what = "attach payload";
  sent.detail = absl::StrCat(payload.size(), " bytes");
  sent.status_codes = kBadFrameCodes;
  return CheckAnswer(session, sent);
}

bool RequestFuzzer::CheckAnswer(SocketSession& session, const SentFrame& sent) {
  const std::string rpc = "AttendSocket " + sent.what;
  std::string payload;
  const absl::StatusOr<FrameConnection::Frame> frame = session.conn->Read(
      &payload, kMaxAnswerBytes, absl::Now() + kFrameTimeout, absl::ZeroDuration());
  if (!frame.ok()) {
    if (!sent.after_idle) {
      Fail(absl::StrCat(rpc, " (", sent.detail, "): no answer: ", frame.status().ToString()));
    }
    return false;
  }
  if (frame->type == FrameType::kStatus) {
    const auto code = static_cast<StatusCode>(frame->code);
    if (code == StatusCode::DEADLINE_EXCEEDED && sent.after_idle) {
      CheckCode(rpc, code, {code}, "closed as idle");
    } else if (sent.is_step) {
      CheckAttend(rpc, sent.plan, code, payload, nullptr, sent.region_step);
    } else {
      CheckCode(rpc, code, sent.status_codes, sent.detail + ": " + payload);
    }
    ExpectClosed(session);
    return false;
  }
  if (!sent.is_step || frame->type != FrameType::kResponse) {
    Fail(absl::StrCat(rpc, " (", sent.detail, ") answered by a frame of type ",
                      static_cast<int>(frame->type)));
    return false;
  }
  v1::AttendResponse response;
  if (!response.ParseFromString(payload)) {
    Fail(rpc + ": the response does not parse");
    return false;
  }
  CheckAttend(rpc, sent.plan, StatusCode::OK, "", &response, sent.region_step);
  session.idle_since = sent.sending;
  return true;
}

void RequestFuzzer::ExpectClosed(SocketSession& session) {
  std::string payload;
  const absl::Status st =
      session.conn->Read(&payload, 1 << 20, absl::Now() + absl::Seconds(5), absl::ZeroDuration())
          .status();
  if (st.code() != absl::StatusCode::kOutOfRange && st.code() != absl::StatusCode::kUnavailable) {
    Fail("AttendSocket: the connection stayed open after a status frame: " + st.ToString());
  }
}

}  // namespace kvpool::testing
