#include "common/capability.h"

#include <grpcpp/grpcpp.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/sha256.h"

namespace triax {
namespace {

void Put(std::string* out, absl::string_view s) {
  const uint64_t n = s.size();
  out->append(reinterpret_cast<const char*>(&n), sizeof(n));
  out->append(s.data(), s.size());
}

void Put(std::string* out, uint64_t v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

std::string Mac(absl::string_view key, const v1::Capability& cap) {
  std::string msg = "triaxkv-capability-v1";
  Put(&msg, cap.tenant_id());
  Put(&msg, cap.sequence_id());
  Put(&msg, cap.worker_id());
  Put(&msg, static_cast<uint64_t>(cap.expires_unix_ms()));
  Put(&msg, static_cast<uint64_t>(cap.scope()));
  Put(&msg, cap.max_tokens());
  // The key's HMAC state, kept per thread for the last key it used (the
  // manager signs with one key; a worker verifies with its current key and,
  // for a while after a change, the previous one).
  thread_local std::string cached_key;
  thread_local std::unique_ptr<HmacSha256> hmac;
  if (hmac == nullptr || cached_key != key) {
    hmac = std::make_unique<HmacSha256>(key);
    cached_key = std::string(key);
  }
  return hmac->Mac(msg);
}

bool MacMatches(absl::string_view key, const v1::Capability& cap) {
  if (key.empty()) return false;
  const std::string want = Mac(key, cap);
  return cap.mac().size() == want.size() &&
         CRYPTO_memcmp(cap.mac().data(), want.data(), want.size()) == 0;
}

// Whether a capability of scope `have` allows an operation needing `need`.
bool Covers(v1::Capability::Scope have, v1::Capability::Scope need) {
  if (have == v1::Capability::SCOPE_MANAGER) return true;
  if (have == v1::Capability::SCOPE_CLIENT) {
    return need == v1::Capability::SCOPE_CLIENT ||
           need == v1::Capability::SCOPE_FORK;
  }
  return have == v1::Capability::SCOPE_FORK &&
         need == v1::Capability::SCOPE_FORK;
}

const char* ScopeName(v1::Capability::Scope s) {
  switch (s) {
    case v1::Capability::SCOPE_CLIENT:
      return "client";
    case v1::Capability::SCOPE_MANAGER:
      return "manager";
    case v1::Capability::SCOPE_FORK:
      return "fork";
    default:
      return "unspecified";
  }
}

}  // namespace

absl::StatusOr<std::string> NewCapabilityKey() {
  std::string key(kCapabilityKeyBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()),
                 static_cast<int>(key.size())) != 1) {
    return absl::InternalError("RAND_bytes failed: no capability key");
  }
  return key;
}

void SignCapability(absl::string_view key, v1::Capability* cap) {
  cap->set_mac(Mac(key, *cap));
}

void AddCapability(grpc::ClientContext* ctx, const v1::Capability& cap) {
  ctx->AddMetadata(kCapabilityMetadata, cap.SerializeAsString());
}

void AddCapabilities(grpc::ClientContext* ctx,
                     const std::vector<v1::Capability>& caps) {
  for (const v1::Capability& c : caps) AddCapability(ctx, c);
}

CapabilityVerifier::CapabilityVerifier(int64_t (*now_ms)()) : now_ms_(now_ms) {}

void CapabilityVerifier::SetWorkerId(absl::string_view worker_id) {
  absl::MutexLock lock(&mu_);
  worker_id_ = std::string(worker_id);
}

void CapabilityVerifier::Require() {
  absl::MutexLock lock(&mu_);
  required_ = true;
}

void CapabilityVerifier::SetKey(absl::string_view key) {
  absl::MutexLock lock(&mu_);
  if (key == key_) return;
  previous_key_ = std::move(key_);
  key_ = std::string(key);
}

bool CapabilityVerifier::required() const {
  absl::MutexLock lock(&mu_);
  return required_;
}

std::vector<v1::Capability> CapabilityVerifier::FromCall(
    const grpc::ServerContextBase& ctx) {
  std::vector<v1::Capability> out;
  auto range = ctx.client_metadata().equal_range(kCapabilityMetadata);
  for (auto it = range.first; it != range.second; ++it) {
    v1::Capability cap;
    if (cap.ParseFromArray(it->second.data(),
                           static_cast<int>(it->second.size()))) {
      out.push_back(std::move(cap));
    }
  }
  return out;
}

absl::Status CapabilityVerifier::Check(const grpc::ServerContextBase& ctx,
                                       absl::string_view method,
                                       const CapabilityNeed& need) const {
  return CheckAll(ctx, method, {need});
}

absl::Status CapabilityVerifier::CheckAll(
    const grpc::ServerContextBase& ctx, absl::string_view method,
    const std::vector<CapabilityNeed>& needs) const {
  if (!required()) return absl::OkStatus();
  return CheckPresented(FromCall(ctx), method, needs);
}

absl::Status CapabilityVerifier::CheckPresented(
    std::vector<v1::Capability> presented, absl::string_view method,
    const std::vector<CapabilityNeed>& needs) const {
  std::string key, previous, worker_id;
  {
    absl::MutexLock lock(&mu_);
    if (!required_) return absl::OkStatus();
    key = key_;
    previous = previous_key_;
    worker_id = worker_id_;
  }
  if (key.empty() || worker_id.empty()) {
    return absl::UnavailableError(absl::StrCat(
        method,
        ": this worker has no capability key yet (not registered with its "
        "manager); try again"));
  }
  const int64_t now = now_ms_();
  std::vector<v1::Capability> valid;
  std::string why;
  for (v1::Capability& cap : presented) {
    if (!MacMatches(key, cap) && !MacMatches(previous, cap)) {
      why = "a capability's signature does not verify";
    } else if (cap.worker_id() != worker_id) {
      why = absl::StrCat("a capability is for worker ", Quote(cap.worker_id()),
                         ", not this one (", Quote(worker_id), ")");
    } else if (now >= cap.expires_unix_ms()) {
      why = absl::StrCat(
          "a capability for sequence_id=", Quote(cap.sequence_id()),
          " expired ", (now - cap.expires_unix_ms()) / 1000, " s ago");
    } else {
      valid.push_back(std::move(cap));
    }
  }
  for (const CapabilityNeed& need : needs) {
    const v1::Capability* partial = nullptr;
    bool ok = false;
    for (const v1::Capability& cap : valid) {
      const bool names = cap.tenant_id() == need.tenant_id &&
                         cap.sequence_id() == need.sequence_id;
      const bool any = (cap.scope() == v1::Capability::SCOPE_MANAGER &&
                        cap.sequence_id().empty()) ||
                       need.any_sequence;
      if (!names && !any) continue;
      if (!Covers(cap.scope(), need.scope) ||
          (need.tokens > 0 && cap.scope() == v1::Capability::SCOPE_CLIENT &&
           need.tokens > cap.max_tokens())) {
        partial = &cap;
        continue;
      }
      ok = true;
      break;
    }
    if (ok) continue;
    const std::string what =
        need.sequence_id.empty()
            ? std::string("this worker")
            : absl::StrCat("sequence_id=", Quote(need.sequence_id),
                           " of tenant_id=", Quote(need.tenant_id));
    if (partial != nullptr) {
      if (need.tokens > partial->max_tokens() &&
          partial->scope() == v1::Capability::SCOPE_CLIENT) {
        return absl::PermissionDeniedError(absl::StrCat(
            method, ": the plan's ", need.tokens, " tokens exceed the ",
            partial->max_tokens(), " the manager planned for ", what));
      }
      return absl::PermissionDeniedError(absl::StrCat(
          method, ": the ", ScopeName(partial->scope()), " capability for ",
          what, " does not allow a ", ScopeName(need.scope), " call"));
    }
    if (!valid.empty() && why.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          method, ": no capability of this call names ", what,
          " (the manager signs one per sequence, for its tenant)"));
    }
    return absl::UnauthenticatedError(absl::StrCat(
        method, ": ", why.empty() ? "no capability" : why, " for ", what,
        "; calls to this worker need the manager's (metadata ",
        kCapabilityMetadata, ")"));
  }
  return absl::OkStatus();
}

}  // namespace triax
