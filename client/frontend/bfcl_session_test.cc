#include "client/frontend/bfcl_session.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "client/frontend/llama2c.h"
#include "client/frontend/service_types.h"
#include "common/status_matchers.h"

namespace triax::frontend {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

// Two turns over 14 bytes:
//   turn 0 [0, 9):  system "SSS", user "uu", tool call "cc", tool result "rr"
//   turn 1 [9, 14): user "UU", assistant "AA", delimiter "|"
RenderedConversation TwoTurns() {
  RenderedConversation c;
  c.id = "conv";
  c.text = "SSSuuccrrUUAA|";
  RenderedTurn t0;
  t0.begin = 0;
  t0.end = 9;
  t0.spans = {{Role::kSystem, 0, 3},
              {Role::kUser, 3, 2},
              {Role::kToolCall, 5, 2},
              {Role::kToolResult, 7, 2}};
  RenderedTurn t1;
  t1.begin = 9;
  t1.end = 14;
  t1.spans = {{Role::kUser, 9, 2},
              {Role::kAssistant, 11, 2},
              {Role::kDelimiter, 13, 1}};
  c.turns = {t0, t1};
  return c;
}

std::vector<int> Roles(const std::vector<TokenSpan>& spans) {
  std::vector<int> out;
  out.reserve(spans.size());
  for (const auto& s : spans) out.push_back(static_cast<int>(s.role));
  return out;
}
std::vector<uint32_t> Sizes(const std::vector<TokenSpan>& spans) {
  std::vector<uint32_t> out;
  out.reserve(spans.size());
  for (const auto& s : spans) out.push_back(s.num_tokens);
  return out;
}
std::vector<int> FocusIndices(const BfclSession& s) {
  std::vector<int> out;
  for (size_t i = 0; i < s.focus.size(); ++i) {
    if (s.focus[i]) out.push_back(static_cast<int>(i));
  }
  return out;
}

TEST(BfclSessionTest, TokensSpansRangesAndFocus) {
  auto s = MakeBfclSession(TwoTurns());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->id, "conv");
  ASSERT_EQ(s->tokens.size(), 15u);
  EXPECT_EQ(s->tokens[0], ByteTokenizer::kBos);
  EXPECT_EQ(s->tokens[1], 'S');
  EXPECT_EQ(s->tokens[14], '|');
  ASSERT_EQ(s->turns.size(), 2u);
  // BOS joins the first span; turn 0 starts at BOS.
  EXPECT_THAT(Sizes(s->turns[0].spans), ElementsAre(4, 2, 2, 2));
  EXPECT_EQ(s->turns[0].first, 0);
  EXPECT_EQ(s->turns[0].end, 10);
  EXPECT_THAT(Sizes(s->turns[1].spans), ElementsAre(2, 2, 1));
  EXPECT_THAT(Roles(s->turns[1].spans),
              ElementsAre(static_cast<int>(Role::kUser),
                          static_cast<int>(Role::kAssistant),
                          static_cast<int>(Role::kDelimiter)));
  EXPECT_EQ(s->turns[1].first, 10);
  EXPECT_EQ(s->turns[1].end, 15);
  // Tool-call bytes 5, 6 and assistant bytes 11, 12, shifted by BOS.
  EXPECT_THAT(FocusIndices(*s), ElementsAre(6, 7, 12, 13));
  EXPECT_EQ(s->num_focus(), 4);
  EXPECT_THAT(Sizes(s->AllSpans()), ElementsAre(4, 2, 2, 2, 2, 2, 1));
}

TEST(BfclSessionTest, FocusRolesAndMaxTurns) {
  BfclSessionOptions o;
  o.focus_roles = {Role::kToolCall};
  o.max_turns = 1;
  auto s = MakeBfclSession(TwoTurns(), o);
  ASSERT_TRUE(s.ok()) << s.status();
  // The text is cut after turn 0.
  EXPECT_EQ(s->tokens.size(), 10u);
  ASSERT_EQ(s->turns.size(), 1u);
  EXPECT_EQ(s->turns[0].end, 10);
  EXPECT_THAT(FocusIndices(*s), ElementsAre(6, 7));

  o.max_turns = 5;  // more than there are: all kept
  s = MakeBfclSession(TwoTurns(), o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tokens.size(), 15u);
  EXPECT_EQ(s->turns.size(), 2u);
}

TEST(BfclSessionTest, BadInput) {
  BfclSessionOptions o;
  o.max_turns = -1;
  EXPECT_THAT(
      MakeBfclSession(TwoTurns(), o),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_turns=-1")));
  RenderedConversation empty;
  empty.id = "e";
  EXPECT_THAT(MakeBfclSession(empty),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"e\" has no turns")));
  RenderedConversation gap = TwoTurns();
  gap.turns[1].spans[1].begin = 12;  // a hole at byte 11
  EXPECT_THAT(MakeBfclSession(gap),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("turn 1: span at byte 12")));
  RenderedConversation past = TwoTurns();
  past.text.resize(12);  // turn 1 ends beyond the text
  EXPECT_THAT(
      MakeBfclSession(past),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("turn 1")));
}

TEST(ServiceTypesTest, SpansAndShape) {
  auto s = MakeBfclSession(TwoTurns());
  ASSERT_TRUE(s.ok()) << s.status();
  const std::vector<v1::Span> spans = ServiceSpans(s->turns[0].spans);
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0].role(), v1::ROLE_SYSTEM);
  EXPECT_EQ(spans[0].num_tokens(), 4u);
  EXPECT_EQ(spans[2].role(), v1::ROLE_TOOL_CALL);
  EXPECT_EQ(spans[2].modality(), v1::MODALITY_TEXT);

  Model m;
  m.name = "tiny";
  m.config.dim = 64;
  m.config.n_layers = 3;
  m.config.n_heads = 8;
  m.config.n_kv_heads = 2;
  const v1::ModelShape shape = ServiceShape(m);
  EXPECT_EQ(shape.name(), "tiny");
  EXPECT_EQ(shape.n_layers(), 3u);
  EXPECT_EQ(shape.n_kv_heads(), 2u);
  EXPECT_EQ(shape.n_q_heads(), 8u);
  EXPECT_EQ(shape.head_dim(), 8u);
}

}  // namespace
}  // namespace triax::frontend
