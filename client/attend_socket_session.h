// AttendSessions over the AttendSocket format (proto/kvpool/v1/attend_socket.h): the steps of a
// decode loop over a plain TCP connection to the server's --attend_socket_port, or over its Unix
// socket (--attend_unix_socket) with a shared-memory region, no gRPC. Used by
// KvPoolClient::OpenAttendStream when ClientOptions::attend_unix_socket or attend_socket_port is
// set.
#ifndef KVPOOL_CLIENT_ATTEND_SOCKET_SESSION_H_
#define KVPOOL_CLIENT_ATTEND_SOCKET_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool_client.h"  // by file name: installed as kvpool/kvpool_client.h

namespace kvpool::client {

// The "HOST:PORT" of `port` on the host of a gRPC target ("host:port", "dns:///host:port",
// "ipv4:host:port", "ipv6:[host]:port"); INVALID_ARGUMENT for other targets (unix sockets).
absl::StatusOr<std::string> AttendSocketAddress(const std::string& target, int port);

// Connects to `address` ("HOST:PORT"). `deadline` covers the whole session; each Step polls for
// its response without sleeping for `spin`, then blocks; responses over `max_response_bytes` fail
// the session with RESOURCE_EXHAUSTED.
absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttendSocketSession(const std::string& address,
                                                                       absl::Time deadline,
                                                                       absl::Duration spin,
                                                                       uint32_t max_response_bytes);

// Connects to the Unix socket at `path` and attaches a shared-memory region of `region_bytes`
// (kvpool/v1/attend_region.h): each Step copies the request's q, new_k and new_v into it and the
// output out of it, and sends only the rest over the socket. A step the region cannot hold fails
// the session with INVALID_ARGUMENT. Otherwise as OpenAttendSocketSession.
absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttendRegionSession(const std::string& path,
                                                                       uint64_t region_bytes,
                                                                       absl::Time deadline,
                                                                       absl::Duration spin,
                                                                       uint32_t max_response_bytes);

// An AttendSocket region session whose caller writes each step's arrays into the region itself
// and reads the output there, at the offsets attend_socket::LayoutRegionStep gives
// (kvpool/v1/attend_region.h): e.g. by DMA from and to its own GPU after registering region()
// with its CUDA context. The session copies nothing.
class InPlaceAttendSession {
 public:
  virtual ~InPlaceAttendSession() = default;
  virtual uint8_t* region() const = 0;
  virtual uint64_t region_bytes() const = 0;
  // Runs a step whose items carry no q, new_k or new_v (append_in_region marks an append), their
  // bytes being in the region already, laid out as the request's region_q_bytes and
  // region_kv_bytes say (attend_socket::RegionStepLayout); the output is in the region when it
  // returns (the response's `out` is empty). After an error the session is finished, as for
  // AttendSession::Step.
  virtual absl::StatusOr<v1::AttendResponse> StepInPlace(const v1::AttendRequest& request) = 0;
  // Closes the session and returns its final status.
  virtual absl::Status Finish() = 0;
};

// OpenAttendRegionSession for callers that fill and read the region themselves.
absl::StatusOr<std::unique_ptr<InPlaceAttendSession>> OpenInPlaceAttendSession(
    const std::string& path, uint64_t region_bytes, absl::Time deadline, absl::Duration spin,
    uint32_t max_response_bytes);

}  // namespace kvpool::client

#endif  // KVPOOL_CLIENT_ATTEND_SOCKET_SESSION_H_
