// ManagerService::TransferSequence (manager_service.h "TransferSequence"):
// prepare, the destination's ImportSequence, commit or abort, FreePages.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/log.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_service.h"

namespace triax::manager {

grpc::ServerUnaryReactor* ManagerService::TransferSequence(
    grpc::CallbackServerContext* ctx, const v1::TransferSequenceRequest* req,
    v1::TransferSequenceResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (absl::Status denied =
          auth_.Tenant(*ctx, "TransferSequence", req->tenant_id());
      !denied.ok()) {
    reactor->Finish(ToGrpcStatus(denied));
    return reactor;
  }
  absl::StatusOr<TransferPrepared> prepared =
      core_->PrepareTransfer(FromProto(*req));
  if (!prepared.ok()) {
    FinishDurable(core_, reactor, ToGrpcStatus(prepared.status()));
    return reactor;
  }
  if (prepared->done) {  // an idempotent repeat of a committed transfer
    ToProto(*prepared->done, resp);
    SignSequence(resp->mutable_sequence());
    FinishDurable(core_, reactor, grpc::Status::OK);
    return reactor;
  }
  // The import call's state lives until its completion callback.
  struct Call {
    grpc::ClientContext ctx;
    v1::ImportSequenceRequest req;
    v1::ImportSequenceResponse resp;
    std::shared_ptr<v1::Worker::Stub> stub;
    TransferPrepared prepared;
  };
  auto* call = new Call;
  ToProto(*prepared, &call->req);
  call->prepared = *std::move(prepared);
  const TransferPrepared& p = call->prepared;
  call->stub = WorkerStub(p.destination_address);
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::milliseconds(p.timeout_ms);
  // The caller's deadline, if sooner: the answer must reach it.
  deadline = std::min(deadline, ctx->deadline());
  call->ctx.set_deadline(deadline);
  if (!capability_key_.empty()) {
    SignWorkerCall(&call->ctx, p.destination_worker_id, p.tenant_id,
                   p.sequence_id);
    *call->req.mutable_source_capability() =
        ManagerCapability(p.source_worker_id, p.tenant_id, p.sequence_id);
  }
  Log(LogLevel::kInfo, "manager", "transfer started",
      absl::StrCat(Kv("transfer", p.transfer_id), " ",
                   Kv("sequence_id", p.sequence_id), " ",
                   Kv("source", p.source_worker_id), " ",
                   Kv("destination", p.destination_worker_id), " ",
                   Kv("blocks", p.blocks.size()), " ",
                   Kv("reserved_bytes", p.reserved_bytes), " ",
                   Kv("timeout_ms", p.timeout_ms)));
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  call->stub->async()->ImportSequence(
      &call->ctx, &call->req, &call->resp,
      [this, call, reactor, resp](const grpc::Status& status) {
        const TransferPrepared& p = call->prepared;
        const std::string what = absl::StrCat(
            "transfer ", p.transfer_id, " of ", Quote(p.sequence_id), " from ",
            Quote(p.source_worker_id), " to ", Quote(p.destination_worker_id),
            ": ");
        absl::Status result;
        if (!status.ok()) {
          const absl::Status ws = FromGrpcStatus(status);
          result = absl::Status(
              ws.code(),
              absl::StrCat(what, "destination ImportSequence: ", ws.message()));
          core_->AbortTransfer(p.token, result);
        } else {
          absl::StatusOr<TransferCommitted> committed =
              core_->CommitTransfer(p.token, FromProto(call->resp));
          if (committed.ok()) {
            ToProto(committed->result, resp);
            SignSequence(resp->mutable_sequence());
            FreePagesBestEffort(p.source_worker_id, committed->source_address,
                                absl::StrCat(p.transfer_id, "-free-source"),
                                committed->tenant_id, committed->sequence_id,
                                "source copy after the commit");
            Log(LogLevel::kInfo, "manager", "transfer committed",
                absl::StrCat(
                    Kv("transfer", p.transfer_id), " ",
                    Kv("sequence_id", p.sequence_id), " ",
                    Kv("destination", p.destination_worker_id), " ",
                    Kv("pages", committed->result.pages), " ",
                    Kv("wire_bytes", committed->result.wire_bytes), " ",
                    Kv("bf16_bytes", committed->result.bf16_bytes), " ",
                    Kv("pull_seconds", committed->result.pull_seconds), " ",
                    Kv("data_path", committed->result.data_path)));
          } else {
            result = committed.status();
          }
        }
        if (!result.ok()) {
          // The destination frees whatever it allocated or installed.
          FreePagesBestEffort(p.destination_worker_id, p.destination_address,
                              absl::StrCat(p.transfer_id, "-free-destination"),
                              p.tenant_id, p.sequence_id,
                              "destination copy of an aborted transfer");
          Log(LogLevel::kWarn, "manager", "transfer aborted",
              absl::StrCat(Kv("transfer", p.transfer_id), " ",
                           Kv("error", result.ToString())));
        }
        FinishDurable(core_, reactor, ToGrpcStatus(result));
        delete call;
        absl::MutexLock lock(&mu_);
        --in_flight_;
      });
  return reactor;
}

void ManagerService::FreePagesBestEffort(const std::string& worker_id,
                                         const std::string& address,
                                         const std::string& request_id,
                                         const std::string& tenant_id,
                                         const std::string& sequence_id,
                                         const std::string& why) {
  struct Call {
    grpc::ClientContext ctx;
    v1::FreePagesRequest req;
    v1::FreePagesResponse resp;
    std::shared_ptr<v1::Worker::Stub> stub;
  };
  auto* call = new Call;
  call->req.set_request_id(request_id);
  call->req.set_tenant_id(tenant_id);
  call->req.set_sequence_id(sequence_id);
  call->stub = WorkerStub(address);
  call->ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(worker_rpc_timeout_ms_));
  SignWorkerCall(&call->ctx, worker_id, tenant_id, sequence_id);
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  call->stub->async()->FreePages(
      &call->ctx, &call->req, &call->resp,
      [this, call, worker_id, why](const grpc::Status& status) {
        // NOT_FOUND: the worker never had it (or freed it already).
        if (!status.ok() &&
            status.error_code() != grpc::StatusCode::NOT_FOUND) {
          Log(LogLevel::kWarn, "manager",
              "FreePages failed; the pages are the worker's orphans until its "
              "next heartbeat's release list or its return",
              absl::StrCat(Kv("worker_id", worker_id), " ",
                           Kv("sequence_id", call->req.sequence_id()), " ",
                           Kv("what", why), " ",
                           Kv("error", FromGrpcStatus(status).ToString())));
        }
        delete call;
        absl::MutexLock lock(&mu_);
        --in_flight_;
      });
}

}  // namespace triax::manager
