// Links the installed kvpool client and uses each public header (no server needed): a client, a
// TransferClient over it, an in-place AttendSocket session refused for want of a socket, and a
// region step's layout.
#include <cstdio>
#include <cstring>

#include "absl/time/clock.h"
#include "kvpool/attend_socket_session.h"
#include "kvpool/kvpool_client.h"
#include "kvpool/transfer_client.h"
#include "kvpool/v1/attend_region.h"

int main() {
  auto c = kvpool::client::KvPoolClient::Create("127.0.0.1:1", kvpool::client::ClientOptions());
  if (c == nullptr) return 1;
  kvpool::client::BufferCopy copy;
  copy.to_buffer = [](void* dst, const void* src, size_t n) {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  };
  copy.from_buffer = [](void* dst, const void* src, size_t n) {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  };
  kvpool::client::TransferClient transfer(c.get(), copy);
  auto session = kvpool::client::OpenInPlaceAttendSession("/nonexistent/kvpool.sock", 1 << 20,
                                                          absl::Now() + absl::Seconds(1),
                                                          absl::ZeroDuration(), 1 << 20);
  auto layout = kvpool::attend_socket::LayoutRegionStep(2, 1, 512, 256, 512);
  std::printf("client created, in-place session %s, region step of %llu bytes\n",
              session.ok() ? "opened" : "refused",
              static_cast<unsigned long long>(layout ? layout->end : 0));
  return !session.ok() && layout.has_value() ? 0 : 1;
}
