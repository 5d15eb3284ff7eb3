#include "kvmanager/paging.h"

#include <algorithm>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/ids.h"

namespace triax::manager {
namespace {

// The token's plain text: version, list, filter and last key, one per line
// (ids and filters never hold a newline).
constexpr absl::string_view kTokenVersion = "triax-page-1";

absl::Status BadToken(absl::string_view token, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("page_token ", Quote(token), " ", why,
                   "; pass the next_page_token of the previous page "
                   "unchanged, or none for the first page"));
}

}  // namespace

absl::StatusOr<PageCursor> PageCursor::Start(absl::string_view list,
                                             absl::string_view filter,
                                             const PageRequest& req) {
  if (req.page_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size ", req.page_size, " is negative; 0 means the default (",
        kDefaultPageSize, "), at most ", kMaxPageSize));
  }
  const size_t size =
      req.page_size == 0
          ? kDefaultPageSize
          : static_cast<size_t>(std::min(req.page_size, kMaxPageSize));
  if (req.page_token.empty()) {
    return PageCursor(std::string(list), std::string(filter), size,
                      std::nullopt);
  }
  std::string plain;
  if (!absl::WebSafeBase64Unescape(req.page_token, &plain)) {
    return BadToken(req.page_token, "is not a page token (not base64)");
  }
  std::vector<absl::string_view> parts = absl::StrSplit(plain, '\n');
  if (parts.size() != 4 || parts[0] != kTokenVersion || parts[3].empty()) {
    return BadToken(req.page_token, "is not a page token of this manager");
  }
  if (parts[1] != list) {
    return BadToken(req.page_token,
                    absl::StrCat("was issued by ", parts[1], ", not ", list));
  }
  if (parts[2] != filter) {
    return BadToken(
        req.page_token,
        absl::StrCat("was issued for a request with other fields (",
                     parts[2].empty() ? "none" : parts[2], "; this one has ",
                     filter.empty() ? "none" : filter, ")"));
  }
  return PageCursor(std::string(list), std::string(filter), size,
                    std::string(parts[3]));
}

std::string PageCursor::NextToken(absl::string_view last_key) const {
  return absl::WebSafeBase64Escape(
      absl::StrCat(kTokenVersion, "\n", list_, "\n", filter_, "\n", last_key));
}

}  // namespace triax::manager
