// One Attend step: framing checks, the store call and the response encoding, on buffers that are
// reused from one call to the next so that a decode loop on one stream allocates nothing per
// step once the batch shape is stable.
#ifndef KVPOOL_SERVICE_ATTEND_RUNNER_H_
#define KVPOOL_SERVICE_ATTEND_RUNNER_H_

#include <atomic>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvpool/v1/attend_region.h"
#include "kvpool/v1/kvpool.pb.h"
#include "service/store/kv_store.h"

namespace kvpool {

// Not thread-safe: one runner per stream (or per unary call).
class AttendRunner {
 public:
  // `draining`, when not null, is read into every response's server_draining.
  explicit AttendRunner(KvStore* store, const std::atomic<bool>* draining = nullptr)
      : store_(store), draining_(draining) {}

  // Parses `request` from its wire bytes. Its items are counted on the wire first, so that a
  // request of more than the store's --max_attend_batch is refused (RESOURCE_EXHAUSTED) before
  // any is built: an empty item takes 2 bytes there and about 50 times that parsed. Bytes that
  // are not an AttendRequest get INVALID_ARGUMENT, and so do requests holding a group or over
  // 1024 unknown fields (each one kept by the parse, at 2 bytes on the wire).
  absl::Status Parse(std::string_view wire, v1::AttendRequest* request) const;
  absl::Status Parse(grpc::ByteBuffer* wire, v1::AttendRequest* request) const;
  // Runs `request` and fills `response` (cleared first; its fields' capacity is reused): the
  // store writes the output, in the requested dtype, straight into the response's fields.
  absl::Status Run(const v1::AttendRequest& request, v1::AttendResponse* response);
  // Runs an AttendSocket region request (kvpool/v1/attend_region.h): q, new_k and new_v are read
  // from `region`, and the output is written there, not into the response.
  absl::Status RunInRegion(const v1::AttendRequest& request,
                           const attend_socket::SharedRegion& region, v1::AttendResponse* response);

 private:
  // Parse over two streams of the same bytes: one counts the items and unknown fields, one parses
  // them.
  absl::Status ParseFrom(google::protobuf::io::ZeroCopyInputStream* count,
                         google::protobuf::io::ZeroCopyInputStream* parse,
                         v1::AttendRequest* request) const;
  absl::Status Step(const v1::AttendRequest& request, const attend_socket::SharedRegion* region,
                    v1::AttendResponse* response);
  // Geometry of the namespace of the last first-item lease seen, so that a stream describes
  // its lease once rather than every step.
  absl::Status ResolveGeometry(uint64_t lease_id);

  KvStore* const store_;
  const std::atomic<bool>* const draining_;
  uint64_t geometry_lease_ = 0;
  bool geometry_valid_ = false;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  std::vector<KvStore::AttendItem> items_;
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_ATTEND_RUNNER_H_
