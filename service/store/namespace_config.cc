#include "service/store/namespace_config.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace kvpool {
namespace {

constexpr int kMaxNameLength = 64;
// Upper bounds that, with kMaxNamespaceLayers, keep every size product of a namespace far from
// overflow.
constexpr int kMaxKvHeads = 1024;
constexpr int kMaxHeadDim = 1024;
constexpr int kMaxBlockTokens = 1024;

// Default sign-vector seed of the default namespace (any nonzero constant).
constexpr uint64_t kDefaultRotationSeed = 0x6B76706F6F6C0001ull;

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == '-';
}

bool IsKnownDtype(KvDtype d) {
  switch (d) {
    case KvDtype::kFp16:
    case KvDtype::kFp8E4M3:
    case KvDtype::kInt8:
    case KvDtype::kInt4:
      return true;
  }
  return false;
}

absl::Status CheckRange(const char* what, int value, int max) {
  if (value <= 0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrFormat("namespace %s must be in [1, %d], got %d", what, max, value));
  }
  return absl::OkStatus();
}

// splitmix64 finalizer of (seed, layer); never 0 for a nonzero seed.
uint64_t LayerSignSeed(uint64_t rotation_seed, int layer) {
  if (rotation_seed == 0) return 0;
  uint64_t z = rotation_seed ^ (0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(layer) + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z == 0 ? 1 : z;
}

}  // namespace

NamespaceConfig DefaultNamespaceConfig(uint64_t capacity_bytes) {
  NamespaceConfig c;
  c.name = "default";
  c.num_layers = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.block_tokens = 16;
  c.layer_dtypes.assign(c.num_layers, KvDtype::kInt4);
  c.rotation_block = 128;
  c.rotation_seed = kDefaultRotationSeed;
  c.group_size = 128;
  c.sink_tokens = 0;
  c.capacity_bytes = capacity_bytes;
  return c;
}

absl::Status ValidateNamespaceConfig(const NamespaceConfig& config) {
  const std::string& name = config.name;
  if (name.empty() || name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "namespace name must be 1 to %d characters, got %d", kMaxNameLength, name.size()));
  }
  for (char c : name) {
    if (!IsNameChar(c)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "namespace name \"%s\" may only contain [a-zA-Z0-9._-]", name));
    }
  }
  if (absl::Status s = CheckRange("num_layers", config.num_layers, kMaxNamespaceLayers);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckRange("num_kv_heads", config.num_kv_heads, kMaxKvHeads); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckRange("head_dim", config.head_dim, kMaxHeadDim); !s.ok()) return s;
  if (absl::Status s = CheckRange("block_tokens", config.block_tokens, kMaxBlockTokens);
      !s.ok()) {
    return s;
  }
  if (config.layer_dtypes.size() != static_cast<size_t>(config.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("namespace has %d layers but %d layer dtypes", config.num_layers,
                        config.layer_dtypes.size()));
  }
  if (config.rotation_block < 0 || config.group_size < 0 || config.sink_tokens < 0) {
    return absl::InvalidArgumentError(
        "namespace rotation_block, group_size and sink_tokens must not be negative");
  }
  if (config.blocks_per_sink_page < 1) {
    return absl::InvalidArgumentError("namespace blocks_per_sink_page must be at least 1");
  }
  for (int l = 0; l < config.num_layers; ++l) {
    if (!IsKnownDtype(config.layer_dtypes[l])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d has unknown dtype %d", l, static_cast<int>(config.layer_dtypes[l])));
    }
    if (const char* why = ValidatePageLayout(LayerLayout(config, l)); why != nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d: %s", l, why));
    }
  }
  return absl::OkStatus();
}

PageLayout LayerLayout(const NamespaceConfig& config, int layer) {
  PageLayout p;
  p.num_kv_heads = config.num_kv_heads;
  p.head_dim = config.head_dim;
  p.block_tokens = config.block_tokens;
  p.dtype = config.layer_dtypes[layer];
  p.group_size = config.group_size == 0 ? config.head_dim : config.group_size;
  p.rot_block = config.rotation_block;
  p.sign_seed = LayerSignSeed(config.rotation_seed, layer);
  p.sink_tokens = config.sink_tokens;
  return p;
}

uint64_t BytesPerBlock(const NamespaceConfig& config) {
  uint64_t bytes = 0;
  for (int l = 0; l < config.num_layers; ++l) bytes += LayerLayout(config, l).layer_page_bytes();
  return bytes;
}

uint64_t SinkBytesPerBlock(const NamespaceConfig& config) {
  uint64_t bytes = 0;
  for (int l = 0; l < config.num_layers; ++l) bytes += LayerLayout(config, l).sink_page_bytes();
  return bytes;
}

namespace {

uint64_t SinkBlocks(const NamespaceConfig& config, uint64_t blocks) {
  if (SinkBytesPerBlock(config) == 0) return 0;
  const uint64_t r = static_cast<uint64_t>(config.blocks_per_sink_page);
  return blocks / r + (blocks % r != 0 ? 1 : 0);
}

}  // namespace

uint64_t ArenaBytes(const NamespaceConfig& config, uint64_t blocks) {
  return BytesPerBlock(config) * blocks + SinkBytesPerBlock(config) * SinkBlocks(config, blocks);
}

ArenaBlocks PlanArena(const NamespaceConfig& config, uint64_t capacity_bytes) {
  const uint64_t page = BytesPerBlock(config);
  const uint64_t sink = SinkBytesPerBlock(config);
  const auto r = static_cast<unsigned __int128>(config.blocks_per_sink_page);
  // With a fraction of a sink page per block the arena holds capacity * r / (r * page + sink)
  // blocks (capacity / page without sinks); rounding the sink pages up takes away a few at most.
  uint64_t blocks =
      static_cast<uint64_t>(static_cast<unsigned __int128>(capacity_bytes) * r / (r * page + sink));
  while (blocks > 0 && ArenaBytes(config, blocks) > capacity_bytes) --blocks;
  return {blocks, SinkBlocks(config, blocks)};
}

double BytesPerToken(const NamespaceConfig& config) {
  const double sink_share = static_cast<double>(SinkBytesPerBlock(config)) /
                            static_cast<double>(config.blocks_per_sink_page);
  return (static_cast<double>(BytesPerBlock(config)) + sink_share) / config.block_tokens;
}

double Fp16BytesPerToken(const NamespaceConfig& config) {
  return 2.0 * config.num_layers * config.num_kv_heads * config.head_dim * 2.0;
}

}  // namespace kvpool
