// The kvpool server assembled: compute backend, store (with its start-up namespaces), gRPC
// server (KvPool service, KvPoolTransport (the NCCL data plane) on a CUDA backend built with
// NCCL, grpc.health.v1, server reflection), the AttendSocket listener, the /metrics exposer and
// a sweeper thread (expired leases, idle Put streams, stalled Get streams).
// Shutdown is graceful: health turns NOT_SERVING, no new RPC or AttendSocket connection is taken,
// in-flight RPCs and open AttendSocket sessions drain until the deadline, then the rest are
// cancelled.
#ifndef KVPOOL_SERVICE_SERVER_H_
#define KVPOOL_SERVICE_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/server.h"
#include "service/attend_server.h"
#include "service/attend_socket_server.h"
#include "service/kvpool_service.h"
#include "service/metrics/metrics_exposer.h"
#include "service/metrics/metrics_registry.h"
#include "service/rpc_metrics.h"
#include "service/service_options.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "service/transport/peer_transport.h"
#include "service/transport/transport_service.h"

namespace kvpool {

inline constexpr char kServerVersion[] = "0.1.0";

struct ServerOptions {
  // gRPC listening address; port 0 picks a free port; "" = in-process channel only.
  std::string grpc_address = "0.0.0.0:50051";
  // /metrics listening address ("HOST:PORT"; port 0 picks a free port); "" = no exposer.
  std::string metrics_address = "0.0.0.0:9464";
  // The store's options; its `backend` is replaced by the server's backend.
  KvStore::Options store;
  // Namespaces created before the server starts serving (the first one is the default).
  std::vector<NamespaceConfig> namespaces;
  ServiceOptions service;
  AttendServerOptions attend;
  // Attend over a plain TCP socket (kvpool-server: --attend_socket_port) or a Unix one
  // (--attend_unix_socket); both off by default here.
  AttendSocketOptions attend_socket;
  // The CUDA backend's device, on which KvPoolTransport opens NCCL channels; -1 = no
  // KvPoolTransport. Ignored (no KvPoolTransport) for a non-CUDA backend or a build without NCCL.
  int nccl_device = -1;
  TransportOptions transport;
  int max_message_bytes = 64 << 20;
  // Period of the sweeper (Sweep); zero disables it (leases still expire lazily on every call,
  // but idle Put streams and stalled Get streams are then never cancelled).
  absl::Duration lease_sweep_interval = absl::Seconds(1);
};

class Server {
 public:
  // Builds and starts everything; on error nothing keeps running.
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options,
                                                       std::unique_ptr<ComputeBackend> backend);
  // Shuts down with no grace if Shutdown was not called.
  ~Server();

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }  // 0 without a TCP listener
  int attend_socket_port() const;     // 0 without an AttendSocket listener
  int metrics_port() const;           // 0 without an exposer
  KvStore* store() const { return store_.get(); }
  const ComputeBackend& backend() const { return *backend_; }
  metrics::Registry* registry() { return &registry_; }

  // A channel into this server that bypasses the network, with the server's message limit as
  // its receive limit and no send limit.
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // Health NOT_SERVING and no new calls or AttendSocket connections, then waits up to `grace` for
  // in-flight RPCs and open AttendSocket sessions before cancelling them, then stops the sweeper
  // and the exposer. Idempotent; thread-safe.
  void Shutdown(absl::Duration grace);

  // What the sweeper thread does every lease_sweep_interval: drops expired leases, cancels the
  // Put streams idle for longer than ServiceOptions::put_idle_timeout and the Get streams
  // stalled for longer than ServiceOptions::get_stall_timeout, and aborts the NCCL channels idle
  // past their timeout.
  void Sweep();

 private:
  Server() = default;
  void SweepEvery(absl::Duration interval);

  // Declaration order is destruction order in reverse: the gRPC server goes before the service,
  // the service before the store, the store before the backend.
  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<KvStore> store_;
  metrics::Registry registry_;
  std::unique_ptr<RpcMetrics> rpc_metrics_;
  std::unique_ptr<KvPoolService> service_;
  std::unique_ptr<AttendServer> attend_server_;         // its queues outlive the gRPC server
  std::unique_ptr<AttendSocketServer> attend_socket_;   // null without its listener
  std::unique_ptr<PeerTransportFactory> transport_factory_;    // null without KvPoolTransport
  std::unique_ptr<KvPoolTransportService> transport_service_;  // null without KvPoolTransport
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<metrics::MetricsExposer> exposer_;
  int port_ = 0;
  int max_message_bytes_ = 0;
  absl::Notification stop_sweeper_;
  std::thread sweeper_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  // Set as a graceful shutdown begins; every Attend response says so from then on.
  std::atomic<bool> draining_{false};
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_SERVER_H_
