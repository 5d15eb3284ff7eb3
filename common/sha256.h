// SHA-256 and HMAC-SHA256 on the per-call paths of --auth=token: the
// manager hashes each call's token secret (TokenStore) and signs the
// capabilities of each SequenceInfo, workers verify a capability per call.
//
// OpenSSL 3's one-shot EVP_Digest(EVP_sha256()), SHA256() and HMAC() go
// through the provider layer on every call (an implicit fetch, a context
// allocated and freed). Here the low-level SHA256_CTX functions run the
// same assembly without it, and an HmacSha256 keeps the key's inner and
// outer states by value, so a MAC is two state copies and the compression
// rounds of the message. callgrind, in kvmanager with --auth=token
// (valgrind hides SHA-NI, so these are the portable code's counts): a
// capability signed, fields included, 25,000 instructions with HMAC(),
// about 8,600 now; a token's hash 5,900 with SHA256(), 2,400 now
// (bench/results/manager.md "Security on and off").
#pragma once

#include <memory>
#include <string>

#include "absl/strings/string_view.h"

namespace triax {

// The 32-byte SHA-256 digest of `in`.
std::string Sha256(absl::string_view in);

// HMAC-SHA256 (RFC 2104) under one key. Immutable after construction;
// Mac may run on several threads at once.
class HmacSha256 {
 public:
  explicit HmacSha256(absl::string_view key);
  ~HmacSha256();
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;

  // The 32-byte MAC of `message`.
  std::string Mac(absl::string_view message) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace triax
