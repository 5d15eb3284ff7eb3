// Shared pieces of the fuzz targets (tests/fuzz/*_fuzz.cc; docs/fuzzing.md).
//
// A target that drives a sequence of calls reads its input as records:
//   [selector u8][length u16 little-endian][length bytes of payload]
// (a length past the end takes what is left), so that libFuzzer's mutations
// keep whole requests intact more often than a single blob would, and a
// seed is a readable list of calls (tests/fuzz/make_fuzz_seeds.cc).
//
// Every target also enforces the project's rule for bad input: a refusal is
// a canonical status with a message, never UNKNOWN or INTERNAL and never an
// empty message; FuzzCheck aborts otherwise so that libFuzzer (or the
// replay runner) reports it as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace triax::fuzz {

class Records {
 public:
  Records(const uint8_t* data, size_t size) : p_(data), n_(size) {}

  // The next record; false at the end of the input.
  bool Next(uint8_t* selector, absl::string_view* payload) {
    if (n_ < 3) return false;
    *selector = p_[0];
    size_t len = static_cast<size_t>(p_[1]) | (static_cast<size_t>(p_[2]) << 8);
    p_ += 3;
    n_ -= 3;
    if (len > n_) len = n_;
    *payload = absl::string_view(reinterpret_cast<const char*>(p_), len);
    p_ += len;
    n_ -= len;
    return true;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

// Appends one record (for the seed writer).
inline void AppendRecord(std::string* out, uint8_t selector,
                         const std::string& payload) {
  const size_t len = payload.size() > 0xffff ? 0xffff : payload.size();
  out->push_back(static_cast<char>(selector));
  out->push_back(static_cast<char>(len & 0xff));
  out->push_back(static_cast<char>(len >> 8));
  out->append(payload, 0, len);
}

[[noreturn]] inline void FuzzFail(const char* call, const absl::Status& s,
                                  const char* why) {
  std::fprintf(stderr, "fuzz: %s returned %s: %s\n", call, s.ToString().c_str(),
               why);
  std::abort();
}

// Aborts when a refusal breaks the rule above.
inline void FuzzCheck(const absl::Status& s, const char* call) {
  if (s.ok()) return;
  if (s.code() == absl::StatusCode::kUnknown) {
    FuzzFail(call, s, "UNKNOWN is not a refusal");
  }
  if (s.code() == absl::StatusCode::kInternal) {
    FuzzFail(call, s, "INTERNAL on a request (a bug or an unchecked input)");
  }
  if (s.message().empty()) FuzzFail(call, s, "a refusal without a message");
}

template <typename T>
void FuzzCheck(const T& status_or, const char* call) {
  FuzzCheck(status_or.status(), call);
}

}  // namespace triax::fuzz

namespace triax::fuzz {

// Byte i of page `layer` of the block spill_file_fuzz.cc spills (and whose
// valid file make_fuzz_seeds.cc writes).
inline uint8_t SpillPatternByte(size_t i, size_t layer, size_t page_bytes) {
  return static_cast<uint8_t>(i * 31 + layer * 7 + page_bytes);
}

}  // namespace triax::fuzz
