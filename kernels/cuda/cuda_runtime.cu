// kvpool::cuda::Available and the per-thread record of the last CUDA error.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/kv_kernels.h"

namespace kvpool::cuda {
namespace {

// The message of the last failure recorded on this thread; each backend call reads it on the
// thread that made the failing call.
thread_local std::string last_error_message;

}  // namespace

KernelStatus RecordCudaError(cudaError_t err, const char* what) {
  last_error_message =
      std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  // A failed runtime call also leaves its error for the thread's next cudaGetLastError: taken
  // here, so that the next launch check on this thread does not report this failure as its own
  // (a sticky error, which poisons the context, stays).
  cudaGetLastError();
  return KernelStatus::kCudaError;
}

bool Available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error so later checks start clean
    return false;
  }
  return count > 0;
}

KernelStatus ServesLayout(const PageLayout& layout) {
  if (ValidatePageLayout(layout) != nullptr) return KernelStatus::kInvalidArgument;
  // The attention kernels' groups (the quantize and dequantize kernels take multiples of 8).
  if ((layout.quantized() && layout.group_size % 16 != 0) ||
      layout.layer_page_bytes() > UINT32_MAX || !FitsPageGeometry(layout)) {
    return KernelStatus::kUnsupported;
  }
  return DispatchLayout(layout, [](auto, auto, auto, auto) { return KernelStatus::kOk; });
}

const char* LastErrorMessage() { return last_error_message.c_str(); }

}  // namespace kvpool::cuda
