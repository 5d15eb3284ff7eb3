// Capabilities (docs/security.md "Capabilities"): the manager signs, for one
// sequence on one worker, what a caller may do there until an expiry; the
// worker verifies the signature with the key the manager gave it over the
// authenticated registration, so it serves only calls the manager allowed.
//
// The MAC is HMAC-SHA256 over a length-prefixed encoding of every field but
// `mac` (so no two field lists encode alike). A capability travels in the
// "x-triax-capability-bin" metadata of a worker call (gRPC base64-encodes
// -bin values), once per sequence the call names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "triax/v1/types.pb.h"

namespace grpc {
class ClientContext;
class ServerContextBase;
}  // namespace grpc

namespace triax {

inline constexpr char kCapabilityMetadata[] = "x-triax-capability-bin";
inline constexpr size_t kCapabilityKeyBytes = 32;

// 32 random bytes from the OS.
absl::StatusOr<std::string> NewCapabilityKey();

// Sets cap->mac from `key` and the other fields.
void SignCapability(absl::string_view key, v1::Capability* cap);

// Adds each capability to the call's metadata.
void AddCapabilities(grpc::ClientContext* ctx,
                     const std::vector<v1::Capability>& caps);
void AddCapability(grpc::ClientContext* ctx, const v1::Capability& cap);

// What a worker call asks for: the sequence (tenant, id) and the least
// scope that covers the operation.
struct CapabilityNeed {
  std::string tenant_id;
  std::string sequence_id;  // empty: a worker-wide call (SCOPE_MANAGER)
  v1::Capability::Scope scope = v1::Capability::SCOPE_CLIENT;
  // AllocatePages: the tokens of the plan asked for (0: not an allocation).
  uint64_t tokens = 0;
  // Any sequence of this worker will do (OpenLink: a link is made for the
  // transfers of whichever sequences the manager signs).
  bool any_sequence = false;
};

// A worker's check of the capabilities on its calls. Off (accepts
// everything) until Require; with no key yet (not registered), refuses
// UNAVAILABLE. Thread-safe.
class CapabilityVerifier {
 public:
  explicit CapabilityVerifier(int64_t (*now_ms)());

  // Capabilities are required from now on (kvworker --token_file).
  void Require();
  // This worker's id (capabilities name it); until set, and until a key
  // arrives, a required check refuses UNAVAILABLE.
  void SetWorkerId(absl::string_view worker_id);
  // The key from the manager's registration or heartbeat (replacing the
  // previous one: both verify for a grace period, so calls signed just
  // before a manager's key change still pass).
  void SetKey(absl::string_view key);
  bool required() const;

  // OK when the call carries a capability that this worker's key signed,
  // for this worker, not expired, for need.tenant_id and need.sequence_id
  // (a SCOPE_MANAGER capability with an empty sequence_id covers every
  // sequence) in a scope that covers need.scope, and (allocations) whose
  // max_tokens is at least need.tokens. UNAUTHENTICATED when there is no
  // capability or none verifies (forged, another worker's, expired);
  // PERMISSION_DENIED when one verifies but does not cover the call (another
  // sequence or tenant, a narrower scope, more tokens). Messages name the
  // method and the sequence, never the MAC.
  absl::Status Check(const grpc::ServerContextBase& ctx,
                     absl::string_view method,
                     const CapabilityNeed& need) const;
  absl::Status CheckAll(const grpc::ServerContextBase& ctx,
                        absl::string_view method,
                        const std::vector<CapabilityNeed>& needs) const;
  // The same over the capabilities a call presented.
  absl::Status CheckPresented(std::vector<v1::Capability> presented,
                              absl::string_view method,
                              const std::vector<CapabilityNeed>& needs) const;

  // The capabilities on a call (for forwarding), parsed; malformed ones
  // skipped.
  static std::vector<v1::Capability> FromCall(
      const grpc::ServerContextBase& ctx);

 private:
  int64_t (*const now_ms_)();
  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  bool required_ ABSL_GUARDED_BY(mu_) = false;
  std::string key_ ABSL_GUARDED_BY(mu_);
  std::string previous_key_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax
