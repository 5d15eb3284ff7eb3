#include "common/ids.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace triax {

std::string Quote(absl::string_view value) {
  constexpr size_t kMax = 64;
  if (value.size() > kMax) {
    return absl::StrCat("\"", absl::CEscape(value.substr(0, kMax)), "...\" (",
                        value.size(), " bytes)");
  }
  return absl::StrCat("\"", absl::CEscape(value), "\"");
}

absl::Status ValidateId(absl::string_view field, absl::string_view value) {
  if (value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  if (value.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", value.size(),
                     " bytes long; the limit is 128: ", Quote(value)));
  }
  for (char c : value) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                    c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " ", Quote(value),
                       " has a character outside [A-Za-z0-9._:-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRequestId(absl::string_view value) {
  if (value.empty()) return absl::OkStatus();
  return ValidateId("request_id", value);
}

}  // namespace triax
