// NCCL transfers under failures and limits of their staging memory, with the transport faked on
// the CPU (transport_test_util.h): a first read that fails, a device free that waits, a staging
// total that is reached (before a Put evicts anything).
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvpool/v1/kvpool.pb.h"
#include "tests/service/transport_test_util.h"

namespace kvpool::testing {
namespace {

// The CPU backend, with reads into an arena that fail on request: all of them, or those from
// the fail_from-th on (0-based).
class FailingGathers final : public ForwardingBackend {
 public:
  absl::Status GatherArena(absl::Span<const ArenaRun> runs, uint8_t* dst) override {
    if (fail || (fail_from >= 0 && reads++ >= fail_from)) return absl::InternalError("read failed");
    return ForwardingBackend::GatherArena(runs, dst);
  }
  bool fail = false;
  int fail_from = -1;
  int reads = 0;
};

// A Get whose first read fails (the backend's here; in service also a lease released between
// the descriptor and the read) answers its status before the descriptor, so the worker waits for
// nothing and the channel stays usable. Run with one round and with rounds of one layer.
TEST_F(TransportProtocolTest, GetWhoseFirstReadFailsKeepsTheChannel) {
  for (uint64_t staging : {uint64_t{64} << 20, uint64_t{1}}) {
    store_.reset();  // before the backend it uses
    auto backend = std::make_unique<FailingGathers>();
    FailingGathers* failing = backend.get();
    backend_ = std::move(backend);
    MakeStore(32);
    StartWithStaging(staging);
    const uint64_t lease = PutAndMatch(8, 4);
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    v1::NcclGetRequest req = NcclGetOf(lease, v1::GET_FORMAT_RAW);
    v1::NcclGetDescriptor header;
    std::vector<uint8_t> buf;
    failing->fail = true;
    EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kInternal);
    EXPECT_EQ(service_->channels().size(), 1u);
    failing->fail = false;
    const absl::Status again = w.Get(req, &header, &buf);
    EXPECT_TRUE(again.ok()) << again;
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
}

// RAW K (or V) bytes of each layer of a Get of `lease`, all heads.
std::vector<uint64_t> RawLayerBytes(KvStore& store, const NamespaceConfig& config,
                                    uint64_t lease) {
  const uint32_t blocks = store.DescribeLease(lease)->num_blocks;
  std::vector<uint64_t> bytes;
  for (int l = 0; l < config.num_layers; ++l) {
    bytes.push_back(uint64_t{blocks} * config.num_kv_heads *
                    LayerLayout(config, l).head_page_bytes());
  }
  return bytes;
}

// A Get whose second round's read fails once the worker waits for data breaks the channel, and
// its two staging buffers (of --nccl_staging_bytes, kept for reuse after a Get that succeeds)
// are freed, not kept: sends queued before the failure may still read them.
TEST_F(TransportProtocolTest, GetWhoseLaterReadFailsFreesItsStaging) {
  store_.reset();
  auto backend = std::make_unique<FailingGathers>();
  FailingGathers* failing = backend.get();
  backend_ = std::move(backend);
  MakeStore(32);
  const uint64_t lease = PutAndMatch(13, 4);
  const std::vector<uint64_t> layer = RawLayerBytes(*store_, config_, lease);
  ASSERT_EQ(layer.size(), 2u);
  ASSERT_LT(layer[0], layer[1]);
  // A buffer holds layer 1's K and V; the first round takes layer 0 alone, the second layer 1.
  StartWithStaging(2 * layer[1]);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  v1::NcclGetRequest req = NcclGetOf(lease, v1::GET_FORMAT_RAW);
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  ASSERT_TRUE(w.Get(req, &header, &buf).ok());
  EXPECT_EQ(service_->transfers().staging_buffers(), 2u) << "kept for reuse";
  failing->fail_from = failing->reads + 1;
  EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(service_->channels().size(), 0u);
  EXPECT_TRUE(StagingFreed());
}

// A Get in two rounds whose payload fits one staging buffer takes one buffer, its rounds side
// by side, and gives the bytes of a Get in one round.
TEST_F(TransportProtocolTest, GetThatFitsOneBufferTakesOneInTwoRounds) {
  MakeStore(32);
  const uint64_t lease = PutAndMatch(13, 6);
  const std::vector<uint64_t> layer = RawLayerBytes(*store_, config_, lease);
  std::vector<uint8_t> bufs[2];
  v1::NcclGetDescriptor headers[2];
  // One round; then the first round layer 0 alone (it needs more than an eighth of the buffer),
  // the second layer 1.
  for (int run = 0; run < 2; ++run) {
    StartWithStaging(run == 0 ? uint64_t{64} << 20 : 2 * (layer[0] + layer[1]));
    TestWorker w(stub_.get(), &network_);
    ASSERT_TRUE(w.Open().ok());
    ASSERT_TRUE(w.Get(NcclGetOf(lease, v1::GET_FORMAT_RAW), &headers[run], &bufs[run]).ok());
    EXPECT_EQ(service_->transfers().staging_buffers(), 1u);
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }
  EXPECT_EQ(headers[0].SerializeAsString(), headers[1].SerializeAsString());
  EXPECT_EQ(bufs[0], bufs[1]);
}

// The CPU backend, whose arena frees wait while `hold` is set, as a device free waits for a
// kernel of another channel's transfer stalled on its worker.
class HeldFrees final : public ForwardingBackend {
 public:
  void FreeArena(uint8_t* arena) override {
    absl::MutexLock l(&mu);
    mu.Await(absl::Condition(
        +[](bool* held) { return !*held; }, &hold));
    inner().FreeArena(arena);
  }
  absl::Mutex mu;
  bool hold ABSL_GUARDED_BY(mu) = false;
};

// A transfer ends without freeing its staging buffers itself: with staging of 1 byte every buffer
// is one of its own size, freed once the transfer is done, and a free that waits holds up no
// transfer.
TEST_F(TransportProtocolTest, TransfersDoNotWaitForStagingFrees) {
  auto backend = std::make_unique<HeldFrees>();
  HeldFrees* held = backend.get();
  backend_ = std::move(backend);
  MakeStore(32);
  StartWithStaging(1);
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  {
    absl::MutexLock l(&held->mu);
    held->hold = true;
  }
  const std::vector<int32_t> ids = TokenIds(12, 5);
  const SequenceKv kv = MakeSequenceKv(config_, 12, 8);
  absl::Notification put_done;
  absl::StatusOr<v1::PutResponse> put;
  std::thread worker([&] {
    put = w.Put(ids, kv, PerToken());
    put_done.Notify();
  });
  const bool in_time = put_done.WaitForNotificationWithTimeout(absl::Seconds(20));
  {
    absl::MutexLock l(&held->mu);
    held->hold = false;
  }
  worker.join();
  EXPECT_TRUE(in_time) << "the Put waited for its staging buffers' frees";
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens_stored(), 12u);
  EXPECT_TRUE(Counted("NcclPut", "OK", 1));
  EXPECT_TRUE(StagingFreed());
}

// Staging buffers take at most max_staging_total_bytes together: a transfer past it gets
// RESOURCE_EXHAUSTED before anything moves, and the channel and the pool stay as they were.
TEST_F(TransportProtocolTest, TransfersPastTheStagingTotalAreRefused) {
  MakeStore(32);
  TransportOptions options;
  options.staging_bytes = 1;  // every buffer one of its own size, past the total
  options.max_staging_total_bytes = 1;
  StartService(options);
  const uint64_t lease = PutAndMatch(8, 4);
  const uint64_t in_use = BlocksInUse();
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  v1::NcclGetRequest req = NcclGetOf(lease);
  v1::NcclGetDescriptor header;
  std::vector<uint8_t> buf;
  EXPECT_EQ(w.Get(req, &header, &buf).code(), absl::StatusCode::kResourceExhausted);
  const std::vector<int32_t> ids = TokenIds(12, 900);
  EXPECT_EQ(w.Put(ids, MakeSequenceKv(config_, 12, 5), PerToken()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(service_->channels().size(), 1u);
  EXPECT_EQ(BlocksInUse(), in_use);
  EXPECT_EQ(service_->transfers().staging_buffers(), 0u);
}

// An NcclPut takes its staging before it allocates blocks: one refused its staging evicts
// nothing, even from a pool whose every block is cached and unpinned.
TEST_F(TransportProtocolTest, PutRefusedItsStagingEvictsNothing) {
  MakeStore(4);
  TransportOptions options;
  options.staging_bytes = 1;
  options.max_staging_total_bytes = 1;
  StartService(options);
  const std::vector<int32_t> cached = TokenIds(16, 5);
  ASSERT_TRUE(Put(cached, MakeSequenceKv(config_, 16, 3)).ok());
  TestWorker w(stub_.get(), &network_);
  ASSERT_TRUE(w.Open().ok());
  EXPECT_EQ(w.Put(TokenIds(8, 900), MakeSequenceKv(config_, 8, 4), PerToken()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Stats().namespaces[0].evictions, 0u);
  auto match = store_->Match("main", cached, absl::ZeroDuration());
  ASSERT_TRUE(match.ok()) << match.status();
  EXPECT_EQ(match->cached_tokens, 16u);
  EXPECT_EQ(service_->transfers().staging_buffers(), 0u);
}

}  // namespace
}  // namespace kvpool::testing
