#include "service/attend_socket_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvpool/v1/attend_region.h"
#include "service/attend_runner.h"

namespace kvpool {

using attend_socket::FrameConnection;
using attend_socket::FrameType;

// After refusing a frame from its header: how long a client may send nothing before the server
// stops reading what it still sends, and how long it reads at most, before it closes.
constexpr absl::Duration kDiscardQuiet = absl::Seconds(1);
constexpr absl::Duration kDiscardLimit = absl::Seconds(10);

class AttendSocketServer::PinnedRegion {
 public:
  PinnedRegion(std::unique_ptr<attend_socket::SharedRegion> region, ComputeBackend* backend,
               std::atomic<uint64_t>* counted)
      : region_(std::move(region)), backend_(backend), counted_(counted) {}
  ~PinnedRegion() {
    backend_->UnregisterHostMemory(region_->data());
    counted_->fetch_sub(region_->size(), std::memory_order_relaxed);
  }
  const attend_socket::SharedRegion& region() const { return *region_; }

 private:
  const std::unique_ptr<attend_socket::SharedRegion> region_;
  ComputeBackend* const backend_;
  std::atomic<uint64_t>* const counted_;
};

absl::StatusOr<std::unique_ptr<AttendSocketServer>> AttendSocketServer::Start(
    KvStore* store, ComputeBackend* backend, RpcMetrics* metrics,
    const AttendSocketOptions& options) {
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError("AttendSocket max_connections must be at least 1");
  }
  if (options.address.empty() && options.unix_path.empty()) {
    return absl::InvalidArgumentError("AttendSocket needs a TCP address or a Unix path");
  }
  std::unique_ptr<AttendSocketServer> s(new AttendSocketServer(store, backend, metrics, options));
  const std::string addresses[2] = {
      options.address, options.unix_path.empty() ? "" : absl::StrCat("unix:", options.unix_path)};
  for (int i = 0; i < 2; ++i) {
    if (addresses[i].empty()) continue;
    int port = 0;
    absl::StatusOr<int> fd = attend_socket::Listen(addresses[i], &port);
    if (!fd.ok()) return fd.status();  // the destructor closes a listener already open
    s->listen_fds_[i] = *fd;
    if (i == 0) s->port_ = port;
  }
  for (int i = 0; i < 2; ++i) {
    if (s->listen_fds_[i] >= 0) {
      s->acceptors_[i] = std::thread([raw = s.get(), fd = s->listen_fds_[i]] { raw->Accept(fd); });
    }
  }
  return s;
}

AttendSocketServer::AttendSocketServer(KvStore* store, ComputeBackend* backend, RpcMetrics* metrics,
                                       const AttendSocketOptions& options)
    : store_(store),
      backend_(backend),
      metrics_{metrics->ForMethod("AttendSocket"), metrics->ForMethod("AttendSocket.step")},
      options_(options) {}

AttendSocketServer::~AttendSocketServer() { Shutdown(); }

void AttendSocketServer::StopAccepting() {
  {
    absl::MutexLock l(&mu_);
    accepting_ = false;
  }
  std::call_once(close_listeners_, [this] {
    // Wakes each acceptor's accept(2), which then returns an error.
    for (int i = 0; i < 2; ++i) {
      if (listen_fds_[i] < 0) continue;
      shutdown(listen_fds_[i], SHUT_RDWR);
      if (acceptors_[i].joinable()) acceptors_[i].join();
      close(listen_fds_[i]);
    }
    if (listen_fds_[1] >= 0) unlink(options_.unix_path.c_str());
  });
}

bool AttendSocketServer::AllSessionsDone() const {
  for (const Session& s : sessions_) {
    if (!s.done.load(std::memory_order_acquire)) return false;
  }
  return true;
}

void AttendSocketServer::AwaitSessions(absl::Time deadline) {
  StopAccepting();
  absl::MutexLock l(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(this, &AttendSocketServer::AllSessionsDone), deadline);
}

void AttendSocketServer::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    accepting_ = false;
    for (Session& s : sessions_) {
      if (s.conn == nullptr) continue;  // ended
      s.cut.store(true, std::memory_order_release);
      s.conn->Shutdown();
    }
  }
  StopAccepting();
  // Joined without mu_, which each session takes as it ends.
  std::list<Session> ending;
  {
    absl::MutexLock l(&mu_);
    ending.swap(sessions_);
  }
  for (Session& s : ending) s.thread.join();
}

void AttendSocketServer::Accept(int listen_fd) {
  for (;;) {
    const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    // Out of descriptors or memory: retrying at once would spin.
    if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    absl::MutexLock l(&mu_);
    if (!accepting_) {
      if (fd >= 0) close(fd);
      return;
    }
    // Ended sessions' threads are joined here, on failed accepts too.
    ReapLocked();
    if (fd < 0) continue;  // as above, or the peer gave up before the accept
    auto conn = std::make_unique<FrameConnection>(fd);
    if (sessions_.size() >= static_cast<size_t>(options_.max_connections)) {
      Refuse(*conn, absl::ResourceExhaustedError(
                        "every session slot is taken (--attend_socket_max_connections)"));
      continue;
    }
    Session& s = sessions_.emplace_back();
    s.conn = std::move(conn);
    try {
      s.thread = std::thread([this, &s] { Serve(&s); });
    } catch (const std::system_error& e) {  // out of threads or memory: the server stays up
      conn = std::move(s.conn);
      sessions_.pop_back();
      Refuse(*conn,
             absl::UnavailableError(absl::StrCat("no thread for a session (", e.what(), ")")));
    }
  }
}

void AttendSocketServer::Refuse(FrameConnection& conn, const absl::Status& why) {
  // Counted first, as in Serve. Best effort: a full socket buffer just drops the status.
  metrics_.session.Finished(static_cast<grpc::StatusCode>(why.code()), absl::ZeroDuration());
  conn.WriteStatus(absl::Status(why.code(), absl::StrCat("AttendSocket: ", why.message())),
                   absl::Now())
      .IgnoreError();
}

absl::StatusOr<std::unique_ptr<AttendSocketServer::PinnedRegion>> AttendSocketServer::Attach(
    FrameConnection& conn, const std::string& payload) {
  if (!conn.is_unix()) {
    return absl::FailedPreconditionError(
        "AttendSocket: shared-memory regions are attached over the Unix socket only");
  }
  const std::optional<uint64_t> bytes = attend_socket::DecodeRegionSize(payload);
  if (!bytes.has_value() || *bytes == 0) {
    return absl::InvalidArgumentError("AttendSocket: an attach frame carries a size above 0");
  }
  if (*bytes > options_.max_region_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("AttendSocket region of ", *bytes, " bytes over the limit of ",
                     options_.max_region_bytes, " (--attend_region_max_bytes)"));
  }
  // Counted only when it fits: a refused size never makes a concurrent attach fail.
  uint64_t before = regions_bytes_.load(std::memory_order_relaxed);
  do {
    if (*bytes > options_.total_region_bytes - std::min(before, options_.total_region_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "AttendSocket regions would take ", before + *bytes, " bytes, over the limit of ",
          options_.total_region_bytes, " (--attend_region_total_bytes)"));
    }
  } while (
      !regions_bytes_.compare_exchange_weak(before, before + *bytes, std::memory_order_relaxed));
  absl::StatusOr<std::unique_ptr<attend_socket::SharedRegion>> region =
      attend_socket::SharedRegion::Create(*bytes);
  absl::Status pinned =
      region.ok() ? backend_->RegisterHostMemory((*region)->data(), *bytes) : region.status();
  if (!pinned.ok()) {
    regions_bytes_.fetch_sub(*bytes, std::memory_order_relaxed);
    return pinned;
  }
  const int fd = (*region)->fd();
  auto attached = std::make_unique<PinnedRegion>(*std::move(region), backend_, &regions_bytes_);
  if (absl::Status s =
          conn.WriteBytes(FrameType::kRegion, payload, fd, absl::Now() + options_.idle_timeout);
      !s.ok()) {
    return s;
  }
  return attached;
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
  AttendRunner runner(store_, options_.draining);
  v1::AttendRequest request;
  v1::AttendResponse response;
  std::string payload;
  std::unique_ptr<PinnedRegion> region;  // once attached
  absl::Status end;                      // what ends the session: OK when the client closes it
  bool tell_peer = true;                 // false once the socket itself has failed
  bool frame_unread = false;             // the last frame was refused from its header
  for (;;) {
    bool spin = spinning_.fetch_add(1, std::memory_order_relaxed) < options_.max_spinning;
    if (!spin) spinning_.fetch_sub(1, std::memory_order_relaxed);
    const absl::Duration spin_for = spin ? options_.spin : absl::ZeroDuration();
    // The slot is given back once the spin is over, not when the read returns: an idle session
    // blocks in its read for up to idle_timeout.
    auto stop_spinning = [&] {
      if (spin) spinning_.fetch_sub(1, std::memory_order_relaxed);
      spin = false;
    };
    absl::StatusOr<FrameConnection::Frame> frame =
        conn.Read(&payload, options_.max_frame_bytes, absl::Now() + options_.idle_timeout, spin_for,
                  stop_spinning);
    stop_spinning();
    // Clients have no descriptors to pass: one sent along is closed at once.
    if (const int passed = conn.TakeReceivedFd(); passed >= 0) close(passed);
    if (!frame.ok()) {
      if (!absl::IsOutOfRange(frame.status())) end = frame.status();
      tell_peer = !absl::IsUnavailable(end);
      frame_unread = absl::IsInvalidArgument(end) || absl::IsResourceExhausted(end);
      break;
    }
    const absl::Time begin = absl::Now();
    metrics_.session.Received(attend_socket::kHeaderBytes + payload.size());
    if (frame->type == FrameType::kAttach) {
      if (region != nullptr) {
        end = absl::FailedPreconditionError("AttendSocket: the session has a region already");
        break;
      }
      absl::StatusOr<std::unique_ptr<PinnedRegion>> attached = Attach(conn, payload);
      if (!attached.ok()) {
        end = attached.status();
        break;
      }
      region = *std::move(attached);
      continue;
    }
    if (frame->type != FrameType::kRequest && frame->type != FrameType::kRegionRequest) {
      // Not a step: the session ends with it, and no step is counted.
      end = absl::InvalidArgumentError("AttendSocket: a client sends request or attach frames");
      break;
    }
    if (frame->type == FrameType::kRegionRequest && region == nullptr) {
      end = absl::FailedPreconditionError("AttendSocket: a region request before an attach");
    } else if (absl::Status parsed = runner.Parse(payload, &request); !parsed.ok()) {
      end = absl::Status(parsed.code(), absl::StrCat("AttendSocket: ", parsed.message()));
    } else if (frame->type == FrameType::kRegionRequest) {
      end = runner.RunInRegion(request, region->region(), &response);
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
  // A session the server cut (its shutdown's grace ended) ended so, whatever its socket said
  // (a read of the shut socket looks like the client closing it): CANCELLED, as an AttendStream
  // the drain ends, and nothing more can be sent.
  if (session->cut.load(std::memory_order_acquire)) {
    end = absl::CancelledError("AttendSocket: the server shut down");
    tell_peer = false;
  }
  // Counted first: a client that has the status or sees the close also sees the session counted.
  metrics_.session.Finished(static_cast<grpc::StatusCode>(end.code()), absl::Now() - start);
  // The peer is told why, unless the socket itself failed.
  if (!end.ok() && tell_peer) {
    conn.WriteStatus(end, absl::Now() + absl::Seconds(1)).IgnoreError();
    // A client still writing the refused frame (one over --max_message_bytes) gets to finish it
    // and read the status, rather than block until its deadline.
    if (frame_unread) conn.DiscardInput(kDiscardQuiet, absl::Now() + kDiscardLimit);
  }
  // The peer sees the close now. The descriptor and the buffers go under mu_, so that Shutdown
  // never acts on a number the kernel has handed out again; the thread is joined when reaped.
  conn.Shutdown();
  absl::MutexLock l(&mu_);
  session->conn.reset();
  session->done.store(true, std::memory_order_release);
}

}  // namespace kvpool
