// Limits the RPC layer enforces on framing (the store enforces its own on content).
#ifndef KVPOOL_SERVICE_SERVICE_OPTIONS_H_
#define KVPOOL_SERVICE_SERVICE_OPTIONS_H_

#include <cstdint>

#include "absl/time/time.h"

namespace kvpool {

struct ServiceOptions {
  // Total request bytes one Put stream may carry (RESOURCE_EXHAUSTED beyond).
  uint64_t max_put_stream_bytes = uint64_t{64} << 30;
  // Put streams open at once: a header arriving on one more gets RESOURCE_EXHAUSTED (each open
  // session keeps its sequence's token ids and pins its blocks).
  uint64_t max_put_streams = 1024;
  // Get streams open at once: one more gets RESOURCE_EXHAUSTED (each keeps a message of up to
  // get_chunk_bytes built while its client reads).
  uint64_t max_get_streams = 256;
  // Upper bound on K+V payload bytes of one GetResponse (a single block may exceed it; so is the
  // message limit below). The default leaves 1 KiB for the message's other fields under gRPC's
  // default 4 MiB receive limit.
  uint32_t get_chunk_bytes = (4u << 20) - 1024;
  // The largest gRPC message (the Server sets it from ServerOptions::max_message_bytes): a Get
  // whose single block would not fit one is refused before anything is read.
  uint64_t max_message_bytes = uint64_t{64} << 20;
  // A Put stream with no message for longer is cancelled by the server's sweep, and its blocks
  // freed; zero = never.
  absl::Duration put_idle_timeout = absl::Minutes(1);
  // A Get stream whose client has taken no message for longer (one written and not yet sent:
  // the client stopped reading) is cancelled by the server's sweep, freeing its slot among
  // max_get_streams; zero = never.
  absl::Duration get_stall_timeout = absl::Minutes(1);
};

}  // namespace kvpool

#endif  // KVPOOL_SERVICE_SERVICE_OPTIONS_H_
