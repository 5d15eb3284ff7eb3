#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace triax {
namespace {

LogLevel MinLevel() {
  static const LogLevel level = [] {
    const char* env = std::getenv("TRIAX_LOG_LEVEL");
    if (env == nullptr) return LogLevel::kInfo;
    absl::string_view v(env);
    if (v == "debug") return LogLevel::kDebug;
    if (v == "warn") return LogLevel::kWarn;
    if (v == "error") return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

ABSL_CONST_INIT absl::Mutex log_mu(absl::kConstInit);

}  // namespace

std::string Kv(absl::string_view key, absl::string_view value) {
  bool quote = value.empty();
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f || c == '"' || c == '=' || c == '\\') {
      quote = true;
    }
  }
  if (!quote) return absl::StrCat(key, "=", value);
  std::string out = absl::StrCat(key, "=\"");
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (u < 0x20 || u == 0x7f) {
          absl::StrAppendFormat(&out, "\\u%04x", u);
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
  return out;
}

void Log(LogLevel level, absl::string_view component, absl::string_view msg,
         absl::string_view kvs) {
  if (level < MinLevel()) return;
  std::string line =
      absl::StrCat("ts=",
                   absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                    absl::UTCTimeZone()),
                   " level=", LevelName(level), " component=", component, " ",
                   Kv("msg", msg));
  if (!kvs.empty()) absl::StrAppend(&line, " ", kvs);
  line.push_back('\n');
  absl::MutexLock lock(&log_mu);
  std::fputs(line.c_str(), stderr);
}

}  // namespace triax
