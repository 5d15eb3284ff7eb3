// Arrival traces for the capacity replay (capacity_replay; docs/capacity.md
// "Replay"): sessions that arrive at given times, each a series of turns,
// how they are made (synthetic shapes, or the span structure of BFCL
// conversations) and their text form.
//
// A session's turn k is played as a frontend plays it: turn 0's prompt is
// the Open, turn k > 0's prompt an Extend with new_turn after think_ms of
// idleness; decode_ms after the prompt was admitted, the response (the
// generated tokens and, for tool calls, the tool's result) is an Extend in
// the same turn. After the last turn's response the session closes.
//
// Text form (one line per session, then one per turn; '#' starts a comment
// line; fields are key=value separated by spaces, in any order):
//   session id=ID tenant=TENANT arrive_ms=N shape=NAME
//   turn think_ms=N decode_ms=N prompt=ROLE:TOKENS,... response=ROLE:TOKENS,...
// ROLE is a role label (system, tool_schema, user, assistant, reasoning,
// tool_call, tool_result, delimiter); response=- is an empty response; ids
// and tenants are [A-Za-z0-9._:-]{1,128}. Sessions are in non-decreasing
// arrive_ms order with distinct ids, each with at least one turn; turn 0
// has think_ms=0 and a non-empty prompt. ReadTrace's errors are
// INVALID_ARGUMENT "PATH:LINE: " followed by the field and the value
// (`arrive_ms="-4" is not a non-negative integer`), NOT_FOUND when the
// file cannot be read.
//
// Thread contract: plain values and pure functions (thread-safe).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/frontend/bfcl.h"
#include "kvmanager/types.h"

namespace triax::bench::capacity {

struct TraceTurn {
  int64_t think_ms = 0;   // idle before the turn (turn 0: 0)
  int64_t decode_ms = 0;  // from the prompt's admission to the response
  std::vector<manager::Span> prompt;    // the Open, or an Extend new_turn
  std::vector<manager::Span> response;  // an Extend in the turn; may be empty
};

struct TraceSession {
  std::string id;
  std::string tenant;
  int64_t arrive_ms = 0;
  std::string shape;  // where the shape came from: "synthetic", a BFCL id
  std::vector<TraceTurn> turns;
  uint64_t Tokens() const;
};

struct Trace {
  std::vector<TraceSession> sessions;  // by arrive_ms
  uint64_t Tokens() const;
  // Tenants in the order they first arrive.
  std::vector<std::string> Tenants() const;
};

// The span structure of one session: per turn, prompt and response.
struct SessionShape {
  std::string name;
  std::vector<std::pair<std::vector<manager::Span>, std::vector<manager::Span>>>
      turns;
};

// The shape of a rendered BFCL conversation: each turn's role spans cut
// before the first TOOL_CALL or ASSISTANT span (prompt: the system turn's
// spans for turn 0 and the user's message with its delimiters; response:
// the call, the tool's result and the delimiters after them), each span's
// bytes divided by `bytes_per_token` and rounded up (1: kvproxy-18m's byte
// tokens; BOS is left out). INVALID_ARGUMENT naming bytes_per_token when it
// is not >= 1, and naming the conversation when a turn has no prompt.
absl::StatusOr<SessionShape> ShapeOfConversation(
    const frontend::RenderedConversation& conv, double bytes_per_token);

// Token ranges of the synthetic shape, each [min, max] drawn uniformly.
struct SyntheticShape {
  uint32_t turns_min = 2, turns_max = 8;
  uint32_t system_min = 200, system_max = 600;  // turn 0
  uint32_t schema_min = 0, schema_max = 2000;   // turn 0, tool schemas
  uint32_t user_min = 20, user_max = 200;       // every turn's prompt
  uint32_t call_min = 20, call_max = 120;       // response: the tool call
  uint32_t result_min = 10, result_max = 400;   // response: its result
};

struct TenantWeight {
  std::string tenant;
  double weight = 1;  // > 0
  // Sessions of this tenant arrive in [from_ms, to_ms) only.
  int64_t from_ms = 0;
  int64_t to_ms = INT64_MAX;
};

// How sessions arrive and pace their turns.
struct Timing {
  // Sessions per second (Poisson arrivals), > 0, when every tenant is in
  // its window: tenant k's sessions arrive at arrival_rate x weight_k /
  // (sum of the weights), within its window.
  double arrival_rate = 1;
  double think_ms = 5000;  // mean idle before turns k > 0 (exponential)
  // decode_ms = response tokens x decode_ms_per_token + tool_ms (0 without
  // a response).
  double decode_ms_per_token = 20;
  double tool_ms = 200;
};

// The pseudo-random stream of MakeTrace (splitmix64).
class TraceRng {
 public:
  explicit TraceRng(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  double Uniform();  // [0, 1), 53 bits
  // [lo, hi] (lo <= hi).
  uint32_t Between(uint32_t lo, uint32_t hi);
  double Exponential(double mean);

 private:
  uint64_t state_;
};

// `sessions` sessions, each with a shape from `next_shape` (called once
// per session, in arrival order), a tenant by weight, arrivals and think
// times from `timing`, all drawn from one pseudo-random stream of `seed`
// (splitmix64; the same seed gives the same trace on every platform).
// Arrivals are drawn at the full rate with a tenant by weight, and dropped
// when that tenant is outside its window (thinning: each tenant's sessions
// are a Poisson stream of its own rate in its window). Session ids are "s"
// and the index, zero-padded to 6 digits. INVALID_ARGUMENT naming the
// field for sessions < 1, no tenants, a weight that is not > 0, a window
// with from_ms >= to_ms or from_ms < 0, every tenant's window ending,
// arrival_rate not > 0, think_ms, decode_ms_per_token or tool_ms negative.
absl::StatusOr<Trace> MakeTrace(
    int sessions, const std::vector<TenantWeight>& tenants,
    const Timing& timing, uint64_t seed,
    const std::function<SessionShape(TraceRng&)>& next_shape);

// Draws a synthetic shape (turn 0: system, tool schema, user; later turns:
// user; every response: a tool call and its result, with the delimiters
// left out). INVALID_ARGUMENT naming the range whose min exceeds its max,
// or turns_min < 1.
absl::Status CheckSyntheticShape(const SyntheticShape& s);
SessionShape DrawSyntheticShape(const SyntheticShape& s, TraceRng& rng);

// The text form (see the top of the file).
std::string TraceText(const Trace& trace);
absl::StatusOr<Trace> ParseTrace(absl::string_view path,
                                 absl::string_view text);
absl::StatusOr<Trace> ReadTrace(const std::string& path);
absl::Status WriteTrace(const std::string& path, const Trace& trace);

}  // namespace triax::bench::capacity
