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
namespace {

// The fields QuantizeAppendParams and PagedDecodeAttentionParams share, for `layer` of `pool`.
template <typename Params>
Params LayerParams(const BlockPool& pool, int layer) {
  Params p;
  p.layout = pool.layout(layer);
  p.pages = pool.layer_base(layer);
  p.sink_pages = pool.sink_base(layer);
  p.num_blocks = pool.num_blocks();
  p.num_sink_blocks = pool.num_sink_blocks();
  return p;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const NamespaceConfig& config,
                                                             const ArenaBlocks& blocks,
                                                             ComputeBackend* backend) {
  if (blocks.blocks == 0 ||
      blocks.blocks > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "namespace %s: %d blocks is outside [1, 2^31-1]", config.name, blocks.blocks));
  }
  const bool sinks = config.sink_tokens > 0;
  if (sinks ? blocks.sink_blocks == 0 || blocks.sink_blocks > blocks.blocks
            : blocks.sink_blocks != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("namespace %s: %d sink blocks for %d blocks and %d sink tokens",
                        config.name, blocks.sink_blocks, blocks.blocks, config.sink_tokens));
  }
  std::vector<PageLayout> layouts;
  layouts.reserve(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) layouts.push_back(LayerLayout(config, l));
  absl::StatusOr<uint8_t*> arena = backend->AllocateArena(
      BytesPerBlock(config) * blocks.blocks + SinkBytesPerBlock(config) * blocks.sink_blocks);
  if (!arena.ok()) return arena.status();
  return std::unique_ptr<BlockPool>(
      new BlockPool(backend, *arena, static_cast<int32_t>(blocks.blocks),
                    static_cast<int32_t>(blocks.sink_blocks), std::move(layouts)));
}

BlockPool::BlockPool(ComputeBackend* backend, uint8_t* arena, int32_t num_blocks,
                     int32_t num_sink_blocks, std::vector<PageLayout> layouts)
    : backend_(backend),
      arena_(arena),
      num_blocks_(num_blocks),
      num_sink_blocks_(num_sink_blocks),
      layouts_(std::move(layouts)),
      allocated_(num_blocks, false) {
  uint8_t* p = arena_;
  for (const PageLayout& layout : layouts_) {
    layer_base_.push_back(p);
    p += layout.layer_page_bytes() * static_cast<size_t>(num_blocks_);
  }
  for (const PageLayout& layout : layouts_) {
    sink_base_.push_back(layout.sink_tokens > 0 ? p : nullptr);
    p += layout.sink_page_bytes() * static_cast<size_t>(num_sink_blocks_);
  }
  free_.reserve(num_blocks_ - num_sink_blocks_);
  for (int32_t id = num_blocks_ - 1; id >= num_sink_blocks_; --id) free_.push_back(id);
  sink_free_.reserve(num_sink_blocks_);
  for (int32_t id = num_sink_blocks_ - 1; id >= 0; --id) sink_free_.push_back(id);
}

BlockPool::~BlockPool() { backend_->FreeArena(arena_); }

QuantizeAppendParams BlockPool::AppendParams(int layer) const {
  return LayerParams<QuantizeAppendParams>(*this, layer);
}

PagedDecodeAttentionParams BlockPool::AttentionParams(int layer) const {
  return LayerParams<PagedDecodeAttentionParams>(*this, layer);
}

absl::StatusOr<std::vector<int32_t>> BlockPool::Allocate(size_t n, size_t firsts) {
  assert(firsts <= n);
  if (num_sink_blocks_ == 0) firsts = 0;  // no sinks: any block can start a sequence
  if (n > num_free() || firsts > sink_free_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%d blocks requested (%d of them with a sink page), %d of %d free (%d of "
                        "%d with a sink page)",
                        n, firsts, num_free(), num_blocks_, sink_free_.size(), num_sink_blocks_));
  }
  std::vector<int32_t> ids;
  ids.reserve(n);
  Take(sink_free_, firsts, &ids);
  Take(free_, n - ids.size(), &ids);
  Take(sink_free_, n - ids.size(), &ids);
  for (int32_t id : ids) allocated_[id] = true;
  return ids;
}

void BlockPool::Take(std::vector<int32_t>& stack, size_t n, std::vector<int32_t>* ids) {
  n = std::min(n, stack.size());
  // The stack's top is its end; hand ids out in ascending order.
  ids->insert(ids->end(), stack.rbegin(), stack.rbegin() + n);
  stack.resize(stack.size() - n);
}

void BlockPool::Free(absl::Span<const int32_t> ids) {
  for (int32_t id : ids) {
    assert(id >= 0 && id < num_blocks_ && allocated_[id]);
    allocated_[id] = false;
    (id < num_sink_blocks_ ? sink_free_ : free_).push_back(id);
  }
}

}  // namespace kvpool
