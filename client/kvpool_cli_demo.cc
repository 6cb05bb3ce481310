// `kvpool demo`: simulated prefill and decode workers against a running server. Requests share
// a system prompt; prefill workers Put each prompt (skipping what Match says is cached), decode
// workers Match it, Append the uncached tail and run decode steps for every layer over one
// AttendStream session (over the AttendSocket when the client has one, as deploy/local/run_demo.sh
// gives it), checking each output against fp64 attention over the fp16 K/V sent.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/kvpool_cli.h"
#include "tests/common/bench_output.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(std::string, demo_namespace, "demo", "demo: namespace created (or reused) for it");
ABSL_FLAG(int32_t, demo_layers, 8, "demo: layers of the simulated model");
ABSL_FLAG(int32_t, demo_kv_heads, 8, "demo: KV heads");
ABSL_FLAG(int32_t, demo_head_dim, 128, "demo: head_dim");
ABSL_FLAG(int32_t, demo_capacity_mb, 64, "demo: pool MiB reserved for the demo namespace");
ABSL_FLAG(int32_t, requests, 8, "demo: requests");
ABSL_FLAG(int32_t, system_tokens, 256, "demo: tokens of the shared system prompt");
ABSL_FLAG(int32_t, user_tokens, 72, "demo: tokens of each request's own user turn");
ABSL_FLAG(int32_t, decode_steps, 4, "demo: decode steps per request");
ABSL_FLAG(int32_t, prefill_workers, 2, "demo: parallel prefill workers");
ABSL_FLAG(int32_t, decode_workers, 2, "demo: parallel decode workers");
// INT4 with rotation gives ~0.2 on this data (a numpy model of the recipe agrees).
ABSL_FLAG(double, max_rel_error, 0.35, "demo: fail when attention error vs fp16 exceeds this");

namespace kvpool::cli {
namespace {

// The workload: a "universe" of K/V rows per layer; request r owns the system rows followed by
// its user turn and its decode tokens.
struct Workload {
  int requests, system, user, steps, q_heads;
  std::vector<int32_t> system_ids;
  LayeredKv universe;

  int PromptTokens() const { return system + user; }
  int OwnBegin(int r) const { return system + r * (user + steps); }
  std::vector<int32_t> Ids(int r, uint64_t seed) const {
    std::vector<int32_t> ids = system_ids;
    std::vector<int32_t> own = MakeTokenIds(user + steps, seed * 31 + 1 + r);
    ids.insert(ids.end(), own.begin(), own.end());
    return ids;
  }
  // Request r's K/V rows, [layers][system + user + steps][heads][head_dim].
  LayeredKv RequestKv(int r) const {
    LayeredKv kv;  // the shape only: a copy of the universe would keep its capacity
    kv.num_layers = universe.num_layers;
    kv.heads = universe.heads;
    kv.head_dim = universe.head_dim;
    kv.tokens = system + user + steps;
    const size_t row = static_cast<size_t>(universe.heads) * universe.head_dim;
    kv.k.assign(kv.num_layers * kv.tokens * row, 0.f);
    kv.v.assign(kv.k.size(), 0.f);
    for (int l = 0; l < kv.num_layers; ++l) {
      for (int t = 0; t < kv.tokens; ++t) {
        const int src = t < system ? t : OwnBegin(r) + t - system;
        std::copy_n(universe.K(l, src), row, &kv.k[kv.Offset(l, t)]);
        std::copy_n(universe.V(l, src), row, &kv.v[kv.Offset(l, t)]);
      }
    }
    return kv;
  }
};

// Progress line on stderr, rewritten in place.
class Progress {
 public:
  Progress(int requests, int steps) : requests_(requests), steps_(steps) {}
  void PrefillDone() { Bump(&prefilled_); }
  void StepDone() { Bump(&stepped_); }
  void End() { std::fprintf(stderr, "\n"); }

 private:
  void Bump(int* counter) {
    absl::MutexLock lock(&mu_);
    ++*counter;
    std::fprintf(stderr, "\r[demo] prefill %d/%d requests | decode %d/%d steps ", prefilled_,
                 requests_, stepped_, requests_ * steps_);
    std::fflush(stderr);
  }
  const int requests_, steps_;
  absl::Mutex mu_;
  int prefilled_ ABSL_GUARDED_BY(mu_) = 0;
  int stepped_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::StatusOr<v1::NamespaceInfo> DemoNamespace(client::KvPoolClient& c) {
  v1::NamespaceSpec spec;
  spec.set_name(absl::GetFlag(FLAGS_demo_namespace));
  spec.set_num_layers(absl::GetFlag(FLAGS_demo_layers));
  spec.set_num_kv_heads(absl::GetFlag(FLAGS_demo_kv_heads));
  spec.set_head_dim(absl::GetFlag(FLAGS_demo_head_dim));
  spec.set_block_tokens(16);
  spec.set_default_dtype(v1::KV_DTYPE_INT4);
  spec.set_rotation_seed(0x6B76706F6F6C);
  spec.set_capacity_bytes(static_cast<uint64_t>(absl::GetFlag(FLAGS_demo_capacity_mb)) << 20);
  absl::StatusOr<v1::NamespaceInfo> created = c.CreateNamespace(spec, Call());
  if (created.ok() || !absl::IsAlreadyExists(created.status())) return created;
  absl::StatusOr<v1::NamespaceInfo> existing = c.GetNamespace(spec.name(), Call());
  if (!existing.ok()) return existing;
  const v1::NamespaceSpec& e = existing->spec();
  if (e.num_layers() != spec.num_layers() || e.num_kv_heads() != spec.num_kv_heads() ||
      e.head_dim() != spec.head_dim()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "namespace %s exists with another geometry; pick --demo_namespace", spec.name()));
  }
  return existing;
}

// What a worker's calls took, for the summary: its time inside the timed calls only (not in
// building K/V or checking outputs), and the per-call latencies.
struct CallTimes {
  double secs = 0;
  std::vector<double> us;
  template <typename F>
  auto Time(F&& call) {
    const absl::Time start = absl::Now();
    auto result = call();
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    secs += t;
    us.push_back(t * 1e6);
    return result;
  }
  void ForgetLast() {  // a call whose work is not counted (one that is repeated in full)
    secs -= us.back() / 1e6;
    us.pop_back();
  }
};

// Prefill of request r: Match to learn the cached prefix, then Put only the rest (timed in
// `put_times`); `cached` grows by the prefix that Put did not send. Returns the bytes it sent.
absl::StatusOr<uint64_t> Prefill(client::KvPoolClient& c, const std::string& ns, const Workload& w,
                                 int r, uint64_t seed, uint64_t* cached, CallTimes& put_times) {
  const int prompt = w.PromptTokens();
  std::vector<int32_t> ids = w.Ids(r, seed);
  ids.resize(prompt);
  absl::StatusOr<v1::MatchResponse> m = c.Match(ns, ids, absl::ZeroDuration(), Call());
  if (!m.ok()) return m.status();
  absl::Status released = c.Release(m->lease_id(), Call());
  if (!released.ok()) return released;
  const LayeredKv kv = w.RequestKv(r);
  int begin = static_cast<int>(m->cached_tokens());
  client::SequenceKv tail = ToSequenceKv(kv, begin, prompt - begin);
  absl::StatusOr<v1::PutResponse> put =
      put_times.Time([&] { return c.Put(ns, ids, tail, Call()); });
  if (!put.ok() && absl::IsFailedPrecondition(put.status()) && begin > 0) {
    put_times.ForgetLast();
    begin = 0;  // the prefix was evicted since Match: send everything
    tail = ToSequenceKv(kv, 0, prompt);
    put = put_times.Time([&] { return c.Put(ns, ids, tail, Call()); });
  }
  if (!put.ok()) return put.status();
  *cached += begin;
  return put->bytes_received();
}

// Decode of a batch of requests: Match, Append the uncached tail, then steps x layers of
// Attend over one session (each step timed in `step_times`), each output compared with the fp64
// reference.
absl::Status Decode(client::KvPoolClient& c, const std::string& ns, const Workload& w,
                    const std::vector<int>& batch, uint64_t seed, Progress& progress,
                    RelativeError& error, CallTimes& step_times) {
  const int prompt = w.PromptTokens();
  const int layers = w.universe.num_layers;
  const int d = w.universe.head_dim;
  std::vector<LayeredKv> kv;
  std::vector<std::vector<int32_t>> ids;
  std::vector<uint64_t> leases;
  absl::Status status;
  for (int r : batch) {
    kv.push_back(w.RequestKv(r));
    ids.push_back(w.Ids(r, seed));
    const std::vector<int32_t> prompt_ids(ids.back().begin(), ids.back().begin() + prompt);
    absl::StatusOr<v1::MatchResponse> m = c.Match(ns, prompt_ids, absl::ZeroDuration(), Call());
    if (!m.ok()) {
      status = m.status();
      break;
    }
    leases.push_back(m->lease_id());
    const int cached = m->cached_tokens();
    const std::vector<int32_t> tail(prompt_ids.begin() + cached, prompt_ids.end());
    for (int l = 0; l < layers && status.ok() && cached < prompt; ++l) {
      absl::StatusOr<uint32_t> held =
          c.Append(m->lease_id(), l, tail, prompt - cached,
                   LayerSliceFp16(kv.back(), false, l, cached, prompt - cached),
                   LayerSliceFp16(kv.back(), true, l, cached, prompt - cached), Call());
      status = held.status();
    }
    if (!status.ok()) break;
  }
  absl::StatusOr<std::unique_ptr<client::AttendSession>> session;
  if (status.ok()) {
    session = c.OpenAttendStream(SessionCall());
    status = session.status();
  }
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(d));
  v1::AttendResponse resp;  // every step's, its buffers reused
  for (int s = 0; s < w.steps && status.ok(); ++s) {
    const int pos = prompt + s;  // the new token's position
    for (int l = 0; l < layers && status.ok(); ++l) {
      v1::AttendRequest req;
      req.set_layer(l);
      req.set_num_q_heads(w.q_heads);
      req.set_output_dtype(v1::OUTPUT_DTYPE_FP32);
      std::vector<std::vector<float>> qs;
      for (size_t i = 0; i < batch.size(); ++i) {
        qs.push_back(testing::FromHalf(testing::ToHalf(testing::MakeNormal(
            static_cast<size_t>(w.q_heads) * d, seed * 65537 + (batch[i] * 1000 + s) * 131 + l))));
        const std::vector<uint16_t> q = testing::ToHalf(qs.back());
        const std::vector<uint16_t> k = LayerSliceFp16(kv[i], false, l, pos, 1);
        const std::vector<uint16_t> v = LayerSliceFp16(kv[i], true, l, pos, 1);
        v1::AttendItem* item = req.add_items();
        item->set_lease_id(leases[i]);
        item->set_q(q.data(), q.size() * 2);
        item->set_new_k(k.data(), k.size() * 2);
        item->set_new_v(v.data(), v.size() * 2);
        item->set_new_token_id(ids[i][pos]);
      }
      status = step_times.Time([&] { return (*session)->Step(req, &resp); });
      if (!status.ok()) break;
      const std::vector<float> out = Floats(resp.out());
      const size_t per_item = static_cast<size_t>(w.q_heads) * d;
      if (out.size() != per_item * batch.size()) {
        status = absl::DataLossError("AttendResponse.out has the wrong size");
        break;
      }
      for (size_t i = 0; i < batch.size(); ++i) {
        if (resp.context_tokens_size() > static_cast<int>(i) &&
            resp.context_tokens(i) != static_cast<uint32_t>(pos + 1)) {
          status = absl::DataLossError(
              absl::StrFormat("attended %u tokens, expected %d", resp.context_tokens(i), pos + 1));
          break;
        }
        error.Add(absl::MakeConstSpan(&out[i * per_item], per_item),
                  ReferenceAttention(qs[i], w.q_heads, kv[i], l, pos + 1, sm_scale));
      }
    }
    for (size_t i = 0; i < batch.size() && status.ok(); ++i) progress.StepDone();
  }
  if (session.ok() && *session != nullptr) {
    absl::Status finished = (*session)->Finish();
    if (status.ok()) status = finished;
  }
  ReleaseAll(c, leases);
  return status;
}

}  // namespace

int RunDemo() {
  const std::string target = absl::GetFlag(FLAGS_target);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  std::unique_ptr<client::KvPoolClient> c = client::KvPoolClient::Create(target, Options());
  absl::StatusOr<v1::NamespaceInfo> info = DemoNamespace(*c);
  if (!info.ok()) {
    std::fprintf(stderr, "demo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const std::string ns = info->spec().name();
  Workload w;
  w.requests = absl::GetFlag(FLAGS_requests);
  w.system = absl::GetFlag(FLAGS_system_tokens);
  w.user = absl::GetFlag(FLAGS_user_tokens);
  w.steps = absl::GetFlag(FLAGS_decode_steps);
  w.q_heads = info->spec().num_kv_heads() * absl::GetFlag(FLAGS_q_heads_per_kv_head);
  if (w.requests <= 0 || w.system < 0 || w.user <= 0 || w.steps <= 0 || w.q_heads <= 0) {
    std::fprintf(stderr, "demo: --requests, --user_tokens, --decode_steps must be positive\n");
    return 2;
  }
  w.system_ids = MakeTokenIds(w.system, seed * 31);
  w.universe = MakeLayeredKv(info->spec().num_layers(), w.system + w.requests * (w.user + w.steps),
                             info->spec().num_kv_heads(), info->spec().head_dim(), seed);
  std::printf("demo: %d requests (%d-token shared system prompt + %d-token user turns), %d "
              "decode steps each, namespace %s (%u layers, %u KV heads, head_dim %u, %d q "
              "heads), server %s\n",
              w.requests, w.system, w.user, w.steps, ns.c_str(), info->spec().num_layers(),
              info->spec().num_kv_heads(), info->spec().head_dim(), w.q_heads, target.c_str());

  Progress progress(w.requests, w.steps);
  FirstError first_error;
  // Prefill: workers take requests in order, each on its own channel.
  const int prefillers = std::max(1, absl::GetFlag(FLAGS_prefill_workers));
  std::vector<CallTimes> put_times(prefillers);
  std::atomic<int> next{0};
  std::atomic<uint64_t> put_bytes{0}, prefix_cached{0};
  std::vector<std::thread> workers;
  for (int p = 0; p < prefillers; ++p) {
    workers.emplace_back([&, p] {
      std::unique_ptr<client::KvPoolClient> pc =
          client::KvPoolClient::Create(target, Options(p + 1));
      for (int r = next++; r < w.requests; r = next++) {
        uint64_t cached = 0;
        absl::StatusOr<uint64_t> bytes = Prefill(*pc, ns, w, r, seed, &cached, put_times[p]);
        if (!bytes.ok()) return first_error.Set(bytes.status(), "prefill");
        put_bytes += *bytes;
        prefix_cached += cached;
        progress.PrefillDone();
      }
    });
  }
  for (std::thread& t : workers) t.join();
  workers.clear();

  // Decode: worker i serves requests i, i + W, ... as one batch.
  const int decoders = std::max(1, std::min(absl::GetFlag(FLAGS_decode_workers), w.requests));
  std::vector<RelativeError> errors(decoders);
  std::vector<CallTimes> step_times(decoders);
  for (int i = 0; i < decoders && first_error.Get().ok(); ++i) {
    workers.emplace_back([&, i] {
      std::vector<int> batch;
      for (int r = i; r < w.requests; r += decoders) batch.push_back(r);
      std::unique_ptr<client::KvPoolClient> dc =
          client::KvPoolClient::Create(target, Options(100 + i));
      first_error.Set(Decode(*dc, ns, w, batch, seed, progress, errors[i], step_times[i]),
                      "decode");
    });
  }
  for (std::thread& t : workers) t.join();
  progress.End();
  if (absl::Status s = first_error.Get(); !s.ok()) {
    std::fprintf(stderr, "demo failed: %s\n", s.ToString().c_str());
    return 1;
  }

  RelativeError error;
  for (const RelativeError& e : errors) {
    error.err2 += e.err2;
    error.ref2 += e.ref2;
  }
  absl::StatusOr<v1::StatsResponse> after = c->Stats(Call());
  if (!after.ok()) {
    std::fprintf(stderr, "demo: %s\n", after.status().ToString().c_str());
    return 1;
  }
  const v1::NamespaceStats* ns_stats = nullptr;
  for (const v1::NamespaceStats& n : after->namespaces()) {
    if (n.name() == ns) ns_stats = &n;
  }
  const double stored_bpt = info->bytes_per_token();
  const double fp16_bpt = info->fp16_bytes_per_token();
  const uint64_t prompt_tokens = static_cast<uint64_t>(w.requests) * w.PromptTokens();
  // The workers run side by side: a phase's rate is its work over the busiest worker's time
  // inside the timed calls (building K/V and the reference attention are the client's own work).
  double put_secs = 0, step_secs = 0;
  std::vector<double> step_us;
  for (const CallTimes& t : put_times) put_secs = std::max(put_secs, t.secs);
  for (const CallTimes& t : step_times) {
    step_secs = std::max(step_secs, t.secs);
    step_us.insert(step_us.end(), t.us.begin(), t.us.end());
  }
  std::printf("tokens stored:        %llu in namespace %s (backend %s)\n",
              static_cast<unsigned long long>(ns_stats ? ns_stats->tokens_stored() : 0),
              ns.c_str(), after->backend().c_str());
  std::printf("bytes per token:      %.0f stored vs %.0f fp16 (%.2fx smaller)\n", stored_bpt,
              fp16_bpt, stored_bpt > 0 ? fp16_bpt / stored_bpt : 0.0);
  std::printf(
      "prefix hit rate:      %.1f%% (%llu of %llu prompt tokens already cached when the "
      "prefill workers matched them)\n",
      100.0 * prefix_cached.load() / prompt_tokens,
      static_cast<unsigned long long>(prefix_cached.load()),
      static_cast<unsigned long long>(prompt_tokens));
  std::printf("attention rel. error: %.4f vs fp64 attention over the fp16 K/V (quantization "
              "error of puts: %.4f)\n",
              error.Value(), ns_stats ? ns_stats->quant_rel_error() : 0.0);
  std::printf(
      "throughput:           Put %.3f GB/s fp16 (%.1f MB in %.2f s of Put calls); %.1f "
      "decode steps/s (%d x %d layers in %.2f s of Attend steps)\n",
      put_secs > 0 ? put_bytes.load() / put_secs / 1e9 : 0.0, put_bytes.load() / 1e6, put_secs,
      step_secs > 0 ? w.requests * w.steps / step_secs : 0.0, w.requests * w.steps,
      info->spec().num_layers(), step_secs);
  std::printf(
      "attend step latency:  p50 %.0f us, p99 %.0f us (%zu steps of up to %d requests "
      "x 1 layer)\n",
      bench::Percentile(step_us, 0.5), bench::Percentile(step_us, 0.99), step_us.size(),
      (w.requests + decoders - 1) / decoders);
  const double max_error = absl::GetFlag(FLAGS_max_rel_error);
  if (!(error.Value() <= max_error)) {
    std::fprintf(stderr, "demo failed: attention error %.4f above --max_rel_error %.4f\n",
                 error.Value(), max_error);
    return 1;
  }
  return 0;
}

}  // namespace kvpool::cli
