#include "service/attend_stream_server.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/time/clock.h"
#include "service/attend_runner.h"
#include "service/proto_convert.h"

namespace kvpool {
namespace {

// One AttendStream call, from its accept to its final status. At most one operation is pending
// at a time (accept, read, write or finish), all posted by the thread of the call's queue; that
// thread hands each completion to Proceed, which deletes the call after the last one.
class AttendStreamCall {
 public:
  enum class Op { kAccepted, kRead, kWritten, kFinished };
  struct Tag {
    AttendStreamCall* call;
    Op op;
  };

  // Posts the accept of the next stream on `cq`.
  static void Listen(KvPoolService* service, KvStore* store, AttendStreamServer::Metrics* metrics,
                     grpc::ServerCompletionQueue* cq) {
    new AttendStreamCall(service, store, metrics, cq);
  }

  // `draining`: the queue is shut down, so nothing more may be posted; the call just ends.
  void Proceed(Op op, bool ok, bool draining) {
    if (draining) {
      if (op == Op::kRead || op == Op::kWritten) {
        metrics_->stream.Finished(grpc::StatusCode::CANCELLED, absl::Now() - start_);
      }
      delete this;
      return;
    }
    switch (op) {
      case Op::kAccepted:
        if (!ok) {  // the server is shutting down
          delete this;
          return;
        }
        Listen(service_, store_, metrics_, cq_);
        start_ = absl::Now();
        stream_.Read(&request_, &read_);
        return;
      case Op::kRead:
        if (!ok) {  // the client half-closed, or the call is over
          FinishWith(grpc::Status::OK);
          return;
        }
        Step();
        return;
      case Op::kWritten:
        if (!ok) {
          FinishWith(
              grpc::Status(grpc::StatusCode::CANCELLED, "AttendStream closed by the client"));
          return;
        }
        stream_.Read(&request_, &read_);
        return;
      case Op::kFinished:
        delete this;
        return;
    }
  }

 private:
  AttendStreamCall(KvPoolService* service, KvStore* store, AttendStreamServer::Metrics* metrics,
                   grpc::ServerCompletionQueue* cq)
      : service_(service), store_(store), metrics_(metrics), cq_(cq), runner_(store) {
    service_->RequestAttendStream(&ctx_, &stream_, cq_, cq_, &accepted_);
  }

  void Step() {
    const absl::Time begin = absl::Now();
    metrics_->stream.Received(request_.ByteSizeLong());
    const absl::Status s = runner_.Run(request_, &response_);
    if (!s.ok()) {
      const grpc::Status status = ToGrpcStatus(s);
      metrics_->step.Finished(status.error_code(), absl::Now() - begin);
      FinishWith(status);
      return;
    }
    metrics_->stream.Sent(response_.ByteSizeLong());
    metrics_->step.Finished(grpc::StatusCode::OK, absl::Now() - begin);
    stream_.Write(response_, &written_);
  }

  void FinishWith(const grpc::Status& s) {
    // Recorded before Finish: a client that has the status also sees it counted.
    metrics_->stream.Finished(s.error_code(), absl::Now() - start_);
    stream_.Finish(s, &finished_);
  }

  KvPoolService* const service_;
  KvStore* const store_;
  AttendStreamServer::Metrics* const metrics_;
  grpc::ServerCompletionQueue* const cq_;
  AttendRunner runner_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<v1::AttendResponse, v1::AttendRequest> stream_{&ctx_};
  absl::Time start_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
  Tag accepted_{this, Op::kAccepted};
  Tag read_{this, Op::kRead};
  Tag written_{this, Op::kWritten};
  Tag finished_{this, Op::kFinished};
};

}  // namespace

AttendStreamServer::AttendStreamServer(KvPoolService* service, KvStore* store, RpcMetrics* metrics,
                                       const AttendStreamOptions& options)
    : service_(service),
      store_(store),
      metrics_{metrics->ForMethod("AttendStream"), metrics->ForMethod("AttendStream.step")},
      options_(options) {}

AttendStreamServer::~AttendStreamServer() { Shutdown(); }

void AttendStreamServer::AddQueues(grpc::ServerBuilder& builder) {
  for (int i = 0; i < std::max(1, options_.threads); ++i) {
    auto queue = std::make_unique<Queue>();
    queue->cq = builder.AddCompletionQueue();
    queues_.push_back(std::move(queue));
  }
}

void AttendStreamServer::Start() {
  for (const std::unique_ptr<Queue>& queue : queues_) {
    AttendStreamCall::Listen(service_, store_, &metrics_, queue->cq.get());
    queue->thread = std::thread([this, q = queue.get()] { Poll(q); });
  }
}

void AttendStreamServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  for (const std::unique_ptr<Queue>& queue : queues_) {
    if (queue->thread.joinable()) {
      queue->stop.Set(queue->cq.get(), gpr_now(GPR_CLOCK_MONOTONIC), &queue->stop);
      queue->thread.join();
    } else {  // never started: nothing was posted but the queue still needs its shutdown
      queue->cq->Shutdown();
      void* tag;
      bool ok;
      while (queue->cq->Next(&tag, &ok)) {
      }
    }
  }
}

void AttendStreamServer::Poll(Queue* queue) {
  using Clock = std::chrono::steady_clock;
  const auto spin = absl::ToChronoNanoseconds(options_.spin);
  bool draining = false;
  Clock::time_point last_event = Clock::now();
  for (;;) {
    void* tag = nullptr;
    bool ok = false;
    const bool spinning = !draining && Clock::now() - last_event < spin;
    const grpc::CompletionQueue::NextStatus status = queue->cq->AsyncNext(
        &tag, &ok,
        spinning ? gpr_time_0(GPR_CLOCK_MONOTONIC) : gpr_inf_future(GPR_CLOCK_MONOTONIC));
    if (status == grpc::CompletionQueue::SHUTDOWN) return;
    if (status == grpc::CompletionQueue::TIMEOUT) continue;
    last_event = Clock::now();
    if (tag == &queue->stop) {
      draining = true;
      queue->cq->Shutdown();
      continue;
    }
    auto* t = static_cast<AttendStreamCall::Tag*>(tag);
    t->call->Proceed(t->op, ok, draining);
  }
}

}  // namespace kvpool
