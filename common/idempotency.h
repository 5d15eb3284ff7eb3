// Remembers the replies of mutating requests by client request id, so that a
// retried request returns the first reply instead of applying twice.
#pragma once

#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace triax {

// Thread-safe. Keeps the last `capacity` replies (FIFO). `Reply` is copyable.
// Keys are (method, request_id); an empty request id is never cached.
template <typename Reply>
class IdempotencyCache {
 public:
  explicit IdempotencyCache(size_t capacity = 65536) : capacity_(capacity) {}

  struct Entry {
    absl::Status status;
    Reply reply;
  };

  std::optional<Entry> Find(const std::string& method,
                            const std::string& request_id) const {
    if (request_id.empty()) return std::nullopt;
    absl::MutexLock lock(&mu_);
    auto it = map_.find(Key(method, request_id));
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }

  void Put(const std::string& method, const std::string& request_id,
           absl::Status status, Reply reply) {
    if (request_id.empty()) return;
    absl::MutexLock lock(&mu_);
    std::string key = Key(method, request_id);
    if (map_.contains(key)) return;
    map_.emplace(key, Entry{std::move(status), std::move(reply)});
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
