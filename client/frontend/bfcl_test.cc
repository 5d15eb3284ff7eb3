#include "client/frontend/bfcl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_split.h"
#include "client/frontend/forward.h"
#include "client/frontend/test_data.h"
#include "common/status_matchers.h"

namespace triax::frontend {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using ::triax::testing::StatusIs;

constexpr char kHeader[] =
    "<|im_start|>system\nYou are a helpful assistant that can call functions. "
    "When a request needs tools, reply with <tool_call> followed by a list of "
    "calls in Python syntax and </tool_call>. Available functions, one JSON "
    "object per line:\n";

// Every byte in exactly one span, spans consecutive, turns consecutive.
void ExpectExactCover(const RenderedConversation& rc) {
  size_t at = 0;
  for (const auto& turn : rc.turns) {
    EXPECT_EQ(turn.begin, at);
    for (const auto& s : turn.spans) {
      EXPECT_EQ(s.begin, at);
      EXPECT_GT(s.length, 0u);
      at += s.length;
    }
    EXPECT_EQ(turn.end, at);
  }
  EXPECT_EQ(at, rc.text.size());
}

Role RoleAt(const RenderedConversation& rc, size_t byte) {
  for (const auto& s : rc.AllSpans()) {
    if (byte >= s.begin && byte < s.begin + s.length) return s.role;
  }
  ADD_FAILURE() << "byte " << byte << " not covered";
  return Role::kReasoning;
}

Role RoleOf(const RenderedConversation& rc, const std::string& needle) {
  const size_t at = rc.text.find(needle);
  EXPECT_NE(at, std::string::npos) << needle;
  if (at == std::string::npos) return Role::kReasoning;
  const Role r = RoleAt(rc, at);
  for (size_t b = at; b < at + needle.size(); ++b)
    EXPECT_EQ(RoleAt(rc, b), r) << needle;
  return r;
}

BfclData TinyData() {
  auto d = BfclData::FromStrings(
      R"j({"id": "t_0", "question": [[{"role": "user", "content": "Go to docs"}], [{"role": "user", "content": "List \"all\""}]], "involved_classes": ["MathAPI"]})j",
      R"j({"id": "t_0", "ground_truth": [["cd(folder='docs')"], ["ls(a=True)", "pwd()"]]})j",
      {{"MathAPI",
        "{\"name\": \"add\", \"description\": \"Adds \\u00e9.\", "
        "\"parameters\": {\"a\": 1}}\n"
        "{\"name\":\"mul\",\"x\":[1,2.5,true,null]}\n"}});
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(*d);
}

TEST(BfclTest, RendersChatMlWithRoles) {
  BfclData d = TinyData();
  auto rc = d.Render("t_0");
  ASSERT_TRUE(rc.ok()) << rc.status();
  const std::string want =
      std::string(kHeader) +
      "{\"name\": \"add\", \"description\": \"Adds \\u00e9.\", \"parameters\": "
      "{\"a\": 1}}\n"
      "{\"name\": \"mul\", \"x\": [1, 2.5, true, null]}<|im_end|>\n"
      "<|im_start|>user\nGo to docs<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n[cd(folder='docs')]\n</"
      "tool_call><|im_end|>\n"
      "<|im_start|>tool\n{\"status\": \"ok\"}<|im_end|>\n"
      "<|im_start|>user\nList \"all\"<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n[ls(a=True), "
      "pwd()]\n</tool_call><|im_end|>\n"
      "<|im_start|>tool\n{\"status\": \"ok\"}<|im_end|>\n";
  EXPECT_EQ(rc->text, want);
  ExpectExactCover(*rc);
  ASSERT_EQ(rc->turns.size(), 2u);
  EXPECT_EQ(RoleOf(*rc, "<|im_start|>system\n"), Role::kDelimiter);
  EXPECT_EQ(RoleOf(*rc, "You are a helpful"), Role::kSystem);
  EXPECT_EQ(RoleOf(*rc, "{\"name\": \"mul\""), Role::kToolSchema);
  EXPECT_EQ(RoleOf(*rc, "Go to docs"), Role::kUser);
  EXPECT_EQ(RoleOf(*rc, "[ls(a=True), pwd()]"), Role::kToolCall);
  EXPECT_EQ(RoleOf(*rc, "{\"status\": \"ok\"}"), Role::kToolResult);
  EXPECT_EQ(RoleOf(*rc, "<|im_end|>\n<|im_start|>assistant\n"),
            Role::kDelimiter);
  // Turn 1 starts with the second user message's header.
  EXPECT_EQ(rc->text.substr(rc->turns[1].begin, 17), "<|im_start|>user\n");
}

TEST(BfclTest, TruncatesDocsAndTurnsToTheBudget) {
  BfclData d = TinyData();
  auto full = d.Render("t_0");
  ASSERT_TRUE(full.ok());
  auto cut = d.Render("t_0", full->text.size() - 1);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->docs_kept, 1);
  EXPECT_EQ(cut->turns_kept, 2);
  EXPECT_TRUE(cut->truncated());
  EXPECT_LE(cut->text.size(), full->text.size() - 1);
  ExpectExactCover(*cut);
  EXPECT_THAT(d.Render("t_0", 100),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("budget of 100")));
}

TEST(BfclTest, MalformedInputIsAnError) {
  EXPECT_THAT(ParseBfclEntry("{\"id\": \"x\", \"question\": ["),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("malformed JSON")));
  EXPECT_THAT(ParseBfclEntry("[1, 2]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a JSON object")));
  EXPECT_THAT(
      ParseBfclEntry(R"j({"id": "x", "question": 3, "involved_classes": []})j"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'question'")));
  EXPECT_THAT(
      ParseBfclEntry(
          R"j({"id": "x", "question": [[{"role": "robot", "content": "hi"}]], "involved_classes": []})j"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("robot")));
  EXPECT_THAT(
      ParseBfclAnswer(R"j({"id": "x", "ground_truth": [[1]]})j"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-string")));
  BfclData d = TinyData();
  EXPECT_THAT(d.Render("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(FuncDocFile("FooAPI"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("FooAPI")));
  auto bad_docs = BfclData::FromStrings("", "", {{"MathAPI", "{\"name\": \n"}});
  EXPECT_THAT(bad_docs, StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("MathAPI line 1")));
}

TEST(BfclTest, PyJsonDumpsMatchesPythonDefaults) {
  using ojson = nlohmann::ordered_json;
  auto j = ojson::parse(
      R"j({"b": 1e-05, "a": [0.1, 100000.0, 1e16, -0.0, 3], "s": "\u20ac\ud83d\ude00\n\u007f"})j");
  EXPECT_EQ(
      PyJsonDumps(j),
      R"j({"b": 1e-05, "a": [0.1, 100000.0, 1e+16, -0.0, 3], "s": "\u20ac\ud83d\ude00\n\u007f"})j");
  EXPECT_EQ(PyJsonDumps(ojson::object()), "{}");
  EXPECT_EQ(PyJsonDumps(ojson::array()), "[]");
}

TEST(BfclRealDataTest, DocLinesRoundTripAndHeldOutEntryRenders) {
  const std::string dir = TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto d = BfclData::Load(dir);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->entries().size(), 200u);
  // The doc files were written by json.dumps: re-serializing is the identity.
  auto raw =
      ReadFile(dir + "/bfcl/multi_turn_func_doc/gorilla_file_system.json");
  ASSERT_TRUE(raw.ok());
  auto rc = d->Render("multi_turn_base_3");
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_THAT(rc->text, StartsWith(kHeader));
  for (absl::string_view line : absl::StrSplit(*raw, '\n', absl::SkipEmpty())) {
    const size_t at = rc->text.find(std::string(line));
    ASSERT_NE(at, std::string::npos) << line.substr(0, 60);
    // Each doc line ends at a newline, the last one at <|im_end|>.
    const char next = rc->text[at + line.size()];
    EXPECT_TRUE(next == '\n' || next == '<') << line.substr(0, 60);
  }
  ExpectExactCover(*rc);
  EXPECT_EQ(rc->turns_total, 2);
  EXPECT_EQ(RoleOf(*rc, "{\"name\": \"cd\""), Role::kToolSchema);
  EXPECT_EQ(rc->turns[0].spans.front().role, Role::kDelimiter);

  auto cut = d->Render("multi_turn_base_3", 2047);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_LE(cut->text.size(), 2047u);
  EXPECT_TRUE(cut->truncated());
  ExpectExactCover(*cut);
}

// kvproxy-18m memorized the tool schemas as rendered in training (it
// continues the system instruction and the doc lines byte for byte once given
// some context): a low NLL on the doc lines of a rendered conversation
// confirms the byte-exact format, and the same text dumped with compact JSON
// separators must score clearly worse.
double DocNll(const Model& model, const std::string& text) {
  ByteTokenizer bt;
  const std::vector<int> tokens = bt.Encode(text.substr(0, 280), true);
  Transformer tf(&model, 2);
  LocalKvStore kv(model.config);
  std::vector<float> logits;
  EXPECT_TRUE(tf.Forward(tokens, 0, &kv, &logits).ok());
  NllResult r;
  // Bytes 0..199 are the header and instruction, which the small model only
  // half recalls right after BOS; score what follows.
  for (size_t t = 200; t < tokens.size(); ++t) {
    r.sum += TokenNll(&logits[(t - 1) * 260], 260, tokens[t]);
    ++r.count;
  }
  return r.mean();
}

TEST(BfclRealDataTest, KvProxyFindsTheRenderingFamiliar) {
  const std::string dir = TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto d = BfclData::Load(dir);
  ASSERT_TRUE(d.ok()) << d.status();
  auto model = LoadModel(dir + "/models/kvproxy-18m/model.bin");
  ASSERT_TRUE(model.ok()) << model.status();
  auto rc = d->Render("multi_turn_base_3");
  ASSERT_TRUE(rc.ok());
  const double good = DocNll(**model, rc->text);
  std::string compact = rc->text;
  for (size_t at = compact.find("\": ", 200); at != std::string::npos;
       at = compact.find("\": ", at + 1)) {
    compact.erase(at + 2, 1);
  }
  const double bad = DocNll(**model, compact);
  EXPECT_LT(good, 0.15) << "nats/byte on the rendered doc lines";
  EXPECT_GT(bad, good + 0.1) << "compact separators should look unfamiliar";
}

}  // namespace
}  // namespace triax::frontend
