// The NCCL data plane between two processes on two GPUs: the server (KvStore on the CUDA backend,
// KvPool and KvPoolTransport over TCP) runs here on GPU 0; a worker (this binary started again,
// NcclWorker.Main) joins on GPU 1. Checks: an NcclPut stores exactly what the host Put path
// stores, and one the server refuses for a NaN leaves the channel healthy; repeated NcclGets
// (over 4 GiB in all) deliver byte-exact FP16 and RAW payloads (RAW with each layer's sink rows:
// the namespace keeps 4 sink tokens); a worker killed in the middle of a Get neither hangs nor
// crashes the server, which then serves the next worker. Skips with a message on a machine with
// fewer than two GPUs.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/kvpool_client.h"
#include "client/nccl_channel.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "service/kvpool_service.h"
#include "service/metrics/metrics_registry.h"
#include "service/rpc_metrics.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/transport/peer_transport.h"
#include "service/transport/transport_service.h"
#include "tests/gpu/nccl_test_util.h"

namespace kvpool {
namespace {

constexpr uint32_t kTokens = 8192;  // 32 layers: 1 GiB of fp16 K+V, 272 MiB of INT4 pages
constexpr int kFp16Gets = 4;        // 4 GiB of FP16 Gets, plus one RAW Get and the Put
constexpr uint64_t kSeed = 1;
constexpr int kServerDevice = 0;
constexpr int kWorkerDevice = 1;
constexpr char kNs[] = "nccl";

// The shared test namespace with 4 fp16 sink tokens, so that a RAW Get carries sink rows.
NamespaceConfig TestNamespace(const std::string& name, uint64_t capacity_bytes) {
  NamespaceConfig c = nccl_test::TestNamespace(name, capacity_bytes);
  c.sink_tokens = 4;
  return c;
}

// ---- worker process ----------------------------------------------------------------------------

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// The layer segments of a Get, copied to the host and digested: "<format> <layer> <k> <v>", then
// " <sink k> <sink v>" when the layer has sink segments.
std::vector<std::string> SegmentDigests(const char* format, const v1::NcclGetDescriptor& d,
                                        const uint8_t* device_buffer) {
  std::vector<std::string> lines;
  std::vector<uint8_t> host;
  auto digest = [&](uint64_t at, uint64_t bytes) {
    host.resize(bytes);
    EXPECT_EQ(cudaMemcpy(host.data(), device_buffer + at, bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return nccl_test::Digest(host.data(), host.size());
  };
  for (const v1::NcclLayerSegments& s : d.layers()) {
    std::string line = absl::StrCat(format, " ", s.layer(), " ", digest(s.k_offset(), s.bytes()),
                                    " ", digest(s.v_offset(), s.bytes()));
    if (s.sink_bytes() > 0) {
      absl::StrAppend(&line, " ", digest(s.sink_k_offset(), s.sink_bytes()), " ",
                      digest(s.sink_v_offset(), s.sink_bytes()));
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

// Modes (KVPOOL_NCCL_WORKER): "roundtrip" puts the test sequence over NCCL, matches it and gets
// it back kFp16Gets times in FP16 and once RAW, writing "lease <id>" and the digests to
// KVPOOL_NCCL_OUT; "get" gets lease KVPOOL_NCCL_LEASE once in FP16 and writes the digests; "die"
// starts the same Get and is expected to be killed by the test before it ends; "get_fails" makes
// the same Get, expects it to fail, and writes its status code and how long it took in ms.
TEST(NcclWorker, Main) {
  const std::string mode = Env("KVPOOL_NCCL_WORKER");
  if (mode.empty()) GTEST_SKIP() << "runs only as the worker process of the NCCL tests";
  const std::string target = Env("KVPOOL_NCCL_TARGET");
  absl::StatusOr<std::unique_ptr<client::NcclChannel>> channel = client::NcclChannel::Open(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()), kWorkerDevice,
      absl::Seconds(60));
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_EQ(cudaSetDevice(kWorkerDevice), cudaSuccess);
  const NamespaceConfig config = TestNamespace(kNs, 0);
  const uint64_t layer_bytes =
      uint64_t{kTokens} * config.num_kv_heads * config.head_dim * sizeof(uint16_t);
  const uint64_t capacity = 2 * layer_bytes * config.num_layers;
  uint8_t* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, capacity), cudaSuccess);
  std::ofstream out(Env("KVPOOL_NCCL_OUT"));

  uint64_t lease = 0;
  if (mode == "roundtrip") {
    std::vector<uint16_t> k, v;
    nccl_test::FillSequenceKv(kSeed, config, kTokens, &k, &v);
    ASSERT_EQ(cudaMemcpy(buffer, k.data(), capacity / 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(buffer + capacity / 2, v.data(), capacity / 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::vector<int32_t> ids = nccl_test::SequenceTokens(kSeed, kTokens);
    const uint64_t token_bytes = static_cast<uint64_t>(config.num_kv_heads) * config.head_dim * 2;
    absl::StatusOr<v1::PutResponse> put =
        (*channel)->Put(kNs, ids, config.num_layers, buffer, buffer + capacity / 2, token_bytes,
                        absl::Seconds(120));
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->tokens_stored(), kTokens);
    // A Put whose contents the server refuses (a NaN): INVALID_ARGUMENT, and the channel, which
    // the server keeps (it receives every byte first), stays healthy for the transfers below.
    const uint16_t nan = 0x7E00;
    ASSERT_EQ(cudaMemcpy(buffer + 2, &nan, sizeof(nan), cudaMemcpyHostToDevice), cudaSuccess);
    const std::vector<int32_t> refused_ids = nccl_test::SequenceTokens(kSeed + 2, kTokens);
    EXPECT_EQ((*channel)
                  ->Put(kNs, refused_ids, config.num_layers, buffer, buffer + capacity / 2,
                        token_bytes, absl::Seconds(120))
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE((*channel)->healthy());
    std::unique_ptr<client::KvPoolClient> kv = client::KvPoolClient::Create(target);
    absl::StatusOr<v1::MatchResponse> match = kv->Match(kNs, ids, absl::Minutes(10));
    ASSERT_TRUE(match.ok()) << match.status();
    ASSERT_EQ(match->cached_tokens(), kTokens);
    lease = match->lease_id();
    out << "lease " << lease << "\n";
  } else {
    ASSERT_TRUE(absl::SimpleAtoi(Env("KVPOOL_NCCL_LEASE"), &lease));
  }

  v1::NcclGetRequest request;
  request.set_lease_id(lease);
  request.set_format(v1::GET_FORMAT_FP16);
  if (mode == "get_fails" || mode == "get_times_out") {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::NcclGetDescriptor> d = (*channel)->Get(
        request, buffer, capacity, absl::Seconds(mode == "get_times_out" ? 3 : 120));
    out << static_cast<int>(d.status().code()) << " "
        << absl::ToInt64Milliseconds(absl::Now() - start) << "\n";
    return;
  }
  const int fp16_gets = mode == "roundtrip" ? kFp16Gets : 1;
  std::vector<std::string> first;
  for (int i = 0; i < fp16_gets; ++i) {
    absl::StatusOr<v1::NcclGetDescriptor> d =
        (*channel)->Get(request, buffer, capacity, absl::Seconds(mode == "die" ? 20 : 120));
    ASSERT_NE(mode, "die") << "the test should have killed this worker mid-transfer";
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_EQ(d->total_bytes(), capacity);
    std::vector<std::string> lines = SegmentDigests("fp16", *d, buffer);
    if (i == 0) first = lines;
    ASSERT_EQ(lines, first) << "Get " << i << " differs from the first";
  }
  for (const std::string& line : first) out << line << "\n";
  if (mode == "roundtrip") {
    // A timeout that is not positive is refused before anything is sent; the channel is kept.
    EXPECT_EQ((*channel)->Get(request, buffer, capacity, absl::ZeroDuration()).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE((*channel)->healthy());
    // A transfer runs on the channel's GPU and leaves the caller's current device as it was.
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    request.set_format(v1::GET_FORMAT_RAW);
    absl::StatusOr<v1::NcclGetDescriptor> d =
        (*channel)->Get(request, buffer, capacity, absl::Seconds(120));
    int current = -1;
    EXPECT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0);
    ASSERT_EQ(cudaSetDevice(kWorkerDevice), cudaSuccess);
    ASSERT_TRUE(d.ok()) << d.status();
    for (const std::string& line : SegmentDigests("raw", *d, buffer)) out << line << "\n";

    // A channel the server no longer has (closed here by the worker's own CloseChannel): the
    // transfer is UNAVAILABLE and this end is aborted too, so a TransferClient drops it.
    auto stub = v1::KvPoolTransport::NewStub(
        grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext close_ctx;
    v1::CloseChannelRequest close;
    close.set_channel_id((*channel)->channel_id());
    v1::CloseChannelResponse closed;
    ASSERT_TRUE(stub->CloseChannel(&close_ctx, close, &closed).ok());
    request.set_format(v1::GET_FORMAT_FP16);
    EXPECT_EQ((*channel)->Get(request, buffer, capacity, absl::Seconds(30)).status().code(),
              absl::StatusCode::kUnavailable);
    EXPECT_FALSE((*channel)->healthy());

    // A Put whose buffers hold fewer layers than the namespace: refused before any byte is
    // read, and the channel (whose server end waited for the segments) aborted.
    absl::StatusOr<std::unique_ptr<client::NcclChannel>> fresh =
        client::NcclChannel::Open(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()),
                                  kWorkerDevice, absl::Seconds(60));
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    const std::vector<int32_t> other = nccl_test::SequenceTokens(kSeed + 1, kTokens);
    EXPECT_EQ((*fresh)
                  ->Put(kNs, other, config.num_layers - 1, buffer, buffer + capacity / 2,
                        static_cast<uint64_t>(config.num_kv_heads) * config.head_dim * 2,
                        absl::Seconds(30))
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE((*fresh)->healthy());
  }
  out.close();
  cudaFree(buffer);
}

// The one line a "get_fails" or "get_times_out" worker writes: its Get's status code and how long
// the Get took, in ms.
bool ParseFailedGet(const std::vector<std::string>& lines, int* code, int64_t* ms) {
  if (lines.size() != 1) {
    ADD_FAILURE() << "the worker wrote " << lines.size() << " lines";
    return false;
  }
  const std::vector<std::string> fields = absl::StrSplit(lines[0], ' ');
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], code) ||
      !absl::SimpleAtoi(fields[1], ms)) {
    ADD_FAILURE() << "not '<code> <ms>': " << lines[0];
    return false;
  }
  return true;
}

// ---- server side -------------------------------------------------------------------------------

// Lets the test stop one transfer half-way: when armed, the next QueueSend delivers the first half
// of its segments, notifies `paused`, waits for `resume`, then delivers the rest, and records how
// that ended in `outcome` (then notifies `finished`).
struct KillSwitch {
  absl::Mutex mu;
  bool armed ABSL_GUARDED_BY(mu) = false;
  bool fail ABSL_GUARDED_BY(mu) = false;  // the armed send fails after its first half
  absl::Notification paused, resume, finished;
  absl::Status outcome;  // written before `finished`
  absl::Time resumed_at;  // written before `finished`
};

class KillSwitchTransport final : public PeerTransport {
 public:
  KillSwitchTransport(std::unique_ptr<PeerTransport> inner, KillSwitch* kill_switch)
      : inner_(std::move(inner)), switch_(kill_switch) {}

  absl::Status QueueSend(absl::Span<const SendSegment> segments, absl::Time deadline) override {
    bool armed = false;
    bool fail = false;
    {
      absl::MutexLock l(&switch_->mu);
      armed = std::exchange(switch_->armed, false) && segments.size() >= 2;
      fail = switch_->fail;
    }
    if (!armed) return inner_->QueueSend(segments, deadline);
    const size_t half = segments.size() / 2;
    absl::Status s = inner_->Send(segments.subspan(0, half), deadline);
    if (fail) {
      return s.ok() ? absl::InternalError("injected: the server fails mid-transfer") : s;
    }
    switch_->paused.Notify();
    switch_->resume.WaitForNotificationWithTimeout(absl::Minutes(2));
    switch_->resumed_at = absl::Now();
    if (s.ok()) s = inner_->Send(segments.subspan(half), deadline);
    switch_->outcome = s;
    switch_->finished.Notify();
    return s;
  }
  absl::Status WaitSends(size_t pending, absl::Time deadline) override {
    return inner_->WaitSends(pending, deadline);
  }
  absl::Status Recv(absl::Span<const RecvSegment> segments, absl::Time deadline) override {
    return inner_->Recv(segments, deadline);
  }
  void Abort() override { inner_->Abort(); }

 private:
  const std::unique_ptr<PeerTransport> inner_;
  KillSwitch* const switch_;
};

class KillSwitchFactory final : public PeerTransportFactory {
 public:
  KillSwitchFactory(std::unique_ptr<PeerTransportFactory> inner, KillSwitch* kill_switch)
      : inner_(std::move(inner)), switch_(kill_switch) {}
  absl::StatusOr<OpenedTransport> Open(absl::Time join_deadline) override {
    absl::StatusOr<OpenedTransport> opened = inner_->Open(join_deadline);
    if (!opened.ok()) return opened;
    opened->transport =
        std::make_unique<KillSwitchTransport>(std::move(opened->transport), switch_);
    return opened;
  }

 private:
  const std::unique_ptr<PeerTransportFactory> inner_;
  KillSwitch* const switch_;
};

// The system clock an hour behind: the service's deadlines are on it, and the transports must
// keep to the same clock (the wall clock would find every deadline an hour past).
class HourBehindClock final : public Clock {
 public:
  absl::Time Now() const override { return SystemClock()->Now() - absl::Hours(1); }
};

class NcclTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
      GTEST_SKIP() << "needs 2 GPUs (server on GPU 0, worker process on GPU 1); " << count
                   << " visible: skipped";
    }
    absl::StatusOr<std::unique_ptr<ComputeBackend>> backend = NewCudaBackend(kServerDevice);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    KvStore::Options options;
    options.pool_bytes = uint64_t{4} << 30;
    options.backend = backend_.get();
    absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Create(options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    for (const char* name : {kNs, "ref"}) {
      ASSERT_TRUE(store_->CreateNamespace(TestNamespace(name, uint64_t{3} << 29)).ok());
    }
    rpc_metrics_ = std::make_unique<RpcMetrics>(&registry_);
    service_ = std::make_unique<KvPoolService>(store_.get(), rpc_metrics_.get(), ServiceOptions{});
    absl::StatusOr<std::unique_ptr<PeerTransportFactory>> nccl =
        NewNcclTransportFactory(kServerDevice, &clock_);
    ASSERT_TRUE(nccl.ok()) << nccl.status();
    factory_ = std::make_unique<KillSwitchFactory>(*std::move(nccl), &kill_switch_);
    transport_ =
        std::make_unique<KvPoolTransportService>(store_.get(), backend_.get(), factory_.get(),
                                                 &clock_, rpc_metrics_.get(), TransportOptions{});
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(service_.get());
    builder.RegisterService(transport_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    if (!kill_switch_.resume.HasBeenNotified()) kill_switch_.resume.Notify();
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }

  // Runs a worker in `mode` to its end; returns the lines it wrote.
  std::vector<std::string> RunWorker(const std::string& mode, uint64_t lease, int want_exit) {
    const std::string out = absl::StrCat(::testing::TempDir(), "nccl_worker_", mode, ".txt");
    auto worker = StartWorker(mode, lease, out);
    if (worker == nullptr) return {};
    absl::StatusOr<int> code = worker->Wait(absl::Minutes(5));
    EXPECT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(code.value_or(-1), want_exit) << "worker " << mode;
    std::vector<std::string> lines;
    std::ifstream in(out);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }
  std::unique_ptr<nccl_test::WorkerProcess> StartWorker(const std::string& mode, uint64_t lease,
                                                        const std::string& out) {
    auto worker = nccl_test::WorkerProcess::Spawn(
        {"--gtest_filter=NcclWorker.Main"},
        {absl::StrCat("KVPOOL_NCCL_WORKER=", mode),
         absl::StrCat("KVPOOL_NCCL_TARGET=127.0.0.1:", port_),
         absl::StrCat("KVPOOL_NCCL_LEASE=", lease), absl::StrCat("KVPOOL_NCCL_OUT=", out)});
    EXPECT_TRUE(worker.ok()) << worker.status();
    return worker.ok() ? *std::move(worker) : nullptr;
  }

  // The digest lines a worker must report for `lease`, from the store's own host-path reads.
  std::vector<std::string> ExpectedDigests(const char* format, uint64_t lease) {
    const NamespaceConfig config = TestNamespace(kNs, 0);
    const uint32_t blocks = kTokens / config.block_tokens;
    const bool raw = std::string(format) == "raw";
    std::vector<std::string> lines;
    for (int layer = 0; layer < config.num_layers; ++layer) {
      const size_t bytes = raw ? size_t{blocks} * config.num_kv_heads *
                                     LayerLayout(config, layer).head_page_bytes()
                               : size_t{kTokens} * config.num_kv_heads * config.head_dim * 2;
      std::vector<uint8_t> k(bytes), v(bytes);
      const absl::Status s =
          raw ? store_->ReadRaw(lease, layer, 0, blocks, 0, config.num_kv_heads, k.data(),
                                v.data())
              : store_->ReadFp16(lease, layer, 0, blocks, 0, config.num_kv_heads,
                                 reinterpret_cast<uint16_t*>(k.data()),
                                 reinterpret_cast<uint16_t*>(v.data()));
      EXPECT_TRUE(s.ok()) << s;
      lines.push_back(absl::StrCat(format, " ", layer, " ", nccl_test::Digest(k.data(), bytes),
                                   " ", nccl_test::Digest(v.data(), bytes)));
      if (raw) {  // the first block's sink rows, as the RAW NcclGet sends them after V
        const size_t sink_bytes = size_t{static_cast<uint32_t>(config.sink_tokens)} *
                                  config.num_kv_heads * config.head_dim * sizeof(uint16_t);
        std::vector<uint8_t> sink_k(sink_bytes), sink_v(sink_bytes);
        EXPECT_TRUE(
            store_->ReadRawSinks(lease, layer, 0, config.num_kv_heads, sink_k.data(), sink_v.data())
                .ok());
        absl::StrAppend(&lines.back(), " ", nccl_test::Digest(sink_k.data(), sink_bytes), " ",
                        nccl_test::Digest(sink_v.data(), sink_bytes));
      }
    }
    return lines;
  }

  // Puts the test sequence into namespace `ns` through the host path and matches it.
  uint64_t HostPut(const char* ns) {
    const NamespaceConfig config = TestNamespace(ns, 0);
    std::vector<uint16_t> k, v;
    nccl_test::FillSequenceKv(kSeed, config, kTokens, &k, &v);
    const std::vector<int32_t> ids = nccl_test::SequenceTokens(kSeed, kTokens);
    auto put = store_->BeginPut(ns, ids);
    EXPECT_TRUE(put.ok()) << put.status();
    if (!put.ok()) return 0;
    const size_t layer = size_t{kTokens} * config.num_kv_heads * config.head_dim;
    for (int l = 0; l < config.num_layers; ++l) {
      EXPECT_TRUE((*put)->AddChunk(l, 0, kTokens, k.data() + l * layer, v.data() + l * layer).ok());
    }
    EXPECT_TRUE((*put)->Commit().ok());
    auto match = store_->Match(ns, ids, absl::Minutes(10));
    EXPECT_TRUE(match.ok()) << match.status();
    return match.ok() ? match->lease_id : 0;
  }

  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<KvStore> store_;
  metrics::Registry registry_;
  std::unique_ptr<RpcMetrics> rpc_metrics_;
  std::unique_ptr<KvPoolService> service_;
  HourBehindClock clock_;
  KillSwitch kill_switch_;
  std::unique_ptr<PeerTransportFactory> factory_;
  std::unique_ptr<KvPoolTransportService> transport_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(NcclTransferTest, PutAndOverFourGiBOfGetsAreByteExactAcrossProcesses) {
  const std::vector<std::string> lines = RunWorker("roundtrip", 0, 0);
  ASSERT_FALSE(lines.empty());
  uint64_t lease = 0;
  ASSERT_EQ(lines[0].rfind("lease ", 0), 0u);
  ASSERT_TRUE(absl::SimpleAtoi(lines[0].substr(6), &lease));
  std::vector<std::string> want = ExpectedDigests("fp16", lease);
  const std::vector<std::string> raw = ExpectedDigests("raw", lease);
  want.insert(want.end(), raw.begin(), raw.end());
  EXPECT_EQ(std::vector<std::string>(lines.begin() + 1, lines.end()), want);

  // The NCCL Put quantized exactly what the host Put path quantizes from the same data.
  const uint64_t ref = HostPut("ref");
  ASSERT_NE(ref, 0u);
  EXPECT_EQ(ExpectedDigests("raw", ref), raw);  // the same sink rows (and pages, checked below)
  const NamespaceConfig config = TestNamespace(kNs, 0);
  const uint32_t blocks = kTokens / config.block_tokens;
  for (int layer = 0; layer < config.num_layers; ++layer) {
    const size_t bytes =
        size_t{blocks} * config.num_kv_heads * LayerLayout(config, layer).head_page_bytes();
    std::vector<uint8_t> k(bytes), v(bytes), rk(bytes), rv(bytes);
    ASSERT_TRUE(store_->ReadRaw(lease, layer, 0, blocks, 0, config.num_kv_heads, k.data(),
                                v.data()).ok());
    ASSERT_TRUE(store_->ReadRaw(ref, layer, 0, blocks, 0, config.num_kv_heads, rk.data(),
                                rv.data()).ok());
    ASSERT_EQ(k, rk) << "layer " << layer;
    ASSERT_EQ(v, rv) << "layer " << layer;
  }
  EXPECT_EQ(transport_->channels().size(), 0u);  // the worker closed its channel on exit
}

TEST_F(NcclTransferTest, WorkerKilledMidGetNeitherHangsNorCrashesTheServer) {
  const uint64_t lease = HostPut(kNs);
  ASSERT_NE(lease, 0u);
  {
    absl::MutexLock l(&kill_switch_.mu);
    kill_switch_.armed = true;
  }
  const std::string out = absl::StrCat(::testing::TempDir(), "nccl_worker_die.txt");
  std::unique_ptr<nccl_test::WorkerProcess> worker = StartWorker("die", lease, out);
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(kill_switch_.paused.WaitForNotificationWithTimeout(absl::Minutes(3)))
      << "the worker never started its Get";
  worker->Kill();
  absl::StatusOr<int> code = worker->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL);
  kill_switch_.resume.Notify();

  // The rest of the send fails (peer gone, call cancelled, or the worker's 20 s deadline) and
  // the server forgets the channel.
  ASSERT_TRUE(kill_switch_.finished.WaitForNotificationWithTimeout(absl::Seconds(60)))
      << "the server's send is still blocked on the dead worker";
  EXPECT_FALSE(kill_switch_.outcome.ok());
  EXPECT_LE(absl::Now() - kill_switch_.resumed_at, absl::Seconds(40));

  // The next worker is served, byte-exact, and nothing leaked.
  const std::vector<std::string> lines = RunWorker("get", lease, 0);
  EXPECT_EQ(lines, ExpectedDigests("fp16", lease));
  EXPECT_EQ(transport_->channels().size(), 0u);
  EXPECT_LE(transport_->transfers().staging_buffers(), TransportOptions{}.max_idle_staging);
  EXPECT_EQ(store_->Stats().active_leases, 1u);
  EXPECT_TRUE(store_->Release(lease).ok());
}

// The server fails a Get after half its sends (and aborts its communicator): the worker, whose
// receives would otherwise wait for the rest until its 120 s deadline, sees the call's error and
// returns it at once.
TEST_F(NcclTransferTest, ServerFailingMidGetEndsTheWorkersGetAtOnce) {
  const uint64_t lease = HostPut(kNs);
  ASSERT_NE(lease, 0u);
  {
    absl::MutexLock l(&kill_switch_.mu);
    kill_switch_.armed = true;
    kill_switch_.fail = true;
  }
  const std::vector<std::string> lines = RunWorker("get_fails", lease, 0);
  int code = 0;
  int64_t ms = 0;
  ASSERT_TRUE(ParseFailedGet(lines, &code, &ms));
  EXPECT_EQ(code, static_cast<int>(absl::StatusCode::kInternal)) << "the server's status";
  EXPECT_LT(ms, 10000) << "the worker waited for its deadline";
  EXPECT_EQ(transport_->channels().size(), 0u);
  EXPECT_TRUE(store_->Release(lease).ok());
}

// The server stalls a Get after half its sends: the worker's data phase ends at its own timeout
// with DEADLINE_EXCEEDED (its status, not the CANCELLED of the call it then cancels), and the
// server's stalled send fails once resumed.
TEST_F(NcclTransferTest, StalledGetEndsAtTheWorkersTimeoutAsDeadlineExceeded) {
  const uint64_t lease = HostPut(kNs);
  ASSERT_NE(lease, 0u);
  {
    absl::MutexLock l(&kill_switch_.mu);
    kill_switch_.armed = true;
  }
  const std::vector<std::string> lines = RunWorker("get_times_out", lease, 0);
  kill_switch_.resume.Notify();
  int code = 0;
  int64_t ms = 0;
  ASSERT_TRUE(ParseFailedGet(lines, &code, &ms));
  EXPECT_EQ(code, static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_GE(ms, 3000);
  EXPECT_LT(ms, 10000);
  ASSERT_TRUE(kill_switch_.finished.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_FALSE(kill_switch_.outcome.ok());
  EXPECT_TRUE(store_->Release(lease).ok());
}

}  // namespace
}  // namespace kvpool
