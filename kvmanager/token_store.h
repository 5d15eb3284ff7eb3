// Bearer tokens of the manager (docs/security.md "Identity and roles"): who
// a caller is. The manager issues a token once (IssueToken) and keeps only
// its SHA-256; a caller presents it in the `authorization: Bearer <token>`
// metadata of every call.
//
// A token reads "tkv1.<id>.<secret>": <id> 16 hex digits (public: it names
// the token in listings, revocations and logs), <secret> 43 base64url
// characters (32 random bytes from the OS). Verification finds the record
// by id and compares SHA-256(secret) in constant time, so a stolen listing
// or metadata store cannot be replayed and a guess costs a full hash.
//
// Roles: admin (operator RPCs, every tenant), tenant (its own sequences,
// traces and events, nothing else), worker (RegisterWorker and Heartbeat).
// The bootstrap admin token is not stored here but read from a file at
// start (kvmanager --admin_token_file; AddBootstrap).
//
// Thread contract: thread-safe; Verify takes a reader lock only, so the
// check on every RPC does not contend with the manager core's mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace triax::manager {

enum class TokenRole { kAdmin = 1, kTenant = 2, kWorker = 3 };

// "admin" | "tenant" | "worker".
const char* RoleName(TokenRole role);
absl::StatusOr<TokenRole> ParseRole(absl::string_view name);

// A token as stored: never its secret.
struct TokenRecord {
  std::string id;      // 16 hex digits
  std::string sha256;  // 32 bytes: SHA-256 of the secret
  TokenRole role = TokenRole::kTenant;
  std::string tenant_id;    // kTenant only
  std::string description;  // free text of the issuer
  int64_t created_ms = 0;   // unix ms
  int64_t expires_ms = 0;   // unix ms; 0: never
};

// Who a verified token names.
struct Principal {
  TokenRole role = TokenRole::kTenant;
  std::string tenant_id;  // kTenant
  std::string token_id;
};

// A fresh token: the record to store and the whole token, shown once.
struct IssuedToken {
  TokenRecord record;
  std::string token;
};

// Makes a token for `role` (kTenant needs a tenant id; the others none) from
// 40 random bytes of the OS. INVALID_ARGUMENT naming the field otherwise.
absl::StatusOr<IssuedToken> MakeToken(TokenRole role,
                                      absl::string_view tenant_id,
                                      absl::string_view description,
                                      int64_t now_ms, int64_t ttl_seconds);

// Splits "tkv1.<id>.<secret>" and checks both parts' form; UNAUTHENTICATED
// naming what is wrong (never echoing the secret).
absl::Status ParseToken(absl::string_view token, std::string* id,
                        std::string* secret);

// kvmanager --admin_token_file: the admin token in `path` (surrounding
// whitespace ignored); when the file does not exist, a new admin token is
// written to it (mode 0600, created exclusively) and *created set. A file
// that others may read or the group write is refused (FAILED_PRECONDITION),
// as ssh refuses such keys (0440 for a group, a Kubernetes Secret mounted
// for the pod's fsGroup, is fine); errors name the path.
absl::StatusOr<std::string> ReadOrCreateAdminToken(const std::string& path,
                                                   int64_t now_ms,
                                                   bool* created);

class TokenStore {
 public:
  // Adds (or replaces, by id) a record: issue, recovery.
  void Put(TokenRecord record);
  // Removes the record; false when there was none.
  bool Remove(absl::string_view id);
  // The admin token read from a file at start: verified like the others,
  // never listed as stored nor written to the metadata.
  absl::Status AddBootstrap(absl::string_view token);

  // The principal of `token` at `now_ms`: UNAUTHENTICATED when it is
  // malformed, unknown (or revoked), its secret differs, or it expired.
  absl::StatusOr<Principal> Verify(absl::string_view token,
                                   int64_t now_ms) const;

  // Stored records (bootstrap excluded), by id.
  std::vector<TokenRecord> List() const;
  std::optional<TokenRecord> Find(absl::string_view id) const;
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, TokenRecord> tokens_ ABSL_GUARDED_BY(mu_);
  std::string bootstrap_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::manager
