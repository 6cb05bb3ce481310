#include "client/attend_socket_session.h"

#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvpool/v1/attend_region.h"
#include "kvpool/v1/attend_socket.h"

namespace kvpool::client {
namespace {

using attend_socket::FrameConnection;
using attend_socket::FrameType;

// An AttendSocket session. Without a region each Step sends the request as it is; with one
// (kvpool/v1/attend_region.h) it copies the request's bulk bytes into the region, sends the rest,
// and copies the response's output back out of the region.
class SocketAttendSession final : public AttendSession, public InPlaceAttendSession {
 public:
  SocketAttendSession(std::unique_ptr<FrameConnection> conn,
                      std::unique_ptr<attend_socket::SharedRegion> region, absl::Time deadline,
                      absl::Duration spin, uint32_t max_response_bytes)
      : conn_(std::move(conn)),
        region_(std::move(region)),
        deadline_(deadline),
        spin_(spin),
        max_response_bytes_(max_response_bytes) {}

  using AttendSession::Step;
  absl::Status Step(const v1::AttendRequest& request, v1::AttendResponse* response) override {
    if (region_ == nullptr) return Exchange(FrameType::kRequest, request, response);
    if (finished_) return Finished();
    absl::StatusOr<size_t> out_bytes = Stage(request);
    if (!out_bytes.ok()) {
      End(out_bytes.status());
      return final_status_;
    }
    absl::Status s = Exchange(FrameType::kRegionRequest, sent_, response);
    if (s.ok()) {
      response->set_out(reinterpret_cast<const char*>(region_->data() + layout_.out), *out_bytes);
    }
    return s;
  }

  // Only region sessions are handed out as InPlaceAttendSession: region_ is set here.
  uint8_t* region() const override { return region_->data(); }
  uint64_t region_bytes() const override { return region_->size(); }

  absl::StatusOr<v1::AttendResponse> StepInPlace(const v1::AttendRequest& request) override {
    v1::AttendResponse response;  // only region sessions are in place
    if (absl::Status s = Exchange(FrameType::kRegionRequest, request, &response); !s.ok()) {
      return s;
    }
    return response;
  }

  absl::Status Finish() override {
    if (!finished_) End(absl::OkStatus());
    return final_status_;
  }

 private:
  absl::Status Finished() const {
    return final_status_.ok() ? absl::FailedPreconditionError("session finished") : final_status_;
  }

  // Sends `message` as a frame of `type` and reads the response into `*response`.
  absl::Status Exchange(FrameType type, const google::protobuf::MessageLite& message,
                        v1::AttendResponse* response) {
    if (finished_) return Finished();
    // Past the session's deadline nothing more is sent (the server would still run the step).
    if (absl::Now() >= deadline_) {
      End(absl::DeadlineExceededError("AttendSocket session deadline"));
      return final_status_;
    }
    // A server that refused or ended the session has sent a status frame before closing: it is
    // read even when the write fails.
    const absl::Status written = conn_->WriteMessage(type, message, deadline_);
    absl::StatusOr<FrameConnection::Frame> frame =
        conn_->Read(&payload_, max_response_bytes_, written.ok() ? deadline_ : absl::Now(),
                    written.ok() ? spin_ : absl::ZeroDuration());
    if (!frame.ok()) {
      End(absl::IsOutOfRange(frame.status())
              ? absl::UnavailableError("AttendSocket closed by the server")
              : (written.ok() ? frame.status() : written));
    } else if (frame->type == FrameType::kStatus) {
      End(attend_socket::StatusFromFrame(frame->code, payload_));
    } else if (frame->type != FrameType::kResponse || !response->ParseFromString(payload_)) {
      End(absl::InternalError("AttendSocket: the server's answer is not an AttendResponse"));
    } else {
      return absl::OkStatus();
    }
    return final_status_;
  }

  // Copies `request`'s q, new_k and new_v into the region, sets layout_ and sent_ (the request
  // without them), and returns the output's size; INVALID_ARGUMENT for items of unequal sizes
  // or a step the region cannot hold.
  absl::StatusOr<size_t> Stage(const v1::AttendRequest& request) {
    const int n = request.items_size();
    if (n == 0) return absl::InvalidArgumentError("Attend needs at least one item");
    const size_t q_bytes = request.items(0).q().size();
    size_t kv_bytes = 0;
    int appending = 0;
    for (const v1::AttendItem& item : request.items()) {
      if (item.q().size() != q_bytes || item.new_k().size() != item.new_v().size() ||
          (!item.new_k().empty() && kv_bytes != 0 && item.new_k().size() != kv_bytes)) {
        return absl::InvalidArgumentError(
            "AttendSocket region steps need equal q sizes and equal new_k / new_v sizes");
      }
      if (!item.new_k().empty()) {
        kv_bytes = item.new_k().size();
        ++appending;
      }
    }
    const size_t out_item_bytes =
        q_bytes / 2 * (request.output_dtype() == v1::OUTPUT_DTYPE_FP32 ? 4 : 2);
    const std::optional<attend_socket::RegionStepLayout> layout =
        attend_socket::LayoutRegionStep(n, appending, q_bytes, kv_bytes, out_item_bytes);
    if (!layout.has_value() || layout->end > region_->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("AttendSocket step of ", n, " items does not fit the ", region_->size(),
                       "-byte region (ClientOptions::attend_region_bytes)"));
    }
    layout_ = *layout;
    sent_.Clear();
    sent_.set_layer(request.layer());
    sent_.set_num_q_heads(request.num_q_heads());
    sent_.set_sm_scale(request.sm_scale());
    sent_.set_output_dtype(request.output_dtype());
    sent_.set_return_lse(request.return_lse());
    sent_.set_region_q_bytes(layout_.q_bytes);
    sent_.set_region_kv_bytes(layout_.kv_bytes);
    uint8_t* const base = region_->data();
    size_t appended = 0;
    for (int i = 0; i < n; ++i) {
      const v1::AttendItem& in = request.items(i);
      std::memcpy(base + layout_.q + i * q_bytes, in.q().data(), q_bytes);
      v1::AttendItem* item = sent_.add_items();
      item->set_lease_id(in.lease_id());
      item->set_new_token_id(in.new_token_id());
      if (in.new_k().empty()) continue;
      std::memcpy(base + layout_.new_k + appended * kv_bytes, in.new_k().data(), kv_bytes);
      std::memcpy(base + layout_.new_v + appended * kv_bytes, in.new_v().data(), kv_bytes);
      item->set_append_in_region(true);
      ++appended;
    }
    return n * out_item_bytes;
  }

  // Finishes the session with `status` and closes the connection.
  void End(absl::Status status) {
    finished_ = true;
    final_status_ = std::move(status);
    conn_.reset();  // the region stays mapped: an in-place caller may still hold its address
  }

  std::unique_ptr<FrameConnection> conn_;
  // Null: plain requests. Kept mapped until the session is destroyed, also after End: an in-place
  // caller may still hold its address.
  std::unique_ptr<attend_socket::SharedRegion> region_;
  const absl::Time deadline_;
  const absl::Duration spin_;
  const uint32_t max_response_bytes_;
  attend_socket::RegionStepLayout layout_;  // of the last region step
  v1::AttendRequest sent_;                  // the last region step's request as sent
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
  return std::make_unique<SocketAttendSession>(*std::move(conn), nullptr, deadline, spin,
                                               max_response_bytes);
}

namespace {

// A session over the Unix socket at `path` with a region of `region_bytes` attached.
absl::StatusOr<std::unique_ptr<SocketAttendSession>> OpenRegion(const std::string& path,
                                                                uint64_t region_bytes,
                                                                absl::Time deadline,
                                                                absl::Duration spin,
                                                                uint32_t max_response_bytes) {
  absl::StatusOr<std::unique_ptr<FrameConnection>> conn =
      attend_socket::Connect(absl::StrCat("unix:", path), deadline);
  if (!conn.ok()) return conn.status();
  absl::StatusOr<std::unique_ptr<attend_socket::SharedRegion>> region =
      attend_socket::AttachRegion(**conn, region_bytes, deadline);
  if (!region.ok()) return region.status();
  return std::make_unique<SocketAttendSession>(*std::move(conn), *std::move(region), deadline, spin,
                                               max_response_bytes);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttendRegionSession(
    const std::string& path, uint64_t region_bytes, absl::Time deadline, absl::Duration spin,
    uint32_t max_response_bytes) {
  absl::StatusOr<std::unique_ptr<SocketAttendSession>> session =
      OpenRegion(path, region_bytes, deadline, spin, max_response_bytes);
  if (!session.ok()) return session.status();
  return std::unique_ptr<AttendSession>(*std::move(session));
}

absl::StatusOr<std::unique_ptr<InPlaceAttendSession>> OpenInPlaceAttendSession(
    const std::string& path, uint64_t region_bytes, absl::Time deadline, absl::Duration spin,
    uint32_t max_response_bytes) {
  absl::StatusOr<std::unique_ptr<SocketAttendSession>> session =
      OpenRegion(path, region_bytes, deadline, spin, max_response_bytes);
  if (!session.ok()) return session.status();
  return std::unique_ptr<InPlaceAttendSession>(*std::move(session));
}

}  // namespace kvpool::client
