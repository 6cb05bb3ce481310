#include "client/transfer_client.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace kvpool::client {
namespace {

// A zero or negative timeout would expire the NCCL attempt at once, aborting the channel.
absl::Status CheckTimeout(absl::Duration timeout) {
  return timeout > absl::ZeroDuration()
             ? absl::OkStatus()
             : absl::InvalidArgumentError("transfers take a positive timeout");
}

absl::Status CheckPutSource(const PutSource& src, size_t num_tokens) {
  if (num_tokens == 0) return absl::InvalidArgumentError("Put of an empty sequence");
  if (src.num_layers == 0 || src.num_kv_heads == 0 || src.head_dim == 0 || src.k == nullptr ||
      src.v == nullptr) {
    return absl::InvalidArgumentError("PutSource needs a shape and both buffers");
  }
  return absl::OkStatus();
}

// What is left of a call's timeout for its gRPC transfer (the whole of it without an NCCL
// attempt); DEADLINE_EXCEEDED, naming the NCCL attempt's error, when nothing is.
absl::StatusOr<absl::Duration> TimeLeft(absl::Time deadline, const absl::Status& nccl_error) {
  const absl::Duration left = deadline - absl::Now();
  if (left > absl::ZeroDuration()) return left;
  return absl::DeadlineExceededError(absl::StrCat(
      "the timeout passed in the NCCL attempt, no time left for gRPC: ", nccl_error.ToString()));
}

}  // namespace

BufferCopy HostBufferCopy() {
  auto copy = [](void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  };
  return BufferCopy{copy, copy};
}

TransferClient::TransferClient(KvPoolClient* kv, BufferCopy copy,
                               std::unique_ptr<NcclChannel> channel)
    : kv_(kv), copy_(std::move(copy)), channel_(std::move(channel)) {}

void TransferClient::SetChannel(std::unique_ptr<NcclChannel> channel) {
  std::shared_ptr<NcclChannel> old;
  {
    absl::MutexLock l(&mu_);
    old = std::exchange(channel_, std::move(channel));
  }
  // `old` closes here, outside mu_ (closing is an RPC), once no transfer still uses it.
}

TransferPath TransferClient::path() const {
  return HealthyChannel() != nullptr ? TransferPath::kNccl : TransferPath::kGrpc;
}

std::shared_ptr<NcclChannel> TransferClient::HealthyChannel() const {
  std::shared_ptr<NcclChannel> channel;
  {
    absl::MutexLock l(&mu_);
    channel = channel_;
  }
  return channel != nullptr && channel->healthy() ? channel : nullptr;
}

void TransferClient::DropChannel(const std::shared_ptr<NcclChannel>& channel) {
  std::shared_ptr<NcclChannel> dropped;
  absl::MutexLock l(&mu_);
  if (channel_ == channel) dropped = std::move(channel_);
}

absl::StatusOr<TransferGetResult> TransferClient::Get(const v1::GetRequest& request, void* dst,
                                                      uint64_t capacity, absl::Duration timeout) {
  if (dst == nullptr) return absl::InvalidArgumentError("Get into a null buffer");
  if (absl::Status s = CheckTimeout(timeout); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status nccl_error;
  // Closed (an RPC, within the call's deadline) after the retry, not before it.
  std::shared_ptr<NcclChannel> dropped;
  if (std::shared_ptr<NcclChannel> channel = HealthyChannel()) {
    v1::NcclGetRequest nccl;
    nccl.set_lease_id(request.lease_id());
    nccl.set_layer_begin(request.layer_begin());
    nccl.set_layer_end(request.layer_end());
    nccl.set_head_begin(request.head_begin());
    nccl.set_head_end(request.head_end());
    nccl.set_format(request.format());
    absl::StatusOr<v1::NcclGetDescriptor> d = channel->Get(nccl, dst, capacity, timeout);
    if (d.ok()) {
      TransferGetResult result;
      result.path = TransferPath::kNccl;
      result.layers.assign(d->layers().begin(), d->layers().end());
      result.num_blocks = d->num_blocks();
      result.valid_tokens = d->valid_tokens();
      result.total_bytes = d->total_bytes();
      return result;
    }
    if (channel->healthy()) return d.status();
    DropChannel(channel);
    channel->SetCloseDeadline(deadline);
    dropped = std::move(channel);
    nccl_error = d.status();
  }
  absl::StatusOr<absl::Duration> left = TimeLeft(deadline, nccl_error);
  if (!left.ok()) return left.status();
  absl::StatusOr<TransferGetResult> result = GrpcGet(request, dst, capacity, *left);
  if (result.ok()) result->nccl_error = nccl_error;
  return result;
}

absl::StatusOr<TransferPutResult> TransferClient::Put(std::string_view ns,
                                                      absl::Span<const int32_t> token_ids,
                                                      const PutSource& src,
                                                      absl::Duration timeout) {
  if (absl::Status s = CheckPutSource(src, token_ids.size()); !s.ok()) return s;
  if (absl::Status s = CheckTimeout(timeout); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status nccl_error;
  // Closed (an RPC, within the call's deadline) after the retry, not before it.
  std::shared_ptr<NcclChannel> dropped;
  if (std::shared_ptr<NcclChannel> channel = HealthyChannel()) {
    const uint64_t token_bytes = uint64_t{src.num_kv_heads} * src.head_dim * sizeof(uint16_t);
    absl::StatusOr<v1::PutResponse> r =
        channel->Put(ns, token_ids, src.num_layers, src.k, src.v, token_bytes, timeout);
    if (r.ok()) {
      TransferPutResult result;
      result.path = TransferPath::kNccl;
      result.response = *std::move(r);
      return result;
    }
    if (channel->healthy()) return r.status();
    DropChannel(channel);
    channel->SetCloseDeadline(deadline);
    dropped = std::move(channel);
    nccl_error = r.status();
  }
  absl::StatusOr<absl::Duration> left = TimeLeft(deadline, nccl_error);
  if (!left.ok()) return left.status();
  absl::StatusOr<TransferPutResult> result = GrpcPut(ns, token_ids, src, *left);
  if (result.ok()) result->nccl_error = nccl_error;
  return result;
}

absl::StatusOr<TransferGetResult> TransferClient::GrpcGet(const v1::GetRequest& request, void* dst,
                                                          uint64_t capacity,
                                                          absl::Duration timeout) {
  CallOptions call;
  call.deadline = timeout;
  v1::GetRequest over_lease_blocks = request;
  over_lease_blocks.set_lease_blocks(true);  // every layer as NcclGet lays it out
  absl::StatusOr<GetResult> got = kv_->Get(over_lease_blocks, call);
  if (!got.ok()) return got.status();
  TransferGetResult result;
  result.path = TransferPath::kGrpc;
  for (const GetLayer& layer : got->layers) {
    if (layer.v.size() != layer.k.size() || layer.sink_v.size() != layer.sink_k.size()) {
      return absl::DataLossError(absl::StrFormat(
          "layer %d: K holds %d bytes, V %d; sink K %d, sink V %d", layer.layer, layer.k.size(),
          layer.v.size(), layer.sink_k.size(), layer.sink_v.size()));
    }
    if (!result.layers.empty() && layer.num_blocks != result.num_blocks) {
      return absl::DataLossError(absl::StrFormat(
          "layer %d spans %d blocks, layer %d %d: a server that ignores GetRequest.lease_blocks",
          layer.layer, layer.num_blocks, result.layers.back().layer(), result.num_blocks));
    }
    // As NcclGet lays a layer out: K, V, then the sink rows (RAW with sinks), K then V.
    v1::NcclLayerSegments& seg = result.layers.emplace_back();
    seg.set_layer(layer.layer);
    seg.set_k_offset(result.total_bytes);
    seg.set_v_offset(result.total_bytes + layer.k.size());
    seg.set_bytes(layer.k.size());
    if (request.format() == v1::GET_FORMAT_RAW) *seg.mutable_layout() = layer.layout;
    result.total_bytes += 2 * layer.k.size();
    if (!layer.sink_k.empty()) {
      seg.set_sink_k_offset(result.total_bytes);
      seg.set_sink_v_offset(result.total_bytes + layer.sink_k.size());
      seg.set_sink_bytes(layer.sink_k.size());
      result.total_bytes += 2 * layer.sink_k.size();
    }
    result.valid_tokens = result.layers.size() == 1
                              ? layer.valid_tokens
                              : std::min(result.valid_tokens, layer.valid_tokens);
    result.num_blocks = layer.num_blocks;
  }
  if (result.total_bytes > capacity) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the payload is %d bytes, the worker's buffer %d", result.total_bytes, capacity));
  }
  auto* base = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < got->layers.size(); ++i) {
    const GetLayer& layer = got->layers[i];
    const v1::NcclLayerSegments& seg = result.layers[i];
    // K, V, sink K, sink V (the sink rows empty without sinks).
    const std::pair<uint64_t, const std::string*> parts[] = {{seg.k_offset(), &layer.k},
                                                             {seg.v_offset(), &layer.v},
                                                             {seg.sink_k_offset(), &layer.sink_k},
                                                             {seg.sink_v_offset(), &layer.sink_v}};
    for (const auto& [offset, bytes] : parts) {
      if (bytes->empty()) continue;
      if (absl::Status s = copy_.to_buffer(base + offset, bytes->data(), bytes->size()); !s.ok()) {
        return s;
      }
    }
  }
  return result;
}

absl::StatusOr<TransferPutResult> TransferClient::GrpcPut(std::string_view ns,
                                                          absl::Span<const int32_t> token_ids,
                                                          const PutSource& src,
                                                          absl::Duration timeout) {
  SequenceKv kv;
  kv.num_layers = src.num_layers;
  kv.token_begin = 0;
  kv.num_tokens = static_cast<uint32_t>(token_ids.size());
  kv.num_kv_heads = src.num_kv_heads;
  kv.head_dim = src.head_dim;
  const size_t elems = kv.LayerElements() * kv.num_layers;
  kv.k.resize(elems);
  kv.v.resize(elems);
  if (absl::Status s = copy_.from_buffer(kv.k.data(), src.k, elems * sizeof(uint16_t)); !s.ok()) {
    return s;
  }
  if (absl::Status s = copy_.from_buffer(kv.v.data(), src.v, elems * sizeof(uint16_t)); !s.ok()) {
    return s;
  }
  CallOptions call;
  call.deadline = timeout;
  absl::StatusOr<v1::PutResponse> r = kv_->Put(ns, token_ids, kv, call);
  if (!r.ok()) return r.status();
  TransferPutResult result;
  result.path = TransferPath::kGrpc;
  result.response = *std::move(r);
  return result;
}

}  // namespace kvpool::client
