// The reactors of the streaming RPCs, one class per RPC, each in its own file. Each reactor
// deletes itself in OnDone and records its call in the method's metrics.
#ifndef KVPOOL_SERVICE_STREAM_REACTORS_H_
#define KVPOOL_SERVICE_STREAM_REACTORS_H_

#include <cstdint>

#include "grpcpp/support/server_callback.h"
#include "kvpool/v1/kvpool.pb.h"
#include "service/idle_streams.h"
#include "service/rpc_metrics.h"
#include "service/service_options.h"
#include "service/store/kv_store.h"

namespace kvpool {

// Put: a header, then chunks; commits when the client half-closes. Registered in `streams` while
// open (the sweep cancels it after options->put_idle_timeout without a message). `store`,
// `options`, `streams` and `metrics` must outlive the call; `ctx` is the call's.
grpc::ServerReadReactor<v1::PutRequest>* NewPutReactor(
    grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
    IdleStreams* streams, RpcMetrics::Method* metrics, v1::PutResponse* response);

// Get: streams the lease's blocks layer by layer, one message in flight; registered in `streams`
// while open (the sweep cancels it after options->get_stall_timeout without a message taken),
// refused past options->max_get_streams. FP16 rows past a block's real tokens are zeros (the
// block's earlier owner's K/V otherwise). `store`, `options`, `streams` and `metrics` must
// outlive the call; `ctx` is the call's.
grpc::ServerWriteReactor<v1::GetResponse>* NewGetReactor(
    grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
    IdleStreams* streams, RpcMetrics::Method* metrics, const v1::GetRequest* request);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STREAM_REACTORS_H_
