#include "kvpool/v1/attend_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvpool::attend_socket {
namespace {

constexpr uint64_t kAlign = 64;

// *offset = align(*offset), the array's start, then *offset += count * each; false on overflow.
bool Place(uint64_t count, uint64_t each, uint64_t* offset, uint64_t* start) {
  uint64_t bytes;
  if (*offset > UINT64_MAX - (kAlign - 1)) return false;
  *start = (*offset + kAlign - 1) / kAlign * kAlign;
  return !__builtin_mul_overflow(count, each, &bytes) &&
         !__builtin_add_overflow(*start, bytes, offset);
}

absl::Status Errno(const char* what) {
  return absl::InternalError(
      absl::StrCat("AttendSocket region ", what, ": ", std::strerror(errno)));
}

// Maps `bytes` of `fd` shared and read-write; closes `fd` when it fails.
absl::StatusOr<uint8_t*> MapShared(int fd, uint64_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data != MAP_FAILED) return static_cast<uint8_t*>(data);
  const absl::Status s = Errno("mmap");
  close(fd);
  return s;
}

}  // namespace

std::optional<RegionStepLayout> LayoutRegionStep(uint64_t items, uint64_t appending,
                                                 uint64_t q_bytes, uint64_t kv_bytes,
                                                 uint64_t out_bytes) {
  RegionStepLayout l;
  uint64_t offset = 0;
  if (!Place(items, q_bytes, &offset, &l.q) || !Place(appending, kv_bytes, &offset, &l.new_k) ||
      !Place(appending, kv_bytes, &offset, &l.new_v) || !Place(items, out_bytes, &offset, &l.out)) {
    return std::nullopt;
  }
  l.end = offset;
  l.q_bytes = q_bytes;
  l.kv_bytes = kv_bytes;
  return l;
}

std::string EncodeRegionSize(uint64_t bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(bytes >> (8 * i));
  return out;
}

std::optional<uint64_t> DecodeRegionSize(const std::string& payload) {
  if (payload.size() != 8) return std::nullopt;
  uint64_t bytes = 0;
  for (int i = 0; i < 8; ++i)
    bytes |= static_cast<uint64_t>(static_cast<uint8_t>(payload[i])) << (8 * i);
  return bytes;
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(uint64_t bytes) {
  if (bytes == 0 || bytes > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError("AttendSocket region size out of range");
  }
  const int fd = memfd_create("kvpool-attend-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const absl::Status s = Errno("size");
    close(fd);
    return s;
  }
  absl::StatusOr<uint8_t*> data = MapShared(fd, bytes);
  if (!data.ok()) return data.status();
  return std::unique_ptr<SharedRegion>(new SharedRegion(fd, *data, bytes, /*created=*/true));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Map(int fd, uint64_t bytes) {
  if (fd < 0) return absl::InternalError("AttendSocket region frame without a descriptor");
  struct stat st;
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || seals < 0 || (seals & F_SEAL_SHRINK) == 0 || bytes == 0 ||
      static_cast<uint64_t>(st.st_size) != bytes) {
    close(fd);
    return absl::InternalError("AttendSocket region is not a sealed memfd of the announced size");
  }
  absl::StatusOr<uint8_t*> data = MapShared(fd, bytes);
  if (!data.ok()) return data.status();
  return std::unique_ptr<SharedRegion>(new SharedRegion(fd, *data, bytes, /*created=*/false));
}

SharedRegion::~SharedRegion() {
  munmap(data_, size_);
  // The seals allow it; best effort (a failure leaves the pages to the last descriptor's close).
  if (created_) fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size_);
  close(fd_);
}

absl::StatusOr<std::unique_ptr<SharedRegion>> AttachRegion(FrameConnection& conn, uint64_t bytes,
                                                           absl::Time deadline) {
  const std::string size = EncodeRegionSize(bytes);
  if (absl::Status s = conn.WriteBytes(FrameType::kAttach, size, -1, deadline); !s.ok()) return s;
  std::string payload;
  absl::StatusOr<FrameConnection::Frame> frame =
      conn.Read(&payload, 1 << 20, deadline, absl::ZeroDuration());
  if (!frame.ok()) return frame.status();
  if (frame->type == FrameType::kStatus) return StatusFromFrame(frame->code, payload);
  if (frame->type != FrameType::kRegion || payload != size) {
    return absl::InternalError("AttendSocket: the server's answer to an attach is not its region");
  }
  return SharedRegion::Map(conn.TakeReceivedFd(), bytes);
}

}  // namespace kvpool::attend_socket
