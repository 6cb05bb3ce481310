// CPU reference of Dequantize. Per (block, token, K|V, head): x' = DecodeRow (code * s + z in
// float, kernels/cpu/page_codec.h), then, if layout.rotated(), the inverse BlockHadamard in
// double, cast to float, then FloatToHalf. FP16 pages, and the sink rows of a first_sink_page,
// are copied bit for bit. Rows from valid_tokens on are zeros.
#include <cstring>
#include <optional>
#include <vector>

#include "kernels/cpu/page_codec.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/kv_kernels.h"

namespace kvpool::cpu {
namespace {

KernelStatus Validate(const DequantizeParams& p) {
  const PageLayout& l = p.layout;
  if (ValidatePageLayout(l) != nullptr || p.num_out_blocks < 0 || p.num_blocks < 0 ||
      p.head_begin < 0 || p.head_begin >= p.head_end || p.head_end > l.num_kv_heads ||
      p.valid_tokens < 0) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.num_out_blocks == 0) return KernelStatus::kOk;
  if (p.pages == nullptr || p.block_ids == nullptr || p.k_out == nullptr || p.v_out == nullptr ||
      (p.first_sink_page != nullptr && l.sink_tokens == 0)) {
    return KernelStatus::kInvalidArgument;
  }
  for (int i = 0; i < p.num_out_blocks; ++i) {
    if (p.block_ids[i] < 0 || p.block_ids[i] >= p.num_blocks) {
      return KernelStatus::kInvalidArgument;
    }
  }
  return KernelStatus::kOk;
}

}  // namespace

KernelStatus Dequantize(const DequantizeParams& p) {
  const KernelStatus status = Validate(p);
  if (status != KernelStatus::kOk || p.num_out_blocks == 0) return status;
  const PageLayout& l = p.layout;
  std::optional<BlockHadamard> rotation;
  if (l.rotated()) rotation.emplace(l.head_dim, l.rot_block, l.sign_seed);
  std::vector<float> row(l.head_dim);
  std::vector<double> unrotated(l.head_dim);
  const int out_heads = p.head_end - p.head_begin;
  for (int i = 0; i < p.num_out_blocks; ++i) {
    for (int tok = 0; tok < l.block_tokens; ++tok) {
      const size_t out_token = static_cast<size_t>(i) * l.block_tokens + tok;
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = p.head_begin; h < p.head_end; ++h) {
          const uint8_t* head_page = HeadPage(l, p.pages, p.block_ids[i], kv, h);
          uint16_t* dst = (kv == 0 ? p.k_out : p.v_out) +
                          (out_token * out_heads + (h - p.head_begin)) * l.head_dim;
          if (static_cast<int64_t>(out_token) >= p.valid_tokens) {
            std::memset(dst, 0, l.head_dim * 2);
            continue;
          }
          if (i == 0 && p.first_sink_page != nullptr && tok < l.sink_tokens) {
            std::memcpy(dst, p.first_sink_page + l.sink_offset(kv, h, tok), l.head_dim * 2);
            continue;
          }
          if (!l.quantized()) {
            std::memcpy(dst, head_page + tok * l.code_bytes_per_token(), l.head_dim * 2);
            continue;
          }
          DecodeRow(l, head_page, tok, row.data());
          if (rotation) {
            for (int c = 0; c < l.head_dim; ++c) unrotated[c] = row[c];
            rotation->Inverse(unrotated.data());
            for (int c = 0; c < l.head_dim; ++c) row[c] = static_cast<float>(unrotated[c]);
          }
          for (int c = 0; c < l.head_dim; ++c) dst[c] = FloatToHalf(row[c]);
        }
      }
    }
  }
  return KernelStatus::kOk;
}

}  // namespace kvpool::cpu
