// A rendered BFCL conversation as a byte-level model (kvproxy-18m) replays
// it turn by turn: the tokens from BOS, per turn the role spans in tokens
// (what Open gets for turn 0 and Extend for each later turn) and the turn's
// token range, and the "focus" tokens whose NLL the benchmarks report.
//
// Layout: tokens[0] is BOS, tokens[1 + b] is byte b of the rendered text.
// BOS joins the conversation's first span (its num_tokens is one more than
// its bytes). Turn 0 covers tokens [0, turns[0].end) (BOS included); turn
// k > 0 covers [turn.begin + 1, turn.end + 1). focus[1 + b] is true when
// byte b lies in a span of one of the focus roles.
//
// Thread contract: plain values; MakeBfclSession is a pure function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/frontend/bfcl.h"

namespace triax::frontend {

// `num_tokens` consecutive tokens of one role (a triax.v1.Span without the
// protobuf; client/frontend/service_types.h converts).
struct TokenSpan {
  Role role = Role::kSystem;
  uint32_t num_tokens = 0;
};

struct BfclSessionTurn {
  std::vector<TokenSpan> spans;  // cover exactly [first, end)
  int64_t first = 0, end = 0;    // token range [first, end)
};

struct BfclSession {
  std::string id;
  std::vector<int> tokens;  // BOS, then one byte token per rendered byte
  std::vector<BfclSessionTurn> turns;
  std::vector<bool> focus;  // by token index, same length as tokens

  // Number of true entries of `focus`.
  int64_t num_focus() const;
  // The spans of every turn, in order (the whole conversation in one Open).
  std::vector<TokenSpan> AllSpans() const;
};

struct BfclSessionOptions {
  // Roles whose tokens are focus tokens.
  std::vector<Role> focus_roles = {Role::kAssistant, Role::kToolCall};
  // Keep at most this many turns (the text is cut after the last kept one);
  // 0 keeps all.
  int max_turns = 0;
};

// Builds the session of `conv` (id from conv.id). INVALID_ARGUMENT when
// options.max_turns < 0, when `conv` has no turns, or when a turn or span
// lies outside the text or the spans of a turn do not cover it in order
// (the message names the turn and the offsets).
absl::StatusOr<BfclSession> MakeBfclSession(
    const RenderedConversation& conv, const BfclSessionOptions& options = {});

}  // namespace triax::frontend
