// Prefix reuse under memory pressure (pressure_test_fixture.h): blocks that
// a tier plan spills or evicts leave the prefix index, so a later Open only
// reuses the blocks before the first of them.
#include <numeric>
#include <string>
#include <vector>

#include "kvmanager/pressure_test_fixture.h"

namespace triax::manager {
namespace {

using ::triax::testing::IsOk;

class PrefixPressureTest : public PressureFixture {
 protected:
  // "system 16 + user 128" (9 full blocks) with token ids 1..144.
  absl::StatusOr<SequenceInfo> OpenIds(const std::string& tenant) {
    OpenSequenceRequest req;
    req.tenant_id = tenant;
    req.model = Model();
    req.spans = {Span{Role::kSystem, Modality::kText, 16},
                 Span{Role::kUser, Modality::kText, 128}};
    req.token_ids.resize(144);
    std::iota(req.token_ids.begin(), req.token_ids.end(), 1u);
    return core_->OpenSequence(req);
  }
  void Finish(const TierPlan& plan) {
    ASSERT_NE(plan.token, 0u);
    std::vector<absl::Status> ok(plan.commands.size());
    ASSERT_THAT(core_->FinishTierPlan(plan.token, ok), IsOk());
  }
  uint64_t Indexed() { return core_->GetPressure(0).prefix_index_blocks; }
  // Index of the first block of `seq` in the pool that is not on the device
  // or evicted (its size when none).
  uint32_t FirstGone(const std::string& seq) {
    auto s = core_->GetSequence("", seq);
    EXPECT_THAT(s, IsOk());
    uint32_t i = 0;
    while (i < s->blocks.size() && s->blocks[i].tier == Tier::kDevice &&
           !s->blocks[i].evicted) {
      ++i;
    }
    return i;
  }
};

TEST_F(PrefixPressureTest, SpilledBlocksLeaveTheIndex) {
  ManagerOptions options;
  options.resume_reserve = false;
  Make(options, 28, /*host_blocks=*/64);
  Tenant("t");
  ASSERT_THAT(OpenIds("t"), IsOk());  // seq-1: goes idle
  EXPECT_EQ(Indexed(), 9u);
  clock_.AdvanceMs(int64_t{10} * 60 * 1000);
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  size_t spilled = 0;
  for (const TierCommand& c : plan.commands) {
    if (c.kind == TierCommand::Kind::kSpill && c.sequence_id == "seq-1") {
      spilled += c.blocks.size();
    }
  }
  ASSERT_GT(spilled, 0u);
  Finish(plan);
  EXPECT_EQ(Indexed(), 9u - spilled);
  const uint32_t usable = FirstGone("seq-1");
  // Room for the next Open (the others hold no hashed blocks).
  ASSERT_THAT(core_->CloseSequence({"", "t", "seq-2"}), IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "t", "seq-3"}), IsOk());
  EXPECT_EQ(Indexed(), 9u - spilled);
  auto b = OpenIds("t");
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, usable);
}

TEST_F(PrefixPressureTest, EvictedBlocksLeaveTheIndex) {
  ManagerOptions options;
  options.ranker.mode = PressureMode::kGraphEvict;
  Make(options, 28);
  Tenant("t");
  ASSERT_THAT(OpenIds("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  ASSERT_THAT(Open("t"), IsOk());
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  size_t evicted = 0;
  for (const TierCommand& c : plan.commands) {
    if (c.kind == TierCommand::Kind::kEvict && c.sequence_id == "seq-1") {
      evicted += c.blocks.size();
    }
  }
  ASSERT_GT(evicted, 0u);
  Finish(plan);
  EXPECT_EQ(Indexed(), 9u - evicted);
  // graph-evict keeps system blocks: block 0 stays reusable.
  const uint32_t usable = FirstGone("seq-1");
  ASSERT_GT(usable, 0u);
  ASSERT_LT(usable, 9u);
  ASSERT_THAT(core_->CloseSequence({"", "t", "seq-2"}), IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "t", "seq-3"}), IsOk());
  auto b = OpenIds("t");
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, usable);
  // Closing everything empties the index.
  ASSERT_THAT(core_->CloseSequence({"", "t", "seq-1"}), IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "t", b->sequence_id}), IsOk());
  EXPECT_EQ(Indexed(), 0u);
}

}  // namespace
}  // namespace triax::manager
