// BlockPool: the fixed arena of one namespace's blocks and the free list over it.
//
// One ComputeBackend arena holds, layer-major, every layer's pages
// ([num_layers][num_blocks][layer_page_bytes(l)]) followed, when sink_tokens > 0, by every
// layer's sink pages ([num_layers][num_sink_blocks][sink_page_bytes]). Block ids are int32
// indices in [0, num_blocks); ids [0, num_sink_blocks) have a sink page. A sequence's first block
// (the only one whose sink page is used) is taken among those; other blocks are taken among the
// rest first, and among those with a sink page only when the rest are all taken.
//
// Thread safety: not thread-safe; the owning store's lock guards every call except the const
// accessors of the arena geometry (layout, layer_base, sink_base, num_blocks, num_sink_blocks,
// AppendParams, AttentionParams), which never change.
#ifndef KVPOOL_SERVICE_STORE_BLOCK_POOL_H_
#define KVPOOL_SERVICE_STORE_BLOCK_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "service/store/compute_backend.h"
#include "service/store/namespace_config.h"

namespace kvpool {

class BlockPool {
 public:
  // Allocates the arena for `blocks` of a valid `config` (PlanArena) from `backend` (not owned;
  // must outlive the pool). INVALID_ARGUMENT for 0 blocks or more than INT32_MAX, and for sink
  // blocks outside [1, blocks] with sinks or any without.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const NamespaceConfig& config,
                                                           const ArenaBlocks& blocks,
                                                           ComputeBackend* backend);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_sink_blocks() const { return num_sink_blocks_; }
  size_t num_free() const { return free_.size() + sink_free_.size(); }
  size_t num_free_sink() const { return sink_free_.size(); }
  const PageLayout& layout(int layer) const { return layouts_[layer]; }
  // Base of layer `layer`'s pages / sink pages (null when the namespace keeps no sinks).
  uint8_t* layer_base(int layer) const { return layer_base_[layer]; }
  uint8_t* sink_base(int layer) const { return sink_base_[layer]; }

  // A QuantizeAppend / PagedDecodeAttention on layer `layer`: its layout, page and sink bases and
  // the arena's bounds filled in, the rest left to the caller.
  QuantizeAppendParams AppendParams(int layer) const;
  PagedDecodeAttentionParams AttentionParams(int layer) const;

  // `n` distinct free block ids, the first `firsts` (<= n) of them for sequences' first blocks:
  // ids with a sink page when the namespace keeps sinks. RESOURCE_EXHAUSTED (nothing taken) when
  // fewer are free.
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Allocate(size_t n, size_t firsts = 0);
  // Returns allocated blocks to the free list. Requires each id to be allocated.
  void Free(absl::Span<const int32_t> ids);
  bool IsAllocated(int32_t id) const { return allocated_[id]; }

 private:
  BlockPool(ComputeBackend* backend, uint8_t* arena, int32_t num_blocks, int32_t num_sink_blocks,
            std::vector<PageLayout> layouts);
  // Takes up to `n` ids from `stack` into `ids`.
  void Take(std::vector<int32_t>& stack, size_t n, std::vector<int32_t>* ids);

  ComputeBackend* const backend_;
  uint8_t* const arena_;
  const int32_t num_blocks_;
  const int32_t num_sink_blocks_;
  const std::vector<PageLayout> layouts_;
  std::vector<uint8_t*> layer_base_;
  std::vector<uint8_t*> sink_base_;
  // Stacks of free ids without and with a sink page; the lowest ids are handed out first.
  std::vector<int32_t> free_;
  std::vector<int32_t> sink_free_;
  std::vector<bool> allocated_;  // [num_blocks]
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_BLOCK_POOL_H_
