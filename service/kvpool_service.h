// The kvpool.v1.KvPool gRPC service on the callback API, except Attend and AttendStream, which are
// async on wire bytes (raw methods) and served by AttendServer (attend_server.h) on threads of
// its own. Handlers are thin:
// they check framing (byte lengths vs shapes, empty payloads, stream limits), convert proto <->
// store types, call KvStore, and turn absl::Status into grpc::Status at this edge only. The other
// streaming RPCs have one reactor class each (stream_reactors.h). Every call is recorded in
// RpcMetrics.
#ifndef KVPOOL_SERVICE_KVPOOL_SERVICE_H_
#define KVPOOL_SERVICE_KVPOOL_SERVICE_H_

#include <cstdint>

#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/idle_streams.h"
#include "service/rpc_metrics.h"
#include "service/service_options.h"
#include "service/store/kv_store.h"

namespace kvpool {

// Every method on the callback API but Attend and AttendStream. The chain is spelled out because
// marking a callback method async keeps its callback handler; an RPC missing here stays
// synchronous.
using KvPoolServiceBase = v1::KvPool::WithCallbackMethod_CreateNamespace<
    v1::KvPool::WithCallbackMethod_ListNamespaces<v1::KvPool::WithCallbackMethod_Put<
        v1::KvPool::WithCallbackMethod_Match<v1::KvPool::WithCallbackMethod_Get<
            v1::KvPool::WithCallbackMethod_Append<v1::KvPool::WithRawMethod_Attend<
                v1::KvPool::WithRawMethod_AttendStream<v1::KvPool::WithCallbackMethod_Release<
                    v1::KvPool::WithCallbackMethod_Stats<v1::KvPool::Service>>>>>>>>>>;

class KvPoolService final : public KvPoolServiceBase {
 public:
  // `store` and `metrics` must outlive the service and every call it started.
  // `clock` (null: SystemClock()) times the Put and Get streams' idleness.
  KvPoolService(KvStore* store, RpcMetrics* metrics, const ServiceOptions& options,
                Clock* clock = nullptr);

  // Cancels the Put streams idle for longer than ServiceOptions::put_idle_timeout and the Get
  // streams stalled for longer than ServiceOptions::get_stall_timeout (neither when zero); the
  // server's sweep calls it. Returns how many.
  int CancelIdleStreams();

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
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx,
                                    const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;

 private:
  KvStore* const store_;
  const ServiceOptions options_;
  IdleStreams put_streams_;
  IdleStreams get_streams_;
  RpcMetrics::Method create_namespace_;
  RpcMetrics::Method list_namespaces_;
  RpcMetrics::Method put_;
  RpcMetrics::Method match_;
  RpcMetrics::Method get_;
  RpcMetrics::Method append_;
  RpcMetrics::Method release_;
  RpcMetrics::Method stats_;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_KVPOOL_SERVICE_H_
