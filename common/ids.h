// Validation of client-chosen identifiers (tenant, worker, request ids).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace triax {

// OK when `value` matches [A-Za-z0-9._:-]{1,128}; otherwise INVALID_ARGUMENT
// naming `field` and the offending value.
absl::Status ValidateId(absl::string_view field, absl::string_view value);

// Request ids may be empty (no idempotency) but are otherwise ids.
absl::Status ValidateRequestId(absl::string_view value);

// Shortens a value for an error message: at most 64 bytes, escaped.
std::string Quote(absl::string_view value);

}  // namespace triax
