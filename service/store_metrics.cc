#include "service/store_metrics.h"

#include <memory>
#include <string>

namespace kvpool {
namespace {

// The families, registered once; the collector fills them from one Stats() snapshot.
struct StoreFamilies {
  explicit StoreFamilies(metrics::Registry* r)
      : pool_bytes(r->AddGauge("kvpool_pool_bytes", "Pool bytes by namespace and block state.",
                               {"namespace", "state"})),
        pool_blocks(r->AddGauge("kvpool_pool_blocks", "Pool blocks by namespace and block state.",
                                {"namespace", "state"})),
        sink_blocks(r->AddGauge("kvpool_sink_blocks",
                                "Blocks with a sink page (a sequence's first block takes one), "
                                "by namespace: total and free.",
                                {"namespace", "state"})),
        tokens_stored(
            r->AddGauge("kvpool_tokens_stored", "Tokens in published blocks.", {"namespace"})),
        query_tokens(r->AddCounter("kvpool_prefix_query_tokens_total",
                                   "Tokens looked up by Match and committed Puts.", {"namespace"})),
        hit_tokens(r->AddCounter("kvpool_prefix_hit_tokens_total", "Looked-up tokens found cached.",
                                 {"namespace"})),
        evictions(r->AddCounter("kvpool_evictions_total", "Blocks evicted.", {"namespace"})),
        quantized_bytes(r->AddCounter("kvpool_quantized_bytes_total",
                                      "Page bytes written by the quantize kernel.", {"namespace"})),
        active_leases(r->AddGauge("kvpool_active_leases", "Leases not yet released or expired.")),
        lease_token_ids(r->AddGauge("kvpool_lease_token_ids",
                                    "Token ids the leases keep (--max_lease_token_ids).")),
        bytes_per_token(r->AddGauge("kvpool_bytes_per_token",
                                    "Stored bytes per token (all layers, K and V).",
                                    {"namespace"})),
        fp16_bytes_per_token(r->AddGauge("kvpool_fp16_bytes_per_token",
                                         "Bytes per token of the same KV in fp16.", {"namespace"})),
        compression_ratio(r->AddGauge("kvpool_compression_ratio",
                                      "fp16 bytes per token over stored bytes per token.",
                                      {"namespace"})),
        quant_error(r->AddGauge("kvpool_quantization_relative_error",
                                "Sampled relative L2 error of recent puts.", {"namespace"})),
        device_memory(r->AddGauge(
            "kvpool_device_memory_bytes",
            "Device memory: total, free, and allocated to arenas (the pools and NCCL staging).",
            {"state"})) {}

  void Collect(const StoreStats& s) {
    for (const NamespaceStoreStats& n : s.namespaces) {
      const std::string& ns = n.name;
      const struct {
        const char* state;
        uint64_t blocks;
      } states[] = {
          {"free", n.blocks_free}, {"in_use", n.blocks_in_use}, {"evictable", n.blocks_evictable}};
      for (const auto& st : states) {
        pool_blocks.WithLabels({ns, st.state}).Set(static_cast<double>(st.blocks));
        pool_bytes.WithLabels({ns, st.state})
            .Set(static_cast<double>(st.blocks) * static_cast<double>(n.bytes_per_block));
      }
      if (n.sink_blocks_total > 0) {
        sink_blocks.WithLabels({ns, "total"}).Set(static_cast<double>(n.sink_blocks_total));
        sink_blocks.WithLabels({ns, "free"}).Set(static_cast<double>(n.sink_blocks_free));
      }
      tokens_stored.WithLabels({ns}).Set(static_cast<double>(n.tokens_stored));
      query_tokens.WithLabels({ns}).Set(static_cast<double>(n.prefix_query_tokens));
      hit_tokens.WithLabels({ns}).Set(static_cast<double>(n.prefix_hit_tokens));
      evictions.WithLabels({ns}).Set(static_cast<double>(n.evictions));
      quantized_bytes.WithLabels({ns}).Set(static_cast<double>(n.quantized_bytes));
      bytes_per_token.WithLabels({ns}).Set(n.bytes_per_token);
      fp16_bytes_per_token.WithLabels({ns}).Set(n.fp16_bytes_per_token);
      compression_ratio.WithLabels({ns}).Set(
          n.bytes_per_token > 0 ? n.fp16_bytes_per_token / n.bytes_per_token : 0.0);
      quant_error.WithLabels({ns}).Set(n.quant_rel_error);
    }
    active_leases.WithLabels({}).Set(static_cast<double>(s.active_leases));
    lease_token_ids.WithLabels({}).Set(static_cast<double>(s.lease_token_ids));
    device_memory.WithLabels({"total"}).Set(static_cast<double>(s.memory.device_total_bytes));
    device_memory.WithLabels({"free"}).Set(static_cast<double>(s.memory.device_free_bytes));
    device_memory.WithLabels({"arena"}).Set(static_cast<double>(s.memory.arena_bytes));
  }

  metrics::GaugeFamily& pool_bytes;
  metrics::GaugeFamily& pool_blocks;
  metrics::GaugeFamily& sink_blocks;
  metrics::GaugeFamily& tokens_stored;
  metrics::CounterFamily& query_tokens;
  metrics::CounterFamily& hit_tokens;
  metrics::CounterFamily& evictions;
  metrics::CounterFamily& quantized_bytes;
  metrics::GaugeFamily& active_leases;
  metrics::GaugeFamily& lease_token_ids;
  metrics::GaugeFamily& bytes_per_token;
  metrics::GaugeFamily& fp16_bytes_per_token;
  metrics::GaugeFamily& compression_ratio;
  metrics::GaugeFamily& quant_error;
  metrics::GaugeFamily& device_memory;
};

}  // namespace

void RegisterStoreMetrics(KvStore* store, metrics::Registry* registry) {
  auto families = std::make_shared<StoreFamilies>(registry);
  registry->AddCollector([store, families] { families->Collect(store->Stats()); });
}

}  // namespace kvpool
