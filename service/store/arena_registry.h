// Bookkeeping shared by the compute backends: which arenas a backend handed out and how many
// bytes they hold. The registry never allocates or frees arena memory itself.
//
// Thread safety: every method may be called from several threads at once.
#ifndef KVPOOL_SERVICE_STORE_ARENA_REGISTRY_H_
#define KVPOOL_SERVICE_STORE_ARENA_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace kvpool {

class ArenaRegistry {
 public:
  // Records a live arena of `bytes`.
  void Add(uint8_t* arena, size_t bytes);
  // Forgets `arena`. Returns false, changing nothing, when `arena` is null or not live: the
  // caller frees the memory only on true, so an unknown or repeated pointer is never freed.
  [[nodiscard]] bool Remove(uint8_t* arena);
  // Forgets every live arena and returns them, for the owning backend's destructor to free.
  std::vector<uint8_t*> TakeAll();
  // Total bytes of the live arenas.
  uint64_t bytes() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint8_t*, size_t> arenas_ ABSL_GUARDED_BY(mu_);  // live arena -> bytes
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_STORE_ARENA_REGISTRY_H_
