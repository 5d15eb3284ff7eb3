// Who may make each Manager call (docs/security.md "Identity and roles").
//
// With tokens required (kvmanager --auth=token) every call must carry
// `authorization: Bearer <token>` (token_store.h); the service asks one of
// the checks below first thing and refuses the call before the core sees
// it:
//   UNAUTHENTICATED    no token, a malformed, unknown, revoked or expired
//                      one (the message names the token id, never the
//                      secret);
//   PERMISSION_DENIED  a valid token whose role may not make the call, or a
//                      tenant token acting for another tenant (the message
//                      names the method, the token id and what it lacks).
// Roles: admin may do everything but act as a worker; a tenant only what
// names its own tenant (its sequences, traces and events; ListTenants shows
// it alone); a worker only RegisterWorker and Heartbeat.
// With tokens not required (--auth=none, the default) every check passes.
//
// Thread contract: thread-safe (TokenStore::Verify under its reader lock).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmanager/token_store.h"

namespace grpc {
class ServerContextBase;
}

namespace triax::manager {

class Authorizer {
 public:
  // Off: every check passes.
  Authorizer() = default;
  // On: `tokens` (outliving this) verifies bearer tokens at now_ms().
  Authorizer(const TokenStore* tokens, std::function<int64_t()> now_ms);

  bool enabled() const { return tokens_ != nullptr; }

  // The caller's principal: nullopt when off; UNAUTHENTICATED as above.
  absl::StatusOr<std::optional<Principal>> Caller(
      const grpc::ServerContextBase& ctx, absl::string_view method) const;

  // Admin only (operator RPCs).
  absl::Status Admin(const grpc::ServerContextBase& ctx,
                     absl::string_view method) const;
  // A worker token only.
  absl::Status Worker(const grpc::ServerContextBase& ctx,
                      absl::string_view method) const;
  // Admin, or the tenant `tenant_id` names.
  absl::Status Tenant(const grpc::ServerContextBase& ctx,
                      absl::string_view method,
                      absl::string_view tenant_id) const;
  // Any admin or tenant (read-only tables every user needs: policies,
  // calibration).
  absl::Status User(const grpc::ServerContextBase& ctx,
                    absl::string_view method) const;
  // The tenant filter a list or watch may use: admin keeps `requested`
  // (empty: all); a tenant gets its own (requested empty or its own, else
  // PERMISSION_DENIED). Off: `requested`.
  absl::StatusOr<std::string> TenantScope(const grpc::ServerContextBase& ctx,
                                          absl::string_view method,
                                          absl::string_view requested) const;

 private:
  const TokenStore* tokens_ = nullptr;
  std::function<int64_t()> now_ms_;
};

}  // namespace triax::manager
