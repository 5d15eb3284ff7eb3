// SHA-256 (FIPS 180-4) of a byte string or a file, as lowercase hex; used to
// record which weights a calibration table was measured on.
// Errors: NOT_FOUND when the file cannot be opened, DATA_LOSS on a read
// error. Thread contract: free functions, thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace triax::calibrate {

std::string Sha256Hex(absl::string_view data);
absl::StatusOr<std::string> Sha256File(const std::string& path);

}  // namespace triax::calibrate
