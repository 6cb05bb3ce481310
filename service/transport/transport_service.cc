#include "service/transport/transport_service.h"

#include <atomic>
#include <functional>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "service/proto_convert.h"

namespace kvpool {
namespace {

// One server-streaming transfer: `body` runs on its own thread and writes through `emit`, which
// blocks until gRPC took the message. The reactor is deleted by whichever of the thread (after
// Finish) and OnDone comes last. `metrics` counts the request's bytes, each message's and the
// call.
template <typename Response>
class TransferReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  using Body = std::function<absl::Status(const NcclTransfers::Emit<Response>&, TransferCancel*)>;

  TransferReactor(Body body, RpcMetrics::Method* metrics, uint64_t request_bytes) {
    std::thread([this, body = std::move(body), metrics, request_bytes] {
      const absl::Time start = absl::Now();
      metrics->Received(request_bytes);
      const absl::Status s = body(
          [this, metrics](const Response& r) {
            absl::Status written = Write(r);
            if (written.ok()) metrics->Sent(r.ByteSizeLong());
            return written;
          },
          &cancel_);
      const grpc::Status status = ToGrpcStatus(s);
      // Recorded before Finish: a worker that has the status also sees the call counted.
      metrics->Finished(status.error_code(), absl::Now() - start);
      this->Finish(status);
      Unref();
    }).detach();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock l(&mu_);
    write_ok_ = ok;
    write_done_ = true;
  }
  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { Unref(); }

 private:
  absl::Status Write(const Response& r) {
    {
      absl::MutexLock l(&mu_);
      write_done_ = false;
    }
    this->StartWrite(&r);
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(&write_done_));
    return write_ok_ ? absl::OkStatus() : absl::CancelledError("the worker's stream is gone");
  }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  TransferCancel cancel_;
  std::atomic<int> refs_{2};  // the thread and OnDone
  absl::Mutex mu_;
  bool write_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

KvPoolTransportService::KvPoolTransportService(KvStore* store, ComputeBackend* backend,
                                               PeerTransportFactory* factory, Clock* clock,
                                               RpcMetrics* metrics, const TransportOptions& options)
    : channels_(factory, clock, options.channels),
      transfers_(store, backend, &channels_, clock, options),
      open_metrics_(metrics->ForMethod("OpenChannel")),
      close_metrics_(metrics->ForMethod("CloseChannel")),
      get_metrics_(metrics->ForMethod("NcclGet")),
      put_metrics_(metrics->ForMethod("NcclPut")) {}

grpc::ServerUnaryReactor* KvPoolTransportService::OpenChannel(grpc::CallbackServerContext* ctx,
                                                              const v1::OpenChannelRequest* request,
                                                              v1::OpenChannelResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time start = absl::Now();
  open_metrics_.Received(request->ByteSizeLong());
  absl::StatusOr<ChannelManager::Opened> opened =
      channels_.Open(absl::Milliseconds(request->join_timeout_ms()));
  if (opened.ok()) {
    response->set_channel_id(opened->channel_id);
    response->set_nccl_unique_id(opened->join_id);
    response->set_num_ranks(2);
    response->set_worker_rank(1);
    response->set_idle_timeout_ms(
        static_cast<uint32_t>(absl::ToInt64Milliseconds(channels_.options().idle_timeout)));
    open_metrics_.Sent(response->ByteSizeLong());
  }
  const grpc::Status status = ToGrpcStatus(opened.status());
  open_metrics_.Finished(status.error_code(), absl::Now() - start);
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* KvPoolTransportService::CloseChannel(
    grpc::CallbackServerContext* ctx, const v1::CloseChannelRequest* request,
    v1::CloseChannelResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time start = absl::Now();
  close_metrics_.Received(request->ByteSizeLong());
  const grpc::Status status = ToGrpcStatus(channels_.Close(request->channel_id()));
  close_metrics_.Finished(status.error_code(), absl::Now() - start);
  reactor->Finish(status);
  return reactor;
}

grpc::ServerWriteReactor<v1::NcclGetResponse>* KvPoolTransportService::NcclGet(
    grpc::CallbackServerContext* /*ctx*/, const v1::NcclGetRequest* request) {
  return new TransferReactor<v1::NcclGetResponse>(
      [this, request](const NcclTransfers::Emit<v1::NcclGetResponse>& emit,
                      TransferCancel* cancel) { return transfers_.Get(*request, emit, cancel); },
      &get_metrics_, request->ByteSizeLong());
}

grpc::ServerWriteReactor<v1::NcclPutResponse>* KvPoolTransportService::NcclPut(
    grpc::CallbackServerContext* /*ctx*/, const v1::NcclPutRequest* request) {
  return new TransferReactor<v1::NcclPutResponse>(
      [this, request](const NcclTransfers::Emit<v1::NcclPutResponse>& emit,
                      TransferCancel* cancel) { return transfers_.Put(*request, emit, cancel); },
      &put_metrics_, request->ByteSizeLong());
}

}  // namespace kvpool
