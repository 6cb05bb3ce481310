// The AttendSocket wire format: AttendStream's messages (kvpool.proto) over a plain TCP or Unix
// stream socket, for decode loops that cannot afford gRPC's hand-offs between threads on every
// message. Server and client share this one implementation so both ends agree byte for byte.
//
// A connection carries frames, each a 16-byte header then `length` payload bytes:
//   bytes 0-3    magic "KVA1"
//   bytes 4-5    type, little-endian (FrameType): 1 request (a serialized AttendRequest),
//                2 response (a serialized AttendResponse), 3 status (a UTF-8 message),
//                4 attach, 5 region, 6 region request (attend_region.h)
//   bytes 6-7    status frames: the gRPC status code (never 0); 0 otherwise
//   bytes 8-11   payload length, little-endian
//   bytes 12-15  zero
// The client sends a request and reads its response before the next request, in order, like an
// AttendStream step. The server answers a failed step, a bad frame or a refused connection with a
// status frame and closes the connection (after refusing a frame from its header, one over the
// size limit or not of this format, it first reads and drops what the client still sends, for up
// to 10 s, so that the client's write completes and it reads the status); the client closing the
// connection ends the session.
// Over a Unix socket a client may also attach a shared-memory region and run region requests,
// whose bulk bytes stay in the region (attend_region.h).
#ifndef KVPOOL_PROTO_KVPOOL_V1_ATTEND_SOCKET_H_
#define KVPOOL_PROTO_KVPOOL_V1_ATTEND_SOCKET_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"

namespace kvpool::attend_socket {

enum class FrameType : uint16_t {
  kRequest = 1,
  kResponse = 2,
  kStatus = 3,
  kAttach = 4,         // client: an 8-byte little-endian region size (attend_region.h)
  kRegion = 5,         // server: the region's size as in kAttach, its memfd passed with the frame
  kRegionRequest = 6,  // client: an AttendRequest whose bulk bytes are in the region
};
inline constexpr size_t kHeaderBytes = 16;
inline constexpr uint32_t kMagic = 0x3141564b;  // "KVA1" read as a little-endian word

// One connected TCP (non-blocking, TCP_NODELAY) or Unix stream socket, closed on destruction.
// Reads and writes whole frames; Shutdown may be called from another thread to end a blocked Read
// or Write.
class FrameConnection {
 public:
  // Takes ownership of `fd`.
  explicit FrameConnection(int fd);
  ~FrameConnection();
  FrameConnection(const FrameConnection&) = delete;
  FrameConnection& operator=(const FrameConnection&) = delete;

  struct Frame {
    FrameType type;
    int code;  // status frames only
  };
  // Reads the next frame's payload into `payload` (its capacity is reused). Polls without
  // sleeping for `spin`, or until `deadline` when that is sooner (a response or the next step
  // then lands without a thread wake-up), then blocks until `deadline`. Errors: OUT_OF_RANGE when
  // the peer closed between frames, UNAVAILABLE when it closed inside one or the socket failed,
  // DEADLINE_EXCEEDED, INVALID_ARGUMENT for a header that is not this format's, RESOURCE_EXHAUSTED
  // for a payload over `max_payload` (nothing of it is read). A descriptor passed with the frame
  // (Unix sockets) is kept for TakeReceivedFd. `spin_ended` runs once when the spin is over and
  // the read is about to block, if it does.
  absl::StatusOr<Frame> Read(
      std::string* payload, uint32_t max_payload, absl::Time deadline, absl::Duration spin,
      absl::FunctionRef<void()> spin_ended = [] {});
  // Writes `message` as a frame of `type` (kRequest, kResponse or kRegionRequest).
  absl::Status WriteMessage(FrameType type, const google::protobuf::MessageLite& message,
                            absl::Time deadline);
  // Writes a frame of `type` with `payload`; `pass_fd` >= 0 (Unix sockets only) travels with it
  // as SCM_RIGHTS (the caller keeps its own descriptor).
  absl::Status WriteBytes(FrameType type, absl::string_view payload, int pass_fd,
                          absl::Time deadline);
  // The last descriptor a Read received (the caller owns it), or -1.
  int TakeReceivedFd();
  // Whether the socket is a Unix one (the peer runs on this host).
  bool is_unix() const { return is_unix_; }
  // Writes a status frame carrying `status` (not OK).
  absl::Status WriteStatus(const absl::Status& status, absl::Time deadline);
  // Ends the writing side, then reads and drops what the peer still sends until it closes the
  // connection, sends nothing for `quiet`, or `deadline` (checked as bytes arrive too): a peer
  // still writing a frame that was refused from its header (one over the size limit) then
  // completes its write and reads the status frame.
  void DiscardInput(absl::Duration quiet, absl::Time deadline);
  // shutdown(2) on both directions: a Read or Write in another thread returns at once.
  void Shutdown();

 private:
  absl::Status WriteFrame(absl::Time deadline, int pass_fd = -1);  // sends out_
  std::string out_;                                                // the frame being written
  const int fd_;
  bool is_unix_ = false;
  int received_fd_ = -1;
};

// The status a status frame carries.
absl::Status StatusFromFrame(int code, absl::string_view message);

// Listens on "HOST:PORT" (port 0 picks a free one; HOST may be "[::]" or "0.0.0.0") or on
// "unix:PATH" (a socket file at PATH that no server listens on is replaced; UNAVAILABLE when one
// does, or when PATH is another kind of file): a blocking listening socket, whose port is stored
// in `*port` (0 for a Unix socket).
absl::StatusOr<int> Listen(const std::string& address, int* port);
// Connects to "HOST:PORT" or "unix:PATH" before `deadline`; the FrameConnection of the connected
// socket.
absl::StatusOr<std::unique_ptr<FrameConnection>> Connect(const std::string& address,
                                                         absl::Time deadline);

}  // namespace kvpool::attend_socket

#endif  // KVPOOL_PROTO_KVPOOL_V1_ATTEND_SOCKET_H_
