#include "bench/capacity/replay_trace.h"

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::bench::capacity {
namespace {

using manager::Span;

uint64_t SpanTokens(const std::vector<Span>& spans) {
  uint64_t n = 0;
  for (const Span& s : spans) n += s.num_tokens;
  return n;
}

// Adds `tokens` of `role` to `spans`, joining the last span of that role.
void AddSpan(std::vector<Span>* spans, Role role, uint32_t tokens) {
  if (tokens == 0) return;
  if (!spans->empty() && spans->back().role == role) {
    spans->back().num_tokens += tokens;
    return;
  }
  spans->push_back(Span{role, Modality::kText, tokens});
}

std::string SpansText(const std::vector<Span>& spans) {
  if (spans.empty()) return "-";
  return absl::StrJoin(spans, ",", [](std::string* out, const Span& s) {
    absl::StrAppend(out, RoleLabel(s.role), ":", s.num_tokens);
  });
}

std::string RoleChoices() {
  std::vector<std::string> names;
  for (int r = static_cast<int>(Role::kSystem);
       r <= static_cast<int>(Role::kDelimiter); ++r) {
    names.push_back(RoleLabel(static_cast<Role>(r)));
  }
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<std::vector<Span>> ParseSpans(const std::string& where,
                                             absl::string_view key,
                                             absl::string_view value) {
  std::vector<Span> spans;
  if (value == "-") return spans;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    const std::pair<absl::string_view, absl::string_view> rt =
        absl::StrSplit(part, absl::MaxSplits(':', 1));
    Role role = Role::kUnspecified;
    for (int r = static_cast<int>(Role::kSystem);
         r <= static_cast<int>(Role::kDelimiter); ++r) {
      if (RoleLabel(static_cast<Role>(r)) == rt.first) {
        role = static_cast<Role>(r);
      }
    }
    if (role == Role::kUnspecified) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, key, "=\"", value, "\": \"", rt.first,
                       "\" is no role (", RoleChoices(), ")"));
    }
    uint32_t tokens = 0;
    if (!absl::SimpleAtoi(rt.second, &tokens) || tokens == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, key, "=\"", value, "\": tokens \"", rt.second,
                       "\" of ", rt.first, " is not a positive integer"));
    }
    spans.push_back(Span{role, Modality::kText, tokens});
  }
  return spans;
}

// key=value fields of one line after its keyword; every key in `keys`
// exactly once.
absl::StatusOr<std::map<std::string, std::string>> Fields(
    const std::string& where, const std::vector<absl::string_view>& words,
    const std::set<std::string>& keys) {
  std::map<std::string, std::string> out;
  for (size_t i = 1; i < words.size(); ++i) {
    const std::pair<std::string, std::string> kv =
        absl::StrSplit(words[i], absl::MaxSplits('=', 1));
    if (keys.count(kv.first) == 0 || words[i].find('=') == words[i].npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "\"", words[i], "\" is no field of a ", words[0],
                       " line (", absl::StrJoin(keys, ", "), ")"));
    }
    if (!out.emplace(kv.first, kv.second).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, kv.first, " is given twice"));
    }
  }
  for (const std::string& k : keys) {
    if (out.count(k) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, words[0], " line without ", k, "="));
    }
  }
  return out;
}

absl::StatusOr<int64_t> NonNegative(const std::string& where,
                                    absl::string_view key,
                                    const std::string& value) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, key, "=\"", value, "\" is not a non-negative integer"));
  }
  return v;
}

absl::Status CheckRange(absl::string_view name, uint32_t lo, uint32_t hi) {
  if (lo > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": min ", lo, " is above max ", hi));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t TraceSession::Tokens() const {
  uint64_t n = 0;
  for (const TraceTurn& t : turns) {
    n += SpanTokens(t.prompt) + SpanTokens(t.response);
  }
  return n;
}

uint64_t Trace::Tokens() const {
  uint64_t n = 0;
  for (const TraceSession& s : sessions) n += s.Tokens();
  return n;
}

std::vector<std::string> Trace::Tenants() const {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const TraceSession& s : sessions) {
    if (seen.insert(s.tenant).second) out.push_back(s.tenant);
  }
  return out;
}

absl::StatusOr<SessionShape> ShapeOfConversation(
    const frontend::RenderedConversation& conv, double bytes_per_token) {
  if (!(bytes_per_token >= 1) || !std::isfinite(bytes_per_token)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes_per_token=", bytes_per_token, " is not a number >= 1"));
  }
  SessionShape shape;
  shape.name = conv.id;
  for (size_t k = 0; k < conv.turns.size(); ++k) {
    std::vector<Span> prompt, response;
    bool answering = false;
    for (const frontend::RoleSpan& rs : conv.turns[k].spans) {
      answering = answering || rs.role == Role::kToolCall ||
                  rs.role == Role::kAssistant;
      const auto tokens = static_cast<uint32_t>(
          std::ceil(static_cast<double>(rs.length) / bytes_per_token));
      AddSpan(answering ? &response : &prompt, rs.role, tokens);
    }
    if (prompt.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "conversation ", conv.id, " turn ", k,
          " has no prompt (it starts with a tool call or an answer)"));
    }
    shape.turns.emplace_back(std::move(prompt), std::move(response));
  }
  if (shape.turns.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("conversation ", conv.id, " has no turns"));
  }
  return shape;
}

uint64_t TraceRng::Next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double TraceRng::Uniform() {
  return static_cast<double>(Next() >> 11) * 0x1.0p-53;
}

uint32_t TraceRng::Between(uint32_t lo, uint32_t hi) {
  const uint64_t span = uint64_t{hi} - lo + 1;
  return lo + static_cast<uint32_t>(Next() % span);
}

double TraceRng::Exponential(double mean) {
  return -std::log1p(-Uniform()) * mean;
}

absl::Status CheckSyntheticShape(const SyntheticShape& s) {
  if (s.turns_min < 1) {
    return absl::InvalidArgumentError("turns: min 0 is below 1");
  }
  TRIAX_RETURN_IF_ERROR(CheckRange("turns", s.turns_min, s.turns_max));
  TRIAX_RETURN_IF_ERROR(CheckRange("system", s.system_min, s.system_max));
  TRIAX_RETURN_IF_ERROR(CheckRange("schema", s.schema_min, s.schema_max));
  TRIAX_RETURN_IF_ERROR(CheckRange("user", s.user_min, s.user_max));
  TRIAX_RETURN_IF_ERROR(CheckRange("call", s.call_min, s.call_max));
  TRIAX_RETURN_IF_ERROR(CheckRange("result", s.result_min, s.result_max));
  if (s.system_max + s.schema_max + s.user_max == 0) {
    return absl::InvalidArgumentError(
        "system, schema and user: turn 0 would have no prompt");
  }
  return absl::OkStatus();
}

SessionShape DrawSyntheticShape(const SyntheticShape& s, TraceRng& rng) {
  SessionShape shape;
  shape.name = "synthetic";
  const uint32_t turns = rng.Between(s.turns_min, s.turns_max);
  for (uint32_t k = 0; k < turns; ++k) {
    std::vector<Span> prompt, response;
    if (k == 0) {
      AddSpan(&prompt, Role::kSystem, rng.Between(s.system_min, s.system_max));
      AddSpan(&prompt, Role::kToolSchema,
              rng.Between(s.schema_min, s.schema_max));
    }
    AddSpan(&prompt, Role::kUser, rng.Between(s.user_min, s.user_max));
    if (prompt.empty()) AddSpan(&prompt, Role::kUser, 1);
    AddSpan(&response, Role::kToolCall, rng.Between(s.call_min, s.call_max));
    AddSpan(&response, Role::kToolResult,
            rng.Between(s.result_min, s.result_max));
    shape.turns.emplace_back(std::move(prompt), std::move(response));
  }
  return shape;
}

absl::StatusOr<Trace> MakeTrace(
    int sessions, const std::vector<TenantWeight>& tenants,
    const Timing& timing, uint64_t seed,
    const std::function<SessionShape(TraceRng&)>& next_shape) {
  if (sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sessions=", sessions, " is below 1"));
  }
  if (tenants.empty()) return absl::InvalidArgumentError("no tenants");
  double total_weight = 0;
  bool endless = false;
  for (const TenantWeight& t : tenants) {
    TRIAX_RETURN_IF_ERROR(ValidateId("tenant", t.tenant));
    if (!(t.weight > 0) || !std::isfinite(t.weight)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tenant ", t.tenant, ": weight=", t.weight, " is not > 0"));
    }
    if (t.from_ms < 0 || t.from_ms >= t.to_ms) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant ", t.tenant, ": window from_ms=", t.from_ms,
                       " to_ms=", t.to_ms, " is empty or negative"));
    }
    endless = endless || t.to_ms == INT64_MAX;
    total_weight += t.weight;
  }
  if (!endless) {
    return absl::InvalidArgumentError(
        "every tenant's window ends: give one tenant no end, or the trace "
        "could run out of arrivals");
  }
  if (!(timing.arrival_rate > 0) || !std::isfinite(timing.arrival_rate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("arrival_rate=", timing.arrival_rate, " is not > 0"));
  }
  for (const auto& [name, v] :
       {std::pair<const char*, double>{"think_ms", timing.think_ms},
        {"decode_ms_per_token", timing.decode_ms_per_token},
        {"tool_ms", timing.tool_ms}}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "=", v, " is negative"));
    }
  }
  TraceRng rng(seed);
  Trace trace;
  trace.sessions.reserve(static_cast<size_t>(sessions));
  double t_ms = 0;
  for (int i = 0; i < sessions;) {
    t_ms += rng.Exponential(1000.0 / timing.arrival_rate);
    double pick = rng.Uniform() * total_weight;
    const TenantWeight* tenant = &tenants.back();
    for (const TenantWeight& t : tenants) {
      if (pick < t.weight) {
        tenant = &t;
        break;
      }
      pick -= t.weight;
    }
    const auto at = static_cast<int64_t>(t_ms);
    if (at < tenant->from_ms || at >= tenant->to_ms) continue;
    TraceSession s;
    s.id = absl::StrFormat("s%06d", i++);
    s.tenant = tenant->tenant;
    s.arrive_ms = at;
    SessionShape shape = next_shape(rng);
    s.shape = shape.name;
    for (size_t k = 0; k < shape.turns.size(); ++k) {
      TraceTurn turn;
      turn.prompt = std::move(shape.turns[k].first);
      turn.response = std::move(shape.turns[k].second);
      if (k > 0) {
        turn.think_ms = static_cast<int64_t>(rng.Exponential(timing.think_ms));
      }
      const uint64_t out = SpanTokens(turn.response);
      turn.decode_ms =
          out == 0 ? 0
                   : static_cast<int64_t>(static_cast<double>(out) *
                                              timing.decode_ms_per_token +
                                          timing.tool_ms);
      s.turns.push_back(std::move(turn));
    }
    trace.sessions.push_back(std::move(s));
  }
  return trace;
}

std::string TraceText(const Trace& trace) {
  std::string out = "# triaxkv capacity replay trace v1\n";
  for (const TraceSession& s : trace.sessions) {
    absl::StrAppend(&out, "session id=", s.id, " tenant=", s.tenant,
                    " arrive_ms=", s.arrive_ms, " shape=", s.shape, "\n");
    for (const TraceTurn& t : s.turns) {
      absl::StrAppend(&out, "turn think_ms=", t.think_ms,
                      " decode_ms=", t.decode_ms,
                      " prompt=", SpansText(t.prompt),
                      " response=", SpansText(t.response), "\n");
    }
  }
  return out;
}

absl::StatusOr<Trace> ParseTrace(absl::string_view path,
                                 absl::string_view text) {
  Trace trace;
  std::set<std::string> ids;
  int line_no = 0;
  int session_line = 0;
  auto close_session = [&]() -> absl::Status {
    if (!trace.sessions.empty() && trace.sessions.back().turns.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", session_line, ": session id=", trace.sessions.back().id,
          " has no turns"));
    }
    return absl::OkStatus();
  };
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const std::string where = absl::StrCat(path, ":", line_no, ": ");
    const std::vector<absl::string_view> words =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (words[0] == "session") {
      TRIAX_RETURN_IF_ERROR(close_session());
      TRIAX_ASSIGN_OR_RETURN(
          auto f, Fields(where, words, {"id", "tenant", "arrive_ms", "shape"}));
      TraceSession s;
      s.id = f["id"];
      s.tenant = f["tenant"];
      s.shape = f["shape"];
      for (const char* key : {"id", "tenant"}) {
        if (absl::Status st = ValidateId(key, f[key]); !st.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(where, st.message()));
        }
      }
      TRIAX_ASSIGN_OR_RETURN(s.arrive_ms,
                             NonNegative(where, "arrive_ms", f["arrive_ms"]));
      if (!trace.sessions.empty() &&
          s.arrive_ms < trace.sessions.back().arrive_ms) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "arrive_ms=", s.arrive_ms,
                         " is before the previous "
                         "session's ",
                         trace.sessions.back().arrive_ms,
                         " (sessions go in arrival order)"));
      }
      if (!ids.insert(s.id).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "id=", s.id, " is used twice"));
      }
      session_line = line_no;
      trace.sessions.push_back(std::move(s));
    } else if (words[0] == "turn") {
      if (trace.sessions.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "turn line before any session line"));
      }
      TRIAX_ASSIGN_OR_RETURN(
          auto f, Fields(where, words,
                         {"think_ms", "decode_ms", "prompt", "response"}));
      TraceTurn t;
      TRIAX_ASSIGN_OR_RETURN(t.think_ms,
                             NonNegative(where, "think_ms", f["think_ms"]));
      TRIAX_ASSIGN_OR_RETURN(t.decode_ms,
                             NonNegative(where, "decode_ms", f["decode_ms"]));
      TRIAX_ASSIGN_OR_RETURN(t.prompt,
                             ParseSpans(where, "prompt", f["prompt"]));
      TRIAX_ASSIGN_OR_RETURN(t.response,
                             ParseSpans(where, "response", f["response"]));
      TraceSession& s = trace.sessions.back();
      if (s.turns.empty() && t.think_ms != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "think_ms=", t.think_ms,
            " on the first turn of session id=", s.id, " (must be 0)"));
      }
      if (s.turns.empty() && t.prompt.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "prompt=- on the first turn of session id=", s.id,
            " (the Open needs tokens)"));
      }
      if (t.prompt.empty() && t.response.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "prompt=- and response=-: the turn is empty"));
      }
      s.turns.push_back(std::move(t));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "\"", words[0],
                       "\" is no line kind (session, turn, or # comment)"));
    }
  }
  TRIAX_RETURN_IF_ERROR(close_session());
  if (trace.sessions.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no sessions in the trace"));
  }
  return trace;
}

absl::StatusOr<Trace> ReadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseTrace(path, ss.str());
}

absl::Status WriteTrace(const std::string& path, const Trace& trace) {
  std::ofstream out(path, std::ios::binary);
  out << TraceText(trace);
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace triax::bench::capacity
