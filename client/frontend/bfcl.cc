#include "client/frontend/bfcl.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/frontend/llama2c.h"

namespace triax::frontend {

namespace {

using ojson = nlohmann::ordered_json;

constexpr char kSystemInstruction[] =
    "You are a helpful assistant that can call functions. When a request "
    "needs tools, reply with <tool_call> followed by a list of calls in Python "
    "syntax and </tool_call>. Available functions, one JSON object per line:\n";

absl::StatusOr<ojson> ParseJson(absl::string_view text,
                                absl::string_view what) {
  ojson j = ojson::parse(text.begin(), text.end(), nullptr,
                         /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": malformed JSON (", text.size(), " bytes)"));
  }
  return j;
}

absl::StatusOr<std::string> GetString(const ojson& obj, const char* field,
                                      absl::string_view what) {
  if (!obj.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a JSON object"));
  }
  auto it = obj.find(field);
  if (it == obj.end() || !it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field '", field, "' missing or not a string"));
  }
  return it->get<std::string>();
}

void AppendEscaped(const std::string& s, std::string* out) {
  out->push_back('"');
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    uint32_t cp = c;
    size_t len = 1;
    // nlohmann validated the UTF-8 while parsing.
    if (c >= 0xF0) {
      cp = c & 0x07;
      len = 4;
    } else if (c >= 0xE0) {
      cp = c & 0x0F;
      len = 3;
    } else if (c >= 0xC0) {
      cp = c & 0x1F;
      len = 2;
    }
    for (size_t k = 1; k < len && i + k < s.size(); ++k) {
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    }
    i += len;
    char buf[16];
    switch (cp) {
      case '"':
        out->append("\\\"");
        continue;
      case '\\':
        out->append("\\\\");
        continue;
      case '\n':
        out->append("\\n");
        continue;
      case '\r':
        out->append("\\r");
        continue;
      case '\t':
        out->append("\\t");
        continue;
      case '\b':
        out->append("\\b");
        continue;
      case '\f':
        out->append("\\f");
        continue;
      default:
        break;
    }
    if (cp >= 0x20 && cp <= 0x7E) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x10000) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
      out->append(buf);
    } else {
      const uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (v >> 10),
                    0xDC00 + (v & 0x3FF));
      out->append(buf);
    }
  }
  out->push_back('"');
}

// Python's float repr: the shortest round-tripping digits, fixed notation for
// decimal exponents in [-4, 16), else d.ddde+XX.
std::string PyFloatRepr(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  int prec = 1;
  for (; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*e", prec - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // buf = [-]d[.ddd]e[+-]XX
  std::string s(buf);
  const bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  const size_t e = s.find('e');
  const int exp = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t k = 0; k < e; ++k) {
    if (s[k] != '.') digits.push_back(s[k]);
  }
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(-exp - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out += digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+',
                  std::abs(exp));
    out += eb;
  }
  return out;
}

void Dump(const ojson& j, std::string* out) {
  switch (j.type()) {
    case ojson::value_t::null:
      out->append("null");
      return;
    case ojson::value_t::boolean:
      out->append(j.get<bool>() ? "true" : "false");
      return;
    case ojson::value_t::number_integer:
      out->append(absl::StrCat(j.get<int64_t>()));
      return;
    case ojson::value_t::number_unsigned:
      out->append(absl::StrCat(j.get<uint64_t>()));
      return;
    case ojson::value_t::number_float:
      out->append(PyFloatRepr(j.get<double>()));
      return;
    case ojson::value_t::string:
      AppendEscaped(j.get_ref<const std::string&>(), out);
      return;
    case ojson::value_t::array: {
      out->push_back('[');
      bool first = true;
      for (const auto& e : j) {
        if (!first) out->append(", ");
        first = false;
        Dump(e, out);
      }
      out->push_back(']');
      return;
    }
    case ojson::value_t::object: {
      out->push_back('{');
      bool first = true;
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (!first) out->append(", ");
        first = false;
        AppendEscaped(it.key(), out);
        out->append(": ");
        Dump(it.value(), out);
      }
      out->push_back('}');
      return;
    }
    default:
      out->append("null");
      return;  // binary / discarded: not JSON text
  }
}

// Builds the text and spans, merging adjacent pieces of one role inside a
// turn (a span never straddles two turns).
class Builder {
 public:
  void Add(Role role, absl::string_view piece) {
    if (piece.empty()) return;
    if (spans_.size() > turn_span_ && spans_.back().role == role) {
      spans_.back().length += piece.size();
    } else {
      spans_.push_back({role, text_.size(), piece.size()});
    }
    text_.append(piece.data(), piece.size());
  }
  // Closes the current turn at the current end of text.
  void EndTurn(std::vector<RenderedTurn>* turns) {
    RenderedTurn t;
    t.begin = turn_begin_;
    t.end = text_.size();
    t.spans.assign(spans_.begin() + turn_span_, spans_.end());
    turns->push_back(std::move(t));
    turn_begin_ = text_.size();
    turn_span_ = spans_.size();
  }
  std::string& text() { return text_; }

 private:
  std::string text_;
  std::vector<RoleSpan> spans_;
  size_t turn_begin_ = 0, turn_span_ = 0;
};

absl::StatusOr<Role> MessageRole(const std::string& role,
                                 absl::string_view id) {
  if (role == "user") return Role::kUser;
  if (role == "system") return Role::kSystem;
  if (role == "assistant") return Role::kAssistant;
  if (role == "tool") return Role::kToolResult;
  return absl::InvalidArgumentError(
      absl::StrCat("entry ", id, ": message role '", role,
                   "' is not one of "
                   "user, system, assistant, tool"));
}

size_t SystemBytes(const std::vector<std::string>& docs, int kept) {
  size_t n = std::string("<|im_start|>system\n").size() +
             sizeof(kSystemInstruction) - 1 +
             std::string("<|im_end|>\n").size();
  for (int i = 0; i < kept; ++i) n += docs[i].size() + (i > 0 ? 1 : 0);
  return n;
}

std::string Exchange(const std::vector<BfclMessage>& messages,
                     const std::vector<std::string>& calls) {
  std::string s;
  for (const auto& m : messages) {
    absl::StrAppend(&s, "<|im_start|>", m.role, "\n", m.content,
                    "<|im_end|>\n");
  }
  absl::StrAppend(&s, "<|im_start|>assistant\n<tool_call>\n[",
                  absl::StrJoin(calls, ", "),
                  "]\n</tool_call><|im_end|>\n<|im_start|>tool\n"
                  "{\"status\": \"ok\"}<|im_end|>\n");
  return s;
}

}  // namespace

std::vector<RoleSpan> RenderedConversation::AllSpans() const {
  std::vector<RoleSpan> all;
  for (const auto& t : turns)
    all.insert(all.end(), t.spans.begin(), t.spans.end());
  return all;
}

std::string PyJsonDumps(const nlohmann::ordered_json& value) {
  std::string out;
  Dump(value, &out);
  return out;
}

absl::StatusOr<std::string> FuncDocFile(absl::string_view api_class) {
  static const std::pair<const char*, const char*> kFiles[] = {
      {"GorillaFileSystem", "gorilla_file_system.json"},
      {"TwitterAPI", "posting_api.json"},
      {"MessageAPI", "message_api.json"},
      {"TicketAPI", "ticket_api.json"},
      {"MathAPI", "math_api.json"},
      {"TradingBot", "trading_bot.json"},
      {"TravelAPI", "travel_booking.json"},
      {"VehicleControlAPI", "vehicle_control.json"},
  };
  for (const auto& [cls, file] : kFiles) {
    if (api_class == cls) return std::string(file);
  }
  return absl::NotFoundError(
      absl::StrCat("involved_classes: unknown API class '", api_class, "'"));
}

absl::StatusOr<BfclEntry> ParseBfclEntry(absl::string_view json_line) {
  auto j_or = ParseJson(json_line, "BFCL entry");
  if (!j_or.ok()) return j_or.status();
  const ojson& j = *j_or;
  BfclEntry e;
  auto id = GetString(j, "id", "BFCL entry");
  if (!id.ok()) return id.status();
  e.id = *id;
  const std::string what = absl::StrCat("BFCL entry ", e.id);
  auto q = j.find("question");
  if (q == j.end() || !q->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field 'question' missing or not a list"));
  }
  for (size_t t = 0; t < q->size(); ++t) {
    const ojson& turn = (*q)[t];
    if (!turn.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": question[", t, "] is not a list of messages"));
    }
    std::vector<BfclMessage> msgs;
    for (size_t m = 0; m < turn.size(); ++m) {
      const std::string mwhat =
          absl::StrCat(what, " question[", t, "][", m, "]");
      auto role = GetString(turn[m], "role", mwhat);
      if (!role.ok()) return role.status();
      auto content = GetString(turn[m], "content", mwhat);
      if (!content.ok()) return content.status();
      auto r = MessageRole(*role, e.id);
      if (!r.ok()) return r.status();
      msgs.push_back({*role, *content});
    }
    e.turns.push_back(std::move(msgs));
  }
  auto ic = j.find("involved_classes");
  if (ic == j.end() || !ic->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field 'involved_classes' missing or not a list"));
  }
  for (const auto& c : *ic) {
    if (!c.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": involved_classes holds a non-string"));
    }
    e.involved_classes.push_back(c.get<std::string>());
  }
  return e;
}

absl::StatusOr<BfclAnswer> ParseBfclAnswer(absl::string_view json_line) {
  auto j_or = ParseJson(json_line, "BFCL answer");
  if (!j_or.ok()) return j_or.status();
  const ojson& j = *j_or;
  BfclAnswer a;
  auto id = GetString(j, "id", "BFCL answer");
  if (!id.ok()) return id.status();
  a.id = *id;
  auto gt = j.find("ground_truth");
  if (gt == j.end() || !gt->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BFCL answer ", a.id, ": field 'ground_truth' missing or not a list"));
  }
  for (size_t t = 0; t < gt->size(); ++t) {
    const ojson& turn = (*gt)[t];
    if (!turn.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "BFCL answer ", a.id, ": ground_truth[", t, "] is not a list"));
    }
    std::vector<std::string> calls;
    for (const auto& c : turn) {
      if (!c.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat("BFCL answer ", a.id,
                                                       ": ground_truth[", t,
                                                       "] holds a non-string"));
      }
      calls.push_back(c.get<std::string>());
    }
    a.ground_truth.push_back(std::move(calls));
  }
  return a;
}

absl::StatusOr<RenderedConversation> RenderBfcl(
    const BfclEntry& entry, const BfclAnswer& answer,
    const std::map<std::string, std::vector<std::string>>& docs,
    size_t max_bytes) {
  if (answer.ground_truth.size() != entry.turns.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entry ", entry.id, ": ", entry.turns.size(), " question turns but ",
        answer.ground_truth.size(), " ground_truth turns"));
  }
  if (entry.turns.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("entry ", entry.id, ": no turns"));
  }
  std::vector<std::string> doc_lines;
  for (const auto& cls : entry.involved_classes) {
    auto it = docs.find(cls);
    if (it == docs.end()) {
      return absl::NotFoundError(absl::StrCat(
          "entry ", entry.id, ": no function docs for class '", cls, "'"));
    }
    doc_lines.insert(doc_lines.end(), it->second.begin(), it->second.end());
  }
  RenderedConversation rc;
  rc.id = entry.id;
  rc.docs_total = static_cast<int>(doc_lines.size());
  rc.turns_total = static_cast<int>(entry.turns.size());

  std::vector<size_t> exchange_bytes;
  for (size_t t = 0; t < entry.turns.size(); ++t) {
    exchange_bytes.push_back(
        Exchange(entry.turns[t], answer.ground_truth[t]).size());
  }
  int turns_kept = rc.turns_total;
  int docs_kept = rc.docs_total;
  if (max_bytes > 0) {
    auto dialogue = [&](int turns) {
      size_t n = 0;
      for (int t = 0; t < turns; ++t) n += exchange_bytes[t];
      return n;
    };
    const int min_docs = doc_lines.empty() ? 0 : 1;
    while (turns_kept > 1 &&
           SystemBytes(doc_lines, min_docs) + dialogue(turns_kept) >
               max_bytes) {
      --turns_kept;
    }
    if (SystemBytes(doc_lines, min_docs) + dialogue(turns_kept) > max_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("entry ", entry.id,
                       ": the system turn with one doc line and the first "
                       "exchange need ",
                       SystemBytes(doc_lines, min_docs) + dialogue(1),
                       " bytes, over the context budget of ", max_bytes));
    }
    docs_kept = min_docs;
    while (docs_kept < rc.docs_total &&
           SystemBytes(doc_lines, docs_kept + 1) + dialogue(turns_kept) <=
               max_bytes) {
      ++docs_kept;
    }
  }
  rc.turns_kept = turns_kept;
  rc.docs_kept = docs_kept;

  Builder b;
  b.Add(Role::kDelimiter, "<|im_start|>system\n");
  b.Add(Role::kSystem, kSystemInstruction);
  for (int i = 0; i < docs_kept; ++i) {
    if (i > 0) b.Add(Role::kToolSchema, "\n");
    b.Add(Role::kToolSchema, doc_lines[i]);
  }
  b.Add(Role::kDelimiter, "<|im_end|>\n");
  for (int t = 0; t < turns_kept; ++t) {
    for (const auto& m : entry.turns[t]) {
      auto role = MessageRole(m.role, entry.id);
      if (!role.ok()) return role.status();
      const std::string header = absl::StrCat("<|im_start|>", m.role, "\n");
      b.Add(Role::kDelimiter, header);
      b.Add(*role, m.content);
      b.Add(Role::kDelimiter, "<|im_end|>\n");
    }
    b.Add(Role::kDelimiter, "<|im_start|>assistant\n");
    b.Add(Role::kToolCall,
          absl::StrCat("<tool_call>\n[",
                       absl::StrJoin(answer.ground_truth[t], ", "),
                       "]\n</tool_call>"));
    b.Add(Role::kDelimiter, "<|im_end|>\n<|im_start|>tool\n");
    b.Add(Role::kToolResult, "{\"status\": \"ok\"}");
    b.Add(Role::kDelimiter, "<|im_end|>\n");
    b.EndTurn(&rc.turns);
  }
  rc.text = std::move(b.text());
  return rc;
}

absl::StatusOr<BfclData> BfclData::FromStrings(
    absl::string_view entries_jsonl, absl::string_view answers_jsonl,
    const std::map<std::string, std::string>& doc_files) {
  BfclData d;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(entries_jsonl, '\n')) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == absl::string_view::npos) continue;
    auto e = ParseBfclEntry(line);
    if (!e.ok()) {
      return absl::Status(
          e.status().code(),
          absl::StrCat("entries line ", line_no, ": ", e.status().message()));
    }
    d.entries_[e->id] = std::move(*e);
  }
  line_no = 0;
  for (absl::string_view line : absl::StrSplit(answers_jsonl, '\n')) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == absl::string_view::npos) continue;
    auto a = ParseBfclAnswer(line);
    if (!a.ok()) {
      return absl::Status(
          a.status().code(),
          absl::StrCat("answers line ", line_no, ": ", a.status().message()));
    }
    d.answers_[a->id] = std::move(*a);
  }
  for (const auto& [cls, contents] : doc_files) {
    std::vector<std::string> lines;
    line_no = 0;
    for (absl::string_view line : absl::StrSplit(contents, '\n')) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == absl::string_view::npos) continue;
      auto j = ParseJson(
          line, absl::StrCat("function docs of ", cls, " line ", line_no));
      if (!j.ok()) return j.status();
      lines.push_back(PyJsonDumps(*j));
    }
    d.docs_[cls] = std::move(lines);
  }
  return d;
}

absl::StatusOr<BfclData> BfclData::Load(const std::string& data_dir) {
  const std::string dir = data_dir + "/bfcl/";
  auto entries = ReadFile(dir + "BFCL_v4_multi_turn_base.json");
  if (!entries.ok()) return entries.status();
  auto answers = ReadFile(dir + "possible_answer/BFCL_v4_multi_turn_base.json");
  if (!answers.ok()) return answers.status();
  std::map<std::string, std::string> doc_files;
  for (const char* cls :
       {"GorillaFileSystem", "TwitterAPI", "MessageAPI", "TicketAPI", "MathAPI",
        "TradingBot", "TravelAPI", "VehicleControlAPI"}) {
    auto file = FuncDocFile(cls);
    if (!file.ok()) return file.status();
    auto contents = ReadFile(dir + "multi_turn_func_doc/" + *file);
    if (!contents.ok()) return contents.status();
    doc_files[cls] = std::move(*contents);
  }
  return FromStrings(*entries, *answers, doc_files);
}

absl::StatusOr<RenderedConversation> BfclData::Render(const std::string& id,
                                                      size_t max_bytes) const {
  auto e = entries_.find(id);
  if (e == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("BFCL id '", id, "' not found"));
  }
  auto a = answers_.find(id);
  if (a == answers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("BFCL id '", id, "' has no possible_answer entry"));
  }
  return RenderBfcl(e->second, a->second, docs_, max_bytes);
}

}  // namespace triax::frontend
