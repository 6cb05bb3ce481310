// The kvpool.v1.KvPool gRPC service on the callback API. Handlers are thin: they check framing
// (byte lengths vs shapes, empty payloads, stream limits), convert proto <-> store types, call
// KvStore, and turn absl::Status into grpc::Status at this edge only. Streaming RPCs have one
// reactor class each (stream_reactors.h). Every call is recorded in RpcMetrics.
#ifndef KVPOOL_SERVICE_KVPOOL_SERVICE_H_
#define KVPOOL_SERVICE_KVPOOL_SERVICE_H_

#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/rpc_metrics.h"
#include "service/service_options.h"
#include "service/store/kv_store.h"

namespace kvpool {

class KvPoolService final : public v1::KvPool::CallbackService {
 public:
  // `store` and `metrics` must outlive the service and every call it started.
  KvPoolService(KvStore* store, RpcMetrics* metrics, const ServiceOptions& options);

  grpc::ServerUnaryReactor* CreateNamespace(grpc::CallbackServerContext* ctx,
                                            const v1::CreateNamespaceRequest* request,
                                            v1::CreateNamespaceResponse* response) override;
  grpc::ServerUnaryReactor* ListNamespaces(grpc::CallbackServerContext* ctx,
                                           const v1::ListNamespacesRequest* request,
                                           v1::ListNamespacesResponse* response) override;
  grpc::ServerReadReactor<v1::PutRequest>* Put(grpc::CallbackServerContext* ctx,
                                               v1::PutResponse* response) override;
  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* ctx, const v1::MatchRequest* request,
                                  v1::MatchResponse* response) override;
  grpc::ServerWriteReactor<v1::GetResponse>* Get(grpc::CallbackServerContext* ctx,
                                                 const v1::GetRequest* request) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* ctx,
                                   const v1::AppendRequest* request,
                                   v1::AppendResponse* response) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttendStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx,
                                    const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;

 private:
  KvStore* const store_;
  const ServiceOptions options_;
  RpcMetrics::Method create_namespace_;
  RpcMetrics::Method list_namespaces_;
  RpcMetrics::Method put_;
  RpcMetrics::Method match_;
  RpcMetrics::Method get_;
  RpcMetrics::Method append_;
  RpcMetrics::Method attend_;
  RpcMetrics::Method attend_stream_;
  RpcMetrics::Method release_;
  RpcMetrics::Method stats_;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_KVPOOL_SERVICE_H_
