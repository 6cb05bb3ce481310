// RequestFuzzer's random values, lease model, server checks and step loop; the operations are in
// request_fuzzer_rpcs.cc, request_fuzzer_attend.cc and request_fuzzer_socket.cc.
#include "tests/fuzz/request_fuzzer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/common/kv_test_data.h"

namespace kvpool::testing {
namespace {

// The operations Step picks from, in FuzzOpMix's order.
enum class Op {
  kCreateNamespace,
  kPut,
  kMatch,
  kGet,
  kAppend,
  kAttend,
  kAttendStream,
  kRelease,
  kSocket,
  kStats,
  kAdvanceClock,
};

std::discrete_distribution<int> OpPicker(const FuzzOpMix& m) {
  return std::discrete_distribution<int>({
      static_cast<double>(m.create_namespace),
      static_cast<double>(m.put),
      static_cast<double>(m.match),
      static_cast<double>(m.get),
      static_cast<double>(m.append),
      static_cast<double>(m.attend),
      static_cast<double>(m.attend_stream),
      static_cast<double>(m.release),
      static_cast<double>(m.socket),
      static_cast<double>(m.stats),
      static_cast<double>(m.advance_clock),
  });
}

// fp16 bit patterns: NaN, +Inf, -Inf (always refused); 65504, 32768, -65504 (past the bound of
// rotated layers, 65504 / sqrt(rotation_block)); 512 (large, and within it).
constexpr uint16_t kBadHalves[] = {0x7e00, 0x7c00, 0xfc00, 0x7bff, 0x7800, 0xfbff, 0x6000};

// Token ids RandomTokens draws are below this; RoundTrip's are above it.
constexpr int32_t kFuzzTokenIds = 50000;
constexpr int32_t kRoundTripFirstId = 900000;
// Relative L2 error RoundTrip accepts: several times INT4's, far below the ~1.4 of unrelated data.
constexpr double kRoundTripMaxError = 0.2;

bool AttachedRegionsReleased(TestServer* server) {
  return server->server->registry()->Serialize().find("kvpool_attend_region_bytes 0\n") !=
         std::string::npos;
}

}  // namespace

// ---- SharedLeasePool ----

void SharedLeasePool::Add(FuzzLease lease) {
  absl::MutexLock lock(&mu_);
  leases_.push_back(std::move(lease));
}

std::vector<FuzzLease> SharedLeasePool::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return leases_;
}

std::vector<uint64_t> SharedLeasePool::Update(const std::vector<FuzzLease>& before,
                                              const std::vector<FuzzLease>& after) {
  auto ids = [](const std::vector<FuzzLease>& leases) {
    std::set<uint64_t> out;
    for (const FuzzLease& l : leases) out.insert(l.id);
    return out;
  };
  const std::set<uint64_t> had = ids(before);
  const std::set<uint64_t> has = ids(after);
  std::vector<uint64_t> evicted;
  absl::MutexLock lock(&mu_);
  leases_.erase(std::remove_if(leases_.begin(), leases_.end(),
                               [&](const FuzzLease& l) {
                                 return had.count(l.id) > 0 && has.count(l.id) == 0;
                               }),
                leases_.end());
  for (const FuzzLease& l : after) {
    if (had.count(l.id) == 0) leases_.push_back(l);
  }
  while (leases_.size() > capacity_) {
    evicted.push_back(leases_.front().id);
    leases_.erase(leases_.begin());
  }
  return evicted;
}

std::vector<uint64_t> SharedLeasePool::TakeAll() {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> ids;
  for (const FuzzLease& l : leases_) ids.push_back(l.id);
  leases_.clear();
  return ids;
}

// ---- RequestFuzzer: set-up and the step loop ----

RequestFuzzer::RequestFuzzer(const FuzzTarget& target, const FuzzOptions& options,
                             const FuzzOpMix& mix)
    : target_(target),
      options_(options),
      stub_(target.server->stub.get()),
      rng_(options.seed),
      op_picker_(OpPicker(mix)) {
  EXPECT_TRUE(options.mode == FuzzMode::kAlone || mix.advance_clock == 0)
      << "only a fuzzer alone on its server may move the clock";
  RefreshNamespaces();
}

void RequestFuzzer::Run(uint64_t steps) {
  for (uint64_t i = 0; i < steps && failures_ < kMaxFailures; ++i) Step();
}

void RequestFuzzer::Step() {
  std::vector<FuzzLease> before;
  if (options_.shared_leases != nullptr) {
    leases_ = options_.shared_leases->Snapshot();
    before = leases_;
  }
  switch (static_cast<Op>(op_picker_(rng_))) {
    case Op::kCreateNamespace:
      CreateNamespace();
      break;
    case Op::kPut:
      Put();
      break;
    case Op::kMatch:
      Match();
      break;
    case Op::kGet:
      Get();
      break;
    case Op::kAppend:
      Append();
      break;
    case Op::kAttend:
      Attend();
      break;
    case Op::kAttendStream:
      AttendStream();
      break;
    case Op::kRelease:
      Release();
      break;
    case Op::kSocket:
      Socket();
      break;
    case Op::kStats:
      CheckStats();
      break;
    case Op::kAdvanceClock:
      AdvanceClock();
      break;
  }
  if (options_.mode == FuzzMode::kAlone) {
    if (step_ % 50 == 49) {
      CheckStats();
      RoundTrip();
    }
  } else if (step_ % 20 == 19) {
    RefreshNamespaces();  // to use the namespaces other fuzzers created
  }
  if (options_.shared_leases != nullptr) {
    SyncSharedLeases(before);
  } else {
    ReleaseOldLeases();
  }
  ++step_;
}

void RequestFuzzer::ReleaseLease(uint64_t id, const std::string& why) {
  grpc::ClientContext ctx;
  v1::ReleaseRequest req;
  req.set_lease_id(id);
  v1::ReleaseResponse r;
  const grpc::Status st = stub_->Release(&ctx, req, &r);
  const bool ok = st.ok() || (LeaseMayVanish() && st.error_code() == grpc::StatusCode::NOT_FOUND);
  if (!ok) Fail(absl::StrCat("Release of ", why, " ", id, ": ", st.error_message()));
}

void RequestFuzzer::ReleaseOldLeases() {
  while (leases_.size() > options_.max_leases) {
    const uint64_t id = leases_.front().id;
    leases_.erase(leases_.begin());
    ReleaseLease(id, "an old lease");
  }
}

void RequestFuzzer::SyncSharedLeases(const std::vector<FuzzLease>& before) {
  const std::vector<uint64_t> evicted = options_.shared_leases->Update(before, leases_);
  leases_.clear();
  for (uint64_t id : evicted) ReleaseLease(id, "a lease past the pool's capacity");
}

void RequestFuzzer::ReleaseAll() {
  std::vector<FuzzLease> leases;
  leases.swap(leases_);
  for (const FuzzLease& l : leases) ReleaseLease(l.id, "a held lease");
  if (options_.shared_leases == nullptr) return;
  for (uint64_t id : options_.shared_leases->TakeAll()) ReleaseLease(id, "a pooled lease");
}

std::string RequestFuzzer::CodeSummary() const {
  std::string out;
  for (const auto& [rpc, counts] : codes_) {
    absl::StrAppend(&out, rpc, ":");
    for (const auto& [code, n] : counts) absl::StrAppend(&out, " ", static_cast<int>(code), "x", n);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

// ---- random values ----

uint64_t RequestFuzzer::Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

bool RequestFuzzer::Chance(double p) {
  return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
}

uint32_t RequestFuzzer::EdgeU32() {
  switch (Below(8)) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return std::numeric_limits<uint32_t>::max();
    case 3:
      return 0x80000000u;
    case 4:
      return static_cast<uint32_t>(Below(5000));
    case 5:
      return 1u << Below(32);
    default:
      return static_cast<uint32_t>(Below(64));
  }
}

std::string RequestFuzzer::RandomHalves(size_t count, bool may_be_bad) {
  std::vector<uint16_t> h = ToHalf(MakeNormal(count, rng_()));
  if (may_be_bad && count > 0 && BadChance(0.08)) {
    const int n = 1 + static_cast<int>(Below(3));
    for (int i = 0; i < n; ++i) h[Below(count)] = kBadHalves[Below(std::size(kBadHalves))];
  }
  return std::string(reinterpret_cast<const char*>(h.data()), count * 2);
}

std::string RequestFuzzer::Fp16Payload(size_t bytes) {
  if (!BadChance(0.07)) return RandomHalves(bytes / 2);
  switch (Below(5)) {
    case 0:
      return "";
    case 1:
      return std::string(bytes + 1, '\0');
    case 2:
      return bytes >= 2 ? std::string(bytes - 2, '\0') : std::string(3, 'x');
    case 3:
      return std::string(bytes * 2 + 2, '\0');
    default:
      return std::string(Below(100), '\x11');
  }
}

std::vector<int32_t> RequestFuzzer::RandomTokens(const NamespaceGeometry* g) {
  std::vector<int32_t> t;
  const uint32_t block_tokens = g != nullptr ? std::max<uint32_t>(1, g->block_tokens) : 16;
  if (!prompts_.empty() && Chance(0.5)) {
    t = prompts_[Below(prompts_.size())];
    if (Chance(0.5)) t.resize(Below(t.size() + 1));
  }
  const uint64_t fresh = Chance(0.1) ? Below(400) : Below(3 * block_tokens + 3);
  for (uint64_t i = 0; i < fresh; ++i) t.push_back(static_cast<int32_t>(Below(kFuzzTokenIds)));
  if (!t.empty() && BadChance(0.04)) t[Below(t.size())] = -1 - static_cast<int32_t>(Below(5));
  if (Chance(0.01)) t.assign(70000, 7);  // a long sequence: many blocks of one hash chain
  return t;
}

std::string RequestFuzzer::PickNamespace() {
  if (Chance(0.05)) return Chance(0.5) ? "nope" : "";
  auto it = namespaces_.begin();
  std::advance(it, Below(namespaces_.size()));
  return it->first;
}

uint64_t RequestFuzzer::PickLeaseId(FuzzLease** lease) {
  *lease = nullptr;
  if (!leases_.empty() && Chance(0.9)) {
    *lease = &leases_[Below(leases_.size())];
    return (*lease)->id;
  }
  const uint64_t edge_ids[] = {0, 1, ~uint64_t{0}, uint64_t{1} << 63};
  return Chance(0.5) ? edge_ids[Below(std::size(edge_ids))] : rng_();
}

// ---- model and checks ----

void RequestFuzzer::Fail(const std::string& what) {
  ++failures_;
  ADD_FAILURE() << "seed " << options_.seed << " step " << step_ << ": " << what;
}

void RequestFuzzer::CheckCode(const std::string& rpc, grpc::StatusCode code, const CodeSet& allowed,
                              const std::string& detail) {
  ++codes_[rpc][code];
  if (options_.verbose && code != grpc::StatusCode::OK) {
    std::printf("  %s %d %s\n", rpc.c_str(), static_cast<int>(code), detail.substr(0, 160).c_str());
  }
  if (allowed.count(code) == 0) {
    Fail(absl::StrCat(rpc, " returned code ", static_cast<int>(code), ": ", detail));
  }
}

void RequestFuzzer::RefreshNamespaces() {
  grpc::ClientContext ctx;
  v1::ListNamespacesResponse r;
  const grpc::Status st = stub_->ListNamespaces(&ctx, {}, &r);
  if (!st.ok()) {
    Fail("ListNamespaces: " + st.error_message());
    return;
  }
  for (const v1::NamespaceInfo& n : r.namespaces()) {
    NamespaceGeometry& g = namespaces_[n.spec().name()];
    g.layers = n.spec().num_layers();
    g.kv_heads = n.spec().num_kv_heads();
    g.head_dim = n.spec().head_dim();
    g.block_tokens = n.spec().block_tokens();
  }
}

const RequestFuzzer::NamespaceGeometry* RequestFuzzer::Geometry(const std::string& ns) {
  const std::string& name = ns.empty() ? target_.default_namespace.name : ns;
  auto it = namespaces_.find(name);
  if (it == namespaces_.end() && name != "nope") {  // perhaps another fuzzer's new namespace
    RefreshNamespaces();
    it = namespaces_.find(name);
  }
  return it == namespaces_.end() ? nullptr : &it->second;
}

FuzzLease* RequestFuzzer::FindLease(uint64_t id) {
  for (FuzzLease& l : leases_) {
    if (l.id == id) return &l;
  }
  return nullptr;
}

void RequestFuzzer::Forget(uint64_t id) {
  leases_.erase(std::remove_if(leases_.begin(), leases_.end(),
                               [id](const FuzzLease& l) { return l.id == id; }),
                leases_.end());
}

grpc::Status RequestFuzzer::HeldTokens(uint64_t id, uint32_t layer, int64_t* tokens) {
  v1::GetRequest req;
  req.set_lease_id(id);
  req.set_layer_begin(layer);
  req.set_layer_end(layer + 1);
  req.set_head_end(1);  // the counts are the same for every head: read as little as possible
  std::vector<v1::GetResponse> out;
  const grpc::Status st = ReadAll(stub_, req, &out, absl::Seconds(60));
  *tokens = 0;
  for (const v1::GetResponse& m : out) *tokens += m.valid_tokens();
  return st;
}

void RequestFuzzer::CheckLeaseModel(uint64_t id, const std::string& after) {
  if (!ModelsTokens()) return;
  FuzzLease* lease = FindLease(id);
  if (lease == nullptr) return;
  for (uint32_t layer = 0; layer < lease->layer_tokens.size(); ++layer) {
    int64_t held = 0;
    const grpc::Status st = HeldTokens(id, layer, &held);
    if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
      if (!LeaseMayVanish()) Fail("lease vanished after " + after);
      Forget(id);
      return;
    }
    if (!st.ok()) {
      Fail("Get of a modelled lease: " + st.error_message());
      return;
    }
    if (held != lease->layer_tokens[layer]) {
      Fail(absl::StrCat("lease ", id, " layer ", layer, " holds ", held, " tokens, the model ",
                        lease->layer_tokens[layer], ", after ", after));
      lease->layer_tokens[layer] = held;  // report each divergence once
    }
  }
}

void RequestFuzzer::CheckStats() {
  const v1::StatsResponse s = GetStats(stub_);
  for (const v1::NamespaceStats& n : s.namespaces()) {
    if (n.blocks_free() + n.blocks_in_use() + n.blocks_evictable() != n.blocks_total()) {
      Fail("block accounting: " + n.ShortDebugString());
    }
    if (n.sink_blocks_free() > n.sink_blocks_total()) {
      Fail("sink block accounting: " + n.ShortDebugString());
    }
  }
  if (options_.mode == FuzzMode::kAlone && !clock_moved_ && s.active_leases() != leases_.size()) {
    Fail(absl::StrCat("active_leases ", s.active_leases(), ", the model ", leases_.size()));
  }
}

void RequestFuzzer::RoundTrip() {
  const NamespaceConfig& c = target_.default_namespace;
  const int per_token = c.num_kv_heads * c.head_dim;
  const int tokens = 2 * c.block_tokens;
  // Ids no generator draws, new on every call: nothing of the sequence is cached yet.
  const int32_t first_id = kRoundTripFirstId + tokens * round_trips_++;
  const Sequence s = MakeSequence(c, tokens, first_id, rng_());
  v1::PutResponse put;
  grpc::Status st = PutSequence(stub_, c.name, s, per_token, c.block_tokens, &put);
  if (!st.ok()) {
    Fail("round trip Put: " + st.error_message());
    return;
  }
  const v1::MatchResponse m = MatchOk(stub_, c.name, s);
  if (m.cached_tokens() != static_cast<uint32_t>(tokens)) {
    Fail(absl::StrCat("round trip: ", m.cached_tokens(), " of ", tokens, " tokens cached"));
  }
  v1::GetRequest get;
  get.set_lease_id(m.lease_id());
  std::vector<v1::GetResponse> out;
  st = ReadAll(stub_, get, &out);
  if (!st.ok()) Fail("round trip Get: " + st.error_message());
  double err = 0, norm = 0;
  auto accumulate = [&](const std::string& got, const std::vector<uint16_t>& put_layer,
                        size_t offset, size_t values) {
    std::vector<uint16_t> h(got.size() / 2);
    std::memcpy(h.data(), got.data(), h.size() * 2);
    const std::vector<float> read = FromHalf(h);
    const std::vector<float> want = FromHalf(put_layer);
    for (size_t i = 0; i < values && i < read.size() && offset + i < want.size(); ++i) {
      err += (read[i] - want[offset + i]) * (read[i] - want[offset + i]);
      norm += want[offset + i] * want[offset + i];
    }
  };
  for (const v1::GetResponse& r : out) {
    const size_t offset = size_t{r.block_begin()} * c.block_tokens * per_token;
    const size_t values = size_t{r.valid_tokens()} * per_token;
    accumulate(r.k(), s.k[r.layer()], offset, values);
    accumulate(r.v(), s.v[r.layer()], offset, values);
  }
  const double rel = std::sqrt(err / std::max(norm, 1e-9));
  if (!(rel < kRoundTripMaxError) || norm == 0) {
    Fail(absl::StrCat("round trip relative error ", rel, " (first token id ", first_id, ", put ",
                      put.ShortDebugString(), ")"));
  }
  ReleaseOk(stub_, m.lease_id());
}

void RequestFuzzer::CheckIdleServer() {
  // Sessions, streams and their regions end on server threads after the client's side has.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  v1::StatsResponse s;
  bool idle = false;
  while (!idle && absl::Now() < deadline) {
    s = GetStats(stub_);
    idle = s.active_leases() == 0 && AttachedRegionsReleased(target_.server);
    for (const v1::NamespaceStats& n : s.namespaces()) idle = idle && n.blocks_in_use() == 0;
    if (!idle) absl::SleepFor(absl::Milliseconds(10));
  }
  if (s.active_leases() != 0) Fail(absl::StrCat(s.active_leases(), " leases active when idle"));
  if (!AttachedRegionsReleased(target_.server)) Fail("regions still attached when idle");
  for (const v1::NamespaceStats& n : s.namespaces()) {
    if (n.blocks_in_use() != 0) Fail("blocks in use with no lease: " + n.ShortDebugString());
    if (n.blocks_free() + n.blocks_in_use() + n.blocks_evictable() != n.blocks_total()) {
      Fail("block accounting: " + n.ShortDebugString());
    }
    // Only a cached sequence's first block holds a sink page once nothing is in use.
    if (n.sink_blocks_free() != n.sink_blocks_total() && n.blocks_evictable() == 0) {
      Fail("sink pages held with nothing cached: " + n.ShortDebugString());
    }
  }
}

}  // namespace kvpool::testing
