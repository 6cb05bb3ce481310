// Helpers shared by the GPU attention test and benchmark: an owning device buffer (the paged
// host batch the test copies to the device is tests/common/attention_batch.h).
#ifndef KVPOOL_TESTS_GPU_ATTENTION_TEST_UTIL_H_
#define KVPOOL_TESTS_GPU_ATTENTION_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "tests/common/attention_batch.h"

namespace kvpool::testing {

// Aborts with the failing call's text: device setup failures leave nothing to test.
#define KVPOOL_CUDA_CHECK(expr)                                                 \
  do {                                                                          \
    const cudaError_t kvpool_err_ = (expr);                                     \
    if (kvpool_err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(kvpool_err_)); \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

// Device memory of `bytes` bytes, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) KVPOOL_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    if (bytes_ > 0) {
      KVPOOL_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice));
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

  template <typename T>
  std::vector<T> ToHost() const {
    std::vector<T> host(bytes_ / sizeof(T));
    KVPOOL_CUDA_CHECK(
        cudaMemcpy(host.data(), ptr_, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Median of `iters` CUDA-event timings of `run` on the default stream, each after `flush()`
// (which leaves the L2 without the data `run` reads), after 3 warm-up runs.
template <typename Flush, typename F>
double MedianMs(int iters, Flush&& flush, F&& run) {
  cudaEvent_t start, stop;
  KVPOOL_CUDA_CHECK(cudaEventCreate(&start));
  KVPOOL_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) run();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    flush();
    KVPOOL_CUDA_CHECK(cudaEventRecord(start));
    run();
    KVPOOL_CUDA_CHECK(cudaEventRecord(stop));
    KVPOOL_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    KVPOOL_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  KVPOOL_CUDA_CHECK(cudaEventDestroy(start));
  KVPOOL_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_GPU_ATTENTION_TEST_UTIL_H_
