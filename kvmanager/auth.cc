#include "kvmanager/auth.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace triax::manager {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

std::string Who(const Principal& p) {
  if (p.role == TokenRole::kTenant) {
    return absl::StrCat("token ", p.token_id, " (tenant ", Quote(p.tenant_id),
                        ")");
  }
  return absl::StrCat("token ", p.token_id, " (", RoleName(p.role), ")");
}

}  // namespace

Authorizer::Authorizer(const TokenStore* tokens,
                       std::function<int64_t()> now_ms)
    : tokens_(tokens), now_ms_(std::move(now_ms)) {}

absl::StatusOr<std::optional<Principal>> Authorizer::Caller(
    const grpc::ServerContextBase& ctx, absl::string_view method) const {
  if (!enabled()) return std::optional<Principal>();
  const auto& md = ctx.client_metadata();
  auto range = md.equal_range("authorization");
  if (range.first == range.second) {
    return absl::UnauthenticatedError(absl::StrCat(
        method,
        ": no bearer token (metadata \"authorization: Bearer <token>\"); "
        "this manager requires one (--auth=token)"));
  }
  if (std::next(range.first) != range.second) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": more than one authorization metadata value"));
  }
  const absl::string_view value(range.first->second.data(),
                                range.first->second.size());
  if (!absl::StartsWith(value, kBearer)) {
    return absl::UnauthenticatedError(absl::StrCat(
        method, ": the authorization metadata is not \"Bearer <token>\""));
  }
  absl::StatusOr<Principal> p =
      tokens_->Verify(value.substr(kBearer.size()), now_ms_());
  if (!p.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": ", p.status().message()));
  }
  return std::optional<Principal>(*std::move(p));
}

absl::Status Authorizer::Admin(const grpc::ServerContextBase& ctx,
                               absl::string_view method) const {
  absl::StatusOr<std::optional<Principal>> p = Caller(ctx, method);
  if (!p.ok()) return p.status();
  if (!p->has_value() || (*p)->role == TokenRole::kAdmin)
    return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(method, ": ", Who(**p), " is not an admin token"));
}

absl::Status Authorizer::Worker(const grpc::ServerContextBase& ctx,
                                absl::string_view method) const {
  absl::StatusOr<std::optional<Principal>> p = Caller(ctx, method);
  if (!p.ok()) return p.status();
  if (!p->has_value() || (*p)->role == TokenRole::kWorker)
    return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(method, ": ", Who(**p),
                   " is not a worker token; only workers register "
                   "and heartbeat"));
}

absl::Status Authorizer::Tenant(const grpc::ServerContextBase& ctx,
                                absl::string_view method,
                                absl::string_view tenant_id) const {
  absl::StatusOr<std::optional<Principal>> p = Caller(ctx, method);
  if (!p.ok()) return p.status();
  if (!p->has_value()) return absl::OkStatus();
  const Principal& who = **p;
  if (who.role == TokenRole::kAdmin) return absl::OkStatus();
  if (who.role == TokenRole::kTenant && who.tenant_id == tenant_id) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      method, ": ", Who(who), " may not act for tenant_id=", Quote(tenant_id)));
}

absl::Status Authorizer::User(const grpc::ServerContextBase& ctx,
                              absl::string_view method) const {
  absl::StatusOr<std::optional<Principal>> p = Caller(ctx, method);
  if (!p.ok()) return p.status();
  if (!p->has_value() || (*p)->role != TokenRole::kWorker)
    return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(method, ": ", Who(**p), " is a worker token"));
}

absl::StatusOr<std::string> Authorizer::TenantScope(
    const grpc::ServerContextBase& ctx, absl::string_view method,
    absl::string_view requested) const {
  absl::StatusOr<std::optional<Principal>> p = Caller(ctx, method);
  if (!p.ok()) return p.status();
  if (!p->has_value() || (*p)->role == TokenRole::kAdmin) {
    return std::string(requested);
  }
  const Principal& who = **p;
  if (who.role == TokenRole::kTenant &&
      (requested.empty() || requested == who.tenant_id)) {
    return who.tenant_id;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      method, ": ", Who(who), " may not see ",
      requested.empty() ? std::string("every tenant")
                        : absl::StrCat("tenant_id=", Quote(requested))));
}

}  // namespace triax::manager
