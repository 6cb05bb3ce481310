// Serves a Registry's exposition text over HTTP (GET /metrics) on its own port, with an
// embedded civetweb server running its own threads.
#ifndef KVPOOL_SERVICE_METRICS_METRICS_EXPOSER_H_
#define KVPOOL_SERVICE_METRICS_METRICS_EXPOSER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "service/metrics/metrics_registry.h"

struct mg_context;

namespace kvpool::metrics {

class MetricsExposer {
 public:
  // Listens on `address` ("HOST:PORT" or "PORT"; port 0 picks a free one) and serves
  // `registry`, which must outlive the exposer. UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(const std::string& address,
                                                               const Registry* registry);
  // Stops serving; returns after in-flight requests finish.
  ~MetricsExposer();

  MetricsExposer(const MetricsExposer&) = delete;
  MetricsExposer& operator=(const MetricsExposer&) = delete;

  // The port actually bound.
  int port() const { return port_; }

 private:
  MetricsExposer(mg_context* ctx, int port) : ctx_(ctx), port_(port) {}

  mg_context* const ctx_;
  const int port_;
};

}  // namespace kvpool::metrics

#endif  // KVPOOL_SERVICE_METRICS_METRICS_EXPOSER_H_
