// TransferClient: bulk Get and Put of a worker's KV buffers over the NCCL data plane when a
// channel is open, and over KvPoolClient's gRPC streaming Get/Put otherwise. Both paths fill and
// read the caller's buffer in the same layout (the NcclGetDescriptor / NcclPutRequest layouts of
// proto/kvpool/v1/kvpool.proto), so the caller does not care which one ran.
//
// Path choice, per call: NCCL when a channel is attached and healthy; else gRPC. When an NCCL
// transfer fails and leaves the channel broken (peer or link failure, deadline), the channel is
// dropped and the same call is retried once over gRPC (Get only reads; an uncommitted NCCL Put
// stored nothing). Errors that leave the channel healthy (bad request, unknown lease, buffer too
// small) are returned as they are.
//
// The buffers are wherever the caller keeps them: device memory for NCCL (the channel's GPU);
// the gRPC path reaches them through the caller's BufferCopy (cudaMemcpy for device buffers,
// std::memcpy for host ones). This library links without CUDA or NCCL: a channel is opened by the
// caller (NcclChannel::Open, built only with NCCL) and attached here.
//
// Thread safety: thread-safe. mu_ guards only the attached channel; transfers run outside it
// (an NcclChannel serializes its own transfers).
#ifndef KVPOOL_CLIENT_TRANSFER_CLIENT_H_
#define KVPOOL_CLIENT_TRANSFER_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvpool/v1/kvpool.pb.h"

// By file name: installed beside this header as kvpool/<name>.h.
#include "kvpool_client.h"
#include "nccl_channel.h"

namespace kvpool::client {

// How the gRPC path moves bytes between host memory and the caller's buffers.
struct BufferCopy {
  // Copies `bytes` from host memory `src` into the caller's buffer at `dst`.
  std::function<absl::Status(void* dst, const void* src, size_t bytes)> to_buffer;
  // Copies `bytes` from the caller's buffer at `src` into host memory `dst`.
  std::function<absl::Status(void* dst, const void* src, size_t bytes)> from_buffer;
};

// BufferCopy for buffers in host memory (std::memcpy both ways).
BufferCopy HostBufferCopy();

enum class TransferPath { kNccl, kGrpc };

struct TransferGetResult {
  TransferPath path = TransferPath::kGrpc;
  // Where each selected layer landed, ascending: K at k_offset, V at v_offset, `bytes` each;
  // RAW: [num_blocks][heads] head pages and `layout`, and from a namespace with sink tokens the
  // first block's sink rows at sink_k_offset and sink_v_offset, `sink_bytes` each
  // ([heads][layout.sink_tokens][head_dim] fp16, the first sink_tokens tokens exact); FP16:
  // [num_blocks * block_tokens][heads][head_dim] fp16. Every layer spans the lease's blocks on both
  // paths, rows past the tokens a layer holds zeros (a decode step's appends in flight). The gRPC
  // path asks for that (GetRequest.lease_blocks). From a server older than that field, whose
  // layers span the tokens each holds, layers of different block counts are refused (DATA_LOSS),
  // a layer holding none is left out, and num_blocks can be smaller than NcclGet's (a tail block
  // the lease took past every layer's tokens); the segments still describe the buffer.
  std::vector<v1::NcclLayerSegments> layers;
  uint32_t num_blocks = 0;
  uint32_t valid_tokens = 0;  // real tokens in every listed layer (min over them)
  uint64_t total_bytes = 0;
  // The NCCL attempt's error when this result came from the gRPC retry; OK otherwise.
  absl::Status nccl_error;
};

// A sequence's fp16 K and V in the caller's buffers, for every layer of its namespace.
struct PutSource {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  const void* k = nullptr;  // [num_layers][token_ids.size()][num_kv_heads][head_dim] fp16
  const void* v = nullptr;  // same shape
};

struct TransferPutResult {
  TransferPath path = TransferPath::kGrpc;
  v1::PutResponse response;
  absl::Status nccl_error;  // as in TransferGetResult
};

class TransferClient {
 public:
  // `kv` is not owned and must outlive this object; `channel` may be null (gRPC only).
  TransferClient(KvPoolClient* kv, BufferCopy copy, std::unique_ptr<NcclChannel> channel = nullptr);

  // Attaches a (new) channel, replacing the current one; null detaches.
  void SetChannel(std::unique_ptr<NcclChannel> channel);
  // The path the next call takes.
  TransferPath path() const;

  // Reads the selection of `request` (its max_chunk_bytes applies to the gRPC path) into `dst`,
  // which holds `capacity` bytes. RESOURCE_EXHAUSTED when the payload does not fit. Both calls
  // take a positive timeout (INVALID_ARGUMENT otherwise) that covers the call, a gRPC retry
  // after a failed NCCL attempt included; only an NCCL attempt whose server is slow to answer
  // may end up to 5 s past it (NcclChannel), with no time left for a retry then.
  absl::StatusOr<TransferGetResult> Get(const v1::GetRequest& request, void* dst, uint64_t capacity,
                                        absl::Duration timeout);
  // Stores the sequence `token_ids` of namespace `ns` from `src`; only the tokens the server
  // does not hold yet move over NCCL, the whole sequence over gRPC.
  absl::StatusOr<TransferPutResult> Put(std::string_view ns, absl::Span<const int32_t> token_ids,
                                        const PutSource& src, absl::Duration timeout);

 private:
  // The attached channel when it is healthy, else null.
  std::shared_ptr<NcclChannel> HealthyChannel() const;
  // Detaches `channel` if it is still the attached one.
  void DropChannel(const std::shared_ptr<NcclChannel>& channel);

  absl::StatusOr<TransferGetResult> GrpcGet(const v1::GetRequest& request, void* dst,
                                            uint64_t capacity, absl::Duration timeout);
  absl::StatusOr<TransferPutResult> GrpcPut(std::string_view ns,
                                            absl::Span<const int32_t> token_ids,
                                            const PutSource& src, absl::Duration timeout);

  KvPoolClient* const kv_;
  const BufferCopy copy_;
  mutable absl::Mutex mu_;
  std::shared_ptr<NcclChannel> channel_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::client

#endif  // KVPOOL_CLIENT_TRANSFER_CLIENT_H_
