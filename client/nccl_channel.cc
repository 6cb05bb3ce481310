#include "client/nccl_channel.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/kvpool_client.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"

namespace kvpool::client {
namespace {

constexpr int kServerRank = 0;
constexpr absl::Duration kPollInterval = absl::Microseconds(20);
// How long a transfer's copies may still run once the server has ended the call with an error. A
// server that refuses a Put's contents receives every byte first (to stay in step) and keeps its
// channel: this end's sends complete just after, and aborting it for the status alone would break
// a working channel. Copies still running past this mean the server stopped moving data.
constexpr absl::Duration kServerFailedGrace = absl::Milliseconds(100);

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// A transfer's timeout is its data-phase deadline on this end: not positive, it would expire at
// once and abort the channel while the server waited (0 is the server's default there).
absl::Status CheckTimeout(absl::Duration timeout) {
  if (timeout > absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError("NCCL transfer timeout must be positive");
}

// Makes `device` the calling thread's current CUDA device for its scope, then restores the
// caller's: a worker that drives other GPUs must not find its device changed by a transfer.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = false;
};

struct Segment {
  void* data;
  uint64_t bytes;
};

// The rest of a transfer's stream, read on a thread of its own while the data moves: a server
// that ends the call with an error mid-transfer is seen at once (NCCL does not tell this end when
// the server aborts its communicator, and the transfer would wait for its deadline).
template <typename Response>
class StreamTail {
 public:
  explicit StreamTail(grpc::ClientReader<Response>* reader)
      : thread_([this, reader] {
          Response msg;
          while (reader->Read(&msg)) last_ = msg;
          status_ = reader->Finish();
          ended_.store(true, std::memory_order_release);
        }) {}
  ~StreamTail() { Wait(); }

  // Whether the server has ended the call with an error.
  bool Failed() const { return ended_.load(std::memory_order_acquire) && !status_.ok(); }
  // Waits for the call's end: its status; last() is then its last message (default if none).
  const grpc::Status& Wait() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  const Response& last() const { return last_; }

 private:
  Response last_;
  grpc::Status status_;
  std::atomic<bool> ended_{false};
  std::thread thread_;  // last, so that it starts after the members it writes
};

class NcclChannelImpl final : public NcclChannel {
 public:
  NcclChannelImpl(std::unique_ptr<v1::KvPoolTransport::Stub> stub, uint64_t id, int device)
      : stub_(std::move(stub)), id_(id), device_(device) {}

  ~NcclChannelImpl() override {
    absl::MutexLock l(&mu_);
    grpc::ClientContext ctx;
    absl::Time close_by = absl::Now() + absl::Seconds(5);
    {
      absl::MutexLock c(&close_mu_);
      close_by = std::min(close_by, close_deadline_);
    }
    ctx.set_deadline(absl::ToChronoTime(close_by));
    v1::CloseChannelRequest req;
    req.set_channel_id(id_);
    v1::CloseChannelResponse resp;
    stub_->CloseChannel(&ctx, req, &resp);
    const ScopedDevice device(device_);
    AbortLocked();
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Creates the stream and event and joins as rank 1.
  absl::Status Join(const std::string& unique_id, absl::Time deadline) {
    absl::MutexLock l(&mu_);
    if (unique_id.size() != sizeof(ncclUniqueId::internal)) {
      return absl::InvalidArgumentError("the server's ncclUniqueId has the wrong size");
    }
    const ScopedDevice device(device_);
    if (!device.ok() || cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&done_, cudaEventDisableTiming) != cudaSuccess) {
      return absl::FailedPreconditionError(
          absl::StrFormat("CUDA device %d unusable for NCCL", device_));
    }
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, 2, id, 1, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      AbortLocked();
      return absl::UnavailableError(
          absl::StrFormat("ncclCommInitRankConfig: %s", ncclGetErrorString(r)));
    }
    absl::Status joined = PollCommLocked(deadline, "joining");
    healthy_.store(joined.ok(), std::memory_order_release);
    return joined;
  }

  // Without mu_, which a transfer holds for its whole length.
  bool healthy() const override { return healthy_.load(std::memory_order_acquire); }
  uint64_t channel_id() const override { return id_; }
  void SetCloseDeadline(absl::Time deadline) override {
    absl::MutexLock c(&close_mu_);
    close_deadline_ = std::min(close_deadline_, deadline);
  }

  absl::StatusOr<v1::NcclGetDescriptor> Get(v1::NcclGetRequest request, void* dst,
                                            uint64_t capacity, absl::Duration timeout) override {
    if (absl::Status s = CheckTimeout(timeout); !s.ok()) return s;
    absl::MutexLock l(&mu_);
    if (comm_ == nullptr) return absl::UnavailableError("NCCL channel aborted");
    request.set_channel_id(id_);
    request.set_buffer_bytes(capacity);
    request.set_sink_rows(true);  // received below
    request.set_timeout_ms(ProtocolMilliseconds(timeout));
    const absl::Time deadline = absl::Now() + timeout;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline + absl::Seconds(5)));
    auto reader = stub_->NcclGet(&ctx, request);
    v1::NcclGetResponse msg;
    if (!reader->Read(&msg) || !msg.has_header()) return RefusedLocked(reader->Finish());
    const v1::NcclGetDescriptor header = msg.header();
    if (absl::Status s = CheckGetDescriptor(header, capacity); !s.ok()) {
      return RefuseLocked(ctx, *reader, s);
    }
    std::vector<Segment> segments;
    auto* base = static_cast<uint8_t*>(dst);
    for (const v1::NcclLayerSegments& s : header.layers()) {
      segments.push_back({base + s.k_offset(), s.bytes()});
      segments.push_back({base + s.v_offset(), s.bytes()});
      if (s.sink_bytes() > 0) {
        segments.push_back({base + s.sink_k_offset(), s.sink_bytes()});
        segments.push_back({base + s.sink_v_offset(), s.sink_bytes()});
      }
    }
    StreamTail<v1::NcclGetResponse> tail(reader.get());
    const absl::Status moved =
        RunLocked(segments, /*send=*/false, deadline, [&] { return tail.Failed(); });
    if (absl::Status s = EndTransfer(ctx, tail, moved); !s.ok()) {
      if (moved.ok()) AbortLocked();  // the server failed after its sends: out of step
      return s;
    }
    return header;
  }

  absl::StatusOr<v1::PutResponse> Put(std::string_view ns, absl::Span<const int32_t> token_ids,
                                      uint32_t num_layers, const void* k, const void* v,
                                      uint64_t token_bytes, absl::Duration timeout) override {
    if (absl::Status s = CheckTimeout(timeout); !s.ok()) return s;
    absl::MutexLock l(&mu_);
    if (comm_ == nullptr) return absl::UnavailableError("NCCL channel aborted");
    v1::NcclPutRequest request;
    request.set_channel_id(id_);
    request.set_namespace_(std::string(ns));
    request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
    request.set_timeout_ms(ProtocolMilliseconds(timeout));
    const absl::Time deadline = absl::Now() + timeout;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline + absl::Seconds(5)));
    auto reader = stub_->NcclPut(&ctx, request);
    v1::NcclPutResponse msg;
    if (!reader->Read(&msg) || !msg.has_plan()) return RefusedLocked(reader->Finish());
    const v1::NcclPutPlan plan = msg.plan();
    if (absl::Status s = CheckPutPlan(plan, ns, token_ids.size(), num_layers, token_bytes);
        !s.ok()) {
      return RefuseLocked(ctx, *reader, s);
    }
    std::vector<Segment> segments;
    const uint64_t layer_stride = token_ids.size() * token_bytes;
    for (uint32_t layer = 0; layer < plan.num_layers() && plan.num_tokens() > 0; ++layer) {
      const uint64_t at = layer * layer_stride + plan.token_begin() * token_bytes;
      segments.push_back(
          {const_cast<uint8_t*>(static_cast<const uint8_t*>(k)) + at, plan.layer_bytes()});
      segments.push_back(
          {const_cast<uint8_t*>(static_cast<const uint8_t*>(v)) + at, plan.layer_bytes()});
    }
    StreamTail<v1::NcclPutResponse> tail(reader.get());
    const absl::Status moved =
        RunLocked(segments, /*send=*/true, deadline, [&] { return tail.Failed(); });
    if (absl::Status s = EndTransfer(ctx, tail, moved); !s.ok()) return s;
    if (!tail.last().has_result()) return absl::InternalError("NcclPut ended without a result");
    return tail.last().result();
  }

 private:
  // ncclSend (send) or ncclRecv of every segment to/from the server in one group, then polls
  // until done; any failure, or the copies still running kServerFailedGrace after
  // `server_failed()` turned true (the server ended the call with an error), aborts the
  // communicator.
  absl::Status RunLocked(const std::vector<Segment>& segments, bool send, absl::Time deadline,
                         const std::function<bool()>& server_failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (segments.empty()) return absl::OkStatus();
    const ScopedDevice device(device_);
    ncclResult_t r = ncclGroupStart();
    for (const Segment& s : segments) {
      if (r != ncclSuccess && r != ncclInProgress) break;
      r = send ? ncclSend(s.data, s.bytes, ncclUint8, kServerRank, comm_, stream_)
               : ncclRecv(s.data, s.bytes, ncclUint8, kServerRank, comm_, stream_);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = end;
    if (r != ncclSuccess && r != ncclInProgress) {
      AbortLocked();
      return absl::UnavailableError(absl::StrFormat("NCCL enqueue: %s", ncclGetErrorString(r)));
    }
    if (absl::Status s = PollCommLocked(deadline, "enqueueing"); !s.ok()) return s;
    if (cudaEventRecord(done_, stream_) != cudaSuccess) {
      AbortLocked();
      return absl::InternalError("cudaEventRecord failed");
    }
    absl::Time give_up = deadline;  // kServerFailedGrace after server_failed(), if sooner
    bool server_ended = false;
    while (true) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return absl::OkStatus();
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      const absl::Time now = absl::Now();
      if (!server_ended && server_failed()) {
        server_ended = true;
        give_up = std::min(give_up, now + kServerFailedGrace);
      }
      if (q != cudaErrorNotReady || (state != ncclSuccess && state != ncclInProgress)) {
        AbortLocked();
        return absl::UnavailableError("NCCL transfer failed; channel aborted");
      }
      if (now > give_up) {
        AbortLocked();
        return server_ended ? absl::UnavailableError(
                                  "NCCL transfer still running after the server ended the call; "
                                  "channel aborted")
                            : absl::DeadlineExceededError(
                                  "NCCL transfer not complete by its timeout; channel aborted");
      }
      absl::SleepFor(kPollInterval);
    }
  }

  // Ends a transfer's call once its data phase is over (`moved`): a failed one is cancelled, and
  // its status is the server's when the server had ended the call with an error first (the cause
  // is on its side), else this end's own (the server's would be the CANCELLED of that cancel).
  template <typename Response>
  static absl::Status EndTransfer(grpc::ClientContext& ctx, StreamTail<Response>& tail,
                                  const absl::Status& moved) {
    const bool server_failed_first = !moved.ok() && tail.Failed();
    if (!moved.ok()) ctx.TryCancel();
    const absl::Status finished = FromGrpc(tail.Wait());
    if (moved.ok()) return finished;
    return server_failed_first ? finished : moved;
  }

  absl::Status PollCommLocked(absl::Time deadline, const char* phase)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress || absl::Now() > deadline) {
        AbortLocked();
        return absl::UnavailableError(absl::StrFormat("NCCL %s failed or timed out", phase));
      }
      absl::SleepFor(kPollInterval);
    }
  }

  // The status of a transfer the server refused before any byte moved. UNAVAILABLE: the server no
  // longer has the channel (or cannot be reached), so this end is aborted too.
  absl::Status RefusedLocked(const grpc::Status& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Status s = FromGrpc(finished);
    if (absl::IsUnavailable(s)) AbortLocked();
    return s;
  }

  // Ends a transfer whose first answer this end refuses (CheckGetDescriptor, CheckPutPlan) with
  // `why`: the server waits on its end of the data phase; cancelled, it aborts it, and so must we.
  template <typename Reader>
  absl::Status RefuseLocked(grpc::ClientContext& ctx, Reader& reader, absl::Status why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ctx.TryCancel();
    reader.Finish();
    AbortLocked();
    return why;
  }

  void AbortLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    healthy_.store(false, std::memory_order_release);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  const std::unique_ptr<v1::KvPoolTransport::Stub> stub_;
  const uint64_t id_;
  const int device_;
  mutable absl::Mutex mu_;
  cudaStream_t stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  cudaEvent_t done_ ABSL_GUARDED_BY(mu_) = nullptr;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::atomic<bool> healthy_{false};  // joined and not aborted: comm_ != nullptr
  // Apart from mu_, which a transfer holds while another thread sets this.
  absl::Mutex close_mu_;
  absl::Time close_deadline_ ABSL_GUARDED_BY(close_mu_) = absl::InfiniteFuture();
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclChannel::Open(
    std::shared_ptr<grpc::Channel> channel, int device, absl::Duration join_timeout) {
  if (join_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NcclChannel::Open takes a positive join timeout");
  }
  // One deadline for the RPC and the join after it, as the server counts its join from the RPC.
  const absl::Time deadline = absl::Now() + join_timeout;
  auto stub = v1::KvPoolTransport::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::OpenChannelRequest req;
  req.set_join_timeout_ms(ProtocolMilliseconds(join_timeout));
  v1::OpenChannelResponse resp;
  if (grpc::Status s = stub->OpenChannel(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
  auto impl = std::make_unique<NcclChannelImpl>(std::move(stub), resp.channel_id(), device);
  if (absl::Status s = impl->Join(resp.nccl_unique_id(), deadline); !s.ok()) {
    return s;
  }
  return std::unique_ptr<NcclChannel>(std::move(impl));
}

}  // namespace kvpool::client
