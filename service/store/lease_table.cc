#include "service/store/lease_table.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/random/distributions.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace kvpool {

absl::StatusOr<std::shared_ptr<Lease>> LeaseTable::Add(std::shared_ptr<Lease> lease,
                                                       absl::Time now) {
  if (leases_.size() >= max_leases_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "lease limit reached: %d leases are active (--max_leases)", leases_.size()));
  }
  do {
    lease->id = absl::Uniform<uint64_t>(absl::IntervalClosed, ids_, 1, UINT64_MAX);
  } while (leases_.contains(lease->id));
  lease->expires = now + lease->ttl;
  by_expiry_.insert({lease->expires, lease->id});
  leases_[lease->id] = lease;
  return lease;
}

std::shared_ptr<Lease> LeaseTable::Find(uint64_t id, absl::Time now) const {
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second->expires <= now) return nullptr;
  return it->second;
}

void LeaseTable::Renew(Lease& lease, absl::Time now) {
  by_expiry_.erase({lease.expires, lease.id});
  lease.expires = now + lease.ttl;
  by_expiry_.insert({lease.expires, lease.id});
}

std::shared_ptr<Lease> LeaseTable::Remove(uint64_t id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return nullptr;
  std::shared_ptr<Lease> lease = std::move(it->second);
  leases_.erase(it);
  by_expiry_.erase({lease->expires, id});
  return lease;
}

std::vector<std::shared_ptr<Lease>> LeaseTable::Expire(absl::Time now) {
  std::vector<std::shared_ptr<Lease>> expired;
  while (!by_expiry_.empty() && by_expiry_.begin()->first <= now) {
    const uint64_t id = by_expiry_.begin()->second;
    by_expiry_.erase(by_expiry_.begin());
    auto it = leases_.find(id);
    expired.push_back(std::move(it->second));
    leases_.erase(it);
  }
  return expired;
}

}  // namespace kvpool
