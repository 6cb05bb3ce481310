// The reactors of the streaming RPCs, one class per RPC, each in its own file. Each reactor
// deletes itself in OnDone and records its call in the method's metrics.
#ifndef KVPOOL_SERVICE_STREAM_REACTORS_H_
#define KVPOOL_SERVICE_STREAM_REACTORS_H_

#include <atomic>
#include <cstdint>

#include "grpcpp/support/server_callback.h"
#include "kvpool/v1/kvpool.pb.h"
#include "service/put_streams.h"
#include "service/rpc_metrics.h"
#include "service/service_options.h"
#include "service/store/kv_store.h"

namespace kvpool {

// Put: a header, then chunks; commits when the client half-closes. Registered in `streams` while
// open (the sweep cancels it after options->put_idle_timeout without a message). `store`,
// `options`, `streams` and `metrics` must outlive the call; `ctx` is the call's.
grpc::ServerReadReactor<v1::PutRequest>* NewPutReactor(
    grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
    PutStreams* streams, RpcMetrics::Method* metrics, v1::PutResponse* response);

// Get: streams the lease's blocks layer by layer, one message in flight; counted in
// `open_gets` while open, refused past options->max_get_streams. FP16 rows past a block's real
// tokens are zeros (the block's earlier owner's K/V otherwise).
grpc::ServerWriteReactor<v1::GetResponse>* NewGetReactor(KvStore* store,
                                                         const ServiceOptions* options,
                                                         std::atomic<uint64_t>* open_gets,
                                                         RpcMetrics::Method* metrics,
                                                         const v1::GetRequest* request);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STREAM_REACTORS_H_
