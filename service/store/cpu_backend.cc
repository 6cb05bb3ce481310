// The CPU reference backend: arenas in host memory, kernels from kvpool::cpu, all synchronous.
// Arena memory is host memory, so the transfer paths are the host paths.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "kernels/kv_kernels.h"
#include "service/store/arena_registry.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store_impl.h"

namespace kvpool {
namespace {

// Arenas start 64-byte aligned (a cache line; pages inside are 16-byte aligned by layout).
constexpr size_t kArenaAlignment = 64;

class CpuBackend final : public ComputeBackend {
 public:
  ~CpuBackend() override {
    for (uint8_t* arena : arenas_.TakeAll()) std::free(arena);
  }

  std::string name() const override { return "cpu"; }

  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("arena of 0 bytes");
    const size_t rounded = (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
    auto* arena = static_cast<uint8_t*>(std::aligned_alloc(kArenaAlignment, rounded));
    if (arena == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cannot allocate a host arena of %d bytes", rounded));
    }
    std::memset(arena, 0, rounded);
    arenas_.Add(arena, rounded);
    return arena;
  }

  void FreeArena(uint8_t* arena) override {
    if (arenas_.Remove(arena)) std::free(arena);
  }

  absl::Status QuantizeAppend(const QuantizeAppendParams& p) override {
    return FromKernelStatus(cpu::QuantizeAppend(p), "QuantizeAppend");
  }
  absl::Status Dequantize(const DequantizeParams& p) override {
    return FromKernelStatus(cpu::Dequantize(p), "Dequantize");
  }
  absl::Status PagedDecodeAttention(const PagedDecodeAttentionParams& p,
                                    const QuantizeAppendParams* append) override {
    if (append != nullptr) {
      if (absl::Status s = QuantizeAppend(*append); !s.ok()) return s;
    }
    return FromKernelStatus(cpu::PagedDecodeAttention(p), "PagedDecodeAttention");
  }
  absl::Status ReadArena(const uint8_t* src, size_t bytes, void* dst) override {
    if (bytes > 0 && (src == nullptr || dst == nullptr)) {
      return absl::InvalidArgumentError("ReadArena: null pointer");
    }
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  // Arena memory is host memory here: gathering into it is reading the runs to the host.
  absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) override {
    return ReadRuns(runs, dst);
  }
  absl::Status DequantizeToArena(absl::Span<const DequantizeParams> ps) override {
    for (const DequantizeParams& p : ps) {
      if (absl::Status s = Dequantize(p); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // Every element checked before the first is written, as on the CUDA backend.
  absl::Status QuantizeAppendFromArena(absl::Span<const QuantizeAppendParams> ps) override {
    for (const QuantizeAppendParams& p : ps) {
      if (absl::Status s = ValidateQuantizeAppend(p); !s.ok()) return s;
    }
    for (const QuantizeAppendParams& p : ps) {
      if (absl::Status s = QuantizeAppend(p); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status CheckHalfRangeArena(absl::Span<const HalfRangeCheck> checks) override {
    for (const HalfRangeCheck& c : checks) {
      if (absl::Status s = store_internal::CheckHalfRange(c.x, c.n, c.max_abs_bits, c.what);
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  ComputeBackendStats Stats() const override {
    ComputeBackendStats s;
    s.arena_bytes = arenas_.bytes();
    return s;
  }

 private:
  ArenaRegistry arenas_;
};

}  // namespace

std::unique_ptr<ComputeBackend> NewCpuBackend() { return std::make_unique<CpuBackend>(); }

absl::Status FromKernelStatus(KernelStatus s, const char* what) {
  switch (s) {
    case KernelStatus::kOk:
      return absl::OkStatus();
    case KernelStatus::kInvalidArgument:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s", what, KernelStatusName(s)));
    case KernelStatus::kUnsupported:
      return absl::UnimplementedError(absl::StrFormat("%s: %s", what, KernelStatusName(s)));
    case KernelStatus::kCudaError:
      return absl::InternalError(absl::StrFormat("%s: %s", what, KernelStatusName(s)));
  }
  return absl::InternalError(
      absl::StrFormat("%s: unknown kernel status %d", what, static_cast<int>(s)));
}

}  // namespace kvpool
