#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/proto_convert.h"
#include "service/stream_reactors.h"

namespace kvpool {
namespace {

// A GetResponse's bytes besides its K and V payloads (fields, layout descriptor), at most.
constexpr uint64_t kMessageOverheadBytes = 1024;

// Walks (layer, block run) in order with one message in flight: the next message is read from
// the store in OnWriteDone of the previous one, into the same response object, so its payload
// strings keep their capacity.
class GetReactor final : public grpc::ServerWriteReactor<v1::GetResponse> {
 public:
  GetReactor(grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
             IdleStreams* streams, RpcMetrics::Method* metrics, const v1::GetRequest* request)
      : store_(store),
        options_(options),
        streams_(streams),
        stream_(ctx),
        metrics_(metrics),
        request_(*request) {
    metrics_->Received(request->ByteSizeLong());
    if (streams_->Add(&stream_) > options_->max_get_streams) {
      FinishWith(absl::ResourceExhaustedError(absl::StrCat(
          "more than ", options_->max_get_streams, " Get streams open (--max_get_streams)")));
      return;
    }
    const absl::Status s = Plan();
    if (!s.ok()) {
      FinishWith(s);
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishWith(stream_.cancelled_idle()
                     ? absl::DeadlineExceededError(
                           absl::StrCat("Get stream's client took no message for over ",
                                        absl::FormatDuration(options_->get_stall_timeout),
                                        " (--get_stall_timeout_ms): cancelled"))
                     : absl::CancelledError("Get stream closed by the client"));
      return;
    }
    // Counted once written: a write the cancel of a stalled stream ends never went out.
    metrics_->Sent(response_.ByteSizeLong());
    streams_->Touch(&stream_);
    Next();
  }

  void OnDone() override {
    streams_->Remove(&stream_);
    delete this;
  }

 private:
  absl::Status Plan() {
    absl::StatusOr<KvStore::LeaseView> lease = store_->DescribeLease(request_.lease_id());
    if (!lease.ok()) return lease.status();
    lease_ = *std::move(lease);
    const NamespaceConfig& c = lease_.info.config;
    layer_ = request_.layer_begin();
    layer_end_ = request_.layer_end() == 0 ? c.num_layers : request_.layer_end();
    head_begin_ = request_.head_begin();
    head_end_ = request_.head_end() == 0 ? c.num_kv_heads : request_.head_end();
    if (layer_ >= layer_end_ || layer_end_ > static_cast<uint32_t>(c.num_layers)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers [", layer_, ", ", layer_end_, ") out of range for ", c.num_layers));
    }
    if (head_begin_ >= head_end_ || head_end_ > static_cast<uint32_t>(c.num_kv_heads)) {
      return absl::InvalidArgumentError(absl::StrCat("KV heads [", head_begin_, ", ", head_end_,
                                                     ") out of range for ", c.num_kv_heads));
    }
    switch (request_.format()) {
      case v1::GET_FORMAT_UNSPECIFIED:
      case v1::GET_FORMAT_FP16:
        raw_ = false;
        break;
      case v1::GET_FORMAT_RAW:
        raw_ = true;
        break;
      default:
        return absl::InvalidArgumentError("unknown GetFormat");
    }
    // A message carries at least one block of one layer, K and V (and a RAW layer's first its
    // sink rows): refused now if one cannot.
    for (uint32_t l = layer_; l < layer_end_; ++l) {
      const uint64_t least = 2 * (BlockBytes(l) + SinkBytes(l));
      if (least + kMessageOverheadBytes > options_->max_message_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat("a block of layer ", l, " takes ", least,
                         " bytes in this format, over the ", options_->max_message_bytes,
                         "-byte message limit (--max_message_bytes): ask for "
                         "fewer KV heads per Get"));
      }
    }
    // Within the server's message limit, whatever --get_chunk_bytes says: the check above left
    // room for at least one block.
    chunk_bytes_ = static_cast<uint32_t>(
        std::min<uint64_t>(request_.max_chunk_bytes() == 0
                               ? options_->get_chunk_bytes
                               : std::min(request_.max_chunk_bytes(), options_->get_chunk_bytes),
                           options_->max_message_bytes - kMessageOverheadBytes));
    block_ = 0;
    // The checks passed. Each read renews the lease; a Get that reads nothing (no block to send)
    // renews it here.
    for (uint32_t l = layer_; l < layer_end_; ++l) {
      if (LayerBlocks(l) > 0) return absl::OkStatus();
    }
    return store_->RenewLease(request_.lease_id());
  }

  // Bytes of K (and of V) of one block of `layer`, in this Get's format and heads.
  uint64_t BlockBytes(uint32_t layer) const {
    const NamespaceConfig& c = lease_.info.config;
    const uint64_t heads = head_end_ - head_begin_;
    return raw_ ? heads * LayerLayout(c, static_cast<int>(layer)).head_page_bytes()
                : Fp16KvBytes(c, c.block_tokens) / c.num_kv_heads * heads;
  }

  // Bytes of K (and of V) of `layer`'s sink rows in a RAW message of block 0, in this Get's
  // heads; 0 in FP16 (the rows are in k and v) or without sinks.
  uint64_t SinkBytes(uint32_t layer) const {
    const PageLayout l = LayerLayout(lease_.info.config, static_cast<int>(layer));
    return raw_ ? uint64_t{head_end_ - head_begin_} * l.sink_tokens * l.head_dim * 2 : 0;
  }

  // Tokens held for `layer`: the lease's per-layer count when the store reports one.
  uint32_t LayerTokens(uint32_t layer) const {
    if (layer < lease_.layer_tokens.size()) return lease_.layer_tokens[layer];
    return lease_.num_blocks * static_cast<uint32_t>(lease_.info.config.block_tokens);
  }

  // Blocks sent for `layer`: the lease's (lease_blocks), or those holding its tokens.
  uint32_t LayerBlocks(uint32_t layer) const {
    if (request_.lease_blocks()) return lease_.num_blocks;
    const uint32_t bt = static_cast<uint32_t>(lease_.info.config.block_tokens);
    return (LayerTokens(layer) + bt - 1) / bt;
  }

  void Next() {
    const NamespaceConfig& c = lease_.info.config;
    const uint32_t bt = static_cast<uint32_t>(c.block_tokens);
    // Skip layers with nothing (left) to send.
    while (layer_ < layer_end_ && block_ >= LayerBlocks(layer_)) {
      ++layer_;
      block_ = 0;
    }
    if (layer_ >= layer_end_) {
      FinishWith(absl::OkStatus());
      return;
    }
    const uint32_t layer_tokens = LayerTokens(layer_);
    const uint32_t layer_blocks = LayerBlocks(layer_);
    const PageLayout layout = LayerLayout(c, static_cast<int>(layer_));
    const uint64_t block_bytes = BlockBytes(layer_);
    const uint64_t sink_bytes = block_ == 0 ? SinkBytes(layer_) : 0;
    const uint64_t room = chunk_bytes_ > 2 * sink_bytes ? chunk_bytes_ - 2 * sink_bytes : 0;
    const uint32_t per_msg = static_cast<uint32_t>(std::max<uint64_t>(1, room / (2 * block_bytes)));
    const uint32_t n = std::min(per_msg, layer_blocks - block_);

    response_.Clear();
    response_.set_layer(layer_);
    response_.set_block_begin(block_);
    response_.set_num_blocks(n);
    response_.set_valid_tokens(
        layer_tokens > block_ * bt ? std::min(n * bt, layer_tokens - block_ * bt) : 0);
    if (block_ == 0) ToProtoLayout(layout, response_.mutable_layout());
    std::string* k = response_.mutable_k();
    std::string* v = response_.mutable_v();
    k->resize(n * block_bytes);
    v->resize(n * block_bytes);
    const absl::Status s =
        raw_ ? store_->ReadRaw(request_.lease_id(), layer_, block_, n, head_begin_, head_end_,
                               reinterpret_cast<uint8_t*>(k->data()),
                               reinterpret_cast<uint8_t*>(v->data()))
             : store_->ReadFp16(request_.lease_id(), layer_, block_, n, head_begin_, head_end_,
                                reinterpret_cast<uint16_t*>(k->data()),
                                reinterpret_cast<uint16_t*>(v->data()));
    if (!s.ok()) {
      FinishWith(s);
      return;
    }
    if (sink_bytes > 0) {
      std::string* sink_k = response_.mutable_sink_k();
      std::string* sink_v = response_.mutable_sink_v();
      sink_k->resize(sink_bytes);
      sink_v->resize(sink_bytes);
      const absl::Status sinks = store_->ReadRawSinks(
          request_.lease_id(), layer_, head_begin_, head_end_,
          reinterpret_cast<uint8_t*>(sink_k->data()), reinterpret_cast<uint8_t*>(sink_v->data()));
      if (!sinks.ok()) {
        FinishWith(sinks);
        return;
      }
    }
    block_ += n;
    StartWrite(&response_);
  }

  void FinishWith(const absl::Status& s) {
    const grpc::Status g = ToGrpcStatus(s);
    // Recorded before Finish: a client that has the status also sees it counted.
    metrics_->Finished(g.error_code(), absl::Now() - start_);
    Finish(g);
  }

  KvStore* const store_;
  const ServiceOptions* const options_;
  IdleStreams* const streams_;
  IdleStreams::Stream stream_;
  RpcMetrics::Method* const metrics_;
  const v1::GetRequest request_;
  const absl::Time start_ = absl::Now();
  KvStore::LeaseView lease_;
  bool raw_ = false;
  uint32_t chunk_bytes_ = 0;
  uint32_t layer_ = 0;  // next (layer, block) to send
  uint32_t layer_end_ = 0;
  uint32_t block_ = 0;
  uint32_t head_begin_ = 0;
  uint32_t head_end_ = 0;
  v1::GetResponse response_;
};

}  // namespace

grpc::ServerWriteReactor<v1::GetResponse>* NewGetReactor(
    grpc::CallbackServerContext* ctx, KvStore* store, const ServiceOptions* options,
    IdleStreams* streams, RpcMetrics::Method* metrics, const v1::GetRequest* request) {
  return new GetReactor(ctx, store, options, streams, metrics, request);
}

}  // namespace kvpool
