// Reclaim rounds (reclaim_round.h) through the manager core (fixture:
// pressure_test_fixture.h): FakeClock,
// one worker that is only a registry entry (the test plays the worker: each
// tier command succeeds, or fails when told), exact bytes.
// Model: 2 layers, 2 KV heads, head_dim 64, T = 16: a BF16 block is 16384
// bytes. Sequences are "system 16 + user 128" (9 blocks); with the default
// window guard of 64 tokens the first 5 blocks (80 tokens) are rankable.
#include "kvmanager/reclaim_round.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <map>

#include "common/status_matchers.h"
#include "kvmanager/pressure_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

absl::Time Later() { return absl::Now() + absl::Seconds(30); }

class ReclaimRoundTest : public PressureFixture {
 protected:
  absl::StatusOr<ExtendSequenceResult> Extend(
      const std::string& tenant, const std::string& seq, uint32_t user_tokens,
      AdmissionShortfall* sf = nullptr) {
    ExtendSequenceRequest req;
    req.tenant_id = tenant;
    req.sequence_id = seq;
    req.new_turn = true;
    req.spans = {Span{Role::kUser, Modality::kText, user_tokens}};
    return core_->ExtendSequence(req, sf);
  }

  // Plays the worker: every command succeeds, or fails with fail_.
  TierPlanOutcome Run(const TierPlan& plan) {
    TierPlanOutcome out;
    if (plan.token == 0) return out;
    ++plans_;
    absl::Status fail = fail_;
    if (fail_next_plans_ > 0) {
      --fail_next_plans_;
      fail = absl::ResourceExhaustedError("worker pool is full");
    }
    std::vector<absl::Status> results(plan.commands.size(), fail);
    EXPECT_THAT(core_->FinishTierPlan(plan.token, results, &out), IsOk());
    return out;
  }
  TierPlanRunner Runner() {
    return [this](const TierPlan& plan) { return Run(plan); };
  }

  // An Open retried after each stage of a round, as the service does.
  absl::Status OpenAfterReclaim(const std::string& tenant, uint32_t user_tokens,
                                ReclaimReport* report,
                                absl::Time deadline = Later()) {
    AdmissionShortfall sf;
    auto refused = Open(tenant, &sf, user_tokens);
    if (refused.ok() || !absl::IsResourceExhausted(refused.status())) {
      return refused.status();
    }
    return ReclaimRound(
        core_.get(), refused.status(), &sf, deadline, Runner(),
        [&](AdmissionShortfall* s) {
          return Open(tenant, s, user_tokens).status();
        },
        report);
  }

  // Spills seq's rankable blocks to the host tier (it is idle, the others
  // were active since): the background PlanPressure of a full pool.
  size_t SpillIdle(const std::string& seq) {
    core_->RefreshRanking();
    TierPlan plan = core_->PlanPressure();
    EXPECT_NE(plan.token, 0u);
    Run(plan);
    size_t on_host = 0;
    auto s = core_->GetSequence("", seq);
    EXPECT_THAT(s, IsOk());
    for (const BlockPlan& b : s->blocks) on_host += b.tier == Tier::kHost;
    return on_host;
  }

  std::map<uint64_t, int> DemotionsPerBlock() {
    std::map<uint64_t, int> n;
    for (const Event& e : core_->events().Retained(1, EventFilter{})) {
      if (e.kind == EventKind::kBlockDemoted) ++n[e.lineage_id];
    }
    return n;
  }

  absl::Status fail_ = absl::OkStatus();
  int fail_next_plans_ = 0;  // plans refused for room before fail_ applies
  int plans_ = 0;
};

TEST_F(ReclaimRoundTest, OneRoundCoversAShortfallThatNeedsTwoActionsOnABlock) {
  // Ceiling 20 blocks, 18 in use; a 9-block Open is over by 7 blocks. One
  // demotion of each of the 10 rankable blocks (BF16 -> INT8) frees about
  // half of each: not enough, so some blocks must be demoted again.
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/20 * kBf16);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  const uint64_t before = Used("t", Tier::kDevice);
  ReclaimReport report;
  ASSERT_THAT(OpenAfterReclaim("t", 128, &report), IsOk());
  EXPECT_GE(report.stages, 2u);
  EXPECT_EQ(plans_, static_cast<int>(report.stages));
  EXPECT_GT(report.demotions, 10u) << "more actions than rankable blocks";
  EXPECT_EQ(report.spills + report.evictions, 0u);  // no spill tier
  int twice = 0;
  for (const auto& [lineage, n] : DemotionsPerBlock()) twice += n >= 2;
  EXPECT_GT(twice, 0) << "some block was demoted twice in the round";
  std::printf(
      "deep round: shortfall %llu bytes covered, %s, %d blocks "
      "demoted twice or more\n",
      7ULL * kBf16, report.Summary().c_str(), twice);
  // What the report says was freed is what the tenant's usage shows.
  EXPECT_EQ(report.bytes_freed, before + 9 * kBf16 - Used("t", Tier::kDevice));
  EXPECT_GE(report.bytes_freed, 7 * kBf16);
  EXPECT_LE(Used("t", Tier::kDevice), 20 * kBf16);
  EXPECT_TRUE(report.stopped.empty()) << report.stopped;
  EXPECT_THAT(
      report.Summary(),
      AllOf(HasSubstr(absl::StrCat("freed ", report.bytes_freed, " bytes in ",
                                   report.stages, " stages")),
            HasSubstr(absl::StrCat(report.demotions, " demotions"))));
}

TEST_F(ReclaimRoundTest, WorkerRoomAdmissionSucceedsAndReportsWhatWasFreed) {
  // 28 blocks of room, 27 in use: a new 9-block Open needs 8 more blocks,
  // and the low watermark (0.8) asks for more.
  Make(ManagerOptions{}, 28);
  Tenant("a");
  Tenant("b");
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("a"), IsOk());
  const uint64_t before = Reserved();
  ReclaimReport report;
  ASSERT_THAT(OpenAfterReclaim("b", 128, &report), IsOk());
  EXPECT_GE(report.stages, 1u);
  EXPECT_EQ(report.bytes_freed, before + 9 * kBf16 - Reserved());
  EXPECT_EQ(report.failed_commands, 0u);
  EXPECT_LE(Reserved(), 28 * kBf16);
}

TEST_F(ReclaimRoundTest, NothingReclaimableFailsNamingTheShortfallAndWhy) {
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/12 * kBf16);
  // Short sequences: every block is within the window guard.
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("t", nullptr, 48), IsOk());
  ReclaimReport report;
  absl::Status st = OpenAfterReclaim("t", 48, &report);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kResourceExhausted,
                           AllOf(HasSubstr("over by 65536 bytes"),
                                 HasSubstr("reclaim freed 0 bytes in 0 stages"),
                                 HasSubstr("still short by 65536 bytes"),
                                 HasSubstr("nothing left to take"),
                                 HasSubstr("of tenant \"t\""),
                                 HasSubstr("12 (196608 bytes) in the window "
                                           "guard"))));
  EXPECT_EQ(report.stages, 0u);
  EXPECT_EQ(plans_, 0);
}

TEST_F(ReclaimRoundTest, ShortfallLeftAfterReclaimSaysWhatWasFreed) {
  // Ceiling 20 blocks: two 9-block sequences and a 24-block Open cannot
  // fit whatever is demoted (the new blocks alone need 24 > 20 - 8 of
  // guarded blocks), so the round takes all it can and stops.
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/20 * kBf16);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  ReclaimReport report;
  absl::Status st = OpenAfterReclaim("t", 368, &report);
  ASSERT_THAT(st, StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_GT(report.stages, 0u);
  EXPECT_GT(report.bytes_freed, 0u);
  EXPECT_THAT(
      st.message(),
      AllOf(HasSubstr(
                absl::StrCat("reclaim freed ", report.bytes_freed, " bytes")),
            HasSubstr("still short by"), HasSubstr("nothing left to take"),
            HasSubstr("in the window guard"),
            HasSubstr("with nothing left to take (protected")));
}

TEST_F(ReclaimRoundTest, DeadlineAndFailingWorkerEndTheRound) {
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/20 * kBf16);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  ReclaimReport report;
  EXPECT_THAT(OpenAfterReclaim("t", 128, &report, absl::InfinitePast()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("the reclaim deadline passed")));
  EXPECT_EQ(plans_, 0);
  fail_ = absl::UnavailableError("worker gone");
  EXPECT_THAT(OpenAfterReclaim("t", 128, &report),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("no action of the last stage was "
                                       "applied"),
                             HasSubstr("worker gone"))));
  EXPECT_EQ(plans_, 1);
  EXPECT_GT(report.failed_commands, 0u);
  EXPECT_EQ(report.demotions, 0u);
}

// A stage the worker refuses for room (a full spill tier, a pool without
// a frame) is planned again around its blocks; three in a row end it.
TEST_F(ReclaimRoundTest, AStageRefusedForRoomIsPlannedAroundItsBlocks) {
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/20 * kBf16);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  fail_next_plans_ = 1;
  ReclaimReport report;
  // 4 blocks: 2 over the ceiling, a stage takes a few of the 10 rankable.
  ASSERT_THAT(OpenAfterReclaim("t", 48, &report), IsOk());
  EXPECT_GE(plans_, 2);
  EXPECT_GT(report.failed_commands, 0u);
  EXPECT_GT(report.demotions, 0u);
  // Refused every time: the round ends after at most three such stages
  // (or when the refused blocks leave nothing to take), naming the refusal.
  plans_ = 0;
  fail_next_plans_ = 100;
  EXPECT_THAT(OpenAfterReclaim("t", 48, &report),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("worker pool is full")));
  EXPECT_GE(plans_, 1);
  EXPECT_LE(plans_, 3);
  EXPECT_EQ(report.demotions + report.spills + report.evictions, 0u);
  fail_next_plans_ = 0;
}

TEST_F(ReclaimRoundTest,
       DemotionsGoOutInSmallCommandsAndAFailedOneLeavesTheRest) {
  // One long sequence: 26 blocks, 22 outside the window guard; an 8-block
  // Open is over the 28-block ceiling by 6 blocks, which takes more than 8
  // demotions (each frees about half a block).
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/28 * kBf16);
  ASSERT_THAT(Open("t", nullptr, 400), IsOk());
  AdmissionShortfall sf;
  ASSERT_THAT(
      Open("t", &sf, 112),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("over by")));
  core_->RefreshRanking();
  TierPlan plan = core_->PlanAdmission(sf);
  ASSERT_NE(plan.token, 0u);
  ASSERT_GE(plan.commands.size(), 2u);
  size_t blocks = 0;
  for (const TierCommand& c : plan.commands) {
    EXPECT_EQ(c.kind, TierCommand::Kind::kDemote);
    EXPECT_EQ(c.sequence_id, "seq-1");
    EXPECT_LE(c.blocks.size(), 8u);
    blocks += c.blocks.size();
  }
  EXPECT_GT(blocks, 8u);
  // The worker refuses the first command (no room for its new pages): the
  // others still apply.
  std::vector<absl::Status> results(plan.commands.size(), absl::OkStatus());
  results[0] = absl::ResourceExhaustedError("no room for the new pages");
  TierPlanOutcome out;
  ASSERT_THAT(core_->FinishTierPlan(plan.token, results, &out), IsOk());
  EXPECT_EQ(out.failed_commands, 1u);
  EXPECT_EQ(out.demotions, blocks - plan.commands[0].blocks.size());
  EXPECT_GT(out.device_bytes_freed, 0u);
}

TEST(ReclaimOptions, DeadlineMustBePositive) {
  FakeClock clock;
  for (int64_t ms : {0, -1}) {
    ManagerOptions o;
    o.admission_deadline_ms = ms;
    EXPECT_THAT(
        ManagerCore::Create(o, &clock),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr(absl::StrCat("admission_deadline_ms ", ms))));
  }
}

// --- Room held for spilled open sequences -----------------------------------

TEST_F(ReclaimRoundTest, SpilledSessionsBytesAreNotTakenByANewOpen) {
  // 28 blocks, a host tier. seq-1 goes idle, seq-2 and seq-3 stay active:
  // the pool is above its high watermark and seq-1's 5 rankable blocks are
  // spilled, leaving 6 blocks free on the device.
  for (bool reserve : {true, false}) {
    SCOPED_TRACE(reserve ? "resume_reserve" : "no resume_reserve");
    ManagerOptions options;
    options.resume_reserve = reserve;
    Make(options, 28, /*host_blocks=*/64);
    Tenant("t");
    ASSERT_THAT(Open("t"), IsOk());
    clock_.AdvanceMs(int64_t{10} * 60 * 1000);
    ASSERT_THAT(Open("t"), IsOk());
    ASSERT_THAT(Open("t"), IsOk());
    const size_t spilled = SpillIdle("seq-1");
    ASSERT_EQ(spilled, 5u);
    ASSERT_EQ(Reserved(), 22 * kBf16);
    // A 4-block Open fits in the freed room, but not beside seq-1's 5
    // spilled blocks.
    AdmissionShortfall sf;
    auto open = Open("t", &sf, 48);
    if (!reserve) {
      // The room seq-1 needs is gone: its restore must take from others.
      EXPECT_THAT(open, IsOk());
      uint32_t blocks = 0;
      ReclaimReport report;
      EXPECT_THAT(RestoreRound(core_.get(), "seq-1", Later(), Runner(), &blocks,
                               &report),
                  IsOk());
      EXPECT_GE(report.stages, 1u);
      EXPECT_GT(report.bytes_freed, 0u);
      std::printf(
          "no resume reserve: the 4-block Open admitted at once; "
          "seq-1's restore of %zu blocks then reclaimed: %s\n",
          spilled, report.Summary().c_str());
      continue;
    }
    ASSERT_THAT(open, StatusIs(absl::StatusCode::kResourceExhausted,
                               AllOf(HasSubstr("worker \"w1\""),
                                     HasSubstr("81920 held for spilled open "
                                               "sequences to resume"),
                                     HasSubstr("over by 49152 bytes"))));
    EXPECT_TRUE(sf.resume_reserve);
    EXPECT_EQ(sf.worker_held_bytes, 5 * kBf16);
    EXPECT_EQ(sf.tenant_held_bytes, 5 * kBf16);
    // Every sequence is idle now, so spilling would be the cheapest action
    // of every block; but the Open's reclaim ranks without spills (a spill
    // would move more bytes into the reserve) and demotes, then the Open
    // fits beside the reserve.
    clock_.AdvanceMs(int64_t{10} * 60 * 1000);
    core_->RefreshRanking();
    const PressureState ranked = core_->GetPressure(1);
    ASSERT_FALSE(ranked.ranked.empty());
    EXPECT_EQ(ranked.ranked[0].action, PressureAction::kSpillHost);
    ReclaimReport report;
    ASSERT_THAT(OpenAfterReclaim("t", 48, &report), IsOk());
    EXPECT_EQ(report.spills, 0u);
    EXPECT_GT(report.demotions, 0u);
    std::printf(
        "resume reserve: the 4-block Open refused (over by 49152 "
        "bytes with 81920 held), admitted after a round that %s\n",
        report.Summary().c_str());
    EXPECT_LE(Reserved() + Used("t", Tier::kHost), 28 * kBf16);
    // seq-1 comes back without taking anything from the others.
    uint32_t blocks = 0;
    const int plans_before = plans_;
    EXPECT_THAT(
        RestoreRound(core_.get(), "seq-1", Later(), Runner(), &blocks, &report),
        IsOk());
    EXPECT_EQ(blocks, spilled);
    EXPECT_EQ(report.stages, 0u);
    EXPECT_EQ(plans_, plans_before + 1);  // the restore itself
    auto s = core_->GetSequence("", "seq-1");
    ASSERT_THAT(s, IsOk());
    for (const BlockPlan& b : s->blocks) EXPECT_EQ(b.tier, Tier::kDevice);
  }
}

TEST_F(ReclaimRoundTest, ResumptionReclaimsFromOthersFirst) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  const size_t spilled = SpillIdle("seq-1");
  ASSERT_EQ(spilled, 5u);
  // The active sequences grow into the room (an Extend does not count the
  // reserve: they are open sessions too).
  ASSERT_THAT(Extend("t", "seq-2", 48), IsOk());  // 3 blocks
  ASSERT_THAT(Extend("t", "seq-3", 48), IsOk());  // 3 blocks: 28 of 28
  ASSERT_EQ(Reserved(), 28 * kBf16);
  uint32_t blocks = 0;
  ReclaimReport report;
  ASSERT_THAT(
      RestoreRound(core_.get(), "seq-1", Later(), Runner(), &blocks, &report),
      IsOk());
  EXPECT_EQ(blocks, spilled);
  EXPECT_GE(report.stages, 1u);
  EXPECT_GE(report.bytes_freed, spilled * kBf16);
  auto s = core_->GetSequence("", "seq-1");
  ASSERT_THAT(s, IsOk());
  for (const BlockPlan& b : s->blocks) EXPECT_EQ(b.tier, Tier::kDevice);
  EXPECT_LE(Reserved(), 28 * kBf16);
  // Nothing of seq-1 was acted on by its own reclaim.
  for (const Event& e : core_->events().Retained(1, EventFilter{})) {
    if (e.sequence_id == "seq-1") {
      EXPECT_NE(e.kind, EventKind::kBlockDemoted);
      EXPECT_NE(e.kind, EventKind::kBlockEvicted);
    }
  }
}

TEST_F(ReclaimRoundTest, ResumptionIsRefusedOnlyWhenNothingElseIsReclaimable) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  ASSERT_EQ(SpillIdle("seq-1"), 5u);
  // The others are closed and the room goes to short sequences whose
  // blocks are all in the window guard: nothing is left to take.
  for (const char* seq : {"seq-2", "seq-3"}) {
    CloseSequenceRequest close;
    close.tenant_id = "t";
    close.sequence_id = seq;
    ASSERT_THAT(core_->CloseSequence(close), IsOk());
  }
  // 4 device blocks of seq-1; 24 free; 5 held: 19 usable.
  for (int i = 0; i < 4; ++i) ASSERT_THAT(Open("t", nullptr, 48), IsOk());
  ASSERT_THAT(Open("t", nullptr, 32), IsOk());  // 3 blocks: 4 + 19 + 5 = 28
  // One more block anywhere takes seq-1's room: an Extend by a guarded
  // sequence (Extends do not count the reserve).
  ASSERT_THAT(Extend("t", "seq-8", 16), IsOk());
  ASSERT_EQ(Reserved(), 24 * kBf16);
  uint32_t blocks = 0;
  ReclaimReport report;
  absl::Status st =
      RestoreRound(core_.get(), "seq-1", Later(), Runner(), &blocks, &report);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kResourceExhausted,
                           AllOf(HasSubstr("sequence_id \"seq-1\""),
                                 HasSubstr("do not fit on worker \"w1\""),
                                 HasSubstr("nothing left to take"),
                                 HasSubstr("in the window guard"),
                                 HasSubstr("of the sequence being resumed"),
                                 Not(HasSubstr("still short by 0 ")))));
  EXPECT_EQ(report.stages, 0u);
}

// A worker that refuses a restore for room (its room was newer than the
// plan's) gets one more plan in the refreshed room rather than an error.
TEST_F(ReclaimRoundTest, ARestoreRefusedForRoomIsPlannedAgain) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  const size_t spilled = SpillIdle("seq-1");
  ASSERT_GT(spilled, 0u);
  plans_ = 0;
  fail_next_plans_ = 1;
  uint32_t blocks = 0;
  ReclaimReport report;
  ASSERT_THAT(
      RestoreRound(core_.get(), "seq-1", Later(), Runner(), &blocks, &report),
      IsOk());
  EXPECT_EQ(plans_, 2);
  EXPECT_EQ(blocks, 2 * spilled);  // planned twice, restored once
  auto s = core_->GetSequence("", "seq-1");
  ASSERT_THAT(s, IsOk());
  for (const BlockPlan& b : s->blocks) EXPECT_EQ(b.tier, Tier::kDevice);
  // Refused twice: the second refusal is the answer.
  ASSERT_EQ(SpillIdle("seq-1"), spilled);
  fail_next_plans_ = 2;
  EXPECT_THAT(
      RestoreRound(core_.get(), "seq-1", Later(), Runner(), &blocks, &report),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("restore of sequence_id \"seq-1\" failed"),
                     HasSubstr("worker pool is full"))));
}

// An Extend's reclaim may demote or evict the extended sequence's own
// blocks but not spill them: its next Attend would restore them at once.
TEST_F(ReclaimRoundTest, AnExtendsReclaimDoesNotSpillTheSequenceItself) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  Tenant("t");
  ASSERT_THAT(Open("t"), IsOk());  // seq-1: idle, ranked coldest
  clock_.AdvanceMs(int64_t{10} * 60 * 1000);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());  // 27 of 28 blocks
  AdmissionShortfall sf;
  ASSERT_THAT(Extend("t", "seq-1", 48, &sf).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
  EXPECT_EQ(sf.resident_sequence_id, "seq-1");
  auto spills_of = [](const TierPlan& plan, const std::string& seq) {
    size_t n = 0;
    for (const TierCommand& c : plan.commands) {
      if (c.kind == TierCommand::Kind::kSpill && c.sequence_id == seq) {
        n += c.blocks.size();
      }
    }
    return n;
  };
  core_->RefreshRanking();
  const TierPlan plan = core_->PlanAdmission(sf);
  ASSERT_NE(plan.token, 0u);
  EXPECT_EQ(spills_of(plan, "seq-1"), 0u);
  fail_ = absl::UnavailableError("worker away");  // changes nothing
  Run(plan);
  // Without the field the same ranking spills seq-1 first.
  sf.resident_sequence_id.clear();
  const TierPlan other = core_->PlanAdmission(sf);
  EXPECT_GT(spills_of(other, "seq-1"), 0u);
  Run(other);
}

}  // namespace
}  // namespace triax::manager
