#include "kvmanager/tagger.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

constexpr Role kDelim = Role::kDelimiter;
constexpr Modality kText = Modality::kText;
constexpr Modality kImage = Modality::kImage;
constexpr Modality kAudio = Modality::kAudio;

// Builds a rendering piece by piece with the expected tag of each piece, so
// the expected spans are exact without counting bytes by hand.
class Expect {
 public:
  Expect& Add(Role role, const std::string& piece, Modality m = kText) {
    const uint32_t n = static_cast<uint32_t>(piece.size());
    if (!spans_.empty() && spans_.back().role == role &&
        spans_.back().modality == m && spans_.back().turn == turn_) {
      spans_.back().num_tokens += n;
    } else {
      spans_.push_back(TaggedSpan{role, m, n, turn_});
    }
    text_ += piece;
    return *this;
  }
  Expect& NextTurn() {
    ++turn_;
    return *this;
  }
  const std::string& text() const { return text_; }
  const std::vector<TaggedSpan>& spans() const { return spans_; }

 private:
  std::string text_;
  std::vector<TaggedSpan> spans_;
  uint32_t turn_ = 0;
};

RenderedText Rendered(ChatTemplate t, const std::string& text) {
  RenderedText r;
  r.chat_template = t;
  r.text = text;
  return r;
}

absl::StatusOr<std::vector<TaggedSpan>> Tag(
    ChatTemplate t, const std::string& text,
    TurnNumbering numbering = TurnNumbering::kOpen) {
  return TagRendered(Rendered(t, text), numbering);
}

// A Qwen2.5-style agentic conversation: tools in the system prompt, an
// image, reasoning, a tool call, a tool response in a user message, a second
// turn with a tool message, and an open assistant message still reasoning.
Expect ChatMlConversation() {
  Expect e;
  e.Add(kDelim, "<|im_start|>system\n")
      .Add(Role::kSystem,
           "You are a helpful assistant.\n\n# Tools\n\nYou are provided with "
           "function signatures within <tools></tools> XML tags:\n")
      .Add(Role::kToolSchema,
           "<tools>\n{\"type\": \"function\", \"function\": {\"name\": "
           "\"get_weather\", \"parameters\": {\"city\": \"string\"}}}\n"
           "</tools>")
      .Add(Role::kSystem,
           "\n\nFor each function call, return within <tool_call></tool_call> "
           "XML tags:\n<tool_call>\n{\"name\": <function-name>, "
           "\"arguments\": <args-json-object>}\n</tool_call>")
      .Add(kDelim, "<|im_end|>\n<|im_start|>user\n")
      .Add(Role::kUser, "Weather here? ")
      .Add(Role::kUser,
           "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>", kImage)
      .Add(Role::kUser, " Thanks.")
      .Add(kDelim, "<|im_end|>\n<|im_start|>assistant\n")
      .Add(Role::kReasoning, "<think>\nThe user wants the weather.\n</think>")
      .Add(Role::kAssistant, "\n\n")
      .Add(Role::kToolCall,
           "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
           "{\"city\": \"Paris\"}}\n</tool_call>")
      .Add(kDelim, "<|im_end|>\n<|im_start|>user\n")
      .Add(Role::kToolResult,
           "<tool_response>\n{\"temp\": 21}\n</tool_response>")
      .Add(kDelim, "<|im_end|>\n<|im_start|>assistant\n")
      .Add(Role::kAssistant, "It is 21 degrees.")
      .Add(kDelim, "<|im_end|>\n")
      .NextTurn()
      .Add(kDelim, "<|im_start|>user\n")
      .Add(Role::kUser, "And tomorrow? ")
      .Add(Role::kUser, "<audio>", kAudio)
      .Add(kDelim, "<|im_end|>\n<|im_start|>assistant\n")
      .Add(Role::kToolCall, "<tool_call>\n{\"name\": \"x\"}\n</tool_call>")
      .Add(kDelim, "<|im_end|>\n<|im_start|>tool\n")
      .Add(Role::kToolResult, "{\"temp\": 18}")
      .Add(kDelim, "<|im_end|>\n<|im_start|>assistant\n")
      .Add(Role::kReasoning, "<think>\nStill thin");
  return e;
}

TEST(TaggerTest, ChatMlAgenticConversation) {
  const Expect e = ChatMlConversation();
  auto spans = Tag(ChatTemplate::kChatML, e.text());
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_EQ(*spans, e.spans());
}

TEST(TaggerTest, Llama3AgenticConversation) {
  Expect e;
  e.Add(kDelim,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
      .Add(Role::kSystem,
           "Environment: ipython\nYou have access to these functions:\n")
      .Add(Role::kToolSchema,
           "{\n    \"name\": \"get_weather\",\n    \"parameters\": "
           "{\"city\": {\"type\": \"string\", \"min\": -1.5e3}}\n}\n")
      .Add(Role::kSystem, "{\"not_a_tool\": true}\nReply in JSON.")
      .Add(kDelim, "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
      .Add(Role::kUser, "<|image|>", kImage)
      .Add(Role::kUser, "Weather in this city?")
      .Add(kDelim,
           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
      .Add(Role::kReasoning, "<think>a photo of Paris</think>")
      .Add(Role::kToolCall, "<|python_tag|>get_weather.call(city=\"Paris\")")
      .Add(kDelim, "<|eom_id|><|start_header_id|>ipython<|end_header_id|>\n\n")
      .Add(Role::kToolResult, "{\"temp\": 21}")
      .Add(kDelim,
           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
      .Add(Role::kAssistant, "21 degrees.")
      .Add(kDelim, "<|eot_id|>")
      .NextTurn()
      .Add(kDelim, "<|start_header_id|>user<|end_header_id|>\n\n")
      .Add(Role::kUser, "Thanks! ")
      .Add(Role::kUser, "<|audio_start|>xyz<|audio_end|>", kAudio)
      .Add(kDelim,
           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  auto spans = Tag(ChatTemplate::kLlama3, e.text());
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_EQ(*spans, e.spans());
}

TEST(TaggerTest, GenericAgenticConversation) {
  Expect e;
  e.Add(kDelim, "\n### System:\n")
      .Add(Role::kSystem, "You are helpful.\n")
      .Add(Role::kToolSchema, "{\"name\": \"search\", \"args\": [1, 2]}  \n")
      .Add(kDelim, "### user:\n")
      .Add(Role::kUser, "Find cats like ")
      .Add(Role::kUser, "<image>", kImage)
      .Add(Role::kUser, "\n### Results\n### Step 1: look:\n")
      .Add(kDelim, "### Assistant:\n")
      .Add(Role::kReasoning, "<think>search it</think>")
      .Add(Role::kToolCall, "<tool_call>{\"name\": \"search\"}</tool_call>")
      .Add(Role::kAssistant, "\n")
      .Add(kDelim, "### Tool:\n")
      .Add(Role::kToolResult, "3 results\n")
      .Add(kDelim, "### ASSISTANT:\n")
      .Add(Role::kAssistant, "Here.\n")
      .NextTurn()
      .Add(kDelim, "### User:\n")
      .Add(Role::kUser, "More\n")
      .Add(kDelim, "### Assistant:\n")
      .Add(Role::kAssistant, "Sure ")
      .Add(Role::kToolCall, "<tool_call>{\"na");
  auto spans = Tag(ChatTemplate::kGeneric, e.text());
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_EQ(*spans, e.spans());
}

TEST(TaggerTest, TurnNumberingContinueCountsTheFirstUserMessage) {
  const std::string text =
      "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n";
  auto open = Tag(ChatTemplate::kChatML, text, TurnNumbering::kOpen);
  auto cont = Tag(ChatTemplate::kChatML, text, TurnNumbering::kContinue);
  ASSERT_TRUE(open.ok() && cont.ok());
  EXPECT_THAT(*open, ElementsAre(TaggedSpan{kDelim, kText, 22, 0},
                                 TaggedSpan{Role::kAssistant, kText, 2, 0},
                                 TaggedSpan{kDelim, kText, 11 + 17, 0},
                                 TaggedSpan{Role::kUser, kText, 2, 0},
                                 TaggedSpan{kDelim, kText, 11, 0}));
  EXPECT_THAT(*cont, ElementsAre(TaggedSpan{kDelim, kText, 22, 0},
                                 TaggedSpan{Role::kAssistant, kText, 2, 0},
                                 TaggedSpan{kDelim, kText, 11, 0},
                                 TaggedSpan{kDelim, kText, 17, 1},
                                 TaggedSpan{Role::kUser, kText, 2, 1},
                                 TaggedSpan{kDelim, kText, 11, 1}));
}

TEST(TaggerTest, ContinuesAnOpenMessage) {
  RenderedText r = Rendered(ChatTemplate::kChatML,
                            "more thought</think>Answer<|im_end|>\n"
                            "<|im_start|>user\nhi<|im_end|>\n");
  r.continues = Role::kReasoning;
  auto spans = TagRendered(r, TurnNumbering::kContinue);
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_THAT(*spans, ElementsAre(TaggedSpan{Role::kReasoning, kText, 20, 0},
                                  TaggedSpan{Role::kAssistant, kText, 6, 0},
                                  TaggedSpan{kDelim, kText, 11, 0},
                                  TaggedSpan{kDelim, kText, 17, 1},
                                  TaggedSpan{Role::kUser, kText, 2, 1},
                                  TaggedSpan{kDelim, kText, 11, 1}));
  // Decoded tokens of an open tool call, still open.
  r = Rendered(ChatTemplate::kLlama3, "\"a\": 1}");
  r.continues = Role::kToolCall;
  spans = TagRendered(r, TurnNumbering::kContinue);
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_THAT(*spans, ElementsAre(TaggedSpan{Role::kToolCall, kText, 7, 0}));
  // A continued user message must still end.
  r = Rendered(ChatTemplate::kChatML, "more words");
  r.continues = Role::kUser;
  EXPECT_THAT(TagRendered(r, TurnNumbering::kContinue),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("has no <|im_end|>")));
  r.continues = Role::kDelimiter;
  EXPECT_THAT(TagRendered(r, TurnNumbering::kContinue),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rendered.continues is ROLE_DELIMITER")));
}

TEST(TaggerTest, TokenOffsetsTakeTheTagOfTheirFirstByte) {
  // "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok"
  //  0           12     17 19        29 30          42        52
  RenderedText r =
      Rendered(ChatTemplate::kChatML,
               "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok");
  ASSERT_EQ(r.text.size(), 54u);
  // Tokens: "<|im_start|>" "user\n" "h" "i<|im_end|>\n" (straddles: user)
  //         "<|im_start|>" "assistant\no" (straddles: delimiter) "k".
  r.token_offsets = {0, 12, 17, 18, 30, 42, 53};
  r.bos_tokens = 1;
  auto spans = TagRendered(r, TurnNumbering::kOpen);
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_THAT(*spans, ElementsAre(TaggedSpan{kDelim, kText, 3, 0},
                                  TaggedSpan{Role::kUser, kText, 2, 0},
                                  TaggedSpan{kDelim, kText, 2, 0},
                                  TaggedSpan{Role::kAssistant, kText, 1, 0}));
  // One token for the whole text.
  r.token_offsets = {0};
  r.bos_tokens = 0;
  spans = TagRendered(r, TurnNumbering::kOpen);
  ASSERT_TRUE(spans.ok());
  EXPECT_THAT(*spans, ElementsAre(TaggedSpan{kDelim, kText, 1, 0}));
}

TEST(TaggerTest, TokenSkippingATurnKeepsTurnsIncreasing) {
  // One token covers a whole user message: the next token is two turns on.
  const std::string text =
      "<|im_start|>user\na<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
      "<|im_start|>user\nc<|im_end|>\n";
  RenderedText r = Rendered(ChatTemplate::kChatML, text);
  r.token_offsets = {0, 17, 60};
  auto spans = TagRendered(r, TurnNumbering::kOpen);
  ASSERT_TRUE(spans.ok()) << spans.status();
  EXPECT_THAT(*spans, ElementsAre(TaggedSpan{kDelim, kText, 1, 0},
                                  TaggedSpan{Role::kUser, kText, 1, 0},
                                  TaggedSpan{kDelim, kText, 1, 2}));
}

TEST(TaggerTest, InputErrors) {
  auto err = [](const RenderedText& r, const std::string& what) {
    EXPECT_THAT(TagRendered(r, TurnNumbering::kOpen),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)))
        << r.text;
  };
  const std::string ok = "<|im_start|>user\nhi<|im_end|>\n";
  err(Rendered(ChatTemplate::kChatML, ""), "rendered.text is empty");
  err(Rendered(ChatTemplate::kUnspecified, ok), "rendered.chat_template is 0");
  err(Rendered(static_cast<ChatTemplate>(9), ok),
      "rendered.chat_template is 9");
  RenderedText r = Rendered(ChatTemplate::kChatML, ok);
  r.token_offsets = {1, 2};
  err(r, "rendered.token_offsets[0] is 1; it must be 0");
  r.token_offsets = {0, 5, 5};
  err(r, "rendered.token_offsets[2] is 5, not greater than");
  r.token_offsets = {0, 5, static_cast<uint32_t>(ok.size())};
  err(r, "past the last byte");
  r.token_offsets.clear();
  r.bos_tokens = kMaxBosTokens + 1;
  err(r, "rendered.bos_tokens 4097");
  r = Rendered(ChatTemplate::kChatML, std::string(kMaxRenderedBytes + 1, 'x'));
  err(r, "the limit is");
}

TEST(TaggerTest, TemplateErrorsNameTheByteAndTheExpectation) {
  const std::vector<std::tuple<ChatTemplate, std::string, std::string>> cases =
      {
          {ChatTemplate::kChatML, "hello", "byte 0: expected <|im_start|>"},
          {ChatTemplate::kChatML, "<|im_start|>user",
           "byte 0: unterminated "
           "header"},
          {ChatTemplate::kChatML,
           "<|im_start|>" + std::string(40, 'a') + "\nx<|im_end|>",
           "byte 0: unterminated header"},
          {ChatTemplate::kChatML, "<|im_start|>wizard\nx<|im_end|>",
           "byte 12: unknown role name \"wizard\""},
          {ChatTemplate::kChatML, "<|im_start|>user\nhi",
           "byte 0: the ROLE_USER message has no <|im_end|>"},
          {ChatTemplate::kChatML, "<|im_start|>user\nhi<|im_start|>assistant\n",
           "byte 19: <|im_start|> inside the message at byte 0"},
          {ChatTemplate::kChatML, "<|im_start|>user\nhi<|im_end|>junk",
           "byte 29: expected <|im_start|>"},
          {ChatTemplate::kChatML,
           "<|im_start|>assistant\n<tool_call>x<think>y<|im_end|>",
           "byte 34: <think> inside the <tool_call> opened at byte 22"},
          {ChatTemplate::kChatML,
           "<|im_start|>assistant\n<tool_call>x<tool_call><|im_end|>",
           "byte 34: <tool_call> inside the <tool_call> opened at byte 22"},
          {ChatTemplate::kChatML,
           "<|im_start|>assistant\n<think>x<think><|im_end|>",
           "byte 30: <think> inside the <think> opened at byte 22"},
          {ChatTemplate::kChatML,
           "<|im_start|>assistant\n<tool_call>[f()]<|im_end|>\n",
           "byte 22: unclosed <tool_call>: expected </tool_call> before byte "
           "38"},
          {ChatTemplate::kChatML, "<|im_start|>assistant\n<think>x<|im_end|>",
           "byte 22: unclosed <think>: expected </think> before byte 30"},
          {ChatTemplate::kChatML, "<|im_start|>assistant\nx</think><|im_end|>",
           "byte 23: </think> without an open <think>"},
          {ChatTemplate::kChatML,
           "<|im_start|>assistant\nx</tool_call><|im_end|>",
           "byte 23: </tool_call> without an open <tool_call>"},
          {ChatTemplate::kChatML,
           "<|im_start|>user\n<tool_response>x<|im_end|>",
           "byte 17: unclosed <tool_response>"},
          {ChatTemplate::kChatML, "<|im_start|>system\n<tools>\n{}<|im_end|>",
           "byte 19: unclosed <tools>"},
          {ChatTemplate::kChatML,
           "<|im_start|>user\n<|vision_start|><|image_pad|><|im_end|>",
           "byte 17: unclosed <|vision_start|>: expected <|vision_end|>"},
          {ChatTemplate::kLlama3, "<|start_header_id|>user<|eot_id|>",
           "byte 0: unterminated header: expected a role name of at most 32 "
           "bytes and <|end_header_id|>"},
          {ChatTemplate::kLlama3,
           "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
           "<|begin_of_text|>",
           "byte 54: <|begin_of_text|> is only allowed at byte 0"},
          {ChatTemplate::kLlama3,
           "<|start_header_id|>user<|end_header_id|>\n\nhi<|begin_of_text|>"
           "<|eot_id|>",
           "byte 44: <|begin_of_text|> is only allowed at byte 0"},
          {ChatTemplate::kLlama3,
           "<|start_header_id|>bot<|end_header_id|>\n\nhi<|eot_id|>",
           "byte 19: unknown role name \"bot\""},
          {ChatTemplate::kLlama3,
           "<|start_header_id|>system<|end_header_id|>\n\nhi",
           "byte 0: the ROLE_SYSTEM message has no <|eot_id|>"},
          {ChatTemplate::kGeneric, "Hello\n### User:\nhi",
           "byte 0: expected a header line \"### <role>:\""},
          {ChatTemplate::kGeneric, "### User:\nhi\n### Notes:\n",
           "byte 17: unknown role name \"Notes\""},
          {ChatTemplate::kGeneric,
           "### Assistant:\n<tool_call>x\n### User:\nhi",
           "byte 15: unclosed <tool_call>"},
      };
  for (const auto& [tmpl, text, what] : cases) {
    auto got = Tag(tmpl, text);
    EXPECT_THAT(got, StatusIs(absl::StatusCode::kInvalidArgument,
                              HasSubstr("rendered.text " + what)))
        << text << "\n -> " << got.status();
  }
}

TEST(TaggerTest, OpenAssistantMessagesMayLeaveBlocksOpen) {
  for (const std::string text :
       {"<|im_start|>assistant\n<think>x", "<|im_start|>assistant\n<tool_call>",
        "<|im_start|>assistant\n<|vision_start|>", "<|im_start|>assistant\n"}) {
    EXPECT_TRUE(Tag(ChatTemplate::kChatML, text).ok()) << text;
  }
}

TEST(TaggerTest, SchemaLinesMustBeJsonObjectsWithAName) {
  auto roles = [](const std::string& content) {
    auto s = Tag(ChatTemplate::kGeneric, "### System:\n" + content);
    EXPECT_TRUE(s.ok()) << s.status();
    std::vector<Role> out;
    if (s.ok()) {
      for (const TaggedSpan& t : *s) out.push_back(t.role);
    }
    return out;
  };
  const std::vector<Role> schema = {kDelim, Role::kToolSchema};
  const std::vector<Role> system = {kDelim, Role::kSystem};
  EXPECT_EQ(roles("{\"name\": \"f\"}"), schema);
  EXPECT_EQ(roles("{\"a\": {\"name\": 1}, \"name\": \"\\u00e9\\n\"}"), schema);
  EXPECT_EQ(roles("{\"a\": {\"name\": 1}}"), system);  // not top-level
  EXPECT_EQ(roles("{\"name\": \"f\"} trailing"), system);
  EXPECT_EQ(roles("{\"name\": tru}"), system);
  EXPECT_EQ(roles("{\"name\": 01}"), system);
  EXPECT_EQ(roles("{\"name\": \"f\""), system);
  EXPECT_EQ(roles("[{\"name\": \"f\"}]"), system);
  EXPECT_EQ(roles(" {\"name\": \"f\"}"), system);  // not at a line start
  std::string deep(100, '[');
  EXPECT_EQ(roles("{\"name\": " + deep + std::string(100, ']') + "}"), system);
}

}  // namespace
}  // namespace triax::manager
