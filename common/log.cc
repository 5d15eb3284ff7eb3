#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logfmt.h"

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
std::atomic<int> log_format{static_cast<int>(LogFormat::kLogfmt)};

// One JSON object; bytes that are not UTF-8 become U+FFFD rather than
// failing the record.
std::string JsonRecord(absl::string_view ts, const char* level,
                       absl::string_view component, absl::string_view msg,
                       absl::string_view kvs) {
  nlohmann::ordered_json j;
  j["ts"] = ts;
  j["level"] = level;
  j["component"] = component;
  j["msg"] = msg;
  if (!kvs.empty()) {
    absl::StatusOr<LogfmtRecord> pairs = ParseLogfmt(kvs);
    if (pairs.ok()) {
      for (auto& [key, value] : *pairs) {
        // The record's own four keys are not overwritten by a pair.
        const std::string name =
            j.contains(key) ? absl::StrCat("kv_", key) : key;
        int64_t n = 0;
        if (absl::SimpleAtoi(value, &n) && absl::StrCat(n) == value) {
          j[name] = n;
        } else {
          j[name] = value;
        }
      }
    } else {
      j["kvs"] = kvs;
    }
  }
  return j.dump(-1, ' ', false,
                nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace

std::string Quoted(absl::string_view value) {
  std::string out = "\"";
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

std::string Kv(absl::string_view key, absl::string_view value) {
  bool quote = value.empty();
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f || c == '"' || c == '=' || c == '\\') {
      quote = true;
    }
  }
  if (!quote) return absl::StrCat(key, "=", value);
  return absl::StrCat(key, "=", Quoted(value));
}

void SetLogFormat(LogFormat format) {
  log_format.store(static_cast<int>(format), std::memory_order_relaxed);
}

void Log(LogLevel level, absl::string_view component, absl::string_view msg,
         absl::string_view kvs) {
  if (level < MinLevel()) return;
  const std::string ts = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                          absl::UTCTimeZone());
  std::string line;
  if (log_format.load(std::memory_order_relaxed) ==
      static_cast<int>(LogFormat::kJson)) {
    line = JsonRecord(ts, LevelName(level), component, msg, kvs);
  } else {
    line = absl::StrCat("ts=", ts, " level=", LevelName(level),
                        " component=", component, " ", Kv("msg", msg));
    if (!kvs.empty()) absl::StrAppend(&line, " ", kvs);
  }
  line.push_back('\n');
  absl::MutexLock lock(&log_mu);
  std::fputs(line.c_str(), stderr);
}

}  // namespace triax
