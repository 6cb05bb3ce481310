#include "service/malloc_tuning.h"

#include <climits>

#include "absl/strings/str_cat.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvpool {

absl::Status SetMallocThresholds(size_t mmap_threshold, size_t trim_threshold) {
  if (mmap_threshold > INT_MAX || trim_threshold > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("malloc thresholds must be at most ", INT_MAX,
                                                   " bytes, not ", mmap_threshold, " and ",
                                                   trim_threshold));
  }
  if (mmap_threshold == 0 && trim_threshold == 0) return absl::OkStatus();
#if defined(__GLIBC__)
  if (mmap_threshold != 0 && mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("M_MMAP_THRESHOLD ", mmap_threshold, " refused by malloc"));
  }
  if (trim_threshold != 0 && mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("M_TRIM_THRESHOLD ", trim_threshold, " refused by malloc"));
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError("malloc thresholds are set only with glibc");
#endif
}

}  // namespace kvpool
