#include "kvmanager/tagger.h"

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace triax::manager {
namespace {

using absl::string_view;
constexpr size_t kNpos = string_view::npos;

// ChatML.
constexpr string_view kImStart = "<|im_start|>";
constexpr string_view kImEnd = "<|im_end|>";
// Llama 3.
constexpr string_view kBeginOfText = "<|begin_of_text|>";
constexpr string_view kStartHeader = "<|start_header_id|>";
constexpr string_view kEndHeader = "<|end_header_id|>";
constexpr string_view kEotId = "<|eot_id|>";
constexpr string_view kEomId = "<|eom_id|>";
constexpr string_view kPythonTag = "<|python_tag|>";
// Generic.
constexpr string_view kGenericPrefix = "### ";
// Content blocks.
constexpr string_view kThink = "<think>";
constexpr string_view kThinkEnd = "</think>";
constexpr string_view kToolCall = "<tool_call>";
constexpr string_view kToolCallEnd = "</tool_call>";
constexpr string_view kTools = "<tools>";
constexpr string_view kToolsEnd = "</tools>";
constexpr string_view kToolResponse = "<tool_response>";
constexpr string_view kToolResponseEnd = "</tool_response>";

struct Placeholder {
  string_view open;
  string_view close;  // empty: a single marker
  Modality modality;
};
constexpr Placeholder kPlaceholders[] = {
    {"<image>", "", Modality::kImage},
    {"<|image|>", "", Modality::kImage},
    {"<|image_pad|>", "", Modality::kImage},
    {"<|video_pad|>", "", Modality::kImage},
    {"<|vision_start|>", "<|vision_end|>", Modality::kImage},
    {"<audio>", "", Modality::kAudio},
    {"<|audio|>", "", Modality::kAudio},
    {"<|audio_pad|>", "", Modality::kAudio},
    {"<|AUDIO|>", "", Modality::kAudio},
    {"<|audio_start|>", "<|audio_end|>", Modality::kAudio},
    {"<|audio_bos|>", "<|audio_eos|>", Modality::kAudio},
};

enum class MsgKind { kSystem, kUser, kAssistant, kTool };
// Where the parser is inside a message's content.
enum class Inner { kBody, kThink, kToolCall, kPython, kTools, kToolResponse };

Role BaseRole(MsgKind k) {
  switch (k) {
    case MsgKind::kSystem:
      return Role::kSystem;
    case MsgKind::kUser:
      return Role::kUser;
    case MsgKind::kAssistant:
      return Role::kAssistant;
    case MsgKind::kTool:
      return Role::kToolResult;
  }
  return Role::kUnspecified;
}

Role InnerRole(MsgKind k, Inner in) {
  switch (in) {
    case Inner::kBody:
      return BaseRole(k);
    case Inner::kThink:
      return Role::kReasoning;
    case Inner::kToolCall:
    case Inner::kPython:
      return Role::kToolCall;
    case Inner::kTools:
      return Role::kToolSchema;
    case Inner::kToolResponse:
      return Role::kToolResult;
  }
  return Role::kUnspecified;
}

string_view OpenTag(Inner in) {
  switch (in) {
    case Inner::kThink:
      return kThink;
    case Inner::kToolCall:
      return kToolCall;
    case Inner::kPython:
      return kPythonTag;
    case Inner::kTools:
      return kTools;
    case Inner::kToolResponse:
      return kToolResponse;
    case Inner::kBody:
      break;
  }
  return "";
}

string_view CloseTag(Inner in) {
  switch (in) {
    case Inner::kThink:
      return kThinkEnd;
    case Inner::kToolCall:
      return kToolCallEnd;
    case Inner::kTools:
      return kToolsEnd;
    case Inner::kToolResponse:
      return kToolResponseEnd;
    case Inner::kPython:
    case Inner::kBody:
      break;
  }
  return "";
}

// Up to 24 bytes at `at`, C-escaped and quoted, for error messages.
std::string Snippet(string_view text, size_t at) {
  if (at >= text.size()) return "the end of the text";
  string_view s = text.substr(at, 24);
  return absl::StrCat("\"", absl::CHexEscape(s),
                      at + s.size() < text.size() ? "...\"" : "\"");
}

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// --- A small JSON recognizer (RFC 8259 syntax, nesting depth <= 64) --------

constexpr int kMaxJsonDepth = 64;

size_t JsonWs(string_view t, size_t i) {
  while (i < t.size() && IsSpace(t[i])) ++i;
  return i;
}

bool IsHex(char c) {
  return absl::ascii_isxdigit(static_cast<unsigned char>(c));
}

// t[i] == '"'; returns the index after the closing quote or kNpos.
size_t JsonString(string_view t, size_t i) {
  ++i;
  while (i < t.size()) {
    const unsigned char c = t[i];
    if (c == '"') return i + 1;
    if (c < 0x20) return kNpos;
    if (c == '\\') {
      if (i + 1 >= t.size()) return kNpos;
      const char e = t[i + 1];
      if (e == 'u') {
        if (i + 6 > t.size()) return kNpos;
        for (size_t k = i + 2; k < i + 6; ++k) {
          if (!IsHex(t[k])) return kNpos;
        }
        i += 6;
        continue;
      }
      if (std::string_view("\"\\/bfnrt").find(e) == std::string_view::npos) {
        return kNpos;
      }
      i += 2;
      continue;
    }
    ++i;
  }
  return kNpos;
}

size_t JsonDigits(string_view t, size_t i) {
  const size_t start = i;
  while (i < t.size() && absl::ascii_isdigit(static_cast<unsigned char>(t[i])))
    ++i;
  return i > start ? i : kNpos;
}

size_t JsonNumber(string_view t, size_t i) {
  if (t[i] == '-') ++i;
  if (i >= t.size()) return kNpos;
  if (t[i] == '0') {
    ++i;
  } else {
    i = JsonDigits(t, i);
    if (i == kNpos) return kNpos;
  }
  if (i < t.size() && t[i] == '.') {
    i = JsonDigits(t, i + 1);
    if (i == kNpos) return kNpos;
  }
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    i = JsonDigits(t, i);
  }
  return i;
}

// A JSON value at t[i] (no leading whitespace); returns its end or kNpos.
// At depth 0, sets *has_name when the object has a key "name".
size_t JsonValue(string_view t, size_t i, int depth, bool* has_name) {
  if (i >= t.size() || depth > kMaxJsonDepth) return kNpos;
  const char c = t[i];
  if (c == '{' || c == '[') {
    const char close = c == '{' ? '}' : ']';
    i = JsonWs(t, i + 1);
    if (i < t.size() && t[i] == close) return i + 1;
    while (true) {
      if (c == '{') {
        if (i >= t.size() || t[i] != '"') return kNpos;
        const size_t key_end = JsonString(t, i);
        if (key_end == kNpos) return kNpos;
        if (depth == 0 && t.substr(i, key_end - i) == "\"name\"") {
          *has_name = true;
        }
        i = JsonWs(t, key_end);
        if (i >= t.size() || t[i] != ':') return kNpos;
        i = JsonWs(t, i + 1);
      }
      i = JsonValue(t, i, depth + 1, has_name);
      if (i == kNpos) return kNpos;
      i = JsonWs(t, i);
      if (i >= t.size()) return kNpos;
      if (t[i] == close) return i + 1;
      if (t[i] != ',') return kNpos;
      i = JsonWs(t, i + 1);
    }
  }
  if (c == '"') return JsonString(t, i);
  if (c == '-' || absl::ascii_isdigit(static_cast<unsigned char>(c))) {
    return JsonNumber(t, i);
  }
  for (string_view lit : {"true", "false", "null"}) {
    if (absl::StartsWith(t.substr(i), lit)) return i + lit.size();
  }
  return kNpos;
}

// A tool schema starting at t[i] == '{' in t (one message's content): a JSON
// object with a top-level "name" key followed by spaces to the end of its
// line. Returns the end of the schema's line (after its "\n") or kNpos.
size_t ToolSchemaLine(string_view t, size_t i) {
  bool has_name = false;
  size_t j = JsonValue(t, i, 0, &has_name);
  if (j == kNpos || !has_name) return kNpos;
  while (j < t.size() && (t[j] == ' ' || t[j] == '\t' || t[j] == '\r')) ++j;
  if (j == t.size()) return j;
  return t[j] == '\n' ? j + 1 : kNpos;
}

// --- The parser --------------------------------------------------------------

struct ByteRun {
  size_t begin = 0, end = 0;
  Role role = Role::kUnspecified;
  Modality modality = Modality::kText;
  uint32_t turn = 0;  // user messages that started a turn up to here
};

// Caches the next occurrence of a pattern at or after a moving position, so
// that repeated searches cost O(text) in all.
class NextFinder {
 public:
  NextFinder(string_view text, string_view pattern)
      : text_(text), pattern_(pattern) {}
  size_t From(size_t from) {
    if (!searched_ || (at_ != kNpos && at_ < from)) {
      at_ = text_.find(pattern_, from);
      searched_ = true;
    }
    return at_;
  }

 private:
  string_view text_;
  string_view pattern_;
  bool searched_ = false;
  size_t at_ = kNpos;
};

class Parser {
 public:
  Parser(string_view text, ChatTemplate tmpl) : text_(text), tmpl_(tmpl) {}

  absl::Status Run(Role continues) {
    std::optional<std::pair<MsgKind, Inner>> start;
    switch (continues) {
      case Role::kUnspecified:
        break;
      case Role::kSystem:
        start.emplace(MsgKind::kSystem, Inner::kBody);
        break;
      case Role::kUser:
        start.emplace(MsgKind::kUser, Inner::kBody);
        break;
      case Role::kAssistant:
        start.emplace(MsgKind::kAssistant, Inner::kBody);
        break;
      case Role::kToolResult:
        start.emplace(MsgKind::kTool, Inner::kBody);
        break;
      case Role::kReasoning:
        start.emplace(MsgKind::kAssistant, Inner::kThink);
        break;
      case Role::kToolCall:
        start.emplace(MsgKind::kAssistant, Inner::kToolCall);
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("rendered.continues is ", RoleName(continues),
                         "; expected ROLE_UNSPECIFIED, ROLE_SYSTEM, ROLE_USER, "
                         "ROLE_ASSISTANT, ROLE_TOOL_RESULT, ROLE_REASONING or "
                         "ROLE_TOOL_CALL"));
    }
    switch (tmpl_) {
      case ChatTemplate::kChatML:
        return ParseMarked(start, kImStart, "\n", {kImEnd});
      case ChatTemplate::kLlama3:
        return ParseMarked(start, kStartHeader, kEndHeader, {kEotId, kEomId});
      case ChatTemplate::kGeneric:
        return ParseGeneric(start);
      case ChatTemplate::kUnspecified:
        break;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("rendered.chat_template is ", static_cast<int>(tmpl_),
                     "; expected CHATML, LLAMA3 or GENERIC"));
  }

  const std::vector<ByteRun>& runs() const { return runs_; }

 private:
  absl::Status Err(size_t at, string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("rendered.text byte ", at, ": ", what));
  }

  void Emit(size_t begin, size_t end, Role role, Modality m) {
    if (begin >= end) return;
    if (!runs_.empty() && runs_.back().end == begin &&
        runs_.back().role == role && runs_.back().modality == m &&
        runs_.back().turn == turn_) {
      runs_.back().end = end;
      return;
    }
    runs_.push_back(ByteRun{begin, end, role, m, turn_});
  }
  void Delim(size_t begin, size_t end) {
    Emit(begin, end, Role::kDelimiter, Modality::kText);
  }

  size_t SkipSpace(size_t i) const {
    while (i < text_.size() && IsSpace(text_[i])) ++i;
    return i;
  }

  absl::StatusOr<MsgKind> KindOf(string_view name, size_t at) const {
    std::string n(name);
    if (tmpl_ == ChatTemplate::kGeneric) absl::AsciiStrToLower(&n);
    if (n == "system") return MsgKind::kSystem;
    if (n == "user") return MsgKind::kUser;
    if (n == "assistant") return MsgKind::kAssistant;
    if (n == "tool" || n == "ipython") return MsgKind::kTool;
    return Err(at, absl::StrCat("unknown role name \"", absl::CHexEscape(name),
                                "\"; expected system, user, assistant, tool "
                                "or ipython"));
  }

  // A user message starts a turn unless it carries a tool response.
  void MaybeStartTurn(MsgKind kind, size_t content_begin, size_t content_end) {
    if (kind != MsgKind::kUser) return;
    const size_t i = std::min(SkipSpace(content_begin), content_end);
    if (absl::StartsWith(text_.substr(i, content_end - i), kToolResponse)) {
      return;
    }
    ++turn_;
  }

  // ChatML and Llama 3: messages with explicit start, header-end and end
  // markers.
  absl::Status ParseMarked(std::optional<std::pair<MsgKind, Inner>> start,
                           string_view open, string_view header_end,
                           std::initializer_list<string_view> ends) {
    const size_t n = text_.size();
    std::vector<NextFinder> end_finders;
    for (string_view e : ends) end_finders.emplace_back(text_, e);
    NextFinder open_finder(text_, open);
    NextFinder bot_finder(text_, kBeginOfText);
    const bool llama = tmpl_ == ChatTemplate::kLlama3;
    // The end marker of the message whose content starts at `from`, or kNpos;
    // checks that no next message starts inside.
    auto find_end = [&](size_t msg_at, size_t from,
                        size_t* end_len) -> absl::StatusOr<size_t> {
      size_t end = kNpos;
      for (size_t k = 0; k < end_finders.size(); ++k) {
        const size_t e = end_finders[k].From(from);
        if (e < end) {
          end = e;
          *end_len = ends.begin()[k].size();
        }
      }
      const size_t next = open_finder.From(from);
      if (next < end) {
        return Err(next,
                   absl::StrCat(open, " inside the message at byte ", msg_at,
                                "; expected ", *ends.begin(), " first"));
      }
      if (llama) {
        const size_t bot = bot_finder.From(from);
        if (bot < end) {
          return Err(bot, "<|begin_of_text|> is only allowed at byte 0");
        }
      }
      return end;
    };
    // The end of the content of the message at `msg_at` whose content starts
    // at `from` (the text's end for an open assistant message) and the
    // length of its end marker (0 when open).
    auto content = [&](MsgKind kind, size_t msg_at, size_t from,
                       size_t* end_len) -> absl::StatusOr<size_t> {
      *end_len = 0;
      absl::StatusOr<size_t> end = find_end(msg_at, from, end_len);
      if (!end.ok()) return end.status();
      if (*end == kNpos && kind != MsgKind::kAssistant) {
        return Err(msg_at,
                   absl::StrCat("the ", RoleName(BaseRole(kind)),
                                " message has no ", *ends.begin(),
                                " (only an assistant message may be open "
                                "at the end of the text)"));
      }
      return *end == kNpos ? n : *end;
    };

    size_t pos = 0;
    if (llama && absl::StartsWith(text_, kBeginOfText)) {
      Delim(0, kBeginOfText.size());
      pos = kBeginOfText.size();
    }
    if (start.has_value()) {
      size_t end_len = 0;
      TRIAX_ASSIGN_OR_RETURN(size_t content_end,
                             content(start->first, 0, pos, &end_len));
      TRIAX_RETURN_IF_ERROR(ParseContent(start->first, start->second, 0, pos,
                                         content_end, end_len == 0));
      pos = content_end + end_len;
      Delim(content_end, pos);
    }
    while (pos < n) {
      const size_t ws = SkipSpace(pos);
      Delim(pos, ws);
      pos = ws;
      if (pos == n) break;
      if (!absl::StartsWith(text_.substr(pos), open)) {
        if (llama && absl::StartsWith(text_.substr(pos), kBeginOfText)) {
          return Err(pos, "<|begin_of_text|> is only allowed at byte 0");
        }
        return Err(pos, absl::StrCat("expected ", open, " (the start of a ",
                                     "message), found ", Snippet(text_, pos)));
      }
      const size_t msg_at = pos;
      const size_t name_begin = pos + open.size();
      const size_t header_at =
          text_.substr(name_begin, kMaxRoleNameBytes + header_end.size())
              .find(header_end);
      if (header_at == kNpos) {
        return Err(msg_at,
                   absl::StrCat("unterminated header: expected a role name of "
                                "at most ",
                                kMaxRoleNameBytes, " bytes and ",
                                absl::CHexEscape(header_end), ", found ",
                                Snippet(text_, name_begin)));
      }
      const string_view name = text_.substr(name_begin, header_at);
      TRIAX_ASSIGN_OR_RETURN(MsgKind kind, KindOf(name, name_begin));
      size_t content_begin = name_begin + header_at + header_end.size();
      if (llama) {
        for (int k = 0;
             k < 2 && content_begin < n && text_[content_begin] == '\n'; ++k)
          ++content_begin;
      }
      size_t end_len = 0;
      TRIAX_ASSIGN_OR_RETURN(size_t content_end,
                             content(kind, msg_at, content_begin, &end_len));
      MaybeStartTurn(kind, content_begin, content_end);
      Delim(msg_at, content_begin);
      TRIAX_RETURN_IF_ERROR(ParseContent(kind, Inner::kBody, msg_at,
                                         content_begin, content_end,
                                         end_len == 0));
      pos = content_end + end_len;
      Delim(content_end, pos);
    }
    return absl::OkStatus();
  }

  // GENERIC: the NAME of a header line at `ls`, or kNpos-length (nullopt).
  std::optional<string_view> GenericHeader(size_t ls, size_t* line_end) const {
    size_t le = text_.find('\n', ls);
    if (le == kNpos) le = text_.size();
    *line_end = le;
    string_view line = text_.substr(ls, le - ls);
    if (!absl::StartsWith(line, kGenericPrefix) || !absl::EndsWith(line, ":")) {
      return std::nullopt;
    }
    string_view name = line.substr(kGenericPrefix.size(),
                                   line.size() - kGenericPrefix.size() - 1);
    if (name.empty() || name.size() > kMaxRoleNameBytes ||
        !absl::ascii_isalpha(static_cast<unsigned char>(name[0]))) {
      return std::nullopt;
    }
    for (char c : name) {
      if (!absl::ascii_isalpha(static_cast<unsigned char>(c)) && c != '_') {
        return std::nullopt;
      }
    }
    return name;
  }

  // The start of the next header line at or after the line start `ls`.
  size_t NextGenericHeader(size_t ls) const {
    while (ls < text_.size()) {
      size_t le = 0;
      if (GenericHeader(ls, &le).has_value()) return ls;
      ls = le + 1;
    }
    return text_.size();
  }

  absl::Status ParseGeneric(std::optional<std::pair<MsgKind, Inner>> start) {
    const size_t n = text_.size();
    size_t pos = 0;
    if (start.has_value()) {
      const size_t end = NextGenericHeader(0);
      TRIAX_RETURN_IF_ERROR(
          ParseContent(start->first, start->second, 0, 0, end,
                       end == n && start->first == MsgKind::kAssistant));
      pos = end;
    } else {
      pos = SkipSpace(0);
      // Whitespace before the first header: back up to its line start.
      while (pos > 0 && text_[pos - 1] != '\n') --pos;
      Delim(0, pos);
    }
    while (pos < n) {
      size_t le = 0;
      std::optional<string_view> name = GenericHeader(pos, &le);
      if (!name.has_value()) {
        return Err(pos, absl::StrCat("expected a header line \"### <role>:\", "
                                     "found ",
                                     Snippet(text_, pos)));
      }
      TRIAX_ASSIGN_OR_RETURN(MsgKind kind,
                             KindOf(*name, pos + kGenericPrefix.size()));
      const size_t content_begin = std::min(le + 1, n);
      const size_t content_end = NextGenericHeader(content_begin);
      MaybeStartTurn(kind, content_begin, content_end);
      Delim(pos, content_begin);
      TRIAX_RETURN_IF_ERROR(
          ParseContent(kind, Inner::kBody, pos, content_begin, content_end,
                       content_end == n && kind == MsgKind::kAssistant));
      pos = content_end;
    }
    return absl::OkStatus();
  }

  // Tags the content [begin, end) of the message at `msg_at`. `open`: the
  // message is still being generated, so a block may be left open.
  absl::Status ParseContent(MsgKind kind, Inner inner, size_t msg_at,
                            size_t begin, size_t end, bool open) {
    const string_view t = text_.substr(0, end);
    size_t inner_at = begin;
    const Placeholder* block = nullptr;
    size_t block_at = 0;
    size_t run_start = begin;
    Role run_role = InnerRole(kind, inner);
    Modality run_mod = Modality::kText;
    auto set_tag = [&](size_t at, Role role, Modality m) {
      if (role == run_role && m == run_mod) return;
      Emit(run_start, at, run_role, run_mod);
      run_start = at;
      run_role = role;
      run_mod = m;
    };
    auto enter = [&](size_t& i, Inner next) {
      set_tag(i, InnerRole(kind, next), Modality::kText);
      inner = next;
      inner_at = i;
      i += OpenTag(next).size();
    };
    auto leave = [&](size_t& i) {
      i += CloseTag(inner).size();
      inner = Inner::kBody;
      set_tag(i, BaseRole(kind), Modality::kText);
    };
    auto nested = [&](size_t i, string_view tag) {
      return Err(i, absl::StrCat(tag, " inside the ", OpenTag(inner),
                                 " opened at byte ", inner_at, "; expected ",
                                 CloseTag(inner), " first"));
    };
    auto stray = [&](size_t i, string_view close, string_view open_tag) {
      return Err(i, absl::StrCat(close, " without an open ", open_tag));
    };

    bool line_start = true;
    size_t i = begin;
    while (i < end) {
      if (block != nullptr) {
        const size_t c = t.find(block->close, i);
        if (c == kNpos) {
          i = end;
          break;
        }
        i = c + block->close.size();
        block = nullptr;
        set_tag(i, InnerRole(kind, inner), Modality::kText);
        line_start = false;
        continue;
      }
      const char c = t[i];
      if (c == '\n') {
        ++i;
        line_start = true;
        continue;
      }
      const bool at_line_start = line_start;
      line_start = false;
      if (kind == MsgKind::kSystem && inner == Inner::kBody && at_line_start) {
        if (absl::StartsWith(t.substr(i), kTools)) {
          enter(i, Inner::kTools);
          continue;
        }
        if (c == '{') {
          const size_t line_end = ToolSchemaLine(t, i);
          if (line_end != kNpos) {
            set_tag(i, Role::kToolSchema, Modality::kText);
            i = line_end;
            set_tag(i, Role::kSystem, Modality::kText);
            line_start = i > 0 && t[i - 1] == '\n';
            continue;
          }
        }
      }
      if (c != '<') {
        ++i;
        continue;
      }
      const string_view rest = t.substr(i);
      const Placeholder* ph = nullptr;
      for (const Placeholder& p : kPlaceholders) {
        if (absl::StartsWith(rest, p.open)) {
          ph = &p;
          break;
        }
      }
      if (ph != nullptr) {
        set_tag(i, InnerRole(kind, inner), ph->modality);
        if (!ph->close.empty()) {
          block = ph;
          block_at = i;
          i += ph->open.size();
        } else {
          i += ph->open.size();
          set_tag(i, InnerRole(kind, inner), Modality::kText);
        }
        continue;
      }
      switch (inner) {
        case Inner::kBody:
          if (kind == MsgKind::kAssistant) {
            if (absl::StartsWith(rest, kThink)) {
              enter(i, Inner::kThink);
              continue;
            }
            if (absl::StartsWith(rest, kToolCall)) {
              enter(i, Inner::kToolCall);
              continue;
            }
            if (absl::StartsWith(rest, kThinkEnd)) {
              return stray(i, kThinkEnd, kThink);
            }
            if (absl::StartsWith(rest, kToolCallEnd)) {
              return stray(i, kToolCallEnd, kToolCall);
            }
            if (tmpl_ == ChatTemplate::kLlama3 &&
                absl::StartsWith(rest, kPythonTag)) {
              enter(i, Inner::kPython);
              continue;
            }
          } else if (kind == MsgKind::kUser) {
            if (absl::StartsWith(rest, kToolResponse)) {
              enter(i, Inner::kToolResponse);
              continue;
            }
            if (absl::StartsWith(rest, kToolResponseEnd)) {
              return stray(i, kToolResponseEnd, kToolResponse);
            }
          }
          break;
        case Inner::kThink:
          if (absl::StartsWith(rest, kThinkEnd)) {
            leave(i);
            continue;
          }
          if (absl::StartsWith(rest, kThink)) return nested(i, kThink);
          break;
        case Inner::kToolCall:
          if (absl::StartsWith(rest, kToolCallEnd)) {
            leave(i);
            continue;
          }
          if (absl::StartsWith(rest, kThink)) return nested(i, kThink);
          if (absl::StartsWith(rest, kToolCall)) return nested(i, kToolCall);
          break;
        case Inner::kTools:
          if (absl::StartsWith(rest, kToolsEnd)) {
            leave(i);
            continue;
          }
          break;
        case Inner::kToolResponse:
          if (absl::StartsWith(rest, kToolResponseEnd)) {
            leave(i);
            continue;
          }
          if (absl::StartsWith(rest, kToolResponse)) {
            return nested(i, kToolResponse);
          }
          break;
        case Inner::kPython:
          break;
      }
      ++i;
    }
    Emit(run_start, end, run_role, run_mod);
    if (open) return absl::OkStatus();
    if (block != nullptr) {
      return Err(block_at, absl::StrCat("unclosed ", block->open, ": expected ",
                                        block->close, " before byte ", end,
                                        " (the end of the message at byte ",
                                        msg_at, ")"));
    }
    if (inner != Inner::kBody && inner != Inner::kPython) {
      return Err(
          inner_at,
          absl::StrCat("unclosed ", OpenTag(inner), ": expected ",
                       CloseTag(inner), " before byte ", end,
                       " (the end of the message at byte ", msg_at, ")"));
    }
    return absl::OkStatus();
  }

  const string_view text_;
  const ChatTemplate tmpl_;
  std::vector<ByteRun> runs_;
  uint32_t turn_ = 0;
};

void Append(std::vector<TaggedSpan>* out, Role role, Modality m, uint32_t n,
            uint32_t turn) {
  if (!out->empty() && out->back().role == role && out->back().modality == m &&
      out->back().turn == turn) {
    out->back().num_tokens += n;
    return;
  }
  out->push_back(TaggedSpan{role, m, n, turn});
}

}  // namespace

std::string DebugString(const TaggedSpan& s) {
  std::string mod = absl::AsciiStrToLower(ModalityName(s.modality));
  absl::string_view m = mod;
  absl::ConsumePrefix(&m, "modality_");
  return absl::StrCat(RoleName(s.role), "/", m, " x", s.num_tokens, " t",
                      s.turn);
}

void PrintTo(const TaggedSpan& s, std::ostream* os) { *os << DebugString(s); }

absl::StatusOr<std::vector<TaggedSpan>> TagRendered(const RenderedText& r,
                                                    TurnNumbering numbering) {
  const size_t n = r.text.size();
  if (n == 0) return absl::InvalidArgumentError("rendered.text is empty");
  if (n > kMaxRenderedBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rendered.text is ", n, " bytes; the limit is ", kMaxRenderedBytes));
  }
  if (r.bos_tokens > kMaxBosTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendered.bos_tokens ", r.bos_tokens,
                     " is over the limit of ", kMaxBosTokens));
  }
  const std::vector<uint32_t>& off = r.token_offsets;
  if (!off.empty()) {
    if (off[0] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rendered.token_offsets[0] is ", off[0], "; it must be 0"));
    }
    if (off.size() > n) {
      return absl::InvalidArgumentError(
          absl::StrCat("rendered.token_offsets has ", off.size(),
                       " entries for ", n, " bytes of text"));
    }
    for (size_t k = 1; k < off.size(); ++k) {
      if (off[k] <= off[k - 1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rendered.token_offsets[", k, "] is ", off[k],
            ", not greater than token_offsets[", k - 1, "] = ", off[k - 1]));
      }
      if (off[k] >= n) {
        return absl::InvalidArgumentError(
            absl::StrCat("rendered.token_offsets[", k, "] is ", off[k],
                         ", past the last byte of the ", n, "-byte text"));
      }
    }
  }
  Parser parser(r.text, r.chat_template);
  TRIAX_RETURN_IF_ERROR(parser.Run(r.continues));
  const std::vector<ByteRun>& runs = parser.runs();
  // The parser covers every byte once, in order.
  size_t covered = 0;
  for (const ByteRun& b : runs) {
    if (b.begin != covered || b.end <= b.begin) break;
    covered = b.end;
  }
  if (covered != n) {
    return absl::InternalError(absl::StrCat("tagger covered ", covered, " of ",
                                            n, " bytes (a tagger bug)"));
  }
  auto turn_of = [&](uint32_t t) {
    return numbering == TurnNumbering::kOpen && t > 0 ? t - 1 : t;
  };
  std::vector<TaggedSpan> out;
  if (r.bos_tokens > 0) {
    Append(&out, Role::kDelimiter, Modality::kText, r.bos_tokens, 0);
  }
  if (off.empty()) {
    for (const ByteRun& b : runs) {
      Append(&out, b.role, b.modality, static_cast<uint32_t>(b.end - b.begin),
             turn_of(b.turn));
    }
    return out;
  }
  size_t ri = 0;
  for (uint32_t o : off) {
    while (runs[ri].end <= o) ++ri;
    const ByteRun& b = runs[ri];
    Append(&out, b.role, b.modality, 1, turn_of(b.turn));
  }
  return out;
}

std::vector<Span> ToSpans(const std::vector<TaggedSpan>& tagged) {
  std::vector<Span> out;
  out.reserve(tagged.size());
  for (const TaggedSpan& t : tagged) {
    out.push_back(Span{t.role, t.modality, t.num_tokens, t.turn});
  }
  return out;
}

}  // namespace triax::manager
