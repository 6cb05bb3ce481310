// The kvpool.v1.KvPoolTransport gRPC service (the NCCL data plane) on the callback API. Handlers
// are thin: OpenChannel / CloseChannel call the ChannelManager; NcclGet / NcclPut run
// NcclTransfers on a thread of their own (a transfer blocks on NCCL for as long as the payload
// takes, which must not hold gRPC's callback threads) and stream what it emits. A cancelled call
// (the worker went away) aborts its channel's transport at once. Every call is counted in the
// kvpool_rpc_* families under its method's name (a transfer's NCCL payload is not in its bytes).
//
// Server (service/server.cc) registers it beside KvPool when its backend is CUDA and the build
// has NCCL, with a NewNcclTransportFactory on the backend's device (ServerOptions::nccl_device).
#ifndef KVPOOL_SERVICE_TRANSPORT_TRANSPORT_SERVICE_H_
#define KVPOOL_SERVICE_TRANSPORT_TRANSPORT_SERVICE_H_

#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/rpc_metrics.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/transport/channel_manager.h"
#include "service/transport/nccl_transfers.h"
#include "service/transport/peer_transport.h"

namespace kvpool {

class KvPoolTransportService final : public v1::KvPoolTransport::CallbackService {
 public:
  // Not owned: store, backend (the store's), factory, clock and metrics must outlive the service
  // and every call it started.
  KvPoolTransportService(KvStore* store, ComputeBackend* backend, PeerTransportFactory* factory,
                         Clock* clock, RpcMetrics* metrics, const TransportOptions& options);

  ChannelManager& channels() { return channels_; }
  const NcclTransfers& transfers() const { return transfers_; }

  grpc::ServerUnaryReactor* OpenChannel(grpc::CallbackServerContext* ctx,
                                        const v1::OpenChannelRequest* request,
                                        v1::OpenChannelResponse* response) override;
  grpc::ServerUnaryReactor* CloseChannel(grpc::CallbackServerContext* ctx,
                                         const v1::CloseChannelRequest* request,
                                         v1::CloseChannelResponse* response) override;
  grpc::ServerWriteReactor<v1::NcclGetResponse>* NcclGet(
      grpc::CallbackServerContext* ctx, const v1::NcclGetRequest* request) override;
  grpc::ServerWriteReactor<v1::NcclPutResponse>* NcclPut(
      grpc::CallbackServerContext* ctx, const v1::NcclPutRequest* request) override;

 private:
  ChannelManager channels_;
  NcclTransfers transfers_;
  RpcMetrics::Method open_metrics_, close_metrics_, get_metrics_, put_metrics_;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_TRANSPORT_TRANSPORT_SERVICE_H_
