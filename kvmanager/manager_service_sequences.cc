// The sequence RPCs: Open, Extend, ReportAccess (with admission after
// reclaim and restores), Fork, Close and Truncate. Each handler body is
// shared by its unary RPC and SequenceCalls (manager_service_stream.cc).
#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_unary.h"
#include "kvmanager/reclaim_round.h"

namespace triax::manager {
namespace {

bool HasSpilledBlocks(const SequenceInfo& s) {
  for (const BlockPlan& b : s.blocks) {
    if (b.tier != Tier::kDevice && !b.evicted) return true;
  }
  return false;
}

void ToProto(const ReclaimReport& r, v1::ReclaimSummary* out) {
  out->set_stages(r.stages);
  out->set_bytes_freed(r.bytes_freed);
  out->set_demotions(r.demotions);
  out->set_spills(r.spills);
  out->set_evictions(r.evictions);
  out->set_failed_commands(r.failed_commands);
}

}  // namespace

absl::Status ManagerService::CheckSpans(int spans) const {
  if (limits_.max_spans_per_request == 0 ||
      static_cast<uint32_t>(spans) <= limits_.max_spans_per_request) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("spans has ", spans, " spans, the limit ",
                   "max_spans_per_request = ", limits_.max_spans_per_request));
}

ManagerService::CallDone ManagerService::UnaryDone(
    grpc::ServerUnaryReactor* reactor) const {
  return [core = core_, reactor](grpc::Status status) {
    FinishDurable(core, reactor, std::move(status));
  };
}

grpc::ServerUnaryReactor* ManagerService::OpenSequence(
    grpc::CallbackServerContext* ctx, const v1::OpenSequenceRequest* req,
    v1::OpenSequenceResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  StartOpen(ctx, *req, resp, UnaryDone(reactor));
  return reactor;
}

void ManagerService::StartOpen(grpc::CallbackServerContext* ctx,
                               const v1::OpenSequenceRequest& req,
                               v1::OpenSequenceResponse* resp, CallDone done) {
  if (absl::Status denied = auth_.Tenant(*ctx, "OpenSequence", req.tenant_id());
      !denied.ok()) {
    done(ToGrpcStatus(denied));
    return;
  }
  if (!req.has_model()) {
    done(ToGrpcStatus(absl::InvalidArgumentError("model is not set")));
    return;
  }
  if (absl::Status s = CheckSpans(req.spans_size()); !s.ok()) {
    done(ToGrpcStatus(s));
    return;
  }
  OpenSequenceRequest open = FromProto(req);
  AdmissionShortfall shortfall;
  auto r = core_->OpenSequence(open, &shortfall);
  if (r.ok() || !absl::IsResourceExhausted(r.status()) ||
      shortfall.request_bytes == 0) {
    if (r.ok()) {
      ToProto(*r, resp->mutable_sequence());
      SignSequence(resp->mutable_sequence());
    }
    done(ToGrpcStatus(r.status()));
    return;
  }
  // Admission after reclaiming: on the pressure executor.
  Post([this, done = std::move(done), resp, open = std::move(open), shortfall,
        refused = r.status(), deadline = ReclaimDeadline(ctx)] {
    ReclaimReport report;
    auto again = AdmitAfterReclaim<SequenceInfo>(
        refused, shortfall, deadline,
        [&](AdmissionShortfall* sf) { return core_->OpenSequence(open, sf); },
        &report);
    if (again.ok()) {
      ToProto(*again, resp->mutable_sequence());
      SignSequence(resp->mutable_sequence());
      ToProto(report, resp->mutable_reclaimed());
    }
    done(ToGrpcStatus(again.status()));
  });
}

grpc::ServerUnaryReactor* ManagerService::ExtendSequence(
    grpc::CallbackServerContext* ctx, const v1::ExtendSequenceRequest* req,
    v1::ExtendSequenceResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  StartExtend(ctx, *req, resp, UnaryDone(reactor));
  return reactor;
}

void ManagerService::StartExtend(grpc::CallbackServerContext* ctx,
                                 const v1::ExtendSequenceRequest& req,
                                 v1::ExtendSequenceResponse* resp,
                                 CallDone done) {
  if (absl::Status denied =
          auth_.Tenant(*ctx, "ExtendSequence", req.tenant_id());
      !denied.ok()) {
    done(ToGrpcStatus(denied));
    return;
  }
  if (absl::Status s = CheckSpans(req.spans_size()); !s.ok()) {
    done(ToGrpcStatus(s));
    return;
  }
  ExtendSequenceRequest extend = FromProto(req);
  AdmissionShortfall shortfall;
  auto r = core_->ExtendSequence(extend, &shortfall);
  if (!r.ok() && absl::IsResourceExhausted(r.status()) &&
      shortfall.request_bytes > 0) {
    Post([this, done = std::move(done), resp, extend = std::move(extend),
          shortfall, refused = r.status(), deadline = ReclaimDeadline(ctx)] {
      ReclaimReport report;
      auto again = AdmitAfterReclaim<ExtendSequenceResult>(
          refused, shortfall, deadline,
          [&](AdmissionShortfall* sf) {
            return core_->ExtendSequence(extend, sf);
          },
          &report);
      if (again.ok()) ToProto(report, resp->mutable_reclaimed());
      FinishExtend(done, resp, std::move(again));
    });
    return;
  }
  FinishExtend(std::move(done), resp, std::move(r));
}

void ManagerService::FinishExtend(CallDone done,
                                  v1::ExtendSequenceResponse* resp,
                                  absl::StatusOr<ExtendSequenceResult> r) {
  if (r.ok() && HasSpilledBlocks(r->sequence)) {
    // The session is active again: bring its spilled blocks back (in the
    // background; a frontend that must not race its next Attend reports
    // active=true first, which waits). Extends of sequences with nothing
    // spilled (the common case) never touch the executor.
    const std::string seq = r->sequence.sequence_id;
    Post([this, seq] {
      ReclaimReport report;
      uint32_t blocks = 0;
      RestoreWithReclaim(seq, ReclaimDeadline(nullptr), &blocks, &report)
          .IgnoreError();
    });
  }
  if (!r.ok() || !r->demotion) {
    if (r.ok()) {
      ToProto(*r, resp);
      SignSequence(resp->mutable_sequence());
    }
    done(ToGrpcStatus(r.status()));
    return;
  }
  // Allocation policy: demote the blocks whose tag's choice shrank on the
  // worker, then commit (or keep them) and reply. The Extend succeeds either
  // way.
  const uint64_t token = r->demotion->token;
  CallWorkerDemote(*r->demotion, [this, done = std::move(done), resp, token](
                                     const absl::Status& worker, uint64_t) {
    auto fin = core_->FinishExtendDemotion(token, worker);
    if (fin.ok()) {
      ToProto(*fin, resp);
      SignSequence(resp->mutable_sequence());
    }
    done(ToGrpcStatus(fin.status()));
  });
}

grpc::ServerUnaryReactor* ManagerService::ReportAccess(
    grpc::CallbackServerContext* ctx, const v1::ReportAccessRequest* req,
    v1::ReportAccessResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  StartReportAccess(ctx, *req, resp, UnaryDone(reactor));
  return reactor;
}

void ManagerService::StartReportAccess(grpc::CallbackServerContext* ctx,
                                       const v1::ReportAccessRequest& req,
                                       v1::ReportAccessResponse* resp,
                                       CallDone done) {
  if (absl::Status denied = auth_.Tenant(*ctx, "ReportAccess", req.tenant_id());
      !denied.ok()) {
    done(ToGrpcStatus(denied));
    return;
  }
  auto plan = core_->ReportAccess(FromProto(req));
  if (!plan.ok()) {
    done(ToGrpcStatus(plan.status()));
    return;
  }
  uint32_t blocks = 0;
  for (const TierCommand& c : plan->commands) blocks += c.blocks.size();
  if (!req.active()) {
    // Neighbours only: restored in the background, the reply goes now.
    resp->set_blocks_prefetching(blocks);
    if (plan->token != 0) {
      Post([this, plan = std::move(*plan)] { RunTierPlan(plan); });
    }
    done(grpc::Status::OK);
    return;
  }
  // Active: the reply waits until the sequence's spilled blocks are back
  // (reclaiming room from other sequences if needed), so the frontend's
  // next Attend finds them on the device.
  Post([this, done = std::move(done), resp, blocks, plan = std::move(*plan),
        seq = req.sequence_id(), deadline = ReclaimDeadline(ctx)] {
    RunTierPlan(plan);
    ReclaimReport report;
    uint32_t restored = 0;
    const absl::Status st =
        RestoreWithReclaim(seq, deadline, &restored, &report);
    resp->set_blocks_prefetching(blocks + restored);
    if (report.stages > 0) ToProto(report, resp->mutable_reclaimed());
    done(ToGrpcStatus(st));
  });
}

template <typename T>
absl::StatusOr<T> ManagerService::AdmitAfterReclaim(
    const absl::Status& refused, AdmissionShortfall shortfall,
    absl::Time deadline,
    const std::function<absl::StatusOr<T>(AdmissionShortfall*)>& retry,
    ReclaimReport* report) {
  absl::StatusOr<T> again = refused;
  // The room the refusal counted is the worker's last report less all that
  // was planned since; what was freed since is not in it. Ask the worker
  // first: the request may fit its real room without taking anything.
  if (!shortfall.worker_id.empty()) {
    for (const WorkerInfo& w : core_->ListWorkers()) {
      if (w.worker_id != shortfall.worker_id) continue;
      if (w.inventory.frame_bytes > 0) RefreshRoom(w.worker_id, w.address);
    }
    AdmissionShortfall fresh;
    again = retry(&fresh);
    if (again.ok() || fresh.request_bytes == 0) return again;
    shortfall = std::move(fresh);
  }
  const absl::Status still = again.status();
  const absl::Status st = ReclaimRound(
      core_, still, &shortfall, deadline,
      [this](const TierPlan& plan) { return RunReclaimStage(plan); },
      [&](AdmissionShortfall* sf) {
        again = retry(sf);
        return again.status();
      },
      report);
  if (!st.ok()) return st;
  return again;
}

absl::Status ManagerService::RestoreWithReclaim(const std::string& sequence_id,
                                                absl::Time deadline,
                                                uint32_t* blocks,
                                                ReclaimReport* report) {
  return RestoreRound(
      core_, sequence_id, deadline,
      [this](const TierPlan& plan) { return RunReclaimStage(plan); }, blocks,
      report);
}

grpc::ServerUnaryReactor* ManagerService::ForkSequence(
    grpc::CallbackServerContext* ctx, const v1::ForkSequenceRequest* req,
    v1::ForkSequenceResponse* resp) {
  return Unary(core_, ctx, [&] { return DoFork(*ctx, *req, resp); });
}

absl::Status ManagerService::DoFork(const grpc::ServerContextBase& ctx,
                                    const v1::ForkSequenceRequest& req,
                                    v1::ForkSequenceResponse* resp) {
  TRIAX_RETURN_IF_ERROR(auth_.Tenant(ctx, "ForkSequence", req.tenant_id()));
  auto r = core_->ForkSequence(FromProto(req));
  if (!r.ok()) return r.status();
  ToProto(*r, resp->mutable_sequence());
  SignSequence(resp->mutable_sequence());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* ManagerService::CloseSequence(
    grpc::CallbackServerContext* ctx, const v1::CloseSequenceRequest* req,
    v1::CloseSequenceResponse* resp) {
  return Unary(core_, ctx, [&] { return DoClose(*ctx, *req, resp); });
}

absl::Status ManagerService::DoClose(const grpc::ServerContextBase& ctx,
                                     const v1::CloseSequenceRequest& req,
                                     v1::CloseSequenceResponse* resp) {
  TRIAX_RETURN_IF_ERROR(auth_.Tenant(ctx, "CloseSequence", req.tenant_id()));
  auto r = core_->CloseSequence(FromProto(req));
  if (!r.ok()) return r.status();
  ToProto(*r, resp);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* ManagerService::TruncateSequence(
    grpc::CallbackServerContext* ctx, const v1::TruncateSequenceRequest* req,
    v1::TruncateSequenceResponse* resp) {
  return Unary(core_, ctx, [&] { return DoTruncate(*ctx, *req, resp); });
}

absl::Status ManagerService::DoTruncate(const grpc::ServerContextBase& ctx,
                                        const v1::TruncateSequenceRequest& req,
                                        v1::TruncateSequenceResponse* resp) {
  TRIAX_RETURN_IF_ERROR(auth_.Tenant(ctx, "TruncateSequence", req.tenant_id()));
  auto r = core_->TruncateSequence(FromProto(req));
  if (!r.ok()) return r.status();
  ToProto(*r, resp);
  return absl::OkStatus();
}

}  // namespace triax::manager
