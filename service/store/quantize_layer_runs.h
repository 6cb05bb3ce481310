// Which elements of one QuantizeAppendFromArena call a single cuda::QuantizeAppendLayers launch
// can take together: the layers of a transfer round, which share their tokens, slots and layout
// and sit at fixed strides in the staging buffer and in the layer-major arena. Host code only.
#ifndef KVPOOL_SERVICE_STORE_QUANTIZE_LAYER_RUNS_H_
#define KVPOOL_SERVICE_STORE_QUANTIZE_LAYER_RUNS_H_

#include <cstddef>
#include <vector>

#include "absl/types/span.h"
#include "kernels/kv_kernels.h"

namespace kvpool::store_internal {

// Elements [first, first + count) of a call: element first + i is element first's k, v, pages
// and sink_pages plus i strides, with its own layout.sign_seed.
struct QuantizeLayerRun {
  size_t first = 0;
  int count = 0;
  cuda::QuantizeLayerStrides stride;
};

// Splits `ps` in order into runs of at most cuda::kMaxQuantizeLayers elements. An element joins
// the run before it when its layout equals the run's but for sign_seed, it names the same
// num_tokens, slot_mapping and positions arrays and arena sizes, and its k, v, pages and
// sink_pages lie one stride past the element before (the stride set by the run's second
// element; k and v by the same one; pages by a stride other than 0).
std::vector<QuantizeLayerRun> QuantizeLayerRuns(absl::Span<const QuantizeAppendParams> ps);

}  // namespace kvpool::store_internal

#endif  // KVPOOL_SERVICE_STORE_QUANTIZE_LAYER_RUNS_H_
