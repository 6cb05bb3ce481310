#include "service/metrics/metrics_exposer.h"

#include <civetweb.h>

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvpool::metrics {
namespace {

// civetweb request handler for /metrics; cbdata is the Registry.
int HandleMetrics(mg_connection* conn, void* cbdata) {
  const mg_request_info* info = mg_get_request_info(conn);
  if (std::strcmp(info->request_method, "GET") != 0 &&
      std::strcmp(info->request_method, "HEAD") != 0) {
    mg_send_http_error(conn, 405, "%s", "only GET is served\n");
    return 405;
  }
  const std::string body = static_cast<const Registry*>(cbdata)->Serialize();
  const std::string content_type(kExpositionContentType);
  mg_send_http_ok(conn, content_type.c_str(), static_cast<long long>(body.size()));
  if (std::strcmp(info->request_method, "GET") == 0) {
    mg_write(conn, body.data(), body.size());
  }
  return 200;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(const std::string& address,
                                                                      const Registry* registry) {
  // Each connection holds a thread until its request arrives: a few idle or slow clients must
  // not keep the scraper out for long.
  const char* options[] = {"listening_ports",    address.c_str(), "num_threads", "8",
                           "request_timeout_ms", "5000",          nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  mg_context* ctx = mg_start(&callbacks, nullptr, options);
  if (ctx == nullptr) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", address));
  }
  mg_set_request_handler(ctx, "/metrics$", &HandleMetrics, const_cast<Registry*>(registry));
  mg_server_port ports[1];
  if (mg_get_server_ports(ctx, 1, ports) < 1) {
    mg_stop(ctx);
    return absl::InternalError("metrics: no listening port after start");
  }
  return std::unique_ptr<MetricsExposer>(new MetricsExposer(ctx, ports[0].port));
}

MetricsExposer::~MetricsExposer() { mg_stop(ctx_); }

}  // namespace kvpool::metrics
