// RequestFuzzer's store RPCs: CreateNamespace, Put, Match, Get, Append, Release.
//
// The status codes each may return are the contract of proto/kvpool/v1/kvpool.proto: its
// "Errors" convention at the top (NOT_FOUND for an unknown namespace or lease; INVALID_ARGUMENT
// for malformed input; ALREADY_EXISTS for a namespace name in use; RESOURCE_EXHAUSTED for a
// message, stream, sequence or batch over its limit, a namespace larger than the unreserved pool,
// the namespace limit, or a pool full of pinned blocks; FAILED_PRECONDITION for a stream that
// ends incomplete) narrowed to what each RPC can meet.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/fuzz/request_fuzzer.h"

namespace kvpool::testing {
namespace {

using grpc::StatusCode;

const std::set<StatusCode> kCreateNamespaceCodes = {StatusCode::OK, StatusCode::INVALID_ARGUMENT,
                                                    StatusCode::ALREADY_EXISTS,
                                                    StatusCode::RESOURCE_EXHAUSTED};
// FAILED_PRECONDITION: the stream ended with blocks uncovered; CANCELLED only when the fuzzer
// cancelled the call itself.
const std::set<StatusCode> kPutCodes = {
    StatusCode::OK, StatusCode::NOT_FOUND, StatusCode::INVALID_ARGUMENT,
    StatusCode::RESOURCE_EXHAUSTED, StatusCode::FAILED_PRECONDITION};
// Match, Get and Append: the namespace or lease, the input, a limit (sequence length, lease count,
// message size, a pool full of pinned blocks).
const std::set<StatusCode> kLeaseCallCodes = {StatusCode::OK, StatusCode::NOT_FOUND,
                                              StatusCode::INVALID_ARGUMENT,
                                              StatusCode::RESOURCE_EXHAUSTED};
const std::set<StatusCode> kReleaseCodes = {StatusCode::OK, StatusCode::NOT_FOUND};

constexpr absl::Duration kCallTimeout = absl::Seconds(60);

}  // namespace

// ---- CreateNamespace: a spec valid but for chance, or one with fields at and past their
// bounds (NamespaceSpec's comments); a namespace created must have blocks. ----

v1::NamespaceSpec RequestFuzzer::PlausibleSpec() {
  v1::NamespaceSpec s;
  s.set_name(absl::StrCat("v", Below(100000)));
  const uint32_t head_dim = 16 * (1 + Below(8));
  s.set_num_layers(1 + Below(3));
  s.set_num_kv_heads(1 + Below(4));
  s.set_head_dim(head_dim);
  const uint32_t block_tokens[] = {1, 2, 3, 16, 17, 32};
  s.set_block_tokens(block_tokens[Below(std::size(block_tokens))]);
  s.set_default_dtype(static_cast<v1::KvDtype>(Below(5)));
  if (Chance(0.4)) {
    for (uint32_t l = 0; l < s.num_layers(); ++l) {
      s.add_layer_dtypes(static_cast<v1::KvDtype>(Below(5)));
    }
  }
  std::vector<uint32_t> rotation_blocks, group_sizes;
  for (uint32_t x = 16; x <= head_dim; x *= 2) {
    if (head_dim % x == 0) rotation_blocks.push_back(x);
  }
  for (uint32_t x = 1; x <= head_dim; ++x) {
    if (head_dim % x == 0 && (x % 16 == 0 || Chance(0.3))) group_sizes.push_back(x);
  }
  s.set_rotation_block(Chance(0.5) ? 0 : rotation_blocks[Below(rotation_blocks.size())]);
  s.set_rotation_disabled(Chance(0.2));
  s.set_rotation_seed(Chance(0.3) ? 0 : rng_());
  s.set_group_size(Chance(0.4) ? 0 : group_sizes[Below(group_sizes.size())]);
  s.set_sink_tokens(Chance(0.5) ? 0 : Below(s.block_tokens() + 1));
  s.set_blocks_per_sink_page(Below(6));
  s.set_capacity_bytes((32 << 10) * (1 + Below(16)));
  return s;
}

v1::NamespaceSpec RequestFuzzer::EdgeSpec() {
  v1::NamespaceSpec s;
  const char* const names[] = {"", "a", "x y", "ns/1", "\xc3\xbcn\xc3\xaf", "small", "ok-1.b_2"};
  if (Chance(0.6)) {
    s.set_name(absl::StrCat("f", Below(1000)));
  } else if (Chance(0.5)) {
    s.set_name(names[Below(std::size(names))]);
  } else {
    s.set_name(std::string(60 + Below(10), 'n'));  // around the 64-character limit
  }
  const uint32_t layers[] = {0, 1, 2, 3, 4096, 4097, 0xffffffffu};
  const uint32_t heads[] = {0, 1, 3, 8, 1024, 1025, 0xffffffffu};
  const uint32_t dims[] = {0, 8, 16, 48, 64, 96, 100, 128, 1024, 1040, 0xfffffff0u};
  const uint32_t block_tokens[] = {0, 1, 3, 16, 17, 32, 1024, 1025, 0xffffffffu};
  s.set_num_layers(Chance(0.7) ? 1 + Below(3) : layers[Below(std::size(layers))]);
  s.set_num_kv_heads(Chance(0.7) ? 1 + Below(3) : heads[Below(std::size(heads))]);
  s.set_head_dim(Chance(0.7) ? 16 * (1 + Below(8)) : dims[Below(std::size(dims))]);
  s.set_block_tokens(block_tokens[Below(Chance(0.7) ? 6 : std::size(block_tokens))]);
  s.set_default_dtype(static_cast<v1::KvDtype>(Chance(0.85) ? Below(5) : EdgeU32()));
  const uint64_t dtypes = Chance(0.7) ? 0 : Below(6);
  for (uint64_t i = 0; i < dtypes; ++i) {
    s.add_layer_dtypes(static_cast<v1::KvDtype>(Chance(0.8) ? Below(5) : Below(100)));
  }
  s.set_rotation_block(Chance(0.5) ? 0 : (Chance(0.7) ? (1u << Below(11)) : EdgeU32()));
  s.set_rotation_disabled(Chance(0.2));
  s.set_rotation_seed(rng_());
  s.set_group_size(Chance(0.5) ? 0 : (Chance(0.7) ? 16 * Below(9) : EdgeU32()));
  s.set_sink_tokens(Chance(0.6) ? 0 : (Chance(0.7) ? Below(40) : EdgeU32()));
  const uint64_t capacities[] = {0, 1, 4096, 256 << 10, 1 << 20, uint64_t{1} << 40, ~uint64_t{0}};
  s.set_capacity_bytes(Chance(0.8) ? (64 << 10) * (1 + Below(8))
                                   : capacities[Below(std::size(capacities))]);
  s.set_blocks_per_sink_page(Chance(0.6) ? 0 : EdgeU32());
  return s;
}

void RequestFuzzer::CreateNamespace() {
  v1::CreateNamespaceRequest req;
  *req.mutable_spec() = BadChance(0.5) ? EdgeSpec() : PlausibleSpec();
  grpc::ClientContext ctx;
  v1::CreateNamespaceResponse r;
  const grpc::Status st = stub_->CreateNamespace(&ctx, req, &r);
  CheckCode("CreateNamespace", st.error_code(), kCreateNamespaceCodes,
            st.error_message() + " spec " + req.ShortDebugString());
  if (!st.ok()) return;
  if (r.info().num_blocks() == 0) Fail("namespace with 0 blocks: " + req.ShortDebugString());
  RefreshNamespaces();
}

// ---- Put: a header (sometimes missing) and per-layer chunks, some broken (layer, range, payload
// length, NaN), repeated, or after a second header; a stream may stop early or be cancelled. A
// Put that succeeds accounts for every token. ----

bool RequestFuzzer::WritePutChunks(const NamespaceGeometry& g, const v1::PutRequest& header,
                                   uint32_t tokens, grpc::ClientWriter<v1::PutRequest>* writer,
                                   grpc::ClientContext* ctx) {
  const uint32_t per_token = g.kv_heads * g.head_dim;
  const uint32_t chunk_tokens =
      Chance(0.5) ? std::max<uint32_t>(1, g.block_tokens) : 1 + static_cast<uint32_t>(Below(40));
  for (uint32_t layer = 0; layer < g.layers; ++layer) {
    for (uint32_t begin = 0; begin < tokens; begin += chunk_tokens) {
      const uint32_t n = std::min(chunk_tokens, tokens - begin);
      v1::PutRequest req;
      v1::PutChunk* chunk = req.mutable_chunk();
      chunk->set_layer(Chance(0.02) ? (Chance(0.5) ? g.layers : EdgeU32()) : layer);
      chunk->set_token_begin(Chance(0.02) ? EdgeU32() : begin);
      chunk->set_num_tokens(Chance(0.02) ? EdgeU32() : n);
      const size_t bytes = size_t{n} * per_token * 2;
      chunk->set_k(Fp16Payload(bytes));
      chunk->set_v(Fp16Payload(bytes));
      if (Chance(0.03)) writer->Write(header);
      if (!writer->Write(req)) return false;  // the server ended the stream
      if (Chance(0.03)) writer->Write(req);
      if (Chance(0.005)) {
        ctx->TryCancel();
        return true;
      }
      if (Chance(0.01)) return false;  // incomplete
    }
  }
  return false;
}

void RequestFuzzer::Put() {
  const std::string ns = PickNamespace();
  const NamespaceGeometry* g = Geometry(ns);
  const std::vector<int32_t> tokens = RandomTokens(g);
  v1::PutRequest header;
  header.mutable_header()->set_namespace_(ns);
  for (int32_t t : tokens) header.mutable_header()->add_token_ids(t);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
  v1::PutResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer = stub_->Put(&ctx, &response);
  const bool sends_header = !Chance(0.03);
  if (sends_header) writer->Write(header);
  bool cancelled = false;
  // Namespaces made by EdgeSpec may be huge; their Puts send a stray chunk only.
  if (g != nullptr && g->layers < 64 && g->kv_heads * g->head_dim < (1 << 16) &&
      tokens.size() < 5000) {
    cancelled = WritePutChunks(*g, header, tokens.size(), writer.get(), &ctx);
  } else if (Chance(0.5)) {
    v1::PutRequest req;
    req.mutable_chunk()->set_num_tokens(1);
    req.mutable_chunk()->set_k(std::string(Below(300), 'a'));
    writer->Write(req);
  }
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  std::set<StatusCode> allowed = kPutCodes;
  if (cancelled) allowed.insert(StatusCode::CANCELLED);
  CheckCode("Put", st.error_code(), allowed,
            absl::StrCat(st.error_message(), " ns=", ns, " tokens=", tokens.size(),
                         sends_header ? "" : " (no header)"));
  if (!st.ok()) return;
  if (response.tokens_cached() + response.tokens_stored() + response.tokens_ignored() !=
      tokens.size()) {
    Fail(absl::StrCat("Put counts ", response.ShortDebugString(), " for ", tokens.size(),
                      " tokens"));
  }
  if (tokens.size() < 2000) prompts_.push_back(tokens);
  if (prompts_.size() > 40) prompts_.erase(prompts_.begin());
}

// ---- Match: token ids of earlier Puts and fresh ones, ttl_ms at and past the cap. The lease
// expires after the ttl asked (0: the default, capped at the maximum) and covers whole blocks. ----

void RequestFuzzer::Match() {
  const std::string ns = PickNamespace();
  const NamespaceGeometry* g = Geometry(ns);
  v1::MatchRequest req;
  req.set_namespace_(ns);
  const std::vector<int32_t> tokens = RandomTokens(g);
  for (int32_t t : tokens) req.add_token_ids(t);
  const int64_t max_ttl_ms = absl::ToInt64Milliseconds(target_.max_lease_ttl);
  const uint32_t max_ttl = static_cast<uint32_t>(max_ttl_ms);
  const uint32_t ttls[] = {0, 1, 1000, 0xffffffffu, max_ttl, max_ttl + 1};
  req.set_ttl_ms(ttls[Below(std::size(ttls))]);
  grpc::ClientContext ctx;
  v1::MatchResponse r;
  const grpc::Status st = stub_->Match(&ctx, req, &r);
  CheckCode("Match", st.error_code(), kLeaseCallCodes, st.error_message());
  if (!st.ok() || g == nullptr) return;
  if (r.lease_id() == 0) Fail("Match returned lease id 0");
  const int64_t expires_in = r.expires_unix_ms() - absl::ToUnixMillis(target_.server->clock.Now());
  const int64_t ttl = req.ttl_ms() == 0 ? absl::ToInt64Milliseconds(target_.default_lease_ttl)
                                        : std::min<int64_t>(req.ttl_ms(), max_ttl_ms);
  if (expires_in != ttl) {
    Fail(absl::StrCat("Match with ttl_ms ", req.ttl_ms(), ": expires in ", expires_in, " ms"));
  }
  if (r.cached_tokens() % g->block_tokens != 0 || r.cached_tokens() > tokens.size()) {
    Fail(absl::StrCat("Match cached_tokens ", r.cached_tokens(), " of ", tokens.size()));
  }
  leases_.push_back({r.lease_id(), ns.empty() ? target_.default_namespace.name : ns,
                     std::vector<int64_t>(g->layers, r.cached_tokens())});
}

// ---- Get: layer and head ranges, format and chunk size in and out of range. A Get that
// succeeds sends ascending layers within the range, payloads of the layer's shape, and for a
// modelled lease exactly the tokens it holds. ----

void RequestFuzzer::Get() {
  FuzzLease* lease;
  v1::GetRequest req;
  req.set_lease_id(PickLeaseId(&lease));
  const NamespaceGeometry* g = lease != nullptr ? Geometry(lease->ns) : nullptr;
  const uint32_t layers = g != nullptr ? g->layers : 2;
  const uint32_t heads = g != nullptr ? g->kv_heads : 2;
  req.set_layer_begin(Chance(0.7) ? Below(layers + 1) : EdgeU32());
  req.set_layer_end(Chance(0.7) ? Below(layers + 2) : EdgeU32());
  req.set_head_begin(Chance(0.7) ? Below(heads + 1) : EdgeU32());
  req.set_head_end(Chance(0.7) ? Below(heads + 2) : EdgeU32());
  req.set_format(static_cast<v1::GetFormat>(Chance(0.9) ? Below(3) : EdgeU32()));
  const uint32_t chunk_bytes[] = {0, 1, 2, 100, 4096, 0xffffffffu};
  req.set_max_chunk_bytes(chunk_bytes[Below(std::size(chunk_bytes))]);
  req.set_lease_blocks(Chance(0.3));
  std::vector<v1::GetResponse> out;
  const grpc::Status st = ReadAll(stub_, req, &out, kCallTimeout);
  CheckCode("Get", st.error_code(), kLeaseCallCodes,
            st.error_message() + " " + req.ShortDebugString());
  if (st.error_code() == StatusCode::NOT_FOUND && lease != nullptr && !LeaseMayVanish()) {
    Fail("Get NOT_FOUND on a live lease: " + st.error_message());
  }
  if (!st.ok() || g == nullptr) return;
  const uint32_t layer_begin = req.layer_begin();
  const uint32_t layer_end = req.layer_end() == 0 ? layers : req.layer_end();
  const uint32_t head_count = (req.head_end() == 0 ? heads : req.head_end()) - req.head_begin();
  std::map<uint32_t, int64_t> tokens, blocks;  // per layer
  int64_t last_layer = -1;
  for (const v1::GetResponse& m : out) {
    if (m.layer() < layer_begin || m.layer() >= layer_end) Fail("Get layer out of range");
    if (static_cast<int64_t>(m.layer()) < last_layer) Fail("Get layers not ascending");
    last_layer = m.layer();
    tokens[m.layer()] += m.valid_tokens();
    blocks[m.layer()] += m.num_blocks();
    if (m.valid_tokens() > uint64_t{m.num_blocks()} * g->block_tokens) {
      Fail("Get valid_tokens past its blocks: " + m.ShortDebugString().substr(0, 200));
    }
    if (req.format() != v1::GET_FORMAT_RAW) {
      const size_t want = size_t{m.num_blocks()} * g->block_tokens * head_count * g->head_dim * 2;
      if (m.k().size() != want || m.v().size() != want) {
        Fail(absl::StrCat("Get fp16 payload ", m.k().size(), "/", m.v().size(), " bytes, want ",
                          want));
      }
    }
  }
  // lease_blocks: every selected layer spans the lease's blocks, or none does (no block).
  for (uint32_t layer = layer_begin; layer < layer_end && req.lease_blocks(); ++layer) {
    if (blocks[layer] != blocks[layer_begin]) {
      Fail(absl::StrCat("Get lease_blocks: layer ", layer, " spans ", blocks[layer],
                        " blocks, layer ", layer_begin, " ", blocks[layer_begin]));
    }
  }
  if (!ModelsTokens()) return;
  for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
    if (tokens[layer] != lease->layer_tokens[layer]) {
      Fail(absl::StrCat("Get layer ", layer, ": ", tokens[layer], " tokens, the model ",
                        lease->layer_tokens[layer]));
    }
  }
}

// ---- Append: layer, token count, token ids and payloads in and out of shape. A success grows
// the layer by num_tokens (layer_tokens says so); a failure changes no lease (checked). ----

void RequestFuzzer::Append() {
  FuzzLease* lease;
  v1::AppendRequest req;
  req.set_lease_id(PickLeaseId(&lease));
  const NamespaceGeometry* g = Geometry(lease != nullptr ? lease->ns : "");
  req.set_layer(BadChance(0.1) ? (Chance(0.5) ? g->layers : EdgeU32()) : Below(g->layers));
  uint32_t n = Chance(0.9) ? 1 + static_cast<uint32_t>(Below(20)) : EdgeU32();
  if (n > 100000) n = 100000 + static_cast<uint32_t>(Below(3));  // keeps the payload sendable
  req.set_num_tokens(Chance(0.95) ? n : n + 1);
  switch (Below(4)) {
    case 0:
      break;  // no ids
    case 1:
      for (uint32_t i = 0; i < n; ++i) req.add_token_ids(static_cast<int32_t>(Below(1000)));
      break;
    case 2:  // one id too many or too few, -1 (unknown) or -2 (invalid)
      for (int64_t i = 0; i < int64_t{n} + (Chance(0.5) ? 1 : -1); ++i) {
        req.add_token_ids(-1 - static_cast<int32_t>(Below(2)));
      }
      break;
    default:
      for (uint32_t i = 0; i < n; ++i) req.add_token_ids(-1);
      break;
  }
  const size_t bytes = size_t{n} * g->kv_heads * g->head_dim * 2;
  if (bytes < (64 << 20)) {  // else no payload: over the message limit anyway
    req.set_k(Fp16Payload(bytes));
    req.set_v(Fp16Payload(bytes));
  }
  grpc::ClientContext ctx;
  v1::AppendResponse r;
  const grpc::Status st = stub_->Append(&ctx, req, &r);
  CheckCode("Append", st.error_code(), kLeaseCallCodes, st.error_message());
  if (lease == nullptr) return;
  if (st.ok()) {
    lease->layer_tokens[req.layer()] += req.num_tokens();
    if (ModelsTokens() && r.layer_tokens() != lease->layer_tokens[req.layer()]) {
      Fail(absl::StrCat("Append layer_tokens ", r.layer_tokens(), ", the model ",
                        lease->layer_tokens[req.layer()]));
    }
  }
  if (!st.ok() || Chance(0.3)) {
    CheckLeaseModel(req.lease_id(),
                    absl::StrCat("Append with code ", st.error_code(), ": ", st.error_message()));
  }
}

// ---- Release: a modelled lease or an unknown id; a live lease's release succeeds. ----

void RequestFuzzer::Release() {
  FuzzLease* lease;
  const uint64_t id = PickLeaseId(&lease);
  grpc::ClientContext ctx;
  v1::ReleaseRequest req;
  req.set_lease_id(id);
  v1::ReleaseResponse r;
  const grpc::Status st = stub_->Release(&ctx, req, &r);
  CheckCode("Release", st.error_code(), kReleaseCodes, st.error_message());
  if (lease == nullptr) return;
  if (st.error_code() == StatusCode::NOT_FOUND && !LeaseMayVanish()) {
    Fail("Release of a live lease: NOT_FOUND");
  }
  Forget(id);
}

void RequestFuzzer::AdvanceClock() {
  target_.server->clock.Advance(absl::Milliseconds(Below(40000)));
  clock_moved_ = true;
}

}  // namespace kvpool::testing
