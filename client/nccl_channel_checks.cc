// The worker's checks of the server's NcclGet descriptor and NcclPut plan (nccl_channel.h),
// built with or without NCCL.
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "client/nccl_channel.h"

namespace kvpool::client {

absl::Status CheckGetDescriptor(const v1::NcclGetDescriptor& d, uint64_t capacity) {
  auto check = [&](const v1::NcclLayerSegments& s, uint64_t offset, uint64_t bytes) {
    if (offset <= capacity && bytes <= capacity - offset) return absl::OkStatus();
    return absl::DataLossError(
        absl::StrFormat("the descriptor puts %d bytes of layer %d at offset %d of a %d-byte buffer",
                        bytes, s.layer(), offset, capacity));
  };
  for (const v1::NcclLayerSegments& s : d.layers()) {
    for (const uint64_t offset : {s.k_offset(), s.v_offset()}) {
      if (absl::Status bad = check(s, offset, s.bytes()); !bad.ok()) return bad;
    }
    if (s.sink_bytes() == 0) continue;  // no sink segments
    for (const uint64_t offset : {s.sink_k_offset(), s.sink_v_offset()}) {
      if (absl::Status bad = check(s, offset, s.sink_bytes()); !bad.ok()) return bad;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPutPlan(const v1::NcclPutPlan& plan, std::string_view ns, size_t num_token_ids,
                          uint32_t num_layers, uint64_t token_bytes) {
  if (plan.layer_bytes() != uint64_t{plan.num_tokens()} * token_bytes ||
      plan.num_layers() != num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the K/V buffers hold %d layers of %d-byte tokens; namespace %s has %d layers of "
        "%d-byte tokens",
        num_layers, token_bytes, ns, plan.num_layers(),
        plan.num_tokens() > 0 ? plan.layer_bytes() / plan.num_tokens() : 0));
  }
  if (uint64_t{plan.token_begin()} + plan.num_tokens() > num_token_ids) {
    return absl::DataLossError(
        absl::StrFormat("the plan asks for tokens [%d, +%d) of a sequence of %d",
                        plan.token_begin(), plan.num_tokens(), num_token_ids));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::client
