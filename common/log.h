// Structured logging to stderr, one line per record, logfmt by default:
//   ts=2026-11-22T10:00:00.123Z level=info component=manager msg="..." k=v
// or, after SetLogFormat(LogFormat::kJson), one JSON object a line:
//   {"ts":"2026-11-22T10:00:00.123Z","level":"info","component":"manager",
//    "msg":"...","k":"v","n":3}
#pragma once

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace triax {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

enum class LogFormat { kLogfmt = 0, kJson = 1 };

// Process-wide; the daemons set it from --log_format before they log.
void SetLogFormat(LogFormat format);

// Thread-safe. `kvs` is the record's other pairs, made of Kv() joined by
// spaces; in JSON they become members (integers as numbers, the rest as
// strings; a `kvs` that is not logfmt is kept whole under "kvs").
// Records below the level are dropped (default info; the
// TRIAX_LOG_LEVEL environment variable may say debug|info|warn|error).
void Log(LogLevel level, absl::string_view component, absl::string_view msg,
         absl::string_view kvs = {});

// `value` in double quotes with ", \, \n, \r, \t escaped and other control
// bytes as \u00XX: a logfmt quoted value and a JSON string alike (bytes
// >= 0x80 pass through, so valid UTF-8 stays valid).
std::string Quoted(absl::string_view value);

// Formats one logfmt key=value pair. A value that is empty or holds a space,
// '"', '=', '\\' or a control character is quoted, with '"' and '\\' escaped
// as \" and \\, newline, return and tab as \n, \r, \t and other control
// bytes as \u00XX (the JSON escapes, which logfmt readers decode); other
// bytes, UTF-8 included, pass through. `key` is a constant identifier.
std::string Kv(absl::string_view key, absl::string_view value);

// Strings of every kind take the quoting overload above: a template taking
// them by value would be the better match and print them bare.
inline std::string Kv(absl::string_view key, const std::string& value) {
  return Kv(key, absl::string_view(value));
}
inline std::string Kv(absl::string_view key, const char* value) {
  return Kv(key, absl::string_view(value));
}
// Numbers print bare (bool as true/false).
template <typename T, typename = std::enable_if_t<std::is_arithmetic<T>::value>>
std::string Kv(absl::string_view key, T value) {
  if constexpr (std::is_same<T, bool>::value) {
    return absl::StrCat(key, "=", value ? "true" : "false");
  } else {
    return absl::StrCat(key, "=", value);
  }
}

}  // namespace triax
