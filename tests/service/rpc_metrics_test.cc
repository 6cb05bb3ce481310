#include "service/rpc_metrics.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/metrics/metrics_registry.h"

namespace kvpool {
namespace {

// The count of kvpool_rpc_duration_seconds{method, code} in the exposition, 0 when absent.
int Count(metrics::Registry& r, const std::string& method, const std::string& code) {
  const std::string text = r.Serialize();
  const std::string key =
      "kvpool_rpc_duration_seconds_count{method=\"" + method + "\",code=\"" + code + "\"} ";
  const size_t at = text.find(key);
  return at == std::string::npos ? 0 : std::stoi(text.substr(at + key.size()));
}

// Each code gets its own series of the method, a code outside gRPC's counts as UNKNOWN, and
// calls finishing on several threads at once are all counted.
TEST(RpcMetrics, CountsEveryFinishedCallUnderItsCode) {
  metrics::Registry registry;
  RpcMetrics rpc(&registry);
  RpcMetrics::Method step = rpc.ForMethod("Step");
  RpcMetrics::Method other = rpc.ForMethod("Other");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) step.Finished(grpc::StatusCode::OK, absl::Microseconds(50));
    });
  }
  for (std::thread& t : threads) t.join();
  step.Finished(grpc::StatusCode::RESOURCE_EXHAUSTED, absl::Milliseconds(1));
  step.Finished(grpc::StatusCode::UNAUTHENTICATED, absl::Milliseconds(1));
  step.Finished(static_cast<grpc::StatusCode>(99), absl::Milliseconds(1));
  step.Finished(grpc::StatusCode::UNKNOWN, absl::Milliseconds(1));
  other.Finished(grpc::StatusCode::OK, absl::Milliseconds(1));
  EXPECT_EQ(Count(registry, "Step", "OK"), 4000);
  EXPECT_EQ(Count(registry, "Step", "RESOURCE_EXHAUSTED"), 1);
  EXPECT_EQ(Count(registry, "Step", "UNAUTHENTICATED"), 1);
  EXPECT_EQ(Count(registry, "Step", "UNKNOWN"), 2);
  EXPECT_EQ(Count(registry, "Other", "OK"), 1);
  EXPECT_EQ(Count(registry, "Other", "RESOURCE_EXHAUSTED"), 0);
}

// Byte series exist for the methods that count bytes only.
TEST(RpcMetrics, ExportsByteSeriesOfMethodsThatCountBytes) {
  metrics::Registry registry;
  RpcMetrics rpc(&registry);
  RpcMetrics::Method session = rpc.ForMethod("Session");
  RpcMetrics::Method step = rpc.ForMethod("Session.step");
  session.Received(100);
  session.Received(20);
  session.Sent(7);
  step.Finished(grpc::StatusCode::OK, absl::Microseconds(50));
  const std::string text = registry.Serialize();
  EXPECT_NE(text.find("kvpool_rpc_received_bytes_total{method=\"Session\"} 120\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvpool_rpc_sent_bytes_total{method=\"Session\"} 7\n"), std::string::npos);
  EXPECT_EQ(text.find("bytes_total{method=\"Session.step\"}"), std::string::npos) << text;
}

}  // namespace
}  // namespace kvpool
