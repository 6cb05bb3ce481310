// Per-method RPC metrics: kvpool_rpc_duration_seconds{method,code} and the payload byte
// counters kvpool_rpc_{received,sent}_bytes_total{method}.
#ifndef KVPOOL_SERVICE_RPC_METRICS_H_
#define KVPOOL_SERVICE_RPC_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "service/metrics/metrics_registry.h"

namespace kvpool {

class RpcMetrics {
 public:
  // Registers the three families in `registry`, which must outlive this object.
  explicit RpcMetrics(metrics::Registry* registry);

  // The series of one method. Each is created on its first use (a method that never counts
  // bytes exports no byte series) and kept: updates after that take no lock (a decode step's
  // hot path). Thread-safe.
  class Method {
   public:
    void Received(uint64_t bytes);
    void Sent(uint64_t bytes);
    // Records one finished call of this method (a code outside gRPC's counts as UNKNOWN).
    void Finished(grpc::StatusCode code, absl::Duration elapsed);

   private:
    friend class RpcMetrics;
    static constexpr int kCodes = 17;  // grpc::StatusCode OK .. UNAUTHENTICATED
    struct Series {
      std::atomic<metrics::Counter*> received{nullptr};
      std::atomic<metrics::Counter*> sent{nullptr};
      std::array<std::atomic<metrics::Histogram*>, kCodes> duration{};  // by code
    };
    Method(std::string name, RpcMetrics* families)
        : name_(std::move(name)), families_(families), series_(std::make_unique<Series>()) {}
    std::string name_;
    RpcMetrics* families_;
    std::unique_ptr<Series> series_;
  };
  Method ForMethod(const std::string& name);

 private:
  metrics::HistogramFamily& duration_;
  metrics::CounterFamily& received_;
  metrics::CounterFamily& sent_;
};

// The gRPC name of a status code, e.g. "RESOURCE_EXHAUSTED".
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_RPC_METRICS_H_
