// SequenceTable (sequence_table.h) through its own interface: ids, block
// creation and charging, sharing and release (ownership passing to a fork,
// bytes returned per tier), lookups with their errors, retirement and
// closed retention, listing. Records from manager_parts_testing.h.
#include "kvmanager/sequence_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "kvmanager/manager_parts_testing.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);
constexpr uint64_t kBf16 = 16384;

std::vector<std::string> Ids(const std::vector<SequenceInfo>& list) {
  std::vector<std::string> out;
  out.reserve(list.size());
  for (const SequenceInfo& s : list) out.push_back(s.sequence_id);
  return out;
}

// A fork of `parent` sharing its first `n` blocks, as ManagerCore does it.
SequenceRecord* Fork(PartsWorld* w, SequenceRecord* parent, size_t n) {
  auto seq = std::make_unique<SequenceRecord>(*parent);
  SequenceRecord* s = seq.get();
  s->id = w->sequences.NewId();
  s->parent = parent->id;
  s->blocks.clear();
  s->bytes = 0;
  for (size_t i = 0; i < n; ++i) SequenceTable::Share(s, parent->blocks[i]);
  s->tenant->open_sequences++;
  s->worker->open.insert(s);
  return w->sequences.Insert(std::move(seq));
}

TEST(SequenceTableTest, NewBlocksAreDenseAndCharged) {
  PartsWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* a = w.AddSequence(t, wk, {Role::kSystem, Role::kUser});
  SequenceRecord* b = w.AddSequence(t, wk, {Role::kUser});
  EXPECT_EQ(a->id, "seq-1");
  EXPECT_EQ(b->id, "seq-2");
  ASSERT_EQ(a->blocks.size(), 2u);
  EXPECT_EQ(a->blocks[0]->lineage_id, 1u);
  EXPECT_EQ(a->blocks[1]->lineage_id, 2u);
  EXPECT_EQ(b->blocks[0]->lineage_id, 3u);
  EXPECT_EQ(a->blocks[1]->index, 1u);
  EXPECT_EQ(a->blocks[1]->first_token, 16u);
  EXPECT_EQ(a->blocks[1]->capacity, 16u);
  EXPECT_EQ(a->blocks[1]->refcount, 1u);
  EXPECT_EQ(a->blocks[1]->owner, a);
  EXPECT_EQ(a->blocks[1]->creator, "seq-1");
  EXPECT_EQ(a->bytes, 2 * kBf16);
  EXPECT_EQ(t->used[kDev], 3 * kBf16);
  EXPECT_EQ(wk->reserved, 3 * kBf16);
  EXPECT_EQ(w.sequences.num_blocks(), 3u);
  EXPECT_EQ(w.sequences.FindBlock(3), b->blocks[0]);
  EXPECT_EQ(w.sequences.FindBlock(4), nullptr);
  EXPECT_EQ(w.sequences.BlockOf(*a, 2), a->blocks[1]);
  EXPECT_EQ(w.sequences.BlockOf(*a, 3), nullptr);  // b's
  EXPECT_EQ(w.sequences.BlockOf(*a, 99), nullptr);
  EXPECT_EQ(SequenceTable::Owner(*a->blocks[0]), a);
}

TEST(SequenceTableTest, SharedBlocksPassToTheForkAndAreFreedOnce) {
  PartsWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* parent = w.AddSequence(t, wk, {Role::kUser, Role::kUser});
  SequenceRecord* child = Fork(&w, parent, 1);
  BlockRecord* shared = parent->blocks[0];
  EXPECT_EQ(shared->refcount, 2u);
  EXPECT_EQ(child->bytes, kBf16);
  EXPECT_EQ(t->used[kDev], 2 * kBf16);  // charged once
  // The creator lets go first: the fork owns the block now.
  EXPECT_FALSE(SequenceTable::Unref(parent, shared));
  EXPECT_EQ(shared->owner, child);
  EXPECT_EQ(t->used[kDev], 2 * kBf16);
  // The last reference returns the bytes.
  EXPECT_TRUE(SequenceTable::Unref(child, shared));
  EXPECT_EQ(t->used[kDev], kBf16);
  EXPECT_EQ(wk->reserved, kBf16);
  w.sequences.EraseBlock(shared->lineage_id);
  EXPECT_EQ(w.sequences.FindBlock(1), nullptr);
}

TEST(SequenceTableTest, ReleaseReturnsBytesToTheBlocksTier) {
  PartsWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30, /*host=*/1 << 30);
  SequenceRecord* s =
      w.AddSequence(t, wk, {Role::kUser, Role::kUser, Role::kUser});
  PartsWorld::Spill(s, s->blocks[1], Tier::kHost);
  EXPECT_EQ(t->used[kHost], kBf16);
  EXPECT_EQ(wk->tier_used[kHost], kBf16);
  s->blocks[2]->evicted = true;  // holds nothing (as FinishTierPlan leaves it)
  t->used[kDev] -= kBf16;
  wk->reserved -= kBf16;
  for (BlockRecord* b : s->blocks) EXPECT_TRUE(SequenceTable::Unref(s, b));
  EXPECT_EQ(t->used[kDev], 0u);
  EXPECT_EQ(t->used[kHost], 0u);
  EXPECT_EQ(wk->reserved, 0u);
  EXPECT_EQ(wk->tier_used[kHost], 0u);
}

TEST(SequenceTableTest, LookupsNameTheField) {
  PartsWorld w;
  TenantRecord* t = w.AddTenant("t");
  TenantRecord* other = w.AddTenant("other");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* s = w.AddSequence(t, wk, {Role::kUser});
  auto found = w.sequences.FindOpen(*t, "sequence_id", "seq-1");
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(*found, s);
  EXPECT_THAT(w.sequences.FindOpen(*t, "parent_sequence_id", ""),
              StatusIs(C::kInvalidArgument, "parent_sequence_id is empty"));
  EXPECT_THAT(
      w.sequences.FindOpen(*t, "sequence_id", "seq-9"),
      StatusIs(C::kNotFound, "sequence_id \"seq-9\" is not a known sequence"));
  EXPECT_THAT(w.sequences.FindOpen(*other, "sequence_id", "seq-1"),
              StatusIs(C::kPermissionDenied,
                       "sequence_id \"seq-1\" belongs to another tenant, not "
                       "\"other\""));
  s->state = SequenceState::kClosed;
  EXPECT_THAT(
      w.sequences.FindOpen(*t, "sequence_id", "seq-1"),
      StatusIs(C::kFailedPrecondition, "sequence_id \"seq-1\" is closed"));
  s->state = SequenceState::kLost;
  EXPECT_THAT(w.sequences.FindOpen(*t, "sequence_id", "seq-1"),
              StatusIs(C::kFailedPrecondition,
                       "sequence_id \"seq-1\" is lost (its worker went "
                       "down)"));
  EXPECT_EQ(SequenceTable::Owner(*s->blocks[0]), nullptr);  // not open
  // Reads see any state; tenant nullptr is the operator.
  EXPECT_THAT(w.sequences.FindVisible(t, "seq-1"), IsOk());
  EXPECT_THAT(w.sequences.FindVisible(nullptr, "seq-1"), IsOk());
  EXPECT_THAT(w.sequences.FindVisible(other, "seq-1"),
              StatusIs(C::kPermissionDenied, ::testing::HasSubstr("other")));
  EXPECT_THAT(w.sequences.FindVisible(nullptr, "seq-2"),
              StatusIs(C::kNotFound, ::testing::HasSubstr("seq-2")));
}

TEST(SequenceTableTest, RetiredSequencesStayQueryableWithinRetention) {
  PartsWorld w;
  SequenceTable table(/*closed_retention=*/2);
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  std::vector<SequenceRecord*> seqs;
  for (int i = 0; i < 11; ++i) {
    auto s = std::make_unique<SequenceRecord>();
    s->id = table.NewId();
    s->tenant = t;
    s->worker = wk;
    s->policy = FindBuiltinPolicy("bf16");
    s->turn_start = {0};
    t->open_sequences++;
    wk->open.insert(s.get());
    seqs.push_back(table.Insert(std::move(s)));
  }
  // Ordered by creation: seq-2 before seq-10.
  EXPECT_THAT(Ids(table.List(nullptr, false)),
              ElementsAre("seq-1", "seq-2", "seq-3", "seq-4", "seq-5", "seq-6",
                          "seq-7", "seq-8", "seq-9", "seq-10", "seq-11"));
  for (int i = 0; i < 3; ++i) {
    seqs[i]->state = SequenceState::kClosed;
    table.Retire(seqs[i]);
  }
  EXPECT_EQ(t->open_sequences, 8u);
  EXPECT_EQ(wk->open.size(), 8u);
  EXPECT_EQ(table.Find("seq-1"), nullptr);  // the oldest left retention
  ASSERT_NE(table.Find("seq-2"), nullptr);
  EXPECT_EQ(table.Find("seq-2")->state, SequenceState::kClosed);
  EXPECT_EQ(table.List(t, true).size(), 10u);
  EXPECT_EQ(table.List(t, false).front().sequence_id, "seq-4");
  TenantRecord* other = w.AddTenant("other");
  EXPECT_TRUE(table.List(other, true).empty());
  const SequenceInfo info = SequenceTable::Info(*seqs[3], true);
  EXPECT_EQ(info.sequence_id, "seq-4");
  EXPECT_EQ(info.tenant_id, "t");
  EXPECT_EQ(info.worker_id, "w");
  EXPECT_EQ(info.turns, 1u);
  EXPECT_EQ(info.policy, "bf16");
}

}  // namespace
}  // namespace triax::manager
