#include "absl/time/clock.h"
#include "service/attend_runner.h"
#include "service/proto_convert.h"
#include "service/stream_reactors.h"

namespace kvpool {
namespace {

// Strictly alternates read, run, write: one request in flight, so the request, the response
// and the runner's buffers are reused for every step without a lock.
class AttendStreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  AttendStreamReactor(KvStore* store, RpcMetrics::Method* metrics)
      : runner_(store), metrics_(metrics) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      FinishWith(grpc::Status::OK);
      return;
    }
    metrics_->Received(request_.ByteSizeLong());
    const absl::Status s = runner_.Run(request_, &response_);
    if (!s.ok()) {
      FinishWith(ToGrpcStatus(s));
      return;
    }
    metrics_->Sent(response_.ByteSizeLong());
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishWith(grpc::Status(grpc::StatusCode::CANCELLED, "AttendStream closed by the client"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void FinishWith(const grpc::Status& s) {
    // Recorded before Finish: a client that has the status also sees it counted.
    metrics_->Finished(s.error_code(), absl::Now() - start_);
    Finish(s);
  }

  AttendRunner runner_;
  RpcMetrics::Method* const metrics_;
  const absl::Time start_ = absl::Now();
  v1::AttendRequest request_;
  v1::AttendResponse response_;
};

}  // namespace

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* NewAttendStreamReactor(
    KvStore* store, RpcMetrics::Method* metrics) {
  return new AttendStreamReactor(store, metrics);
}

}  // namespace kvpool
