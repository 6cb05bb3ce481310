// The kvpool::cuda functions of a build without CUDA (KVPOOL_ENABLE_CUDA=OFF): nothing is
// available and every operation reports kUnsupported.
#include "kernels/kv_kernels.h"

namespace kvpool::cuda {

bool Available() { return false; }

KernelStatus ServesLayout(const PageLayout&) { return KernelStatus::kUnsupported; }

KernelStatus QuantizeAppend(const QuantizeAppendParams&, void*) {
  return KernelStatus::kUnsupported;
}

KernelStatus QuantizeAppendLayers(const QuantizeAppendParams&, int, const QuantizeLayerStrides&,
                                  const uint64_t*, void*) {
  return KernelStatus::kUnsupported;
}

KernelStatus Dequantize(const DequantizeParams&, void*) { return KernelStatus::kUnsupported; }

KernelStatus PagedDecodeAttention(const PagedDecodeAttentionParams&, void*) {
  return KernelStatus::kUnsupported;
}

size_t AttentionWorkspaceBytes(const PageLayout&, int, int, int, int) { return 0; }
AttentionPlan PlanAttention(const PageLayout&, int, int, int, int) { return {}; }

const char* LastErrorMessage() { return "built without CUDA"; }

}  // namespace kvpool::cuda
