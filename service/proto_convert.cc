#include "service/proto_convert.h"

#include <algorithm>
#include <array>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvpool {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::StatusOr<KvDtype> FromProtoDtype(v1::KvDtype d, KvDtype unspecified) {
  switch (d) {
    case v1::KV_DTYPE_UNSPECIFIED:
      return unspecified;
    case v1::KV_DTYPE_FP16:
      return KvDtype::kFp16;
    case v1::KV_DTYPE_FP8_E4M3:
      return KvDtype::kFp8E4M3;
    case v1::KV_DTYPE_INT8:
      return KvDtype::kInt8;
    case v1::KV_DTYPE_INT4:
      return KvDtype::kInt4;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown KvDtype ", static_cast<int>(d)));
}

v1::KvDtype ToProtoDtype(KvDtype d) {
  switch (d) {
    case KvDtype::kFp16:
      return v1::KV_DTYPE_FP16;
    case KvDtype::kFp8E4M3:
      return v1::KV_DTYPE_FP8_E4M3;
    case KvDtype::kInt8:
      return v1::KV_DTYPE_INT8;
    case KvDtype::kInt4:
      return v1::KV_DTYPE_INT4;
  }
  return v1::KV_DTYPE_UNSPECIFIED;
}

namespace {

// NamespaceSpec.rotation_block 0: the largest power of two dividing head_dim, at most 128 (16 at
// least for the multiples of 16 a namespace takes).
int DefaultRotationBlock(int head_dim) {
  int block = 16;
  while (block < 128 && head_dim % (2 * block) == 0) block *= 2;
  return block;
}

}  // namespace

absl::StatusOr<NamespaceConfig> FromProtoSpec(const v1::NamespaceSpec& spec) {
  // Checked before layer_dtypes is sized from it.
  if (spec.num_layers() == 0 || spec.num_layers() > static_cast<uint32_t>(kMaxNamespaceLayers)) {
    return absl::InvalidArgumentError(absl::StrCat("namespace num_layers must be in [1, ",
                                                   kMaxNamespaceLayers, "], got ",
                                                   spec.num_layers()));
  }
  if (spec.layer_dtypes_size() > static_cast<int>(spec.num_layers())) {
    return absl::InvalidArgumentError(absl::StrCat("layer_dtypes has ", spec.layer_dtypes_size(),
                                                   " entries for ", spec.num_layers(), " layers"));
  }
  NamespaceConfig c;
  c.name = spec.name();
  c.num_layers = static_cast<int>(spec.num_layers());
  c.num_kv_heads = static_cast<int>(spec.num_kv_heads());
  c.head_dim = static_cast<int>(spec.head_dim());
  c.block_tokens = spec.block_tokens() == 0 ? 16 : static_cast<int>(spec.block_tokens());
  absl::StatusOr<KvDtype> def = FromProtoDtype(spec.default_dtype(), KvDtype::kInt4);
  if (!def.ok()) return def.status();
  c.layer_dtypes.assign(c.num_layers, *def);
  for (int l = 0; l < spec.layer_dtypes_size(); ++l) {
    absl::StatusOr<KvDtype> d = FromProtoDtype(spec.layer_dtypes(l), *def);
    if (!d.ok()) return d.status();
    c.layer_dtypes[l] = *d;
  }
  c.rotation_block = spec.rotation_disabled()     ? 0
                     : spec.rotation_block() == 0 ? DefaultRotationBlock(c.head_dim)
                                                  : static_cast<int>(spec.rotation_block());
  c.rotation_seed = spec.rotation_seed();
  c.group_size = spec.group_size() == 0 ? c.head_dim : static_cast<int>(spec.group_size());
  c.sink_tokens = static_cast<int>(spec.sink_tokens());
  if (spec.blocks_per_sink_page() != 0) {
    c.blocks_per_sink_page = static_cast<int>(spec.blocks_per_sink_page());
  }
  c.capacity_bytes = spec.capacity_bytes();
  return c;
}

void ToProtoInfo(const NamespaceInfo& info, v1::NamespaceInfo* out) {
  const NamespaceConfig& c = info.config;
  v1::NamespaceSpec* spec = out->mutable_spec();
  spec->set_name(c.name);
  spec->set_num_layers(c.num_layers);
  spec->set_num_kv_heads(c.num_kv_heads);
  spec->set_head_dim(c.head_dim);
  spec->set_block_tokens(c.block_tokens);
  // The most common layer dtype is the default; every layer is listed explicitly.
  std::array<int, 4> count{};
  for (KvDtype d : c.layer_dtypes) ++count[static_cast<int>(d)];
  int most = static_cast<int>(KvDtype::kInt4);
  for (int d = 0; d < 4; ++d) {
    if (count[d] > count[most]) most = d;
  }
  spec->set_default_dtype(ToProtoDtype(static_cast<KvDtype>(most)));
  for (KvDtype d : c.layer_dtypes) spec->add_layer_dtypes(ToProtoDtype(d));
  spec->set_rotation_block(c.rotation_block);
  spec->set_rotation_disabled(c.rotation_block == 0);
  spec->set_rotation_seed(c.rotation_seed);
  spec->set_group_size(c.group_size);
  spec->set_sink_tokens(c.sink_tokens);
  spec->set_capacity_bytes(c.capacity_bytes);
  spec->set_blocks_per_sink_page(c.blocks_per_sink_page);
  out->set_num_blocks(info.num_blocks);
  out->set_num_sink_blocks(info.num_sink_blocks);
  out->set_bytes_per_block(info.bytes_per_block);
  out->set_bytes_per_token(info.bytes_per_token);
  out->set_fp16_bytes_per_token(info.fp16_bytes_per_token);
}

void ToProtoStats(const StoreStats& stats, v1::StatsResponse* out) {
  out->set_backend(stats.backend);
  out->set_active_leases(stats.active_leases);
  uint64_t query = 0;
  uint64_t hit = 0;
  for (const NamespaceStoreStats& n : stats.namespaces) {
    v1::NamespaceStats* p = out->add_namespaces();
    p->set_name(n.name);
    p->set_blocks_total(n.blocks_total);
    p->set_blocks_free(n.blocks_free);
    p->set_blocks_in_use(n.blocks_in_use);
    p->set_blocks_evictable(n.blocks_evictable);
    p->set_tokens_stored(n.tokens_stored);
    p->set_evictions(n.evictions);
    p->set_bytes_per_token(n.bytes_per_token);
    p->set_fp16_bytes_per_token(n.fp16_bytes_per_token);
    p->set_quant_rel_error(n.quant_rel_error);
    p->set_sink_blocks_total(n.sink_blocks_total);
    p->set_sink_blocks_free(n.sink_blocks_free);
    query += n.prefix_query_tokens;
    hit += n.prefix_hit_tokens;
  }
  out->set_prefix_query_tokens(query);
  out->set_prefix_hit_tokens(hit);
}

void ToProtoLayout(const PageLayout& layout, v1::PageLayoutDescriptor* out) {
  out->set_dtype(ToProtoDtype(layout.dtype));
  out->set_head_dim(layout.head_dim);
  out->set_block_tokens(layout.block_tokens);
  out->set_group_size(layout.group_size);
  out->set_rotation_block(layout.rotated() ? layout.rot_block : 0);
  out->set_rotation_sign_seed(layout.sign_seed);
  out->set_codes_bytes(static_cast<uint32_t>(layout.codes_bytes()));
  out->set_head_page_bytes(static_cast<uint32_t>(layout.head_page_bytes()));
  out->set_sink_tokens(static_cast<uint32_t>(layout.sink_tokens));
}

}  // namespace kvpool
