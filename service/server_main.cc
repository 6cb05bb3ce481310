// kvpool-server: the pool as a process. Flags configure the backend, pool size, limits and
// ports; SIGTERM or SIGINT shuts it down gracefully (drain for --shutdown_grace_ms).
#include <pthread.h>
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "service/server.h"
#include "service/store/compute_backend.h"
#include "service/store/namespace_config.h"

ABSL_FLAG(int, port, 50051, "gRPC port (0 = pick a free one)");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port (0 = pick a free one, -1 = off)");
ABSL_FLAG(std::string, backend, "auto", "auto, cpu or cuda (auto: cuda when a device works)");
ABSL_FLAG(int, device, 0, "CUDA device ordinal");
ABSL_FLAG(bool, cuda_kernel_host_io, true,
          "CUDA backend: attention kernels read q and write outputs in pinned host memory where "
          "the device supports it (false: DMA copies around the kernels instead)");
ABSL_FLAG(uint64_t, pool_bytes, 0,
          "pool arena bytes; 0 = 1 GiB on cpu, --pool_memory_fraction of free memory on cuda");
ABSL_FLAG(double, pool_memory_fraction, 0.8,
          "cuda with --pool_bytes=0: fraction of free device memory for the pool");
ABSL_FLAG(double, default_namespace_fraction, 0.5,
          "fraction of the pool reserved for the default namespace");
ABSL_FLAG(int64_t, default_lease_ttl_ms, 30000, "lease lifetime when a Match asks for 0");
ABSL_FLAG(int64_t, max_lease_ttl_ms, 600000, "longest lease lifetime granted");
ABSL_FLAG(uint64_t, max_leases, 65536, "leases alive at once");
ABSL_FLAG(int, max_message_bytes, 64 << 20, "largest gRPC message, either direction");
ABSL_FLAG(uint64_t, max_put_stream_bytes, uint64_t{64} << 30,
          "largest Put stream (the default namespace takes 128 KiB of fp16 K/V per token: 512K "
          "tokens); a Put whose new tokens need more is refused before it evicts anything");
ABSL_FLAG(uint64_t, max_get_streams, 256,
          "Get streams open at once (one more gets RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint64_t, max_put_streams, 1024,
          "Put streams open at once (a header on one more gets RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint32_t, max_sequence_tokens, 1 << 20, "tokens per Put or lease sequence");
ABSL_FLAG(uint64_t, max_lease_token_ids, uint64_t{1} << 28,
          "token ids all live leases keep together, 4 bytes of host memory each (a Match or an "
          "append past it gets RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint32_t, max_attend_batch, 1024, "items per Attend request");
ABSL_FLAG(int, max_namespaces, 64,
          "namespaces the server holds (CreateNamespace past it gets RESOURCE_EXHAUSTED)");
ABSL_FLAG(int, attend_threads, 4,
          "threads (one completion queue each) that run unary Attend calls and AttendStream "
          "decode steps");
ABSL_FLAG(int64_t, attend_spin_us, 500,
          "how long an Attend thread polls without sleeping after its last event (0 = block; "
          "spinning saves a thread wake-up per call or decode step)");
ABSL_FLAG(int, attend_socket_port, 50052,
          "AttendSocket port: Attend steps over plain TCP, without gRPC (0 = pick a free one, "
          "-1 = off)");
ABSL_FLAG(int, attend_socket_max_connections, 256, "AttendSocket sessions served at once");
ABSL_FLAG(int64_t, attend_socket_spin_us, 500,
          "how long an AttendSocket session polls for its next request without sleeping (0 = "
          "block)");
ABSL_FLAG(int, attend_socket_max_spinning, 4,
          "AttendSocket sessions that may poll without sleeping at the same time (each a busy "
          "core); the others block at once");
ABSL_FLAG(int64_t, attend_socket_idle_timeout_ms, 600000,
          "an AttendSocket session with no request (or an unsendable response) this long is "
          "closed");
ABSL_FLAG(std::string, attend_unix_socket, "",
          "AttendSocket on a Unix socket at this path as well (empty = off): sessions of clients "
          "on this host may attach a shared-memory region that holds each step's q, new K/V and "
          "output, pinned for direct device copies");
ABSL_FLAG(uint64_t, attend_region_max_bytes, uint64_t{64} << 20,
          "largest shared-memory region an AttendSocket session may attach");
ABSL_FLAG(uint64_t, attend_region_total_bytes, uint64_t{1} << 30,
          "pinned host memory all AttendSocket sessions' regions may take together");
ABSL_FLAG(uint64_t, nccl_max_channels, 256, "NCCL channels open at once (cuda)");
ABSL_FLAG(int64_t, nccl_channel_idle_timeout_ms, 300000,
          "an NCCL channel unused this long (or not joined by its worker) is aborted");
ABSL_FLAG(int64_t, nccl_default_join_timeout_ms, 30000,
          "time a worker is given to join a new NCCL channel when its OpenChannel names none");
ABSL_FLAG(int64_t, nccl_max_join_timeout_ms, 120000,
          "longest time a worker is given to join a new NCCL channel");
ABSL_FLAG(int64_t, nccl_default_transfer_timeout_ms, 30000,
          "data-phase deadline of an NcclGet / NcclPut that names none");
ABSL_FLAG(int64_t, nccl_max_transfer_timeout_ms, 300000, "longest NcclGet / NcclPut granted");
ABSL_FLAG(uint64_t, nccl_staging_bytes, uint64_t{256} << 20,
          "device memory of one NCCL staging buffer (a transfer takes up to two, larger when a "
          "layer is)");
ABSL_FLAG(uint64_t, nccl_staging_total_bytes, uint64_t{8} << 30,
          "device memory all NCCL staging buffers may take together, outside the pool (a "
          "transfer past it gets RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint32_t, get_chunk_bytes, (4u << 20) - 1024,
          "K+V payload bytes per Get message (a message, with its other fields, fits a client's "
          "default 4 MiB receive limit)");
ABSL_FLAG(int64_t, put_idle_timeout_ms, 60000,
          "a Put stream with no message for longer is cancelled and its blocks freed (0 = never)");
ABSL_FLAG(int64_t, get_stall_timeout_ms, 60000,
          "a Get stream whose client takes no message for longer (it stopped reading) is "
          "cancelled, freeing its --max_get_streams slot (0 = never)");
ABSL_FLAG(int64_t, shutdown_grace_ms, 10000,
          "time in-flight RPCs and open AttendSocket sessions get to finish on shutdown");
ABSL_FLAG(int64_t, lease_sweep_ms, 1000,
          "period of the sweep of expired leases, idle Put streams and stalled Get streams (0 = "
          "off)");

namespace kvpool {
namespace {

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeBackend(const std::string& kind, int device) {
  if (kind == "cpu") return NewCpuBackend();
  const CudaBackendOptions cuda_options{absl::GetFlag(FLAGS_cuda_kernel_host_io)};
  if (kind == "cuda") return NewCudaBackend(device, cuda_options);
  if (kind != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cpu or cuda, not ", kind));
  }
  absl::StatusOr<std::unique_ptr<ComputeBackend>> cuda = NewCudaBackend(device, cuda_options);
  if (cuda.ok()) return cuda;
  std::fprintf(stderr, "kvpool-server: CUDA backend unavailable (%s); using cpu\n",
               std::string(cuda.status().message()).c_str());
  return NewCpuBackend();
}

uint64_t PoolBytes(const ComputeBackend& backend) {
  const uint64_t flag = absl::GetFlag(FLAGS_pool_bytes);
  if (flag != 0) return flag;
  if (backend.name() != "cuda") return uint64_t{1} << 30;
  return static_cast<uint64_t>(absl::GetFlag(FLAGS_pool_memory_fraction) *
                               static_cast<double>(backend.Stats().device_free_bytes));
}

// INVALID_ARGUMENT naming the first flag whose value the server cannot use (the values the
// server's own options check elsewhere are left to those checks).
absl::Status CheckFlags() {
  const std::pair<const char*, int> ports[] = {
      {"port", absl::GetFlag(FLAGS_port)},
      {"metrics_port", absl::GetFlag(FLAGS_metrics_port)},
      {"attend_socket_port", absl::GetFlag(FLAGS_attend_socket_port)}};
  for (const auto& [name, port] : ports) {
    const int lowest = std::string_view(name) == "port" ? 0 : -1;
    if (port < lowest || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=", port, ": a port is ", lowest, " to 65535"));
    }
  }
  if (absl::GetFlag(FLAGS_max_message_bytes) <= 0) {
    return absl::InvalidArgumentError("--max_message_bytes must be positive");
  }
  if (absl::GetFlag(FLAGS_attend_socket_idle_timeout_ms) <= 0) {  // 0 would time out every read
    return absl::InvalidArgumentError("--attend_socket_idle_timeout_ms must be positive");
  }
  // Times where 0 means none (no spin, no timeout, no sweep): a negative one is a mistake.
  const std::pair<const char*, int64_t> times[] = {
      {"default_lease_ttl_ms", absl::GetFlag(FLAGS_default_lease_ttl_ms)},
      {"max_lease_ttl_ms", absl::GetFlag(FLAGS_max_lease_ttl_ms)},
      {"attend_spin_us", absl::GetFlag(FLAGS_attend_spin_us)},
      {"attend_socket_spin_us", absl::GetFlag(FLAGS_attend_socket_spin_us)},
      {"nccl_channel_idle_timeout_ms", absl::GetFlag(FLAGS_nccl_channel_idle_timeout_ms)},
      {"nccl_default_join_timeout_ms", absl::GetFlag(FLAGS_nccl_default_join_timeout_ms)},
      {"nccl_max_join_timeout_ms", absl::GetFlag(FLAGS_nccl_max_join_timeout_ms)},
      {"nccl_default_transfer_timeout_ms", absl::GetFlag(FLAGS_nccl_default_transfer_timeout_ms)},
      {"nccl_max_transfer_timeout_ms", absl::GetFlag(FLAGS_nccl_max_transfer_timeout_ms)},
      {"put_idle_timeout_ms", absl::GetFlag(FLAGS_put_idle_timeout_ms)},
      {"get_stall_timeout_ms", absl::GetFlag(FLAGS_get_stall_timeout_ms)},
      {"shutdown_grace_ms", absl::GetFlag(FLAGS_shutdown_grace_ms)},
      {"lease_sweep_ms", absl::GetFlag(FLAGS_lease_sweep_ms)}};
  for (const auto& [name, t] : times) {
    if (t < 0) return absl::InvalidArgumentError(absl::StrCat("--", name, "=", t, " is negative"));
  }
  const std::pair<const char*, double> fractions[] = {
      {"pool_memory_fraction", absl::GetFlag(FLAGS_pool_memory_fraction)},
      {"default_namespace_fraction", absl::GetFlag(FLAGS_default_namespace_fraction)}};
  for (const auto& [name, f] : fractions) {
    if (!(f > 0.0 && f <= 1.0)) {  // NaN fails too
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", f, " is not in (0, 1]"));
    }
  }
  return absl::OkStatus();
}

int Run() {
  if (absl::Status s = CheckFlags(); !s.ok()) {
    std::fprintf(stderr, "kvpool-server: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // Block the shutdown signals in every thread (threads inherit the mask) and take them
  // synchronously in this one.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<ComputeBackend>> backend =
      MakeBackend(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_device));
  if (!backend.ok()) {
    std::fprintf(stderr, "kvpool-server: %s\n", backend.status().ToString().c_str());
    return 2;
  }
  ServerOptions options;
  options.grpc_address = absl::StrCat("0.0.0.0:", absl::GetFlag(FLAGS_port));
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics_address = metrics_port < 0 ? "" : absl::StrCat("0.0.0.0:", metrics_port);
  options.store.pool_bytes = PoolBytes(**backend);
  options.store.default_lease_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_default_lease_ttl_ms));
  options.store.max_lease_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_max_lease_ttl_ms));
  options.store.max_leases = absl::GetFlag(FLAGS_max_leases);
  options.store.max_sequence_tokens = absl::GetFlag(FLAGS_max_sequence_tokens);
  options.store.max_lease_token_ids = absl::GetFlag(FLAGS_max_lease_token_ids);
  options.store.max_attend_batch = absl::GetFlag(FLAGS_max_attend_batch);
  options.store.max_namespaces = absl::GetFlag(FLAGS_max_namespaces);
  options.namespaces.push_back(
      DefaultNamespaceConfig(static_cast<uint64_t>(absl::GetFlag(FLAGS_default_namespace_fraction) *
                                                   static_cast<double>(options.store.pool_bytes))));
  options.service.max_put_stream_bytes = absl::GetFlag(FLAGS_max_put_stream_bytes);
  options.service.max_put_streams = absl::GetFlag(FLAGS_max_put_streams);
  options.service.max_get_streams = absl::GetFlag(FLAGS_max_get_streams);
  options.service.get_chunk_bytes = absl::GetFlag(FLAGS_get_chunk_bytes);
  options.service.put_idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_put_idle_timeout_ms));
  options.service.get_stall_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_get_stall_timeout_ms));
  options.attend.threads = absl::GetFlag(FLAGS_attend_threads);
  options.attend.spin = absl::Microseconds(absl::GetFlag(FLAGS_attend_spin_us));
  const int attend_socket_port = absl::GetFlag(FLAGS_attend_socket_port);
  options.attend_socket.address =
      attend_socket_port < 0 ? "" : absl::StrCat("0.0.0.0:", attend_socket_port);
  options.attend_socket.unix_path = absl::GetFlag(FLAGS_attend_unix_socket);
  options.attend_socket.max_region_bytes = absl::GetFlag(FLAGS_attend_region_max_bytes);
  options.attend_socket.total_region_bytes = absl::GetFlag(FLAGS_attend_region_total_bytes);
  options.attend_socket.max_connections = absl::GetFlag(FLAGS_attend_socket_max_connections);
  options.attend_socket.spin = absl::Microseconds(absl::GetFlag(FLAGS_attend_socket_spin_us));
  options.attend_socket.max_spinning = absl::GetFlag(FLAGS_attend_socket_max_spinning);
  options.attend_socket.idle_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_attend_socket_idle_timeout_ms));
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.attend_socket.max_frame_bytes = static_cast<uint32_t>(options.max_message_bytes);
  options.lease_sweep_interval = absl::Milliseconds(absl::GetFlag(FLAGS_lease_sweep_ms));
  if ((*backend)->name() == "cuda") options.nccl_device = absl::GetFlag(FLAGS_device);
  options.transport.channels.max_channels = absl::GetFlag(FLAGS_nccl_max_channels);
  options.transport.channels.idle_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_nccl_channel_idle_timeout_ms));
  options.transport.channels.default_join_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_nccl_default_join_timeout_ms));
  options.transport.channels.max_join_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_nccl_max_join_timeout_ms));
  options.transport.default_transfer_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_nccl_default_transfer_timeout_ms));
  options.transport.max_transfer_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_nccl_max_transfer_timeout_ms));
  options.transport.staging_bytes = absl::GetFlag(FLAGS_nccl_staging_bytes);
  options.transport.max_staging_total_bytes = absl::GetFlag(FLAGS_nccl_staging_total_bytes);
  const uint64_t pool_bytes = options.store.pool_bytes;

  absl::StatusOr<std::unique_ptr<Server>> server =
      Server::Start(std::move(options), *std::move(backend));
  if (!server.ok()) {
    std::fprintf(stderr, "kvpool-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr,
               "kvpool-server %s listening: grpc port %d, metrics port %d, attend socket port %d, "
               "backend %s, pool %llu bytes\n",
               kServerVersion, (*server)->port(), (*server)->metrics_port(),
               (*server)->attend_socket_port(), (*server)->backend().name().c_str(),
               static_cast<unsigned long long>(pool_bytes));

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "kvpool-server: signal %d, draining for up to %lld ms\n", sig,
               static_cast<long long>(absl::GetFlag(FLAGS_shutdown_grace_ms)));
  (*server)->Shutdown(absl::Milliseconds(absl::GetFlag(FLAGS_shutdown_grace_ms)));
  std::fprintf(stderr, "kvpool-server: stopped\n");
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  // --help lists the flags of this file (abseil looks for a file named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "service/server_main.cc");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage("kvpool-server [flags]: the kvpool KV-cache pool service");
  absl::ParseCommandLine(argc, argv);
  return kvpool::Run();
}
