// The worker side of the NCCL data plane (proto/kvpool/v1/kvpool.proto, KvPoolTransport): opens a
// channel, joins the server's communicator as rank 1 on the worker's GPU, and runs NcclGet /
// NcclPut with the payload in the worker's device memory. Built only with NCCL
// (KVPOOL_ENABLE_NCCL). Any transport failure aborts the communicator (ncclCommAbort, never
// waiting on the server) and leaves the channel unusable: open a new one, or fall back to the
// gRPC streaming Get/Put of KvPoolClient.
//
// Thread safety: one transfer at a time (the protocol requires it); transfers are serialized by
// mu_, and healthy() reads a flag without it.
//
// Timeouts: a transfer's `timeout` must be positive (INVALID_ARGUMENT otherwise, the channel kept)
// and bounds its data phase on this end (DEADLINE_EXCEEDED past it, the channel aborted); the
// server gets the same as timeout_ms. The RPC itself may run up to 5 s longer, so that the
// server's own status (and a Put's result) still arrives. A failed transfer returns the server's
// status when the server ended the call first, else this end's.
#ifndef KVPOOL_CLIENT_NCCL_CHANNEL_H_
#define KVPOOL_CLIENT_NCCL_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::client {

class NcclChannel {
 public:
  // OpenChannel on the server behind `channel`, then a blocking join as rank 1 on CUDA device
  // `device` (bounded by join_timeout, which must be positive, through a non-blocking init).
  static absl::StatusOr<std::unique_ptr<NcclChannel>> Open(std::shared_ptr<grpc::Channel> channel,
                                                           int device, absl::Duration join_timeout);
  virtual ~NcclChannel() = default;

  // False once the channel is aborted: after a failed transfer, or when the server answered that
  // it no longer has the channel (UNAVAILABLE).
  virtual bool healthy() const = 0;
  virtual uint64_t channel_id() const = 0;
  // Bounds the CloseChannel RPC that destroying the channel sends (5 s from then by default): a
  // caller that drops a failed channel inside a timed call passes that call's deadline, so that
  // the close cannot outlast it. The earliest deadline set wins (calls sharing a channel may each
  // drop it). Thread-safe; the channel may still be in use elsewhere.
  virtual void SetCloseDeadline(absl::Time deadline) = 0;

  // NcclGet into device memory `dst` of `capacity` bytes; the descriptor says where each
  // layer's K and V (and in RAW its sink rows, if any) landed.
  virtual absl::StatusOr<v1::NcclGetDescriptor> Get(v1::NcclGetRequest request, void* dst,
                                                    uint64_t capacity, absl::Duration timeout) = 0;
  // NcclPut of a sequence whose fp16 K and V sit in device memory as
  // [num_layers][token_ids.size()][num_kv_heads][head_dim]; `token_bytes` is
  // num_kv_heads * head_dim * 2. The server says which tokens it needs; only those move. A
  // num_layers or token_bytes that is not the namespace's is INVALID_ARGUMENT, nothing read (the
  // channel is aborted with the server's end).
  virtual absl::StatusOr<v1::PutResponse> Put(std::string_view ns,
                                              absl::Span<const int32_t> token_ids,
                                              uint32_t num_layers, const void* k, const void* v,
                                              uint64_t token_bytes, absl::Duration timeout) = 0;
};

// What a worker checks of the server's first answer before any byte moves (NcclChannel runs
// them; they need no NCCL). A server that fails them is out of step with the worker: DATA_LOSS.
// OK when every layer's K and V segment of `d` (and sink K and V segment, if any) lies inside a
// buffer of `capacity` bytes.
absl::Status CheckGetDescriptor(const v1::NcclGetDescriptor& d, uint64_t capacity);
// OK when `plan` asks for tokens of the sequence (`num_token_ids` of them) in buffers of
// `num_layers` layers of `token_bytes`-byte tokens; INVALID_ARGUMENT when those buffers are not
// the namespace's shape (the caller's error), DATA_LOSS when the token range is not the
// sequence's.
absl::Status CheckPutPlan(const v1::NcclPutPlan& plan, std::string_view ns, size_t num_token_ids,
                          uint32_t num_layers, uint64_t token_bytes);

}  // namespace kvpool::client

#endif  // KVPOOL_CLIENT_NCCL_CHANNEL_H_
