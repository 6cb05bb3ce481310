#include "service/store/block_pool.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"

namespace kvpool {

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const NamespaceConfig& config,
                                                             uint64_t num_blocks,
                                                             ComputeBackend* backend) {
  if (num_blocks == 0 ||
      num_blocks > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "namespace %s: %d blocks is outside [1, 2^31-1]", config.name, num_blocks));
  }
  std::vector<PageLayout> layouts;
  layouts.reserve(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) layouts.push_back(LayerLayout(config, l));
  absl::StatusOr<uint8_t*> arena = backend->AllocateArena(BytesPerBlock(config) * num_blocks);
  if (!arena.ok()) return arena.status();
  return std::unique_ptr<BlockPool>(new BlockPool(backend, *arena,
                                                  static_cast<int32_t>(num_blocks),
                                                  std::move(layouts)));
}

BlockPool::BlockPool(ComputeBackend* backend, uint8_t* arena, int32_t num_blocks,
                     std::vector<PageLayout> layouts)
    : backend_(backend), arena_(arena), num_blocks_(num_blocks), layouts_(std::move(layouts)),
      allocated_(num_blocks, false) {
  uint8_t* p = arena_;
  for (const PageLayout& layout : layouts_) {
    layer_base_.push_back(p);
    p += layout.layer_page_bytes() * static_cast<size_t>(num_blocks_);
  }
  for (const PageLayout& layout : layouts_) {
    sink_base_.push_back(layout.sink_tokens > 0 ? p : nullptr);
    p += layout.sink_page_bytes() * static_cast<size_t>(num_blocks_);
  }
  free_.reserve(num_blocks_);
  for (int32_t id = num_blocks_ - 1; id >= 0; --id) free_.push_back(id);
}

BlockPool::~BlockPool() { backend_->FreeArena(arena_); }

absl::StatusOr<std::vector<int32_t>> BlockPool::Allocate(size_t n) {
  if (n > free_.size()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%d blocks requested, %d of %d free", n, free_.size(), num_blocks_));
  }
  std::vector<int32_t> ids(free_.end() - n, free_.end());
  free_.resize(free_.size() - n);
  // The stack's top is its end; hand ids out in ascending order.
  std::reverse(ids.begin(), ids.end());
  for (int32_t id : ids) allocated_[id] = true;
  return ids;
}

void BlockPool::Free(absl::Span<const int32_t> ids) {
  for (int32_t id : ids) {
    assert(id >= 0 && id < num_blocks_ && allocated_[id]);
    allocated_[id] = false;
    free_.push_back(id);
  }
}

}  // namespace kvpool
