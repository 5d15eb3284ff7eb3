// Fuzz target: the chat-template tagger (kvmanager/tagger.h), the parser the
// manager runs on a client's rendered prompt. Input layout:
//   [0] template (mod 4: unspecified, ChatML, Llama-3, generic)
//   [1] bits 0-3 `continues` role (values 9..15 are out of range, as a wire
//       value may be), bit 4 numbering (kOpen / kContinue), bit 5 explicit
//       token offsets, bits 6-7 unused
//   [2] bos_tokens
//   [3] token stride: with explicit offsets a token starts every (stride
//       % 7 + 1) bytes, and a stride of 0 puts a duplicate offset in (a
//       malformed list)
//   [4, ...) the text
// The result must be either spans that cover every token exactly once
// (each of >= 1 tokens, a valid role, turns non-decreasing, adjacent spans
// different) or INVALID_ARGUMENT whose message starts with the field
// ("rendered.").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/match.h"
#include "kvmanager/tagger.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

[[noreturn]] void Fail(const char* why) {
  std::fprintf(stderr, "fuzz_tagger: %s\n", why);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace triax::manager;  // NOLINT(google-build-using-namespace)
  using triax::Modality;
  using triax::Role;
  if (size < 4) return 0;
  RenderedText r;
  r.chat_template = static_cast<ChatTemplate>(data[0] % 4);
  r.continues = static_cast<Role>(data[1] & 0x0f);
  const TurnNumbering numbering =
      (data[1] & 0x10) ? TurnNumbering::kContinue : TurnNumbering::kOpen;
  r.bos_tokens = data[2];
  r.text.assign(reinterpret_cast<const char*>(data + 4), size - 4);
  uint64_t tokens = r.text.size();
  if (data[1] & 0x20) {
    const uint32_t stride = data[3] % 7 + 1;
    for (uint32_t at = 0; at < r.text.size(); at += stride) {
      r.token_offsets.push_back(at);
    }
    if (data[3] == 0 && !r.token_offsets.empty()) {
      r.token_offsets.push_back(r.token_offsets.back());
    }
    tokens = r.token_offsets.size();
  }
  auto spans = TagRendered(r, numbering);
  if (!spans.ok()) {
    triax::fuzz::FuzzCheck(spans.status(), "TagRendered");
    if (spans.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("a refusal other than INVALID_ARGUMENT");
    }
    if (!absl::StartsWith(spans.status().message(), "rendered.")) {
      Fail("a refusal that does not name a rendered. field");
    }
    return 0;
  }
  uint64_t sum = 0;
  const TaggedSpan* prev = nullptr;
  for (const TaggedSpan& s : *spans) {
    if (s.num_tokens < 1) Fail("an empty span");
    if (!triax::IsValid(s.role) || s.role == Role::kUnspecified) {
      Fail("a span without a valid role");
    }
    if (s.modality != Modality::kText && s.modality != Modality::kImage &&
        s.modality != Modality::kAudio) {
      Fail("a span with another modality");
    }
    if (prev != nullptr) {
      if (s.turn < prev->turn) Fail("turns going back");
      if (s.role == prev->role && s.modality == prev->modality &&
          s.turn == prev->turn) {
        Fail("two adjacent spans that should be one");
      }
    }
    sum += s.num_tokens;
    prev = &s;
  }
  if (sum != tokens + r.bos_tokens) Fail("spans do not cover every token");
  // The core's spans keep the tokens.
  uint64_t core_sum = 0;
  for (const auto& s : ToSpans(*spans)) core_sum += s.num_tokens;
  if (core_sum != sum) Fail("ToSpans lost tokens");
  return 0;
}
