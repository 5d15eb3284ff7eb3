#include "kvmanager/manager_service.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/log.h"
#include "kvmanager/convert.h"

namespace triax::manager {
namespace {

// The one helper every unary RPC goes through: runs `body` (which fills the
// response and returns a Status) and finishes with the mapped status.
template <typename F>
grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, F&& body) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(body()));
  return reactor;
}

// Streams events of one subscription; deletes itself in OnDone.
// Thread contract: reactions and the subscription's notify callback may run
// concurrently; mu_ serializes them. Lock order: subscription notify mutex ->
// mu_ -> event log mutex.
class WatchReactor final : public grpc::ServerWriteReactor<v1::Event> {
 public:
  WatchReactor(EventLog* log, const v1::WatchEventsRequest& req)
      : max_events_(req.max_events()) {
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
        out_.Clear();
        ToProto(event, &out_);
        ++sent_;
        writing_ = true;
        StartWrite(&out_);
        return;
      case EventSubscription::Result::kEmpty:
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
  std::shared_ptr<EventSubscription> sub_;
  absl::Mutex mu_;
  v1::Event out_ ABSL_GUARDED_BY(mu_);
  uint32_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

ManagerService::ManagerService(ManagerCore* core, int64_t check_interval_ms,
                               int64_t worker_rpc_timeout_ms)
    : core_(core), worker_rpc_timeout_ms_(worker_rpc_timeout_ms) {
  if (check_interval_ms > 0) {
    checker_ = std::thread(
        [this, check_interval_ms] { CheckLoop(check_interval_ms); });
  }
}

ManagerService::~ManagerService() { Stop(); }

void ManagerService::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (checker_.joinable()) checker_.join();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &in_flight_));
}

void ManagerService::CheckLoop(int64_t interval_ms) {
  while (
      !stop_.WaitForNotificationWithTimeout(absl::Milliseconds(interval_ms))) {
    for (const std::string& id : core_->CheckWorkers()) {
      Log(LogLevel::kWarn, "manager", "worker marked down: no heartbeat",
          absl::StrCat(Kv("worker_id", id), " ",
                       Kv("timeout_ms", core_->options().worker_timeout_ms)));
    }
  }
}

grpc::ServerUnaryReactor* ManagerService::RegisterWorker(
    grpc::CallbackServerContext* ctx, const v1::RegisterWorkerRequest* req,
    v1::RegisterWorkerResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->RegisterWorker(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp);
    Log(LogLevel::kInfo, "manager", "worker registered",
        absl::StrCat(Kv("worker_id", req->worker_id()), " ",
                     Kv("address", req->address()), " ",
                     Kv("capacity_bytes", req->capacity_bytes()), " ",
                     Kv("lost_sequences", r->lost_sequence_ids.size())));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::Heartbeat(
    grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
    v1::HeartbeatResponse* resp) {
  return Unary(ctx, [&] {
    return core_->Heartbeat(req->worker_id(), FromProto(req->inventory()));
  });
}

grpc::ServerUnaryReactor* ManagerService::ListWorkers(
    grpc::CallbackServerContext* ctx, const v1::ListWorkersRequest* req,
    v1::ListWorkersResponse* resp) {
  return Unary(ctx, [&] {
    for (const WorkerInfo& w : core_->ListWorkers())
      ToProto(w, resp->add_workers());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::CreateTenant(
    grpc::CallbackServerContext* ctx, const v1::CreateTenantRequest* req,
    v1::CreateTenantResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->CreateTenant(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_tenant());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::SetBudget(
    grpc::CallbackServerContext* ctx, const v1::SetBudgetRequest* req,
    v1::SetBudgetResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    if (!req->has_budget())
      return absl::InvalidArgumentError("budget is not set");
    auto r = core_->SetBudget(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_tenant());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::ListTenants(
    grpc::CallbackServerContext* ctx, const v1::ListTenantsRequest* req,
    v1::ListTenantsResponse* resp) {
  return Unary(ctx, [&] {
    for (const TenantInfo& t : core_->ListTenants())
      ToProto(t, resp->add_tenants());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::OpenSequence(
    grpc::CallbackServerContext* ctx, const v1::OpenSequenceRequest* req,
    v1::OpenSequenceResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    if (!req->has_model())
      return absl::InvalidArgumentError("model is not set");
    auto r = core_->OpenSequence(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_sequence());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::ExtendSequence(
    grpc::CallbackServerContext* ctx, const v1::ExtendSequenceRequest* req,
    v1::ExtendSequenceResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto r = core_->ExtendSequence(FromProto(*req));
  if (!r.ok() || !r->demotion) {
    if (r.ok()) ToProto(*r, resp);
    reactor->Finish(ToGrpcStatus(r.status()));
    return reactor;
  }
  // Allocation policy: demote the blocks whose tag's choice shrank on the
  // worker, then commit (or keep them) and reply. The Extend succeeds either
  // way.
  const uint64_t token = r->demotion->token;
  CallWorkerDemote(*r->demotion, [this, reactor, resp, token](
                                     const absl::Status& worker, uint64_t) {
    auto fin = core_->FinishExtendDemotion(token, worker);
    if (fin.ok()) ToProto(*fin, resp);
    reactor->Finish(ToGrpcStatus(fin.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ManagerService::ForkSequence(
    grpc::CallbackServerContext* ctx, const v1::ForkSequenceRequest* req,
    v1::ForkSequenceResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->ForkSequence(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_sequence());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::CloseSequence(
    grpc::CallbackServerContext* ctx, const v1::CloseSequenceRequest* req,
    v1::CloseSequenceResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->CloseSequence(FromProto(*req));
    if (!r.ok()) return r.status();
    ToProto(*r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::GetSequence(
    grpc::CallbackServerContext* ctx, const v1::GetSequenceRequest* req,
    v1::GetSequenceResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->GetSequence(req->tenant_id(), req->sequence_id());
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_sequence());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::ListSequences(
    grpc::CallbackServerContext* ctx, const v1::ListSequencesRequest* req,
    v1::ListSequencesResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->ListSequences(req->tenant_id(), req->include_closed());
    if (!r.ok()) return r.status();
    for (const SequenceInfo& s : *r) ToProto(s, resp->add_sequences());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::QueryTrace(
    grpc::CallbackServerContext* ctx, const v1::QueryTraceRequest* req,
    v1::QueryTraceResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->QueryTrace(req->lineage_id());
    if (!r.ok()) return r.status();
    ToProto(*r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::PutPolicy(
    grpc::CallbackServerContext* ctx, const v1::PutPolicyRequest* req,
    v1::PutPolicyResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
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

grpc::ServerUnaryReactor* ManagerService::ListPolicies(
    grpc::CallbackServerContext* ctx, const v1::ListPoliciesRequest* req,
    v1::ListPoliciesResponse* resp) {
  return Unary(ctx, [&] {
    for (const PolicyInfo& p : core_->ListPolicies())
      ToProto(p, resp->add_policies());
    return absl::OkStatus();
  });
}

std::shared_ptr<v1::Worker::Stub> ManagerService::WorkerStub(
    const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = stubs_[address];
  if (stub == nullptr) {
    stub = v1::Worker::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return stub;
}

grpc::ServerUnaryReactor* ManagerService::DemoteBlocks(
    grpc::CallbackServerContext* ctx, const v1::DemoteBlocksRequest* req,
    v1::DemoteBlocksResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto prepared = core_->PrepareDemote(FromProto(*req));
  if (!prepared.ok()) {
    reactor->Finish(ToGrpcStatus(prepared.status()));
    return reactor;
  }
  if (prepared->done) {  // an idempotent repeat
    ToProto(*prepared->done, resp);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  const uint64_t token = prepared->token;
  if (prepared->blocks.empty()) {  // every block already has its encoding
    auto r = core_->CommitDemote(token);
    if (r.ok()) ToProto(*r, resp);
    reactor->Finish(ToGrpcStatus(r.status()));
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
        reactor->Finish(ToGrpcStatus(result));
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
  auto* call = new Call;
  ToProto(prepared, &call->req);
  call->stub = WorkerStub(prepared.worker_address);
  call->done = std::move(done);
  call->ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(worker_rpc_timeout_ms_));
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  const std::string worker_id = prepared.worker_id;
  call->stub->async()->Demote(
      &call->ctx, &call->req, &call->resp,
      [this, call, worker_id](grpc::Status status) {
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
  return Unary(ctx, [&]() -> absl::Status {
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

grpc::ServerUnaryReactor* ManagerService::GetCalibration(
    grpc::CallbackServerContext* ctx, const v1::GetCalibrationRequest* req,
    v1::GetCalibrationResponse* resp) {
  return Unary(ctx, [&]() -> absl::Status {
    auto r = core_->GetCalibration(req->model());
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_table());
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::Event>* ManagerService::WatchEvents(
    grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest* req) {
  absl::Status invalid;
  if (!req->tenant_id().empty())
    invalid = ValidateId("tenant_id", req->tenant_id());
  if (invalid.ok() && !req->sequence_id().empty()) {
    invalid = ValidateId("sequence_id", req->sequence_id());
  }
  if (!invalid.ok()) {
    // Rejected before any write: a reactor that only finishes.
    class Rejected final : public grpc::ServerWriteReactor<v1::Event> {
     public:
      explicit Rejected(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
      void OnDone() override { delete this; }
    };
    return new Rejected(invalid);
  }
  return new WatchReactor(&core_->events(), *req);
}

}  // namespace triax::manager
