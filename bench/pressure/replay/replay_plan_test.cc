#include "bench/pressure/replay/replay_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/status_matchers.h"

namespace triax::bench::replay {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

TEST(ParseSessionIds, KeepsOrderAndCuts) {
  auto ids = ParseSessionIds("--bfcl_ids",
                             "multi_turn_base_3, multi_turn_base_8,"
                             "multi_turn_base_15,",
                             2);
  ASSERT_THAT(ids, IsOk());
  EXPECT_THAT(*ids, ElementsAre("multi_turn_base_3", "multi_turn_base_8"));
  ids = ParseSessionIds("--bfcl_ids", "multi_turn_base_3", 0);
  ASSERT_THAT(ids, IsOk());
  EXPECT_EQ(ids->size(), 1u);
}

TEST(ParseSessionIds, RejectsBadIdsNamingTheFlag) {
  EXPECT_THAT(ParseSessionIds("--bfcl_ids", "", 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--bfcl_ids: \"\" names no conversation")));
  EXPECT_THAT(ParseSessionIds("--bfcl_ids", "multi_turn_base_3,long_7", 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"long_7\" is not multi_turn_base_<n>")));
  EXPECT_THAT(ParseSessionIds("--bfcl_ids", "multi_turn_base_x", 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("multi_turn_base_x")));
  EXPECT_THAT(
      ParseSessionIds("--bfcl_ids", "multi_turn_base_3,multi_turn_base_3", 0),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
  for (const std::string& cal : CalibrationIds()) {
    EXPECT_THAT(ParseSessionIds("--bfcl_ids", "multi_turn_base_3," + cal, 0),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("calibration conversation")))
        << cal;
  }
  EXPECT_EQ(CalibrationIds().size(), 8u);
}

TEST(PoolArithmetic, WholeBlocksAndRoundedUpMiB) {
  // kvproxy-18m: 16-token BF16 block = 16 x 2 heads x 128 x 2 (K,V) x 2 B.
  const uint64_t block = 16 * 2 * 128 * 2 * 2;
  EXPECT_EQ(Bf16PlanBytes(16, 16, block, 6), 6 * block);
  EXPECT_EQ(Bf16PlanBytes(17, 16, block, 6), 12 * block);
  EXPECT_EQ(Bf16PlanBytes(0, 16, block, 6), 0u);
  EXPECT_EQ(Bf16PlanBytes(5, 0, block, 6), 0u);

  auto p = SizePool(3ull << 20, 1.0 / 3);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->pool_mb, 1);
  p = SizePool(100ull << 20, 1.0 / 3);  // 33.33 MiB -> 34
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->pool_mb, 34);
  EXPECT_THAT(p->Explain(12, 17000),
              HasSubstr("12 sessions, 17000 tokens, BF16 final KV 100.0 MiB "
                        "x 0.333 = 33.3 MiB -> --pool_mb=34 (holds 34.0%"));
  p = SizePool(1, 1.0);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->pool_mb, 1);
  EXPECT_THAT(SizePool(0, 0.5), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("total_bytes=0")));
  EXPECT_THAT(SizePool(10, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("fraction=0")));
  EXPECT_THAT(SizePool(10, 1.5), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("fraction=1.5")));
}

TEST(RoundRobin, TurnByTurnAcrossSessions) {
  EXPECT_THAT(RoundRobin({2, 1, 3}),
              ElementsAre(Step{0, 0}, Step{1, 0}, Step{2, 0}, Step{0, 1},
                          Step{2, 1}, Step{2, 2}));
  EXPECT_TRUE(RoundRobin({}).empty());
  EXPECT_TRUE(RoundRobin({0, 0}).empty());
}

TEST(ModeResult, ScoresAndTable) {
  ModeResult r;
  r.mode = "lru";
  r.policy = "bf16";
  r.AddScore(/*session=*/0, /*turn=*/0, 1.5, 1.0);
  r.AddScore(/*session=*/0, /*turn=*/1, 2.0, 1.0);
  EXPECT_DOUBLE_EQ(r.mean_dnll(), 0.75);
  EXPECT_DOUBLE_EQ(r.mean_dnll_late(), 1.0);
  EXPECT_EQ(r.scored, 2);
  EXPECT_EQ(r.scored_late, 1);
  r.final_blocks["evicted"] = 4;
  r.final_blocks["bf16"] = 10;
  ModeResult d;
  d.mode = "demote-first";
  d.policy = "bf16";
  d.AddScore(0, 1, 1.25, 1.0);
  d.final_blocks["int4"] = 3;
  const std::string md = ResultsTable({r, d});
  EXPECT_THAT(md, HasSubstr("| lru | bf16 | 0 | 0 (0) | 0 / 0 / 0 | 0 | 0 | "
                            "0 | 0 | 2 | +0.7500 | +1.0000 (1) | +1.0000 (1 "
                            "turns, 1 tokens) |"));
  EXPECT_THAT(md, HasSubstr("| +0.2500 (1) | +0.2500 (1 turns, 1 tokens) |"));
  EXPECT_THAT(md, HasSubstr("| mode | policy | bf16 | evicted | int4 |"));
  EXPECT_THAT(md, HasSubstr("| lru | bf16 | 10 | 4 | 0 |"));
  EXPECT_THAT(md, HasSubstr("| demote-first | bf16 | 0 | 0 | 3 |"));
  ModeResult empty;
  EXPECT_DOUBLE_EQ(empty.mean_dnll(), 0.0);
  EXPECT_THAT(ResultsTable({empty}), ::testing::Not(HasSubstr("Final plans")));
}

TEST(CommonLaterTurns, OnlyTurnsEveryRowScored) {
  ModeResult a, b;
  a.AddScore(0, 0, 9.0, 0.0);  // turn 0: never common
  b.AddScore(0, 0, 9.0, 0.0);
  a.AddScore(0, 1, 1.0, 0.0);
  a.AddScore(0, 1, 3.0, 0.0);
  b.AddScore(0, 1, 0.5, 0.0);
  b.AddScore(0, 1, 0.5, 0.0);
  a.AddScore(1, 1, 7.0, 0.0);  // only in a
  b.AddScore(2, 2, 7.0, 0.0);  // only in b
  const CommonTurns c = CommonLaterTurns({a, b});
  EXPECT_EQ(c.turns, 1);
  EXPECT_EQ(c.tokens, 2);
  ASSERT_EQ(c.mean_dnll.size(), 2u);
  EXPECT_DOUBLE_EQ(c.mean_dnll[0], 2.0);
  EXPECT_DOUBLE_EQ(c.mean_dnll[1], 0.5);
  ModeResult none;
  const CommonTurns n = CommonLaterTurns({a, none});
  EXPECT_EQ(n.turns, 0);
  EXPECT_TRUE(std::isnan(n.mean_dnll[0]));
  EXPECT_TRUE(std::isnan(n.mean_dnll[1]));
  EXPECT_EQ(ResultsTable({a, none}).find("turns,"), std::string::npos);
}

}  // namespace
}  // namespace triax::bench::replay
