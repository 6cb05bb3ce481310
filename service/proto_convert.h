// Conversions between the wire messages (proto/kvpool/v1) and the store's types, and the one
// place absl::Status becomes grpc::Status. Stateless.
#ifndef KVPOOL_SERVICE_PROTO_CONVERT_H_
#define KVPOOL_SERVICE_PROTO_CONVERT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kernels/page_layout.h"
#include "kvpool/v1/kvpool.pb.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"

namespace kvpool {

// Same code and message (absl and gRPC share the canonical code numbers).
grpc::Status ToGrpcStatus(const absl::Status& s);

// UNSPECIFIED maps to `unspecified`; INVALID_ARGUMENT for an unknown enum value.
absl::StatusOr<KvDtype> FromProtoDtype(v1::KvDtype d, KvDtype unspecified);
v1::KvDtype ToProtoDtype(KvDtype d);

// The spec with the proto's defaults applied (block_tokens 16, INT4, rotation block = head_dim
// unless disabled, group = head_dim). Range checks are left to the store's
// ValidateNamespaceConfig; only what cannot be represented is rejected here.
absl::StatusOr<NamespaceConfig> FromProtoSpec(const v1::NamespaceSpec& spec);
void ToProtoInfo(const NamespaceInfo& info, v1::NamespaceInfo* out);
void ToProtoStats(const StoreStats& stats, v1::StatsResponse* out);
void ToProtoLayout(const PageLayout& layout, v1::PageLayoutDescriptor* out);

// Bytes of fp16 K (or V) for `tokens` tokens of a namespace: tokens * kv_heads * head_dim * 2.
inline uint64_t Fp16KvBytes(const NamespaceConfig& c, uint64_t tokens) {
  return tokens * static_cast<uint64_t>(c.num_kv_heads) * c.head_dim * 2;
}

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_PROTO_CONVERT_H_
