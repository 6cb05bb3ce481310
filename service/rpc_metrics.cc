#include "service/rpc_metrics.h"

namespace kvpool {

RpcMetrics::RpcMetrics(metrics::Registry* registry)
    : duration_(registry->AddHistogram("kvpool_rpc_duration_seconds",
                                       "Server-side duration of RPCs by method and status code.",
                                       {"method", "code"}, metrics::LatencyBucketsSeconds())),
      received_(registry->AddCounter("kvpool_rpc_received_bytes_total",
                                     "Request payload bytes received, by method.", {"method"})),
      sent_(registry->AddCounter("kvpool_rpc_sent_bytes_total",
                                 "Response payload bytes sent, by method.", {"method"})) {}

namespace {

// The series kept in `slot`, made by `make()` (a family's WithLabels) on first use; racing first
// uses resolve the same series. The labels are built only then.
template <typename T, typename Make>
T& Resolve(std::atomic<T*>& slot, Make make) {
  T* series = slot.load(std::memory_order_acquire);
  if (series == nullptr) {
    series = &make();
    slot.store(series, std::memory_order_release);
  }
  return *series;
}

}  // namespace

RpcMetrics::Method RpcMetrics::ForMethod(const std::string& name) { return Method(name, this); }

void RpcMetrics::Method::Received(uint64_t bytes) {
  Resolve(series_->received, [&]() -> metrics::Counter& {
    return families_->received_.WithLabels({name_});
  }).Increment(static_cast<double>(bytes));
}

void RpcMetrics::Method::Sent(uint64_t bytes) {
  Resolve(series_->sent, [&]() -> metrics::Counter& {
    return families_->sent_.WithLabels({name_});
  }).Increment(static_cast<double>(bytes));
}

void RpcMetrics::Method::Finished(grpc::StatusCode code, absl::Duration elapsed) {
  const int i = code >= 0 && code < kCodes ? static_cast<int>(code) : grpc::StatusCode::UNKNOWN;
  Resolve(series_->duration[i], [&]() -> metrics::Histogram& {
    return families_->duration_.WithLabels(
        {name_, StatusCodeName(static_cast<grpc::StatusCode>(i))});
  }).Observe(absl::ToDoubleSeconds(elapsed));
}

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      break;
  }
  return "UNKNOWN";
}

}  // namespace kvpool
