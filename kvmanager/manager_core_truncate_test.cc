// ManagerCore::TruncateSequence: undoing an Extend exactly (blocks, bytes,
// turns, temporal tags, worker reservation), cutting a block, forks, the
// idempotency cache, and bad input.
#include <cstdint>
#include <string>
#include <vector>

#include "kvmanager/manager_core_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

struct BlockView {
  uint64_t lineage_id;
  uint64_t first_token;
  uint32_t num_tokens;
  Temporal temporal;
  Role role;
  bool operator==(const BlockView& o) const {
    return lineage_id == o.lineage_id && first_token == o.first_token &&
           num_tokens == o.num_tokens && temporal == o.temporal &&
           role == o.role;
  }
};

std::vector<BlockView> Blocks(const SequenceInfo& s) {
  std::vector<BlockView> out;
  for (const BlockPlan& b : s.blocks) {
    out.push_back({b.lineage_id, b.first_token, b.num_tokens, b.tag.temporal,
                   b.tag.role});
  }
  return out;
}

class TruncateTest : public CoreTest {
 protected:
  absl::StatusOr<TruncateSequenceResult> Truncate(
      const std::string& seq, uint64_t num_tokens, const std::string& id = "",
      const std::string& tenant = "acme") {
    return core_->TruncateSequence({id, tenant, seq, num_tokens});
  }
  uint64_t WorkerReserved() {
    std::vector<WorkerInfo> w = core_->ListWorkers();
    EXPECT_EQ(w.size(), 1u);
    return w.empty() ? 0 : w[0].reserved_bytes;
  }
};

TEST_F(TruncateTest, UndoesAnExtendExactly) {
  // Given a sequence three turns in (so that turn 0 has aged),
  auto s = Open({S(Role::kSystem, 20), S(Role::kUser, 10)});
  ASSERT_THAT(s, IsOk());
  for (int turn = 1; turn <= 3; ++turn) {
    ASSERT_THAT(Extend(s->sequence_id,
                       {S(Role::kAssistant, 12), S(Role::kUser, 9)}, true),
                IsOk());
  }
  auto before = core_->GetSequence("acme", s->sequence_id);
  ASSERT_THAT(before, IsOk());
  const uint64_t usage = DeviceUsage();
  const uint64_t reserved = WorkerReserved();
  // When a fourth turn is planned (retagging the earlier ones) and undone,
  auto ext = Extend(s->sequence_id, {S(Role::kAssistant, 40)}, true);
  ASSERT_THAT(ext, IsOk());
  ASSERT_EQ(ext->new_blocks.size(), 3u);
  ASSERT_FALSE(ext->retagged_blocks.empty());
  EXPECT_GT(DeviceUsage(), usage);
  auto t = Truncate(s->sequence_id, before->num_tokens);
  ASSERT_THAT(t, IsOk());
  // Expect the plan exactly as before the Extend, its bytes returned,
  EXPECT_EQ(Blocks(t->sequence), Blocks(*before));
  EXPECT_EQ(t->sequence.num_tokens, before->num_tokens);
  EXPECT_EQ(t->sequence.turns, before->turns);
  EXPECT_EQ(t->sequence.bytes, before->bytes);
  EXPECT_EQ(DeviceUsage(), usage);
  EXPECT_EQ(WorkerReserved(), reserved);
  std::vector<uint64_t> added;
  for (const BlockPlan& b : ext->new_blocks) added.push_back(b.lineage_id);
  EXPECT_EQ(t->released_lineage_ids, added);
  EXPECT_EQ(t->freed_lineage_ids, added);
  EXPECT_EQ(CountKind(EventKind::kSequenceTruncated), 1u);
  EXPECT_EQ(CountKind(EventKind::kBlockFreed), 3u);
  // and the same Extend again planning the same layout (new lineages).
  auto again = Extend(s->sequence_id, {S(Role::kAssistant, 40)}, true);
  ASSERT_THAT(again, IsOk());
  ASSERT_EQ(again->new_blocks.size(), 3u);
  EXPECT_EQ(again->sequence.turns, ext->sequence.turns);
  EXPECT_EQ(Temporals(again->sequence), Temporals(ext->sequence));
  EXPECT_GT(again->new_blocks[0].lineage_id, added.back());
}

TEST_F(TruncateTest, UndoesAGrownLastBlockWithinATurn) {
  // Given 20 user tokens (16 | 4) grown by 6 decoded tokens (16 | 10),
  auto s = Open({S(Role::kUser, 20)});
  ASSERT_THAT(s, IsOk());
  auto grown = Extend(s->sequence_id, {S(Role::kUser, 6)}, false, true);
  ASSERT_THAT(grown, IsOk());
  ASSERT_EQ(grown->grown_blocks.size(), 1u);
  const uint64_t usage = DeviceUsage();
  // When truncated back to 20 tokens,
  auto t = Truncate(s->sequence_id, 20);
  ASSERT_THAT(t, IsOk());
  // Expect the last block back at 4 tokens, nothing released or refunded.
  EXPECT_EQ(Blocks(t->sequence), Blocks(*s));
  EXPECT_THAT(t->released_lineage_ids, IsEmpty());
  EXPECT_EQ(DeviceUsage(), usage);
}

TEST_F(TruncateTest, CutsInsideABlockAndDropsLaterTurns) {
  // Given turn 0 of 20 user tokens and turn 1 of 30 assistant tokens,
  auto s = Open({S(Role::kUser, 20)});
  ASSERT_THAT(s, IsOk());
  ASSERT_THAT(Extend(s->sequence_id, {S(Role::kAssistant, 30)}, true), IsOk());
  // When cut at token 10 (inside block 0),
  auto t = Truncate(s->sequence_id, 10);
  ASSERT_THAT(t, IsOk());
  // Expect one block of 10 tokens, back in turn 0 and current again.
  ASSERT_EQ(t->sequence.blocks.size(), 1u);
  EXPECT_EQ(t->sequence.blocks[0].num_tokens, 10u);
  EXPECT_EQ(t->sequence.num_tokens, 10u);
  EXPECT_EQ(t->sequence.turns, 1u);
  EXPECT_EQ(t->sequence.blocks[0].tag.temporal, s->blocks[0].tag.temporal);
  EXPECT_EQ(t->released_lineage_ids.size(), 3u);
  EXPECT_EQ(DeviceUsage(), kBf16);
}

TEST_F(TruncateTest, ReleasesSharedBlocksWithoutFreeingThem) {
  // Given a parent of 40 tokens (16 | 16 | 8) and a fork sharing all of it,
  auto parent = Open({S(Role::kUser, 40)});
  ASSERT_THAT(parent, IsOk());
  auto child = core_->ForkSequence({"", "acme", parent->sequence_id, 0});
  ASSERT_THAT(child, IsOk());
  // a cut inside a shared block is refused and changes nothing;
  EXPECT_THAT(Truncate(parent->sequence_id, 20),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shared with a fork (2 sequences)")));
  // truncating at a block boundary releases the parent's references only.
  auto t = Truncate(parent->sequence_id, 16);
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(t->released_lineage_ids, ElementsAre(2, 3));
  EXPECT_THAT(t->freed_lineage_ids, IsEmpty());
  EXPECT_EQ(DeviceUsage(), 3 * kBf16);
  auto c = core_->GetSequence("acme", child->sequence_id);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->blocks.size(), 3u);
  EXPECT_EQ(c->blocks[1].refcount, 1u);
  // Closing the child then frees the blocks only it held.
  auto closed = core_->CloseSequence({"", "acme", child->sequence_id});
  ASSERT_THAT(closed, IsOk());
  EXPECT_THAT(closed->freed_lineage_ids, ElementsAre(2, 3));
  EXPECT_EQ(DeviceUsage(), kBf16);
}

TEST_F(TruncateTest, IdempotentByRequestIdAndNoOpAtTheSameLength) {
  auto s = Open({S(Role::kUser, 40)});
  ASSERT_THAT(s, IsOk());
  auto same = Truncate(s->sequence_id, 40);
  ASSERT_THAT(same, IsOk());
  EXPECT_EQ(Blocks(same->sequence), Blocks(*s));
  EXPECT_EQ(CountKind(EventKind::kSequenceTruncated), 0u);
  auto first = Truncate(s->sequence_id, 16, "req-1");
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(Extend(s->sequence_id, {S(Role::kUser, 30)}, false), IsOk());
  // The retry answers the first reply and does not cut the new tokens.
  auto retry = Truncate(s->sequence_id, 16, "req-1");
  ASSERT_THAT(retry, IsOk());
  EXPECT_EQ(retry->released_lineage_ids, first->released_lineage_ids);
  auto now = core_->GetSequence("acme", s->sequence_id);
  ASSERT_THAT(now, IsOk());
  EXPECT_EQ(now->num_tokens, 46u);
}

TEST_F(TruncateTest, BadInputNamesTheFieldAndChangesNothing) {
  auto s = Open({S(Role::kUser, 40)});
  ASSERT_THAT(s, IsOk());
  ASSERT_THAT(core_->CreateTenant({"", "other", {}, ""}), IsOk());
  EXPECT_THAT(Truncate(s->sequence_id, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_tokens is 0")));
  EXPECT_THAT(Truncate(s->sequence_id, 41),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_tokens 41 exceeds the 40 tokens")));
  EXPECT_THAT(Truncate("seq-999", 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("seq-999")));
  EXPECT_THAT(Truncate(s->sequence_id, 1, "", "other"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("belongs to another tenant")));
  EXPECT_THAT(
      Truncate(s->sequence_id, 1, "bad id with spaces"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("request_id")));
  auto now = core_->GetSequence("acme", s->sequence_id);
  ASSERT_THAT(now, IsOk());
  EXPECT_EQ(Blocks(*now), Blocks(*s));
  ASSERT_THAT(core_->CloseSequence({"", "acme", s->sequence_id}), IsOk());
  EXPECT_THAT(
      Truncate(s->sequence_id, 1),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is closed")));
}

}  // namespace
}  // namespace triax::manager
