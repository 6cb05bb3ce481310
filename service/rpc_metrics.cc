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

RpcMetrics::Method RpcMetrics::ForMethod(const std::string& name) {
  return Method(name, &received_.WithLabels({name}), &sent_.WithLabels({name}), &duration_);
}

void RpcMetrics::Method::Finished(grpc::StatusCode code, absl::Duration elapsed) {
  const int i = code >= 0 && code < kCodes ? static_cast<int>(code) : grpc::StatusCode::UNKNOWN;
  std::atomic<metrics::Histogram*>& slot = (*by_code_)[i];
  metrics::Histogram* series = slot.load(std::memory_order_acquire);
  if (series == nullptr) {
    // Racing first calls resolve the same series.
    series = &duration_->WithLabels({name_, StatusCodeName(static_cast<grpc::StatusCode>(i))});
    slot.store(series, std::memory_order_release);
  }
  series->Observe(absl::ToDoubleSeconds(elapsed));
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
