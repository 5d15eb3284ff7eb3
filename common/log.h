// Structured key=value logging to stderr, one line per record:
//   ts=2026-11-22T10:00:00.123Z level=info component=manager msg="..." k=v
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace triax {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Thread-safe. Records below the level are dropped (default info; the
// TRIAX_LOG_LEVEL environment variable may say debug|info|warn|error).
void Log(LogLevel level, absl::string_view component, absl::string_view msg,
         absl::string_view kvs = {});

// Formats one key=value pair, quoting the value when it has spaces or quotes.
std::string Kv(absl::string_view key, absl::string_view value);
template <typename T>
std::string Kv(absl::string_view key, T value) {
  return absl::StrCat(key, "=", value);
}

}  // namespace triax
