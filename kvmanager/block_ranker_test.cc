// The reclaim ranking (block_ranker.h): action choice and pool order per
// mode, tenants above their floor, bad input, SelectReclaim, watermarks, and
// randomized checks against a reference scorer (fixed seeds; one thread and
// several give the same ranking).
#include "kvmanager/block_ranker.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);
constexpr int kDisk = static_cast<int>(Tier::kDisk);
constexpr int64_t kNow = 1'000'000;

// One calibrated tag: BF16 1000 B, INT8 520 B, INT4 280 B, INT2 160 B;
// eviction distortion resolves to evict_factor (4) x 0.1 = 0.4.
OptionSet TagOptions() {
  OptionSet set;
  set.options = {{Format::kBF16, 1000, 0.0},
                 {Format::kINT8, 520, 0.001},
                 {Format::kINT4, 280, 0.01},
                 {Format::kINT2, 160, 0.1}};
  return set;
}

// One worker (device only unless tiers are given), one tenant, one sequence
// active at kNow.
PressureInput BaseInput(uint64_t host_capacity = 0,
                        uint64_t disk_capacity = 0) {
  PressureInput in;
  in.now_ms = kNow;
  in.option_sets.push_back(TagOptions());
  WorkerView w;
  w.worker_id = "w0";
  w.capacity[kDev] = 1 << 30;
  w.capacity[kHost] = host_capacity;
  w.capacity[kDisk] = disk_capacity;
  in.workers.push_back(w);
  TenantView t;
  t.tenant_id = "t0";
  in.tenants.push_back(t);
  SequenceView s;
  s.sequence_id = "s0";
  s.last_access_ms = kNow;
  in.sequences.push_back(s);
  return in;
}

BlockView Block(uint64_t lineage, uint32_t sequence = 0,
                Role role = Role::kAssistant, int32_t option_set = 0) {
  BlockView b;
  b.lineage_id = lineage;
  b.sequence = sequence;
  b.index = static_cast<uint32_t>(lineage);
  b.tag.role = role;
  b.tag.temporal = Temporal::kOlder;
  b.tokens = 16;
  b.encoding = Format::kBF16;
  b.bytes = 1000;
  b.option_set = option_set;
  b.last_access_ms = kNow;
  return b;
}

RankerOptions Mode(PressureMode m) {
  RankerOptions o;
  o.mode = m;
  return o;
}

const std::vector<RankedAction>& Pool(const Ranking& r, Tier tier,
                                      uint32_t worker = 0) {
  return r.pools.at(worker).at(static_cast<int>(tier));
}

std::vector<uint64_t> Lineages(const std::vector<RankedAction>& pool) {
  std::vector<uint64_t> out;
  out.reserve(pool.size());
  for (const RankedAction& a : pool) out.push_back(a.lineage_id);
  return out;
}

const RankedAction* FindAction(const Ranking& r, uint64_t lineage) {
  for (const auto& by_tier : r.pools) {
    for (const auto& pool : by_tier) {
      for (const RankedAction& a : pool) {
        if (a.lineage_id == lineage) return &a;
      }
    }
  }
  return nullptr;
}

constexpr PressureMode kAllModes[] = {
    PressureMode::kDemoteFirst, PressureMode::kGraphEvict, PressureMode::kLru};

TEST(PressureModeTest, ParsesAndNames) {
  for (PressureMode m : kAllModes) {
    auto parsed = ParsePressureMode(PressureModeName(m));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, m);
  }
  EXPECT_THAT(ParsePressureMode("fifo"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fifo")));
}

// --- Ranking order -----------------------------------------------------------

TEST(RankTest, DemoteIsCheaperThanEvictForACalibratedTag) {
  PressureInput in = BaseInput();
  in.blocks.push_back(Block(1, 0, Role::kAssistant, -1));  // no calibration
  in.blocks.push_back(Block(2));
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  const auto& pool = Pool(*r, Tier::kDevice);
  ASSERT_EQ(pool.size(), 2u);
  // Block 2: INT8 costs 16 * 0.001 / 480 per byte, the best of its options
  // (INT4 16 * 0.01 / 720, INT2 16 * 0.1 / 840, evict 16 * 0.4 / 1000).
  EXPECT_EQ(pool[0].lineage_id, 2u);
  EXPECT_EQ(pool[0].action, PressureAction::kDemote);
  EXPECT_EQ(pool[0].encoding, Encoding(Format::kINT8));
  EXPECT_EQ(pool[0].bytes_freed, 480u);
  EXPECT_DOUBLE_EQ(pool[0].cost, 16 * 0.001 / 480);
  EXPECT_EQ(pool[0].block, 1u);
  EXPECT_EQ(pool[0].from, Tier::kDevice);
  // Block 1: eviction at the default distortion 1.0.
  EXPECT_EQ(pool[1].lineage_id, 1u);
  EXPECT_EQ(pool[1].action, PressureAction::kEvict);
  EXPECT_DOUBLE_EQ(pool[1].cost, 16 * 1.0 / 1000);
  EXPECT_EQ(pool[1].bytes_freed, 1000u);
}

TEST(RankTest, CostPerByteNotCostDecidesTheDemotionTarget) {
  // Going from INT8 (520 B, D 0.001) to INT4 frees only 240 B at a tiny
  // cost; to INT2 frees 360 B but costs far more per byte.
  PressureInput in = BaseInput();
  BlockView b = Block(1);
  b.encoding = Format::kINT8;
  b.bytes = 520;
  b.distortion = 0.001;
  in.blocks.push_back(b);
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(Pool(*r, Tier::kDevice).size(), 1u);
  const RankedAction& a = Pool(*r, Tier::kDevice)[0];
  EXPECT_EQ(a.action, PressureAction::kDemote);
  EXPECT_EQ(a.encoding, Encoding(Format::kINT4));
  EXPECT_EQ(a.bytes_freed, 240u);
  EXPECT_DOUBLE_EQ(a.cost, 16 * (0.01 - 0.001) / 240);
}

TEST(RankTest, SpillsAnIdleSequenceBeforeDemotingAnActiveOne) {
  PressureInput in = BaseInput(/*host_capacity=*/1 << 20);
  SequenceView idle;
  idle.sequence_id = "idle";
  idle.last_access_ms = kNow - 600'000;  // 20 reuse half-lives
  in.sequences.push_back(idle);
  BlockView active_block = Block(1, 0);
  BlockView idle_block = Block(2, 1);
  idle_block.last_access_ms = kNow - 600'000;
  in.blocks = {active_block, idle_block};
  RankerOptions o;
  o.spill_host_penalty = 1e-2;  // an active block's spill costs more
  auto r = Rank(in, o);
  ASSERT_THAT(r, IsOk());
  const auto& pool = Pool(*r, Tier::kDevice);
  ASSERT_EQ(pool.size(), 2u);
  EXPECT_EQ(pool[0].lineage_id, 2u);
  EXPECT_EQ(pool[0].action, PressureAction::kSpillHost);
  EXPECT_NEAR(pool[0].cost, 16 * 1e-2 * std::exp2(-20.0) / 1000, 1e-15);
  EXPECT_EQ(pool[1].lineage_id, 1u);
  EXPECT_EQ(pool[1].action, PressureAction::kDemote);
}

TEST(RankTest, NoSpillToAFullTier) {
  PressureInput in = BaseInput(/*host_capacity=*/1500);
  in.workers[0].used[kHost] = 600;  // 900 B of room, the block needs 1000
  in.blocks.push_back(Block(1, 0, Role::kAssistant, -1));
  RankerOptions o;
  auto r = Rank(in, o);
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(Pool(*r, Tier::kDevice).size(), 1u);
  EXPECT_EQ(Pool(*r, Tier::kDevice)[0].action, PressureAction::kEvict);
  in.workers[0].used[kHost] = 500;
  r = Rank(in, o);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(Pool(*r, Tier::kDevice)[0].action, PressureAction::kSpillHost);
}

TEST(RankTest, ProtectedRolesAreNeverEvictedInAnyMode) {
  for (PressureMode m : kAllModes) {
    SCOPED_TRACE(PressureModeName(m));
    PressureInput in = BaseInput(/*host_capacity=*/0, /*disk_capacity=*/0);
    in.blocks.push_back(Block(1, 0, Role::kSystem, -1));
    in.blocks.push_back(Block(2, 0, Role::kToolSchema, -1));
    in.blocks.push_back(Block(3, 0, Role::kSystem));  // can be demoted
    BlockView host_sys = Block(4, 0, Role::kSystem, -1);
    host_sys.tier = Tier::kHost;
    in.blocks.push_back(host_sys);
    in.blocks.push_back(Block(5, 0, Role::kUser, -1));
    auto r = Rank(in, Mode(m));
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(FindAction(*r, 1), nullptr);
    EXPECT_EQ(FindAction(*r, 2), nullptr);
    EXPECT_EQ(FindAction(*r, 4), nullptr);
    const RankedAction* user = FindAction(*r, 5);
    ASSERT_NE(user, nullptr);
    EXPECT_EQ(user->action, PressureAction::kEvict);
    const RankedAction* demotable = FindAction(*r, 3);
    if (m == PressureMode::kDemoteFirst) {
      ASSERT_NE(demotable, nullptr);
      EXPECT_EQ(demotable->action, PressureAction::kDemote);
    } else {
      EXPECT_EQ(demotable, nullptr);
    }
  }
  // With a disk tier, a protected host block may still spill to disk.
  PressureInput in = BaseInput(/*host_capacity=*/1 << 20,
                               /*disk_capacity=*/1 << 20);
  BlockView host_sys = Block(4, 0, Role::kSystem, -1);
  host_sys.tier = Tier::kHost;
  in.blocks.push_back(host_sys);
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(Pool(*r, Tier::kHost).size(), 1u);
  EXPECT_EQ(Pool(*r, Tier::kHost)[0].action, PressureAction::kSpillDisk);
}

TEST(RankTest, SharedUnsealedAndDiskBlocksAreNeverCandidates) {
  for (PressureMode m : kAllModes) {
    SCOPED_TRACE(PressureModeName(m));
    PressureInput in = BaseInput(1 << 20, 1 << 20);
    BlockView shared = Block(1);
    shared.refcount = 2;
    BlockView unsealed = Block(2);
    unsealed.sealed = false;
    BlockView on_disk = Block(3);
    on_disk.tier = Tier::kDisk;
    BlockView empty = Block(4);
    empty.bytes = 0;
    in.blocks = {shared, unsealed, on_disk, empty, Block(5)};
    auto r = Rank(in, Mode(m));
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(r->blocks, 5u);
    EXPECT_THAT(Lineages(Pool(*r, Tier::kDevice)), ElementsAre(5u));
    EXPECT_THAT(Pool(*r, Tier::kHost), IsEmpty());
    EXPECT_THAT(Pool(*r, Tier::kDisk), IsEmpty());
  }
}

TEST(RankTest, LruOrdersByLastAccessOfBlockOrSequence) {
  PressureInput in = BaseInput();
  SequenceView recent;
  recent.last_access_ms = kNow - 100;
  in.sequences.push_back(recent);  // sequence 1
  in.sequences[0].last_access_ms = kNow - 50'000;
  BlockView a = Block(10, 0);
  a.last_access_ms = kNow - 90'000;  // 50 s old through its sequence
  BlockView b = Block(11, 0);
  b.last_access_ms = kNow - 10'000;  // 10 s
  BlockView c = Block(12, 1);
  c.last_access_ms = kNow - 90'000;  // 0.1 s through its sequence
  BlockView d = Block(9, 0);
  d.last_access_ms = kNow - 70'000;  // 50 s, ties with a: lineage 9 first
  in.blocks = {a, b, c, d};
  auto r = Rank(in, Mode(PressureMode::kLru));
  ASSERT_THAT(r, IsOk());
  const auto& pool = Pool(*r, Tier::kDevice);
  EXPECT_THAT(Lineages(pool), ElementsAre(9u, 10u, 11u, 12u));
  EXPECT_DOUBLE_EQ(pool[0].cost, 50'000);
  EXPECT_DOUBLE_EQ(pool[2].cost, 10'000);
  EXPECT_DOUBLE_EQ(pool[3].cost, 100);
  for (const RankedAction& x : pool) {
    EXPECT_EQ(x.action, PressureAction::kEvict);
  }
}

TEST(RankTest, GraphWeightMakesAConnectedBlockRankLater) {
  BlockGraph graph;
  for (uint64_t id = 1; id <= 20; ++id) graph.AddBlock(id, kNow - 1000);
  for (uint64_t id = 3; id <= 12; ++id) {
    graph.Link(1, id, EdgeKind::kCoAttention, 2.0);
  }
  graph.Link(1, 13, EdgeKind::kToolCallResult);
  PressureInput in = BaseInput();
  in.blocks = {Block(1), Block(2)};
  for (BlockView& b : in.blocks) {
    ASSERT_TRUE(graph.Snapshot(b.lineage_id, kNow, &b));
  }
  EXPECT_GT(in.blocks[0].importance, in.blocks[1].importance);
  for (PressureMode m :
       {PressureMode::kDemoteFirst, PressureMode::kGraphEvict}) {
    SCOPED_TRACE(PressureModeName(m));
    auto r = Rank(in, Mode(m));
    ASSERT_THAT(r, IsOk());
    const auto& pool = Pool(*r, Tier::kDevice);
    EXPECT_THAT(Lineages(pool), ElementsAre(2u, 1u));
    EXPECT_NEAR(pool[1].cost / pool[0].cost, 1.0 + in.blocks[0].importance,
                1e-12);
  }
  // importance_weight 0 ignores the graph: a tie, broken by lineage.
  RankerOptions o = Mode(PressureMode::kGraphEvict);
  o.importance_weight = 0;
  auto r = Rank(in, o);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(Lineages(Pool(*r, Tier::kDevice)), ElementsAre(1u, 2u));
}

TEST(RankTest, TenantAboveFloorGivesFirstEvenAtAHigherCost) {
  PressureInput in = BaseInput();
  TenantView over;
  over.tenant_id = "over";
  over.floor[kDev] = 1000;
  over.used[kDev] = 3000;  // overage 2000: cost divided by 3
  in.tenants.push_back(over);
  in.tenants[0].floor[kDev] = 5000;
  in.tenants[0].used[kDev] = 5000;  // at its floor
  SequenceView s1;
  s1.tenant = 1;
  s1.last_access_ms = kNow;
  in.sequences.push_back(s1);
  in.blocks = {Block(1, 0), Block(2, 1, Role::kUser, -1)};
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  const auto& pool = Pool(*r, Tier::kDevice);
  ASSERT_EQ(pool.size(), 2u);
  EXPECT_EQ(pool[0].lineage_id, 2u);
  EXPECT_TRUE(pool[0].above_floor);
  EXPECT_DOUBLE_EQ(pool[0].cost, 16 * 1.0 / 1000 / 3);
  EXPECT_EQ(pool[1].lineage_id, 1u);
  EXPECT_FALSE(pool[1].above_floor);
  EXPECT_GT(pool[0].cost, pool[1].cost);
  // Floor 0 with usage: above the floor, cost not scaled.
  in.tenants[1].floor[kDev] = 0;
  r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(Pool(*r, Tier::kDevice)[0].lineage_id, 2u);
  EXPECT_DOUBLE_EQ(Pool(*r, Tier::kDevice)[0].cost, 16 * 1.0 / 1000);
}

TEST(RankTest, HostBlocksGoToTheHostPool) {
  PressureInput in = BaseInput(/*host_capacity=*/1 << 20,
                               /*disk_capacity=*/1 << 20);
  BlockView host = Block(1, 0, Role::kAssistant, -1);
  host.tier = Tier::kHost;
  BlockView dev = Block(2, 0, Role::kAssistant, -1);
  in.blocks = {host, dev};
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(Pool(*r, Tier::kHost).size(), 1u);
  const RankedAction& a = Pool(*r, Tier::kHost)[0];
  EXPECT_EQ(a.lineage_id, 1u);
  EXPECT_EQ(a.action, PressureAction::kSpillDisk);
  EXPECT_EQ(a.from, Tier::kHost);
  EXPECT_DOUBLE_EQ(a.cost, 16 * 4e-3 / 1000);
  ASSERT_EQ(Pool(*r, Tier::kDevice).size(), 1u);
  EXPECT_EQ(Pool(*r, Tier::kDevice)[0].action, PressureAction::kSpillHost);

  // Without a disk tier, a host block can only be evicted; a device block
  // spills to disk when only the disk tier is present.
  in.workers[0].capacity[kDisk] = 0;
  r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(Pool(*r, Tier::kHost).size(), 1u);
  EXPECT_EQ(Pool(*r, Tier::kHost)[0].action, PressureAction::kEvict);
  in.workers[0].capacity[kDisk] = 1 << 20;
  in.workers[0].capacity[kHost] = 0;
  in.blocks = {dev};
  r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(Pool(*r, Tier::kDevice)[0].action, PressureAction::kSpillDisk);
  // The other modes evict host blocks from the host pool.
  in.blocks = {host};
  r = Rank(in, Mode(PressureMode::kLru));
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(Pool(*r, Tier::kHost).size(), 1u);
  EXPECT_EQ(Pool(*r, Tier::kHost)[0].action, PressureAction::kEvict);
}

TEST(RankTest, PoolsPerWorker) {
  PressureInput in = BaseInput();
  in.workers.push_back(in.workers[0]);
  SequenceView s1;
  s1.worker = 1;
  in.sequences.push_back(s1);
  in.blocks = {Block(1, 0), Block(2, 1), Block(3, 1)};
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(r->pools.size(), 2u);
  EXPECT_EQ(r->pools[0].size(), static_cast<size_t>(kNumTiers));
  EXPECT_THAT(Lineages(Pool(*r, Tier::kDevice, 0)), ElementsAre(1u));
  EXPECT_THAT(Lineages(Pool(*r, Tier::kDevice, 1)), ElementsAre(2u, 3u));
  EXPECT_EQ(Pool(*r, Tier::kDevice, 1)[1].sequence, 1u);
  EXPECT_EQ(r->built_ms, kNow);
  EXPECT_GE(r->ranking_ms, 0);
}

TEST(RankTest, CostsEqualAsFloatsAreOrderedExactly) {
  // The two costs round to the same float but differ as doubles: the
  // cheaper one (higher lineage) must still come first.
  PressureInput in = BaseInput();
  BlockView a = Block(1, 0, Role::kUser, -1);
  a.importance = 1e-12;
  BlockView b = Block(2, 0, Role::kUser, -1);
  in.blocks = {a, b};
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  const auto& pool = Pool(*r, Tier::kDevice);
  ASSERT_EQ(pool.size(), 2u);
  ASSERT_EQ(static_cast<float>(pool[0].cost), static_cast<float>(pool[1].cost));
  EXPECT_THAT(Lineages(pool), ElementsAre(2u, 1u));
  EXPECT_LT(pool[0].cost, pool[1].cost);
}

TEST(RankTest, ExplicitEvictDistortionOverridesTheFactor) {
  PressureInput in = BaseInput();
  in.option_sets[0].evict_distortion = 0.05;
  in.option_sets[0].options.resize(1);  // BF16 only: no demotion
  in.blocks = {Block(1)};
  auto r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  EXPECT_DOUBLE_EQ(Pool(*r, Tier::kDevice)[0].cost, 16 * 0.05 / 1000);
  in.option_sets[0].evict_distortion = 0;  // max D is 0 -> the default
  r = Rank(in, RankerOptions{});
  ASSERT_THAT(r, IsOk());
  EXPECT_DOUBLE_EQ(Pool(*r, Tier::kDevice)[0].cost, 16 * 1.0 / 1000);
}

// --- Bad input ---------------------------------------------------------------

TEST(RankTest, RejectsOutOfRangeIndices) {
  {
    PressureInput in = BaseInput();
    in.blocks = {Block(1), Block(2, /*sequence=*/7)};
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("blocks[1].sequence = 7")));
  }
  {
    PressureInput in = BaseInput();
    in.blocks = {Block(1, 0, Role::kUser, 3)};
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("blocks[0].option_set = 3")));
    in.blocks[0].option_set = -2;
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("blocks[0].option_set = -2")));
  }
  {
    PressureInput in = BaseInput();
    in.sequences[0].tenant = 4;
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("sequences[0].tenant = 4")));
  }
  {
    PressureInput in = BaseInput();
    in.sequences[0].worker = 2;
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("sequences[0].worker = 2")));
  }
  {
    PressureInput in = BaseInput();
    in.blocks = {Block(1)};
    in.blocks[0].tier = Tier::kUnspecified;
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("blocks[0].tier = 0")));
  }
  {
    PressureInput in = BaseInput();
    in.blocks = {Block(1)};
    in.blocks[0].importance = std::numeric_limits<double>::quiet_NaN();
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("blocks[0].importance")));
    in.blocks[0].importance = 0;
    in.option_sets[0].options[2].distortion = -1;
    EXPECT_THAT(Rank(in, RankerOptions{}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("option_sets[0].options[2].distortion")));
  }
}

TEST(RankTest, RejectsBadOptions) {
  PressureInput in = BaseInput();
  RankerOptions o;
  o.reuse_half_life_ms = 0;
  EXPECT_THAT(Rank(in, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("reuse_half_life_ms = 0")));
  o = RankerOptions{};
  o.spill_disk_penalty = -1;
  EXPECT_THAT(Rank(in, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("spill_disk_penalty = -1")));
  o = RankerOptions{};
  o.mode = static_cast<PressureMode>(9);
  EXPECT_THAT(Rank(in, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("mode = 9")));
}

// --- SelectReclaim -----------------------------------------------------------

TEST(SelectReclaimTest, TakesTheShortestPrefixAndHonoursSkip) {
  Ranking r;
  r.pools.assign(1, std::vector<std::vector<RankedAction>>(kNumTiers));
  for (uint64_t id = 1; id <= 5; ++id) {
    RankedAction a;
    a.lineage_id = id;
    a.bytes_freed = 100 * id;  // 100, 200, ..., 500
    r.pools[0][kDev].push_back(a);
  }
  auto none = [](const RankedAction&) { return false; };
  EXPECT_THAT(Lineages(SelectReclaim(r, 0, Tier::kDevice, 300, none)),
              ElementsAre(1u, 2u));
  EXPECT_THAT(Lineages(SelectReclaim(r, 0, Tier::kDevice, 301, none)),
              ElementsAre(1u, 2u, 3u));
  EXPECT_THAT(SelectReclaim(r, 0, Tier::kDevice, 0, none), IsEmpty());
  auto skip_even = [](const RankedAction& a) { return a.lineage_id % 2 == 0; };
  EXPECT_THAT(Lineages(SelectReclaim(r, 0, Tier::kDevice, 400, skip_even)),
              ElementsAre(1u, 3u));
  // Not enough: everything not skipped, the caller reports the shortfall.
  EXPECT_THAT(Lineages(SelectReclaim(r, 0, Tier::kDevice, 10'000, skip_even)),
              ElementsAre(1u, 3u, 5u));
  EXPECT_THAT(SelectReclaim(r, 1, Tier::kDevice, 100, none), IsEmpty());
  EXPECT_THAT(SelectReclaim(r, 0, Tier::kHost, 100, none), IsEmpty());
}

TEST(WatermarksTest, ValidatesAndComputesTheTarget) {
  EXPECT_THAT(ValidateWatermarks(Watermarks{}), IsOk());
  EXPECT_THAT(
      ValidateWatermarks(Watermarks{0.7, 0.8}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("high = 0.7")));
  EXPECT_THAT(
      ValidateWatermarks(Watermarks{0.9, 0}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("low = 0")));
  EXPECT_EQ(ReclaimTarget(Watermarks{}, 1000, 900), 0u);  // not above high
  EXPECT_EQ(ReclaimTarget(Watermarks{}, 1000, 950), 150u);
  EXPECT_EQ(ReclaimTarget(Watermarks{}, 0, 950), 0u);
}

// --- Randomized ordering check -----------------------------------------------

// Reference scoring of one block: every allowed (raw cost per byte, freed,
// action order) in the order the ranker considers them.
struct RefChoice {
  bool any = false;
  double raw = 0;
  uint64_t freed = 0;
  PressureAction action = PressureAction::kUnspecified;
};

RefChoice ReferenceChoice(const PressureInput& in, const RankerOptions& o,
                          const BlockView& b) {
  RefChoice best;
  const SequenceView& s = in.sequences[b.sequence];
  const WorkerView& w = in.workers[s.worker];
  auto take = [&](double raw, uint64_t freed, PressureAction a) {
    if (!best.any || raw < best.raw ||
        (raw == best.raw && freed > best.freed)) {
      best = RefChoice{true, raw, freed, a};
    }
  };
  const bool prot =
      std::find(o.protected_roles.begin(), o.protected_roles.end(),
                b.tag.role) != o.protected_roles.end();
  if (o.mode == PressureMode::kDemoteFirst) {
    if (b.tier == Tier::kDevice && b.option_set >= 0) {
      for (const DemoteOption& opt : in.option_sets[b.option_set].options) {
        if (opt.bytes >= b.bytes) continue;
        take(b.tokens * std::max(0.0, opt.distortion - b.distortion) /
                 (b.bytes - opt.bytes),
             b.bytes - opt.bytes, PressureAction::kDemote);
      }
    }
    const double idle = std::max<int64_t>(
        0, in.now_ms - std::max(b.last_access_ms, s.last_access_ms));
    const double reuse = std::exp2(-idle / o.reuse_half_life_ms);
    if (b.tier == Tier::kDevice && w.capacity[kHost] > 0 &&
        w.capacity[kHost] >= w.used[kHost] + b.bytes) {
      take(b.tokens * o.spill_host_penalty * reuse / b.bytes, b.bytes,
           PressureAction::kSpillHost);
    }
    if (w.capacity[kDisk] > 0 && w.capacity[kDisk] >= w.used[kDisk] + b.bytes) {
      take(b.tokens * o.spill_disk_penalty * reuse / b.bytes, b.bytes,
           PressureAction::kSpillDisk);
    }
  }
  if (!prot) {
    double ev = o.default_evict_distortion;
    if (b.option_set >= 0) {
      const OptionSet& set = in.option_sets[b.option_set];
      double max_d = 0;
      for (const DemoteOption& opt : set.options) {
        max_d = std::max(max_d, opt.distortion);
      }
      ev = set.evict_distortion > 0 ? set.evict_distortion
           : max_d > 0              ? o.evict_factor * max_d
                                    : o.default_evict_distortion;
    }
    take(b.tokens * ev / b.bytes, b.bytes, PressureAction::kEvict);
  }
  return best;
}

PressureInput RandomInput(uint32_t seed, size_t n_blocks) {
  std::mt19937_64 rng(seed);
  auto uni = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  auto pick = [&](uint64_t n) {
    return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng);
  };
  PressureInput in;
  in.now_ms = kNow;
  for (int s = 0; s < 6; ++s) {
    OptionSet set;
    uint64_t bytes = 2000;
    double d = 0;
    for (int k = 0; k < 7; ++k) {
      set.options.push_back({Format::kINT4, bytes, d});
      bytes = bytes * 3 / 4;
      d += k == 2 ? 0 : uni(0, 0.05);  // one free step
    }
    set.evict_distortion = s % 2 ? uni(0.1, 1) : 0;
    in.option_sets.push_back(set);
  }
  for (int w = 0; w < 2; ++w) {
    WorkerView wv;
    wv.capacity[kDev] = 1ull << 32;
    wv.capacity[kHost] = w == 0 ? 1ull << 30 : 0;
    wv.capacity[kDisk] = 1ull << 31;
    in.workers.push_back(wv);
  }
  for (int t = 0; t < 5; ++t) {
    TenantView tv;
    tv.floor[kDev] = 1'000'000;
    tv.used[kDev] = t < 2 ? 3'000'000 : 500'000;
    tv.floor[kHost] = t == 4 ? 0 : 100'000;
    tv.used[kHost] = t == 3 ? 0 : 200'000;
    in.tenants.push_back(tv);
  }
  for (int s = 0; s < 60; ++s) {
    SequenceView sv;
    sv.tenant = static_cast<uint32_t>(pick(5));
    sv.worker = static_cast<uint32_t>(pick(2));
    sv.last_access_ms = kNow - static_cast<int64_t>(pick(4)) * 20'000;
    in.sequences.push_back(sv);
  }
  std::vector<uint64_t> lineages(n_blocks);
  for (size_t i = 0; i < n_blocks; ++i) lineages[i] = 1000 + 3 * i;
  std::shuffle(lineages.begin(), lineages.end(), rng);
  for (size_t i = 0; i < n_blocks; ++i) {
    BlockView b;
    b.lineage_id = lineages[i];
    b.sequence = static_cast<uint32_t>(pick(60));
    b.tag.role = static_cast<Role>(1 + pick(8));
    const uint64_t tier = pick(10);
    b.tier = tier < 7 ? Tier::kDevice : tier < 9 ? Tier::kHost : Tier::kDisk;
    b.tokens = static_cast<uint32_t>(1 + pick(16));
    b.refcount = pick(20) == 0 ? 2 : 1;
    b.sealed = pick(20) != 0;
    b.option_set = pick(8) == 0 ? -1 : static_cast<int32_t>(pick(6));
    if (b.option_set >= 0) {
      const auto& opts = in.option_sets[b.option_set].options;
      const size_t k = pick(3);
      b.bytes = opts[k].bytes;
      b.distortion = opts[k].distortion;
    } else {
      b.bytes = 1000 + pick(1000);
    }
    // Many exact ties: a few importance and access-time levels.
    b.importance = static_cast<double>(pick(4)) * 0.5;
    b.last_access_ms = kNow - static_cast<int64_t>(pick(5)) * 10'000;
    in.blocks.push_back(b);
  }
  return in;
}

bool Eligible(const BlockView& b) {
  return b.refcount <= 1 && b.sealed && b.bytes > 0 && b.tier != Tier::kDisk;
}

TEST(RankRandomTest, PoolsAreSortedAndHoldEachBlockOnce) {
  // 20000 blocks: pools of several thousand take the radix path, and the
  // shuffled lineages with many equal costs exercise the run fix-up.
  const uint32_t seed = 20261122;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const PressureInput in = RandomInput(seed, 20'000);
  for (PressureMode m : kAllModes) {
    SCOPED_TRACE(PressureModeName(m));
    const RankerOptions o = Mode(m);
    auto r = Rank(in, o);
    ASSERT_THAT(r, IsOk());
    ASSERT_EQ(r->pools.size(), in.workers.size());
    std::set<uint64_t> seen;
    size_t expected = 0;
    for (const BlockView& b : in.blocks) {
      if (!Eligible(b)) continue;
      if (ReferenceChoice(in, o, b).any) ++expected;
    }
    size_t total = 0;
    bool radix_sized = false;
    for (uint32_t w = 0; w < r->pools.size(); ++w) {
      for (int t = 0; t < kNumTiers; ++t) {
        const auto& pool = r->pools[w][t];
        if (t != kDev && t != kHost) {
          EXPECT_THAT(pool, IsEmpty());
        }
        radix_sized |= pool.size() >= 2048;
        total += pool.size();
        for (size_t i = 0; i < pool.size(); ++i) {
          const RankedAction& a = pool[i];
          ASSERT_TRUE(seen.insert(a.lineage_id).second) << a.lineage_id;
          const BlockView& b = in.blocks[a.block];
          ASSERT_EQ(b.lineage_id, a.lineage_id);
          ASSERT_TRUE(Eligible(b));
          ASSERT_EQ(a.sequence, b.sequence);
          ASSERT_EQ(in.sequences[b.sequence].worker, w);
          ASSERT_EQ(static_cast<int>(a.from), t);
          ASSERT_EQ(static_cast<int>(b.tier), t);
          const TenantView& tv = in.tenants[in.sequences[b.sequence].tenant];
          ASSERT_EQ(a.above_floor, tv.used[t] > tv.floor[t]);
          // The block's own action is the reference's choice.
          if (m != PressureMode::kLru) {
            const RefChoice ref = ReferenceChoice(in, o, b);
            ASSERT_TRUE(ref.any);
            EXPECT_EQ(a.action, ref.action) << a.lineage_id;
            EXPECT_EQ(a.bytes_freed, ref.freed) << a.lineage_id;
            double div = 1;
            if (a.above_floor && tv.floor[t] > 0) {
              div = 1 +
                    static_cast<double>(tv.used[t] - tv.floor[t]) / tv.floor[t];
            }
            EXPECT_NEAR(a.cost, ref.raw * (1 + b.importance) / div,
                        1e-12 * (1 + a.cost))
                << a.lineage_id;
          } else {
            EXPECT_EQ(a.action, PressureAction::kEvict);
          }
          if (i == 0) continue;
          const RankedAction& p = pool[i - 1];
          // (above_floor desc, key asc, lineage asc); kLru: age desc.
          ASSERT_GE(p.above_floor, a.above_floor);
          if (p.above_floor != a.above_floor) continue;
          if (m == PressureMode::kLru) {
            ASSERT_GE(p.cost, a.cost);
          } else {
            ASSERT_LE(p.cost, a.cost);
          }
          if (p.cost == a.cost) {
            ASSERT_LT(p.lineage_id, a.lineage_id);
          }
        }
      }
    }
    EXPECT_EQ(total, expected);
    EXPECT_TRUE(radix_sized);
  }
}

TEST(RankRandomTest, ScratchReuseGivesTheSameRanking) {
  RankScratch scratch;
  for (size_t n : {5000u, 300u, 9000u}) {
    const PressureInput in = RandomInput(7 + static_cast<uint32_t>(n), n);
    for (PressureMode m : kAllModes) {
      auto fresh = Rank(in, Mode(m));
      auto reused = Rank(in, Mode(m), &scratch);
      ASSERT_THAT(fresh, IsOk());
      ASSERT_THAT(reused, IsOk());
      ASSERT_EQ(fresh->pools.size(), reused->pools.size());
      for (size_t w = 0; w < fresh->pools.size(); ++w) {
        for (int t = 0; t < kNumTiers; ++t) {
          EXPECT_EQ(Lineages(fresh->pools[w][t]),
                    Lineages(reused->pools[w][t]));
        }
      }
    }
  }
}

// Every field of every RankedAction, bit for bit (costs compared as bits).
void ExpectSameRanking(const Ranking& a, const Ranking& b) {
  ASSERT_EQ(a.pools.size(), b.pools.size());
  ASSERT_EQ(a.blocks, b.blocks);
  for (size_t w = 0; w < a.pools.size(); ++w) {
    ASSERT_EQ(a.pools[w].size(), b.pools[w].size());
    for (size_t t = 0; t < a.pools[w].size(); ++t) {
      const auto& pa = a.pools[w][t];
      const auto& pb = b.pools[w][t];
      ASSERT_EQ(pa.size(), pb.size()) << "pool " << w << "/" << t;
      for (size_t i = 0; i < pa.size(); ++i) {
        SCOPED_TRACE(::testing::Message()
                     << "pool " << w << "/" << t << " position " << i);
        const RankedAction& x = pa[i];
        const RankedAction& y = pb[i];
        ASSERT_EQ(x.lineage_id, y.lineage_id);
        ASSERT_EQ(x.block, y.block);
        ASSERT_EQ(x.sequence, y.sequence);
        ASSERT_EQ(x.action, y.action);
        ASSERT_TRUE(x.encoding == y.encoding);
        ASSERT_EQ(x.from, y.from);
        ASSERT_EQ(x.bytes_freed, y.bytes_freed);
        uint64_t cx, cy;
        std::memcpy(&cx, &x.cost, sizeof(cx));
        std::memcpy(&cy, &y.cost, sizeof(cy));
        ASSERT_EQ(cx, cy);
        ASSERT_EQ(x.above_floor, y.above_floor);
      }
    }
  }
}

TEST(RankRandomTest, ThreadsGiveTheSameRankingAsOneThread) {
  // parallel_min_blocks = 0 forces the parallel path on small inputs: the
  // block ranges split mid-sequence and the pools spread over the threads.
  RankScratch scratch;
  for (size_t n : {20'000u, 7u, 1u, 0u}) {
    const PressureInput in = RandomInput(31 + static_cast<uint32_t>(n), n);
    for (PressureMode m : kAllModes) {
      SCOPED_TRACE(::testing::Message()
                   << PressureModeName(m) << " blocks " << n);
      RankerOptions one = Mode(m);
      one.threads = 1;
      auto ref = Rank(in, one);
      ASSERT_THAT(ref, IsOk());
      for (int threads : {2, 3}) {
        SCOPED_TRACE(::testing::Message() << "threads " << threads);
        RankerOptions o = Mode(m);
        o.threads = threads;
        o.parallel_min_blocks = 0;
        auto got = Rank(in, o, &scratch);
        ASSERT_THAT(got, IsOk());
        ExpectSameRanking(*ref, *got);
      }
    }
  }
}

TEST(RankRandomTest, ThreadsReportTheFirstBadBlock) {
  PressureInput in = RandomInput(5, 1000);
  in.blocks[900].sequence = 99;    // in the second half
  in.blocks[700].importance = -1;  // in the second half, earlier
  RankerOptions o;
  o.parallel_min_blocks = 0;
  for (int threads : {1, 2, 3}) {
    o.threads = threads;
    EXPECT_THAT(Rank(in, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("blocks[700].importance")))
        << threads;
  }
  in.blocks[10].option_set = 6;  // in the first part
  for (int threads : {1, 2, 3}) {
    o.threads = threads;
    EXPECT_THAT(Rank(in, o), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("blocks[10].option_set")))
        << threads;
  }
}

TEST(RankTest, RejectsBadThreadCounts) {
  const PressureInput in = RandomInput(3, 10);
  for (int threads : {0, -1, kMaxRankThreads + 1}) {
    RankerOptions o;
    o.threads = threads;
    EXPECT_THAT(Rank(in, o),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("threads = ", threads))));
  }
}

}  // namespace
}  // namespace triax::manager
