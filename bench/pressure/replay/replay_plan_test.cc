#include "bench/pressure/replay/replay_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

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
  const uint64_t block = size_t{16} * 2 * 128 * 2 * 2;
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

TEST(IdleRounds, AllActiveIsRoundRobin) {
  const std::vector<int> turns = {3, 1, 4, 2};
  auto steps = IdleRounds(turns, 1.0, 7, 3);
  ASSERT_THAT(steps, IsOk());
  EXPECT_EQ(*steps, RoundRobin(turns));
  auto never_idle = IdleRounds(turns, 0.2, 7, 0);
  ASSERT_THAT(never_idle, IsOk());
  EXPECT_EQ(*never_idle, RoundRobin(turns));
}

// Every turn once, in order per session; all sessions start in round 0;
// some later round leaves a session idle; no session waits longer than
// max_idle_rounds; the same seed gives the same rounds, another seed others.
TEST(IdleRounds, SomeSessionsIdleAndComeBack) {
  const std::vector<int> turns(12, 4);
  auto a = IdleRounds(turns, 0.5, 1, 2);
  ASSERT_THAT(a, IsOk());
  ASSERT_EQ(a->size(), 48u);
  std::vector<int> next(12, 0);
  for (size_t i = 0; i < a->size(); ++i) {
    const Step& st = (*a)[i];
    if (i < 12) {
      EXPECT_EQ(st, (Step{static_cast<int>(i), 0}));
    }
    EXPECT_EQ(st.turn, next[st.session]++) << i;
  }
  for (int n : next) EXPECT_EQ(n, 4);
  // Reconstruct rounds (a round ends where the session index does not
  // grow) and count idle gaps: a session absent from a round while it
  // still had turns.
  std::vector<std::vector<int>> rounds;
  int prev = 1 << 30;
  for (const Step& st : *a) {
    if (st.session <= prev) rounds.emplace_back();
    rounds.back().push_back(st.session);
    prev = st.session;
  }
  std::vector<int> left(12, 4), idle(12, 0);
  int idle_rounds = 0;
  for (const auto& r : rounds) {
    std::vector<bool> in(12, false);
    for (int s : r) in[s] = true;
    for (int s = 0; s < 12; ++s) {
      if (left[s] == 0) continue;
      if (in[s]) {
        --left[s];
        idle[s] = 0;
      } else {
        ++idle_rounds;
        EXPECT_LT(++idle[s], 3) << "session " << s << " idle too long";
      }
    }
  }
  EXPECT_GT(idle_rounds, 0);
  auto again = IdleRounds(turns, 0.5, 1, 2);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*again, *a);
  auto other = IdleRounds(turns, 0.5, 2, 2);
  ASSERT_THAT(other, IsOk());
  EXPECT_NE(*other, *a);
}

TEST(IdleRounds, BadInput) {
  EXPECT_THAT(IdleRounds({2}, 0.0, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("active_fraction=0")));
  EXPECT_THAT(IdleRounds({2}, 1.5, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("active_fraction=1.5")));
  EXPECT_THAT(IdleRounds({2}, 0.5, 1, -1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("max_idle_rounds=-1")));
}

TEST(References, RoundTripExactlyAndCheckTheSessions) {
  const std::string path = ::testing::TempDir() + "/replay_references_test.txt";
  std::vector<SessionReference> refs = {
      {"multi_turn_base_1",
       {std::nan(""), 0.1, 1.0 / 3, 2.5e-300},
       {{0.5, 0.25}, {1e-17, 7.0, 3.0}}},
      {"multi_turn_base_2", {std::nan(""), 9.75}, {}}};
  ASSERT_THAT(WriteReferences(path, refs), IsOk());
  auto back =
      ReadReferences(path, {"multi_turn_base_1", "multi_turn_base_2"}, {4, 2});
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->size(), 2u);
  EXPECT_TRUE(std::isnan((*back)[0].nll[0]));
  for (size_t i = 1; i < 4; ++i) EXPECT_EQ((*back)[0].nll[i], refs[0].nll[i]);
  EXPECT_EQ((*back)[0].turn_mass, refs[0].turn_mass);
  EXPECT_EQ((*back)[1].nll[1], 9.75);
  EXPECT_TRUE((*back)[1].turn_mass.empty());
  EXPECT_THAT(
      ReadReferences(path, {"multi_turn_base_1", "multi_turn_base_3"}, {4, 2}),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("multi_turn_base_3")));
  EXPECT_THAT(ReadReferences(path, {"multi_turn_base_1"}, {5}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("with 4 tokens; want multi_turn_base_1 "
                                 "with 5")));
  EXPECT_THAT(ReadReferences(path + ".missing", {"x"}, {1}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  ASSERT_THAT(WriteReferences(path, {}), IsOk());
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(
        "triax-replay-reference 1\nsession multi_turn_base_1 2 0\n"
        "0.5\nbanana\n",
        f);
    std::fclose(f);
  }
  EXPECT_THAT(ReadReferences(path, {"multi_turn_base_1"}, {2}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("line 4")));
}

TEST(BlockWeights, SharesOfTheLiveBlocksMass) {
  // Tokens 0..7 with mass 1..8; blocks of 3, 3, 2 tokens, the second
  // evicted, a fourth beyond the mass.
  const std::vector<double> mass = {1, 2, 3, 4, 5, 6, 7, 8};
  const AccessReport r = BlockWeights(
      {{10, 0, 3, true}, {11, 3, 3, false}, {12, 6, 2, true}, {13, 8, 4, true}},
      mass);
  EXPECT_THAT(r.lineage_ids, ElementsAre(10, 12, 13));
  ASSERT_EQ(r.weights.size(), 3u);
  EXPECT_FLOAT_EQ(r.weights[0], 6.0f / 21.0f);
  EXPECT_FLOAT_EQ(r.weights[1], 15.0f / 21.0f);
  EXPECT_FLOAT_EQ(r.weights[2], 0.0f);
  const AccessReport z = BlockWeights({{1, 0, 4, true}}, {0, 0, 0, 0});
  EXPECT_THAT(z.weights, ElementsAre(0.0f));
}

}  // namespace
}  // namespace triax::bench::replay
