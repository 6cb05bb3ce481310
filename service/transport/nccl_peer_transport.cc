// The NCCL PeerTransport: rank 0 of a 2-rank communicator on the CUDA backend's device, created
// non-blocking (ncclConfig_t.blocking = 0) so that no call ever waits on the worker: every
// operation is enqueued on the transport's own stream, an event recorded after it, and the event
// polled (communicator async error, Abort, deadline); any failure ends in ncclCommAbort.
#include <memory>

#include "absl/status/status.h"
#include "service/transport/peer_transport.h"

#if defined(KVPOOL_WITH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#endif

namespace kvpool {

#if defined(KVPOOL_WITH_NCCL)
namespace {

constexpr int kWorkerRank = 1;
// Pause between polls of a pending operation.
constexpr absl::Duration kPollInterval = absl::Microseconds(20);

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::UnavailableError(absl::StrFormat("%s: %s", what, ncclGetErrorString(r)));
}

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(
      absl::StrFormat("%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

class NcclPeerTransport final : public PeerTransport {
 public:
  NcclPeerTransport(int device, Clock* clock, ncclComm_t comm, cudaStream_t stream,
                    absl::Time join_deadline)
      : device_(device),
        clock_(clock),
        stream_(stream),
        join_deadline_(join_deadline),
        comm_(comm) {}

  ~NcclPeerTransport() override {
    absl::MutexLock l(&op_mu_);
    cudaSetDevice(device_);
    AbortLocked();
    for (cudaEvent_t e : pending_) cudaEventDestroy(e);
    for (cudaEvent_t e : idle_events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }

  absl::Status QueueSend(absl::Span<const SendSegment> segments, absl::Time deadline) override {
    absl::MutexLock l(&op_mu_);
    return EnqueueLocked(segments.size(), deadline, [&] {
      for (const SendSegment& s : segments) {
        const ncclResult_t r = ncclSend(s.data, s.bytes, ncclUint8, kWorkerRank, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      return ncclSuccess;
    });
  }

  absl::Status WaitSends(size_t pending, absl::Time deadline) override {
    absl::MutexLock l(&op_mu_);
    return WaitLocked(pending, deadline);
  }

  absl::Status Recv(absl::Span<const RecvSegment> segments, absl::Time deadline) override {
    absl::MutexLock l(&op_mu_);
    absl::Status s = EnqueueLocked(segments.size(), deadline, [&] {
      for (const RecvSegment& s : segments) {
        const ncclResult_t r = ncclRecv(s.data, s.bytes, ncclUint8, kWorkerRank, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      return ncclSuccess;
    });
    return s.ok() ? WaitLocked(0, deadline) : s;
  }

  // A call enqueueing or polling sees abort_requested_ at its next poll and aborts the
  // communicator itself; otherwise (queued sends included) it is aborted here, on the caller's
  // thread.
  void Abort() override {
    abort_requested_.store(true);
    if (op_mu_.TryLock()) {
      cudaSetDevice(device_);
      AbortLocked();
      op_mu_.Unlock();
    }
  }

 private:
  // Enqueues `enqueue`'s n operations as one group on stream_ and records an event after them
  // in pending_.
  template <typename Enqueue>
  absl::Status EnqueueLocked(size_t n, absl::Time deadline, Enqueue enqueue)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) {
    if (absl::Status s = UsableLocked(); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      AbortLocked();
      return CudaError(e, "cudaSetDevice");
    }
    // The communicator finishes initializing once the worker joined.
    if (absl::Status s = PollComm(std::min(deadline, join_deadline_), "joining"); !s.ok()) {
      return s;
    }
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess || r == ncclInProgress) r = enqueue();
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = end;
    if (r != ncclSuccess && r != ncclInProgress) {
      AbortLocked();
      return NcclError(r, "enqueueing NCCL send/recv");
    }
    if (absl::Status s = PollComm(deadline, "enqueueing"); !s.ok()) return s;
    cudaEvent_t done = nullptr;
    if (idle_events_.empty()) {
      if (cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
          e != cudaSuccess) {
        AbortLocked();
        return CudaError(e, "cudaEventCreate");
      }
    } else {
      done = idle_events_.back();
      idle_events_.pop_back();
    }
    pending_.push_back(done);  // destroyed with the transport whatever happens next
    if (cudaError_t e = cudaEventRecord(done, stream_); e != cudaSuccess) {
      AbortLocked();
      return CudaError(e, "cudaEventRecord");
    }
    return absl::OkStatus();
  }

  // Polls the oldest pending operations until at most `pending` are left.
  absl::Status WaitLocked(size_t pending, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) {
    if (absl::Status s = UsableLocked(); !s.ok()) return s;
    while (pending_.size() > pending) {
      const cudaError_t q = cudaEventQuery(pending_.front());
      if (q == cudaSuccess) {
        idle_events_.push_back(pending_.front());
        pending_.pop_front();
        continue;
      }
      if (q != cudaErrorNotReady) {
        AbortLocked();
        return CudaError(q, "NCCL transfer");
      }
      if (absl::Status s = CheckLocked(deadline, "transferring"); !s.ok()) return s;
      absl::SleepFor(kPollInterval);
    }
    return absl::OkStatus();
  }

  // UNAVAILABLE once aborted; an Abort that found an operation in flight may have left the
  // communicator's abort to the next operation.
  absl::Status UsableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) {
    if (comm_ != nullptr && !abort_requested_.load()) return absl::OkStatus();
    AbortLocked();
    return absl::UnavailableError("NCCL channel aborted");
  }

  // Polls ncclCommGetAsyncError until it is no longer in progress.
  absl::Status PollComm(absl::Time deadline, const char* phase)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) {
        AbortLocked();
        return NcclError(state, phase);
      }
      if (absl::Status s = CheckLocked(deadline, phase); !s.ok()) return s;
      absl::SleepFor(kPollInterval);
    }
  }

  // Aborts on Abort(), an asynchronous communicator error or a passed deadline.
  absl::Status CheckLocked(absl::Time deadline, const char* phase)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) {
    if (abort_requested_.load()) {
      AbortLocked();
      return absl::UnavailableError(absl::StrFormat("NCCL channel aborted while %s", phase));
    }
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
      AbortLocked();
      return NcclError(state, phase);
    }
    if (clock_->Now() > deadline) {
      AbortLocked();
      return absl::DeadlineExceededError(
          absl::StrFormat("NCCL peer not done %s by the deadline; channel aborted", phase));
    }
    return absl::OkStatus();
  }

  void AbortLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) {
    abort_requested_.store(true);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  const int device_;
  Clock* const clock_;         // the deadlines'
  const cudaStream_t stream_;  // this transport's own stream
  const absl::Time join_deadline_;
  std::atomic<bool> abort_requested_{false};
  // Held by a call while it enqueues or polls (queued sends stay in flight after it returns);
  // guards comm_ and the events.
  absl::Mutex op_mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(op_mu_);
  // Events recorded after the operations not yet seen done, oldest first, and spare ones.
  std::deque<cudaEvent_t> pending_ ABSL_GUARDED_BY(op_mu_);
  std::vector<cudaEvent_t> idle_events_ ABSL_GUARDED_BY(op_mu_);
};

class NcclTransportFactory final : public PeerTransportFactory {
 public:
  NcclTransportFactory(int device, Clock* clock) : device_(device), clock_(clock) {}

  absl::StatusOr<OpenedTransport> Open(absl::Time join_deadline) override {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return CudaError(e, "cudaSetDevice");
    }
    ncclUniqueId id;
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return NcclError(r, "ncclGetUniqueId");
    }
    cudaStream_t stream = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError(e, "cudaStreamCreate");
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, 0, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm != nullptr) ncclCommAbort(comm);
      cudaStreamDestroy(stream);
      return NcclError(r, "ncclCommInitRankConfig");
    }
    OpenedTransport opened;
    opened.transport =
        std::make_unique<NcclPeerTransport>(device_, clock_, comm, stream, join_deadline);
    opened.join_id.assign(id.internal, sizeof(id.internal));
    return opened;
  }

 private:
  const int device_;
  Clock* const clock_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerTransportFactory>> NewNcclTransportFactory(int device,
                                                                              Clock* clock) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrFormat("NCCL transport: CUDA device %d not present", device));
  }
  return std::unique_ptr<PeerTransportFactory>(
      std::make_unique<NcclTransportFactory>(device, clock));
}

#else

absl::StatusOr<std::unique_ptr<PeerTransportFactory>> NewNcclTransportFactory(int /*device*/,
                                                                              Clock* /*clock*/) {
  return absl::UnimplementedError("this server was built without NCCL (KVPOOL_ENABLE_NCCL)");
}

#endif

}  // namespace kvpool
