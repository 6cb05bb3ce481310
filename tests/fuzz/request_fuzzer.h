// A randomized client of the KvPool service: every KvPool RPC, and raw AttendSocket frames over
// TCP and over the Unix socket with shared-memory regions, each sent well formed or broken at
// random against an in-process server (tests/integration/test_server.h).
//
// What it checks, after every call:
//   - the status code is one the contract allows for that RPC and that kind of input (the error
//     conventions at the top of proto/kvpool/v1/kvpool.proto, the AttendSocket's in
//     kvpool/v1/attend_socket.h and attend_region.h);
//   - "an RPC that fails stores nothing and leaves leases as they were": the fuzzer keeps a model
//     of the tokens each of its leases holds per layer, updates it on success, and after a failed
//     Append or Attend (and at random after successful ones) compares it with what Get reads;
//   - the replies add up: Put's token counts, Match's cached prefix and expiry, Get's ranges and
//     sizes, Attend's output, LSE and context sizes;
//   - the pool's block accounting (Stats), the lease count, and that a fresh sequence still reads
//     back close to what was put (RoundTrip).
#ifndef KVPOOL_TESTS_FUZZ_REQUEST_FUZZER_H_
#define KVPOOL_TESTS_FUZZ_REQUEST_FUZZER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "kvpool/v1/kvpool.pb.h"
#include "tests/integration/test_server.h"

namespace kvpool::testing {

// The server a fuzzer drives and the settings of it that the checks depend on.
struct FuzzTarget {
  TestServer* server = nullptr;   // outlives every fuzzer
  std::string unix_socket_path;   // the AttendSocket's Unix listener (its TCP one: on loopback)
  uint64_t max_region_bytes = 0;  // AttendSocketOptions::max_region_bytes
  absl::Duration socket_idle_timeout;  // AttendSocketOptions::idle_timeout
  absl::Duration default_lease_ttl;    // KvStore::Options: Match's ttl_ms 0, and its cap
  absl::Duration max_lease_ttl;
  NamespaceConfig default_namespace;  // the server's first namespace: "" names it
};

enum class FuzzMode {
  // The only client of the server: the tokens of every lease, lease lifetimes and the server's
  // lease count are modelled and checked.
  kAlone,
  // One of several fuzzers on one server, each with leases of its own: the per-lease model is
  // checked, server-wide counts are not.
  kOwnLeases,
  // Fuzzers draw their leases from one SharedLeasePool and race on them: a lease may change or
  // vanish under a call, so only status codes and reply shapes are checked during the run.
  kSharedLeases,
};

// How often each operation is picked by RequestFuzzer::Step (relative weights).
struct FuzzOpMix {
  int create_namespace = 5;
  int put = 17;
  int match = 13;
  int get = 12;
  int append = 13;
  int attend = 12;
  int attend_stream = 6;
  int release = 8;
  int socket = 11;
  int stats = 3;
  // kAlone only (the others check lease expiry against a still clock): the server's clock jumps
  // by up to 40 s, and leases expire.
  int advance_clock = 0;
};

// A lease as the fuzzer models it.
struct FuzzLease {
  uint64_t id = 0;
  std::string ns;
  std::vector<int64_t> layer_tokens;  // tokens held, per layer
};

// Leases that kSharedLeases fuzzers draw from and add to. Thread-safe.
class SharedLeasePool {
 public:
  explicit SharedLeasePool(size_t capacity) : capacity_(capacity) {}

  void Add(FuzzLease lease);
  std::vector<FuzzLease> Snapshot() const;
  // After a step that started from `before` and ended with `after`: adds the leases new in
  // `after`, drops those of `before` missing from it (released, or found gone). Returns the ids of
  // the oldest leases past the capacity, dropped too, for the caller to release.
  std::vector<uint64_t> Update(const std::vector<FuzzLease>& before,
                               const std::vector<FuzzLease>& after);
  // Empties the pool; returns the ids it held.
  std::vector<uint64_t> TakeAll();

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<FuzzLease> leases_ ABSL_GUARDED_BY(mu_);  // oldest first
};

struct FuzzOptions {
  FuzzMode mode = FuzzMode::kAlone;
  uint64_t seed = 1;
  // Scales the rates of most malformed fields (NaN/Inf, payloads of a wrong length, edge specs,
  // layers and heads out of range, empty batches): 1 = the generators' own rates. Unknown
  // leases, odd Get ranges and broken socket frames are sent whatever it says.
  double bad_fraction = 1.0;
  size_t max_leases = 30;                    // the oldest leases held beyond this are released
  bool verbose = false;                      // print every call that did not succeed
  SharedLeasePool* shared_leases = nullptr;  // kSharedLeases only; outlives the fuzzer
};

// One fuzzing client. Not thread-safe: one thread per fuzzer; several fuzzers may share a server.
class RequestFuzzer {
 public:
  RequestFuzzer(const FuzzTarget& target, const FuzzOptions& options, const FuzzOpMix& mix);
  RequestFuzzer(const RequestFuzzer&) = delete;
  RequestFuzzer& operator=(const RequestFuzzer&) = delete;

  // Takes over a lease made outside the fuzzer (kAlone and kOwnLeases; kSharedLeases fuzzers
  // find theirs in the pool).
  void AdoptLease(FuzzLease lease) { leases_.push_back(std::move(lease)); }
  // `steps` Steps, stopping early after kMaxFailures failures.
  void Run(uint64_t steps);
  // One operation picked by the mix and its checks. kAlone: every 50 steps also the Stats checks
  // and a RoundTrip; the others: every 20 steps, the namespace list again (others' new ones).
  void Step();
  // Releases every lease the fuzzer holds, and kSharedLeases: every lease of the pool. NOT_FOUND
  // is accepted where leases may vanish (clock moved, shared leases).
  void ReleaseAll();
  // A fresh sequence of two blocks through Put, Match and Get in the default namespace: all of it
  // cached, and read back within the quantization error.
  void RoundTrip();
  // Once no client calls the server and no lease is held: waits (at most 10 s) for sessions and
  // streams to wind down, then checks that no block is pinned, no lease is active, no region is
  // attached, and the block and sink-page accounting.
  void CheckIdleServer();

  int failures() const { return failures_; }
  uint64_t seed() const { return options_.seed; }
  // Status codes seen per RPC, one line each ("Put: 0x12 3x4": code x count).
  std::string CodeSummary() const;

  static constexpr int kMaxFailures = 20;

 private:
  struct NamespaceGeometry {
    uint32_t layers = 0, kv_heads = 0, head_dim = 0, block_tokens = 0;
  };
  // One Attend step to send, and what the fuzzer meant by it.
  struct AttendPlan {
    v1::AttendRequest request;
    bool repeats_lease = false;  // two items name the same lease
  };
  using CodeSet = std::set<grpc::StatusCode>;

  // ---- random values (request_fuzzer.cc) ----
  uint64_t Below(uint64_t n);  // uniform in [0, n); 0 for n 0
  bool Chance(double p);
  bool BadChance(double p) { return Chance(p * options_.bad_fraction); }
  uint32_t EdgeU32();  // 0, 1, 2^31, 2^32-1, powers of two, small numbers
  // `count` fp16 N(0,1) values as bytes; sometimes (when `may_be_bad`) with NaN, Inf or values
  // too large for a rotated layer.
  std::string RandomHalves(size_t count, bool may_be_bad = true);
  // A K, V or q payload that should have `bytes` bytes: usually RandomHalves, sometimes empty or
  // of a wrong length.
  std::string Fp16Payload(size_t bytes);
  // Token ids for a Put or Match: often a prefix of an earlier Put's, then fresh ids; sometimes a
  // negative id, or a long run of one id.
  std::vector<int32_t> RandomTokens(const NamespaceGeometry* g);
  std::string PickNamespace();  // mostly a real one; sometimes "" or an unknown name
  // A modelled lease (90%) or an id no lease has; `*lease` is null for the latter.
  uint64_t PickLeaseId(FuzzLease** lease);

  // ---- model and checks (request_fuzzer.cc) ----
  bool ModelsTokens() const { return options_.mode != FuzzMode::kSharedLeases; }
  // Whether a modelled lease may be gone without a Release of this fuzzer.
  bool LeaseMayVanish() const { return options_.mode == FuzzMode::kSharedLeases || clock_moved_; }
  void Fail(const std::string& what);
  // Counts `code` for `rpc` and fails unless it is in `allowed`.
  void CheckCode(const std::string& rpc, grpc::StatusCode code, const CodeSet& allowed,
                 const std::string& detail);
  void RefreshNamespaces();
  // The geometry of `ns` ("" = the default namespace); null for a namespace the server lacks.
  const NamespaceGeometry* Geometry(const std::string& ns);
  FuzzLease* FindLease(uint64_t id);
  void Forget(uint64_t id);
  // Reads the tokens lease `id` holds at `layer` through Get.
  grpc::Status HeldTokens(uint64_t id, uint32_t layer, int64_t* tokens);
  // Compares the model of lease `id` with Get's view of it (ModelsTokens only); `after` names the
  // call checked. A lease found gone is forgotten.
  void CheckLeaseModel(uint64_t id, const std::string& after);
  // Block accounting of every namespace; kAlone: the server's lease count.
  void CheckStats();
  // Releases lease `id`; NOT_FOUND is a failure unless LeaseMayVanish.
  void ReleaseLease(uint64_t id, const std::string& why);
  void ReleaseOldLeases();
  void SyncSharedLeases(const std::vector<FuzzLease>& before);

  // ---- store RPCs (request_fuzzer_rpcs.cc) ----
  v1::NamespaceSpec PlausibleSpec();  // valid but for chance (name taken, pool full)
  v1::NamespaceSpec EdgeSpec();       // fields at and past their bounds
  void CreateNamespace();
  // Streams chunks covering `tokens` tokens of every layer of `g`, some broken, repeated or
  // preceded by a second header; may stop early or cancel. Returns whether it cancelled.
  bool WritePutChunks(const NamespaceGeometry& g, const v1::PutRequest& header, uint32_t tokens,
                      grpc::ClientWriter<v1::PutRequest>* writer, grpc::ClientContext* ctx);
  void Put();
  void Match();
  void Get();
  void Append();
  void Release();
  void AdvanceClock();

  // ---- Attend (request_fuzzer_attend.cc) ----
  // A batch of items for one layer; `region`: for an AttendSocket region request (q, new_k and
  // new_v left empty, append_in_region set instead).
  AttendPlan MakeAttendPlan(bool region);
  // Checks the outcome of `plan` (`response`: the reply when `code` is OK) and updates the model:
  // a success appends a token for each appending item, a failure changes no lease.
  void CheckAttend(const std::string& rpc, const AttendPlan& plan, grpc::StatusCode code,
                   const std::string& detail, const v1::AttendResponse* response, bool region);
  void Attend();
  void AttendStream();

  // ---- AttendSocket (request_fuzzer_socket.cc) ----
  struct SocketSession;
  struct SentFrame;
  // A session on the TCP or the Unix listener, perhaps attaching a region first, then up to 5
  // random frames, until one is answered with a status frame (which must close the connection).
  void Socket();
  // Sends one random frame and checks the answer; false when the session is over.
  bool SendRandomFrame(SocketSession& session);
  // Each writes one kind of frame (SentFrame::written false when the write failed).
  SentFrame SendStep(SocketSession& session);
  SentFrame SendRegionStep(SocketSession& session);
  SentFrame SendMalformedHeader(SocketSession& session);
  SentFrame SendIncompleteFrame(SocketSession& session);
  // An attach frame, well formed or with a payload of the wrong length, and its answer; false
  // when the session is over.
  bool Attach(SocketSession& session);
  // Reads and checks the answer to `sent`; false when the session is over.
  bool CheckAnswer(SocketSession& session, const SentFrame& sent);
  // After a status frame: the server closed the connection.
  void ExpectClosed(SocketSession& session);
  // Whether the client has been quiet long enough for the server to close the session as idle
  // (AttendSocketOptions::idle_timeout): then a failed write, or DEADLINE_EXCEEDED, is no bug.
  bool MayBeClosedAsIdle(const SocketSession& session) const;

  const FuzzTarget target_;
  const FuzzOptions options_;
  v1::KvPool::Stub* const stub_;
  std::mt19937_64 rng_;
  std::discrete_distribution<int> op_picker_;
  std::map<std::string, NamespaceGeometry> namespaces_;
  std::vector<FuzzLease> leases_;  // oldest first
  // Token ids of recent successful Puts: new Puts and Matches start with their prefixes.
  std::vector<std::vector<int32_t>> prompts_;
  std::map<std::string, std::map<grpc::StatusCode, int>> codes_;  // per RPC
  uint64_t step_ = 0;
  int failures_ = 0;
  int round_trips_ = 0;
  bool clock_moved_ = false;
};

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_FUZZ_REQUEST_FUZZER_H_
