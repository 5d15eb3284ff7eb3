#include "kvmanager/token_store.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/ids.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace triax::manager {
namespace {

constexpr absl::string_view kPrefix = "tkv1";
constexpr size_t kIdBytes = 8;       // 16 hex digits
constexpr size_t kSecretBytes = 32;  // 43 base64url characters
constexpr size_t kSecretChars = 43;

bool IsLowerHex(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f');
  });
}

bool IsBase64Url(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '-' || c == '_';
  });
}

}  // namespace

const char* RoleName(TokenRole role) {
  switch (role) {
    case TokenRole::kAdmin:
      return "admin";
    case TokenRole::kTenant:
      return "tenant";
    case TokenRole::kWorker:
      return "worker";
  }
  return "unknown";
}

absl::StatusOr<TokenRole> ParseRole(absl::string_view name) {
  if (name == "admin") return TokenRole::kAdmin;
  if (name == "tenant") return TokenRole::kTenant;
  if (name == "worker") return TokenRole::kWorker;
  return absl::InvalidArgumentError(absl::StrCat(
      "role=", Quote(name), " is not one of admin, tenant, worker"));
}

absl::StatusOr<IssuedToken> MakeToken(TokenRole role,
                                      absl::string_view tenant_id,
                                      absl::string_view description,
                                      int64_t now_ms, int64_t ttl_seconds) {
  if (role == TokenRole::kTenant && tenant_id.empty()) {
    return absl::InvalidArgumentError(
        "tenant_id is empty; a tenant token names its tenant");
  }
  if (role != TokenRole::kTenant && !tenant_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tenant_id=", Quote(tenant_id), " is given for role=", RoleName(role),
        "; only tenant tokens name a tenant"));
  }
  if (ttl_seconds < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl_seconds=", ttl_seconds, " is negative"));
  }
  unsigned char raw[kIdBytes + kSecretBytes];
  if (RAND_bytes(raw, sizeof(raw)) != 1) {
    return absl::InternalError("RAND_bytes failed: no randomness for a token");
  }
  IssuedToken out;
  out.record.id = absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(raw), kIdBytes));
  const std::string secret = absl::WebSafeBase64Escape(absl::string_view(
      reinterpret_cast<const char*>(raw + kIdBytes), kSecretBytes));
  OPENSSL_cleanse(raw, sizeof(raw));
  out.record.sha256 = Sha256(secret);
  out.record.role = role;
  out.record.tenant_id = std::string(tenant_id);
  out.record.description = std::string(description);
  out.record.created_ms = now_ms;
  out.record.expires_ms = ttl_seconds == 0 ? 0 : now_ms + ttl_seconds * 1000;
  out.token = absl::StrCat(kPrefix, ".", out.record.id, ".", secret);
  return out;
}

absl::Status ParseToken(absl::string_view token, std::string* id,
                        std::string* secret) {
  std::vector<absl::string_view> parts = absl::StrSplit(token, '.');
  if (parts.size() != 3 || parts[0] != kPrefix) {
    return absl::UnauthenticatedError(
        "the bearer token is not of the form tkv1.<id>.<secret>");
  }
  if (parts[1].size() != 2 * kIdBytes || !IsLowerHex(parts[1])) {
    return absl::UnauthenticatedError(
        "the bearer token's id is not 16 lowercase hex digits");
  }
  if (parts[2].size() != kSecretChars || !IsBase64Url(parts[2])) {
    return absl::UnauthenticatedError(
        absl::StrCat("the bearer token ", parts[1], " has a malformed secret"));
  }
  *id = std::string(parts[1]);
  *secret = std::string(parts[2]);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadOrCreateAdminToken(const std::string& path,
                                                   int64_t now_ms,
                                                   bool* created) {
  *created = false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    TRIAX_ASSIGN_OR_RETURN(IssuedToken t,
                           MakeToken(TokenRole::kAdmin, "", "", now_ms, 0));
    const int out =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (out < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--admin_token_file=", path,
                       ": cannot create: ", std::strerror(errno)));
    }
    const std::string line = t.token + "\n";
    const bool ok = ::write(out, line.data(), line.size()) ==
                        static_cast<ssize_t>(line.size()) &&
                    ::fsync(out) == 0;
    ::close(out);
    if (!ok) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--admin_token_file=", path, ": cannot write the new token"));
    }
    *created = true;
    return t.token;
  }
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--admin_token_file=", path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  // Others may not read it, nor the group write it (a Kubernetes Secret
  // mounted 0440 for the pod's fsGroup is fine).
  if (::fstat(fd, &st) != 0 || (st.st_mode & 027) != 0) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "--admin_token_file=", path,
        ": others may read it or the group write it (mode ",
        absl::StrFormat("%04o", st.st_mode & 07777), "); chmod 600 it"));
  }
  std::string text(512, '\0');
  const ssize_t n = ::read(fd, text.data(), text.size());
  ::close(fd);
  if (n < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--admin_token_file=", path, ": cannot read: ", std::strerror(errno)));
  }
  text.resize(static_cast<size_t>(n));
  const std::string token(absl::StripAsciiWhitespace(text));
  std::string id, secret;
  if (absl::Status s = ParseToken(token, &id, &secret); !s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--admin_token_file=", path, ": ", s.message()));
  }
  return token;
}

void TokenStore::Put(TokenRecord record) {
  absl::MutexLock lock(&mu_);
  std::string id = record.id;
  tokens_[id] = std::move(record);
}

bool TokenStore::Remove(absl::string_view id) {
  absl::MutexLock lock(&mu_);
  if (id == bootstrap_id_) return false;
  return tokens_.erase(id) > 0;
}

absl::Status TokenStore::AddBootstrap(absl::string_view token) {
  std::string id, secret;
  if (absl::Status s = ParseToken(token, &id, &secret); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the admin token: ", s.message()));
  }
  TokenRecord r;
  r.id = id;
  r.sha256 = Sha256(secret);
  r.role = TokenRole::kAdmin;
  r.description = "bootstrap admin token (--admin_token_file)";
  absl::MutexLock lock(&mu_);
  if (tokens_.contains(id) && id != bootstrap_id_) {
    return absl::AlreadyExistsError(
        absl::StrCat("the admin token's id ", id, " is a stored token's"));
  }
  if (!bootstrap_id_.empty()) tokens_.erase(bootstrap_id_);
  bootstrap_id_ = id;
  tokens_[id] = std::move(r);
  return absl::OkStatus();
}

absl::StatusOr<Principal> TokenStore::Verify(absl::string_view token,
                                             int64_t now_ms) const {
  std::string id, secret;
  if (absl::Status s = ParseToken(token, &id, &secret); !s.ok()) return s;
  const std::string hash = Sha256(secret);
  absl::ReaderMutexLock lock(&mu_);
  auto it = tokens_.find(id);
  if (it == tokens_.end()) {
    return absl::UnauthenticatedError(
        absl::StrCat("token ", id, " is unknown or revoked"));
  }
  const TokenRecord& r = it->second;
  if (r.sha256.size() != hash.size() ||
      CRYPTO_memcmp(r.sha256.data(), hash.data(), hash.size()) != 0) {
    return absl::UnauthenticatedError(
        absl::StrCat("token ", id, ": the secret does not match"));
  }
  if (r.expires_ms != 0 && now_ms >= r.expires_ms) {
    return absl::UnauthenticatedError(absl::StrCat(
        "token ", id, " expired ", (now_ms - r.expires_ms) / 1000, " s ago"));
  }
  return Principal{r.role, r.tenant_id, r.id};
}

std::vector<TokenRecord> TokenStore::List() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<TokenRecord> out;
  for (const auto& [id, r] : tokens_) {
    if (id != bootstrap_id_) out.push_back(r);
  }
  std::sort(
      out.begin(), out.end(),
      [](const TokenRecord& a, const TokenRecord& b) { return a.id < b.id; });
  return out;
}

std::optional<TokenRecord> TokenStore::Find(absl::string_view id) const {
  absl::ReaderMutexLock lock(&mu_);
  if (id == bootstrap_id_) return std::nullopt;
  auto it = tokens_.find(id);
  if (it == tokens_.end()) return std::nullopt;
  return it->second;
}

size_t TokenStore::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return tokens_.size() - (bootstrap_id_.empty() ? 0 : 1);
}

}  // namespace triax::manager
