#include "kvpool/v1/attend_socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvpool::attend_socket {
namespace {

constexpr size_t kReadChunkBytes = size_t{1} << 20;

void PutU16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t GetU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}

// Starts `out` with the header of a frame of `payload` bytes.
void StartFrame(std::string* out, FrameType type, int code, size_t payload) {
  out->resize(kHeaderBytes + payload);
  auto* h = reinterpret_cast<uint8_t*>(out->data());
  PutU32(h, kMagic);
  PutU16(h + 4, static_cast<uint16_t>(type));
  PutU16(h + 6, static_cast<uint16_t>(code));
  PutU32(h + 8, static_cast<uint32_t>(payload));
  PutU32(h + 12, 0);
}

// poll(2) for `events` until `deadline`; false when it passed first.
absl::StatusOr<bool> WaitFor(int fd, short events, absl::Time deadline) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      // Clamped: a timeout past INT_MAX ms would turn negative, which poll(2) takes as forever.
      timeout_ms = static_cast<int>(std::min<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), INT_MAX));
    }
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, timeout_ms);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("AttendSocket poll: ", std::strerror(errno)));
    }
  }
}

absl::Status SocketError(const char* what) {
  return absl::UnavailableError(absl::StrCat("AttendSocket ", what, ": ", std::strerror(errno)));
}

// "HOST:PORT" with HOST possibly in brackets.
absl::Status SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  int number = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &number) ||
      number < 0 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("AttendSocket address must be HOST:PORT, not \"", address, "\""));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = address.substr(colon + 1);
  return absl::OkStatus();
}

// getaddrinfo for TCP; the caller frees the list.
absl::StatusOr<addrinfo*> Resolve(const std::string& address, bool passive) {
  std::string host, port;
  if (absl::Status s = SplitHostPort(address, &host, &port); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* list = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &list);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("AttendSocket cannot resolve ", address, ": ", gai_strerror(rc)));
  }
  return list;
}

constexpr absl::string_view kUnixScheme = "unix:";

// The sockaddr of "unix:PATH".
absl::StatusOr<sockaddr_un> UnixAddress(absl::string_view address) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const absl::string_view path = address.substr(kUnixScheme.size());
  if (path.empty() || path.size() >= sizeof(a.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("AttendSocket Unix path must have 1 to ",
                                                   sizeof(a.sun_path) - 1, " characters: \"",
                                                   address, "\""));
  }
  std::memcpy(a.sun_path, path.data(), path.size());
  return a;
}

// recv(2) that keeps a descriptor passed with the bytes (SCM_RIGHTS) in `*received`, closing
// any it held and any beyond the first of a message.
ssize_t RecvKeepingFd(int fd, uint8_t* dst, size_t n, int* received) {
  iovec iov{dst, n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t r = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r <= 0) return r;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int passed;
      std::memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (i == 0) {
        if (*received >= 0) close(*received);
        *received = passed;
      } else {
        close(passed);
      }
    }
  }
  return r;
}

}  // namespace

FrameConnection::FrameConnection(int fd) : fd_(fd) {
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  is_unix_ = getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
             local.ss_family == AF_UNIX;
  if (!is_unix_) {
    const int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
}

FrameConnection::~FrameConnection() {
  if (received_fd_ >= 0) close(received_fd_);
  close(fd_);
}

int FrameConnection::TakeReceivedFd() {
  const int fd = received_fd_;
  received_fd_ = -1;
  return fd;
}

void FrameConnection::DiscardInput(absl::Duration quiet, absl::Time deadline) {
  shutdown(fd_, SHUT_WR);
  char dropped[64 << 10];
  while (absl::Now() < deadline) {
    // Descriptors passed along (Unix sockets) are closed by the kernel, as recv takes none.
    const ssize_t r = recv(fd_, dropped, sizeof(dropped), MSG_DONTWAIT);
    if (r > 0) continue;
    if (r == 0) return;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return;
    absl::StatusOr<bool> ready = WaitFor(fd_, POLLIN, std::min(deadline, absl::Now() + quiet));
    if (!ready.ok() || !*ready) return;
  }
}

void FrameConnection::Shutdown() { shutdown(fd_, SHUT_RDWR); }

absl::StatusOr<FrameConnection::Frame> FrameConnection::Read(std::string* payload,
                                                             uint32_t max_payload,
                                                             absl::Time deadline,
                                                             absl::Duration spin,
                                                             absl::FunctionRef<void()> spin_ended) {
  using Clock = std::chrono::steady_clock;
  // The spin ends by the deadline too.
  const Clock::time_point spin_end =
      Clock::now() + absl::ToChronoNanoseconds(
                         std::max(absl::ZeroDuration(), std::min(spin, deadline - absl::Now())));
  uint8_t header[kHeaderBytes];
  // Fills [dst, dst + n): spinning on recv until spin_end, then polling until the deadline.
  size_t total = 0;  // bytes of this frame read so far
  bool blocked = false;
  auto fill = [&](uint8_t* dst, size_t n) -> absl::Status {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = is_unix_ ? RecvKeepingFd(fd_, dst + got, n - got, &received_fd_)
                                 : recv(fd_, dst + got, n - got, MSG_DONTWAIT);
      if (r > 0) {
        got += static_cast<size_t>(r);
        total += static_cast<size_t>(r);
        continue;
      }
      if (r == 0) {
        return total == 0 ? absl::OutOfRangeError("AttendSocket closed by the peer")
                          : absl::UnavailableError("AttendSocket closed inside a frame");
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return SocketError("recv");
      if (Clock::now() < spin_end) continue;
      if (!blocked) spin_ended();
      blocked = true;
      absl::StatusOr<bool> ready = WaitFor(fd_, POLLIN, deadline);
      if (!ready.ok()) return ready.status();
      if (!*ready) return absl::DeadlineExceededError("AttendSocket read deadline");
    }
    return absl::OkStatus();
  };
  if (absl::Status s = fill(header, kHeaderBytes); !s.ok()) return s;
  const uint16_t type = GetU16(header + 4);
  const uint16_t code = GetU16(header + 6);
  const uint32_t length = GetU32(header + 8);
  if (GetU32(header) != kMagic || GetU32(header + 12) != 0 ||
      type < static_cast<uint16_t>(FrameType::kRequest) ||
      type > static_cast<uint16_t>(FrameType::kRegionRequest) ||
      (type == static_cast<uint16_t>(FrameType::kStatus)) != (code != 0)) {
    return absl::InvalidArgumentError("AttendSocket: not a frame header (magic, type or code)");
  }
  if (length > max_payload) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "AttendSocket frame of ", length, " payload bytes over the limit of ", max_payload));
  }
  // The buffer grows with the bytes that arrive, not with what the header announces: a peer
  // that announces a large frame and sends little holds little memory.
  payload->clear();
  while (payload->size() < length) {
    const size_t at = payload->size();
    payload->resize(std::min<size_t>(length, at + kReadChunkBytes));
    if (absl::Status s =
            fill(reinterpret_cast<uint8_t*>(payload->data()) + at, payload->size() - at);
        !s.ok()) {
      return s;
    }
  }
  return Frame{static_cast<FrameType>(type), code};
}

absl::Status FrameConnection::WriteMessage(FrameType type,
                                           const google::protobuf::MessageLite& message,
                                           absl::Time deadline) {
  const size_t size = message.ByteSizeLong();
  if (size > UINT32_MAX) return absl::ResourceExhaustedError("AttendSocket message over 4 GiB");
  StartFrame(&out_, type, 0, size);
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out_.data()) + kHeaderBytes);
  return WriteFrame(deadline);
}

absl::Status FrameConnection::WriteStatus(const absl::Status& status, absl::Time deadline) {
  const absl::string_view message = status.message();
  StartFrame(&out_, FrameType::kStatus, static_cast<int>(status.code()), message.size());
  std::memcpy(out_.data() + kHeaderBytes, message.data(), message.size());
  return WriteFrame(deadline);
}

absl::Status FrameConnection::WriteBytes(FrameType type, absl::string_view payload, int pass_fd,
                                         absl::Time deadline) {
  if (pass_fd >= 0 && !is_unix_) {
    return absl::FailedPreconditionError("AttendSocket passes descriptors over Unix sockets only");
  }
  StartFrame(&out_, type, 0, payload.size());
  std::memcpy(out_.data() + kHeaderBytes, payload.data(), payload.size());
  return WriteFrame(deadline, pass_fd);
}

absl::Status FrameConnection::WriteFrame(absl::Time deadline, int pass_fd) {
  size_t sent = 0;
  while (sent < out_.size()) {
    ssize_t r;
    if (pass_fd >= 0) {  // with the frame's first bytes
      iovec iov{out_.data() + sent, out_.size() - sent};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
      r = sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (r >= 0) pass_fd = -1;
    } else {
      r = send(fd_, out_.data() + sent, out_.size() - sent, MSG_NOSIGNAL);
    }
    if (r >= 0) {
      sent += static_cast<size_t>(r);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return SocketError("send");
    absl::StatusOr<bool> ready = WaitFor(fd_, POLLOUT, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("AttendSocket write deadline");
  }
  return absl::OkStatus();
}

absl::Status StatusFromFrame(int code, absl::string_view message) {
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

absl::StatusOr<int> Listen(const std::string& address, int* port) {
  if (absl::StartsWith(address, kUnixScheme)) {
    absl::StatusOr<sockaddr_un> a = UnixAddress(address);
    if (!a.ok()) return a.status();
    // A socket file nobody listens on (its server died) is replaced; one that takes connections
    // belongs to a live server and is left alone.
    struct stat st;
    if (lstat(a->sun_path, &st) == 0 && S_ISSOCK(st.st_mode)) {
      const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (probe < 0) return SocketError("socket");
      const bool live = connect(probe, reinterpret_cast<const sockaddr*>(&*a), sizeof(*a)) == 0;
      close(probe);
      if (live) {
        return absl::UnavailableError(
            absl::StrCat("AttendSocket cannot listen on ", address, ": a server listens there"));
      }
      unlink(a->sun_path);
    }
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return SocketError("socket");
    // Connecting takes write permission on the file: the server's user and group get it (a
    // decode worker of another user joins the group), whatever the umask left.
    if (bind(fd, reinterpret_cast<const sockaddr*>(&*a), sizeof(*a)) != 0 ||
        chmod(a->sun_path, 0660) != 0 || listen(fd, SOMAXCONN) != 0) {
      const absl::Status error = absl::UnavailableError(
          absl::StrCat("AttendSocket cannot listen on ", address, ": ", std::strerror(errno)));
      close(fd);
      return error;
    }
    *port = 0;
    return fd;
  }
  absl::StatusOr<addrinfo*> list = Resolve(address, /*passive=*/true);
  if (!list.ok()) return list.status();
  absl::Status last =
      absl::UnavailableError(absl::StrCat("AttendSocket: no address for ", address));
  int fd = -1;
  for (addrinfo* a = *list; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last = SocketError("socket");
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
      last = absl::UnavailableError(
          absl::StrCat("AttendSocket cannot listen on ", address, ": ", std::strerror(errno)));
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(*list);
  if (fd < 0) return last;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return fd;
}

absl::StatusOr<std::unique_ptr<FrameConnection>> Connect(const std::string& address,
                                                         absl::Time deadline) {
  if (absl::StartsWith(address, kUnixScheme)) {
    absl::StatusOr<sockaddr_un> a = UnixAddress(address);
    if (!a.ok()) return a.status();
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return SocketError("socket");
    auto conn = std::make_unique<FrameConnection>(fd);
    // A Unix connect completes or fails at once (EAGAIN: the backlog is full).
    if (connect(fd, reinterpret_cast<const sockaddr*>(&*a), sizeof(*a)) != 0) {
      return absl::UnavailableError(
          absl::StrCat("AttendSocket cannot connect to ", address, ": ", std::strerror(errno)));
    }
    return conn;
  }
  absl::StatusOr<addrinfo*> list = Resolve(address, /*passive=*/false);
  if (!list.ok()) return list.status();
  absl::Status last =
      absl::UnavailableError(absl::StrCat("AttendSocket: no address for ", address));
  std::unique_ptr<FrameConnection> conn;
  for (addrinfo* a = *list; a != nullptr && conn == nullptr; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last = SocketError("socket");
      continue;
    }
    auto candidate = std::make_unique<FrameConnection>(fd);
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = absl::UnavailableError(
            absl::StrCat("AttendSocket cannot connect to ", address, ": ", std::strerror(errno)));
        continue;
      }
      absl::StatusOr<bool> ready = WaitFor(fd, POLLOUT, deadline);
      if (!ready.ok() || !*ready) {
        last = ready.ok() ? absl::DeadlineExceededError(
                                absl::StrCat("AttendSocket connect to ", address, " timed out"))
                          : ready.status();
        continue;
      }
      int error = 0;
      socklen_t len = sizeof(error);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error != 0) {
        last = absl::UnavailableError(
            absl::StrCat("AttendSocket cannot connect to ", address, ": ", std::strerror(error)));
        continue;
      }
    }
    conn = std::move(candidate);
  }
  freeaddrinfo(*list);
  if (conn == nullptr) return last;
  return conn;
}

}  // namespace kvpool::attend_socket
