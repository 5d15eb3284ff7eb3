// ManagerService: the read-only lists and lookups (ListWorkers,
// ListTenants, GetSequence, ListSequences, QueryTrace, ListPolicies,
// GetCalibration), scoped to the caller's tenant with --auth=token.
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

grpc::ServerUnaryReactor* ManagerService::ListWorkers(
    grpc::CallbackServerContext* ctx, const v1::ListWorkersRequest* req,
    v1::ListWorkersResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.Admin(*ctx, "ListWorkers"));
    auto r = core_->ListWorkers(PageOf(*req));
    if (!r.ok()) return r.status();
    for (const WorkerInfo& w : r->items) ToProto(w, resp->add_workers());
    resp->set_next_page_token(r->next_page_token);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::ListTenants(
    grpc::CallbackServerContext* ctx, const v1::ListTenantsRequest* req,
    v1::ListTenantsResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_ASSIGN_OR_RETURN(const std::string scope,
                           auth_.TenantScope(*ctx, "ListTenants", ""));
    if (!scope.empty()) {
      // A tenant sees itself only (no paging: one item).
      auto own = core_->GetTenant(scope);
      if (!own.ok()) return own.status();
      ToProto(*own, resp->add_tenants());
      return absl::OkStatus();
    }
    auto r = core_->ListTenants(PageOf(*req));
    if (!r.ok()) return r.status();
    for (const TenantInfo& t : r->items) ToProto(t, resp->add_tenants());
    resp->set_next_page_token(r->next_page_token);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::GetSequence(
    grpc::CallbackServerContext* ctx, const v1::GetSequenceRequest* req,
    v1::GetSequenceResponse* resp) {
  return Unary(core_, ctx, [&] { return DoGet(*ctx, *req, resp); });
}

absl::Status ManagerService::DoGet(const grpc::ServerContextBase& ctx,
                                   const v1::GetSequenceRequest& req,
                                   v1::GetSequenceResponse* resp) {
  TRIAX_RETURN_IF_ERROR(
      req.tenant_id().empty()
          ? auth_.Admin(ctx, "GetSequence (no tenant_id: any tenant's)")
          : auth_.Tenant(ctx, "GetSequence", req.tenant_id()));
  auto r = core_->GetSequence(req.tenant_id(), req.sequence_id());
  if (!r.ok()) return r.status();
  ToProto(*r, resp->mutable_sequence());
  SignSequence(resp->mutable_sequence());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* ManagerService::ListSequences(
    grpc::CallbackServerContext* ctx, const v1::ListSequencesRequest* req,
    v1::ListSequencesResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_ASSIGN_OR_RETURN(
        const std::string tenant,
        auth_.TenantScope(*ctx, "ListSequences", req->tenant_id()));
    auto r = core_->ListSequences(tenant, req->include_closed(), PageOf(*req));
    if (!r.ok()) return r.status();
    for (const SequenceInfo& s : r->items) ToProto(s, resp->add_sequences());
    resp->set_next_page_token(r->next_page_token);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::QueryTrace(
    grpc::CallbackServerContext* ctx, const v1::QueryTraceRequest* req,
    v1::QueryTraceResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_ASSIGN_OR_RETURN(const std::string scope,
                           auth_.TenantScope(*ctx, "QueryTrace", ""));
    auto r = core_->QueryTrace(req->lineage_id(), PageOf(*req));
    if (!r.ok()) return r.status();
    if (!scope.empty()) {
      // A tenant traces only blocks its own sequences made, and sees only
      // its own events of them (a block shared by prefix reuse is not
      // another tenant's window into it).
      if (!core_->GetSequence(scope, r->sequence_id).ok()) {
        return absl::PermissionDeniedError(absl::StrCat(
            "QueryTrace: lineage_id=", req->lineage_id(),
            " was made by a sequence that is not tenant ", Quote(scope), "'s"));
      }
      std::vector<Event> own;
      for (Event& e : r->events) {
        if (e.tenant_id.empty() || e.tenant_id == scope) {
          own.push_back(std::move(e));
        }
      }
      r->events = std::move(own);
    }
    ToProto(*r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::ListPolicies(
    grpc::CallbackServerContext* ctx, const v1::ListPoliciesRequest* req,
    v1::ListPoliciesResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.User(*ctx, "ListPolicies"));
    auto r = core_->ListPolicies(PageOf(*req));
    if (!r.ok()) return r.status();
    for (const PolicyInfo& p : r->items) ToProto(p, resp->add_policies());
    resp->set_next_page_token(r->next_page_token);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ManagerService::GetCalibration(
    grpc::CallbackServerContext* ctx, const v1::GetCalibrationRequest* req,
    v1::GetCalibrationResponse* resp) {
  return Unary(core_, ctx, [&]() -> absl::Status {
    TRIAX_RETURN_IF_ERROR(auth_.User(*ctx, "GetCalibration"));
    auto r = core_->GetCalibration(req->model());
    if (!r.ok()) return r.status();
    ToProto(*r, resp->mutable_table());
    return absl::OkStatus();
  });
}

}  // namespace triax::manager
