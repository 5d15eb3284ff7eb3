#include "common/logfmt.h"

#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace triax {

absl::StatusOr<LogfmtRecord> ParseLogfmt(absl::string_view line) {
  LogfmtRecord out;
  size_t i = 0;
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("not logfmt at byte ", i, " (", what, "): ", line));
  };
  auto is_control = [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u < 0x20 || u == 0x7f;
  };
  if (line.empty()) return bad("empty line");
  while (i < line.size()) {
    const size_t key_start = i;
    while (i < line.size() &&
           (absl::ascii_isalnum(static_cast<unsigned char>(line[i])) ||
            line[i] == '_' || line[i] == '.' || line[i] == '-')) {
      ++i;
    }
    if (i == key_start) return bad("expected a key");
    std::string key(line.substr(key_start, i - key_start));
    if (i >= line.size() || line[i] != '=') return bad("expected '='");
    ++i;
    std::string value;
    if (i < line.size() && line[i] == '"') {
      ++i;
      bool closed = false;
      while (i < line.size()) {
        const char c = line[i];
        if (c == '"') {
          closed = true;
          ++i;
          break;
        }
        if (is_control(c)) return bad("raw control byte in a quoted value");
        if (c != '\\') {
          value.push_back(c);
          ++i;
          continue;
        }
        if (i + 1 >= line.size()) return bad("dangling backslash");
        const char e = line[i + 1];
        i += 2;
        if (e == '"' || e == '\\') {
          value.push_back(e);
        } else if (e == 'n') {
          value.push_back('\n');
        } else if (e == 'r') {
          value.push_back('\r');
        } else if (e == 't') {
          value.push_back('\t');
        } else if (e == 'u') {
          uint32_t code = 0;
          if (i + 4 > line.size() ||
              !absl::SimpleHexAtoi(line.substr(i, 4), &code) || code > 0x7f) {
            return bad("bad \\u escape");
          }
          value.push_back(static_cast<char>(code));
          i += 4;
        } else {
          return bad("unknown escape");
        }
      }
      if (!closed) return bad("unterminated quoted value");
    } else {
      const size_t value_start = i;
      while (i < line.size() && line[i] != ' ') {
        const char c = line[i];
        if (c == '"' || c == '=' || c == '\\' || is_control(c)) {
          return bad("'\"', '=', '\\' or a control byte in a bare value");
        }
        ++i;
      }
      if (i == value_start) return bad("empty bare value");
      value = std::string(line.substr(value_start, i - value_start));
    }
    out.emplace_back(std::move(key), std::move(value));
    if (i == line.size()) break;
    if (line[i] != ' ') return bad("expected a space between pairs");
    ++i;
    if (i == line.size()) return bad("trailing space");
  }
  return out;
}

std::string LogfmtValue(const LogfmtRecord& record, absl::string_view key) {
  for (const auto& [k, v] : record) {
    if (k == key) return v;
  }
  return "";
}

}  // namespace triax
