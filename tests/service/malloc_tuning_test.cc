// SetMallocThresholds: the thresholds kvpool-server sets at start-up keep a decode step's
// 256 KiB blocks in the heap; values past mallopt's int are refused.
#include "service/malloc_tuning.h"

#include <climits>
#include <cstdlib>

#include "absl/status/status.h"
#include "gtest/gtest.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvpool {
namespace {

#if defined(__GLIBC__)
// Blocks currently served by their own mmap.
size_t MmappedBlocks() { return mallinfo2().hblks; }

TEST(SetMallocThresholds, KeepsStepSizedBlocksOutOfMmap) {
  // Before: glibc's 128 KiB start serves a fresh 256 KiB block with its own mmap.
  void* before = std::malloc(256 << 10);
  ASSERT_NE(before, nullptr);
  const size_t mmapped = MmappedBlocks();
  std::free(before);
  EXPECT_EQ(MmappedBlocks(), mmapped - 1);

  ASSERT_TRUE(SetMallocThresholds(kDefaultMallocMmapThreshold, kDefaultMallocTrimThreshold).ok());
  for (size_t bytes : {size_t{256} << 10, size_t{4} << 20, kDefaultMallocMmapThreshold - 4096}) {
    void* block = std::malloc(bytes);
    ASSERT_NE(block, nullptr);
    EXPECT_EQ(MmappedBlocks(), mmapped - 1) << bytes << " bytes";
    std::free(block);
  }
  void* huge = std::malloc(2 * kDefaultMallocMmapThreshold);
  ASSERT_NE(huge, nullptr);
  EXPECT_EQ(MmappedBlocks(), mmapped);  // past the threshold: its own mmap again
  std::free(huge);
}
#endif

TEST(SetMallocThresholds, RefusesValuesPastInt) {
  EXPECT_EQ(SetMallocThresholds(size_t{INT_MAX} + 1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SetMallocThresholds(0, size_t{INT_MAX} + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SetMallocThresholds(0, 0).ok());
}

}  // namespace
}  // namespace kvpool
