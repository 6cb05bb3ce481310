// Host-side pieces of the CUDA backend (cuda_backend.cc) that touch no CUDA API: the checks of
// a call's host arguments before anything is queued, and where a call's inputs sit in its pinned
// staging buffer.
#ifndef KVPOOL_SERVICE_STORE_CUDA_BACKEND_STAGING_H_
#define KVPOOL_SERVICE_STORE_CUDA_BACKEND_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "service/store/compute_backend.h"

namespace kvpool::cuda_backend_internal {

// UNIMPLEMENTED past the sequences and query heads one PagedDecodeAttention call takes.
inline absl::Status CheckCudaAttentionShape(size_t num_seqs, size_t num_q_heads) {
  constexpr size_t kMax = cuda::kMaxAttentionSeqsOrHeads;
  if (num_seqs <= kMax && num_q_heads <= kMax) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrFormat(
      "PagedDecodeAttention: %d sequences of %d query heads; the CUDA kernels take at most %d of "
      "each per call",
      num_seqs, num_q_heads, cuda::kMaxAttentionSeqsOrHeads));
}

// Host-side checks of PagedDecodeAttention's arguments and of the append riding in it (tables,
// lengths and q are host memory), before anything is queued: the kernels must never see an
// out-of-range block id or length.
inline absl::Status ValidatePagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                                 const QuantizeAppendParams* append) {
  const PageLayout& l = p.layout;
  if (p.num_seqs < 0 || p.num_q_heads <= 0 || !AttentionTableSpanOk(l, p.max_blocks_per_seq) ||
      p.num_splits < 0 || p.num_splits > cuda::kMaxAttentionSplits) {
    return absl::InvalidArgumentError(
        "PagedDecodeAttention: bad batch shape (or tables spanning over 2^30 tokens, or over "
        "2^16 splits)");
  }
  if (absl::Status s = CheckCudaAttentionShape(p.num_seqs, p.num_q_heads); !s.ok()) return s;
  if (p.num_seqs == 0) return absl::OkStatus();
  if (append != nullptr) {
    if (absl::Status s = ValidateQuantizeAppend(*append); !s.ok()) return s;
  }
  if (p.q == nullptr || p.block_tables == nullptr || p.seq_lens == nullptr ||
      (p.out == nullptr) == (p.out_fp16 == nullptr)) {
    return absl::InvalidArgumentError(
        "PagedDecodeAttention: null argument, or not exactly one of out and out_fp16");
  }
  const BadAttentionSequence bad =
      FindBadAttentionSequence(l, p.seq_lens, p.block_tables, p.num_seqs, p.max_blocks_per_seq,
                               p.num_blocks, p.num_sink_blocks);
  if (bad.seq < 0) return absl::OkStatus();
  if (bad.block < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "PagedDecodeAttention: seq %d length %d out of range", bad.seq, p.seq_lens[bad.seq]));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "PagedDecodeAttention: seq %d block %d id %d out of range (a first block must have a sink "
      "page when the layout keeps sinks)",
      bad.seq, bad.block,
      p.block_tables[static_cast<size_t>(bad.seq) * p.max_blocks_per_seq + bad.block]));
}

// Host-side checks of Dequantize's arguments (block_ids is host memory).
inline absl::Status ValidateDequantize(const DequantizeParams& p) {
  if (p.num_out_blocks < 0 || p.head_begin < 0 || p.head_end <= p.head_begin ||
      p.head_end > p.layout.num_kv_heads) {
    return absl::InvalidArgumentError("Dequantize: bad block count or head range");
  }
  if (p.num_out_blocks == 0) return absl::OkStatus();
  if (p.block_ids == nullptr || p.k_out == nullptr || p.v_out == nullptr) {
    return absl::InvalidArgumentError("Dequantize: null argument");
  }
  for (int i = 0; i < p.num_out_blocks; ++i) {
    if (p.block_ids[i] < 0 || p.block_ids[i] >= p.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Dequantize: block id %d out of range", p.block_ids[i]));
    }
  }
  return absl::OkStatus();
}

// Offsets of consecutive 16-byte aligned regions in one staging buffer.
class StagingLayout {
 public:
  size_t Add(size_t bytes) {
    const size_t offset = size_;
    size_ += AlignUp16(bytes);
    return offset;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

// Where QuantizeAppend's host inputs (k, v, slot_mapping and, with sinks, positions) sit in a
// staging buffer, and the kernel's params over the device copy.
class AppendStaging {
 public:
  AppendStaging(const QuantizeAppendParams& p, StagingLayout& layout) : p_(p) {
    const PageLayout& l = p.layout;
    kv_bytes_ = static_cast<size_t>(p.num_tokens) * l.num_kv_heads * l.head_dim * sizeof(uint16_t);
    slot_bytes_ = static_cast<size_t>(p.num_tokens) * sizeof(int64_t);
    pos_bytes_ = l.sink_tokens > 0 ? static_cast<size_t>(p.num_tokens) * sizeof(int32_t) : 0;
    k_off_ = layout.Add(kv_bytes_);
    v_off_ = layout.Add(kv_bytes_);
    slot_off_ = layout.Add(slot_bytes_);
    pos_off_ = layout.Add(pos_bytes_);
  }

  void Fill(uint8_t* host) const {
    std::memcpy(host + k_off_, p_.k, kv_bytes_);
    std::memcpy(host + v_off_, p_.v, kv_bytes_);
    std::memcpy(host + slot_off_, p_.slot_mapping, slot_bytes_);
    if (pos_bytes_ > 0) std::memcpy(host + pos_off_, p_.positions, pos_bytes_);
  }

  QuantizeAppendParams DeviceParams(uint8_t* device) const {
    QuantizeAppendParams d = p_;
    d.k = reinterpret_cast<const uint16_t*>(device + k_off_);
    d.v = reinterpret_cast<const uint16_t*>(device + v_off_);
    d.slot_mapping = reinterpret_cast<const int64_t*>(device + slot_off_);
    d.positions = pos_bytes_ > 0 ? reinterpret_cast<const int32_t*>(device + pos_off_) : nullptr;
    return d;
  }

 private:
  const QuantizeAppendParams& p_;
  size_t kv_bytes_, slot_bytes_, pos_bytes_;
  size_t k_off_, v_off_, slot_off_, pos_off_;
};

}  // namespace kvpool::cuda_backend_internal

#endif  // KVPOOL_SERVICE_STORE_CUDA_BACKEND_STAGING_H_
