// The real kvpool-server binary: starts on free ports, answers health, Put/Match/Get and a
// /metrics scrape over the network, and exits 0 on SIGTERM.
//
// The binary is $KVPOOL_SERVER_BIN, or kvpool-server next to this test's executable.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/attend_socket_session.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/store/namespace_config.h"
#include "tests/integration/test_server.h"

extern char** environ;

namespace kvpool::testing {
namespace {

std::string ServerBinary() {
  if (const char* env = std::getenv("KVPOOL_SERVER_BIN")) return env;
  std::string self(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", self.data(), self.size());
  self.resize(n > 0 ? n : 0);
  return self.substr(0, self.rfind('/') + 1) + "kvpool-server";
}

// A child kvpool-server whose stderr is read until its start-up line names the ports.
class ServerProcess {
 public:
  bool Start(const std::vector<std::string>& flags) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<std::string> args = {ServerBinary()};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    if (rc != 0) {
      close(fds[0]);
      ADD_FAILURE() << "cannot start " << argv[0];
      return false;
    }
    err_ = fdopen(fds[0], "r");
    char line[1024];
    while (std::fgets(line, sizeof(line), err_) != nullptr) {
      log_ += line;
      if (std::sscanf(line,
                      "kvpool-server %*s listening: grpc port %d, metrics port %d, attend socket "
                      "port %d",
                      &port_, &metrics_port_, &attend_socket_port_) == 3) {
        return true;
      }
    }
    return false;  // exited before listening
  }

  // Sends SIGTERM and returns the exit status (-1 if it did not exit normally).
  int Terminate() {
    kill(pid_, SIGTERM);
    return Wait();
  }

  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      Wait();
    }
  }

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  int attend_socket_port() const { return attend_socket_port_; }
  const std::string& log() const { return log_; }

 private:
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    char line[1024];
    while (err_ != nullptr && std::fgets(line, sizeof(line), err_) != nullptr) log_ += line;
    if (err_ != nullptr) fclose(err_);
    err_ = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  pid_t pid_ = -1;
  FILE* err_ = nullptr;
  std::string log_;
  int port_ = 0;
  int metrics_port_ = 0;
  int attend_socket_port_ = 0;
};

// grpc.health.v1.Health/Check for `service` ("": the whole server), through the generic stub (a
// HealthCheckRequest is field 1, the name; a response of {status: SERVING} is the bytes 08 01).
bool HealthServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::CompletionQueue cq;
  const std::string encoded =
      service.empty() ? "" : std::string(1, '\x0a') + static_cast<char>(service.size()) + service;
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1);
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok || !status.ok()) return false;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes == std::string("\x08\x01", 2);
}

// GET http://127.0.0.1:port/metrics; the whole HTTP response.
std::string HttpGetMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

TEST(ServerBinary, ServesPutMatchGetAndMetricsThenExitsCleanlyOnSigterm) {
  ServerProcess server;
  const std::string unix_socket = absl::StrCat("/tmp/kvpool-binary-test-", getpid(), ".sock");
  ASSERT_TRUE(server.Start({"--port=0", "--metrics_port=0", "--attend_socket_port=0",
                            "--attend_unix_socket=" + unix_socket, "--backend=cpu",
                            "--pool_bytes=67108864", "--shutdown_grace_ms=2000"}))
      << server.log();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server.port()),
                                     grpc::InsecureChannelCredentials());
  ASSERT_TRUE(HealthServing(channel));
  EXPECT_TRUE(HealthServing(channel, "kvpool.v1.KvPool"));  // a probe may name the service
  auto stub = v1::KvPool::NewStub(channel);

  const NamespaceConfig c = DefaultNamespaceConfig(0);
  const int pt = c.num_kv_heads * c.head_dim;
  const Sequence s = MakeSequence(c, 40, 1, 12);
  v1::PutResponse put;
  const grpc::Status st = PutSequence(stub.get(), "", s, pt, 40, &put);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(put.tokens_stored(), 32u);
  EXPECT_EQ(put.tokens_ignored(), 8u);

  grpc::ClientContext ctx;
  v1::MatchRequest m;
  for (int32_t t : s.tokens) m.add_token_ids(t);
  v1::MatchResponse mr;
  ASSERT_TRUE(stub->Match(&ctx, m, &mr).ok());
  EXPECT_EQ(mr.cached_tokens(), 32u);
  v1::GetRequest get;
  get.set_lease_id(mr.lease_id());
  get.set_layer_begin(3);
  get.set_layer_end(5);
  std::vector<v1::GetResponse> msgs;
  ASSERT_TRUE(ReadAll(stub.get(), get, &msgs).ok());
  size_t k_bytes = 0;
  for (const auto& r : msgs) k_bytes += r.k().size();
  EXPECT_EQ(k_bytes, 2u * 32 * pt * 2);

  // One decode step over the AttendSocket, and the same over its Unix socket in a region.
  absl::StatusOr<std::unique_ptr<client::AttendSession>> session = client::OpenAttendSocketSession(
      absl::StrCat("127.0.0.1:", server.attend_socket_port()), absl::Now() + absl::Seconds(30),
      absl::ZeroDuration(), 1 << 20);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<uint16_t> q = ToHalf(MakeNormal(size_t{2} * pt, 3));
  v1::AttendRequest attend;
  attend.set_num_q_heads(2 * c.num_kv_heads);
  v1::AttendItem* item = attend.add_items();
  item->set_lease_id(mr.lease_id());
  item->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 2);
  item->set_new_token_id(-1);
  absl::StatusOr<v1::AttendResponse> attended = (*session)->Step(attend);
  ASSERT_TRUE(attended.ok()) << attended.status();
  EXPECT_EQ(attended->context_tokens(0), 32u);
  EXPECT_TRUE((*session)->Finish().ok());
  absl::StatusOr<std::unique_ptr<client::AttendSession>> region = client::OpenAttendRegionSession(
      unix_socket, 1 << 20, absl::Now() + absl::Seconds(30), absl::ZeroDuration(), 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  absl::StatusOr<v1::AttendResponse> in_region = (*region)->Step(attend);
  ASSERT_TRUE(in_region.ok()) << in_region.status();
  EXPECT_EQ(in_region->out(), attended->out());
  EXPECT_TRUE((*region)->Finish().ok());

  // The AttendSocket sessions are counted once their threads have seen the close, after their
  // steps.
  const std::string session_line =
      "kvpool_rpc_duration_seconds_count{method=\"AttendSocket\",code=\"OK\"} 2\n";
  std::string scrape;
  for (int i = 0; i < 100; ++i) {
    scrape = HttpGetMetrics(server.metrics_port());
    if (scrape.find(session_line) != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(scrape.find(session_line), std::string::npos);
  EXPECT_EQ(scrape.rfind("HTTP/1.1 200", 0), 0u) << scrape;
  EXPECT_NE(scrape.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(scrape.find("kvpool_rpc_duration_seconds_count{method=\"Put\",code=\"OK\"} 1\n"),
            std::string::npos);
  EXPECT_NE(scrape.find("kvpool_tokens_stored{namespace=\"default\"} 32\n"), std::string::npos);
  EXPECT_NE(scrape.find(
                "kvpool_rpc_duration_seconds_count{method=\"AttendSocket.step\",code=\"OK\"} 2\n"),
            std::string::npos);
  EXPECT_NE(scrape.find("kvpool_build_info{version=\"0.1.0\",backend=\"cpu\"} 1\n"),
            std::string::npos);

  EXPECT_EQ(server.Terminate(), 0) << server.log();
  EXPECT_NE(server.log().find("stopped"), std::string::npos) << server.log();
  EXPECT_NE(access(unix_socket.c_str(), F_OK), 0) << "the Unix socket file is left behind";
}

// --help lists the server's flags, the limits among them.
TEST(ServerBinary, HelpListsTheServersFlags) {
  FILE* help = popen((ServerBinary() + " --help 2>&1").c_str(), "r");
  ASSERT_NE(help, nullptr);
  std::string text;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), help)) > 0;) text.append(buf, n);
  pclose(help);
  for (const char* flag :
       {"--max_leases (", "--max_attend_batch (", "--pool_bytes (", "--port ("}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag << " not in:\n" << text;
  }
}

// Flags the server cannot use stop it before it listens, with a message naming the flag.
TEST(ServerBinary, UnusableFlagsStopItWithTheirName) {
  for (const std::string flag :
       {"--port=70000", "--metrics_port=-2", "--attend_socket_port=65536", "--max_message_bytes=0",
        "--default_namespace_fraction=0", "--pool_memory_fraction=nan",
        "--attend_socket_idle_timeout_ms=0", "--lease_sweep_ms=-1", "--get_stall_timeout_ms=-5"}) {
    ServerProcess server;
    EXPECT_FALSE(server.Start({flag, "--backend=cpu", "--pool_bytes=67108864"})) << flag;
    EXPECT_EQ(server.Terminate(), 2) << flag;
    const std::string name = flag.substr(0, flag.find('='));
    EXPECT_NE(server.log().find(name), std::string::npos) << server.log();
  }
}

// A second server on the gRPC port of a running one fails to start instead of sharing the port
// (gRPC's default SO_REUSEPORT would split the clients' connections between two pools).
TEST(ServerBinary, ASecondServerCannotTakeARunningServersPort) {
  ServerProcess first;
  ASSERT_TRUE(first.Start({"--port=0", "--metrics_port=-1", "--attend_socket_port=-1",
                           "--backend=cpu", "--pool_bytes=67108864"}))
      << first.log();
  ServerProcess second;
  EXPECT_FALSE(second.Start({absl::StrCat("--port=", first.port()), "--metrics_port=-1",
                             "--attend_socket_port=-1", "--backend=cpu", "--pool_bytes=67108864"}))
      << second.log();
  EXPECT_EQ(second.Terminate(), 1) << second.log();
  EXPECT_NE(second.log().find("cannot listen"), std::string::npos) << second.log();
  EXPECT_EQ(first.Terminate(), 0) << first.log();
}

// TCP connections to 127.0.0.1:port, as many as connect (at most n).
std::vector<int> ConnectMany(int port, int n) {
  std::vector<int> fds;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      break;
    }
    fds.push_back(fd);
  }
  return fds;
}

// Sessions that ended hold their descriptors until the AttendSocket reaps them. A server whose
// descriptors all went to sessions (a low RLIMIT_NOFILE, many clients at once) reaps them when
// its accepts fail, and then serves new clients again.
TEST(ServerBinary, AttendSocketServesAgainAfterItsDescriptorsRanOut) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 128);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  ServerProcess server;  // inherits the low limit
  const bool started = server.Start({"--port=0", "--metrics_port=-1", "--attend_socket_port=0",
                                     "--backend=cpu", "--pool_bytes=67108864"});
  // This process keeps its own limit, raised if needed for the 200 connections.
  rlimit mine = old;
  mine.rlim_cur = std::max<rlim_t>(old.rlim_cur, std::min<rlim_t>(old.rlim_max, 512));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &mine), 0);
  ASSERT_TRUE(started) << server.log();
  std::vector<int> fds = ConnectMany(server.attend_socket_port(), 200);
  ASSERT_GT(fds.size(), 128u) << "the connections should outnumber the server's descriptors";
  absl::SleepFor(absl::Milliseconds(500));  // the server accepts what its descriptors allow
  for (int fd : fds) close(fd);
  absl::SleepFor(absl::Milliseconds(500));  // and its sessions see the closes

  absl::StatusOr<std::unique_ptr<client::AttendSession>> session = client::OpenAttendSocketSession(
      absl::StrCat("127.0.0.1:", server.attend_socket_port()), absl::Now() + absl::Seconds(10),
      absl::ZeroDuration(), 1 << 20);
  ASSERT_TRUE(session.ok()) << session.status();
  v1::AttendRequest attend;
  attend.set_num_q_heads(8);
  attend.add_items()->set_lease_id(12345);
  // Served: the unknown lease's status, not the session's deadline.
  EXPECT_EQ((*session)->Step(attend).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(server.Terminate(), 0) << server.log();
}

// Connections that send nothing hold an exposer thread only for its request timeout, and there
// are more threads than a few such clients: a scrape among them is answered at once.
TEST(ServerBinary, MetricsAreServedWhileIdleConnectionsWait) {
  ServerProcess server;
  ASSERT_TRUE(server.Start({"--port=0", "--metrics_port=0", "--attend_socket_port=-1",
                            "--backend=cpu", "--pool_bytes=67108864"}))
      << server.log();
  std::vector<int> idle = ConnectMany(server.metrics_port(), 4);
  ASSERT_EQ(idle.size(), 4u);
  absl::SleepFor(absl::Milliseconds(200));  // accepted, each holding a thread
  const absl::Time start = absl::Now();
  const std::string scrape = HttpGetMetrics(server.metrics_port());
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(scrape.rfind("HTTP/1.1 200", 0), 0u) << scrape;
  for (int fd : idle) close(fd);
  EXPECT_EQ(server.Terminate(), 0) << server.log();
}

}  // namespace
}  // namespace kvpool::testing
