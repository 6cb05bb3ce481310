// The store's state as Prometheus series: a collector that reads KvStore::Stats() at scrape time
// into the kvpool_pool_*, kvpool_tokens_stored, prefix, eviction, quantization, lease and device
// memory families (names are the contract with the dashboard and alert rules).
#ifndef KVPOOL_SERVICE_STORE_METRICS_H_
#define KVPOOL_SERVICE_STORE_METRICS_H_

#include "service/metrics/metrics_registry.h"
#include "service/store/kv_store.h"

namespace kvpool {

// Registers the store families in `registry` and a collector reading `store`; both must
// outlive the registry's last Serialize.
void RegisterStoreMetrics(KvStore* store, metrics::Registry* registry);

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_METRICS_H_
