// Paging of the manager's List calls (Google AIP-158; docs/manager.md
// "Paging"): ListWorkers, ListTenants, ListSequences, ListPolicies and the
// events of QueryTrace.
//
// A request names page_size and page_token; a page answers at most page_size
// items and next_page_token, empty on the last page. page_size 0 means
// kDefaultPageSize (so a client that knows nothing of paging gets the first
// kDefaultPageSize items), above kMaxPageSize it is lowered to kMaxPageSize,
// negative is INVALID_ARGUMENT naming page_size.
//
// Tokens are opaque to clients: web-safe base64 of the list's name, the
// request's other fields (its filter) and the key (id) of the last item
// returned. The next page starts after that key in the list's order, so a
// token stays valid however many items are inserted or removed between the
// calls: every item present for the whole walk is returned exactly once, in
// order; items inserted behind the cursor are not, items inserted ahead are.
// A token that does not decode, names another list or was issued for other
// filter fields is INVALID_ARGUMENT naming page_token and its value. Tokens
// carry no secret and do not expire (they hold nothing but public ids).
//
// Thread contract: pure functions and a value type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace triax::manager {

inline constexpr int32_t kDefaultPageSize = 1000;
inline constexpr int32_t kMaxPageSize = 10000;

struct PageRequest {
  int32_t page_size = 0;   // 0: kDefaultPageSize; clamped to kMaxPageSize
  std::string page_token;  // empty: the first page
};

template <typename T>
struct Page {
  std::vector<T> items;
  std::string next_page_token;  // empty: this was the last page
};

// A validated page request of one list (`list`: the RPC's name) under one
// filter (`filter`: the request's other fields, canonical text).
class PageCursor {
 public:
  static absl::StatusOr<PageCursor> Start(absl::string_view list,
                                          absl::string_view filter,
                                          const PageRequest& req);
  // Items this page may hold (1..kMaxPageSize).
  size_t size() const { return size_; }
  // The key of the previous page's last item; nullopt for the first page.
  const std::optional<std::string>& after() const { return after_; }
  // The token of the page that follows one ending with `last_key`.
  std::string NextToken(absl::string_view last_key) const;

 private:
  PageCursor(std::string list, std::string filter, size_t size,
             std::optional<std::string> after)
      : list_(std::move(list)),
        filter_(std::move(filter)),
        size_(size),
        after_(std::move(after)) {}

  std::string list_;
  std::string filter_;
  size_t size_;
  std::optional<std::string> after_;
};

// Shortlex order of ids ("seq-9" before "seq-10"): for the manager's
// "<prefix>-<n>" ids it is creation order, and it is a total order on any
// strings (tokens may carry any key).
struct ShortlexLess {
  using is_transparent = void;
  bool operator()(absl::string_view a, absl::string_view b) const {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  }
};

}  // namespace triax::manager
