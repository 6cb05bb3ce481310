#include "service/metrics/metrics_registry.h"

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::metrics {
namespace {

TEST(MetricsRegistry, WritesExactExpositionText) {
  Registry r;
  CounterFamily& c = r.AddCounter("kvpool_test_total", "Things done.\nSecond \\ line.", {"method"});
  GaugeFamily& g = r.AddGauge("kvpool_test_gauge", "A level.");
  HistogramFamily& h = r.AddHistogram("kvpool_test_seconds", "Durations.", {"code"}, {0.5, 2.0});
  r.AddGauge("kvpool_test_empty", "No series yet.", {"x"});
  c.WithLabels({"Put"}).Increment(3);
  c.WithLabels({"a\"b\\c\nd"}).Increment(1.5);
  g.WithLabels({}).Set(-2.25);
  Histogram& ok = h.WithLabels({"OK"});
  ok.Observe(0.25);
  ok.Observe(0.5);
  ok.Observe(1.0);
  ok.Observe(7.0);

  EXPECT_EQ(r.Serialize(),
            "# HELP kvpool_test_total Things done.\\nSecond \\\\ line.\n"
            "# TYPE kvpool_test_total counter\n"
            "kvpool_test_total{method=\"Put\"} 3\n"
            "kvpool_test_total{method=\"a\\\"b\\\\c\\nd\"} 1.5\n"
            "# HELP kvpool_test_gauge A level.\n"
            "# TYPE kvpool_test_gauge gauge\n"
            "kvpool_test_gauge -2.25\n"
            "# HELP kvpool_test_seconds Durations.\n"
            "# TYPE kvpool_test_seconds histogram\n"
            "kvpool_test_seconds_bucket{code=\"OK\",le=\"0.5\"} 2\n"
            "kvpool_test_seconds_bucket{code=\"OK\",le=\"2\"} 3\n"
            "kvpool_test_seconds_bucket{code=\"OK\",le=\"+Inf\"} 4\n"
            "kvpool_test_seconds_sum{code=\"OK\"} 8.75\n"
            "kvpool_test_seconds_count{code=\"OK\"} 4\n"
            "# HELP kvpool_test_empty No series yet.\n"
            "# TYPE kvpool_test_empty gauge\n");
}

TEST(MetricsRegistry, LargeTotalsKeepEveryDigit) {
  Registry r;
  r.AddCounter("kvpool_bytes_total", "Bytes.").WithLabels({}).Increment(4294967297.0);
  EXPECT_NE(r.Serialize().find("kvpool_bytes_total 4294967297\n"), std::string::npos);
}

TEST(MetricsRegistry, CollectorsRunBeforeEveryScrape) {
  Registry r;
  Gauge& g = r.AddGauge("kvpool_level", "Level.").WithLabels({});
  int calls = 0;
  r.AddCollector([&] { g.Set(++calls * 10); });
  EXPECT_NE(r.Serialize().find("kvpool_level 10\n"), std::string::npos);
  EXPECT_NE(r.Serialize().find("kvpool_level 20\n"), std::string::npos);
}

TEST(MetricsRegistry, ConcurrentIncrementsSumExactly) {
  Registry r;
  CounterFamily& c = r.AddCounter("kvpool_ops_total", "Ops.", {"t"});
  HistogramFamily& h = r.AddHistogram("kvpool_op_seconds", "Op time.", {}, LatencyBucketsSeconds());
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter& shared = c.WithLabels({"shared"});
      Counter& own = c.WithLabels({std::to_string(t % 2)});
      Histogram& hist = h.WithLabels({});
      for (int i = 0; i < kPerThread; ++i) {
        shared.Increment();
        own.Increment(2);
        hist.Observe(1e-3 * (i % 7));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.WithLabels({"shared"}).Value(), kThreads * kPerThread);
  EXPECT_EQ(c.WithLabels({"0"}).Value(), kThreads / 2 * kPerThread * 2);
  EXPECT_EQ(c.WithLabels({"1"}).Value(), kThreads / 2 * kPerThread * 2);
  const Histogram::Snapshot s = h.WithLabels({}).Read();
  EXPECT_EQ(s.count, uint64_t{kThreads} * kPerThread);
  EXPECT_EQ(s.cumulative.back(), s.count);
  // i % 7 == 0 observes 0, which falls in the first bucket (<= 50us).
  const uint64_t zeros = uint64_t{kThreads} * ((kPerThread + 6) / 7);
  EXPECT_EQ(s.cumulative[0], zeros);
}

}  // namespace
}  // namespace kvpool::metrics
