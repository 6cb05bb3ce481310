#include "service/store/arena_registry.h"

#include <utility>

namespace kvpool {

void ArenaRegistry::Add(uint8_t* arena, size_t bytes) {
  absl::MutexLock l(&mu_);
  arenas_[arena] = bytes;
  bytes_ += bytes;
}

bool ArenaRegistry::Remove(uint8_t* arena) {
  if (arena == nullptr) return false;
  absl::MutexLock l(&mu_);
  auto it = arenas_.find(arena);
  if (it == arenas_.end()) return false;
  bytes_ -= it->second;
  arenas_.erase(it);
  return true;
}

std::vector<uint8_t*> ArenaRegistry::TakeAll() {
  absl::MutexLock l(&mu_);
  std::vector<uint8_t*> all;
  all.reserve(arenas_.size());
  for (const auto& [arena, bytes] : arenas_) all.push_back(arena);
  arenas_.clear();
  bytes_ = 0;
  return all;
}

uint64_t ArenaRegistry::bytes() const {
  absl::MutexLock l(&mu_);
  return bytes_;
}

}  // namespace kvpool
