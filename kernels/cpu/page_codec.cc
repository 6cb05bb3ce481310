#include "kernels/cpu/page_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "kernels/fp16.h"

namespace kvpool::cpu {
namespace {

// All 256 e4m3 codes decoded, built once.
const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

size_t MetaOffset(const PageLayout& l, int token, int group) {
  return l.codes_bytes() + (static_cast<size_t>(token) * l.groups() + group) * 4;
}

void WriteMeta(const PageLayout& l, uint8_t* head_page, int token, int group, uint16_t scale_h,
               uint16_t zero_h) {
  const uint16_t meta[2] = {scale_h, zero_h};
  std::memcpy(head_page + MetaOffset(l, token, group), meta, sizeof(meta));
}

// Stores code `code` of channel c in a row of codes. Channels are written in increasing order,
// so an INT4 low nibble (even c) sets its byte and the high nibble (odd c) is or-ed in.
void PutCode(KvDtype dtype, uint8_t* row, int c, uint8_t code) {
  if (dtype != KvDtype::kInt4) {
    row[c] = code;
  } else if (c % 2 == 0) {
    row[c / 2] = code;
  } else {
    row[c / 2] |= static_cast<uint8_t>(code << 4);
  }
}

// Integer codes of group `group` (INT4/INT8, `levels` = 15 or 255) of the row x', and its meta.
void EncodeIntGroup(const PageLayout& l, const float* x, int levels, int token, int group,
                    uint8_t* head_page, uint8_t* row) {
  const int c0 = group * l.group_size;
  const auto [mn_it, mx_it] = std::minmax_element(x + c0, x + c0 + l.group_size);
  const float mn = *mn_it;
  const float mx = *mx_it;
  const uint16_t scale_h = ScaleBits((mx - mn) / static_cast<float>(levels), FloatToHalf);
  // + 0: a minimum of -0 is stored as +0, whichever of -0 and +0 came first (the GPU's min
  // reduction takes them in another order).
  const uint16_t zero_h = FloatToHalf(mn + 0.0f);
  WriteMeta(l, head_page, token, group, scale_h, zero_h);
  const float s = HalfToFloat(scale_h);
  const float z = HalfToFloat(zero_h);
  // One reciprocal per group; each channel is then one fma onto codes offset by kCodeOffset:
  // q = x * r + (kCodeOffset - z * r), the offset's sum rounded once per group.
  const float r = s > 0.0f ? 1.0f / s : 0.0f;
  const float b = std::fmaf(-z, r, kCodeOffset);
  const float top = kCodeOffset + static_cast<float>(levels);
  for (int c = c0; c < c0 + l.group_size; ++c) {
    uint8_t code = 0;
    if (s > 0.0f) {
      // Clamping before rounding equals clamping after it; fmax/fmin (not std::max/min) also
      // turn NaN into a code, keeping it from the int cast.
      const float q = std::fmin(std::fmax(std::fmaf(x[c], r, b), kCodeOffset), top);
      code = static_cast<uint8_t>(std::nearbyint(q) - kCodeOffset);
    }
    PutCode(l.dtype, row, c, code);
  }
}

// e4m3 codes of group `group` of the row x', and its meta.
void EncodeFp8Group(const PageLayout& l, const float* x, int token, int group, uint8_t* head_page,
                    uint8_t* row) {
  const int c0 = group * l.group_size;
  float amax = 0.0f;
  for (int c = c0; c < c0 + l.group_size; ++c) amax = std::max(amax, std::fabs(x[c]));
  const uint16_t scale_h = ScaleBits(amax / 448.0f, FloatToHalf);
  WriteMeta(l, head_page, token, group, scale_h, 0);
  const float s = HalfToFloat(scale_h);
  const float r = s > 0.0f ? 1.0f / s : 0.0f;
  for (int c = c0; c < c0 + l.group_size; ++c) row[c] = s > 0.0f ? FloatToFp8E4M3(x[c] * r) : 0;
}

}  // namespace

void EncodeQuantizedRow(const PageLayout& l, const float* x, int token, uint8_t* head_page) {
  uint8_t* row = head_page + static_cast<size_t>(token) * l.code_bytes_per_token();
  for (int g = 0; g < l.groups(); ++g) {
    switch (l.dtype) {
      case KvDtype::kInt4:
        EncodeIntGroup(l, x, 15, token, g, head_page, row);
        break;
      case KvDtype::kInt8:
        EncodeIntGroup(l, x, 255, token, g, head_page, row);
        break;
      case KvDtype::kFp8E4M3:
        EncodeFp8Group(l, x, token, g, head_page, row);
        break;
      case KvDtype::kFp16:
        break;
    }
  }
}

void UnpackCodes(const PageLayout& l, const uint8_t* head_page, int token, float* codes) {
  const uint8_t* row = head_page + static_cast<size_t>(token) * l.code_bytes_per_token();
  switch (l.dtype) {
    case KvDtype::kInt4:
      for (int j = 0; j < l.head_dim / 2; ++j) {
        codes[2 * j] = static_cast<float>(row[j] & 0xF);
        codes[2 * j + 1] = static_cast<float>(row[j] >> 4);
      }
      break;
    case KvDtype::kInt8:
      for (int c = 0; c < l.head_dim; ++c) codes[c] = static_cast<float>(row[c]);
      break;
    case KvDtype::kFp8E4M3: {
      const std::array<float, 256>& table = Fp8Table();
      for (int c = 0; c < l.head_dim; ++c) codes[c] = table[row[c]];
      break;
    }
    case KvDtype::kFp16:
      for (int c = 0; c < l.head_dim; ++c) {
        uint16_t h;
        std::memcpy(&h, row + 2 * c, sizeof(h));
        codes[c] = HalfToFloat(h);
      }
      break;
  }
}

GroupMeta ReadGroupMeta(const PageLayout& l, const uint8_t* head_page, int token, int group) {
  uint16_t meta[2];
  std::memcpy(meta, head_page + MetaOffset(l, token, group), sizeof(meta));
  return GroupMeta{HalfToFloat(meta[0]), HalfToFloat(meta[1])};
}

void DecodeRow(const PageLayout& l, const uint8_t* head_page, int token, float* x) {
  UnpackCodes(l, head_page, token, x);
  if (!l.quantized()) return;
  for (int g = 0; g < l.groups(); ++g) {
    const GroupMeta m = ReadGroupMeta(l, head_page, token, g);
    for (int c = g * l.group_size; c < (g + 1) * l.group_size; ++c) x[c] = x[c] * m.scale + m.zero;
  }
}

}  // namespace kvpool::cpu
