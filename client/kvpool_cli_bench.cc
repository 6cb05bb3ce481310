// `kvpool bench put` and `kvpool bench attend`: throughput of parallel Put streams and latency
// of the Attend RPC against a running server.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/attend_socket_session.h"
#include "client/kvpool_cli.h"
#include "kvpool/v1/attend_region.h"
#include "tests/common/bench_output.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(int32_t, streams, 4, "bench put: parallel Put streams, one channel each");
ABSL_FLAG(int32_t, chunk_tokens, 64, "bench put: tokens per Put message");
ABSL_FLAG(double, seconds, 5.0, "bench put: duration");
ABSL_FLAG(int32_t, batch, 8, "bench attend: sequences per Attend RPC");
ABSL_FLAG(int32_t, context, 1024, "bench attend: cached tokens per sequence");
ABSL_FLAG(int32_t, iters, 200, "bench attend: timed RPCs (after 10 warm-up RPCs)");
ABSL_FLAG(bool, append, false,
          "bench attend: every item of every call also appends a new token's K/V (a decode step)");
ABSL_FLAG(bool, stream, false,
          "bench attend: one AttendStream step per call instead of unary Attend");
ABSL_FLAG(int32_t, layer, -1,
          "bench attend: the layer of every call (-1 = the namespace's layers in turn, as a decode "
          "loop visits them)");
ABSL_FLAG(bool, in_place, false,
          "bench attend with --attend_unix_socket: each step's q (and new K/V) is written into the "
          "shared-memory region before the timed step, which sends only the rest and leaves the "
          "output there (what a decode worker that fills the region itself sees)");

namespace kvpool::cli {

using bench::Percentile;

int RunBenchPut() {
  const int streams = absl::GetFlag(FLAGS_streams);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int chunk_tokens = absl::GetFlag(FLAGS_chunk_tokens);
  if (streams <= 0 || tokens <= 0 || chunk_tokens <= 0) {
    std::fprintf(stderr, "bench put: --streams, --tokens and --chunk_tokens must be positive\n");
    return 2;
  }
  std::unique_ptr<client::KvPoolClient> probe =
      client::KvPoolClient::Create(absl::GetFlag(FLAGS_target), Options());
  absl::StatusOr<v1::NamespaceInfo> info = ResolveNamespace(*probe);
  if (!info.ok()) {
    std::fprintf(stderr, "bench put: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const v1::NamespaceSpec& spec = info->spec();
  // One K/V payload shared by every stream.
  const client::SequenceKv kv =
      ToSequenceKv(MakeLayeredKv(spec.num_layers(), tokens, spec.num_kv_heads(), spec.head_dim(),
                                 absl::GetFlag(FLAGS_seed)),
                   0, tokens);
  const size_t chunk_bytes = size_t{2} * chunk_tokens * kv.num_kv_heads * kv.head_dim * 2;
  const absl::Duration duration = absl::Seconds(absl::GetFlag(FLAGS_seconds));

  // Token ids differ per Put and per invocation, so no Put hits blocks cached by an earlier
  // bench run against the same server: every byte received is quantized and stored.
  const uint64_t run_nonce = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  std::atomic<uint64_t> bytes{0}, puts{0}, stored{0};
  FirstError first_error;
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      std::unique_ptr<client::KvPoolClient> c =
          client::KvPoolClient::Create(absl::GetFlag(FLAGS_target), Options(s + 1, chunk_bytes));
      for (uint64_t i = 0; absl::Now() - start < duration; ++i) {
        const std::vector<int32_t> ids = MakeTokenIds(
            tokens, (absl::GetFlag(FLAGS_seed) * 7919 + (s << 24) + i) ^ (run_nonce << 20));
        absl::StatusOr<v1::PutResponse> r = c->Put(spec.name(), ids, kv, Call());
        if (!r.ok()) return first_error.Set(r.status());
        bytes += r->bytes_received();
        stored += r->tokens_stored();
        ++puts;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  if (absl::Status s = first_error.Get(); !s.ok()) {
    std::fprintf(stderr, "bench put: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf(
      "bench put: %d streams, %llu puts of %d tokens (%d layers, %d tokens/message) in "
      "%.2f s: %.3f GB/s fp16, %.0f tokens/s, %llu tokens stored\n",
      streams, static_cast<unsigned long long>(puts.load()), tokens, spec.num_layers(),
      chunk_tokens, secs, bytes.load() / secs / 1e9, puts.load() * tokens / secs,
      static_cast<unsigned long long>(stored.load()));
  return 0;
}

int RunBenchAttend() {
  const int batch = absl::GetFlag(FLAGS_batch);
  const int context = absl::GetFlag(FLAGS_context);
  const int iters = absl::GetFlag(FLAGS_iters);
  if (batch <= 0 || context <= 0 || iters <= 0) {
    std::fprintf(stderr, "bench attend: --batch, --context and --iters must be positive\n");
    return 2;
  }
  std::unique_ptr<client::KvPoolClient> c =
      client::KvPoolClient::Create(absl::GetFlag(FLAGS_target), Options());
  absl::StatusOr<v1::NamespaceInfo> info = ResolveNamespace(*c);
  if (!info.ok()) {
    std::fprintf(stderr, "bench attend: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const v1::NamespaceSpec& spec = info->spec();
  const bool in_place = absl::GetFlag(FLAGS_in_place);
  if (in_place && c->options().attend_unix_socket.empty()) {  // before any lease is taken
    std::fprintf(stderr, "bench attend: --in_place needs --attend_unix_socket\n");
    return 2;
  }
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  // One random layer repeated over every layer: a step reads one layer, and generating distinct
  // K/V for every layer cost ~9 s of CPU per 4K tokens of context at 32 layers (~75 s at 32K).
  client::SequenceKv kv = ToSequenceKv(
      MakeLayeredKv(1, context, spec.num_kv_heads(), spec.head_dim(), seed), 0, context);
  const size_t layer_elems = kv.LayerElements();
  kv.num_layers = spec.num_layers();
  kv.k.resize(layer_elems * kv.num_layers);
  kv.v.resize(layer_elems * kv.num_layers);
  for (uint32_t l = 1; l < kv.num_layers; ++l) {
    std::copy_n(kv.k.begin(), layer_elems, kv.k.begin() + l * layer_elems);
    std::copy_n(kv.v.begin(), layer_elems, kv.v.begin() + l * layer_elems);
  }
  // Each sequence is pinned by its lease as soon as it is stored (a later Put cannot evict it),
  // under a lease as long as a session may be (the server's default could expire while the later
  // Puts run, before the timing begins).
  std::vector<uint64_t> leases;
  absl::Status status;
  for (int b = 0; b < batch && status.ok(); ++b) {
    const std::vector<int32_t> ids = MakeTokenIds(context, seed * 104729 + b);
    status = c->Put(spec.name(), ids, kv, Call()).status();
    if (!status.ok()) break;
    absl::StatusOr<v1::MatchResponse> m =
        c->Match(spec.name(), ids, SessionCall().deadline, Call());
    if (!m.ok()) {
      status = m.status();
      break;
    }
    leases.push_back(m->lease_id());
    if (m->cached_tokens() != static_cast<uint32_t>(context)) {
      status = absl::ResourceExhaustedError(absl::StrFormat(
          "sequence %d holds %d of its %d tokens: the namespace cannot hold --batch x --context", b,
          m->cached_tokens(), context));
    }
  }
  const int q_heads = spec.num_kv_heads() * absl::GetFlag(FLAGS_q_heads_per_kv_head);
  const std::vector<uint16_t> q =
      testing::ToHalf(testing::MakeNormal(size_t{1} * q_heads * spec.head_dim(), seed));
  const bool append = absl::GetFlag(FLAGS_append);
  const std::vector<uint16_t> new_kv = testing::ToHalf(
      testing::MakeNormal(size_t{1} * spec.num_kv_heads() * spec.head_dim(), seed + 1));
  const bool stream = absl::GetFlag(FLAGS_stream);
  const int fixed_layer = absl::GetFlag(FLAGS_layer);
  std::unique_ptr<client::AttendSession> session;
  std::unique_ptr<client::InPlaceAttendSession> in_place_session;
  if (in_place && status.ok()) {
    absl::StatusOr<std::unique_ptr<client::InPlaceAttendSession>> opened =
        client::OpenInPlaceAttendSession(
            c->options().attend_unix_socket, c->options().attend_region_bytes,
            absl::Now() + SessionCall().deadline, c->options().attend_spin,
            static_cast<uint32_t>(c->options().max_message_bytes));
    if (opened.ok()) {
      in_place_session = std::move(*opened);
    } else {
      status = opened.status();
    }
  } else if (stream && status.ok()) {
    absl::StatusOr<std::unique_ptr<client::AttendSession>> opened =
        c->OpenAttendStream(SessionCall());
    if (opened.ok()) {
      session = std::move(*opened);
    } else {
      status = opened.status();
    }
  }
  std::vector<double> latency_us;
  v1::AttendResponse response;
  uint32_t attended = 0;
  for (int i = 0; i < iters + 10 && status.ok(); ++i) {
    v1::AttendRequest req;
    req.set_layer(fixed_layer >= 0 ? fixed_layer : i % spec.num_layers());
    req.set_num_q_heads(q_heads);
    for (uint64_t lease : leases) {
      v1::AttendItem* item = req.add_items();
      item->set_lease_id(lease);
      item->set_q(q.data(), q.size() * sizeof(uint16_t));
      item->set_new_token_id(-1);
      if (append) {
        item->set_new_k(new_kv.data(), new_kv.size() * sizeof(uint16_t));
        item->set_new_v(new_kv.data(), new_kv.size() * sizeof(uint16_t));
      }
    }
    if (in_place_session) {  // the arrays go into the region before the clock starts
      const size_t q_bytes = q.size() * sizeof(uint16_t);
      const size_t kv_bytes = new_kv.size() * sizeof(uint16_t);
      const std::optional<attend_socket::RegionStepLayout> layout = attend_socket::LayoutRegionStep(
          leases.size(), append ? leases.size() : 0, q_bytes, kv_bytes, q_bytes);  // fp16 output
      if (!layout.has_value() || layout->end > in_place_session->region_bytes()) {
        status = absl::InvalidArgumentError("the step does not fit --attend_region_bytes");
        break;
      }
      uint8_t* region = in_place_session->region();
      for (int b = 0; b < req.items_size(); ++b) {
        v1::AttendItem* item = req.mutable_items(b);
        std::memcpy(region + layout->q + b * q_bytes, item->q().data(), q_bytes);
        item->clear_q();
        if (!append) continue;
        std::memcpy(region + layout->new_k + b * kv_bytes, item->new_k().data(), kv_bytes);
        std::memcpy(region + layout->new_v + b * kv_bytes, item->new_v().data(), kv_bytes);
        item->clear_new_k();
        item->clear_new_v();
        item->set_append_in_region(true);
      }
      req.set_region_q_bytes(layout->q_bytes);
      req.set_region_kv_bytes(layout->kv_bytes);
    }
    const absl::Time start = absl::Now();
    if (session) {  // into the same message every step, as a decode loop would
      status = session->Step(req, &response);
    } else {
      absl::StatusOr<v1::AttendResponse> r =
          in_place_session ? in_place_session->StepInPlace(req) : c->Attend(req, Call());
      status = r.status();
      if (r.ok()) response = *std::move(r);
    }
    const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
    if (!status.ok()) break;
    if (i >= 10) latency_us.push_back(us);
    if (response.context_tokens_size() > 0) attended = response.context_tokens(0);
  }
  if (session) session->Finish().IgnoreError();
  if (in_place_session) in_place_session->Finish().IgnoreError();
  ReleaseAll(*c, leases);
  if (!status.ok()) {
    std::fprintf(stderr, "bench attend: %s\n", status.ToString().c_str());
    return 1;
  }
  std::printf(
      "bench attend: batch %d x %u context tokens, %d q heads, %d %s%s: p50 %.0f us, "
      "p99 %.0f us\n",
      batch, attended, q_heads, iters,
      in_place                                   ? "AttendSocket in-place region steps"
      : !stream                                  ? "unary RPCs"
      : !c->options().attend_unix_socket.empty() ? "AttendSocket region steps"
      : c->options().attend_socket_port != 0     ? "AttendSocket steps"
                                                 : "AttendStream steps",
      append ? " with a new token each" : "", Percentile(latency_us, 0.5),
      Percentile(latency_us, 0.99));
  return 0;
}

}  // namespace kvpool::cli
