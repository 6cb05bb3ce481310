#include "service/server.h"

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "service/store/clock.h"
#include "service/store_metrics.h"
#include "service/transport/nccl_transfers.h"

namespace kvpool {

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options,
                                                      std::unique_ptr<ComputeBackend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("Server needs a compute backend");
  // Checked whatever the backend: a bad flag fails on every machine, not only on one with NCCL.
  if (absl::Status s = CheckTransportOptions(options.transport); !s.ok()) return s;
  std::unique_ptr<Server> s(new Server());
  s->backend_ = std::move(backend);
  options.store.backend = s->backend_.get();
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Create(options.store);
  if (!store.ok()) return store.status();
  s->store_ = *std::move(store);
  for (const NamespaceConfig& ns : options.namespaces) {
    absl::StatusOr<NamespaceInfo> info = s->store_->CreateNamespace(ns);
    if (!info.ok()) return info.status();
  }

  s->registry_
      .AddGauge("kvpool_build_info", "Build of the running server (value 1).",
                {"version", "backend"})
      .WithLabels({kServerVersion, s->backend_->name()})
      .Set(1);
  s->rpc_metrics_ = std::make_unique<RpcMetrics>(&s->registry_);
  RegisterStoreMetrics(s->store_.get(), &s->registry_);
  options.service.max_message_bytes = static_cast<uint64_t>(options.max_message_bytes);
  s->service_ = std::make_unique<KvPoolService>(s->store_.get(), s->rpc_metrics_.get(),
                                                options.service, options.store.clock);
  options.attend.draining = &s->draining_;
  options.attend_socket.draining = &s->draining_;
  s->attend_server_ = std::make_unique<AttendServer>(s->service_.get(), s->store_.get(),
                                                     s->rpc_metrics_.get(), options.attend);
  if (s->backend_->name() == "cuda" && options.nccl_device >= 0) {
    absl::StatusOr<std::unique_ptr<PeerTransportFactory>> factory =
        NewNcclTransportFactory(options.nccl_device, SystemClock());
    if (factory.ok()) {
      s->transport_factory_ = *std::move(factory);
      s->transport_service_ = std::make_unique<KvPoolTransportService>(
          s->store_.get(), s->backend_.get(), s->transport_factory_.get(), SystemClock(),
          s->rpc_metrics_.get(), options.transport);
    } else if (!absl::IsUnimplemented(factory.status())) {  // unimplemented: built without NCCL
      return factory.status();
    }
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!options.grpc_address.empty()) {
    builder.AddListeningPort(options.grpc_address, grpc::InsecureServerCredentials(), &s->port_);
  }
  // A second server on a port this one holds must fail to start, not share its connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(s->service_.get());
  s->attend_server_->AddQueues(builder);
  if (s->transport_service_ != nullptr) builder.RegisterService(s->transport_service_.get());
  s->max_message_bytes_ = options.max_message_bytes;
  s->grpc_server_ = builder.BuildAndStart();
  if (s->grpc_server_ == nullptr || (!options.grpc_address.empty() && s->port_ == 0)) {
    return absl::UnavailableError(absl::StrCat("gRPC: cannot listen on ", options.grpc_address));
  }
  s->attend_server_->Start();
  if (!options.attend_socket.address.empty() || !options.attend_socket.unix_path.empty()) {
    absl::StatusOr<std::unique_ptr<AttendSocketServer>> socket = AttendSocketServer::Start(
        s->store_.get(), s->backend_.get(), s->rpc_metrics_.get(), options.attend_socket);
    if (!socket.ok()) {
      s->Shutdown(absl::ZeroDuration());
      return socket.status();
    }
    s->attend_socket_ = *std::move(socket);
    const AttendSocketServer* attend_socket = s->attend_socket_.get();
    metrics::Gauge& region_bytes =
        s->registry_
            .AddGauge("kvpool_attend_region_bytes",
                      "Pinned host memory of the AttendSocket's shared-memory regions.", {})
            .WithLabels({});
    s->registry_.AddCollector([attend_socket, &region_bytes] {
      region_bytes.Set(static_cast<double>(attend_socket->region_bytes()));
    });
  }
  // Each service's own name answers health checks too (a probe may name one); Shutdown turns
  // them all NOT_SERVING with the server's.
  grpc::HealthCheckServiceInterface* health = s->grpc_server_->GetHealthCheckService();
  health->SetServingStatus(v1::KvPool::service_full_name(), true);
  if (s->transport_service_ != nullptr) {
    health->SetServingStatus(v1::KvPoolTransport::service_full_name(), true);
  }
  health->SetServingStatus(true);

  if (!options.metrics_address.empty()) {
    absl::StatusOr<std::unique_ptr<metrics::MetricsExposer>> exposer =
        metrics::MetricsExposer::Start(options.metrics_address, &s->registry_);
    if (!exposer.ok()) {
      s->Shutdown(absl::ZeroDuration());
      return exposer.status();
    }
    s->exposer_ = *std::move(exposer);
  }
  if (options.lease_sweep_interval > absl::ZeroDuration()) {
    const absl::Duration interval = options.lease_sweep_interval;
    Server* raw = s.get();
    s->sweeper_ = std::thread([raw, interval] { raw->SweepEvery(interval); });
  }
  return s;
}

Server::~Server() { Shutdown(absl::ZeroDuration()); }

int Server::attend_socket_port() const {
  return attend_socket_ == nullptr ? 0 : attend_socket_->port();
}

int Server::metrics_port() const { return exposer_ == nullptr ? 0 : exposer_->port(); }

std::shared_ptr<grpc::Channel> Server::InProcessChannel() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes_);
  args.SetMaxSendMessageSize(-1);
  return grpc_server_->InProcessChannel(args);
}

void Server::Sweep() {
  store_->ExpireLeases();
  service_->CancelIdleStreams();
  if (transport_service_ != nullptr) transport_service_->channels().ExpireIdle();
}

void Server::SweepEvery(absl::Duration interval) {
  while (!stop_sweeper_.WaitForNotificationWithTimeout(interval)) Sweep();
}

void Server::Shutdown(absl::Duration grace) {
  absl::MutexLock l(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  // gRPC calls and AttendSocket sessions drain together until one deadline: no new ones are
  // taken, those open may finish, and what is left then is cancelled.
  const absl::Time deadline = absl::Now() + grace;
  draining_.store(true, std::memory_order_relaxed);
  if (attend_socket_ != nullptr) attend_socket_->StopAccepting();
  if (grpc_server_ != nullptr) {
    grpc_server_->GetHealthCheckService()->SetServingStatus(false);
    grpc_server_->Shutdown(absl::ToChronoTime(deadline));
    grpc_server_->Wait();
  }
  if (attend_server_ != nullptr) attend_server_->Shutdown();
  if (attend_socket_ != nullptr) {
    attend_socket_->AwaitSessions(deadline);
    attend_socket_->Shutdown();
  }
  if (!stop_sweeper_.HasBeenNotified()) stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  exposer_.reset();
}

}  // namespace kvpool
