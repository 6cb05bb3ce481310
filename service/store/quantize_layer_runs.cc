#include "service/store/quantize_layer_runs.h"

#include <cstdint>

namespace kvpool::store_internal {
namespace {

int64_t Bytes(const void* from, const void* to) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(to) - reinterpret_cast<uintptr_t>(from));
}

bool SameButSeed(const PageLayout& a, const PageLayout& b) {
  return a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim &&
         a.block_tokens == b.block_tokens && a.dtype == b.dtype && a.group_size == b.group_size &&
         a.rot_block == b.rot_block && a.sink_tokens == b.sink_tokens;
}

// The strides from a to b when b can follow a in a run.
bool Follows(const QuantizeAppendParams& a, const QuantizeAppendParams& b,
             cuda::QuantizeLayerStrides* stride) {
  if (!SameButSeed(a.layout, b.layout) || a.num_tokens != b.num_tokens ||
      a.slot_mapping != b.slot_mapping || a.positions != b.positions ||
      a.num_blocks != b.num_blocks || a.num_sink_blocks != b.num_sink_blocks) {
    return false;
  }
  stride->kv = Bytes(a.k, b.k);
  stride->pages = Bytes(a.pages, b.pages);
  stride->sink_pages = Bytes(a.sink_pages, b.sink_pages);
  // Elements that write the same pages (one layer twice) run one after the other, in order, as
  // they would one launch each; in one launch their writes would race.
  return Bytes(a.v, b.v) == stride->kv && stride->pages != 0;
}

}  // namespace

std::vector<QuantizeLayerRun> QuantizeLayerRuns(absl::Span<const QuantizeAppendParams> ps) {
  std::vector<QuantizeLayerRun> runs;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!runs.empty()) {
      QuantizeLayerRun& run = runs.back();
      cuda::QuantizeLayerStrides stride;
      if (run.count < cuda::kMaxQuantizeLayers && Follows(ps[i - 1], ps[i], &stride) &&
          (run.count == 1 || (stride.kv == run.stride.kv && stride.pages == run.stride.pages &&
                              stride.sink_pages == run.stride.sink_pages))) {
        if (run.count == 1) run.stride = stride;
        ++run.count;
        continue;
      }
    }
    runs.push_back({i, 1, {}});
  }
  return runs;
}

}  // namespace kvpool::store_internal
