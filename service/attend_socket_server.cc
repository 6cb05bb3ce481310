#include "service/attend_socket_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "service/attend_runner.h"

namespace kvpool {

using attend_socket::FrameConnection;
using attend_socket::FrameType;

absl::StatusOr<std::unique_ptr<AttendSocketServer>> AttendSocketServer::Start(
    KvStore* store, RpcMetrics* metrics, const AttendSocketOptions& options) {
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError("AttendSocket max_connections must be at least 1");
  }
  std::unique_ptr<AttendSocketServer> s(new AttendSocketServer(store, metrics, options));
  absl::StatusOr<int> fd = attend_socket::Listen(options.address, &s->port_);
  if (!fd.ok()) return fd.status();
  s->listen_fd_ = *fd;
  s->acceptor_ = std::thread([raw = s.get()] { raw->Accept(); });
  return s;
}

AttendSocketServer::AttendSocketServer(KvStore* store, RpcMetrics* metrics,
                                       const AttendSocketOptions& options)
    : store_(store),
      metrics_{metrics->ForMethod("AttendSocket"), metrics->ForMethod("AttendSocket.step")},
      options_(options) {}

AttendSocketServer::~AttendSocketServer() { Shutdown(); }

void AttendSocketServer::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (Session& s : sessions_) s.conn->Shutdown();
  }
  // Wakes the acceptor's accept(2), which then returns an error.
  shutdown(listen_fd_, SHUT_RDWR);
  acceptor_.join();
  close(listen_fd_);
  absl::MutexLock l(&mu_);
  for (Session& s : sessions_) s.thread.join();
  sessions_.clear();
}

void AttendSocketServer::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    // Out of descriptors or memory: retrying at once would spin.
    if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    absl::MutexLock l(&mu_);
    if (stopping_) {
      if (fd >= 0) close(fd);
      return;
    }
    if (fd < 0) continue;  // as above, or the peer gave up before the accept
    auto conn = std::make_unique<FrameConnection>(fd);
    ReapLocked();
    if (sessions_.size() >= static_cast<size_t>(options_.max_connections)) {
      // Best effort: a full socket buffer just drops the status.
      conn->WriteStatus(absl::UnavailableError("AttendSocket: every session slot is taken "
                                               "(--attend_socket_max_connections)"),
                        absl::Now())
          .IgnoreError();
      metrics_.session.Finished(grpc::StatusCode::UNAVAILABLE, absl::ZeroDuration());
      continue;
    }
    Session& s = sessions_.emplace_back();
    s.conn = std::move(conn);
    s.thread = std::thread([this, &s] { Serve(&s); });
  }
}

void AttendSocketServer::ReapLocked() {
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->done.load(std::memory_order_acquire)) {
      it->thread.join();
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
}

void AttendSocketServer::Serve(Session* session) {
  FrameConnection& conn = *session->conn;
  const absl::Time start = absl::Now();
  AttendRunner runner(store_);
  v1::AttendRequest request;
  v1::AttendResponse response;
  std::string payload;
  absl::Status end;       // what ends the session: OK when the client closes it
  bool tell_peer = true;  // false once the socket itself has failed
  for (;;) {
    const bool spin = spinning_.fetch_add(1, std::memory_order_relaxed) < options_.max_spinning;
    if (!spin) spinning_.fetch_sub(1, std::memory_order_relaxed);
    absl::StatusOr<FrameConnection::Frame> frame =
        conn.Read(&payload, options_.max_frame_bytes, absl::Now() + options_.idle_timeout,
                  spin ? options_.spin : absl::ZeroDuration());
    if (spin) spinning_.fetch_sub(1, std::memory_order_relaxed);
    if (!frame.ok()) {
      if (!absl::IsOutOfRange(frame.status())) end = frame.status();
      tell_peer = !absl::IsUnavailable(end);
      break;
    }
    const absl::Time begin = absl::Now();
    metrics_.session.Received(attend_socket::kHeaderBytes + payload.size());
    if (frame->type != FrameType::kRequest) {
      end = absl::InvalidArgumentError("AttendSocket: a client sends request frames only");
    } else if (!request.ParseFromString(payload)) {
      end = absl::InvalidArgumentError("AttendSocket: the request is not an AttendRequest");
    } else {
      end = runner.Run(request, &response);
    }
    if (!end.ok()) {
      metrics_.step.Finished(static_cast<grpc::StatusCode>(end.code()), absl::Now() - begin);
      break;
    }
    end = conn.WriteMessage(FrameType::kResponse, response, absl::Now() + options_.idle_timeout);
    metrics_.step.Finished(static_cast<grpc::StatusCode>(end.code()), absl::Now() - begin);
    if (!end.ok()) {
      tell_peer = false;
      break;
    }
    // The size WriteMessage computed, not walked again.
    metrics_.session.Sent(attend_socket::kHeaderBytes + response.GetCachedSize());
  }
  // Counted first: a client that has the status or sees the close also sees the session counted.
  metrics_.session.Finished(static_cast<grpc::StatusCode>(end.code()), absl::Now() - start);
  // The peer is told why, unless the socket itself failed.
  if (!end.ok() && tell_peer) {
    conn.WriteStatus(end, absl::Now() + absl::Seconds(1)).IgnoreError();
  }
  // The peer sees the close now; the descriptor itself is closed when the session is reaped, so
  // that Shutdown never acts on a number the kernel has handed out again.
  conn.Shutdown();
  session->done.store(true, std::memory_order_release);
}

}  // namespace kvpool
