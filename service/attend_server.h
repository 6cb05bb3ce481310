// Attend and AttendStream, the decode hot path, on gRPC's async API with threads of its own.
// Each of `threads` completion queues is drained by one thread that runs the calls it accepted
// inline (parsing, framing, the store call, the response): a unary Attend from its request to its
// response, a stream's steps strictly read, run, write. After each event the thread keeps
// polling its queue without sleeping for `spin`, so the next call or decode step is picked up
// without a thread wake-up; idle longer than that, it blocks. The client polls the same way
// (ClientOptions::attend_spin), for unary Attend and AttendSession steps alike.
#ifndef KVPOOL_SERVICE_ATTEND_SERVER_H_
#define KVPOOL_SERVICE_ATTEND_SERVER_H_

#include <atomic>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "service/attend_runner.h"
#include "service/kvpool_service.h"
#include "service/rpc_metrics.h"
#include "service/store/kv_store.h"

namespace kvpool {

struct AttendServerOptions {
  // Threads (one completion queue each) that run Attend calls and AttendStream steps; at least 1.
  int threads = 4;
  // How long a thread polls without sleeping after its last event (0: always block).
  absl::Duration spin = absl::Microseconds(500);
  // Set once a graceful shutdown began (AttendResponse.server_draining); null: never.
  const std::atomic<bool>* draining = nullptr;
};

class AttendServer {
 public:
  // `service`, `store` and `metrics` must outlive this object.
  AttendServer(KvPoolService* service, KvStore* store, RpcMetrics* metrics,
               const AttendServerOptions& options);
  // Shuts the queues down if Shutdown was not called.
  ~AttendServer();

  // kvpool_rpc_duration_seconds has a series per unary call (method "Attend": the server's time
  // from the request to its response handed to gRPC; CANCELLED when the response could not go
  // out, the client having cancelled or passed its deadline), per stream (method "AttendStream":
  // accept to final status; one the client cancelled, or that passed its deadline, counts as
  // CANCELLED) and per step (method "AttendStream.step": like "Attend", the figure to
  // compare with a client's step latency).
  struct Metrics {
    RpcMetrics::Method unary;
    RpcMetrics::Method stream;
    RpcMetrics::Method step;
  };

  AttendServer(const AttendServer&) = delete;
  AttendServer& operator=(const AttendServer&) = delete;

  // Adds the completion queues to `builder`; call once, before BuildAndStart.
  void AddQueues(grpc::ServerBuilder& builder);
  // Starts accepting calls; call once, after a successful BuildAndStart.
  void Start();
  // Call after the gRPC server's Shutdown has returned (it cancelled every call still open): each
  // thread shuts its queue down, drops what is left in it and exits. Idempotent.
  void Shutdown();

  // What the calls accepted on one queue share; touched only by that queue's thread.
  struct Queue {
    Queue(KvPoolService* service, KvStore* store, Metrics* metrics,
          std::unique_ptr<grpc::ServerCompletionQueue> cq, const std::atomic<bool>* draining)
        : service(service),
          store(store),
          draining(draining),
          metrics(metrics),
          cq(std::move(cq)),
          unary_runner(store, draining) {}

    KvPoolService* service;
    KvStore* store;
    const std::atomic<bool>* draining;
    Metrics* metrics;
    std::unique_ptr<grpc::ServerCompletionQueue> cq;
    // Runs every unary Attend accepted on this queue, one after the other, so that they reuse
    // its buffers.
    AttendRunner unary_runner;
    // Set by Shutdown to wake the thread, which then shuts cq down itself: apart from this alarm,
    // only that thread posts to cq, so nothing is posted after the shutdown.
    grpc::Alarm stop;
    std::thread thread;
  };

 private:
  void Poll(Queue* queue);

  KvPoolService* const service_;
  KvStore* const store_;
  Metrics metrics_;
  const AttendServerOptions options_;
  std::vector<std::unique_ptr<Queue>> queues_;
  bool shut_down_ = false;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_ATTEND_SERVER_H_
