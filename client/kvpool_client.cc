#include "client/kvpool_client.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/attend_socket_session.h"
#include "grpcpp/grpcpp.h"

namespace kvpool::client {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// DATA_LOSS unless a Get layer's K and V hold whole blocks of whole heads of its layout (`heads`
// of them when not 0), and no more tokens than its blocks.
absl::Status CheckLayerBytes(const GetLayer& layer, v1::GetFormat format, uint32_t heads) {
  const v1::PageLayoutDescriptor& l = layer.layout;
  const uint64_t head_block = format == v1::GET_FORMAT_RAW
                                  ? uint64_t{l.head_page_bytes()}
                                  : uint64_t{l.block_tokens()} * l.head_dim() * sizeof(uint16_t);
  const uint64_t bytes = layer.k.size();
  if (head_block == 0 || layer.num_blocks == 0 || layer.v.size() != bytes ||
      bytes % (uint64_t{layer.num_blocks} * head_block) != 0 || bytes == 0 ||
      (heads != 0 && bytes != uint64_t{layer.num_blocks} * head_block * heads) ||
      layer.valid_tokens > uint64_t{layer.num_blocks} * l.block_tokens()) {
    return absl::DataLossError(absl::StrFormat(
        "Get: layer %d holds %d K and %d V bytes for %d blocks of %d tokens", layer.layer,
        layer.k.size(), layer.v.size(), layer.num_blocks, layer.valid_tokens));
  }
  // Sink rows, when sent: sink_tokens rows of every head the blocks hold.
  const uint64_t head_sinks = uint64_t{l.sink_tokens()} * l.head_dim() * sizeof(uint16_t);
  const uint64_t block_heads = bytes / layer.num_blocks / head_block;
  if (layer.sink_v.size() != layer.sink_k.size() ||
      (!layer.sink_k.empty() &&
       (head_sinks == 0 || layer.sink_k.size() != block_heads * head_sinks))) {
    return absl::DataLossError(
        absl::StrFormat("Get: layer %d holds %d K and %d V bytes of sink rows for %d heads",
                        layer.layer, layer.sink_k.size(), layer.sink_v.size(), block_heads));
  }
  return absl::OkStatus();
}

// fp16 bytes of a Span<const uint16_t>, as a proto bytes field wants them.
std::string Bytes(const uint16_t* data, size_t elements) {
  return std::string(reinterpret_cast<const char*>(data), elements * sizeof(uint16_t));
}

using Clock = std::chrono::steady_clock;

// The next event of `cq`: polled without sleeping until `spin` after `start`, then waited for.
// False once `cq` is shut down and drained.
bool NextEvent(grpc::CompletionQueue& cq, Clock::time_point start, std::chrono::nanoseconds spin,
               void** tag, bool* ok) {
  for (;;) {
    const bool spinning = Clock::now() - start < spin;
    switch (cq.AsyncNext(
        tag, ok,
        spinning ? gpr_time_0(GPR_CLOCK_MONOTONIC) : gpr_inf_future(GPR_CLOCK_MONOTONIC))) {
      case grpc::CompletionQueue::GOT_EVENT:
        return true;
      case grpc::CompletionQueue::SHUTDOWN:
        return false;
      case grpc::CompletionQueue::TIMEOUT:
        break;
    }
  }
}

// AttendStream on the async API so that Step can post the write and the read together and then
// poll for both without sleeping for up to `spin` (ClientOptions::attend_spin). Only the thread
// that calls Step / Finish touches the queue; every operation posted is awaited before returning.
class GrpcAttendSession final : public AttendSession {
 public:
  GrpcAttendSession(v1::KvPool::Stub* stub, absl::Time deadline, bool wait_for_ready,
                    absl::Duration spin)
      : spin_(absl::ToChronoNanoseconds(spin)) {
    context_.set_deadline(absl::ToChronoTime(deadline));
    context_.set_wait_for_ready(wait_for_ready);
    stream_ = stub->PrepareAsyncAttendStream(&context_, &cq_);
    stream_->StartCall(TagOf(kStarted));
    pending_ = kStarted;
  }
  ~GrpcAttendSession() override {
    if (!finished_) {
      context_.TryCancel();
      CloseWith(/*writes_done=*/false);
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  using AttendSession::Step;
  absl::Status Step(const v1::AttendRequest& request, v1::AttendResponse* response) override {
    if (finished_) {
      return final_status_.ok() ? absl::FailedPreconditionError("session finished") : final_status_;
    }
    // The start's batch must complete before the first write (it reuses the write's op set).
    bool ok = AwaitAll();
    if (ok) {
      stream_->Write(request, TagOf(kWritten));
      stream_->Read(response, TagOf(kRead));
      pending_ |= kWritten | kRead;
      ok = AwaitAll();
    }
    if (!ok) {
      CloseWith(/*writes_done=*/false);
      if (final_status_.ok()) {
        final_status_ = absl::UnavailableError("AttendStream closed by the server");
      }
      return final_status_;
    }
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    if (finished_) return final_status_;
    CloseWith(/*writes_done=*/AwaitAll());
    return final_status_;
  }

 private:
  enum Op : uint32_t { kStarted = 1, kWritten = 2, kRead = 4, kWritesDone = 8, kFinished = 16 };
  static void* TagOf(Op op) { return reinterpret_cast<void*>(static_cast<uintptr_t>(op)); }

  // Waits until no operation is pending; false if any of them failed (the stream is broken).
  bool AwaitAll() {
    const Clock::time_point start = Clock::now();
    bool all_ok = true;
    while (pending_ != 0) {
      void* tag;
      bool ok;
      NextEvent(cq_, start, spin_, &tag, &ok);  // the queue is shut down only in ~
      pending_ &= ~static_cast<uint32_t>(reinterpret_cast<uintptr_t>(tag));
      all_ok = all_ok && ok;
    }
    return all_ok;
  }

  // Half-closes (when the stream is still good), then takes the final status.
  void CloseWith(bool writes_done) {
    finished_ = true;
    AwaitAll();  // the start, when no Step ran
    if (writes_done) {
      stream_->WritesDone(TagOf(kWritesDone));
      pending_ |= kWritesDone;
      AwaitAll();
    }
    grpc::Status status;
    stream_->Finish(&status, TagOf(kFinished));
    pending_ |= kFinished;
    AwaitAll();
    final_status_ = FromGrpc(status);
  }

  const std::chrono::nanoseconds spin_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream_;
  uint32_t pending_ = 0;  // Op bits posted and not yet completed
  bool finished_ = false;
  absl::Status final_status_;
};

class GrpcKvPoolClient final : public KvPoolClient {
 public:
  // `target`: the channel's target, "" for a channel made elsewhere.
  GrpcKvPoolClient(std::shared_ptr<grpc::Channel> channel, std::string target,
                   const ClientOptions& options)
      : options_(options),
        target_(std::move(target)),
        stub_(v1::KvPool::NewStub(std::move(channel))) {}

  const ClientOptions& options() const override { return options_; }

  absl::StatusOr<v1::NamespaceInfo> CreateNamespace(const v1::NamespaceSpec& spec,
                                                    const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::CreateNamespaceRequest req;
    *req.mutable_spec() = spec;
    v1::CreateNamespaceResponse resp;
    absl::Status s = FromGrpc(stub_->CreateNamespace(&ctx, req, &resp));
    if (!s.ok()) return s;
    return std::move(*resp.mutable_info());
  }

  absl::StatusOr<std::vector<v1::NamespaceInfo>> ListNamespaces(
      const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::ListNamespacesResponse resp;
    absl::Status s = FromGrpc(stub_->ListNamespaces(&ctx, v1::ListNamespacesRequest(), &resp));
    if (!s.ok()) return s;
    return std::vector<v1::NamespaceInfo>(resp.namespaces().begin(), resp.namespaces().end());
  }

  absl::StatusOr<v1::NamespaceInfo> GetNamespace(std::string_view name,
                                                 const CallOptions& call) override {
    absl::StatusOr<std::vector<v1::NamespaceInfo>> all = ListNamespaces(call);
    if (!all.ok()) return all.status();
    for (v1::NamespaceInfo& info : *all) {
      if (name.empty() || info.spec().name() == name) return std::move(info);
    }
    return absl::NotFoundError(absl::StrFormat("no namespace \"%s\"", name));
  }

  absl::StatusOr<v1::PutResponse> Put(std::string_view ns, absl::Span<const int32_t> token_ids,
                                      const SequenceKv& kv, const CallOptions& call) override {
    const size_t layer_elems = kv.LayerElements();
    if (kv.k.size() != layer_elems * kv.num_layers || kv.v.size() != kv.k.size()) {
      return absl::InvalidArgumentError("SequenceKv: k/v sizes do not match its shape");
    }
    if (size_t{kv.token_begin} + kv.num_tokens > token_ids.size()) {
      return absl::InvalidArgumentError("SequenceKv: token range beyond token_ids");
    }
    const size_t token_elems = size_t{kv.num_kv_heads} * kv.head_dim;
    const size_t token_bytes = 2 * token_elems * sizeof(uint16_t);  // k + v
    // Clamped before it narrows: a max_chunk_bytes past 2^32 tokens must not wrap.
    const uint32_t chunk_tokens = static_cast<uint32_t>(
        std::clamp<size_t>(options_.max_chunk_bytes / std::max<size_t>(1, token_bytes), 1,
                           std::max<uint32_t>(1, kv.num_tokens)));

    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::PutResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer = stub_->Put(&ctx, &resp);
    v1::PutRequest msg;
    v1::PutHeader* header = msg.mutable_header();
    header->set_namespace_(std::string(ns));
    header->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
    bool open = writer->Write(msg);
    for (uint32_t layer = 0; open && layer < kv.num_layers; ++layer) {
      for (uint32_t t = 0; open && t < kv.num_tokens; t += chunk_tokens) {
        const uint32_t n = std::min(chunk_tokens, kv.num_tokens - t);
        const size_t offset = layer * layer_elems + t * token_elems;
        v1::PutRequest chunk_msg;
        v1::PutChunk* chunk = chunk_msg.mutable_chunk();
        chunk->set_layer(layer);
        chunk->set_token_begin(kv.token_begin + t);
        chunk->set_num_tokens(n);
        chunk->set_k(Bytes(kv.k.data() + offset, n * token_elems));
        chunk->set_v(Bytes(kv.v.data() + offset, n * token_elems));
        open = writer->Write(chunk_msg);
      }
    }
    // A failed Write means the server ended the stream; Finish returns its status.
    if (open) writer->WritesDone();
    absl::Status s = FromGrpc(writer->Finish());
    if (!s.ok()) return s;
    return resp;
  }

  absl::StatusOr<v1::MatchResponse> Match(std::string_view ns,
                                          absl::Span<const int32_t> token_ids,
                                          absl::Duration ttl, const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::MatchRequest req;
    req.set_namespace_(std::string(ns));
    req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
    if (ttl < absl::ZeroDuration()) return absl::InvalidArgumentError("lease ttl is negative");
    req.set_ttl_ms(ProtocolMilliseconds(ttl));
    v1::MatchResponse resp;
    absl::Status s = FromGrpc(stub_->Match(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp;
  }

  absl::Status Release(uint64_t lease_id, const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::ReleaseRequest req;
    req.set_lease_id(lease_id);
    v1::ReleaseResponse resp;
    return FromGrpc(stub_->Release(&ctx, req, &resp));
  }

  absl::StatusOr<GetResult> Get(const v1::GetRequest& request, const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    std::unique_ptr<grpc::ClientReader<v1::GetResponse>> reader = stub_->Get(&ctx, request);
    // Messages of a layer, keyed by block_begin, joined once the stream is complete.
    std::map<uint32_t, std::map<uint32_t, v1::GetResponse>> parts;
    GetResult result;
    result.format = request.format() == v1::GET_FORMAT_RAW ? v1::GET_FORMAT_RAW
                                                            : v1::GET_FORMAT_FP16;
    v1::GetResponse msg;
    // The first message the server should not have sent; the stream is read to its end first.
    absl::Status bad;
    while (reader->Read(&msg)) {
      result.payload_bytes +=
          msg.k().size() + msg.v().size() + msg.sink_k().size() + msg.sink_v().size();
      const uint32_t layer = msg.layer(), begin = msg.block_begin();
      if (bad.ok() && (layer < request.layer_begin() ||
                       (request.layer_end() != 0 && layer >= request.layer_end()))) {
        bad = absl::DataLossError(absl::StrFormat("Get: layer %d was not asked for", layer));
      }
      if (!parts[layer].try_emplace(begin, std::move(msg)).second && bad.ok()) {
        bad =
            absl::DataLossError(absl::StrFormat("Get: layer %d block %d sent twice", layer, begin));
      }
      msg.Clear();
    }
    absl::Status s = FromGrpc(reader->Finish());
    if (!s.ok()) return s;
    if (!bad.ok()) return bad;
    for (auto& [layer, blocks] : parts) {
      GetLayer out;
      out.layer = layer;
      uint32_t next_block = 0;
      for (auto& [begin, part] : blocks) {
        if (begin != next_block) {
          return absl::DataLossError(
              absl::StrFormat("Get: layer %d is missing blocks [%d, %d)", layer, next_block,
                              begin));
        }
        next_block = begin + part.num_blocks();
        out.num_blocks += part.num_blocks();
        out.valid_tokens += part.valid_tokens();
        if (part.has_layout()) out.layout = part.layout();
        out.k.append(part.k());
        out.v.append(part.v());
        out.sink_k.append(part.sink_k());
        out.sink_v.append(part.sink_v());
      }
      const uint32_t heads = request.head_end() > request.head_begin()
                                 ? request.head_end() - request.head_begin()
                                 : 0;  // all of the namespace's: not known here
      if (absl::Status s = CheckLayerBytes(out, result.format, heads); !s.ok()) return s;
      result.layers.push_back(std::move(out));
    }
    return result;
  }

  absl::StatusOr<uint32_t> Append(uint64_t lease_id, uint32_t layer,
                                  absl::Span<const int32_t> token_ids, uint32_t num_tokens,
                                  absl::Span<const uint16_t> k, absl::Span<const uint16_t> v,
                                  const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::AppendRequest req;
    req.set_lease_id(lease_id);
    req.set_layer(layer);
    req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
    req.set_num_tokens(num_tokens);
    req.set_k(Bytes(k.data(), k.size()));
    req.set_v(Bytes(v.data(), v.size()));
    v1::AppendResponse resp;
    absl::Status s = FromGrpc(stub_->Append(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.layer_tokens();
  }

  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                            const CallOptions& call) override {
    // On the async API, polled like an AttendSession's step (ClientOptions::attend_spin).
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::AttendResponse resp;
    grpc::Status status;
    grpc::CompletionQueue cq;
    const Clock::time_point start = Clock::now();
    std::unique_ptr<grpc::ClientAsyncResponseReader<v1::AttendResponse>> rpc =
        stub_->AsyncAttend(&ctx, request, &cq);
    rpc->Finish(&resp, &status, &status);
    void* tag;
    bool ok;
    NextEvent(cq, start, absl::ToChronoNanoseconds(options_.attend_spin), &tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    absl::Status s = FromGrpc(status);
    if (!s.ok()) return s;
    return resp;
  }

  absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttendStream(
      const CallOptions& call) override {
    if (!options_.attend_unix_socket.empty()) {
      return OpenAttendRegionSession(options_.attend_unix_socket, options_.attend_region_bytes,
                                     Deadline(call), options_.attend_spin,
                                     static_cast<uint32_t>(options_.max_message_bytes));
    }
    if (options_.attend_socket_port != 0) {
      if (options_.credentials != nullptr) {
        return absl::FailedPreconditionError(
            "attend_socket_port: the AttendSocket carries no TLS; use AttendStream with "
            "credentials");
      }
      absl::StatusOr<std::string> address =
          AttendSocketAddress(target_, options_.attend_socket_port);
      if (!address.ok()) return address.status();
      return OpenAttendSocketSession(*address, Deadline(call), options_.attend_spin,
                                     static_cast<uint32_t>(options_.max_message_bytes));
    }
    return std::make_unique<GrpcAttendSession>(stub_.get(), Deadline(call),
                                               options_.wait_for_ready, options_.attend_spin);
  }

  absl::StatusOr<v1::StatsResponse> Stats(const CallOptions& call) override {
    grpc::ClientContext ctx;
    Prepare(ctx, call);
    v1::StatsResponse resp;
    absl::Status s = FromGrpc(stub_->Stats(&ctx, v1::StatsRequest(), &resp));
    if (!s.ok()) return s;
    return resp;
  }

 private:
  absl::Time Deadline(const CallOptions& call) const {
    const absl::Duration d =
        call.deadline > absl::ZeroDuration() ? call.deadline : options_.default_deadline;
    return absl::Now() + d;
  }
  void Prepare(grpc::ClientContext& ctx, const CallOptions& call) const {
    ctx.set_deadline(absl::ToChronoTime(Deadline(call)));
    ctx.set_wait_for_ready(options_.wait_for_ready);
  }

  const ClientOptions options_;
  const std::string target_;
  const std::unique_ptr<v1::KvPool::Stub> stub_;
};

}  // namespace

std::unique_ptr<KvPoolClient> KvPoolClient::Create(const std::string& target,
                                                   const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // A distinct argument set keeps channels from sharing one connection (subchannel).
  args.SetInt("kvpool.channel_index", options.channel_index);
  std::shared_ptr<grpc::ChannelCredentials> creds =
      options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  return std::make_unique<GrpcKvPoolClient>(grpc::CreateCustomChannel(target, creds, args), target,
                                            options);
}

std::unique_ptr<KvPoolClient> KvPoolClient::Create(std::shared_ptr<grpc::Channel> channel,
                                                   const ClientOptions& options) {
  return std::make_unique<GrpcKvPoolClient>(std::move(channel), "", options);
}

uint32_t ProtocolMilliseconds(absl::Duration d) {
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1)));
  return static_cast<uint32_t>(std::min<int64_t>(ms, UINT32_MAX));
}

}  // namespace kvpool::client
