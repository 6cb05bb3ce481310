// AttendStream, the decode hot path, on gRPC's async API with threads of its own. Each of
// `threads` completion queues is drained by one thread that runs the steps of the streams it
// accepted inline (framing, the store call, the response), strictly read, run, write per stream.
// After each event the thread keeps polling its queue without sleeping for `spin`, so the next
// step of a decode loop is picked up without a thread wake-up; idle longer than that, it blocks.
// The client's AttendSession polls the same way (ClientOptions::attend_spin).
#ifndef KVPOOL_SERVICE_ATTEND_STREAM_SERVER_H_
#define KVPOOL_SERVICE_ATTEND_STREAM_SERVER_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "service/kvpool_service.h"
#include "service/rpc_metrics.h"
#include "service/store/kv_store.h"

namespace kvpool {

struct AttendStreamOptions {
  // Threads (one completion queue each) that run AttendStream steps; at least 1.
  int threads = 4;
  // How long a thread polls without sleeping after its last event (0: always block).
  absl::Duration spin = absl::Microseconds(500);
};

class AttendStreamServer {
 public:
  // `service`, `store` and `metrics` must outlive this object.
  AttendStreamServer(KvPoolService* service, KvStore* store, RpcMetrics* metrics,
                     const AttendStreamOptions& options);
  // Shuts the queues down if Shutdown was not called.
  ~AttendStreamServer();

  // kvpool_rpc_duration_seconds has a series per stream (method "AttendStream": accept to final
  // status) and per step (method "AttendStream.step": the server's time from a request read to
  // its response handed to gRPC, the figure to compare with a client's step latency).
  struct Metrics {
    RpcMetrics::Method stream;
    RpcMetrics::Method step;
  };

  AttendStreamServer(const AttendStreamServer&) = delete;
  AttendStreamServer& operator=(const AttendStreamServer&) = delete;

  // Adds the completion queues to `builder`; call once, before BuildAndStart.
  void AddQueues(grpc::ServerBuilder& builder);
  // Starts accepting streams; call once, after a successful BuildAndStart.
  void Start();
  // Call after the gRPC server's Shutdown has returned (it cancelled every call still open): each
  // thread shuts its queue down, drops what is left in it and exits. Idempotent.
  void Shutdown();

 private:
  struct Queue {
    std::unique_ptr<grpc::ServerCompletionQueue> cq;
    // Set by Shutdown to wake the thread, which then shuts cq down itself: apart from this alarm,
    // only that thread posts to cq, so nothing is posted after the shutdown.
    grpc::Alarm stop;
    std::thread thread;
  };
  void Poll(Queue* queue);

  KvPoolService* const service_;
  KvStore* const store_;
  Metrics metrics_;
  const AttendStreamOptions options_;
  std::vector<std::unique_ptr<Queue>> queues_;
  bool shut_down_ = false;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_ATTEND_STREAM_SERVER_H_
