// gRPC adapter of the manager (triax.v1.Manager) over ManagerCore, on the
// callback API. Every unary RPC converts the request (convert.h), calls the
// core, converts the reply and maps the status one to one
// (common/grpc_status.h). Core calls hold the core mutex briefly and never
// block on I/O, so they run on the callback thread.
//
// WatchEvents is a ServerWriteReactor fed by an EventLog subscription: it
// writes one event at a time and, when the subscription is empty, waits for
// its notify callback; nothing blocks a callback thread. A watcher that falls
// behind by more than the log's watcher_queue_limit is finished with
// RESOURCE_EXHAUSTED; max_events > 0 finishes with OK after that many.
//
// ExtendSequence: when the core returns a demotion (allocation policies),
// the worker's Demote runs the same way and its completion calls
// ManagerCore::FinishExtendDemotion and finishes the reply (demoted_blocks:
// the blocks committed; a worker failure only keeps their encoding).
//
// PutCalibration / GetCalibration: the core's calibration store (a log line
// per stored table).
//
// DemoteBlocks: ManagerCore::PrepareDemote, then the worker's Demote through
// the async (callback) stub, so no thread waits; its completion callback
// commits (CommitDemote) or aborts (AbortDemote, when the worker failed) and
// finishes the reactor. A worker error comes back with its code and the
// message prefixed "worker <id> Demote: ". Worker stubs are cached by
// address. Worker calls have a deadline of worker_rpc_timeout_ms.
//
// TransferSequence (manager_service_transfer.cc): ManagerCore::
// PrepareTransfer, then the destination's ImportSequence through the async
// stub with the transfer's deadline (the request's timeout_ms, else
// --transfer_timeout_ms; the caller's own deadline if sooner), then
// CommitTransfer and the source's FreePages (async, best effort), and the
// reply with the figures. An ImportSequence error (or a refused commit)
// aborts (AbortTransfer), asks the destination to free what it may hold
// (best effort) and answers the worker's code with the message "transfer T
// of S from A to B: ...". Nothing waits on a callback thread; the answer
// comes when the worker call completes or its deadline passes.
//
// A background thread calls ManagerCore::CheckWorkers every
// check_interval_ms (failure detection) until Stop() or destruction.
//
// Memory pressure: one executor thread runs every tier plan (the worker's
// Demote / Spill / Restore / Evict through the synchronous stub, deadline
// worker_rpc_timeout_ms, then ManagerCore::FinishTierPlan), in order:
//   - every pressure_interval_ms (when > 0): RefreshRanking, PlanPressure,
//     and further stages (ranked again) while a pool is still above its
//     high watermark and the last stage applied something, within the
//     interval;
//   - admission: an OpenSequence or ExtendSequence refused
//     RESOURCE_EXHAUSTED for the tenant's ceiling or the worker's room is
//     handed to the executor, which runs one reclaim round
//     (reclaim_round.h: stages of rank, PlanAdmission, apply, retry) until
//     the call is admitted, nothing is left to take, or the deadline
//     (ManagerOptions::admission_deadline_ms, or the call's own deadline if
//     sooner); a success carries the round's ReclaimSummary, a rejection
//     says what was freed, the bytes still short and why;
//   - restore: ReportAccess with active=true restores the sequence's spilled
//     blocks (a reclaim round from other sequences when they do not fit)
//     and replies when done, RESOURCE_EXHAUSTED when some could not come
//     back; every successful Extend does the same in the background; graph
//     neighbours of reported blocks are restored in the background below
//     the high watermark.
//
// Thread contract: thread-safe. Destroy after the grpc::Server that uses it
// has been shut down (which ends all watch streams).
#pragma once

#include <grpcpp/security/credentials.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kvmanager/arena_messages.h"
#include "kvmanager/auth.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/reclaim_round.h"
#include "triax/v1/manager.grpc.pb.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::manager {

// The largest request the manager's server receives (gRPC's default is
// 4 MiB). It fits an OpenSequence / ExtendSequence whose rendered text has
// the tagger's largest size (kMaxRenderedBytes, 16 MiB) together with token
// offsets for tokens of 1.4 bytes and more on average (an offset takes at
// most 4 bytes on the wire); a larger request is refused RESOURCE_EXHAUSTED
// by gRPC before it reaches the service.
inline constexpr int kMaxRequestBytes = 64 << 20;

// Caps on what one client may ask of the service (kvmanager flags, docs/
// flags.md "Limits"); each is refused RESOURCE_EXHAUSTED with a message
// naming the limit and its value. (Message size is the server's
// --max_message_bytes, enforced by gRPC; open sequences per tenant is
// ManagerOptions::max_sequences_per_tenant, in the core.)
struct ServiceLimits {
  // `spans` of one OpenSequence / ExtendSequence (rendered text is bounded
  // by the tagger's kMaxRenderedBytes instead); 0: no limit.
  uint32_t max_spans_per_request = 65'536;
  // WatchEvents streams open at once; 0: no limit.
  uint32_t max_watchers = 1'024;
  // Events one WatchEvents stream sends before it is finished (the message
  // names the from_id to resume with); 0: no limit.
  uint64_t max_events_per_watch = 0;
  // SequenceCalls streams open at once; 0: no limit.
  uint32_t max_call_streams = 256;
  // Calls of one SequenceCalls stream in flight, from their arrival to
  // their reply's write (>= 1): the stream is not read further until
  // replies are written; the calls of one batch past the room left are
  // answered RESOURCE_EXHAUSTED, and a batch of more calls than this ends
  // the stream RESOURCE_EXHAUSTED. With max_call_streams it bounds what
  // the streams hold (a call in flight: its request and an 8 KiB arena
  // block, more for a large reply).
  uint32_t max_stream_calls = 256;
};

// Finishes `reactor` with `status` once what this thread's core calls
// changed is durable (ManagerCore::WhenDurable; at once without a journal),
// so that no reply acknowledges a change a crash could lose, and no thread
// blocks on the disk meanwhile. Every unary reply of the service goes
// through here.
void FinishDurable(ManagerCore* core, grpc::ServerUnaryReactor* reactor,
                   grpc::Status status);

class ManagerService final : public v1::Manager::CallbackService {
 public:
  // `core` must outlive the service. check_interval_ms <= 0 disables the
  // background failure detector (tests drive CheckWorkers themselves).
  ManagerService(ManagerCore* core, int64_t check_interval_ms,
                 int64_t worker_rpc_timeout_ms = 30000,
                 int64_t pressure_interval_ms = 0);
  ~ManagerService() override;

  // Stops the failure detector and waits for in-flight worker calls;
  // idempotent.
  void Stop();
  // Call before the server starts (not synchronized with RPCs).
  void SetLimits(const ServiceLimits& limits) { limits_ = limits; }

  // Credentials of the channels to workers (TLS, common/tls.h); insecure
  // until set. `server_name`: with TLS, the name workers' certificates are
  // verified against instead of their address (empty: the address). Call
  // before serving.
  void SetWorkerCredentials(std::shared_ptr<grpc::ChannelCredentials> creds,
                            std::string server_name = "");
  // Every call must carry a bearer token the core's TokenStore verifies
  // (auth.h for the rules), and the workers require capabilities signed
  // with `capability_key` (common/capability.h): the manager hands the key
  // to workers in RegisterWorker and Heartbeat replies, signs a client
  // capability (valid capability_ttl_ms) into every SequenceInfo it returns
  // to its tenant, and signs its own worker calls. Call before the server
  // starts.
  void RequireTokens(std::string capability_key, int64_t capability_ttl_ms) {
    auth_ =
        Authorizer(&core_->tokens(), [core = core_] { return core->NowMs(); });
    capability_key_ = std::move(capability_key);
    capability_ttl_ms_ = capability_ttl_ms;
  }

  // With mutual TLS: RegisterWorker and Heartbeat only from client
  // certificates named in `names` (common/tls.h CheckPeerIdentity; "*"
  // suffixes match prefixes); other calls are not checked. Call before the
  // server starts.
  void RequireWorkerCertificates(std::vector<std::string> names) {
    worker_certificate_names_ = std::move(names);
  }

  grpc::ServerUnaryReactor* RegisterWorker(
      grpc::CallbackServerContext* ctx, const v1::RegisterWorkerRequest* req,
      v1::RegisterWorkerResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* ctx,
                                        const v1::ListWorkersRequest* req,
                                        v1::ListWorkersResponse* resp) override;
  grpc::ServerUnaryReactor* CreateTenant(
      grpc::CallbackServerContext* ctx, const v1::CreateTenantRequest* req,
      v1::CreateTenantResponse* resp) override;
  grpc::ServerUnaryReactor* SetBudget(grpc::CallbackServerContext* ctx,
                                      const v1::SetBudgetRequest* req,
                                      v1::SetBudgetResponse* resp) override;
  grpc::ServerUnaryReactor* ListTenants(grpc::CallbackServerContext* ctx,
                                        const v1::ListTenantsRequest* req,
                                        v1::ListTenantsResponse* resp) override;
  grpc::ServerUnaryReactor* OpenSequence(
      grpc::CallbackServerContext* ctx, const v1::OpenSequenceRequest* req,
      v1::OpenSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* ExtendSequence(
      grpc::CallbackServerContext* ctx, const v1::ExtendSequenceRequest* req,
      v1::ExtendSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* ForkSequence(
      grpc::CallbackServerContext* ctx, const v1::ForkSequenceRequest* req,
      v1::ForkSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSequence(
      grpc::CallbackServerContext* ctx, const v1::CloseSequenceRequest* req,
      v1::CloseSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* TruncateSequence(
      grpc::CallbackServerContext* ctx, const v1::TruncateSequenceRequest* req,
      v1::TruncateSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx,
                                        const v1::GetSequenceRequest* req,
                                        v1::GetSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* ListSequences(
      grpc::CallbackServerContext* ctx, const v1::ListSequencesRequest* req,
      v1::ListSequencesResponse* resp) override;
  grpc::ServerUnaryReactor* QueryTrace(grpc::CallbackServerContext* ctx,
                                       const v1::QueryTraceRequest* req,
                                       v1::QueryTraceResponse* resp) override;
  grpc::ServerUnaryReactor* PutPolicy(grpc::CallbackServerContext* ctx,
                                      const v1::PutPolicyRequest* req,
                                      v1::PutPolicyResponse* resp) override;
  grpc::ServerUnaryReactor* ListPolicies(
      grpc::CallbackServerContext* ctx, const v1::ListPoliciesRequest* req,
      v1::ListPoliciesResponse* resp) override;
  grpc::ServerUnaryReactor* DemoteBlocks(
      grpc::CallbackServerContext* ctx, const v1::DemoteBlocksRequest* req,
      v1::DemoteBlocksResponse* resp) override;
  grpc::ServerUnaryReactor* TransferSequence(
      grpc::CallbackServerContext* ctx, const v1::TransferSequenceRequest* req,
      v1::TransferSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* PutCalibration(
      grpc::CallbackServerContext* ctx, const v1::PutCalibrationRequest* req,
      v1::PutCalibrationResponse* resp) override;
  grpc::ServerUnaryReactor* GetCalibration(
      grpc::CallbackServerContext* ctx, const v1::GetCalibrationRequest* req,
      v1::GetCalibrationResponse* resp) override;
  grpc::ServerUnaryReactor* ReportAccess(
      grpc::CallbackServerContext* ctx, const v1::ReportAccessRequest* req,
      v1::ReportAccessResponse* resp) override;
  grpc::ServerUnaryReactor* GetPressure(grpc::CallbackServerContext* ctx,
                                        const v1::GetPressureRequest* req,
                                        v1::GetPressureResponse* resp) override;
  grpc::ServerWriteReactor<v1::Event>* WatchEvents(
      grpc::CallbackServerContext* ctx,
      const v1::WatchEventsRequest* req) override;
  // manager_service_stream.cc: the sequence calls on one stream.
  grpc::ServerBidiReactor<v1::SequenceCallBatch, v1::SequenceReplyBatch>*
  SequenceCalls(grpc::CallbackServerContext* ctx) override;
  // Where SequenceCalls counts each call it answers: `record(method, code,
  // elapsed)` with method "SequenceCalls.<RPC>" (kvmanager's main hands it
  // RpcMetrics::Record, beside the interceptor's per-RPC series; the stream
  // itself is one "SequenceCalls" call there); unset: not counted. Call
  // before the server starts.
  using CallRecorder = std::function<void(const std::string& method, int code,
                                          absl::Duration elapsed)>;
  void SetCallRecorder(CallRecorder record) {
    record_call_ = std::move(record);
  }
  grpc::ServerUnaryReactor* IssueToken(grpc::CallbackServerContext* ctx,
                                       const v1::IssueTokenRequest* req,
                                       v1::IssueTokenResponse* resp) override;
  grpc::ServerUnaryReactor* RevokeToken(grpc::CallbackServerContext* ctx,
                                        const v1::RevokeTokenRequest* req,
                                        v1::RevokeTokenResponse* resp) override;
  grpc::ServerUnaryReactor* ListTokens(grpc::CallbackServerContext* ctx,
                                       const v1::ListTokensRequest* req,
                                       v1::ListTokensResponse* resp) override;
  // manager_service_capacity.cc (kvmanager/capacity.h); read-only.
  grpc::ServerUnaryReactor* PlanCapacity(
      grpc::CallbackServerContext* ctx, const v1::PlanCapacityRequest* req,
      v1::PlanCapacityResponse* resp) override;

 private:
  friend class SequenceCallReactor;  // manager_service_stream.cc
  // How a sequence call's answer leaves: the unary reactor's Finish (through
  // FinishDurable: UnaryDone), or a call stream's reply. Called once, with
  // the call's status, on the thread that made the call's last core call
  // (whose durable ticket the reply waits for); the response object passed
  // with it is filled by then.
  using CallDone = std::function<void(grpc::Status)>;
  CallDone UnaryDone(grpc::ServerUnaryReactor* reactor) const;
  // The bodies of the sequence calls, shared by the unary RPCs and
  // SequenceCalls. `ctx` authorizes (its bearer token) and bounds a reclaim
  // (its deadline); the request may be reused once the call returns; `resp`
  // must live until `done`.
  void StartOpen(grpc::CallbackServerContext* ctx,
                 const v1::OpenSequenceRequest& req,
                 v1::OpenSequenceResponse* resp, CallDone done);
  void StartExtend(grpc::CallbackServerContext* ctx,
                   const v1::ExtendSequenceRequest& req,
                   v1::ExtendSequenceResponse* resp, CallDone done);
  void StartReportAccess(grpc::CallbackServerContext* ctx,
                         const v1::ReportAccessRequest& req,
                         v1::ReportAccessResponse* resp, CallDone done);
  // The synchronous ones: the reply is the returned status (durable once
  // this thread's ticket is).
  absl::Status DoFork(const grpc::ServerContextBase& ctx,
                      const v1::ForkSequenceRequest& req,
                      v1::ForkSequenceResponse* resp);
  absl::Status DoClose(const grpc::ServerContextBase& ctx,
                       const v1::CloseSequenceRequest& req,
                       v1::CloseSequenceResponse* resp);
  absl::Status DoTruncate(const grpc::ServerContextBase& ctx,
                          const v1::TruncateSequenceRequest& req,
                          v1::TruncateSequenceResponse* resp);
  absl::Status DoGet(const grpc::ServerContextBase& ctx,
                     const v1::GetSequenceRequest& req,
                     v1::GetSequenceResponse* resp);
  // With capabilities on (RequireTokens): adds the manager's capability for
  // (tenant_id, sequence_id; empty: the whole worker) on worker_id to a
  // worker call; off: nothing.
  void SignWorkerCall(grpc::ClientContext* ctx, const std::string& worker_id,
                      const std::string& tenant_id,
                      const std::string& sequence_id) const;
  v1::Capability ManagerCapability(const std::string& worker_id,
                                   const std::string& tenant_id,
                                   const std::string& sequence_id) const;
  // With capabilities on: a client capability for the sequence on its
  // worker (and a fork capability for its shared prefix) into
  // info->capabilities; off, or no worker: nothing.
  void SignSequence(v1::SequenceInfo* info) const;
  // RESOURCE_EXHAUSTED past ServiceLimits::max_spans_per_request.
  absl::Status CheckSpans(int spans) const;
  void CheckLoop(int64_t interval_ms);
  // The pressure executor: runs posted tasks in order and, every
  // interval_ms > 0 without tasks, one background pressure round.
  void PressureLoop(int64_t interval_ms);
  void Post(std::function<void()> task);
  // Runs a tier plan's worker calls and commits their outcome; returns what
  // was applied.
  TierPlanOutcome RunTierPlan(const TierPlan& plan);
  // A reclaim round's stage: RunTierPlan, then (when pages moved, or a
  // worker refused for room) each worker of the plan is asked for its
  // inventory (GetInventory) so that the next admission check sees the
  // frames the stage freed rather than the last heartbeat's.
  TierPlanOutcome RunReclaimStage(const TierPlan& plan);
  // The end of a reclaim round for a call: admission_deadline_ms from now,
  // or the call's deadline if sooner (ctx null: no call).
  absl::Time ReclaimDeadline(const grpc::CallbackServerContext* ctx) const;
  // Restores a sequence's spilled blocks, reclaiming room from other
  // sequences (one ReclaimRound, until `deadline`) when they do not fit.
  // *blocks: restores planned; *report: the reclaim. OK when every spilled
  // block is back, RESOURCE_EXHAUSTED naming what was freed and what is
  // still short, or the worker's error. Runs on the executor.
  absl::Status RestoreWithReclaim(const std::string& sequence_id,
                                  absl::Time deadline, uint32_t* blocks,
                                  ReclaimReport* report);
  // One ReclaimRound for a refused admission: asks the shortfall's worker
  // for its room first (RefreshRoom) and retries; then reclaims for
  // `shortfall` and calls `retry` (which refills it) after each stage, until it
  // is admitted, fails otherwise, nothing is left to take or `deadline`. Runs
  // on the executor.
  template <typename T>
  absl::StatusOr<T> AdmitAfterReclaim(
      const absl::Status& refused, AdmissionShortfall shortfall,
      absl::Time deadline,
      const std::function<absl::StatusOr<T>(AdmissionShortfall*)>& retry,
      ReclaimReport* report);
  // Finishes an Extend reply: runs its demotion (allocation policies) and
  // queues the prefetch of the sequence's spilled blocks.
  void FinishExtend(CallDone done, v1::ExtendSequenceResponse* resp,
                    absl::StatusOr<ExtendSequenceResult> r);
  std::shared_ptr<v1::Worker::Stub> WorkerStub(const std::string& address);
  // Asks the worker for its inventory (deadline worker_rpc_timeout_ms) and
  // takes its frames as the worker's room (ManagerCore::RefreshWorkerRoom);
  // on error logs and keeps the old room. Blocking: runs on the executor.
  // After a manager restart: asks the worker at `address` to describe the
  // sequences that were in doubt and adopts what it holds
  // (ManagerCore::AdoptWorkerBlocks). Runs on the executor.
  void DescribeAndAdopt(const std::string& worker_id,
                        const std::string& address,
                        const std::vector<std::string>& sequence_ids);
  void RefreshRoom(const std::string& worker_id, const std::string& address);
  // Runs the worker's Demote for `prepared` through the async stub (deadline
  // worker_rpc_timeout_ms; counted in in_flight_); `done` runs on the
  // completion callback with OK or the worker's error prefixed
  // "worker <id> Demote: ", and the pages re-encoded.
  void CallWorkerDemote(
      const DemotePrepared& prepared,
      std::function<void(const absl::Status&, uint64_t)> done);
  // Asks the worker at `address` to free the sequence's pages through the
  // async stub (deadline worker_rpc_timeout_ms; counted in in_flight_),
  // best effort: a failure is logged with `why` (the pages are then the
  // worker's orphans, freed by its next heartbeat's release list or the
  // reconciliation of its return).
  void FreePagesBestEffort(const std::string& worker_id,
                           const std::string& address,
                           const std::string& request_id,
                           const std::string& tenant_id,
                           const std::string& sequence_id,
                           const std::string& why);

  ManagerCore* const core_;
  // RequireWorkerCertificates' check of RegisterWorker and Heartbeat.
  absl::Status CheckWorkerCertificate(const grpc::ServerContextBase& ctx,
                                      absl::string_view method) const;

  Authorizer auth_;  // off unless RequireTokens
  // Empty: RegisterWorker and Heartbeat take any (or no) certificate.
  std::vector<std::string> worker_certificate_names_;
  std::string capability_key_;  // empty: capabilities off
  int64_t capability_ttl_ms_ = 0;
  ServiceLimits limits_;
  // Arenas of the calls whose replies carry block plans (arena_messages.h).
  ArenaMessageAllocator<v1::OpenSequenceRequest, v1::OpenSequenceResponse>
      open_messages_;
  ArenaMessageAllocator<v1::ExtendSequenceRequest, v1::ExtendSequenceResponse>
      extend_messages_;
  ArenaMessageAllocator<v1::ForkSequenceRequest, v1::ForkSequenceResponse>
      fork_messages_;
  ArenaMessageAllocator<v1::CloseSequenceRequest, v1::CloseSequenceResponse>
      close_messages_;
  ArenaMessageAllocator<v1::TruncateSequenceRequest,
                        v1::TruncateSequenceResponse>
      truncate_messages_;
  ArenaMessageAllocator<v1::GetSequenceRequest, v1::GetSequenceResponse>
      get_messages_;
  // WatchEvents streams open now (ServiceLimits::max_watchers); shared with
  // the reactors, which may finish after a call returns.
  std::shared_ptr<std::atomic<uint32_t>> watchers_ =
      std::make_shared<std::atomic<uint32_t>>(0);
  // SequenceCalls streams open now (ServiceLimits::max_call_streams).
  std::shared_ptr<std::atomic<uint32_t>> call_streams_ =
      std::make_shared<std::atomic<uint32_t>>(0);
  CallRecorder record_call_;
  // SequenceCalls' replies (manager_service_stream.cc).
  ArenaPool reply_arenas_;
  const int64_t worker_rpc_timeout_ms_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<v1::Worker::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials_
      ABSL_GUARDED_BY(mu_);
  std::string worker_server_name_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // worker calls not yet completed
  absl::Notification stop_;
  std::thread checker_;
  absl::Mutex tasks_mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(tasks_mu_);
  bool stopping_ ABSL_GUARDED_BY(tasks_mu_) = false;
  std::thread pressure_;
};

}  // namespace triax::manager
