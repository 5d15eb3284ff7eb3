// Arrival traces (replay_trace.h): the generators' determinism and
// shapes, a BFCL rendering's prompt/response cut, the text form's round
// trip and its errors.
#include "bench/capacity/replay_trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace triax::bench::capacity {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

absl::StatusOr<Trace> Synthetic(uint64_t seed, int sessions = 50) {
  SyntheticShape shape;
  return MakeTrace(
      sessions, {{"a", 3}, {"b", 1}}, Timing{}, seed,
      [&](TraceRng& rng) { return DrawSyntheticShape(shape, rng); });
}

TEST(ReplayTraceTest, SyntheticTracesAreDeterministicAndFollowTheShape) {
  auto t1 = Synthetic(7);
  auto t2 = Synthetic(7);
  auto t3 = Synthetic(8);
  ASSERT_THAT(t1, IsOk());
  ASSERT_THAT(t2, IsOk());
  ASSERT_THAT(t3, IsOk());
  EXPECT_EQ(TraceText(*t1), TraceText(*t2));
  EXPECT_NE(TraceText(*t1), TraceText(*t3));
  ASSERT_EQ(t1->sessions.size(), 50u);
  int a = 0;
  int64_t last = 0;
  for (const TraceSession& s : t1->sessions) {
    EXPECT_GE(s.arrive_ms, last);
    last = s.arrive_ms;
    a += s.tenant == "a";
    ASSERT_GE(s.turns.size(), 2u);
    ASSERT_LE(s.turns.size(), 8u);
    EXPECT_EQ(s.turns[0].think_ms, 0);
    EXPECT_EQ(s.turns[0].prompt[0].role, Role::kSystem);
    for (const TraceTurn& t : s.turns) {
      ASSERT_EQ(t.response.size(), 2u);
      EXPECT_EQ(t.response[0].role, Role::kToolCall);
      EXPECT_EQ(t.response[1].role, Role::kToolResult);
      // decode_ms = response tokens x 20 ms + 200 ms.
      EXPECT_EQ(t.decode_ms, static_cast<int64_t>((t.response[0].num_tokens +
                                                   t.response[1].num_tokens) *
                                                      20.0 +
                                                  200.0));
    }
  }
  EXPECT_GT(a, 25);  // weight 3 of 4
  EXPECT_LT(a, 50);
  EXPECT_EQ(t1->Tenants().size(), 2u);
}

TEST(ReplayTraceTest, ATenantWindowThinsItsArrivals) {
  // b (weight 1 of 2) arrives only in [20 s, 40 s): outside it every
  // session is a's; inside, about half are b's.
  SyntheticShape shape;
  Timing timing;
  timing.arrival_rate = 10;
  auto t =
      MakeTrace(600, {{"a", 1}, {"b", 1, 20'000, 40'000}}, timing, 5,
                [&](TraceRng& rng) { return DrawSyntheticShape(shape, rng); });
  ASSERT_THAT(t, IsOk());
  int b = 0, inside = 0;
  for (const TraceSession& s : t->sessions) {
    const bool in = s.arrive_ms >= 20'000 && s.arrive_ms < 40'000;
    inside += in;
    if (s.tenant == "b") {
      ++b;
      EXPECT_TRUE(in) << s.id << " at " << s.arrive_ms;
    }
  }
  // a's rate is 5/s throughout, b's 5/s inside: ~200 in the window, ~100
  // of them b's.
  EXPECT_GT(inside, 150);
  EXPECT_GT(b, inside / 4);
  EXPECT_LT(b, 3 * inside / 4);
  EXPECT_THAT(
      MakeTrace(5, {{"a", 1, 0, 10}}, timing, 1,
                [&](TraceRng& rng) { return DrawSyntheticShape(shape, rng); }),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("every tenant's window ends")));
  EXPECT_THAT(
      MakeTrace(5, {{"a", 1}, {"b", 1, 10, 10}}, timing, 1,
                [&](TraceRng& rng) { return DrawSyntheticShape(shape, rng); }),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("tenant b: window from_ms=10 to_ms=10")));
}

TEST(ReplayTraceTest, TextRoundTrips) {
  auto t = Synthetic(3, 20);
  ASSERT_THAT(t, IsOk());
  auto back = ParseTrace("t.txt", TraceText(*t));
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(TraceText(*back), TraceText(*t));
  EXPECT_EQ(back->Tokens(), t->Tokens());
}

TEST(ReplayTraceTest, BfclTurnsAreCutBeforeTheToolCall) {
  frontend::RenderedConversation conv;
  conv.id = "multi_turn_base_3";
  frontend::RenderedTurn t0;
  t0.spans = {{Role::kDelimiter, 0, 19},   {Role::kSystem, 0, 100},
              {Role::kToolSchema, 0, 500}, {Role::kDelimiter, 0, 11},
              {Role::kUser, 0, 40},        {Role::kDelimiter, 0, 33},
              {Role::kToolCall, 0, 30},    {Role::kDelimiter, 0, 28},
              {Role::kToolResult, 0, 16},  {Role::kDelimiter, 0, 11}};
  frontend::RenderedTurn t1;
  t1.spans = {{Role::kDelimiter, 0, 17},
              {Role::kUser, 0, 9},
              {Role::kDelimiter, 0, 33},
              {Role::kToolCall, 0, 5}};
  conv.turns = {t0, t1};
  auto shape = ShapeOfConversation(conv, 1);
  ASSERT_THAT(shape, IsOk());
  ASSERT_EQ(shape->turns.size(), 2u);
  EXPECT_EQ(shape->turns[0].first.size(), 6u);
  EXPECT_EQ(shape->turns[0].second.size(), 4u);
  EXPECT_EQ(shape->turns[0].second[0].role, Role::kToolCall);
  EXPECT_EQ(shape->turns[1].first.size(), 3u);
  EXPECT_EQ(shape->turns[1].second.size(), 1u);
  // Four bytes a token, rounded up per span: 19 -> 5, 100 -> 25.
  shape = ShapeOfConversation(conv, 4);
  ASSERT_THAT(shape, IsOk());
  EXPECT_EQ(shape->turns[0].first[0].num_tokens, 5u);
  EXPECT_EQ(shape->turns[0].first[1].num_tokens, 25u);
  EXPECT_THAT(ShapeOfConversation(conv, 0.5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bytes_per_token=0.5")));
  conv.turns[1].spans = {{Role::kToolCall, 0, 5}};
  EXPECT_THAT(ShapeOfConversation(conv, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("multi_turn_base_3 turn 1 has no prompt")));
}

TEST(ReplayTraceTest, BadTextNamesTheLineFieldAndValue) {
  const std::string ok =
      "session id=s1 tenant=a arrive_ms=5 shape=x\n"
      "turn think_ms=0 decode_ms=10 prompt=user:4 response=tool_call:2\n";
  ASSERT_THAT(ParseTrace("t", ok), IsOk());
  struct Case {
    std::string text, message;
  };
  const std::vector<Case> cases = {
      {"turn think_ms=0 decode_ms=1 prompt=user:1 response=-\n",
       "t:1: turn line before any session line"},
      {"session id=s1 tenant=a arrive_ms=-4 shape=x\n",
       "t:1: arrive_ms=\"-4\" is not a non-negative integer"},
      {"session id=s1 tenant=a arrive_ms=4\n",
       "t:1: session line without shape="},
      {"session id=s1 tenant=a arrive_ms=4 shape=x color=red\n",
       "t:1: \"color=red\" is no field of a session line"},
      {"session id=s1 tenant=a b arrive_ms=4 shape=x\n",
       "t:1: \"b\" is no field of a session line"},
      {"session id=s/1 tenant=a arrive_ms=4 shape=x\n", "t:1: id"},
      {ok + "session id=s1 tenant=a arrive_ms=6 shape=x\n",
       "t:3: id=s1 is used twice"},
      {ok + "session id=s2 tenant=a arrive_ms=1 shape=x\n",
       "t:3: arrive_ms=1 is before the previous session's 5"},
      {"session id=s1 tenant=a arrive_ms=4 shape=x\n"
       "turn think_ms=0 decode_ms=1 prompt=boss:3 response=-\n",
       "t:2: prompt=\"boss:3\": \"boss\" is no role (system, tool_schema,"},
      {"session id=s1 tenant=a arrive_ms=4 shape=x\n"
       "turn think_ms=0 decode_ms=1 prompt=user:0 response=-\n",
       "t:2: prompt=\"user:0\": tokens \"0\" of user is not a positive "
       "integer"},
      {"session id=s1 tenant=a arrive_ms=4 shape=x\n"
       "turn think_ms=3 decode_ms=1 prompt=user:2 response=-\n",
       "t:2: think_ms=3 on the first turn of session id=s1"},
      {"session id=s1 tenant=a arrive_ms=4 shape=x\n"
       "turn think_ms=0 decode_ms=1 prompt=- response=user:2\n",
       "t:2: prompt=- on the first turn of session id=s1"},
      {"session id=s1 tenant=a arrive_ms=4 shape=x\n"
       "session id=s2 tenant=a arrive_ms=4 shape=x\n",
       "t:1: session id=s1 has no turns"},
      {"# nothing\n", "t: no sessions in the trace"},
      {"sessions id=s1\n", "t:1: \"sessions\" is no line kind"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(
        ParseTrace("t", c.text),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.text;
  }
  EXPECT_THAT(ReadTrace("/nonexistent/trace.txt"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("/nonexistent/trace.txt")));
}

TEST(ReplayTraceTest, BadGeneratorInputNamesTheField) {
  auto shape = [](TraceRng& rng) {
    return DrawSyntheticShape(SyntheticShape{}, rng);
  };
  EXPECT_THAT(
      MakeTrace(0, {{"a", 1}}, Timing{}, 1, shape),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sessions=0")));
  EXPECT_THAT(MakeTrace(5, {{"a", 0}}, Timing{}, 1, shape),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tenant a: weight=0")));
  Timing slow;
  slow.arrival_rate = 0;
  EXPECT_THAT(MakeTrace(5, {{"a", 1}}, slow, 1, shape),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("arrival_rate=0")));
  SyntheticShape s;
  s.user_min = 300;
  EXPECT_THAT(CheckSyntheticShape(s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("user: min 300 is above max 200")));
}

}  // namespace
}  // namespace triax::bench::capacity
