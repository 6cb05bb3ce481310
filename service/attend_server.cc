#include "service/attend_server.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "service/proto_convert.h"

namespace kvpool {
namespace {

// The calls take and give wire bytes (raw methods), so that a request's items are counted before
// it is parsed (AttendRunner::Parse); responses are serialized as gRPC would.
absl::Status SerializeResponse(const v1::AttendResponse& response, grpc::ByteBuffer* bytes) {
  bytes->Clear();  // the last step's
  bool own_buffer = false;
  const grpc::Status s =
      grpc::SerializationTraits<v1::AttendResponse>::Serialize(response, bytes, &own_buffer);
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("AttendResponse not serialized: ", s.error_message()));
}

// A call served on one AttendServer::Queue. Every operation it posts carries a Tag naming the
// call and the operation; the queue's thread hands each completion to Proceed.
class QueuedCall {
 public:
  struct Tag {
    QueuedCall* call;
    int op;
  };
  virtual ~QueuedCall() = default;
  // `draining`: the queue is shut down, so nothing more may be posted; the call just ends.
  virtual void Proceed(int op, bool ok, bool draining) = 0;
};

// One unary Attend: accepted, run inline on the queue's runner, finished, deleted.
class AttendUnaryCall final : public QueuedCall {
 public:
  // Posts the accept of the next call on `queue`.
  static void Listen(AttendServer::Queue* queue) { new AttendUnaryCall(queue); }

  void Proceed(int op, bool ok, bool draining) override {
    if (op == kFinished) {
      // Counted once the response went out, or found the call dead (cancelled by the client or
      // past its deadline): CANCELLED then, unless the server's own status was an error.
      const bool sent = ok && code_ == grpc::StatusCode::OK;
      if (sent) queue_->metrics->unary.Sent(response_bytes_.Length());
      queue_->metrics->unary.Finished(
          ok || code_ != grpc::StatusCode::OK ? code_ : grpc::StatusCode::CANCELLED, elapsed_);
      delete this;
      return;
    }
    // The accept failed only when the server is shutting down.
    if (draining || !ok) {
      delete this;
      return;
    }
    const absl::Time begin = absl::Now();
    RpcMetrics::Method& method = queue_->metrics->unary;
    method.Received(request_bytes_.Length());
    const grpc::Status s = ToGrpcStatus(Run());
    code_ = s.error_code();
    elapsed_ = absl::Now() - begin;
    // The next call is taken once this one has run: a long step does not hold calls that another
    // queue's thread could run.
    Listen(queue_);
    if (s.ok()) {
      responder_.Finish(response_bytes_, s, &finished_);
    } else {
      responder_.FinishWithError(s, &finished_);
    }
  }

 private:
  enum Op : int { kAccepted, kFinished };

  explicit AttendUnaryCall(AttendServer::Queue* queue) : queue_(queue) {
    queue_->service->RequestAttend(&ctx_, &request_bytes_, &responder_, queue_->cq.get(),
                                   queue_->cq.get(), &accepted_);
  }

  absl::Status Run() {
    AttendRunner& runner = queue_->unary_runner;
    if (absl::Status s = runner.Parse(&request_bytes_, &request_); !s.ok()) return s;
    if (absl::Status s = runner.Run(request_, &response_); !s.ok()) return s;
    return SerializeResponse(response_, &response_bytes_);
  }

  AttendServer::Queue* const queue_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&ctx_};
  grpc::ByteBuffer request_bytes_;
  grpc::ByteBuffer response_bytes_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
  // The run's status and time, counted when the finish returns.
  grpc::StatusCode code_ = grpc::StatusCode::OK;
  absl::Duration elapsed_;
  Tag accepted_{this, kAccepted};
  Tag finished_{this, kFinished};
};

// One AttendStream call, from its accept to its final status. At most one operation is pending
// at a time (accept, read, write or finish), all posted by the thread of the call's queue, which
// deletes the call after the last one.
class AttendStreamCall final : public QueuedCall {
 public:
  // Posts the accept of the next stream on `queue`.
  static void Listen(AttendServer::Queue* queue) { new AttendStreamCall(queue); }

  void Proceed(int op, bool ok, bool draining) override {
    if (op == kFinished) {
      // The OK status went out, or the call was already dead (cancelled, past its deadline).
      if (closing_) Count(ok ? grpc::StatusCode::OK : grpc::StatusCode::CANCELLED);
      delete this;
      return;
    }
    if (draining) {
      if (op == kWritten && ok) queue_->metrics->stream.Sent(response_bytes_.Length());
      if (op == kRead || op == kWritten) Count(grpc::StatusCode::CANCELLED);
      delete this;
      return;
    }
    switch (op) {
      case kAccepted:
        if (!ok) {  // the server is shutting down
          delete this;
          return;
        }
        Listen(queue_);
        start_ = absl::Now();
        stream_.Read(&request_bytes_, &read_);
        return;
      case kRead:
        if (!ok) {
          // The client half-closed, or the call is over; only the finish tells them apart, so
          // the stream is counted there.
          closing_ = true;
          stream_.Finish(grpc::Status::OK, &finished_);
          return;
        }
        Step();
        return;
      case kWritten:
        if (!ok) {
          FinishWith(
              grpc::Status(grpc::StatusCode::CANCELLED, "AttendStream closed by the client"));
          return;
        }
        // Counted once written: a step's write that the client's cancel ends never went out.
        // Its bytes are not kept while the stream waits for the next step.
        queue_->metrics->stream.Sent(response_bytes_.Length());
        response_bytes_.Clear();
        stream_.Read(&request_bytes_, &read_);
        return;
    }
  }

 private:
  enum Op : int { kAccepted, kRead, kWritten, kFinished };

  explicit AttendStreamCall(AttendServer::Queue* queue)
      : queue_(queue), runner_(queue->store, queue->draining) {
    queue_->service->RequestAttendStream(&ctx_, &stream_, queue_->cq.get(), queue_->cq.get(),
                                         &accepted_);
  }

  void Step() {
    const absl::Time begin = absl::Now();
    AttendServer::Metrics& metrics = *queue_->metrics;
    metrics.stream.Received(request_bytes_.Length());
    absl::Status s = runner_.Parse(&request_bytes_, &request_);
    request_bytes_.Clear();  // parsed: not kept until the next read replaces it
    if (s.ok()) s = runner_.Run(request_, &response_);
    if (s.ok()) s = SerializeResponse(response_, &response_bytes_);
    if (!s.ok()) {
      const grpc::Status status = ToGrpcStatus(s);
      metrics.step.Finished(status.error_code(), absl::Now() - begin);
      FinishWith(status);
      return;
    }
    metrics.step.Finished(grpc::StatusCode::OK, absl::Now() - begin);
    stream_.Write(response_bytes_, &written_);
  }

  // Ends the stream with the server's error `s`, counted before Finish: a client that has the
  // status also sees it counted.
  void FinishWith(const grpc::Status& s) {
    Count(s.error_code());
    stream_.Finish(s, &finished_);
  }

  void Count(grpc::StatusCode code) {
    queue_->metrics->stream.Finished(code, absl::Now() - start_);
  }

  AttendServer::Queue* const queue_;
  AttendRunner runner_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> stream_{&ctx_};
  absl::Time start_;
  // The read ended the stream and its OK status was posted: counted when the finish returns.
  bool closing_ = false;
  grpc::ByteBuffer request_bytes_;
  grpc::ByteBuffer response_bytes_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
  Tag accepted_{this, kAccepted};
  Tag read_{this, kRead};
  Tag written_{this, kWritten};
  Tag finished_{this, kFinished};
};

}  // namespace

AttendServer::AttendServer(KvPoolService* service, KvStore* store, RpcMetrics* metrics,
                           const AttendServerOptions& options)
    : service_(service),
      store_(store),
      metrics_{metrics->ForMethod("Attend"), metrics->ForMethod("AttendStream"),
               metrics->ForMethod("AttendStream.step")},
      options_(options) {}

AttendServer::~AttendServer() { Shutdown(); }

void AttendServer::AddQueues(grpc::ServerBuilder& builder) {
  for (int i = 0; i < std::max(1, options_.threads); ++i) {
    queues_.push_back(std::make_unique<Queue>(service_, store_, &metrics_,
                                              builder.AddCompletionQueue(), options_.draining));
  }
}

void AttendServer::Start() {
  for (const std::unique_ptr<Queue>& queue : queues_) {
    AttendUnaryCall::Listen(queue.get());
    AttendStreamCall::Listen(queue.get());
    queue->thread = std::thread([this, q = queue.get()] { Poll(q); });
  }
}

void AttendServer::Shutdown() {
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

void AttendServer::Poll(Queue* queue) {
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
    auto* t = static_cast<QueuedCall::Tag*>(tag);
    t->call->Proceed(t->op, ok, draining);
  }
}

}  // namespace kvpool
