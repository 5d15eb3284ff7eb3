// BFCL v4 multi-turn conversations rendered in ChatML the way kvproxy-18m
// was trained on them, with a role span for every byte.
//
// Rendering (byte-exact, see models/kvproxy-18m/README.md):
//   <|im_start|>system\n                                      DELIMITER
//   You are a helpful assistant ... one JSON object per line:\n  SYSTEM
//   {doc 1}\n{doc 2}\n...{doc N}                               TOOL_SCHEMA
//   <|im_end|>\n                                               DELIMITER
// then per turn:
//   <|im_start|>user\n                                         DELIMITER
//   {user content}                                             USER
//   <|im_end|>\n<|im_start|>assistant\n                        DELIMITER
//   <tool_call>\n[{call}, {call}]\n</tool_call>                TOOL_CALL
//   <|im_end|>\n<|im_start|>tool\n                             DELIMITER
//   {"status": "ok"}                                           TOOL_RESULT
//   <|im_end|>\n                                               DELIMITER
// Docs are the JSON lines of multi_turn_func_doc/<file> for each involved
// class in order, re-serialized like Python's json.dumps defaults. Adjacent
// pieces of one role form one span. Turn 0 is the system turn plus the first
// user/assistant/tool exchange; turn k > 0 is exchange k.
//
// Token counts are byte counts (kvproxy-18m is byte-level; add one BOS).
//
// Errors: INVALID_ARGUMENT for malformed JSON or fields of the wrong type
// (message names the field and the entry), NOT_FOUND for an unknown id or
// API class, FAILED_PRECONDITION when nothing fits in the context budget.
// Thread contract: BfclData is immutable after Load(); share freely.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model.h"
#include "nlohmann/json.hpp"

namespace triax::frontend {

struct RoleSpan {
  Role role = Role::kUnspecified;  // common/model.h
  size_t begin = 0;                // byte offset in the rendered text
  size_t length = 0;               // bytes (= tokens for a byte-level model)
};

struct RenderedTurn {
  size_t begin = 0, end = 0;    // byte range of the turn
  std::vector<RoleSpan> spans;  // consecutive, covering [begin, end)
};

struct RenderedConversation {
  std::string id;
  std::string text;
  std::vector<RenderedTurn> turns;
  int docs_total = 0, docs_kept = 0;    // function doc lines
  int turns_total = 0, turns_kept = 0;  // user/assistant/tool exchanges
  bool truncated() const {
    return docs_kept < docs_total || turns_kept < turns_total;
  }
  std::vector<RoleSpan> AllSpans() const;
};

struct BfclMessage {
  std::string role;  // "user", "system", "assistant" or "tool"
  std::string content;
};

struct BfclEntry {
  std::string id;
  std::vector<std::vector<BfclMessage>> turns;
  std::vector<std::string> involved_classes;
};

// One entry of possible_answer/: per turn, the calls in Python syntax.
struct BfclAnswer {
  std::string id;
  std::vector<std::vector<std::string>> ground_truth;
};

absl::StatusOr<BfclEntry> ParseBfclEntry(absl::string_view json_line);
absl::StatusOr<BfclAnswer> ParseBfclAnswer(absl::string_view json_line);

// json.dumps(value) with Python's defaults: ", " and ": " separators,
// ensure_ascii (\uXXXX escapes, surrogate pairs), key order kept, floats as
// repr().
std::string PyJsonDumps(const nlohmann::ordered_json& value);

// The JSON doc file of an API class ("GorillaFileSystem" ->
// "gorilla_file_system.json"); NOT_FOUND for other names.
absl::StatusOr<std::string> FuncDocFile(absl::string_view api_class);

// Renders `entry` with its ground truth and the doc lines of its classes
// (`docs`: class -> lines, already serialized). When the whole conversation
// is longer than `max_bytes`, trailing exchanges are dropped until the rest
// fits with at least one doc line, and then doc lines are kept in order
// while they fit; `docs_kept`/`turns_kept` say what was kept.
// max_bytes = 0 means no limit.
absl::StatusOr<RenderedConversation> RenderBfcl(
    const BfclEntry& entry, const BfclAnswer& answer,
    const std::map<std::string, std::vector<std::string>>& docs,
    size_t max_bytes = 0);

// The BFCL files of a data directory.
class BfclData {
 public:
  // Reads bfcl/BFCL_v4_multi_turn_base.json, its possible_answer file and
  // every multi_turn_func_doc file named by FuncDocFile().
  static absl::StatusOr<BfclData> Load(const std::string& data_dir);
  // Same, from the given files' contents (tests).
  static absl::StatusOr<BfclData> FromStrings(
      absl::string_view entries_jsonl, absl::string_view answers_jsonl,
      const std::map<std::string, std::string>& doc_files);

  absl::StatusOr<RenderedConversation> Render(const std::string& id,
                                              size_t max_bytes = 0) const;
  const std::map<std::string, BfclEntry>& entries() const { return entries_; }

 private:
  std::map<std::string, BfclEntry> entries_;
  std::map<std::string, BfclAnswer> answers_;
  std::map<std::string, std::vector<std::string>> docs_;  // by class
};

}  // namespace triax::frontend
