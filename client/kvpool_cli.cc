// kvpool: command-line tool for a kvpool server. Usage: kvpool [flags] <command>, where command
// is put | match | get | attend | stats | bench put | bench attend | demo. put/match/get/attend
// regenerate the same sequence from --tokens and --seed, so `put` then `get` compares the
// pool's copy with what was sent.
#include "client/kvpool_cli.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "tests/common/kv_test_data.h"

ABSL_FLAG(std::string, format, "fp16", "get: fp16 (dequantized) or raw (pages as stored)");
ABSL_FLAG(bool, keep_lease, false, "match: keep the lease (it expires after its TTL)");

namespace kvpool::cli {
namespace {

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "kvpool %s: %s\n", what, s.ToString().c_str());
  return 1;
}

// The sequence put/match/get/attend agree on: --tokens ids and K/V from --seed.
struct Sequence {
  v1::NamespaceInfo info;
  std::vector<int32_t> ids;
  LayeredKv kv;
};

absl::StatusOr<Sequence> MakeSequence(client::KvPoolClient& c) {
  absl::StatusOr<v1::NamespaceInfo> info = ResolveNamespace(c);
  if (!info.ok()) return info.status();
  const int tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens <= 0) return absl::InvalidArgumentError("--tokens must be positive");
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  Sequence s;
  s.info = *info;
  s.ids = MakeTokenIds(tokens, seed);
  s.kv = MakeLayeredKv(info->spec().num_layers(), tokens, info->spec().num_kv_heads(),
                       info->spec().head_dim(), seed);
  return s;
}

int Put(client::KvPoolClient& c) {
  absl::StatusOr<Sequence> s = MakeSequence(c);
  if (!s.ok()) return Fail(s.status(), "put");
  const client::SequenceKv kv = ToSequenceKv(s->kv, 0, s->kv.tokens);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::PutResponse> r = c.Put(s->info.spec().name(), s->ids, kv, Call());
  if (!r.ok()) return Fail(r.status(), "put");
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("put %zu tokens into \"%s\": cached %u, stored %u, ignored %u; %llu fp16 bytes "
              "in %.1f ms (%.3f GB/s)\n",
              s->ids.size(), s->info.spec().name().c_str(), r->tokens_cached(),
              r->tokens_stored(), r->tokens_ignored(),
              static_cast<unsigned long long>(r->bytes_received()), secs * 1e3,
              r->bytes_received() / secs / 1e9);
  return 0;
}

int Match(client::KvPoolClient& c) {
  absl::StatusOr<Sequence> s = MakeSequence(c);
  if (!s.ok()) return Fail(s.status(), "match");
  absl::StatusOr<v1::MatchResponse> m =
      c.Match(s->info.spec().name(), s->ids, absl::ZeroDuration(), Call());
  if (!m.ok()) return Fail(m.status(), "match");
  std::printf("lease %llu: %u of %zu tokens cached (%u blocks), expires at %s\n",
              static_cast<unsigned long long>(m->lease_id()), m->cached_tokens(),
              s->ids.size(), m->num_blocks(),
              absl::FormatTime(absl::FromUnixMillis(m->expires_unix_ms())).c_str());
  if (absl::GetFlag(FLAGS_keep_lease)) return 0;
  absl::Status released = c.Release(m->lease_id(), Call());
  return released.ok() ? 0 : Fail(released, "release");
}

int Get(client::KvPoolClient& c) {
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "fp16" && format != "raw") {
    return Fail(absl::InvalidArgumentError("--format must be fp16 or raw"), "get");
  }
  absl::StatusOr<Sequence> s = MakeSequence(c);
  if (!s.ok()) return Fail(s.status(), "get");
  absl::StatusOr<v1::MatchResponse> m =
      c.Match(s->info.spec().name(), s->ids, absl::ZeroDuration(), Call());
  if (!m.ok()) return Fail(m.status(), "match");
  v1::GetRequest req;
  req.set_lease_id(m->lease_id());
  req.set_format(format == "raw" ? v1::GET_FORMAT_RAW : v1::GET_FORMAT_FP16);
  const absl::Time start = absl::Now();
  absl::StatusOr<client::GetResult> g = c.Get(req, Call());
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  c.Release(m->lease_id(), Call()).IgnoreError();
  if (!g.ok()) return Fail(g.status(), "get");
  // fp16: compare the dequantized cached prefix with what `put` sent.
  RelativeError error;
  uint64_t blocks = 0;
  for (const client::GetLayer& layer : g->layers) {
    blocks += layer.num_blocks;
    if (g->format != v1::GET_FORMAT_FP16) continue;
    const std::vector<float> k =
        testing::FromHalf(std::vector<uint16_t>(reinterpret_cast<const uint16_t*>(layer.k.data()),
                                                reinterpret_cast<const uint16_t*>(
                                                    layer.k.data() + layer.k.size())));
    const size_t n = std::min<size_t>(k.size(), static_cast<size_t>(layer.valid_tokens) *
                                                    s->kv.heads * s->kv.head_dim);
    // The sequence `put` sent holds kv.num_layers layers of kv.tokens tokens: no more to compare.
    if (layer.layer >= static_cast<uint32_t>(s->kv.num_layers)) {
      return Fail(absl::DataLossError(absl::StrCat("layer ", layer.layer, " was not put")), "get");
    }
    const size_t m =
        std::min<size_t>(n, static_cast<size_t>(s->kv.tokens) * s->kv.heads * s->kv.head_dim);
    const float* ref = s->kv.K(layer.layer, 0);
    error.Add(absl::MakeConstSpan(k.data(), m), std::vector<double>(ref, ref + m));
  }
  std::printf("get %s: lease %llu, %u cached tokens, %zu layers, %llu layer-blocks, %llu bytes "
              "in %.1f ms (%.3f GB/s)\n",
              format.c_str(), static_cast<unsigned long long>(m->lease_id()),
              m->cached_tokens(), g->layers.size(), static_cast<unsigned long long>(blocks),
              static_cast<unsigned long long>(g->payload_bytes), secs * 1e3,
              g->payload_bytes / secs / 1e9);
  if (g->format == v1::GET_FORMAT_RAW && !g->layers.empty()) {
    const v1::PageLayoutDescriptor& l = g->layers.front().layout;
    std::printf("raw layout: dtype %s, head_dim %u, block_tokens %u, group %u, rotation %u, "
                "head page %u bytes (codes %u)\n",
                v1::KvDtype_Name(l.dtype()).c_str(), l.head_dim(), l.block_tokens(),
                l.group_size(), l.rotation_block(), l.head_page_bytes(), l.codes_bytes());
  } else if (error.ref2 > 0) {
    std::printf("K relative L2 error vs the fp16 sent: %.4f\n", error.Value());
  }
  return 0;
}

int Attend(client::KvPoolClient& c) {
  absl::StatusOr<Sequence> s = MakeSequence(c);
  if (!s.ok()) return Fail(s.status(), "attend");
  absl::StatusOr<v1::MatchResponse> m =
      c.Match(s->info.spec().name(), s->ids, absl::ZeroDuration(), Call());
  if (!m.ok()) return Fail(m.status(), "match");
  if (m->cached_tokens() == 0) {
    c.Release(m->lease_id(), Call()).IgnoreError();
    return Fail(absl::FailedPreconditionError("nothing cached; run `kvpool put` first"),
                "attend");
  }
  const int q_heads = s->kv.heads * absl::GetFlag(FLAGS_q_heads_per_kv_head);
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(s->kv.head_dim));
  RelativeError error;
  double total_us = 0;
  int code = 0;
  for (int layer = 0; layer < s->kv.num_layers; ++layer) {
    const std::vector<float> q = testing::FromHalf(testing::ToHalf(testing::MakeNormal(
        static_cast<size_t>(q_heads) * s->kv.head_dim, absl::GetFlag(FLAGS_seed) + layer)));
    v1::AttendRequest req;
    req.set_layer(layer);
    req.set_num_q_heads(q_heads);
    req.set_output_dtype(v1::OUTPUT_DTYPE_FP32);
    v1::AttendItem* item = req.add_items();
    item->set_lease_id(m->lease_id());
    const std::vector<uint16_t> qh = testing::ToHalf(q);
    item->set_q(qh.data(), qh.size() * sizeof(uint16_t));
    item->set_new_token_id(-1);
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::AttendResponse> r = c.Attend(req, Call());
    total_us += absl::ToDoubleMicroseconds(absl::Now() - start);
    if (!r.ok()) {
      code = Fail(r.status(), "attend");
      break;
    }
    const std::vector<float> out = Floats(r->out());
    if (out.size() != q.size()) {
      code = Fail(absl::DataLossError(
                      absl::StrCat("the output holds ", out.size(), " floats, not ", q.size())),
                  "attend");
      break;
    }
    error.Add(out, ReferenceAttention(q, q_heads, s->kv, layer, m->cached_tokens(), sm_scale));
  }
  c.Release(m->lease_id(), Call()).IgnoreError();
  if (code != 0) return code;
  std::printf("attend: %d layers over %u cached tokens, %d q heads; mean %.0f us per RPC; "
              "relative L2 error vs fp64 attention over the fp16 sent: %.4f\n",
              s->kv.num_layers, m->cached_tokens(), q_heads, total_us / s->kv.num_layers,
              error.Value());
  return 0;
}

int Stats(client::KvPoolClient& c) {
  absl::StatusOr<v1::StatsResponse> r = c.Stats(Call());
  if (!r.ok()) return Fail(r.status(), "stats");
  std::printf("backend %s, %llu active leases, prefix hits %llu of %llu query tokens\n",
              r->backend().c_str(), static_cast<unsigned long long>(r->active_leases()),
              static_cast<unsigned long long>(r->prefix_hit_tokens()),
              static_cast<unsigned long long>(r->prefix_query_tokens()));
  std::printf("%-20s %10s %10s %10s %10s %12s %10s %9s %9s %7s %9s\n", "namespace", "blocks",
              "free", "in_use", "evictable", "tokens", "evictions", "B/token", "fp16 B/t",
              "ratio", "quant err");
  for (const v1::NamespaceStats& n : r->namespaces()) {
    std::printf("%-20s %10llu %10llu %10llu %10llu %12llu %10llu %9.1f %9.1f %6.2fx %9.4f\n",
                n.name().c_str(), static_cast<unsigned long long>(n.blocks_total()),
                static_cast<unsigned long long>(n.blocks_free()),
                static_cast<unsigned long long>(n.blocks_in_use()),
                static_cast<unsigned long long>(n.blocks_evictable()),
                static_cast<unsigned long long>(n.tokens_stored()),
                static_cast<unsigned long long>(n.evictions()), n.bytes_per_token(),
                n.fp16_bytes_per_token(),
                n.bytes_per_token() > 0 ? n.fp16_bytes_per_token() / n.bytes_per_token() : 0.0,
                n.quant_rel_error());
  }
  return 0;
}

constexpr char kUsage[] =
    "kvpool [flags] <command>\n"
    "commands:\n"
    "  put           put a generated sequence (--tokens --seed --namespace)\n"
    "  match         longest cached prefix of that sequence\n"
    "  get           read it back (--format fp16|raw) and compare with what was put\n"
    "  attend        one remote decode-attention step per layer over it\n"
    "  stats         pool statistics\n"
    "  bench put     parallel Put streams (--streams --chunk_tokens --tokens --seconds)\n"
    "  bench attend  Attend latency (--batch --context --iters)\n"
    "  demo          prefill and decode workers sharing a system prompt, in a namespace of\n"
    "                their own (--demo_namespace --requests --decode_steps)\n"
    "common flags: --target --namespace (all but demo) --deadline_ms --session_deadline_ms";

int Run(const std::vector<std::string>& args) {
  const std::string cmd = absl::StrJoin(args, " ");
  // Checked before any command takes a lease it could not release on the way out.
  if (absl::GetFlag(FLAGS_q_heads_per_kv_head) < 1) {
    std::fprintf(stderr, "kvpool: --q_heads_per_kv_head must be at least 1\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_deadline_ms) <= 0 || absl::GetFlag(FLAGS_session_deadline_ms) <= 0) {
    std::fprintf(stderr, "kvpool: --deadline_ms and --session_deadline_ms must be positive\n");
    return 2;
  }
  if (cmd == "bench put") return RunBenchPut();
  if (cmd == "bench attend") return RunBenchAttend();
  if (cmd == "demo") return RunDemo();
  std::unique_ptr<client::KvPoolClient> c =
      client::KvPoolClient::Create(absl::GetFlag(FLAGS_target), Options());
  if (cmd == "put") return Put(*c);
  if (cmd == "match") return Match(*c);
  if (cmd == "get") return Get(*c);
  if (cmd == "attend") return Attend(*c);
  if (cmd == "stats") return Stats(*c);
  std::fprintf(stderr, "%s\n", kUsage);
  return 2;
}

}  // namespace
}  // namespace kvpool::cli

int main(int argc, char** argv) {
  // --help lists the flags of client/kvpool_cli*.cc (abseil looks for a file named after the
  // binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "client/kvpool_cli");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(kvpool::cli::kUsage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  return kvpool::cli::Run(std::vector<std::string>(positional.begin() + 1, positional.end()));
}
