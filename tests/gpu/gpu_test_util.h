// Shared by the GPU tests: they build everywhere CUDA is enabled and skip on a machine without a
// visible device.
#ifndef KVPOOL_TESTS_GPU_GPU_TEST_UTIL_H_
#define KVPOOL_TESTS_GPU_GPU_TEST_UTIL_H_

#include "gtest/gtest.h"
#include "kernels/kv_kernels.h"

// Skips the current test when no CUDA device is visible.
#define KVPOOL_SKIP_WITHOUT_GPU()                                              \
  do {                                                                         \
    if (!cuda::Available()) GTEST_SKIP() << "no CUDA device visible: skipped"; \
  } while (0)

#endif  // KVPOOL_TESTS_GPU_GPU_TEST_UTIL_H_
