// ManagerCore: bearer tokens (manager_core.h "Identity"; token_store.h).
#include "absl/strings/str_cat.h"
#include "common/capability.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

namespace {
constexpr size_t kMaxDescriptionBytes = 256;
}  // namespace

absl::StatusOr<IssuedToken> ManagerCore::IssueToken(
    const std::string& role_name, const std::string& tenant_id,
    uint64_t ttl_seconds, const std::string& description) {
  TRIAX_ASSIGN_OR_RETURN(const TokenRole role, ParseRole(role_name));
  if (role == TokenRole::kTenant) {
    TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  }
  if (description.size() > kMaxDescriptionBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("description has ", description.size(), " bytes; at most ",
                     kMaxDescriptionBytes));
  }
  // 100 years: beyond that a token is one that never expires (0).
  constexpr uint64_t kMaxTtl = uint64_t{100} * 365 * 86400;
  if (ttl_seconds > kMaxTtl) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl_seconds=", ttl_seconds, " is more than ", kMaxTtl,
                     " (100 years); 0 never expires"));
  }
  JournaledLock lock(this);
  if (role == TokenRole::kTenant && tenants_.FindOrNull(tenant_id) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tenant_id=", Quote(tenant_id), " does not exist"));
  }
  TRIAX_ASSIGN_OR_RETURN(
      IssuedToken issued,
      MakeToken(role, tenant_id, description, clock_->NowMs(),
                static_cast<int64_t>(ttl_seconds)));
  tokens_.Put(issued.record);
  if (changes_.enabled) changes_.tokens.insert(issued.record.id);
  return issued;
}

absl::Status ManagerCore::RevokeToken(const std::string& token_id) {
  JournaledLock lock(this);
  if (!tokens_.Remove(token_id)) {
    return absl::NotFoundError(absl::StrCat(
        "token_id=", Quote(token_id),
        " is not a stored token (the bootstrap admin token is revoked by "
        "changing its file)"));
  }
  if (changes_.enabled) {
    changes_.tokens.erase(token_id);
    changes_.revoked_tokens.push_back(token_id);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ManagerCore::EnsureCapabilityKey() {
  JournaledLock lock(this);
  if (!capability_key_.empty()) return capability_key_;
  TRIAX_ASSIGN_OR_RETURN(capability_key_, NewCapabilityKey());
  if (changes_.enabled) changes_.capability_key = true;
  return capability_key_;
}

std::vector<TokenRecord> ManagerCore::ListTokens() const {
  return tokens_.List();
}

}  // namespace triax::manager
