// Defaults of ComputeBackend's optional parts: every valid layout served, host memory not pinned,
// and transfer paths that a backend without NCCL transfers refuses instead of pretending.
#include "service/store/compute_backend.h"

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"

namespace kvpool {
namespace {

absl::Status NoTransferPath(const ComputeBackend& backend, const char* what) {
  return absl::UnimplementedError(absl::StrCat("the ", backend.name(),
                                               " backend does not implement ", what,
                                               " (needed by the NCCL transfer paths)"));
}

}  // namespace

absl::Status ValidateQuantizeAppend(const QuantizeAppendParams& p) {
  if (const char* bad = ValidatePageLayout(p.layout); bad != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeAppend: ", bad));
  }
  if (p.num_tokens < 0 || p.num_blocks < 0 || p.num_sink_blocks < 0) {
    return absl::InvalidArgumentError("QuantizeAppend: negative token or block count");
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  if (p.k == nullptr || p.v == nullptr || p.slot_mapping == nullptr || p.pages == nullptr) {
    return absl::InvalidArgumentError("QuantizeAppend: null input or pages");
  }
  if (p.layout.sink_tokens > 0 && (p.positions == nullptr || p.sink_pages == nullptr)) {
    return absl::InvalidArgumentError("QuantizeAppend: sinks need positions and sink pages");
  }
  if (const int t = FirstBadAppendSlot(p); t >= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "QuantizeAppend: token %d: slot %d, or its position, out of range (or a sink outside the "
        "sink blocks)",
        t, p.slot_mapping[t]));
  }
  return absl::OkStatus();
}

absl::Status ComputeBackend::ReadRuns(absl::Span<const ArenaRun> runs, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  for (const ArenaRun& run : runs) {
    if (run.src == nullptr) {
      std::memset(out, 0, run.bytes);
    } else if (absl::Status s = ReadArena(run.src, run.bytes, out); !s.ok()) {
      return s;
    }
    out += run.bytes;
  }
  return absl::OkStatus();
}

absl::Status ComputeBackend::GatherArena(absl::Span<const ArenaRun> /*runs*/, uint8_t* /*dst*/) {
  return NoTransferPath(*this, "GatherArena");
}

absl::Status ComputeBackend::DequantizeToArena(absl::Span<const DequantizeParams> /*ps*/) {
  return NoTransferPath(*this, "DequantizeToArena");
}

absl::Status ComputeBackend::QuantizeAppendFromArena(
    absl::Span<const QuantizeAppendParams> /*ps*/) {
  return NoTransferPath(*this, "QuantizeAppendFromArena");
}

absl::Status ComputeBackend::CheckHalfRangeArena(absl::Span<const HalfRangeCheck> /*checks*/) {
  return NoTransferPath(*this, "CheckHalfRangeArena");
}

absl::Status ComputeBackend::CheckLayout(const PageLayout& /*layout*/) const {
  return absl::OkStatus();
}

absl::Status ComputeBackend::CheckAttentionShape(size_t /*num_seqs*/,
                                                 size_t /*num_q_heads*/) const {
  return absl::OkStatus();
}

absl::Status ComputeBackend::RegisterHostMemory(void* /*data*/, size_t /*bytes*/) {
  return absl::OkStatus();
}

void ComputeBackend::UnregisterHostMemory(void* /*data*/) {}

}  // namespace kvpool
