// Raw AttendSocket connections and frame headers, for tests that send what the client library
// never does: broken headers, frames cut short, payloads over the limit. Header-only.
#ifndef KVPOOL_TESTS_INTEGRATION_ATTEND_SOCKET_RAW_H_
#define KVPOOL_TESTS_INTEGRATION_ATTEND_SOCKET_RAW_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kvpool/v1/attend_socket.h"

namespace kvpool::testing {

// A connected socket to the AttendSocket's TCP listener on loopback `port`, or with `unix_path`
// set to its Unix listener there; -1 on failure.
inline int RawConnect(int port, const std::string& unix_path = "") {
  const bool is_unix = !unix_path.empty();
  const int fd = socket(is_unix ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int rc;
  if (is_unix) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, unix_path.c_str(), sizeof(a.sun_path) - 1);
    rc = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A frame header as kvpool/v1/attend_socket.h lays it out, any field possibly wrong
// (little-endian hosts only, as the format).
inline std::string RawFrameHeader(uint32_t magic, uint16_t type, uint16_t code, uint32_t length,
                                  uint32_t reserved = 0) {
  std::string h(attend_socket::kHeaderBytes, '\0');
  std::memcpy(h.data(), &magic, 4);
  std::memcpy(h.data() + 4, &type, 2);
  std::memcpy(h.data() + 6, &code, 2);
  std::memcpy(h.data() + 8, &length, 4);
  std::memcpy(h.data() + 12, &reserved, 4);
  return h;
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_INTEGRATION_ATTEND_SOCKET_RAW_H_
