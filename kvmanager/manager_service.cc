#include "kvmanager/manager_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/capability.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_service_unary.h"
#include "kvmanager/reclaim_round.h"

namespace triax::manager {
namespace {

// The fields Spill, Restore and Evict requests share, from a tier command.
template <typename Req>
Req TierRequest(const TierCommand& c) {
  Req req;
  req.set_request_id(c.request_id);
  req.set_tenant_id(c.tenant_id);
  req.set_sequence_id(c.sequence_id);
  for (const BlockPlan& b : c.blocks) req.add_lineage_ids(b.lineage_id);
  return req;
}

// The background loop ranks every round while a pool or tenant is over,
// else every this many rounds.
constexpr int kIdleRankRounds = 10;

// Streams events of one subscription; deletes itself in OnDone.
// Thread contract: reactions and the subscription's notify callback may run
// concurrently; mu_ serializes them. Lock order: subscription notify mutex ->
// mu_ -> event log mutex.
class WatchReactor final : public grpc::ServerWriteReactor<v1::Event> {
 public:
  // `watchers` counts this stream until OnDone; `limit`:
  // ServiceLimits::max_events_per_watch.
  WatchReactor(EventLog* log, const v1::WatchEventsRequest& req,
               std::shared_ptr<std::atomic<uint32_t>> watchers, uint64_t limit)
      : max_events_(req.max_events()),
        replay_only_(req.replay_only()),
        limit_(limit),
        watchers_(std::move(watchers)) {
    sub_ = log->Subscribe(FromProto(req), req.from_id());
    sub_->SetNotify([this] { Pump(); });
    Pump();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
        return;
      }
      if (cancelled_) {
        FinishLocked(
            grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
        return;
      }
    }
    Pump();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!writing_) {
      FinishLocked(
          grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
    }
  }

  void OnDone() override {
    sub_->Cancel();
    watchers_->fetch_sub(1);
    delete this;
  }

 private:
  void Pump() {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_) return;
    if (cancelled_) {
      FinishLocked(
          grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
      return;
    }
    if (max_events_ != 0 && sent_ >= max_events_) {
      FinishLocked(grpc::Status::OK);
      return;
    }
    Event event;
    absl::Status end;
    switch (sub_->Next(&event, &end)) {
      case EventSubscription::Result::kEvent:
        if (limit_ != 0 && sent_ >= limit_) {
          FinishLocked(grpc::Status(
              grpc::StatusCode::RESOURCE_EXHAUSTED,
              absl::StrCat("this watch sent ", sent_,
                           " events, the limit max_events_per_watch = ", limit_,
                           "; watch again with from_id = ", event.id)));
          return;
        }
        out_.Clear();
        ToProto(event, &out_);
        ++sent_;
        writing_ = true;
        StartWrite(&out_);
        return;
      case EventSubscription::Result::kEmpty:
        // Everything retained is sent: a replay ends here.
        if (replay_only_) FinishLocked(grpc::Status::OK);
        return;  // the notify callback calls Pump again
      case EventSubscription::Result::kEnded:
        FinishLocked(ToGrpcStatus(end));
        return;
    }
  }

  void FinishLocked(const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  const uint32_t max_events_;
  const bool replay_only_;
  const uint64_t limit_;
  const std::shared_ptr<std::atomic<uint32_t>> watchers_;
  std::shared_ptr<EventSubscription> sub_;
  absl::Mutex mu_;
  v1::Event out_ ABSL_GUARDED_BY(mu_);
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

void FinishDurable(ManagerCore* core, grpc::ServerUnaryReactor* reactor,
                   grpc::Status status) {
  core->WhenDurable(
      ManagerCore::TakeDurableTicket(),
      [reactor, status = std::move(status)] { reactor->Finish(status); });
}

ManagerService::ManagerService(ManagerCore* core, int64_t check_interval_ms,
                               int64_t worker_rpc_timeout_ms,
                               int64_t pressure_interval_ms)
    : core_(core), worker_rpc_timeout_ms_(worker_rpc_timeout_ms) {
  SetMessageAllocatorFor_OpenSequence(&open_messages_);
  SetMessageAllocatorFor_ExtendSequence(&extend_messages_);
  SetMessageAllocatorFor_ForkSequence(&fork_messages_);
  SetMessageAllocatorFor_CloseSequence(&close_messages_);
  SetMessageAllocatorFor_TruncateSequence(&truncate_messages_);
  SetMessageAllocatorFor_GetSequence(&get_messages_);
  if (check_interval_ms > 0) {
    checker_ = std::thread(
        [this, check_interval_ms] { CheckLoop(check_interval_ms); });
  }
  pressure_ = std::thread(
      [this, pressure_interval_ms] { PressureLoop(pressure_interval_ms); });
}

ManagerService::~ManagerService() { Stop(); }

void ManagerService::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (checker_.joinable()) checker_.join();
  {
    absl::MutexLock lock(&tasks_mu_);
    stopping_ = true;
  }
  if (pressure_.joinable()) pressure_.join();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &in_flight_));
}

void ManagerService::CheckLoop(int64_t interval_ms) {
  while (
      !stop_.WaitForNotificationWithTimeout(absl::Milliseconds(interval_ms))) {
    std::vector<std::string> suspect;
    for (const std::string& id : core_->CheckWorkers(&suspect)) {
      Log(LogLevel::kWarn, "manager", "worker marked down: no heartbeat",
          absl::StrCat(
              Kv("worker_id", id), " ",
              Kv("timeout_ms", core_->options().worker_down_timeout_ms)));
    }
    for (const std::string& id : suspect) {
      Log(LogLevel::kWarn, "manager", "worker suspect: no heartbeat",
          absl::StrCat(Kv("worker_id", id), " ",
                       Kv("timeout_ms", core_->options().worker_timeout_ms)));
    }
  }
}

void ManagerService::Post(std::function<void()> task) {
  absl::MutexLock lock(&tasks_mu_);
  tasks_.push_back(std::move(task));
}

void ManagerService::PressureLoop(int64_t interval_ms) {
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tasks_mu_) {
    return stopping_ || !tasks_.empty();
  };
  absl::Time next_round =
      absl::Now() + absl::Milliseconds(interval_ms > 0 ? interval_ms : 0);
  int idle_rounds = 0;
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&tasks_mu_);
      if (interval_ms > 0) {
        tasks_mu_.AwaitWithDeadline(absl::Condition(&ready), next_round);
      } else {
        tasks_mu_.Await(absl::Condition(&ready));
      }
      if (!tasks_.empty()) {
        task = std::move(tasks_.front());
        tasks_.pop_front();
      } else if (stopping_) {
        return;
      }
    }
    if (task) {
      // Tasks left at shutdown still run: each finishes a reply.
      task();
      continue;
    }
    if (interval_ms > 0 && absl::Now() >= next_round) {
      // Rank when there is work, and at least every kIdleRankRounds rounds
      // so GetPressure's snapshot stays fresh.
      if (core_->NeedsReclaim() || ++idle_rounds >= kIdleRankRounds) {
        idle_rounds = 0;
        core_->RefreshRanking();
        // Further stages (blocks acted on ranked again, so a block may be
        // demoted twice, then spilled) while a pool is still above its high
        // watermark, each stage applied something, and within one interval.
        const absl::Time until = absl::Now() + absl::Milliseconds(interval_ms);
        for (TierPlanOutcome out = RunTierPlan(core_->PlanPressure());
             out.applied() > 0 && core_->NeedsReclaim() && absl::Now() < until;
             out = RunTierPlan(core_->PlanPressure())) {
          core_->RefreshRanking();
        }
      }
      next_round = absl::Now() + absl::Milliseconds(interval_ms);
    }
  }
}

TierPlanOutcome ManagerService::RunTierPlan(const TierPlan& plan) {
  if (plan.token == 0) return TierPlanOutcome{};
  // The plan is on disk (its sequences in doubt) before any worker acts.
  core_->AwaitDurable();
  std::vector<absl::Status> results;
  results.reserve(plan.commands.size());
  uint64_t blocks = 0;
  for (const TierCommand& c : plan.commands) {
    blocks += c.blocks.size();
    std::shared_ptr<v1::Worker::Stub> stub = WorkerStub(c.worker_address);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(worker_rpc_timeout_ms_));
    SignWorkerCall(&ctx, c.worker_id, c.tenant_id, c.sequence_id);
    grpc::Status status;
    const char* what = "";
    switch (c.kind) {
      case TierCommand::Kind::kDemote: {
        what = "Demote";
        v1::DemoteRequest req;
        req.set_request_id(c.request_id);
        req.set_tenant_id(c.tenant_id);
        req.set_sequence_id(c.sequence_id);
        for (const BlockPlan& b : c.blocks) ToProto(b, req.add_blocks());
        v1::DemoteResponse resp;
        status = stub->Demote(&ctx, req, &resp);
        break;
      }
      case TierCommand::Kind::kSpill: {
        what = "Spill";
        auto req = TierRequest<v1::SpillRequest>(c);
        req.set_tier(static_cast<v1::Tier>(c.tier));
        v1::SpillResponse resp;
        status = stub->Spill(&ctx, req, &resp);
        break;
      }
      case TierCommand::Kind::kRestore: {
        what = "Restore";
        v1::RestoreResponse resp;
        status = stub->Restore(&ctx, TierRequest<v1::RestoreRequest>(c), &resp);
        break;
      }
      case TierCommand::Kind::kEvict: {
        what = "Evict";
        v1::EvictResponse resp;
        status = stub->Evict(&ctx, TierRequest<v1::EvictRequest>(c), &resp);
        break;
      }
    }
    absl::Status result;
    if (!status.ok()) {
      const absl::Status ws = FromGrpcStatus(status);
      result =
          absl::Status(ws.code(), absl::StrCat("worker ", Quote(c.worker_id),
                                               " ", what, ": ", ws.message()));
    }
    results.push_back(std::move(result));
  }
  TierPlanOutcome outcome;
  absl::Status fin = core_->FinishTierPlan(plan.token, results, &outcome);
  size_t failed = 0;
  std::string first_error;
  for (const absl::Status& r : results) {
    if (r.ok()) continue;
    if (failed++ == 0) first_error = r.ToString();
  }
  Log(failed > 0 ? LogLevel::kWarn : LogLevel::kInfo, "manager",
      "tier plan applied",
      absl::StrCat(
          Kv("reason", plan.reason), " ", Kv("commands", plan.commands.size()),
          " ", Kv("blocks", blocks), " ", Kv("bytes", plan.bytes), " ",
          Kv("failed", failed),
          failed == 0 ? "" : absl::StrCat(" ", Kv("first_error", first_error)),
          fin.ok() ? "" : absl::StrCat(" ", Kv("error", fin.ToString()))));
  return outcome;
}

TierPlanOutcome ManagerService::RunReclaimStage(const TierPlan& plan) {
  TierPlanOutcome outcome = RunTierPlan(plan);
  // Refresh when pages moved, or when a worker refused for room (the room
  // the plan counted on was stale).
  if (outcome.applied() == 0 &&
      !(outcome.failed_commands > 0 &&
        absl::IsResourceExhausted(outcome.first_error))) {
    return outcome;
  }
  std::map<std::string, std::string> workers;  // id -> address
  for (const TierCommand& c : plan.commands) {
    workers.emplace(c.worker_id, c.worker_address);
  }
  for (const auto& [id, address] : workers) RefreshRoom(id, address);
  return outcome;
}

void ManagerService::DescribeAndAdopt(const std::string& worker_id,
                                      const std::string& address,
                                      const std::vector<std::string>& ids) {
  constexpr size_t kChunk = 1024;  // the worker's limit per request
  for (size_t i = 0; i < ids.size(); i += kChunk) {
    v1::GetInventoryRequest req;
    for (size_t j = i; j < std::min(ids.size(), i + kChunk); ++j) {
      req.add_describe_sequence_ids(ids[j]);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(worker_rpc_timeout_ms_));
    SignWorkerCall(&ctx, worker_id, "", "");
    v1::Inventory inv;
    const grpc::Status st = WorkerStub(address)->GetInventory(&ctx, req, &inv);
    absl::Status adopted = FromGrpcStatus(st);
    if (adopted.ok())
      adopted = core_->AdoptWorkerBlocks(worker_id, FromProto(inv));
    Log(adopted.ok() ? LogLevel::kInfo : LogLevel::kWarn, "manager",
        "reconciled sequences in doubt with their worker",
        absl::StrCat(Kv("worker_id", worker_id), " ",
                     Kv("sequences", req.describe_sequence_ids_size()), " ",
                     Kv("described", inv.described_size()), " ",
                     Kv("error", adopted.ok() ? "-" : adopted.ToString())));
  }
}

void ManagerService::RefreshRoom(const std::string& worker_id,
                                 const std::string& address) {
  const uint64_t planned_before = core_->PlannedOn(worker_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(worker_rpc_timeout_ms_));
  SignWorkerCall(&ctx, worker_id, "", "");
  v1::Inventory inv;
  const grpc::Status st =
      WorkerStub(address)->GetInventory(&ctx, v1::GetInventoryRequest{}, &inv);
  if (!st.ok()) {
    // The next heartbeat brings the room; admission counts the old one.
    Log(LogLevel::kWarn, "manager", "inventory for room failed",
        absl::StrCat(Kv("worker_id", worker_id), " ",
                     Kv("error", FromGrpcStatus(st).ToString())));
    return;
  }
  core_->RefreshWorkerRoom(worker_id, FromProto(inv), planned_before);
}

absl::Time ManagerService::ReclaimDeadline(
    const grpc::CallbackServerContext* ctx) const {
  absl::Time deadline =
      absl::Now() + absl::Milliseconds(core_->options().admission_deadline_ms);
  if (ctx != nullptr &&
      ctx->deadline() != std::chrono::system_clock::time_point::max()) {
    deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
  }
  return deadline;
}

absl::Status ManagerService::CheckWorkerCertificate(
    const grpc::ServerContextBase& ctx, absl::string_view method) const {
  if (worker_certificate_names_.empty()) return absl::OkStatus();
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) {
    return absl::UnauthenticatedError(
        absl::StrCat(method,
                     " needs a client certificate; the call has no "
                     "authentication context"));
  }
  return CheckPeerIdentity(*auth, absl::StrCat("/triax.v1.Manager/", method),
                           worker_certificate_names_);
}

grpc::ServerUnaryReactor* ManagerService::RegisterWorker(
    grpc::CallbackServerContext* ctx, const v1::RegisterWorkerRequest* req,
    v1::RegisterWorkerResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Worker(*ctx, "RegisterWorker"));
    TRIAX_RETURN_IF_ERROR(CheckWorkerCertificate(*ctx, "RegisterWorker"));
    auto r = core_->RegisterWorker(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp);
    resp->set_capability_key(capability_key_);
    if (!r->describe_sequence_ids.empty()) {
      Post([this, id = req->worker_id(), address = req->address(),
            ids = r->describe_sequence_ids] {
        DescribeAndAdopt(id, address, ids);
      });
    }
    Log(LogLevel::kInfo, "manager", "worker registered",
        absl::StrCat(
            Kv("worker_id", req->worker_id()), " ",
            Kv("address", req->address()), " ",
            Kv("capacity_bytes", req->capacity_bytes()), " ",
            Kv("lost_sequences", r->lost_sequence_ids.size()), " ",
            Kv("recovered_sequences", r->recovered_sequence_ids.size()), " ",
            Kv("release_sequences", r->release_sequence_ids.size())));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::Heartbeat(
    grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
    v1::HeartbeatResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Worker(*ctx, "Heartbeat"));
    TRIAX_RETURN_IF_ERROR(CheckWorkerCertificate(*ctx, "Heartbeat"));
    auto r = core_->Heartbeat(req->worker_id(), FromProto(req->inventory()),
                              req->incarnation());
    if (!r.ok()) return r.status();
    ToProto(*r, resp);
    resp->set_capability_key(capability_key_);
    if (!r->describe_sequence_ids.empty()) {
      Post([this, id = req->worker_id(), address = r->worker_address,
            ids = r->describe_sequence_ids] {
        DescribeAndAdopt(id, address, ids);
      });
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::CreateTenant(
    grpc::CallbackServerContext* ctx, const v1::CreateTenantRequest* req,
    v1::CreateTenantResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "CreateTenant"));
    auto r = core_->CreateTenant(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_tenant());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::SetBudget(
    grpc::CallbackServerContext* ctx, const v1::SetBudgetRequest* req,
    v1::SetBudgetResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "SetBudget"));
    if (!req->has_budget())
      return absl::InvalidArgumentError("budget is not set");
    auto r = core_->SetBudget(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_tenant());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::GetPressure(
    grpc::CallbackServerContext* ctx, const v1::GetPressureRequest* req,
    v1::GetPressureResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "GetPressure"));
    if (req->top() > 10000) {
      return absl::InvalidArgumentError(
          absl::StrCat("top ", req->top(), " is above the limit 10000"));
    }
    ToProto(core_->GetPressure(req->top() == 0 ? 20 : req->top()), resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::PutPolicy(
    grpc::CallbackServerContext* ctx, const v1::PutPolicyRequest* req,
    v1::PutPolicyResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "PutPolicy"));
    if (!req->has_policy())
      return absl::InvalidArgumentError("policy is not set");
    auto r = core_->PutPolicy(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_policy());
    Log(LogLevel::kInfo, "manager", "policy stored",
        absl::StrCat(Kv("name", r->name), " ", Kv("rules", r->rules.size())));
    return absl::OkStatus();
  });
}

void ManagerService::SetWorkerCredentials(
    std::shared_ptr<grpc::ChannelCredentials> creds, std::string server_name) {
  absl::MutexLock lock(&mu_);
  worker_credentials_ = std::move(creds);
  worker_server_name_ = std::move(server_name);
}

std::shared_ptr<v1::Worker::Stub> ManagerService::WorkerStub(
    const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = stubs_[address];
  if (stub == nullptr) {
    grpc::ChannelArguments args;
    if (worker_credentials_ != nullptr && !worker_server_name_.empty()) {
      args.SetSslTargetNameOverride(worker_server_name_);
    }
    stub = v1::Worker::NewStub(grpc::CreateCustomChannel(
        address,
        worker_credentials_ != nullptr ? worker_credentials_
                                       : grpc::InsecureChannelCredentials(),
        args));
  }
  return stub;
}

grpc::ServerUnaryReactor* ManagerService::DemoteBlocks(
    grpc::CallbackServerContext* ctx, const v1::DemoteBlocksRequest* req,
    v1::DemoteBlocksResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (absl::Status denied = auth_.Admin(*ctx, "DemoteBlocks"); !denied.ok()) {
    reactor->Finish(ToGrpcStatus(denied));
    return reactor;
  }
  auto prepared = core_->PrepareDemote(FromProto(*req));
  if (!prepared.ok()) {
    FinishDurable(core_, reactor, ToGrpcStatus(prepared.status()));
    return reactor;
  }
  if (prepared->done) {  // an idempotent repeat
    ToProto(*prepared->done, resp);
    FinishDurable(core_, reactor, grpc::Status::OK);
    return reactor;
  }
  const uint64_t token = prepared->token;
  if (prepared->blocks.empty()) {  // every block already has its encoding
    auto r = core_->CommitDemote(token);
    if (r.ok()) ToProto(*r, resp);
    FinishDurable(core_, reactor, ToGrpcStatus(r.status()));
    return reactor;
  }
  const std::string worker_id = prepared->worker_id;
  const int64_t delta = prepared->bytes_delta;
  const size_t blocks = prepared->blocks.size();
  CallWorkerDemote(
      *prepared, [this, reactor, resp, token, worker_id, delta, blocks](
                     const absl::Status& worker, uint64_t pages) {
        absl::Status result;
        if (!worker.ok()) {
          core_->AbortDemote(token);
          result = worker;
          Log(LogLevel::kWarn, "manager", "demote failed on the worker",
              absl::StrCat(Kv("worker_id", worker_id), " ",
                           Kv("error", result.ToString())));
        } else {
          auto r = core_->CommitDemote(token);
          if (r.ok()) {
            ToProto(*r, resp);
            Log(LogLevel::kInfo, "manager", "blocks re-encoded",
                absl::StrCat(
                    Kv("worker_id", worker_id), " ", Kv("blocks", blocks), " ",
                    Kv("bytes_delta", delta), " ", Kv("pages", pages)));
          }
          result = r.status();
        }
        FinishDurable(core_, reactor, ToGrpcStatus(result));
      });
  return reactor;
}

void ManagerService::CallWorkerDemote(
    const DemotePrepared& prepared,
    std::function<void(const absl::Status&, uint64_t)> done) {
  // The worker call's state lives until its completion callback.
  struct Call {
    grpc::ClientContext ctx;
    v1::DemoteRequest req;
    v1::DemoteResponse resp;
    std::shared_ptr<v1::Worker::Stub> stub;
    std::function<void(const absl::Status&, uint64_t)> done;
  };
  // The prepare is on disk (its sequence in doubt) before the worker acts.
  core_->AwaitDurable();
  auto* call = new Call;
  ToProto(prepared, &call->req);
  call->stub = WorkerStub(prepared.worker_address);
  call->done = std::move(done);
  call->ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(worker_rpc_timeout_ms_));
  SignWorkerCall(&call->ctx, prepared.worker_id, call->req.tenant_id(),
                 call->req.sequence_id());
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  const std::string worker_id = prepared.worker_id;
  call->stub->async()->Demote(
      &call->ctx, &call->req, &call->resp,
      [this, call, worker_id](const grpc::Status& status) {
        absl::Status result;
        if (!status.ok()) {
          const absl::Status ws = FromGrpcStatus(status);
          result =
              absl::Status(ws.code(), absl::StrCat("worker ", Quote(worker_id),
                                                   " Demote: ", ws.message()));
        }
        call->done(result, call->resp.pages_reencoded());
        delete call;
        absl::MutexLock lock(&mu_);
        --in_flight_;
      });
}

grpc::ServerUnaryReactor* ManagerService::PutCalibration(
    grpc::CallbackServerContext* ctx, const v1::PutCalibrationRequest* req,
    v1::PutCalibrationResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "PutCalibration"));
    if (!req->has_table())
      return absl::InvalidArgumentError("table is not set");
    if (!req->table().has_shape())
      return absl::InvalidArgumentError("table.shape is not set");
    auto r = core_->PutCalibration(FromProto(*req));
    if (!r.ok()) return r.status();
    resp->set_entries(*r);
    Log(LogLevel::kInfo, "manager", "calibration stored",
        absl::StrCat(Kv("model", req->table().model()), " ", Kv("entries", *r),
                     " ", Kv("tool", req->table().source().tool()), " ",
                     Kv("dataset", req->table().source().dataset())));
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::Event>* ManagerService::WatchEvents(
    grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest* req) {
  absl::Status invalid;
  absl::StatusOr<std::string> scope =
      auth_.TenantScope(*ctx, "WatchEvents", req->tenant_id());
  if (!scope.ok()) invalid = scope.status();
  if (invalid.ok() && !req->tenant_id().empty())
    invalid = ValidateId("tenant_id", req->tenant_id());
  if (invalid.ok() && !req->sequence_id().empty()) {
    invalid = ValidateId("sequence_id", req->sequence_id());
  }
  // Counted from here; a refused stream gives its place back at once.
  const uint32_t open = watchers_->fetch_add(1);
  if (invalid.ok() && limits_.max_watchers != 0 &&
      open >= limits_.max_watchers) {
    invalid = absl::ResourceExhaustedError(
        absl::StrCat(open,
                     " WatchEvents streams are open, the limit "
                     "max_watchers = ",
                     limits_.max_watchers));
  }
  if (!invalid.ok()) {
    watchers_->fetch_sub(1);
    // Rejected before any write: a reactor that only finishes.
    class Rejected final : public grpc::ServerWriteReactor<v1::Event> {
     public:
      explicit Rejected(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
      void OnDone() override { delete this; }
    };
    return new Rejected(invalid);
  }
  v1::WatchEventsRequest scoped = *req;  // a tenant watches its own events
  scoped.set_tenant_id(*scope);
  return new WatchReactor(&core_->events(), scoped, watchers_,
                          limits_.max_events_per_watch);
}

}  // namespace triax::manager
