#include "client/attend_socket_session.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvpool/v1/attend_socket.h"

namespace kvpool::client {
namespace {

using attend_socket::FrameConnection;
using attend_socket::FrameType;

class SocketAttendSession final : public AttendSession {
 public:
  SocketAttendSession(std::unique_ptr<FrameConnection> conn, absl::Time deadline,
                      absl::Duration spin, uint32_t max_response_bytes)
      : conn_(std::move(conn)),
        deadline_(deadline),
        spin_(spin),
        max_response_bytes_(max_response_bytes) {}

  absl::StatusOr<v1::AttendResponse> Step(const v1::AttendRequest& request) override {
    if (finished_) {
      return final_status_.ok() ? absl::FailedPreconditionError("session finished") : final_status_;
    }
    // A server that refused or ended the session has sent a status frame before closing: it is
    // read even when the write fails.
    const absl::Status written = conn_->WriteMessage(FrameType::kRequest, request, deadline_);
    absl::StatusOr<FrameConnection::Frame> frame =
        conn_->Read(&payload_, max_response_bytes_, written.ok() ? deadline_ : absl::Now(),
                    written.ok() ? spin_ : absl::ZeroDuration());
    v1::AttendResponse response;
    if (!frame.ok()) {
      End(absl::IsOutOfRange(frame.status())
              ? absl::UnavailableError("AttendSocket closed by the server")
              : (written.ok() ? frame.status() : written));
    } else if (frame->type == FrameType::kStatus) {
      End(attend_socket::StatusFromFrame(frame->code, payload_));
    } else if (frame->type != FrameType::kResponse || !response.ParseFromString(payload_)) {
      End(absl::InternalError("AttendSocket: the server's answer is not an AttendResponse"));
    } else {
      return response;
    }
    return final_status_;
  }

  absl::Status Finish() override {
    if (!finished_) End(absl::OkStatus());
    return final_status_;
  }

 private:
  // Finishes the session with `status` and closes the connection.
  void End(absl::Status status) {
    finished_ = true;
    final_status_ = std::move(status);
    conn_.reset();
  }

  std::unique_ptr<FrameConnection> conn_;
  const absl::Time deadline_;
  const absl::Duration spin_;
  const uint32_t max_response_bytes_;
  std::string payload_;
  bool finished_ = false;
  absl::Status final_status_;
};

}  // namespace

absl::StatusOr<std::string> AttendSocketAddress(const std::string& target, int port) {
  absl::string_view rest = target;
  for (absl::string_view scheme : {"dns:///", "ipv4:", "ipv6:"}) absl::ConsumePrefix(&rest, scheme);
  const size_t colon = rest.rfind(':');
  const absl::string_view host = rest.substr(0, colon);
  int target_port = 0;
  if (colon == absl::string_view::npos || host.empty() ||
      !absl::SimpleAtoi(rest.substr(colon + 1), &target_port) || absl::StrContains(host, "/") ||
      absl::StrContains(host, ",") || (host.front() != '[' && absl::StrContains(host, ":"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attend_socket_port needs a host:port target to find the server's host, not \"", target,
        "\""));
  }
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttendSocketSession(
    const std::string& address, absl::Time deadline, absl::Duration spin,
    uint32_t max_response_bytes) {
  absl::StatusOr<std::unique_ptr<FrameConnection>> conn = attend_socket::Connect(address, deadline);
  if (!conn.ok()) return conn.status();
  return std::make_unique<SocketAttendSession>(*std::move(conn), deadline, spin,
                                               max_response_bytes);
}

}  // namespace kvpool::client
