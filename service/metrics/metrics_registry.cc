#include "service/metrics/metrics_registry.h"

#include <charconv>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvpool::metrics {
namespace {

void AtomicAdd(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

// Shortest text that reads back as `v`; Prometheus spellings for infinities and NaN.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// Escapes backslash and newline, as HELP text needs; label values (`quote`) also escape the double
// quote.
std::string Escape(std::string_view s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}` for the given names and values plus an optional extra pair; "" when empty.
std::string LabelText(const std::vector<std::string>& names, const std::vector<std::string>& values,
                      absl::string_view extra_name = {}, absl::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, names[i], "=\"", Escape(values[i], /*quote=*/true), "\"");
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out += ',';
    absl::StrAppend(&out, extra_name, "=\"", extra_value, "\"");
  }
  out += '}';
  return out;
}

template <typename T>
void AppendHeader(const Family<T>& f, absl::string_view type, std::string* out) {
  absl::StrAppend(out, "# HELP ", f.name(), " ", Escape(f.help(), /*quote=*/false), "\n",
                  "# TYPE ", f.name(), " ", type, "\n");
}

template <typename T>
void AppendScalarFamily(const Family<T>& f, absl::string_view type, std::string* out) {
  AppendHeader(f, type, out);
  f.ForEach([&](const std::vector<std::string>& values, const T& series) {
    absl::StrAppend(out, f.name(), LabelText(f.label_names(), values), " ",
                    FormatValue(series.Value()), "\n");
  });
}

void AppendHistogramFamily(const HistogramFamily& f, std::string* out) {
  AppendHeader(f, "histogram", out);
  f.ForEach([&](const std::vector<std::string>& values, const Histogram& h) {
    const Histogram::Snapshot s = h.Read();
    for (size_t i = 0; i <= f.bounds().size(); ++i) {
      const std::string le = i < f.bounds().size() ? FormatValue(f.bounds()[i]) : "+Inf";
      absl::StrAppend(out, f.name(), "_bucket", LabelText(f.label_names(), values, "le", le), " ",
                      s.cumulative[i], "\n");
    }
    const std::string labels = LabelText(f.label_names(), values);
    absl::StrAppend(out, f.name(), "_sum", labels, " ", FormatValue(s.sum), "\n");
    absl::StrAppend(out, f.name(), "_count", labels, " ", s.count, "\n");
  });
}

}  // namespace

void Counter::Increment(double v) { AtomicAdd(value_, v); }

void Gauge::Increment(double v) { AtomicAdd(value_, v); }

Histogram::Histogram(const std::vector<double>* bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds->size() + 1]) {
  for (size_t i = 0; i <= bounds_->size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_->size() && v > (*bounds_)[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.cumulative.resize(bounds_->size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

CounterFamily& Registry::AddCounter(std::string name, std::string help,
                                    std::vector<std::string> label_names) {
  absl::MutexLock l(&mu_);
  Entry e{MetricType::kCounter, nullptr, nullptr, nullptr};
  e.counter =
      std::make_unique<CounterFamily>(std::move(name), std::move(help), std::move(label_names));
  families_.push_back(std::move(e));
  return *families_.back().counter;
}

GaugeFamily& Registry::AddGauge(std::string name, std::string help,
                                std::vector<std::string> label_names) {
  absl::MutexLock l(&mu_);
  Entry e{MetricType::kGauge, nullptr, nullptr, nullptr};
  e.gauge = std::make_unique<GaugeFamily>(std::move(name), std::move(help), std::move(label_names));
  families_.push_back(std::move(e));
  return *families_.back().gauge;
}

HistogramFamily& Registry::AddHistogram(std::string name, std::string help,
                                        std::vector<std::string> label_names,
                                        std::vector<double> bounds) {
  absl::MutexLock l(&mu_);
  Entry e{MetricType::kHistogram, nullptr, nullptr, nullptr};
  e.histogram = std::make_unique<HistogramFamily>(std::move(name), std::move(help),
                                                  std::move(label_names), std::move(bounds));
  families_.push_back(std::move(e));
  return *families_.back().histogram;
}

void Registry::AddCollector(std::function<void()> fn) {
  absl::MutexLock l(&mu_);
  collectors_.push_back(std::move(fn));
}

std::string Registry::Serialize() const {
  absl::MutexLock l(&mu_);
  for (const auto& fn : collectors_) fn();
  std::string out;
  for (const Entry& e : families_) {
    switch (e.type) {
      case MetricType::kCounter:
        AppendScalarFamily(*e.counter, "counter", &out);
        break;
      case MetricType::kGauge:
        AppendScalarFamily(*e.gauge, "gauge", &out);
        break;
      case MetricType::kHistogram:
        AppendHistogramFamily(*e.histogram, &out);
        break;
    }
  }
  return out;
}

std::vector<double> LatencyBucketsSeconds() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
          50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0};
}

}  // namespace kvpool::metrics
