// Shared-memory steps of the AttendSocket (attend_socket.h) for clients on the server's host.
//
// Over a Unix socket, the client sends an attach frame (kAttach) with the region size it wants;
// the server creates the region (a memfd whose size is sealed, so no mapping of it can ever fault),
// pins it for direct device copies, and answers with a region frame (kRegion) that passes its
// descriptor; the client maps it. From then on a step is a region request frame (kRegionRequest):
// an AttendRequest whose items leave q, new_k and new_v empty and set append_in_region for a
// token to append, and carry the per-item sizes the client laid out (region_q_bytes,
// region_kv_bytes), while the bytes sit in the region at the offsets of RegionStepLayout; the
// response frame is an AttendResponse whose `out` is empty, the output being in the region. A
// session attaches at most once; its region lives until the session ends.
#ifndef KVPOOL_PROTO_KVPOOL_V1_ATTEND_REGION_H_
#define KVPOOL_PROTO_KVPOOL_V1_ATTEND_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/v1/attend_socket.h"

namespace kvpool::attend_socket {

// Byte offsets of one region step's arrays, each starting on a 64-byte boundary:
//   q      [items][num_q_heads][head_dim] fp16, item order
//   new_k  [appending items][num_kv_heads][head_dim] fp16, in item order
//   new_v  the same for V
//   out    [items][num_q_heads][head_dim] in the request's output dtype
struct RegionStepLayout {
  uint64_t q = 0, new_k = 0, new_v = 0, out = 0;
  uint64_t end = 0;  // bytes the step needs
  // Per item: the bytes of its q and of an appending item's new_k (and new_v), which a region
  // request carries as region_q_bytes and region_kv_bytes.
  uint64_t q_bytes = 0, kv_bytes = 0;
};
// The layout for `items` items of which `appending` append, with q_bytes and kv_bytes per item
// and out_bytes of output per item; nullopt when it does not fit in 64 bits.
std::optional<RegionStepLayout> LayoutRegionStep(uint64_t items, uint64_t appending,
                                                 uint64_t q_bytes, uint64_t kv_bytes,
                                                 uint64_t out_bytes);

// The payload of kAttach and kRegion frames: a region size.
std::string EncodeRegionSize(uint64_t bytes);
std::optional<uint64_t> DecodeRegionSize(const std::string& payload);

// A mapped shared-memory region; unmapped and its descriptor closed on destruction.
class SharedRegion {
 public:
  // Server: a new region of `bytes` (> 0), shrinking, growing and further sealing forbidden.
  // Its destruction frees the pages, so a peer that keeps the descriptor holds no memory (its
  // mapping then reads zeros).
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(uint64_t bytes);
  // Client: maps the region of descriptor `fd` (owned from now on, closed on any error), which
  // must be sealed against shrinking and hold `bytes`.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Map(int fd, uint64_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  SharedRegion(int fd, uint8_t* data, uint64_t size, bool created)
      : fd_(fd), data_(data), size_(size), created_(created) {}
  const int fd_;
  uint8_t* const data_;
  const uint64_t size_;
  const bool created_;  // by Create
};

// Client: sends an attach frame for `bytes` on `conn` (a Unix socket) and maps the region of
// the answer; the status of a status frame answer.
absl::StatusOr<std::unique_ptr<SharedRegion>> AttachRegion(FrameConnection& conn, uint64_t bytes,
                                                           absl::Time deadline);

}  // namespace kvpool::attend_socket

#endif  // KVPOOL_PROTO_KVPOOL_V1_ATTEND_REGION_H_
