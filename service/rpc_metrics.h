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

  // The series of one method, resolved once. Thread-safe.
  class Method {
   public:
    void Received(uint64_t bytes) { received_->Increment(static_cast<double>(bytes)); }
    void Sent(uint64_t bytes) { sent_->Increment(static_cast<double>(bytes)); }
    // Records one finished call of this method. Lock-free once the code's series exists (a
    // decode step's hot path): each code's series is resolved on its first use and kept.
    void Finished(grpc::StatusCode code, absl::Duration elapsed);

   private:
    friend class RpcMetrics;
    static constexpr int kCodes = 17;  // grpc::StatusCode OK .. UNAUTHENTICATED
    Method(std::string name, metrics::Counter* received, metrics::Counter* sent,
           metrics::HistogramFamily* duration)
        : name_(std::move(name)),
          received_(received),
          sent_(sent),
          duration_(duration),
          by_code_(std::make_unique<std::array<std::atomic<metrics::Histogram*>, kCodes>>()) {}
    std::string name_;
    metrics::Counter* received_;
    metrics::Counter* sent_;
    metrics::HistogramFamily* duration_;
    // The series of each code, null until its first call (any other code counts as UNKNOWN).
    std::unique_ptr<std::array<std::atomic<metrics::Histogram*>, kCodes>> by_code_;
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
