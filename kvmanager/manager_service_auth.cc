// ManagerService: bearer tokens (IssueToken, RevokeToken, ListTokens) and
// the capabilities it signs (manager_service.h "RequireTokens";
// docs/security.md).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/capability.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_unary.h"

namespace triax::manager {

v1::Capability ManagerService::ManagerCapability(
    const std::string& worker_id, const std::string& tenant_id,
    const std::string& sequence_id) const {
  v1::Capability cap;
  cap.set_tenant_id(tenant_id);
  cap.set_sequence_id(sequence_id);
  cap.set_worker_id(worker_id);
  // Long enough for the slowest worker call the manager makes.
  cap.set_expires_unix_ms(core_->NowMs() +
                          std::max<int64_t>(worker_rpc_timeout_ms_, 60000));
  cap.set_scope(v1::Capability::SCOPE_MANAGER);
  SignCapability(capability_key_, &cap);
  return cap;
}

void ManagerService::SignWorkerCall(grpc::ClientContext* ctx,
                                    const std::string& worker_id,
                                    const std::string& tenant_id,
                                    const std::string& sequence_id) const {
  if (capability_key_.empty()) return;
  AddCapability(ctx, ManagerCapability(worker_id, tenant_id, sequence_id));
}

void ManagerService::SignSequence(v1::SequenceInfo* info) const {
  info->clear_capabilities();
  if (capability_key_.empty() || info->worker_id().empty()) return;
  const int64_t expires = core_->NowMs() + capability_ttl_ms_;
  v1::Capability* own = info->add_capabilities();
  own->set_tenant_id(info->tenant_id());
  own->set_sequence_id(info->sequence_id());
  own->set_worker_id(info->worker_id());
  own->set_expires_unix_ms(expires);
  own->set_scope(v1::Capability::SCOPE_CLIENT);
  own->set_max_tokens(info->num_tokens());
  SignCapability(capability_key_, own);
  if (info->prefix_blocks() > 0 && !info->prefix_sequence_id().empty()) {
    v1::Capability* fork = info->add_capabilities();
    fork->set_tenant_id(info->prefix_tenant_id().empty()
                            ? info->tenant_id()
                            : info->prefix_tenant_id());
    fork->set_sequence_id(info->prefix_sequence_id());
    fork->set_worker_id(info->worker_id());
    fork->set_expires_unix_ms(expires);
    fork->set_scope(v1::Capability::SCOPE_FORK);
    SignCapability(capability_key_, fork);
  }
}

grpc::ServerUnaryReactor* ManagerService::IssueToken(
    grpc::CallbackServerContext* ctx, const v1::IssueTokenRequest* req,
    v1::IssueTokenResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "IssueToken"));
    auto r = core_->IssueToken(req->role(), req->tenant_id(),
                               req->ttl_seconds(), req->description());
    if (!r.ok()) return r.status();
    ToProto(r->record, resp->mutable_info());
    resp->set_token(r->token);
    Log(LogLevel::kInfo, "manager", "token issued",
        absl::StrCat(Kv("token_id", r->record.id), " ",
                     Kv("role", RoleName(r->record.role)), " ",
                     Kv("tenant_id", r->record.tenant_id), " ",
                     Kv("expires_unix_ms", r->record.expires_ms)));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::RevokeToken(
    grpc::CallbackServerContext* ctx, const v1::RevokeTokenRequest* req,
    v1::RevokeTokenResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "RevokeToken"));
    TRIAX_RETURN_IF_ERROR(core_->RevokeToken(req->token_id()));
    Log(LogLevel::kInfo, "manager", "token revoked",
        Kv("token_id", req->token_id()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::ListTokens(
    grpc::CallbackServerContext* ctx, const v1::ListTokensRequest* req,
    v1::ListTokensResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "ListTokens"));
    for (const TokenRecord& t : core_->ListTokens()) {
      ToProto(t, resp->add_tokens());
    }
    return absl::OkStatus();
  });
}

}  // namespace triax::manager
