// RequestFuzzer's decode steps: the Attend plans that Attend, AttendStream and the AttendSocket
// send, and the checks of their outcome.
//
// Allowed codes (proto/kvpool/v1/kvpool.proto, "Errors" and the AttendRequest comments):
// NOT_FOUND for an unknown lease; INVALID_ARGUMENT for a malformed batch (no items, layer or
// num_q_heads out of range, q or new K/V of the wrong size, NaN/Inf, new_k without new_v, leases
// of two namespaces, a negative token id other than -1, region fields where they do not belong);
// RESOURCE_EXHAUSTED for a batch over the server's limit or a pool full of pinned blocks;
// FAILED_PRECONDITION for a layer of a lease with an Append in flight (other fuzzers, in
// kSharedLeases) and, on the AttendSocket, a region request without a region.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/fuzz/request_fuzzer.h"

namespace kvpool::testing {
namespace {

using grpc::StatusCode;

const std::set<StatusCode> kAttendCodes = {
    StatusCode::OK, StatusCode::NOT_FOUND, StatusCode::INVALID_ARGUMENT,
    StatusCode::RESOURCE_EXHAUSTED, StatusCode::FAILED_PRECONDITION};

constexpr absl::Duration kCallTimeout = absl::Seconds(60);

}  // namespace

RequestFuzzer::AttendPlan RequestFuzzer::MakeAttendPlan(bool region) {
  AttendPlan plan;
  v1::AttendRequest& req = plan.request;
  const std::string ns =
      leases_.empty() ? target_.default_namespace.name : leases_[Below(leases_.size())].ns;
  const NamespaceGeometry* g = Geometry(ns);
  req.set_layer(BadChance(0.1) ? (Chance(0.5) ? g->layers : EdgeU32()) : Below(g->layers));
  const uint32_t q_heads = BadChance(0.15) ? (Chance(0.5) ? 0 : g->kv_heads * 2 + 1)
                                           : g->kv_heads * (1 + static_cast<uint32_t>(Below(4)));
  req.set_num_q_heads(q_heads);
  if (BadChance(0.1)) {
    const float scales[] = {-1.f, NAN, INFINITY, 1e30f, 1e-30f};
    req.set_sm_scale(scales[Below(std::size(scales))]);
  }
  req.set_output_dtype(static_cast<v1::OutputDtype>(BadChance(0.1) ? EdgeU32() : Below(3)));
  req.set_return_lse(Chance(0.5));
  if (!region && BadChance(0.05)) {
    req.set_region_q_bytes(Below(1000));
    req.set_region_kv_bytes(Below(1000));
  }
  uint64_t items = 1 + Below(4);
  if (BadChance(0.2)) {
    items = 0;
  } else if (BadChance(0.05)) {
    items = Chance(0.5) ? 300 : 5000;  // 5000: past the batch limit (1024)
  }
  std::set<uint64_t> named;
  for (uint64_t i = 0; i < items; ++i) {
    FuzzLease* lease = nullptr;
    uint64_t id = 0;
    if (Chance(0.9)) {  // a lease of the plan's namespace; rarely of any namespace
      const bool any_namespace = BadChance(0.03);
      std::vector<FuzzLease*> candidates;
      for (FuzzLease& l : leases_) {
        if (any_namespace || l.ns == ns) candidates.push_back(&l);
      }
      if (!candidates.empty()) {
        lease = candidates[Below(candidates.size())];
        id = lease->id;
      }
    }
    if (lease == nullptr) id = PickLeaseId(&lease);
    if (!named.insert(id).second) plan.repeats_lease = true;
    v1::AttendItem* item = req.add_items();
    item->set_lease_id(id);
    const NamespaceGeometry* item_g = lease != nullptr ? Geometry(lease->ns) : g;
    // A lease holding nothing at the layer has nothing to attend to unless the item appends.
    const bool holds_none =
        lease != nullptr && lease->layer_tokens[req.layer() % lease->layer_tokens.size()] == 0;
    const bool appends = Chance(holds_none ? 0.9 : 0.4);
    item->set_new_token_id(Chance(0.9) ? -1
                                       : (BadChance(0.5) ? -2 - static_cast<int32_t>(Below(10))
                                                         : static_cast<int32_t>(Below(100))));
    if (region) {
      item->set_append_in_region(appends);
      if (BadChance(0.02)) item->set_q("ab");  // bytes a region request must not carry
      continue;
    }
    const size_t kv_bytes = size_t{item_g->kv_heads} * item_g->head_dim * 2;
    item->set_q(Fp16Payload(size_t{q_heads} * item_g->head_dim * 2));
    if (appends) {
      item->set_new_k(Fp16Payload(kv_bytes));
      item->set_new_v(BadChance(0.03) ? "" : Fp16Payload(kv_bytes));
    }
    if (BadChance(0.03)) item->set_append_in_region(true);
  }
  return plan;
}

void RequestFuzzer::CheckAttend(const std::string& rpc, const AttendPlan& plan,
                                grpc::StatusCode code, const std::string& detail,
                                const v1::AttendResponse* response, bool region) {
  CheckCode(rpc, code, kAttendCodes, detail);
  const v1::AttendRequest& req = plan.request;
  std::vector<uint64_t> modelled;  // the modelled leases the batch names, once each
  for (const v1::AttendItem& item : req.items()) {
    const uint64_t id = item.lease_id();
    if (FindLease(id) != nullptr &&
        std::find(modelled.begin(), modelled.end(), id) == modelled.end()) {
      modelled.push_back(id);
    }
  }
  if (code != StatusCode::OK) {
    for (uint64_t id : modelled) {
      CheckLeaseModel(id, absl::StrCat(rpc, " failed with code ", code, ": ", detail));
    }
    return;
  }
  if (response == nullptr) return;
  const int n = req.items_size();
  if (response->context_tokens_size() != n) {
    Fail(absl::StrCat(rpc, ": ", response->context_tokens_size(), " context_tokens for ", n,
                      " items"));
  }
  if (req.return_lse() && response->lse_size() != n * static_cast<int>(req.num_q_heads())) {
    Fail(absl::StrCat(rpc, ": ", response->lse_size(), " LSE values"));
  }
  const FuzzLease* first = n > 0 ? FindLease(req.items(0).lease_id()) : nullptr;
  const NamespaceGeometry* g = first != nullptr ? Geometry(first->ns) : nullptr;
  if (region) {
    if (!response->out().empty()) Fail(rpc + ": a region step's response carries out");
  } else if (g != nullptr) {
    const size_t value_bytes = req.output_dtype() == v1::OUTPUT_DTYPE_FP32 ? 4 : 2;
    const size_t want = size_t(n) * req.num_q_heads() * g->head_dim * value_bytes;
    if (response->out().size() != want) {
      Fail(absl::StrCat(rpc, ": out has ", response->out().size(), " bytes, want ", want));
    }
  }
  for (float lse : response->lse()) {
    if (std::isnan(lse) && std::isfinite(req.sm_scale())) Fail(rpc + ": NaN LSE");
  }
  for (int i = 0; i < n; ++i) {
    FuzzLease* lease = FindLease(req.items(i).lease_id());
    if (lease == nullptr) continue;
    const bool appends = region ? req.items(i).append_in_region() : !req.items(i).new_k().empty();
    int64_t& tokens = lease->layer_tokens[req.layer()];
    if (appends) ++tokens;
    if (ModelsTokens() && !plan.repeats_lease && i < response->context_tokens_size() &&
        response->context_tokens(i) != tokens) {
      Fail(absl::StrCat(rpc, ": item ", i, " attended ", response->context_tokens(i),
                        " tokens, the model ", tokens));
    }
  }
  // Items of one lease see each other's appends in an order the model does not know: Get tells.
  if (plan.repeats_lease) {
    for (uint64_t id : modelled) CheckLeaseModel(id, rpc + " naming a lease twice");
  }
}

// ---- Attend: one plan. ----

void RequestFuzzer::Attend() {
  const AttendPlan plan = MakeAttendPlan(false);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
  v1::AttendResponse r;
  const grpc::Status st = stub_->Attend(&ctx, plan.request, &r);
  CheckAttend("Attend", plan, st.error_code(), st.error_message(), &r, false);
}

// ---- AttendStream: up to 4 plans on one stream, sometimes releasing a lease between steps. A
// step's failure ends the stream with its status; a stream of successful steps ends OK. ----

void RequestFuzzer::AttendStream() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
  auto stream = stub_->AttendStream(&ctx);
  const uint64_t steps = 1 + Below(4);
  for (uint64_t i = 0; i < steps; ++i) {
    const AttendPlan plan = MakeAttendPlan(false);
    if (!stream->Write(plan.request)) break;  // the stream ended early: Finish below says why
    v1::AttendResponse r;
    if (!stream->Read(&r)) {
      const grpc::Status st = stream->Finish();
      if (st.ok()) Fail("AttendStream ended OK without a response");
      CheckAttend("AttendStream", plan, st.error_code(), st.error_message(), nullptr, false);
      return;
    }
    CheckAttend("AttendStream", plan, StatusCode::OK, "", &r, false);
    if (Chance(0.2) && plan.request.items_size() > 0) {
      const uint64_t id = plan.request.items(0).lease_id();
      if (FindLease(id) != nullptr) {
        ReleaseLease(id, "a lease between AttendStream steps");
        Forget(id);
      }
    }
  }
  stream->WritesDone();
  const grpc::Status st = stream->Finish();
  CheckCode("AttendStream end", st.error_code(), {StatusCode::OK}, st.error_message());
}

}  // namespace kvpool::testing
