// Deterministic memory-pressure scenarios in the manager core: FakeClock,
// workers that are only registry entries (the test plays the worker: it
// reports each tier command's outcome to FinishTierPlan), exact bytes.
// Model: 2 layers, 2 KV heads, head_dim 64, T = 16: a BF16 block is 16384
// bytes. Sequences are "system 16 + user 128" (9 blocks); with the default
// window guard of 64 tokens the first 5 blocks (80 tokens) are rankable.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kvmanager/pressure_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::_;
using ::testing::Each;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

class PressureTest : public PressureFixture {
 protected:
  SequenceInfo Get(const std::string& seq) {
    auto s = core_->GetSequence("", seq);
    EXPECT_THAT(s, IsOk());
    return *s;
  }

  // Plays the worker: every command succeeds (or fails with `fail`).
  void Finish(const TierPlan& plan,
              const absl::Status& fail = absl::OkStatus()) {
    ASSERT_NE(plan.token, 0u);
    std::vector<absl::Status> results(plan.commands.size(), fail);
    ASSERT_THAT(core_->FinishTierPlan(plan.token, results), IsOk());
  }
  size_t CountKind(EventKind k) {
    size_t n = 0;
    for (const Event& e : core_->events().Retained(1, EventFilter{}))
      n += e.kind == k;
    return n;
  }
  static size_t Blocks(const TierPlan& plan) {
    size_t n = 0;
    for (const TierCommand& c : plan.commands) n += c.blocks.size();
    return n;
  }
};

TEST_F(PressureTest, NothingPlannedBelowTheHighWatermark) {
  Make(ManagerOptions{}, 100);
  Tenant("t");
  ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  EXPECT_EQ(core_->PlanPressure().token, 0u);
  EXPECT_EQ(core_->PlanPrefetch("seq-1").token, 0u);
}

TEST_F(PressureTest, AboveHighWatermarkDemotesDownToLowWatermark) {
  // 28 blocks of room; three 9-block sequences = 27 blocks > 0.9 * 28.
  Make(ManagerOptions{}, 28);
  Tenant("t");
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("t"), IsOk());
  const uint64_t cap = 28 * kBf16;
  ASSERT_GT(Reserved(), static_cast<uint64_t>(0.9 * cap));
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  // No host or disk tier: the cheapest action per byte is a demotion (the
  // fallback model makes FP8 far cheaper than eviction).
  for (const TierCommand& c : plan.commands) {
    EXPECT_EQ(c.kind, TierCommand::Kind::kDemote);
    EXPECT_EQ(c.worker_id, "w1");
    for (const BlockPlan& b : c.blocks) {
      EXPECT_LT(b.first_token + b.num_tokens + 64, 145u) << "window guard";
    }
  }
  Finish(plan);
  EXPECT_LE(Reserved(), static_cast<uint64_t>(0.8 * cap));
  EXPECT_EQ(Used("t", Tier::kDevice), Reserved());
  EXPECT_EQ(CountKind(EventKind::kBlockDemoted), Blocks(plan));
  // The plans carry the new encodings, applied to the registry (the
  // fallback model's cheapest loss per byte from BF16 is INT8).
  size_t demoted = 0;
  for (const char* s : {"seq-1", "seq-2", "seq-3"}) {
    for (const BlockPlan& b : Get(s).blocks) {
      demoted += b.encoding != Encoding(Format::kBF16);
      if (b.encoding != Encoding(Format::kBF16)) {
        EXPECT_EQ(b.encoding, Encoding(Format::kINT8));
      }
    }
  }
  EXPECT_EQ(demoted, Blocks(plan));
  // Below the high watermark again: nothing more to do.
  core_->RefreshRanking();
  EXPECT_EQ(core_->PlanPressure().token, 0u);
}

TEST_F(PressureTest, BlocksReencodedSinceTheSnapshotAreNotPromoted) {
  Make(ManagerOptions{}, 37);
  Tenant("t");
  for (int i = 0; i < 4; ++i) ASSERT_THAT(Open("t"), IsOk());  // 36 of 37
  core_->RefreshRanking();  // ranks seq-1's blocks as BF16 -> INT8
  // Meanwhile two of seq-1's rankable blocks go to FP8, which is smaller
  // than the snapshot's target INT8 (the pool stays above its high
  // watermark).
  DemoteBlocksRequest demote;
  demote.tenant_id = "t";
  demote.sequence_id = "seq-1";
  for (uint64_t l = 1; l <= 2; ++l) {
    BlockEncoding be;
    be.lineage_id = l;
    be.encoding.format = Format::kFP8;
    demote.blocks.push_back(be);
  }
  auto prepared = core_->PrepareDemote(demote);
  ASSERT_THAT(prepared, IsOk());
  ASSERT_THAT(core_->CommitDemote(prepared->token), IsOk());
  const uint64_t before = Used("t", Tier::kDevice);
  TierPlan plan = core_->PlanPressure();  // the stale snapshot
  ASSERT_NE(plan.token, 0u);
  for (const TierCommand& c : plan.commands) {
    for (const BlockPlan& b : c.blocks) {
      EXPECT_FALSE(c.sequence_id == "seq-1" && b.lineage_id <= 2)
          << "lineage " << b.lineage_id << " would be re-encoded upwards";
    }
  }
  Finish(plan);
  EXPECT_LT(Used("t", Tier::kDevice), before);
  EXPECT_EQ(Used("t", Tier::kDevice), Reserved());
}

TEST_F(PressureTest, IdleSequenceIsSpilledActiveOneIsNot) {
  // New Opens may take the room the spill freed (no resume reserve), so
  // seq-1's restore must reclaim it from them.
  ManagerOptions options;
  options.resume_reserve = false;
  Make(options, 28, /*host_blocks=*/64);
  Tenant("t");
  ASSERT_THAT(Open("t"), IsOk());  // seq-1: goes idle
  clock_.AdvanceMs(int64_t{10} * 60 * 1000);
  ASSERT_THAT(Open("t"), IsOk());  // seq-2, seq-3: active now
  ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  std::set<std::string> spilled_seqs;
  for (const TierCommand& c : plan.commands) {
    if (c.kind == TierCommand::Kind::kSpill) {
      EXPECT_EQ(c.tier, Tier::kHost);
      spilled_seqs.insert(c.sequence_id);
    }
  }
  EXPECT_EQ(spilled_seqs, std::set<std::string>{"seq-1"});
  // The host tier is reserved while the plan runs.
  EXPECT_GT(Used("t", Tier::kHost), 0u);
  Finish(plan);
  size_t on_host = 0;
  for (const BlockPlan& b : Get("seq-1").blocks)
    on_host += b.tier == Tier::kHost;
  EXPECT_GT(on_host, 0u);
  EXPECT_EQ(Used("t", Tier::kHost), on_host * kBf16);
  EXPECT_EQ(CountKind(EventKind::kBlockSpilled), on_host);

  // seq-1 becomes active: its spilled blocks are planned back. The pool
  // is full, so first only a shortfall comes back (and no restore).
  AdmissionShortfall sf;
  // Fill the pool to its capacity: a 1-block sequence per free block.
  while (Reserved() + kBf16 <= 28 * kBf16) {
    ASSERT_THAT(Open("t", nullptr, 0), IsOk());
  }
  TierPlan none = core_->PlanPrefetch("seq-1", &sf);
  EXPECT_EQ(none.token, 0u);
  EXPECT_EQ(sf.request_bytes, on_host * kBf16);
  EXPECT_EQ(sf.exclude_sequence_id, "seq-1");
  // Room is reclaimed from the others, never from seq-1 itself, round by
  // round as the service's RestoreWithReclaim does (the others were opened
  // just now: past the active guard, they may be spilled).
  clock_.AdvanceMs(options.active_guard_ms);
  size_t restored = 0;
  for (int round = 0; round < 4; ++round) {
    core_->RefreshRanking();
    TierPlan room = core_->PlanAdmission(sf);
    ASSERT_NE(room.token, 0u) << "round " << round;
    for (const TierCommand& c : room.commands) {
      EXPECT_NE(c.sequence_id, "seq-1");
    }
    Finish(room);
    TierPlan restore = core_->PlanPrefetch("seq-1", &sf);
    if (restore.token != 0) {
      for (const TierCommand& c : restore.commands) {
        EXPECT_EQ(c.kind, TierCommand::Kind::kRestore);
      }
      restored += Blocks(restore);
      Finish(restore);
    }
    if (sf.request_bytes == 0) break;
  }
  EXPECT_EQ(sf.request_bytes, 0u);
  EXPECT_EQ(restored, on_host);
  for (const BlockPlan& b : Get("seq-1").blocks) {
    EXPECT_EQ(b.tier, Tier::kDevice);
  }
  // The reclaim may have spilled other sequences: the host tier holds
  // exactly the blocks now on it.
  uint64_t host_bytes = 0;
  auto open_seqs = core_->ListSequences("t", false);
  ASSERT_THAT(open_seqs, IsOk());
  for (const SequenceInfo& q : *open_seqs) {
    for (const BlockPlan& b : Get(q.sequence_id).blocks) {
      if (b.tier == Tier::kHost) {
        host_bytes +=
            2 * kernels::PageBytes(b.encoding, kernels::PageShape{16, 2, 64});
      }
    }
  }
  EXPECT_EQ(Used("t", Tier::kHost), host_bytes);
  EXPECT_EQ(CountKind(EventKind::kBlockRestored), on_host);
  EXPECT_EQ(Used("t", Tier::kDevice), Reserved());
}

TEST_F(PressureTest, GraphEvictNeverEvictsProtectedRoles) {
  ManagerOptions options;
  options.ranker.mode = PressureMode::kGraphEvict;
  Make(options, 28);
  Tenant("t");
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  for (const TierCommand& c : plan.commands) {
    EXPECT_EQ(c.kind, TierCommand::Kind::kEvict);
    for (const BlockPlan& b : c.blocks) {
      EXPECT_NE(b.tag.role, Role::kSystem);
      EXPECT_NE(b.tag.role, Role::kToolSchema);
    }
  }
  const uint64_t before = Reserved();
  Finish(plan);
  EXPECT_EQ(Reserved(), before - Blocks(plan) * kBf16);
  EXPECT_EQ(CountKind(EventKind::kBlockEvicted), Blocks(plan));
  size_t evicted = 0;
  for (const char* s : {"seq-1", "seq-2", "seq-3"}) {
    for (const BlockPlan& b : Get(s).blocks) evicted += b.evicted;
  }
  EXPECT_EQ(evicted, Blocks(plan));
  // Closing frees the rest exactly; evicted blocks hold nothing.
  for (const char* s : {"seq-1", "seq-2", "seq-3"}) {
    ASSERT_THAT(core_->CloseSequence({"", "t", s}), IsOk());
  }
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(Used("t", Tier::kDevice), 0u);
}

TEST_F(PressureTest, OnlyProtectedBlocksLeftMeansNothingToEvict) {
  ManagerOptions options;
  options.ranker.mode = PressureMode::kLru;
  options.ranker.protected_roles = {Role::kSystem, Role::kUser};
  Make(options, 28);
  Tenant("t");
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  EXPECT_EQ(core_->PlanPressure().token, 0u);
}

TEST_F(PressureTest, TenantAboveItsFloorGivesFirst) {
  ManagerOptions options;
  options.ranker.mode = PressureMode::kLru;
  Make(options, 28);
  // "rich" is far above its floor; "poor" is below its floor. poor's blocks
  // are older (LRU would take them first), yet rich gives first.
  Tenant("poor", /*floor=*/20 * kBf16, /*ceiling=*/28 * kBf16);
  Tenant("rich", /*floor=*/1, /*ceiling=*/28 * kBf16);
  ASSERT_THAT(Open("poor"), IsOk());
  clock_.AdvanceMs(60'000);
  ASSERT_THAT(Open("rich"), IsOk());
  ASSERT_THAT(Open("rich"), IsOk());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  for (const TierCommand& c : plan.commands) EXPECT_EQ(c.tenant_id, "rich");
  Finish(plan);
}

TEST_F(PressureTest, AdmissionReclaimsThenAdmits) {
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/20 * kBf16);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());  // 18 blocks
  AdmissionShortfall sf;
  auto refused = Open("t", &sf);
  ASSERT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstr("over by 114688 bytes")));
  EXPECT_EQ(sf.tenant_id, "t");
  EXPECT_EQ(sf.worker_id, "w1");
  EXPECT_EQ(sf.request_bytes, 9 * kBf16);
  // One action per block and round: the first round demotes the 10
  // rankable blocks to FP8 (not enough), the next ones go further, as the
  // service's admission loop does.
  absl::StatusOr<SequenceInfo> admitted = refused.status();
  int rounds = 0;
  while (!admitted.ok() && rounds < 4) {
    ++rounds;
    core_->RefreshRanking();
    TierPlan plan = core_->PlanAdmission(sf);
    ASSERT_NE(plan.token, 0u) << "round " << rounds;
    Finish(plan);
    admitted = Open("t", &sf);
  }
  EXPECT_THAT(admitted, IsOk());
  EXPECT_GE(rounds, 2);
  EXPECT_LE(Used("t", Tier::kDevice), 20 * kBf16);
}

TEST_F(PressureTest,
       AdmissionWithNothingReclaimableStillFailsWithTheShortfall) {
  Make(ManagerOptions{}, 1000);
  Tenant("t", 0, /*ceiling=*/12 * kBf16);
  // Short sequences: every block is within the window guard.
  ASSERT_THAT(Open("t", nullptr, 48), IsOk());  // 4 blocks
  ASSERT_THAT(Open("t", nullptr, 48), IsOk());  // 8
  AdmissionShortfall sf;
  ASSERT_THAT(Open("t", &sf, 48), IsOk());  // 12: exactly the ceiling
  auto refused = Open("t", &sf, 48);
  ASSERT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstr("over by 65536 bytes")));
  core_->RefreshRanking();
  EXPECT_EQ(core_->PlanAdmission(sf).token, 0u);
  EXPECT_THAT(Open("t", nullptr, 48),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("over by 65536 bytes")));
}

TEST_F(PressureTest, WorkerRoomAdmissionTakesFromAnyTenant) {
  Make(ManagerOptions{}, 28);
  Tenant("a");
  Tenant("b");
  ASSERT_THAT(Open("a"), IsOk());
  ASSERT_THAT(Open("a"), IsOk());
  ASSERT_THAT(Open("a"), IsOk());  // 27 of 28 blocks
  AdmissionShortfall sf;
  ASSERT_THAT(Open("b", &sf), StatusIs(absl::StatusCode::kResourceExhausted,
                                       HasSubstr("no worker has room")));
  EXPECT_EQ(sf.worker_id, "w1");
  absl::StatusOr<SequenceInfo> admitted = absl::ResourceExhaustedError("");
  for (int round = 0; round < 4 && !admitted.ok(); ++round) {
    core_->RefreshRanking();
    TierPlan plan = core_->PlanAdmission(sf);
    ASSERT_NE(plan.token, 0u);
    for (const TierCommand& c : plan.commands) EXPECT_EQ(c.tenant_id, "a");
    Finish(plan);
    admitted = Open("b", &sf);
  }
  EXPECT_THAT(admitted, IsOk());
  EXPECT_LE(Reserved(), 28 * kBf16);
}

TEST_F(PressureTest, FailedCommandsReturnReservationsAndFreeTheBlocks) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  const uint64_t before = Reserved();
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  Finish(plan, absl::UnavailableError("worker gone"));
  EXPECT_EQ(Reserved(), before);
  EXPECT_EQ(Used("t", Tier::kHost), 0u);
  EXPECT_EQ(CountKind(EventKind::kBlockSpilled), 0u);
  // Not busy any more: the next round plans them again.
  core_->RefreshRanking();
  TierPlan again = core_->PlanPressure();
  EXPECT_NE(again.token, 0u);
  EXPECT_EQ(Blocks(again), Blocks(plan));
  // Unknown tokens (and a token finished twice) are NOT_FOUND.
  EXPECT_THAT(core_->FinishTierPlan(plan.token, {}),
              StatusIs(absl::StatusCode::kNotFound, _));
}

TEST_F(PressureTest, BlocksClosedWhileBusyLeaveNoBytesBehind) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  for (const char* s : {"seq-1", "seq-2", "seq-3"}) {
    ASSERT_THAT(core_->CloseSequence({"", "t", s}), IsOk());
  }
  Finish(plan);
  EXPECT_EQ(Reserved(), 0u);
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kDisk}) {
    EXPECT_EQ(Used("t", tier), 0u) << TierName(tier);
  }
}

TEST_F(PressureTest, WorkerSideRestoresArriveWithTheHeartbeat) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  Finish(plan);
  std::vector<uint64_t> spilled;
  for (const BlockPlan& b : Get("seq-1").blocks) {
    if (b.tier == Tier::kHost) spilled.push_back(b.lineage_id);
  }
  ASSERT_FALSE(spilled.empty());
  const uint64_t device = Used("t", Tier::kDevice);
  Inventory inv;
  inv.restored_lineage_ids = {spilled[0], 999999};  // unknown ids are skipped
  ASSERT_THAT(core_->Heartbeat("w1", inv), IsOk());
  EXPECT_EQ(Used("t", Tier::kDevice), device + kBf16);
  EXPECT_EQ(Used("t", Tier::kHost), (spilled.size() - 1) * kBf16);
  EXPECT_EQ(Get("seq-1").blocks[spilled[0] - 1].tier, Tier::kDevice);
  EXPECT_EQ(CountKind(EventKind::kBlockRestored), 1u);
}

TEST_F(PressureTest, DemotionsInFlightHoldFramesUntilTheyFinish) {
  // Given a pool above its high watermark and a worker reporting one free
  // frame of 64 KiB (a 1-block Open needs one: 2 BF16 pages of 8 KiB),
  Make(ManagerOptions{}, 28);
  Tenant("t");
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("t"), IsOk());
  Inventory inv;
  inv.frame_bytes = 64 << 10;
  inv.frames = 28 * kBf16 / inv.frame_bytes;
  inv.free_frames = inv.free_frames_compacted = 1;
  ASSERT_THAT(core_->Heartbeat("w1", inv), IsOk());
  core_->RefreshRanking();
  const TierPlan plan = core_->PlanPressure();
  ASSERT_NE(plan.token, 0u);
  for (const TierCommand& c : plan.commands) {
    ASSERT_EQ(c.kind, TierCommand::Kind::kDemote);
  }
  // while the demotions run, their new pages sit beside the old ones: they
  // take the pool's bytes (FreeBytes counts them) as well as frame room,
  // and the Open is refused;
  EXPECT_THAT(Open("t", nullptr, 0).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("no worker has room")));
  // once they finished, their new pages are in the worker's frames but not
  // in a report yet, and the BF16 pages they freed may not make whole
  // frames: still refused;
  Finish(plan);
  EXPECT_THAT(Open("t", nullptr, 0).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("planned since")));
  // the worker's next report (the service asks for one after every reclaim
  // stage) says what they freed, and the Open fits.
  inv.free_frames = inv.free_frames_compacted = 2;
  ASSERT_THAT(core_->Heartbeat("w1", inv), IsOk());
  EXPECT_THAT(Open("t", nullptr, 0), IsOk());
}

TEST_F(PressureTest, ASequenceUsedSinceTheRankingIsNotTakenByIt) {
  // Given seq-1 idle and ranked cold, two busy sequences on a full pool,
  ManagerOptions options;
  options.resume_reserve = false;
  Make(options, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  core_->RefreshRanking();
  auto touches = [](const TierPlan& plan, const std::string& seq) {
    for (const TierCommand& c : plan.commands) {
      if (c.sequence_id == seq) return true;
    }
    return false;
  };
  // the ranking takes seq-1 first (the worker refuses: nothing changes);
  const TierPlan first = core_->PlanPressure();
  ASSERT_TRUE(touches(first, "seq-1"));
  Finish(first, absl::UnavailableError("worker away"));
  // once seq-1 is used again, the same ranking leaves it alone,
  clock_.AdvanceMs(1);
  ReportAccessRequest report;
  report.tenant_id = "t";
  report.sequence_id = "seq-1";
  ASSERT_THAT(core_->ReportAccess(report), IsOk());
  const TierPlan second = core_->PlanPressure();
  EXPECT_FALSE(touches(second, "seq-1"));
  if (second.token != 0) Finish(second);
}

TEST_F(PressureTest, ASequenceInUseIsNotSpilled) {
  // Given two sequences idle for 10 minutes in a full pool, one of them
  // resumed (ReportAccess active) just before the ranking,
  for (const int64_t guard_ms : {int64_t{5000}, int64_t{0}}) {
    SCOPED_TRACE(absl::StrCat("active_guard_ms=", guard_ms));
    ManagerOptions options;
    options.active_guard_ms = guard_ms;
    Make(options, 19, /*host_blocks=*/64);
    Tenant("t");
    ASSERT_THAT(Open("t"), IsOk());  // seq-1
    ASSERT_THAT(Open("t"), IsOk());  // seq-2
    clock_.AdvanceMs(int64_t{10} * 60 * 1000);
    ReportAccessRequest report;
    report.tenant_id = "t";
    report.sequence_id = "seq-1";
    report.active = true;
    ASSERT_THAT(core_->ReportAccess(report), IsOk());
    // when a reclaim round for a large request runs stage after stage
    // (demoting seq-1's blocks to their smallest encoding, then spilling),
    // nothing of seq-1 is spilled while it is in the guard; with the guard
    // off it is.
    AdmissionShortfall sf{"t", "w1", 19 * kBf16};
    std::set<std::string> spilled;
    for (int stage = 0; stage < 8; ++stage) {
      clock_.AdvanceMs(1);
      core_->RefreshRanking();
      const TierPlan plan = core_->PlanAdmission(sf);
      if (plan.token == 0) break;
      for (const TierCommand& c : plan.commands) {
        if (c.kind == TierCommand::Kind::kSpill) spilled.insert(c.sequence_id);
      }
      Finish(plan);
    }
    if (guard_ms > 0) {
      EXPECT_EQ(spilled, std::set<std::string>{"seq-2"});
    } else {
      EXPECT_EQ(spilled, (std::set<std::string>{"seq-1", "seq-2"}));
    }
    // and a shortfall's explanation counts seq-1's blocks under the guard.
    if (guard_ms > 0) {
      core_->RefreshRanking();
      EXPECT_THAT(core_->ExplainShortfall(sf),
                  HasSubstr("of a sequence in use (the active guard)"));
    }
  }
}

TEST_F(PressureTest, ActiveGuardMustNotBeNegative) {
  ManagerOptions options;
  options.active_guard_ms = -1;
  EXPECT_THAT(ManagerCore::Create(options, &clock_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("active_guard_ms -1 must be >= 0")));
}

TEST_F(PressureTest, RestoresArePlannedIntoTheReportedFramesOnly) {
  // Given seq-1 idle with blocks spilled to the host tier,
  ManagerOptions options;
  options.resume_reserve = false;
  Make(options, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  core_->RefreshRanking();
  Finish(core_->PlanPressure());
  size_t spilled = 0;
  for (const BlockPlan& b : Get("seq-1").blocks)
    spilled += b.tier == Tier::kHost;
  ASSERT_GT(spilled, 4u);
  const uint64_t free_bytes = 28 * kBf16 - Reserved();
  ASSERT_GE(free_bytes, spilled * kBf16);  // the byte count would take all
  // when the worker reports one free frame of 64 KiB (8 BF16 pages of 8192
  // bytes: 4 blocks of 2 layers) and no free pool slots,
  Inventory inv;
  inv.frame_bytes = 64 << 10;
  inv.frames = 28 * kBf16 / inv.frame_bytes;
  inv.free_frames = 1;
  inv.free_frames_compacted = 1;
  ASSERT_THAT(core_->Heartbeat("w1", inv), IsOk());
  // expect the restore to take 4 blocks and ask reclaim for the rest.
  AdmissionShortfall sf;
  TierPlan restore = core_->PlanPrefetch("seq-1", &sf);
  EXPECT_EQ(Blocks(restore), 4u);
  EXPECT_EQ(sf.request_bytes, (spilled - 4) * kBf16);
  Finish(restore);
  // Planned since the heartbeat: nothing more fits until the next one,
  // and the shortfall is in frames (the bytes would fit), so reclaim is
  // asked for the frames' worth and finds something to take.
  TierPlan more = core_->PlanPrefetch("seq-1", &sf);
  EXPECT_EQ(more.token, 0u);
  EXPECT_EQ(sf.request_bytes, (spilled - 4) * kBf16);
  EXPECT_GT(sf.worker_request_bytes, sf.request_bytes);
  EXPECT_GT(core_->ShortBytes(sf), 0u);
  core_->RefreshRanking();
  TierPlan room = core_->PlanAdmission(sf);
  ASSERT_NE(room.token, 0u);
  for (const TierCommand& c : room.commands) EXPECT_NE(c.sequence_id, "seq-1");
  Finish(room);
  inv.free_frames = inv.free_frames_compacted = 2;
  ASSERT_THAT(core_->Heartbeat("w1", inv), IsOk());
  TierPlan rest = core_->PlanPrefetch("seq-1", &sf);
  EXPECT_EQ(Blocks(rest), spilled - 4);
  EXPECT_EQ(sf.request_bytes, 0u);
}

TEST_F(PressureTest, SpilledBlocksRefuseDemoteAndFork) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  ASSERT_NO_FATAL_FAILURE(OneIdleTwoBusy());
  core_->RefreshRanking();
  Finish(core_->PlanPressure());
  uint64_t spilled = 0;
  for (const BlockPlan& b : Get("seq-1").blocks) {
    if (b.tier == Tier::kHost) spilled = b.lineage_id;
  }
  ASSERT_NE(spilled, 0u);
  DemoteBlocksRequest demote;
  demote.tenant_id = "t";
  demote.sequence_id = "seq-1";
  BlockEncoding be;
  be.lineage_id = spilled;
  be.encoding.format = Format::kINT4;
  demote.blocks = {be};
  EXPECT_THAT(core_->PrepareDemote(demote),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("spilled to TIER_HOST")));
  ForkSequenceRequest fork;
  fork.tenant_id = "t";
  fork.parent_sequence_id = "seq-1";
  EXPECT_THAT(
      core_->ForkSequence(fork),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("spilled")));
}

TEST_F(PressureTest, ReportedBlocksPrefetchTheirSpilledGraphNeighbours) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  Tenant("t");
  // seq-1: system, tool call, tool result (linked), user: 16 blocks total.
  OpenSequenceRequest req;
  req.tenant_id = "t";
  req.model = Model();
  req.spans = {Span{Role::kSystem, Modality::kText, 16},
               Span{Role::kToolCall, Modality::kText, 16},
               Span{Role::kToolResult, Modality::kText, 32},
               Span{Role::kUser, Modality::kText, 80}};
  ASSERT_THAT(core_->OpenSequence(req), IsOk());
  clock_.AdvanceMs(int64_t{10} * 60 * 1000);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  Finish(core_->PlanPressure());
  const SequenceInfo s1 = Get("seq-1");
  // Block 1 is the tool call, 2-3 the tool result.
  ASSERT_EQ(s1.blocks[1].tag.role, Role::kToolCall);
  ASSERT_EQ(s1.blocks[2].tag.role, Role::kToolResult);
  ASSERT_EQ(s1.blocks[2].tier, Tier::kHost);
  ASSERT_EQ(s1.blocks[3].tier, Tier::kHost);
  ASSERT_THAT(core_->CloseSequence({"", "t", "seq-3"}), IsOk());
  // Not active: only neighbours of the reported tool call come back.
  ReportAccessRequest report;
  report.tenant_id = "t";
  report.sequence_id = "seq-1";
  report.lineage_ids = {s1.blocks[1].lineage_id};
  auto plan = core_->ReportAccess(report);
  ASSERT_THAT(plan, IsOk());
  std::set<uint64_t> restored;
  for (const TierCommand& c : plan->commands) {
    for (const BlockPlan& b : c.blocks) restored.insert(b.lineage_id);
  }
  EXPECT_TRUE(restored.count(s1.blocks[2].lineage_id));
  EXPECT_TRUE(restored.count(s1.blocks[3].lineage_id));
  EXPECT_FALSE(restored.count(s1.blocks[0].lineage_id));
  Finish(*plan);
}

TEST_F(PressureTest, AttendedBlocksAndTheirTemporalNeighboursRankLater) {
  ManagerOptions options;
  options.ranker.mode = PressureMode::kGraphEvict;
  Make(options, 100);
  Tenant("t");
  ASSERT_THAT(Open("t"), IsOk());  // seq-1: blocks 1..9
  ASSERT_THAT(Open("t"), IsOk());  // seq-2: blocks 10..18, the same layout
  // seq-1's block 3 (lineage 3) is attended; seq-2 is not.
  ReportAccessRequest report;
  report.tenant_id = "t";
  report.sequence_id = "seq-1";
  report.lineage_ids = {3};
  for (int i = 0; i < 5; ++i) ASSERT_THAT(core_->ReportAccess(report), IsOk());
  core_->RefreshRanking();
  const PressureState st = core_->GetPressure(1000);
  auto cost = [&](uint64_t lineage) {
    for (const RankedActionInfo& a : st.ranked) {
      if (a.lineage_id == lineage) return a.cost;
    }
    ADD_FAILURE() << "lineage " << lineage << " not ranked";
    return 0.0;
  };
  // Same tag, same bytes: only the graph tells them apart.
  EXPECT_GT(cost(3), cost(12));  // the attended block itself
  EXPECT_GT(cost(2), cost(11));  // its neighbours, by adjacency
  EXPECT_GT(cost(4), cost(13));
  EXPECT_LT(cost(2), cost(3));          // a neighbour keeps half
  EXPECT_DOUBLE_EQ(cost(5), cost(14));  // two away: no effect
}

TEST_F(PressureTest, ReportAccessBadInput) {
  Make(ManagerOptions{}, 100);
  Tenant("t");
  Tenant("u");
  ASSERT_THAT(Open("t"), IsOk());
  ReportAccessRequest r;
  r.tenant_id = "t";
  r.sequence_id = "seq-1";
  r.lineage_ids = {1, 2};
  r.weights = {0.5f};
  EXPECT_THAT(core_->ReportAccess(r),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("weights has 1 entries")));
  r.weights = {0.5f, 1.5f};
  EXPECT_THAT(core_->ReportAccess(r),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("weights[1] is 1.5")));
  r.weights = {};
  r.lineage_ids = {1, 12345};
  EXPECT_THAT(
      core_->ReportAccess(r),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("lineage_ids[1] 12345")));
  r.lineage_ids.assign(4097, 1);
  EXPECT_THAT(
      core_->ReportAccess(r),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 4096")));
  r.lineage_ids = {1};
  r.tenant_id = "u";
  EXPECT_THAT(core_->ReportAccess(r),
              StatusIs(absl::StatusCode::kPermissionDenied, _));
  r.tenant_id = "t";
  r.sequence_id = "seq-404";
  EXPECT_THAT(core_->ReportAccess(r), StatusIs(absl::StatusCode::kNotFound, _));
  r.sequence_id = "seq-1";
  EXPECT_THAT(core_->ReportAccess(r), IsOk());
}

TEST_F(PressureTest, BadPressureOptionsAreRefused) {
  ManagerOptions options;
  options.watermarks = {0.7, 0.8};  // low above high
  EXPECT_THAT(
      ManagerCore::Create(options, &clock_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("watermarks")));
  options = ManagerOptions{};
  options.ranker.evict_factor = -1;
  EXPECT_THAT(
      ManagerCore::Create(options, &clock_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("evict_factor")));
  EXPECT_THAT(
      ParseRoleList("system,bogus"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"bogus\"")));
  auto roles = ParseRoleList(" system , tool_schema");
  ASSERT_THAT(roles, IsOk());
  EXPECT_EQ(roles->size(), 2u);
}

TEST_F(PressureTest, GetPressureShowsPoolsTenantsAndTheRanking) {
  Make(ManagerOptions{}, 28, /*host_blocks=*/64);
  Tenant("t");
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  PressureState st = core_->GetPressure(5);
  ASSERT_EQ(st.pools.size(), 2u);  // device and host of w1
  EXPECT_EQ(st.pools[0].tier, Tier::kDevice);
  EXPECT_EQ(st.pools[0].used_bytes, 27 * kBf16);
  EXPECT_EQ(st.pools[0].high_watermark_bytes,
            static_cast<uint64_t>(28 * kBf16 * 0.9));
  EXPECT_EQ(st.pools[1].tier, Tier::kHost);
  EXPECT_EQ(st.mode, "demote-first");
  EXPECT_EQ(st.snapshot_blocks, 27u);  // every exclusively held block
  ASSERT_EQ(st.ranked.size(), 5u);
  for (size_t i = 1; i < st.ranked.size(); ++i) {
    EXPECT_LE(st.ranked[i - 1].cost, st.ranked[i].cost);
  }
  EXPECT_EQ(st.ranked[0].tenant_id, "t");
}

}  // namespace
}  // namespace triax::manager
