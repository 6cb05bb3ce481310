#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "grpcpp/server_context.h"
#include "service/idle_streams.h"
#include "service/proto_convert.h"
#include "service/stream_reactors.h"

namespace kvpool {
namespace {

// Reads one message at a time; the store session is driven only from OnReadDone, which gRPC
// never runs concurrently with itself, so no lock is needed.
class PutReactor final : public grpc::ServerReadReactor<v1::PutRequest> {
 public:
  PutReactor(grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
             IdleStreams* streams, RpcMetrics::Method* metrics, v1::PutResponse* response)
      : ctx_(ctx),
        store_(store),
        options_(options),
        streams_(streams),
        stream_(ctx),
        metrics_(metrics),
        response_(response) {
    streams_->Add(&stream_);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      FinishWith(Commit());
      return;
    }
    streams_->Touch(&stream_);
    const absl::Status s = Accept();
    if (!s.ok()) {
      FinishWith(s);
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    streams_->Remove(&stream_);
    delete this;
  }

 private:
  absl::Status Accept() {
    const uint64_t bytes = request_.ByteSizeLong();
    metrics_->Received(bytes);
    stream_bytes_ += bytes;
    if (stream_bytes_ > options_->max_put_stream_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("Put stream carries more than ",
                                                       options_->max_put_stream_bytes,
                                                       " bytes (--max_put_stream_bytes)"));
    }
    switch (request_.msg_case()) {
      case v1::PutRequest::kHeader:
        return BeginSession(request_.header());
      case v1::PutRequest::kChunk:
        return AddChunk(request_.chunk());
      default:
        return absl::InvalidArgumentError("PutRequest carries neither header nor chunk");
    }
  }

  absl::Status BeginSession(const v1::PutHeader& header) {
    if (session_ != nullptr) {
      return absl::InvalidArgumentError("Put stream has a second header");
    }
    if (streams_->size() > options_->max_put_streams) {  // this one included
      return absl::ResourceExhaustedError(absl::StrCat("more than ", options_->max_put_streams,
                                                       " Put streams open (--max_put_streams)"));
    }
    absl::StatusOr<std::unique_ptr<KvStore::PutSession>> session =
        store_->BeginPut(header.namespace_(),
                         absl::MakeConstSpan(header.token_ids().data(), header.token_ids().size()),
                         options_->max_put_stream_bytes - stream_bytes_);
    if (!session.ok()) return session.status();
    session_ = *std::move(session);
    return absl::OkStatus();
  }

  absl::Status AddChunk(const v1::PutChunk& chunk) {
    if (session_ == nullptr) {
      return absl::InvalidArgumentError("Put stream must start with a header");
    }
    if (chunk.num_tokens() == 0) return absl::InvalidArgumentError("PutChunk has num_tokens 0");
    if (chunk.k().empty() || chunk.v().empty()) {
      return absl::InvalidArgumentError("PutChunk has an empty k or v payload");
    }
    const NamespaceConfig& c = session_->info().config;
    const uint64_t want = Fp16KvBytes(c, chunk.num_tokens());
    if (chunk.k().size() != want || chunk.v().size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("PutChunk k/v have ", chunk.k().size(), "/", chunk.v().size(), " bytes; ",
                       chunk.num_tokens(), " tokens x ", c.num_kv_heads, " heads x ", c.head_dim,
                       " dims fp16 need ", want));
    }
    absl::Status s = session_->AddChunk(chunk.layer(), chunk.token_begin(), chunk.num_tokens(),
                                        reinterpret_cast<const uint16_t*>(chunk.k().data()),
                                        reinterpret_cast<const uint16_t*>(chunk.v().data()));
    if (s.ok()) payload_bytes_ += 2 * want;
    return s;
  }

  // A stream swept as idle or cancelled by the client ends like a complete one: it must not
  // publish, and is counted as what ended it, header or not. It leaves the sweep's registry first:
  // a sweep could otherwise cancel the call after its session had published, and the client would
  // see a failed Put that stored its blocks.
  absl::Status Commit() {
    streams_->Remove(&stream_);
    if (stream_.cancelled_idle()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "Put stream sent nothing for over ", absl::FormatDuration(options_->put_idle_timeout),
          " (--put_idle_timeout_ms): cancelled, nothing stored"));
    }
    if (ctx_->IsCancelled()) return absl::CancelledError("Put cancelled by the client");
    if (session_ == nullptr) {
      return absl::InvalidArgumentError("Put stream ended without a header");
    }
    absl::StatusOr<KvStore::PutResult> r = session_->Commit();
    if (!r.ok()) return r.status();
    response_->set_tokens_cached(r->tokens_cached);
    response_->set_tokens_stored(r->tokens_stored);
    response_->set_tokens_ignored(r->tokens_ignored);
    response_->set_bytes_received(payload_bytes_);
    metrics_->Sent(response_->ByteSizeLong());
    return absl::OkStatus();
  }

  void FinishWith(const absl::Status& s) {
    // An uncommitted session frees its blocks: a failed Put changes nothing.
    session_.reset();
    const grpc::Status g = ToGrpcStatus(s);
    // Recorded before Finish: a client that has the status also sees it counted.
    metrics_->Finished(g.error_code(), absl::Now() - start_);
    Finish(g);
  }

  grpc::CallbackServerContext* const ctx_;
  KvStore* const store_;
  const ServiceOptions* const options_;
  IdleStreams* const streams_;
  IdleStreams::Stream stream_;
  RpcMetrics::Method* const metrics_;
  v1::PutResponse* const response_;
  const absl::Time start_ = absl::Now();
  v1::PutRequest request_;
  std::unique_ptr<KvStore::PutSession> session_;
  uint64_t stream_bytes_ = 0;
  uint64_t payload_bytes_ = 0;
};

}  // namespace

grpc::ServerReadReactor<v1::PutRequest>* NewPutReactor(
    grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
    IdleStreams* streams, RpcMetrics::Method* metrics, v1::PutResponse* response) {
  return new PutReactor(ctx, store, options, streams, metrics, response);
}

}  // namespace kvpool
