// The tagger: role / modality spans and turns of a rendered prompt, from the
// chat template's structure alone (no model inference, no tokenizer). The
// manager core runs it for OpenSequence / ExtendSequence requests that carry
// `rendered` instead of `spans`. No gRPC or protobuf.
//
// Input: RenderedText (kvmanager/types.h): the text, its template, the start
// byte of each token (empty: one token per byte, as for kvproxy-18m), a count
// of BOS tokens before the text, and the message the text continues (if any).
//
// Grammar (every byte gets exactly one role and one modality):
//   CHATML   message := "<|im_start|>" NAME "\n" CONTENT "<|im_end|>"
//   LLAMA3   text    := ["<|begin_of_text|>"] message*
//            message := "<|start_header_id|>" NAME "<|end_header_id|>"
//                       ["\n" ["\n"]] CONTENT ("<|eot_id|>" | "<|eom_id|>")
//   GENERIC  message := HEADER CONTENT, HEADER a whole line "### " NAME ":"
//                       (NAME [A-Za-z][A-Za-z_]{0,31}, case-insensitive);
//                       CONTENT runs to the next header line or the end.
//   NAME is system | user | assistant | tool | ipython (at most 32 bytes).
//   Whitespace between messages is allowed. Markers, the role name, the
//   whitespace between messages and <|begin_of_text|> are ROLE_DELIMITER.
//   The last message may lack its end marker when it is an assistant message
//   (generation in progress); GENERIC messages end at the next header or the
//   end of the text.
// Content roles: system -> SYSTEM, user -> USER, assistant -> ASSISTANT,
// tool / ipython -> TOOL_RESULT, refined inside the content:
//   system:    a "<tools>" at a line start through "</tools>" -> TOOL_SCHEMA;
//              a line starting with a JSON object (it may span lines) that
//              has a top-level "name" key and only spaces after it ->
//              TOOL_SCHEMA, the line's "\n" included. ("<tools></tools>"
//              inside a line, as Qwen's instructions say, is text.)
//   assistant: "<think>" .. "</think>" -> REASONING; "<tool_call>" ..
//              "</tool_call>" -> TOOL_CALL; LLAMA3 "<|python_tag|>" to the
//              end of the message -> TOOL_CALL. The tags belong to the span
//              they open or close (as in client/frontend/bfcl.h).
//   user:      "<tool_response>" .. "</tool_response>" -> TOOL_RESULT.
//   any:       image placeholders <image>, <|image|>, <|image_pad|>,
//              <|video_pad|>, <|vision_start|> .. <|vision_end|> -> IMAGE;
//              audio placeholders <audio>, <|audio|>, <|audio_pad|>,
//              <|AUDIO|>, <|audio_start|> .. <|audio_end|>, <|audio_bos|> ..
//              <|audio_eos|> -> AUDIO; the role is the enclosing one.
// Turns: each user message starts a turn at its header, except one whose
// content begins (after whitespace) with "<tool_response>" (a tool result in
// a user message, as Qwen renders it). TurnNumbering::kOpen numbers the text
// before the second such message turn 0 (an opening prompt);
// kContinue numbers the text before the first one 0 (it continues the
// sequence's current turn).
// Tokens: token k covers [token_offsets[k], token_offsets[k+1]) and takes the
// role, modality and turn of its first byte. BOS tokens are ROLE_DELIMITER,
// text, turn 0.
//
// Errors, all INVALID_ARGUMENT naming the field and, for the text, the byte
// offset and what was expected: empty or oversized text, unspecified
// template, bad `continues`, too many BOS tokens, token offsets not starting
// at 0, not strictly increasing or past the text; text outside a message,
// an unterminated header, an unknown role name, a message of another role
// without its end marker, a marker of the next message inside a message,
// <think> or <tool_call> nested in <tool_call> or <think> nested in <think>,
// a closing </think>, </tool_call> or </tool_response> without its opening
// one, and a block (<think>, <tool_call>,
// <tools>, <tool_response>, <|vision_start|>, ...) left open at the end of a
// completed message.
//
// Cost: O(text bytes + tokens). Thread contract: pure functions; call from
// any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr size_t kMaxRenderedBytes = size_t{16} << 20;
inline constexpr uint32_t kMaxBosTokens = 4096;
inline constexpr size_t kMaxRoleNameBytes = 32;

// A run of tokens with one role, modality and turn.
struct TaggedSpan {
  Role role = Role::kUnspecified;
  Modality modality = Modality::kText;  // kText, kImage or kAudio
  uint32_t num_tokens = 0;              // >= 1
  uint32_t turn = 0;
  bool operator==(const TaggedSpan& o) const {
    return role == o.role && modality == o.modality &&
           num_tokens == o.num_tokens && turn == o.turn;
  }
};
std::string DebugString(const TaggedSpan& s);  // "ROLE_USER/text x5 t1"
void PrintTo(const TaggedSpan& s, std::ostream* os);

enum class TurnNumbering {
  kOpen,      // OpenSequence: the first user message is in turn 0
  kContinue,  // ExtendSequence: the first user message starts turn 1
};

// Spans covering the BOS tokens and every token of the text exactly once, in
// order; adjacent tokens with equal role, modality and turn share a span.
absl::StatusOr<std::vector<TaggedSpan>> TagRendered(const RenderedText& r,
                                                    TurnNumbering numbering);

// The core's spans: turn -> turn_offset.
std::vector<Span> ToSpans(const std::vector<TaggedSpan>& tagged);

}  // namespace triax::manager
