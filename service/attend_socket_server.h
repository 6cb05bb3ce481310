// Attend over a plain TCP or Unix socket (the AttendSocket format,
// proto/kvpool/v1/attend_socket.h): the decode hot path without gRPC. Each connection is a session
// served by a thread of its own that reads a request, runs it (the AttendRunner of AttendStream:
// same checks, same store call, same response) and writes the response, reading the socket itself:
// after each response it polls for the next request without sleeping for `spin` (at most
// `max_spinning` sessions at once, each a busy core), then blocks. A failed step, a bad frame or an
// idle connection gets a status frame and the connection is closed. A session over the Unix socket
// may attach a shared-memory region (proto/kvpool/v1/attend_region.h), pinned by the compute
// backend, and run its steps there.
#ifndef KVPOOL_SERVICE_ATTEND_SOCKET_SERVER_H_
#define KVPOOL_SERVICE_ATTEND_SOCKET_SERVER_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/v1/attend_socket.h"
#include "service/rpc_metrics.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"

namespace kvpool {

struct AttendSocketOptions {
  // "HOST:PORT" to listen on; port 0 picks a free one. Empty: no TCP listener.
  std::string address;
  // A Unix socket path to listen on as well (sessions with shared-memory regions); empty: none.
  // The Server starts no AttendSocket server when both are empty.
  std::string unix_path;
  // Largest region a session may attach, and the sum of all sessions' regions (pinned host
  // memory): RESOURCE_EXHAUSTED beyond either.
  uint64_t max_region_bytes = uint64_t{64} << 20;
  uint64_t total_region_bytes = uint64_t{1} << 30;
  // Sessions served at once; a connection beyond them gets RESOURCE_EXHAUSTED and is closed.
  int max_connections = 256;
  // How long a session's thread polls for the next request without sleeping (0: block at once).
  absl::Duration spin = absl::Microseconds(500);
  // Sessions that may poll that way at the same time; the others block at once, so that many
  // sessions do not keep every core busy.
  int max_spinning = 4;
  // A session whose next request has not fully arrived after this long is closed
  // (DEADLINE_EXCEEDED); so is one whose response cannot be sent for this long.
  absl::Duration idle_timeout = absl::Minutes(10);
  // Largest request payload accepted (RESOURCE_EXHAUSTED beyond).
  uint32_t max_frame_bytes = 64 << 20;
  // Set once a graceful shutdown began (AttendResponse.server_draining); null: never.
  const std::atomic<bool>* draining = nullptr;
};

class AttendSocketServer {
 public:
  // Listens and starts accepting. `store`, `backend` (the store's, which pins regions) and
  // `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<AttendSocketServer>> Start(
      KvStore* store, ComputeBackend* backend, RpcMetrics* metrics,
      const AttendSocketOptions& options);
  // Shuts down if Shutdown was not called.
  ~AttendSocketServer();

  AttendSocketServer(const AttendSocketServer&) = delete;
  AttendSocketServer& operator=(const AttendSocketServer&) = delete;

  int port() const { return port_; }  // of the TCP listener; 0 without one
  // Bytes of the regions attached now, over all sessions (pinned host memory).
  uint64_t region_bytes() const { return regions_bytes_.load(std::memory_order_relaxed); }

  // The first steps of a graceful shutdown: StopAccepting closes the listeners (a new connection
  // is refused by the kernel; open sessions go on), then AwaitSessions waits until every session
  // has ended or `deadline` has passed. Idempotent; thread-safe.
  void StopAccepting();
  void AwaitSessions(absl::Time deadline);
  // Stops accepting, ends every session (a step in progress finishes first; its response is not
  // sent) and joins their threads. Idempotent; thread-safe.
  void Shutdown();

  // kvpool_rpc_duration_seconds has a series per session (method "AttendSocket": connection to
  // close, with the status that ended it) and per step (method "AttendSocket.step": a request
  // read to its response written).
  struct Metrics {
    RpcMetrics::Method session;
    RpcMetrics::Method step;
  };

 private:
  struct Session {
    std::unique_ptr<attend_socket::FrameConnection> conn;  // null once the session ended
    std::thread thread;
    std::atomic<bool> done{false};  // set under mu_ (AwaitSessions waits on it)
    std::atomic<bool> cut{false};   // Shutdown shut its socket
  };

  // A session's region: mapped, pinned by the backend, counted in regions_bytes_.
  class PinnedRegion;

  AttendSocketServer(KvStore* store, ComputeBackend* backend, RpcMetrics* metrics,
                     const AttendSocketOptions& options);
  void Accept(int listen_fd);
  void Serve(Session* session);
  // Answers an attach frame whose payload is `payload`: the region, or why not.
  absl::StatusOr<std::unique_ptr<PinnedRegion>> Attach(attend_socket::FrameConnection& conn,
                                                       const std::string& payload);
  // Tells a connection it gets no session (`why`) and counts it.
  void Refuse(attend_socket::FrameConnection& conn, const absl::Status& why);
  // Joins the threads of finished sessions and drops them.
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllSessionsDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvStore* const store_;
  ComputeBackend* const backend_;
  Metrics metrics_;
  const AttendSocketOptions options_;
  int listen_fds_[2] = {-1, -1};  // TCP, Unix; -1 when not listening
  int port_ = 0;
  std::thread acceptors_[2];
  std::atomic<uint64_t> regions_bytes_{0};  // attached regions' bytes, all sessions
  std::once_flag close_listeners_;
  absl::Mutex mu_;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int> spinning_{0};  // sessions polling without sleeping now
  std::list<Session> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_ATTEND_SOCKET_SERVER_H_
