// SequencePlanner (sequence_planner.h) through its own interface: span
// checks, span-aligned blocks with partial waste, temporal classes and
// retagging by turn (visiting only what changes), continuation of the last
// block, forks, encodings and allocations. Records come from
// manager_parts_testing.h; no ManagerCore, no clock reads.
#include "kvmanager/sequence_planner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/status_matchers.h"
#include "kvmanager/manager_parts_testing.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;
using T = Temporal;

Span S(Role r, uint32_t n, uint32_t turn_offset = 0,
       Modality m = Modality::kText) {
  Span s{r, m, n};
  s.turn_offset = turn_offset;
  return s;
}

std::vector<std::tuple<uint64_t, uint32_t>> Extents(
    const std::vector<PlannedBlock>& blocks) {
  std::vector<std::tuple<uint64_t, uint32_t>> out;
  out.reserve(blocks.size());
  for (const PlannedBlock& b : blocks)
    out.emplace_back(b.first_token, b.num_tokens);
  return out;
}

std::vector<Temporal> Temporals(const BlockTags& tags) {
  std::vector<Temporal> out;
  for (const auto& [tag, n] : tags) out.push_back(tag.temporal);
  return out;
}

std::vector<Temporal> Temporals(const SequenceRecord& s) {
  std::vector<Temporal> out;
  for (const BlockRecord* b : s.blocks) out.push_back(b->tag.temporal);
  return out;
}

// What ManagerCore does with an ExtendPlan, minus events and bytes checks.
void Apply(PartsWorld* w, const SequencePlanner& planner, SequenceRecord* s,
           const ExtendPlan& p, int* retagged = nullptr) {
  planner.AdvanceTurns(s, p);
  planner.ForEachRetag(*s, p.prev_turn, p.turn,
                       [&](BlockRecord* b, Temporal next) {
                         b->tag.temporal = next;
                         if (retagged != nullptr) ++*retagged;
                       });
  if (p.fill > 0) {
    BlockRecord* last = s->blocks.back();
    last->tag.temporal = planner.TemporalOf(*last, p.turn);
  }
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const PlannedBlock& pb = p.blocks[i];
    const Encoding e = SequencePlanner::EncodingOf(*s, p.tags[i].first);
    w->sequences.NewBlock(s, pb.first_token, pb.num_tokens, p.tags[i].first, e,
                          pb.turn, BlockBytes(s->model, s->block_tokens, e));
  }
}

TEST(SequencePlannerTest, SpansAreChecked) {
  using P = SequencePlanner;
  auto total = P::ValidateSpans({S(Role::kUser, 3), S(Role::kSystem, 4)});
  ASSERT_THAT(total, IsOk());
  EXPECT_EQ(*total, 7u);
  EXPECT_THAT(P::ValidateSpans({}),
              StatusIs(C::kInvalidArgument, "spans is empty"));
  EXPECT_THAT(P::ValidateSpans({S(Role::kUser, 1), S(Role::kUnspecified, 1)}),
              StatusIs(C::kInvalidArgument,
                       "spans[1].role is ROLE_UNSPECIFIED; a role is "
                       "required"));
  EXPECT_THAT(
      P::ValidateSpans({S(Role::kUser, 1, 0, static_cast<Modality>(7))}),
      StatusIs(C::kInvalidArgument, HasSubstr("spans[0].modality")));
  EXPECT_THAT(P::ValidateSpans({S(Role::kUser, 0)}),
              StatusIs(C::kInvalidArgument,
                       "spans[0].num_tokens is 0; it must be >= 1"));
  EXPECT_THAT(P::ValidateSpans({S(Role::kUser, 2, 1), S(Role::kUser, 2, 0)}),
              StatusIs(C::kInvalidArgument,
                       "spans[1].turn_offset 0 is below spans[0].turn_offset "
                       "1"));
  EXPECT_THAT(P::ValidateSpans({S(Role::kUser, 2, 3)}),
              StatusIs(C::kInvalidArgument,
                       "spans end in turn_offset 3, more than their 2 "
                       "tokens"));

  std::vector<Span> storage;
  const std::vector<Span> spans = {S(Role::kUser, 2)};
  auto own =
      P::RequestSpans(spans, std::nullopt, TurnNumbering::kOpen, &storage);
  ASSERT_THAT(own, IsOk());
  EXPECT_EQ(*own, &spans);
  RenderedText r;
  r.text = "<|im_start|>user\nhi<|im_end|>\n";
  r.chat_template = ChatTemplate::kChatML;
  EXPECT_THAT(P::RequestSpans({}, std::nullopt, TurnNumbering::kOpen, &storage),
              StatusIs(C::kInvalidArgument, HasSubstr("exactly one of")));
  EXPECT_THAT(P::RequestSpans(spans, r, TurnNumbering::kOpen, &storage),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("spans has 1 entries and rendered is set")));
  auto tagged = P::RequestSpans({}, r, TurnNumbering::kOpen, &storage);
  ASSERT_THAT(tagged, IsOk());
  EXPECT_EQ(*tagged, &storage);
  EXPECT_FALSE(storage.empty());
  r.chat_template = ChatTemplate::kUnspecified;
  EXPECT_THAT(P::RequestSpans({}, r, TurnNumbering::kOpen, &storage),
              StatusIs(C::kInvalidArgument, HasSubstr("rendered")));
}

TEST(SequencePlannerTest, TemporalClassesByTurn) {
  // index 0 is the sink; the newest turn current; R turns before it recent.
  EXPECT_EQ(TemporalFor(0, 0, 9, 2), T::kSink);
  EXPECT_EQ(TemporalFor(5, 9, 9, 2), T::kCurrentTurn);
  EXPECT_EQ(TemporalFor(5, 8, 9, 2), T::kRecentTurns);
  EXPECT_EQ(TemporalFor(5, 7, 9, 2), T::kRecentTurns);
  EXPECT_EQ(TemporalFor(5, 6, 9, 2), T::kOlder);
  EXPECT_EQ(TemporalFor(5, 8, 9, 0), T::kOlder);
}

TEST(SequencePlannerTest, OpenCutsSpansIntoAlignedBlocks) {
  const SequencePlanner planner(2);
  auto p =
      planner.PlanOpen({S(Role::kSystem, 20), S(Role::kUser, 5),
                        S(Role::kAssistant, 33, 0, Modality::kUnspecified)},
                       58, 16);
  ASSERT_THAT(p, IsOk());
  // A block never mixes spans: 16+4 | 5 | 16+16+1.
  EXPECT_THAT(Extents(p->blocks),
              ElementsAre(std::make_tuple(0u, 16u), std::make_tuple(16u, 4u),
                          std::make_tuple(20u, 5u), std::make_tuple(25u, 16u),
                          std::make_tuple(41u, 16u), std::make_tuple(57u, 1u)));
  EXPECT_THAT(Temporals(p->tags),
              ElementsAre(T::kSink, T::kCurrentTurn, T::kCurrentTurn,
                          T::kCurrentTurn, T::kCurrentTurn, T::kCurrentTurn));
  EXPECT_EQ(p->tags[5].first.modality, Modality::kText);  // normalized
  EXPECT_EQ(p->tags[5].second, 1u);
  EXPECT_EQ(p->last_turn, 0u);
  // Rendered text of several turns: the last one is current.
  auto turns = planner.PlanOpen(
      {S(Role::kSystem, 4), S(Role::kUser, 4, 0), S(Role::kUser, 4, 1),
       S(Role::kUser, 4, 2), S(Role::kUser, 4, 3)},
      20, 4);
  ASSERT_THAT(turns, IsOk());
  EXPECT_EQ(turns->last_turn, 3u);
  EXPECT_THAT(Temporals(turns->tags),
              ElementsAre(T::kSink, T::kOlder, T::kRecentTurns, T::kRecentTurns,
                          T::kCurrentTurn));
  EXPECT_EQ(turns->blocks[3].turn, 2u);
}

TEST(SequencePlannerTest, OpenLimits) {
  const SequencePlanner planner(2);
  EXPECT_THAT(
      planner.PlanOpen({S(Role::kUser, 4)}, 4, kMaxBlockTokens + 1),
      StatusIs(C::kInvalidArgument, "block_tokens 4097 is outside 1..4096"));
  EXPECT_THAT(planner.PlanOpen({S(Role::kUser, 4)}, kMaxSequenceTokens + 1, 16),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("tokens; the limit is 16777216")));
  EXPECT_THAT(planner.PlanOpen({S(Role::kUser, 65537)}, 65537, 1),
              StatusIs(C::kInvalidArgument,
                       "spans need 65537 blocks of 1 tokens; the limit is "
                       "65536"));
}

TEST(SequencePlannerTest, ExtendContinuesTheLastBlockOnlyWhenItMay) {
  PartsWorld w;
  const SequencePlanner planner(2);
  SequenceRecord* s = w.AddSequence(w.AddTenant("t"), w.AddWorker("w", 1 << 30),
                                    {Role::kUser, Role::kAssistant}, "bf16",
                                    /*tokens_per_block=*/10);
  // The assistant block has 6 free slots: filled first, then new blocks.
  auto p = planner.PlanExtend(*s, {S(Role::kAssistant, 25)}, 25, false, true);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->fill, 6u);
  EXPECT_THAT(Extents(p->blocks),
              ElementsAre(std::make_tuple(26u, 16u), std::make_tuple(42u, 3u)));
  // Another role, or no continue_last_span: nothing filled.
  EXPECT_EQ(planner.PlanExtend(*s, {S(Role::kUser, 5)}, 5, false, true)->fill,
            0u);
  EXPECT_EQ(
      planner.PlanExtend(*s, {S(Role::kAssistant, 5)}, 5, false, false)->fill,
      0u);
  // Shared, spilled or busy blocks are not grown.
  BlockRecord* last = s->blocks.back();
  for (auto edit : {+[](BlockRecord* b) { b->refcount = 2; },
                    +[](BlockRecord* b) { b->tier = Tier::kHost; },
                    +[](BlockRecord* b) { b->busy = 7; },
                    +[](BlockRecord* b) { b->evicted = true; }}) {
    BlockRecord saved = *last;
    edit(last);
    EXPECT_EQ(
        planner.PlanExtend(*s, {S(Role::kAssistant, 5)}, 5, false, true)->fill,
        0u);
    *last = saved;
  }
  // The grown block joins the turn of the span that grew it.
  auto q = planner.PlanExtend(*s, {S(Role::kAssistant, 2)}, 2, true, true);
  ASSERT_THAT(q, IsOk());
  EXPECT_EQ(q->fill, 2u);
  EXPECT_TRUE(q->blocks.empty());
  Apply(&w, planner, s, *q);
  EXPECT_EQ(last->num_tokens, 12u);
  EXPECT_EQ(last->turn, 1u);
  EXPECT_EQ(last->tag.temporal, T::kCurrentTurn);
  EXPECT_EQ(s->current_turn, 1u);
}

TEST(SequencePlannerTest, ExtendLimits) {
  PartsWorld w;
  const SequencePlanner planner(2);
  SequenceRecord* s =
      w.AddSequence(w.AddTenant("t"), w.AddWorker("w", 1 << 30), {Role::kUser});
  EXPECT_THAT(planner.PlanExtend(*s, {S(Role::kUser, 1)}, kMaxSequenceTokens,
                                 false, false),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("spans bring sequence_id \"seq-1\" to "
                                 "16777232 tokens; the limit is 16777216")));
  EXPECT_THAT(planner.PlanExtend(*s, {S(Role::kUser, 16 * 65536)},
                                 uint64_t{16} * 65536, false, false),
              StatusIs(C::kInvalidArgument,
                       "spans bring sequence_id \"seq-1\" past 65536 blocks"));
}

TEST(SequencePlannerTest, RetaggingVisitsOnlyTheBlocksThatChange) {
  PartsWorld w;
  const SequencePlanner planner(/*recent_turns=*/1);
  SequenceRecord* s = w.AddSequence(w.AddTenant("t"), w.AddWorker("w", 1 << 30),
                                    {Role::kSystem, Role::kUser});
  // Turns 1..4, two blocks each.
  for (int turn = 1; turn <= 4; ++turn) {
    auto p = planner.PlanExtend(*s, {S(Role::kUser, 32)}, 32, true, false);
    ASSERT_THAT(p, IsOk());
    int retagged = 0;
    Apply(&w, planner, s, *p, &retagged);
    // The previous turn becomes recent and the one before it older (the
    // sink never changes): 1 block at turn 1, 2 + 1 at turn 2, then 2 + 2.
    EXPECT_EQ(retagged, turn == 1 ? 1 : turn == 2 ? 3 : 4) << "turn " << turn;
  }
  EXPECT_THAT(s->turn_start, ElementsAre(0u, 2u, 4u, 6u, 8u));
  EXPECT_THAT(Temporals(*s),
              ElementsAre(T::kSink, T::kOlder, T::kOlder, T::kOlder, T::kOlder,
                          T::kOlder, T::kRecentTurns, T::kRecentTurns,
                          T::kCurrentTurn, T::kCurrentTurn));
  // Every class is what TemporalFor says.
  for (const BlockRecord* b : s->blocks) {
    EXPECT_EQ(b->tag.temporal, planner.TemporalOf(*b, s->current_turn));
  }
  // Several turns in one request (rendered text): new blocks are created
  // with their final class; turn starts cover the skipped turns.
  auto multi = planner.PlanExtend(
      *s, {S(Role::kUser, 16, 0), S(Role::kUser, 16, 2)}, 32, false, false);
  ASSERT_THAT(multi, IsOk());
  EXPECT_EQ(multi->turn, 6u);
  EXPECT_THAT(Temporals(multi->tags), ElementsAre(T::kOlder, T::kCurrentTurn));
  Apply(&w, planner, s, *multi);
  EXPECT_THAT(s->turn_start, ElementsAre(0u, 2u, 4u, 6u, 8u, 11u, 11u));
  for (const BlockRecord* b : s->blocks) {
    EXPECT_EQ(b->tag.temporal, planner.TemporalOf(*b, s->current_turn))
        << "block " << b->index;
  }
}

TEST(SequencePlannerTest, ForksShareWholeBlocksAndCopyTheCutOne) {
  PartsWorld w;
  SequenceRecord* s = w.AddSequence(w.AddTenant("t"), w.AddWorker("w", 1 << 30),
                                    {Role::kUser, Role::kUser, Role::kUser});
  auto all = SequencePlanner::PlanFork(*s, 0);
  ASSERT_THAT(all, IsOk());
  EXPECT_EQ(all->shared, 3u);
  EXPECT_EQ(all->cut, nullptr);
  EXPECT_EQ(all->num_tokens, 48u);
  auto cut = SequencePlanner::PlanFork(*s, 20);
  ASSERT_THAT(cut, IsOk());
  EXPECT_EQ(cut->shared, 1u);
  EXPECT_EQ(cut->cut, s->blocks[1]);
  EXPECT_EQ(cut->kept(), 2u);
  EXPECT_EQ(SequencePlanner::PlanFork(*s, 32)->cut, nullptr);
  EXPECT_THAT(SequencePlanner::PlanFork(*s, 49),
              StatusIs(C::kInvalidArgument,
                       "num_tokens 49 exceeds the 48 tokens of "
                       "parent_sequence_id \"seq-1\""));
  PartsWorld::Spill(s, s->blocks[1], Tier::kHost);
  EXPECT_THAT(SequencePlanner::PlanFork(*s, 20),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("block 1 (lineage 2) is spilled to "
                                 "TIER_HOST; forks share device blocks only")));
  EXPECT_THAT(SequencePlanner::PlanFork(*s, 16), IsOk());  // not kept
  s->blocks[0]->busy = 3;
  EXPECT_THAT(SequencePlanner::PlanFork(*s, 16),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("being moved by the pressure manager")));
}

TEST(SequencePlannerTest, EncodingsAndGroups) {
  PartsWorld w;
  SequenceRecord* s = w.AddSequence(w.AddTenant("t"), w.AddWorker("w", 1 << 30),
                                    {Role::kSystem}, "triaxial-static");
  const Tag user{T::kOlder, Modality::kText, Role::kUser};
  EXPECT_EQ(SequencePlanner::EncodingOf(*s, user), Format::kINT2);
  EXPECT_EQ(SequencePlanner::EncodingOf(
                *s, Tag{T::kSink, Modality::kText, Role::kUser}),
            Format::kBF16);
  const std::vector<TagTokens> groups = SequencePlanner::GroupTags(
      {{user, 16},
       {Tag{T::kSink, Modality::kText, Role::kSystem}, 16},
       {Tag{T::kOlder, Modality::kUnspecified, Role::kUser}, 5}});
  ASSERT_EQ(groups.size(), 2u);  // UNSPECIFIED modality is text
  EXPECT_EQ(groups[0].tag.temporal, T::kSink);
  EXPECT_EQ(groups[1].tokens, 21);
}

TEST(SequencePlannerTest, AllocationPinsSinksAndReportsInfeasibleBudgets) {
  CalibrationTableInfo info;
  info.model = "cal";
  info.shape = PartsModel();
  info.block_tokens = 16;
  for (auto [f, d] : {std::pair<Format, double>{Format::kBF16, 0},
                      {Format::kINT4, 0.5},
                      {Format::kINT2, 2.0}}) {
    CalibrationEntryInfo e;
    e.tag = Tag{T::kCurrentTurn, Modality::kText, Role::kUser};
    e.encoding.format = f;
    e.distortion = d;
    info.entries.push_back(e);
  }
  auto table = CalibrationStore::Build(info);
  ASSERT_THAT(table, IsOk());
  PolicyInfo pi;
  pi.name = "alloc";
  pi.budget_bits = 7;
  pi.calibration_model = "cal";
  auto policy = BuildPolicy(pi);
  ASSERT_THAT(policy, IsOk());
  const std::vector<TagTokens> groups = {
      {Tag{T::kSink, Modality::kText, Role::kUser}, 16},
      {Tag{T::kCurrentTurn, Modality::kText, Role::kUser}, 112},
      {Tag{T::kOlder, Modality::kText, Role::kSystem}, 16}};  // no entries
  bool infeasible = false;
  auto a = SequencePlanner::Allocate(**policy, **table, PartsModel(), 16,
                                     groups, false, &infeasible);
  ASSERT_THAT(a, IsOk());
  ASSERT_EQ(a->size(), 3u);
  EXPECT_EQ((*a)[0].second, Format::kBF16);  // sink: pinned
  // 32 pinned BF16 tokens leave 112 tokens INT2 (6.3 bits per value on
  // average), not INT4 (7.8).
  EXPECT_EQ((*a)[1].second, Format::kINT2);
  EXPECT_EQ((*a)[2].second, Format::kBF16);  // no entries for the role
  EXPECT_FALSE(infeasible);
  // A budget below the cheapest options: refused, or the cheapest options.
  pi.budget_bits = 5;
  auto tight = BuildPolicy(pi);
  ASSERT_THAT(tight, IsOk());
  EXPECT_THAT(SequencePlanner::Allocate(**tight, **table, PartsModel(), 16,
                                        groups, false, &infeasible),
              StatusIs(C::kResourceExhausted,
                       HasSubstr("policy \"alloc\" (calibration \"cal\", "
                                 "budget_bits 5): allocation infeasible")));
  auto cheapest = SequencePlanner::Allocate(**tight, **table, PartsModel(), 16,
                                            groups, true, &infeasible);
  ASSERT_THAT(cheapest, IsOk());
  EXPECT_TRUE(infeasible);
  EXPECT_EQ((*cheapest)[0].second, Format::kBF16);
  EXPECT_EQ((*cheapest)[1].second, Format::kINT2);
}

}  // namespace
}  // namespace triax::manager
