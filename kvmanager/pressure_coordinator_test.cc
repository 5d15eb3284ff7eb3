// PressureCoordinator (pressure_coordinator.h) through its own interface:
// option checks, the block graph's structural edges, reclaim triggers,
// plans from a published ranking (demotions, spills) and their outcome
// (bytes moved, or reservations returned), access reports and neighbour
// restores, prefetch with its shortfall, restores a worker made itself, and
// inspection. The test plays ManagerCore (it builds and ranks snapshots)
// and the workers (it reports each command's outcome). FakeClock; records
// from manager_parts_testing.h; a BF16 block is 16384 bytes, INT8 9728.
#include "kvmanager/pressure_coordinator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "kvmanager/manager_parts_testing.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);
constexpr uint64_t kBf16 = 16384;
constexpr uint64_t kInt8 = 9728;

PressureOptions Options() {
  PressureOptions o;
  o.window_guard_tokens = 0;  // every full block is rankable
  return o;
}

struct CoordWorld : PartsWorld {
  explicit CoordWorld(const PressureOptions& options = Options())
      : options(options),
        coord(options, &clock, &workers, &tenants, &sequences, &calibrations,
              &next_token) {}

  // A sequence whose blocks the graph knows, as ManagerCore creates them.
  SequenceRecord* Add(TenantRecord* t, WorkerRecord* w,
                      const std::vector<Role>& roles) {
    SequenceRecord* s = AddSequence(t, w, roles);
    for (const BlockRecord* b : s->blocks) coord.BlockCreated(s, *b);
    return s;
  }
  void Refresh() {
    SnapshotBuilder b = coord.NewSnapshot();
    b.Begin(clock.NowMs());
    while (!b.done()) b.CopyChunk();
    std::shared_ptr<PressureSnapshot> snap = b.TakeSnapshot();
    absl::StatusOr<Ranking> r = Rank(b.input(), options.ranker);
    ASSERT_THAT(r, IsOk());
    snap->ranking = std::move(*r);
    coord.Publish(std::move(snap));
  }
  // Plays the workers: every command ends with `st`.
  absl::Status Finish(const TierPlan& plan, const absl::Status& st,
                      std::vector<Event>* ev) {
    return coord.FinishTierPlan(
        plan.token, std::vector<absl::Status>(plan.commands.size(), st), ev);
  }

  PressureOptions options;
  PressureCoordinator coord;
};

std::vector<BlockRecord*> Planned(CoordWorld* w, const TierPlan& plan) {
  std::vector<BlockRecord*> out;
  for (const TierCommand& c : plan.commands) {
    for (const BlockPlan& b : c.blocks) {
      out.push_back(w->sequences.FindBlock(b.lineage_id));
    }
  }
  return out;
}

TEST(PressureCoordinatorTest, OptionsAreChecked) {
  using P = PressureCoordinator;
  EXPECT_THAT(P::ValidateOptions(PressureOptions{}), IsOk());
  PressureOptions o;
  o.watermarks = Watermarks{0.7, 0.8};
  EXPECT_THAT(P::ValidateOptions(o),
              StatusIs(C::kInvalidArgument,
                       "watermarks low 0.8 and high 0.7 must satisfy 0 < low "
                       "<= high <= 1"));
  o = PressureOptions{};
  o.watermarks = Watermarks{1.5, 0.8};
  EXPECT_THAT(P::ValidateOptions(o),
              StatusIs(C::kInvalidArgument, HasSubstr("watermarks")));
  o = PressureOptions{};
  o.ranker.evict_factor = std::numeric_limits<double>::infinity();
  EXPECT_THAT(P::ValidateOptions(o),
              StatusIs(C::kInvalidArgument,
                       "evict_factor inf must be finite and >= 0"));
  o = PressureOptions{};
  o.ranker.spill_disk_penalty = -1;
  EXPECT_THAT(
      P::ValidateOptions(o),
      StatusIs(C::kInvalidArgument, HasSubstr("spill_disk_penalty -1")));
  o = PressureOptions{};
  o.ranker.reuse_half_life_ms = 0;
  EXPECT_THAT(
      P::ValidateOptions(o),
      StatusIs(C::kInvalidArgument, "reuse_half_life_ms 0 must be > 0"));
  o = PressureOptions{};
  o.ranker.protected_roles = {Role::kSystem, Role::kUnspecified};
  EXPECT_THAT(P::ValidateOptions(o),
              StatusIs(C::kInvalidArgument,
                       "protected_roles has ROLE_UNSPECIFIED, not a role"));
}

TEST(PressureCoordinatorTest, ToolResultsLinkToTheNewestToolCall) {
  CoordWorld w;
  SequenceRecord* s =
      w.Add(w.AddTenant("t"), w.AddWorker("w", 1 << 30),
            {Role::kSystem, Role::kToolCall, Role::kToolResult, Role::kToolCall,
             Role::kToolResult, Role::kToolResult});
  EXPECT_EQ(w.coord.graph().size(), 6u);
  EXPECT_EQ(s->last_tool_call, 4u);
  EXPECT_THAT(w.coord.graph().Neighbours(2), ElementsAre(3u));
  EXPECT_THAT(w.coord.graph().Neighbours(4), UnorderedElementsAre(5u, 6u));
  EXPECT_TRUE(w.coord.graph().Neighbours(1).empty());
  w.coord.BlockFreed(5);
  EXPECT_EQ(w.coord.graph().size(), 5u);
  EXPECT_THAT(w.coord.graph().Neighbours(4), ElementsAre(6u));
}

TEST(PressureCoordinatorTest, ReclaimIsNeededAboveTheHighWatermark) {
  CoordWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 10 * kBf16, /*host=*/10 * kBf16);
  w.Add(t, wk, std::vector<Role>(8, Role::kUser));  // 0.8: below 0.9
  EXPECT_FALSE(w.coord.NeedsReclaim());
  wk->tier_used[kHost] = 9 * kBf16 + 1;  // the host tier counts too
  EXPECT_TRUE(w.coord.NeedsReclaim());
  wk->tier_used[kHost] = 0;
  // A tenant above a lowered ceiling.
  TenantLedger::SetBudget(t, Budget{Tier::kDevice, 0, 7 * kBf16});
  EXPECT_TRUE(w.coord.NeedsReclaim());
  TenantLedger::SetBudget(t, Budget{Tier::kDevice, 0, 20 * kBf16});
  EXPECT_FALSE(w.coord.NeedsReclaim());
  w.Add(t, wk, {Role::kUser, Role::kUser});  // 10 of 10
  EXPECT_TRUE(w.coord.NeedsReclaim());
  // No snapshot yet: nothing is planned and no token is taken.
  EXPECT_EQ(w.coord.PlanPressure().token, 0u);
  EXPECT_EQ(w.next_token, 1u);
  // A DOWN worker is not reclaimed.
  t->budgets[kDev].reset();
  wk->info.state = WorkerState::kDown;
  EXPECT_FALSE(w.coord.NeedsReclaim());
}

TEST(PressureCoordinatorTest, DemotionsDownToTheLowWatermark) {
  CoordWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 10 * kBf16);
  w.Add(t, wk, std::vector<Role>(5, Role::kUser));
  w.Add(t, wk, std::vector<Role>(5, Role::kUser));
  w.Refresh();
  w.next_token = 7;
  TierPlan plan = w.coord.PlanPressure();
  ASSERT_EQ(plan.token, 7u);
  EXPECT_THAT(plan.reason, HasSubstr("worker w device 163840/163840 need "
                                     "32768"));
  // No spill tier: BF16 -> INT8 (the fallback model's cheapest loss per
  // byte), 6656 bytes each, so five blocks.
  std::vector<BlockRecord*> planned = Planned(&w, plan);
  ASSERT_EQ(planned.size(), 5u);
  for (const TierCommand& c : plan.commands) {
    EXPECT_EQ(c.kind, TierCommand::Kind::kDemote);
    EXPECT_EQ(c.worker_address, wk->info.address);
    EXPECT_THAT(c.request_id, HasSubstr("pressure-7-"));
    for (const BlockPlan& b : c.blocks) EXPECT_EQ(b.encoding, Format::kINT8);
  }
  for (const BlockRecord* b : planned) EXPECT_EQ(b->busy, 7u);
  EXPECT_EQ(plan.bytes, 5 * (kBf16 - kInt8));
  EXPECT_EQ(w.coord.plans_in_flight(), 1u);
  // Until it finishes the pool is still full: a second plan takes other
  // blocks (busy ones are never planned twice); it fails and changes
  // nothing.
  TierPlan second = w.coord.PlanPressure();
  ASSERT_EQ(second.token, 8u);
  for (const BlockRecord* b : Planned(&w, second)) {
    EXPECT_EQ(b->busy, 8u);
    EXPECT_THAT(planned, ::testing::Not(::testing::Contains(b)));
  }
  std::vector<Event> none;
  ASSERT_THAT(w.Finish(second, absl::UnavailableError("down"), &none), IsOk());
  EXPECT_TRUE(none.empty());

  std::vector<Event> ev;
  ASSERT_THAT(w.Finish(plan, absl::OkStatus(), &ev), IsOk());
  EXPECT_EQ(wk->reserved, 10 * kBf16 - 5 * (kBf16 - kInt8));
  EXPECT_LE(wk->reserved, 8 * kBf16);  // the low watermark
  EXPECT_EQ(t->used[kDev], wk->reserved);
  ASSERT_EQ(ev.size(), 5u);
  for (const Event& e : ev) {
    EXPECT_EQ(e.kind, EventKind::kBlockDemoted);
    EXPECT_THAT(e.detail, HasSubstr("from=bf16 to=int8 bytes_freed=6656 "
                                    "by=pressure"));
  }
  for (const BlockRecord* b : planned) {
    EXPECT_EQ(b->busy, 0u);
    EXPECT_EQ(b->encoding, Format::kINT8);
  }
  EXPECT_EQ(w.coord.GetPressure(0).demotions, 5u);
  EXPECT_THAT(w.coord.FinishTierPlan(plan.token, {}, &ev),
              StatusIs(C::kNotFound, "tier plan token 7 is not pending"));
  EXPECT_FALSE(w.coord.NeedsReclaim());
}

TEST(PressureCoordinatorTest, SpillsReserveTheHostTierAndFailuresReturnIt) {
  CoordWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 10 * kBf16, /*host=*/20 * kBf16);
  w.Add(t, wk, std::vector<Role>(5, Role::kUser));
  w.Add(t, wk, std::vector<Role>(5, Role::kUser));
  // Idle for ten minutes: a restore is unlikely, so spilling is cheapest.
  w.clock.AdvanceMs(600'000);
  w.Refresh();
  TierPlan plan = w.coord.PlanPressure();
  std::vector<BlockRecord*> planned = Planned(&w, plan);
  ASSERT_EQ(planned.size(), 2u);
  for (const TierCommand& c : plan.commands) {
    EXPECT_EQ(c.kind, TierCommand::Kind::kSpill);
    EXPECT_EQ(c.tier, Tier::kHost);
  }
  // The destination is reserved at planning.
  EXPECT_EQ(wk->tier_used[kHost], 2 * kBf16);
  EXPECT_EQ(t->used[kHost], 2 * kBf16);
  std::vector<Event> ev;
  // Missing results count as failures.
  ASSERT_THAT(w.coord.FinishTierPlan(plan.token, {}, &ev), IsOk());
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(wk->tier_used[kHost], 0u);
  EXPECT_EQ(t->used[kHost], 0u);
  EXPECT_EQ(wk->reserved, 10 * kBf16);
  for (const BlockRecord* b : planned) {
    EXPECT_EQ(b->busy, 0u);
    EXPECT_EQ(b->tier, Tier::kDevice);
  }
  // Again, successfully: the source is released, the blocks are on the host.
  plan = w.coord.PlanPressure();
  planned = Planned(&w, plan);
  ASSERT_EQ(planned.size(), 2u);
  ASSERT_THAT(w.Finish(plan, absl::OkStatus(), &ev), IsOk());
  EXPECT_EQ(wk->reserved, 8 * kBf16);
  EXPECT_EQ(wk->tier_used[kHost], 2 * kBf16);
  EXPECT_EQ(t->used[kDev], 8 * kBf16);
  EXPECT_EQ(t->used[kHost], 2 * kBf16);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].kind, EventKind::kBlockSpilled);
  EXPECT_EQ(ev[0].detail, "tier=TIER_HOST bytes=16384");
  for (const BlockRecord* b : planned) EXPECT_EQ(b->tier, Tier::kHost);
  EXPECT_EQ(w.coord.GetPressure(0).spills, 2u);
}

TEST(PressureCoordinatorTest, PrefetchRestoresWhatFitsAndReportsTheRest) {
  CoordWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 10 * kBf16, /*host=*/10 * kBf16);
  SequenceRecord* s = w.Add(t, wk, std::vector<Role>(4, Role::kUser));
  SequenceRecord* other = w.Add(t, wk, std::vector<Role>(5, Role::kUser));
  PartsWorld::Spill(s, s->blocks[1], Tier::kHost);
  PartsWorld::Spill(s, s->blocks[2], Tier::kHost);
  PartsWorld::Spill(other, other->blocks[0], Tier::kHost);
  EXPECT_EQ(wk->reserved, 6 * kBf16);
  AdmissionShortfall sf{"x", "y", 1, "z"};
  EXPECT_EQ(w.coord.PlanPrefetch("seq-9", &sf).token, 0u);
  EXPECT_EQ(sf.request_bytes, 0u);  // reset
  // Room for one more block on the device: one restored, one short.
  wk->info.capacity_bytes = 7 * kBf16;
  TierPlan plan = w.coord.PlanPrefetch(s->id, &sf);
  ASSERT_NE(plan.token, 0u);
  ASSERT_EQ(plan.commands.size(), 1u);
  EXPECT_EQ(plan.commands[0].kind, TierCommand::Kind::kRestore);
  EXPECT_EQ(plan.commands[0].tier, Tier::kDevice);
  ASSERT_EQ(plan.commands[0].blocks.size(), 1u);
  EXPECT_EQ(plan.commands[0].blocks[0].lineage_id, s->blocks[1]->lineage_id);
  EXPECT_EQ(wk->reserved, 7 * kBf16);  // reserved at planning
  EXPECT_EQ(sf.tenant_id, "t");
  EXPECT_EQ(sf.worker_id, "w");
  EXPECT_EQ(sf.request_bytes, kBf16);
  EXPECT_EQ(sf.exclude_sequence_id, s->id);
  std::vector<Event> ev;
  ASSERT_THAT(w.Finish(plan, absl::OkStatus(), &ev), IsOk());
  EXPECT_EQ(s->blocks[1]->tier, Tier::kDevice);
  EXPECT_EQ(s->spilled, 1u);
  EXPECT_EQ(wk->tier_used[kHost], 2 * kBf16);
  EXPECT_EQ(t->used[kHost], 2 * kBf16);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, EventKind::kBlockRestored);
  EXPECT_EQ(ev[0].detail, "from=TIER_HOST bytes=16384 by=manager");
  // A tenant ceiling stops a restore too.
  wk->info.capacity_bytes = 100 * kBf16;
  TenantLedger::SetBudget(t, Budget{Tier::kDevice, 0, 7 * kBf16});
  EXPECT_EQ(w.coord.PlanPrefetch(s->id, &sf).token, 0u);
  EXPECT_EQ(sf.request_bytes, kBf16);
}

TEST(PressureCoordinatorTest, AccessReportsRestoreSpilledNeighbours) {
  using P = PressureCoordinator;
  ReportAccessRequest bad;
  bad.lineage_ids.assign(4097, 1);
  EXPECT_THAT(P::ValidateAccessReport(bad),
              StatusIs(C::kInvalidArgument,
                       "lineage_ids has 4097 entries; at most 4096"));
  bad.lineage_ids = {1, 2};
  bad.weights = {0.5f};
  EXPECT_THAT(P::ValidateAccessReport(bad),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("weights has 1 entries; lineage_ids has 2")));
  bad.weights = {0.5f, 1.5f};
  EXPECT_THAT(P::ValidateAccessReport(bad),
              StatusIs(C::kInvalidArgument,
                       "weights[1] is 1.5; must be in "
                       "0..1"));

  CoordWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 100 * kBf16, /*host=*/10 * kBf16);
  SequenceRecord* s = w.Add(
      t, wk, {Role::kSystem, Role::kToolCall, Role::kToolResult, Role::kUser});
  SequenceRecord* other = w.Add(t, wk, {Role::kUser});
  PartsWorld::Spill(s, s->blocks[2], Tier::kHost);  // the tool result
  ReportAccessRequest req;
  req.lineage_ids = {other->blocks[0]->lineage_id};
  EXPECT_THAT(w.coord.ReportAccess(s, req),
              StatusIs(C::kNotFound,
                       "lineage_ids[0] 5 is not a block of sequence_id "
                       "\"seq-1\""));
  w.clock.AdvanceMs(1000);
  req.lineage_ids = {s->blocks[1]->lineage_id};  // the tool call
  auto plan = w.coord.ReportAccess(s, req);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(s->last_access_ms, w.clock.NowMs());
  EXPECT_EQ(w.coord.graph().Find(2)->hits, 1u);
  ASSERT_EQ(plan->commands.size(), 1u);
  EXPECT_EQ(plan->commands[0].kind, TierCommand::Kind::kRestore);
  EXPECT_THAT(plan->reason, HasSubstr("neighbours of seq-1"));
  ASSERT_EQ(plan->commands[0].blocks.size(), 1u);
  EXPECT_EQ(plan->commands[0].blocks[0].lineage_id, 3u);
  // Neighbours come back only below the high watermark.
  std::vector<Event> ev;
  ASSERT_THAT(w.Finish(*plan, absl::UnavailableError("worker gone"), &ev),
              IsOk());
  wk->info.capacity_bytes = 4 * kBf16;  // above the high watermark already
  auto none = w.coord.ReportAccess(s, req);
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->token, 0u);
}

TEST(PressureCoordinatorTest, RestoresAWorkerMadeItselfAreApplied) {
  CoordWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 100 * kBf16, /*host=*/10 * kBf16);
  WorkerRecord* other = w.AddWorker("v", 100 * kBf16, /*host=*/10 * kBf16);
  SequenceRecord* s = w.Add(t, wk, std::vector<Role>(4, Role::kUser));
  SequenceRecord* elsewhere = w.Add(t, other, {Role::kUser, Role::kUser});
  PartsWorld::Spill(s, s->blocks[1], Tier::kHost);
  PartsWorld::Spill(s, s->blocks[2], Tier::kHost);
  PartsWorld::Spill(elsewhere, elsewhere->blocks[1], Tier::kHost);
  s->blocks[2]->busy = 3;  // a manager restore in flight commits it
  const uint64_t version = s->version;
  std::vector<Event> ev;
  // Unknown ids, device blocks, busy blocks and other workers' are skipped.
  w.coord.ApplyWorkerRestores(
      wk,
      {99, s->blocks[0]->lineage_id, s->blocks[1]->lineage_id,
       s->blocks[2]->lineage_id, elsewhere->blocks[1]->lineage_id},
      &ev);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].lineage_id, s->blocks[1]->lineage_id);
  EXPECT_EQ(ev[0].detail, "from=TIER_HOST bytes=16384 by=worker");
  EXPECT_EQ(s->blocks[1]->tier, Tier::kDevice);
  EXPECT_EQ(s->blocks[2]->tier, Tier::kHost);
  EXPECT_EQ(s->spilled, 1u);
  EXPECT_EQ(s->version, version + 1);
  EXPECT_EQ(wk->reserved, 3 * kBf16);
  EXPECT_EQ(wk->tier_used[kHost], kBf16);
  EXPECT_EQ(t->used[kHost], 2 * kBf16);  // s's one and elsewhere's
  EXPECT_EQ(w.coord.GetPressure(0).restores, 1u);
}

TEST(PressureCoordinatorTest, InspectionShowsPoolsTenantsAndTheRanking) {
  CoordWorld w;
  TenantRecord* t = w.AddTenant("zeta");
  w.AddTenant("alpha");
  WorkerRecord* wk = w.AddWorker("w", 10 * kBf16, /*host=*/20 * kBf16);
  w.AddWorker("down", 10 * kBf16)->info.state = WorkerState::kDown;
  w.Add(t, wk, std::vector<Role>(3, Role::kUser));
  PressureState st = w.coord.GetPressure(5);
  EXPECT_EQ(st.mode, "demote-first");
  ASSERT_EQ(st.pools.size(), 2u);  // device and host of the UP worker
  EXPECT_EQ(st.pools[0].tier, Tier::kDevice);
  EXPECT_EQ(st.pools[0].used_bytes, 3 * kBf16);
  EXPECT_EQ(st.pools[0].high_watermark_bytes,
            static_cast<uint64_t>(10 * kBf16 * 0.9));
  EXPECT_EQ(st.pools[0].low_watermark_bytes,
            static_cast<uint64_t>(10 * kBf16 * 0.8));
  EXPECT_EQ(st.pools[1].tier, Tier::kHost);
  EXPECT_EQ(st.pools[1].capacity_bytes, 20 * kBf16);
  ASSERT_EQ(st.tenants.size(), 2u);
  EXPECT_EQ(st.tenants[0].tenant_id, "alpha");
  EXPECT_EQ(st.snapshot_blocks, 0u);
  EXPECT_TRUE(st.ranked.empty());
  w.Refresh();
  w.clock.AdvanceMs(250);
  st = w.coord.GetPressure(2);
  EXPECT_EQ(st.snapshot_blocks, 3u);
  EXPECT_EQ(st.snapshot_age_ms, 250);
  ASSERT_EQ(st.ranked.size(), 2u);
  EXPECT_EQ(st.ranked[0].sequence_id, "seq-1");
  EXPECT_EQ(st.ranked[0].tenant_id, "zeta");
  EXPECT_LE(st.ranked[0].cost, st.ranked[1].cost);
}

}  // namespace
}  // namespace triax::manager
