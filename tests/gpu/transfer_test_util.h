// What the CUDA backend's transfer-path tests share (transfer_backend_test,
// half_range_arena_test): the backend, and arena copies to and from the host.
#ifndef KVPOOL_TESTS_GPU_TRANSFER_TEST_UTIL_H_
#define KVPOOL_TESTS_GPU_TRANSFER_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "service/store/compute_backend.h"

namespace kvpool::transfer_test {

// The CUDA backend on device 0 (a test failure, and null, without one).
inline std::unique_ptr<ComputeBackend> GpuBackend() {
  auto backend = NewCudaBackend(0);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

// A device arena of the CUDA backend holding a copy of `bytes` host bytes.
inline uint8_t* Upload(ComputeBackend& gpu, const void* host, size_t bytes) {
  absl::StatusOr<uint8_t*> arena = gpu.AllocateArena(bytes);
  EXPECT_TRUE(arena.ok()) << arena.status();
  if (!arena.ok()) return nullptr;
  EXPECT_EQ(cudaMemcpy(*arena, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return *arena;
}

inline std::vector<uint8_t> Download(ComputeBackend& backend, const uint8_t* arena, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_TRUE(backend.ReadArena(arena, bytes, out.data()).ok());
  return out;
}

}  // namespace kvpool::transfer_test

#endif  // KVPOOL_TESTS_GPU_TRANSFER_TEST_UTIL_H_
