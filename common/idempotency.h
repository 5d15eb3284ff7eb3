// Remembers the replies of mutating requests by client request id, so that a
// retried request returns the first reply instead of applying twice, and a
// request id reused for another payload is refused instead of answered with
// the first reply.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace triax {

// FAILED_PRECONDITION for a request id remembered for a request of another
// payload: `request_id="r1" was used for a different OpenSequence request`.
inline absl::Status RequestIdReused(absl::string_view method,
                                    absl::string_view request_id) {
  return absl::FailedPreconditionError(
      absl::StrCat("request_id=\"", request_id, "\" was used for a different ",
                   method, " request"));
}

// Folds `bytes` (with its length) into the fingerprint `h`: a payload that
// arrives in pieces (a stream) is fingerprinted piece by piece. Fingerprints
// are compared within one process only.
inline uint64_t FingerprintAdd(uint64_t h, absl::string_view bytes) {
  return absl::Hash<std::pair<uint64_t, absl::string_view>>{}({h, bytes});
}

// Thread-safe. Keeps the last `capacity` replies (FIFO). `Reply` is copyable.
// Keys are (method, request_id); an empty request id is never cached. Each
// entry keeps the fingerprint of the request's payload (a hash the caller
// computes, e.g. of the serialized wire request), so that a retry (same
// fingerprint) gets the first reply and a reused id (another fingerprint)
// an error.
template <typename Reply>
class IdempotencyCache {
 public:
  explicit IdempotencyCache(size_t capacity = 65536) : capacity_(capacity) {}

  struct Entry {
    absl::Status status;
    Reply reply;
    uint64_t fingerprint = 0;
  };

  // The entry remembered for (method, request_id), whatever its fingerprint.
  std::optional<Entry> Find(const std::string& method,
                            const std::string& request_id) const {
    if (request_id.empty()) return std::nullopt;
    absl::MutexLock lock(&mu_);
    auto it = map_.find(Key(method, request_id));
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }

  // The entry remembered for (method, request_id), nullopt when none, and
  // RequestIdReused(label, request_id) when it was remembered for a request
  // of another fingerprint. `label` names the RPC in the message.
  absl::StatusOr<std::optional<Entry>> Lookup(const std::string& method,
                                              const std::string& request_id,
                                              uint64_t fingerprint,
                                              absl::string_view label) const {
    std::optional<Entry> hit = Find(method, request_id);
    if (hit.has_value() && hit->fingerprint != fingerprint) {
      return RequestIdReused(label, request_id);
    }
    return hit;
  }

  void Put(const std::string& method, const std::string& request_id,
           uint64_t fingerprint, absl::Status status, Reply reply) {
    if (request_id.empty()) return;
    absl::MutexLock lock(&mu_);
    std::string key = Key(method, request_id);
    if (map_.contains(key)) return;
    map_.emplace(key, Entry{std::move(status), std::move(reply), fingerprint});
    order_.push_back(std::move(key));
    while (order_.size() > capacity_) {
      map_.erase(order_.front());
      order_.pop_front();
    }
  }

 private:
  static std::string Key(const std::string& method, const std::string& id) {
    std::string key;
    key.reserve(method.size() + 1 + id.size());
    key.append(method).push_back('\0');
    key.append(id);
    return key;
  }

  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> map_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax
