// logfmt records: the reader of what common/log.h writes. Log() uses it to
// turn a record's key=value pairs into JSON (--log_format=json); tests use
// it to check that every line a daemon writes is logfmt. Thread-safe.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace triax {

using LogfmtRecord = std::vector<std::pair<std::string, std::string>>;

// Parses one line (no trailing newline) of pairs separated by one space:
//   key=bare  or  key="quoted"
// key: one or more of [A-Za-z0-9_.-]; bare: one or more bytes other than
// space, '"', '=', '\\' and control bytes; quoted: any bytes but control
// bytes, with \" \\ \n \r \t and \u00XX (a control byte) the only escapes.
// INVALID_ARGUMENT naming the offset and what was wrong otherwise.
absl::StatusOr<LogfmtRecord> ParseLogfmt(absl::string_view line);

// The value of `key` in `record` ("" when absent).
std::string LogfmtValue(const LogfmtRecord& record, absl::string_view key);

}  // namespace triax
