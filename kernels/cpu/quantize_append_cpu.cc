// CPU reference of QuantizeAppend. Per (token, K|V, head):
//   x = fp16 -> float; if layout.rotated(): x' = BlockHadamard forward in double, cast to float;
//   else x' = x. Then EncodeQuantizedRow (kernels/cpu/page_codec.h gives the exact math), or the
//   fp16 bits copied for FP16. Tokens with position < sink_tokens also get their fp16 K/V bits
//   copied to the sink page of their block.
#include <cstring>
#include <optional>
#include <vector>

#include "kernels/cpu/page_codec.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/kv_kernels.h"

namespace kvpool::cpu {
namespace {

// Checks everything before a byte is written: layout, pointers, and every slot
// (FirstBadAppendSlot).
KernelStatus Validate(const QuantizeAppendParams& p) {
  const PageLayout& l = p.layout;
  if (ValidatePageLayout(l) != nullptr || p.num_tokens < 0 || p.num_blocks < 0) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.num_tokens == 0) return KernelStatus::kOk;
  if (p.k == nullptr || p.v == nullptr || p.slot_mapping == nullptr || p.pages == nullptr) {
    return KernelStatus::kInvalidArgument;
  }
  const bool sinks = l.sink_tokens > 0;
  if (sinks && (p.positions == nullptr || p.sink_pages == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  return FirstBadAppendSlot(p) < 0 ? KernelStatus::kOk : KernelStatus::kInvalidArgument;
}

}  // namespace

KernelStatus QuantizeAppend(const QuantizeAppendParams& p) {
  const KernelStatus status = Validate(p);
  if (status != KernelStatus::kOk || p.num_tokens == 0) return status;
  const PageLayout& l = p.layout;
  std::optional<BlockHadamard> rotation;
  if (l.rotated()) rotation.emplace(l.head_dim, l.rot_block, l.sign_seed);
  std::vector<double> rotated(l.head_dim);
  std::vector<float> row(l.head_dim);
  const size_t row_bytes = static_cast<size_t>(l.head_dim) * 2;
  for (int t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / l.block_tokens;
    const int offset = static_cast<int>(slot % l.block_tokens);
    const bool sink = l.sink_tokens > 0 && p.positions[t] < l.sink_tokens;
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < l.num_kv_heads; ++h) {
        const uint16_t* src =
            (kv == 0 ? p.k : p.v) + (static_cast<size_t>(t) * l.num_kv_heads + h) * l.head_dim;
        uint8_t* head_page = HeadPage(l, p.pages, block, kv, h);
        if (sink) {
          std::memcpy(p.sink_pages + static_cast<size_t>(block) * l.sink_page_bytes() +
                          l.sink_offset(kv, h, p.positions[t]),
                      src, row_bytes);
        }
        if (!l.quantized()) {
          std::memcpy(head_page + offset * l.code_bytes_per_token(), src, row_bytes);
          continue;
        }
        if (rotation) {
          for (int c = 0; c < l.head_dim; ++c) rotated[c] = HalfToFloat(src[c]);
          rotation->Forward(rotated.data());
          for (int c = 0; c < l.head_dim; ++c) row[c] = static_cast<float>(rotated[c]);
        } else {
          for (int c = 0; c < l.head_dim; ++c) row[c] = HalfToFloat(src[c]);
        }
        EncodeQuantizedRow(l, row.data(), offset, head_page);
      }
    }
  }
  return KernelStatus::kOk;
}

}  // namespace kvpool::cpu
