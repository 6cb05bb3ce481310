// A server with cached prompts under leases and the Attend requests to run over them, shared by
// the AttendStream and AttendSocket tests. Header-only.
#ifndef KVPOOL_TESTS_INTEGRATION_ATTEND_FIXTURE_H_
#define KVPOOL_TESTS_INTEGRATION_ATTEND_FIXTURE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "client/kvpool_client.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {

inline constexpr int kAttendQHeads = 4;
inline constexpr int kAttendPromptTokens = 48;  // whole blocks: all of it is cached

// The wire bytes of an AttendRequest of `items` items (field 4), the first of which does not
// parse (a field 1 tag without its value) and the rest empty (2 bytes each): a server that
// counts the items before it parses answers RESOURCE_EXHAUSTED past --max_attend_batch, one that
// parses first INVALID_ARGUMENT.
inline std::string UnparsedItemsBytes(size_t items) {
  std::string wire = "\x22\x01\x08";
  wire.reserve(2 * items + 1);
  for (size_t i = 1; i < items; ++i) wire.append("\x22\x00", 2);
  return wire;
}

struct AttendFixture {
  std::unique_ptr<TestServer> server;
  std::unique_ptr<client::KvPoolClient> client;  // over the in-process channel
  std::vector<uint64_t> leases;                  // one cached sequence each
  NamespaceConfig config;
};

// A server (options changed by `tweak`) with `sequences` cached prompts, each under its own
// lease.
inline AttendFixture StartAttendFixture(int sequences,
                                        std::function<void(ServerOptions*)> tweak = {}) {
  AttendFixture f;
  f.config = SmallNamespace("small", 4 << 20);
  f.server = TestServer::Start({f.config}, std::move(tweak));
  if (f.server == nullptr) return f;
  f.client = client::KvPoolClient::Create(f.server->server->InProcessChannel());
  const int per_token = f.config.num_kv_heads * f.config.head_dim;
  for (int i = 0; i < sequences; ++i) {
    const Sequence s = MakeSequence(f.config, kAttendPromptTokens, 1000 * (i + 1), 50 + i);
    v1::PutResponse put;
    EXPECT_TRUE(PutSequence(f.server->stub.get(), "small", s, per_token, 16, &put).ok());
    absl::StatusOr<v1::MatchResponse> m = f.client->Match("small", s.tokens);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) f.leases.push_back(m->lease_id());
  }
  return f;
}

// One item on `lease` with a fresh query (no append): the layer and q follow from `seed`.
inline v1::AttendRequest AttendRequestFor(const AttendFixture& f, uint64_t lease, uint64_t seed) {
  const std::vector<uint16_t> q = ToHalf(MakeNormal(kAttendQHeads * f.config.head_dim, seed));
  v1::AttendRequest req;
  req.set_layer(static_cast<uint32_t>(seed % f.config.num_layers));
  req.set_num_q_heads(kAttendQHeads);
  req.set_output_dtype(v1::OUTPUT_DTYPE_FP32);
  v1::AttendItem* item = req.add_items();
  item->set_lease_id(lease);
  item->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
  item->set_new_token_id(-1);
  return req;
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_INTEGRATION_ATTEND_FIXTURE_H_
