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

const char* LastErrorMessage() { return last_error_message.c_str(); }

}  // namespace kvpool::cuda
