// A small Prometheus client: counter, gauge and histogram families with labels, and the text
// exposition format 0.0.4. The project writes its own because prometheus-cpp is not packaged
// for the build platform.
//
// Usage: register every family once at start-up (AddCounter/AddGauge/AddHistogram), resolve the
// label values of hot series once (family.WithLabels(...)) and keep the returned reference;
// updates to a series are lock-free atomics. Collectors added with AddCollector run at scrape
// time, before the text is written, to copy state kept elsewhere into gauges and counters.
//
// Thread safety: everything is thread-safe. Lock order: Registry::mu_ before any Family::mu_.
// Series and families live as long as the registry; references to them stay valid.
#ifndef KVPOOL_SERVICE_METRICS_METRICS_REGISTRY_H_
#define KVPOOL_SERVICE_METRICS_METRICS_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvpool::metrics {

// A monotonically increasing value.
class Counter {
 public:
  // Requires v >= 0.
  void Increment(double v = 1.0);
  // Mirrors a monotonic total kept elsewhere (read by a collector). Requires v >= Value().
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0);
  void Decrement(double v = 1.0) { Increment(-v); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into fixed buckets (upper bounds, strictly increasing; +Inf implied).
class Histogram {
 public:
  explicit Histogram(const std::vector<double>* bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double>* bounds_;                // owned by the family
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // [bounds + 1], not cumulative
  std::atomic<double> sum_{0.0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

// All series of one metric name, keyed by label values (in the order of the label names).
template <typename T>
class Family {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bounds = {})
      : name_(std::move(name)),
        help_(std::move(help)),
        label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {}

  // The series with these label values, created on first use. Requires one value per label
  // name. The reference stays valid for the family's lifetime.
  T& WithLabels(const std::vector<std::string>& values);

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  const std::vector<double>& bounds() const { return bounds_; }

  // Calls fn(label values, series) for every series, in label-value order.
  void ForEach(const std::function<void(const std::vector<std::string>&, const T&)>& fn) const;

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histograms only
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> series_ ABSL_GUARDED_BY(mu_);
};

using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

class Registry {
 public:
  // Register a family. Names follow Prometheus conventions ([a-zA-Z_:][a-zA-Z0-9_:]*); a
  // counter's name ends in _total. A name must not be registered twice.
  CounterFamily& AddCounter(std::string name, std::string help,
                            std::vector<std::string> label_names = {});
  GaugeFamily& AddGauge(std::string name, std::string help,
                        std::vector<std::string> label_names = {});
  HistogramFamily& AddHistogram(std::string name, std::string help,
                                std::vector<std::string> label_names, std::vector<double> bounds);

  // fn runs at every Serialize, before the text is written. It must not call Serialize.
  void AddCollector(std::function<void()> fn);

  // The text exposition format 0.0.4 of every family, in registration order; families with
  // no series print only HELP and TYPE.
  std::string Serialize() const;

 private:
  struct Entry {
    MetricType type;
    std::unique_ptr<CounterFamily> counter;
    std::unique_ptr<GaugeFamily> gauge;
    std::unique_ptr<HistogramFamily> histogram;
  };
  mutable absl::Mutex mu_;
  std::vector<Entry> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
};

// The Content-Type of Serialize()'s output.
inline constexpr std::string_view kExpositionContentType =
    "text/plain; version=0.0.4; charset=utf-8";

// Upper bounds from 50 us to 10 s (1-2.5-5 steps), for RPC durations in seconds.
std::vector<double> LatencyBucketsSeconds();

// ---- template definitions ------------------------------------------------------------------

template <typename T>
T& Family<T>::WithLabels(const std::vector<std::string>& values) {
  absl::MutexLock l(&mu_);
  auto& slot = series_[values];
  if (slot == nullptr) {
    if constexpr (std::is_same_v<T, Histogram>) {
      slot = std::make_unique<T>(&bounds_);
    } else {
      slot = std::make_unique<T>();
    }
  }
  return *slot;
}

template <typename T>
void Family<T>::ForEach(
    const std::function<void(const std::vector<std::string>&, const T&)>& fn) const {
  absl::MutexLock l(&mu_);
  for (const auto& [values, series] : series_) fn(values, *series);
}

}  // namespace kvpool::metrics

#endif  // KVPOOL_SERVICE_METRICS_METRICS_REGISTRY_H_
