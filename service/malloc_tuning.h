// Fixed glibc malloc thresholds for a process that allocates and frees blocks of 100 KiB to a few
// MiB per request (an Attend step's q, output and new K/V; gRPC messages).
//
// By default glibc serves blocks above M_MMAP_THRESHOLD with their own mmap and returns the free
// top of a heap to the kernel past M_TRIM_THRESHOLD; both start at 128 KiB and rise only as large
// blocks are freed, up to 32 MiB. Until they have risen, and again whenever two such blocks are
// freed together, the next request's first touch of its blocks page-faults: allocating, touching
// and freeing 256 KiB took ~130 us instead of ~11 us on the development machine. Fixed thresholds
// keep those blocks in the heap from the first request on.
#ifndef KVPOOL_SERVICE_MALLOC_TUNING_H_
#define KVPOOL_SERVICE_MALLOC_TUNING_H_

#include <cstddef>

#include "absl/status/status.h"

namespace kvpool {

// glibc's own ceiling for its dynamic mmap threshold, and twice it, the trim threshold its
// dynamic rule sets beside it.
inline constexpr size_t kDefaultMallocMmapThreshold = size_t{32} << 20;
inline constexpr size_t kDefaultMallocTrimThreshold = size_t{64} << 20;

// Sets M_MMAP_THRESHOLD and M_TRIM_THRESHOLD; 0 leaves a threshold to glibc's dynamic default.
// INVALID_ARGUMENT for a value over INT_MAX; UNIMPLEMENTED where the C library is not glibc.
absl::Status SetMallocThresholds(size_t mmap_threshold, size_t trim_threshold);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_MALLOC_TUNING_H_
