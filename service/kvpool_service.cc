#include "service/kvpool_service.h"

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "service/proto_convert.h"
#include "service/stream_reactors.h"

namespace kvpool {
namespace {

// Runs a unary handler body `fn` (returning absl::Status), records the call and finishes it.
template <typename Fn>
grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* ctx, RpcMetrics::Method* method,
                                   const google::protobuf::Message& request,
                                   const google::protobuf::Message& response, Fn fn) {
  const absl::Time start = absl::Now();
  method->Received(request.ByteSizeLong());
  const grpc::Status s = ToGrpcStatus(fn());
  if (s.ok()) method->Sent(response.ByteSizeLong());
  method->Finished(s.error_code(), absl::Now() - start);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(s);
  return reactor;
}

}  // namespace

KvPoolService::KvPoolService(KvStore* store, RpcMetrics* metrics, const ServiceOptions& options,
                             Clock* clock)
    : store_(store),
      options_(options),
      put_streams_(clock),
      get_streams_(clock),
      create_namespace_(metrics->ForMethod("CreateNamespace")),
      list_namespaces_(metrics->ForMethod("ListNamespaces")),
      put_(metrics->ForMethod("Put")),
      match_(metrics->ForMethod("Match")),
      get_(metrics->ForMethod("Get")),
      append_(metrics->ForMethod("Append")),
      release_(metrics->ForMethod("Release")),
      stats_(metrics->ForMethod("Stats")) {}

grpc::ServerUnaryReactor* KvPoolService::CreateNamespace(grpc::CallbackServerContext* ctx,
                                                         const v1::CreateNamespaceRequest* request,
                                                         v1::CreateNamespaceResponse* response) {
  return RunUnary(ctx, &create_namespace_, *request, *response, [&]() -> absl::Status {
    absl::StatusOr<NamespaceConfig> config = FromProtoSpec(request->spec());
    if (!config.ok()) return config.status();
    absl::StatusOr<NamespaceInfo> info = store_->CreateNamespace(*config);
    if (!info.ok()) return info.status();
    ToProtoInfo(*info, response->mutable_info());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvPoolService::ListNamespaces(grpc::CallbackServerContext* ctx,
                                                        const v1::ListNamespacesRequest* request,
                                                        v1::ListNamespacesResponse* response) {
  return RunUnary(ctx, &list_namespaces_, *request, *response, [&] {
    for (const NamespaceInfo& info : store_->ListNamespaces()) {
      ToProtoInfo(info, response->add_namespaces());
    }
    return absl::OkStatus();
  });
}

grpc::ServerReadReactor<v1::PutRequest>* KvPoolService::Put(grpc::CallbackServerContext* ctx,
                                                            v1::PutResponse* response) {
  return NewPutReactor(ctx, store_, &options_, &put_streams_, &put_, response);
}

int KvPoolService::CancelIdleStreams() {
  int cancelled = 0;
  if (options_.put_idle_timeout > absl::ZeroDuration()) {
    cancelled += put_streams_.CancelIdle(options_.put_idle_timeout);
  }
  if (options_.get_stall_timeout > absl::ZeroDuration()) {
    cancelled += get_streams_.CancelIdle(options_.get_stall_timeout);
  }
  return cancelled;
}

grpc::ServerUnaryReactor* KvPoolService::Match(grpc::CallbackServerContext* ctx,
                                               const v1::MatchRequest* request,
                                               v1::MatchResponse* response) {
  return RunUnary(ctx, &match_, *request, *response, [&]() -> absl::Status {
    absl::StatusOr<KvStore::MatchResult> r =
        store_->Match(request->namespace_(),
                      absl::MakeConstSpan(request->token_ids().data(), request->token_ids().size()),
                      absl::Milliseconds(request->ttl_ms()));
    if (!r.ok()) return r.status();
    response->set_lease_id(r->lease_id);
    response->set_cached_tokens(r->cached_tokens);
    response->set_num_blocks(r->num_blocks);
    response->set_expires_unix_ms(absl::ToUnixMillis(r->expires));
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::GetResponse>* KvPoolService::Get(grpc::CallbackServerContext* ctx,
                                                              const v1::GetRequest* request) {
  return NewGetReactor(ctx, store_, &options_, &get_streams_, &get_, request);
}

grpc::ServerUnaryReactor* KvPoolService::Append(grpc::CallbackServerContext* ctx,
                                                const v1::AppendRequest* request,
                                                v1::AppendResponse* response) {
  return RunUnary(ctx, &append_, *request, *response, [&]() -> absl::Status {
    if (request->num_tokens() == 0) return absl::InvalidArgumentError("num_tokens is 0");
    if (request->k().empty() || request->v().empty()) {
      return absl::InvalidArgumentError("Append has an empty k or v payload");
    }
    absl::StatusOr<KvStore::LeaseView> lease = store_->DescribeLease(request->lease_id());
    if (!lease.ok()) return lease.status();
    const NamespaceConfig& c = lease->info.config;
    const uint64_t want = Fp16KvBytes(c, request->num_tokens());
    if (request->k().size() != want || request->v().size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("Append k/v have ", request->k().size(), "/", request->v().size(),
                       " bytes; ", request->num_tokens(), " tokens x ", c.num_kv_heads, " heads x ",
                       c.head_dim, " dims fp16 need ", want));
    }
    absl::StatusOr<uint32_t> tokens = store_->Append(
        request->lease_id(), request->layer(),
        absl::MakeConstSpan(request->token_ids().data(), request->token_ids().size()),
        request->num_tokens(), reinterpret_cast<const uint16_t*>(request->k().data()),
        reinterpret_cast<const uint16_t*>(request->v().data()));
    if (!tokens.ok()) return tokens.status();
    response->set_layer_tokens(*tokens);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvPoolService::Release(grpc::CallbackServerContext* ctx,
                                                 const v1::ReleaseRequest* request,
                                                 v1::ReleaseResponse* response) {
  return RunUnary(ctx, &release_, *request, *response,
                  [&] { return store_->Release(request->lease_id()); });
}

grpc::ServerUnaryReactor* KvPoolService::Stats(grpc::CallbackServerContext* ctx,
                                               const v1::StatsRequest* request,
                                               v1::StatsResponse* response) {
  return RunUnary(ctx, &stats_, *request, *response, [&] {
    ToProtoStats(store_->Stats(), response);
    return absl::OkStatus();
  });
}

}  // namespace kvpool
