// BlockPool: the fixed arena of one namespace's blocks and the free list over it.
//
// One ComputeBackend arena holds, layer-major, every layer's pages
// ([num_layers][num_blocks][layer_page_bytes(l)]) followed, when sink_tokens > 0, by every
// layer's sink pages ([num_layers][num_blocks][sink_page_bytes]). Block ids are int32 indices
// in [0, num_blocks).
//
// Thread safety: not thread-safe; the owning store's lock guards every call except the const
// accessors of the arena geometry (layout, layer_base, sink_base, num_blocks), which never change.
#ifndef KVPOOL_SERVICE_STORE_BLOCK_POOL_H_
#define KVPOOL_SERVICE_STORE_BLOCK_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/page_layout.h"
#include "service/store/compute_backend.h"
#include "service/store/namespace_config.h"

namespace kvpool {

class BlockPool {
 public:
  // Allocates the arena for `num_blocks` blocks of a valid `config` from `backend` (not owned;
  // must outlive the pool). INVALID_ARGUMENT for 0 blocks or more than INT32_MAX.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const NamespaceConfig& config,
                                                           uint64_t num_blocks,
                                                           ComputeBackend* backend);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int32_t num_blocks() const { return num_blocks_; }
  size_t num_free() const { return free_.size(); }
  const PageLayout& layout(int layer) const { return layouts_[layer]; }
  // Base of layer `layer`'s pages / sink pages (null when the namespace keeps no sinks).
  uint8_t* layer_base(int layer) const { return layer_base_[layer]; }
  uint8_t* sink_base(int layer) const { return sink_base_[layer]; }

  // `n` distinct free block ids, or RESOURCE_EXHAUSTED (nothing taken) when fewer are free.
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Allocate(size_t n);
  // Returns allocated blocks to the free list. Requires each id to be allocated.
  void Free(absl::Span<const int32_t> ids);
  bool IsAllocated(int32_t id) const { return allocated_[id]; }

 private:
  BlockPool(ComputeBackend* backend, uint8_t* arena, int32_t num_blocks,
            std::vector<PageLayout> layouts);

  ComputeBackend* const backend_;
  uint8_t* const arena_;
  const int32_t num_blocks_;
  const std::vector<PageLayout> layouts_;
  std::vector<uint8_t*> layer_base_;
  std::vector<uint8_t*> sink_base_;
  std::vector<int32_t> free_;    // stack of free ids; the lowest ids are handed out first
  std::vector<bool> allocated_;  // [num_blocks]
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_BLOCK_POOL_H_
