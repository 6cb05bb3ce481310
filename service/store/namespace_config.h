// One model's KV geometry and quantization policy (DESIGN.md section 3), and the page layouts
// it implies per layer. Pure data and checks: no store state.
#ifndef KVPOOL_SERVICE_STORE_NAMESPACE_CONFIG_H_
#define KVPOOL_SERVICE_STORE_NAMESPACE_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/page_layout.h"

namespace kvpool {

// Most layers a namespace may have (ValidateNamespaceConfig rejects more).
inline constexpr int kMaxNamespaceLayers = 4096;

struct NamespaceConfig {
  std::string name;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  std::vector<KvDtype> layer_dtypes;  // one per layer
  int rotation_block = 0;             // 0 = no rotation; else power of two in [16, head_dim]
  uint64_t rotation_seed = 0;         // 0 = no sign vector
  int group_size = 0;                 // channels per scale/zero; equals head_dim by default
  int sink_tokens = 0;                // <= block_tokens
  // With sink_tokens > 0: one sink page per this many blocks (rounded up), >= 1. Only a
  // sequence's first block uses a sink page, so the pool gives them to the blocks a sequence
  // starts in and the rest of the blocks go without.
  int blocks_per_sink_page = 16;
  uint64_t capacity_bytes = 0;  // pool bytes reserved for this namespace
};

// The default namespace served at start-up: Llama-3-8B geometry (32 layers, 8 KV heads,
// head_dim 128), block_tokens 16, INT4 everywhere, rotation block 128, no sinks.
NamespaceConfig DefaultNamespaceConfig(uint64_t capacity_bytes);

// INVALID_ARGUMENT with the reason when `config` cannot be served.
absl::Status ValidateNamespaceConfig(const NamespaceConfig& config);

// Layout of layer `layer`'s pages. The layer's sign seed is derived from rotation_seed and the
// layer index (0 when rotation_seed is 0).
PageLayout LayerLayout(const NamespaceConfig& config, int layer);

// Bytes a block's pages take over all layers, sink pages apart.
uint64_t BytesPerBlock(const NamespaceConfig& config);
// Bytes a sink page takes over all layers (0 without sinks).
uint64_t SinkBytesPerBlock(const NamespaceConfig& config);

// How an arena of some capacity divides: `blocks` blocks, of which the first `sink_blocks` (ids
// [0, sink_blocks)) have a sink page.
struct ArenaBlocks {
  uint64_t blocks = 0;
  uint64_t sink_blocks = 0;
};
// The bytes of an arena of `blocks` blocks with ceil(blocks / blocks_per_sink_page) sink pages
// (none without sinks).
uint64_t ArenaBytes(const NamespaceConfig& config, uint64_t blocks);
// The most blocks `capacity_bytes` hold that way.
ArenaBlocks PlanArena(const NamespaceConfig& config, uint64_t capacity_bytes);
// Arena bytes per token of the stored format (a block's pages and its share of a sink page), and
// of the same K/V in fp16.
double BytesPerToken(const NamespaceConfig& config);
double Fp16BytesPerToken(const NamespaceConfig& config);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_NAMESPACE_CONFIG_H_
