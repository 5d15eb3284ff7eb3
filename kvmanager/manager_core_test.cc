// Scenarios through the ManagerCore facade: planning of sequences (Open,
// Extend, Fork, Close), workers (placement, failure detection, restarts),
// tenants and admission, access checks, idempotency, traces, and requests as
// rendered text. Deterministic: FakeClock, no sleeps, exact byte numbers
// (manager_core_test_fixture.h).
#include "kvmanager/manager_core.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kvmanager/manager_core_test_fixture.h"
#include "kvmanager/tagger.h"

namespace triax::manager {
namespace {

using ::testing::_;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

TEST(PageBytesTest, ExpectedSizesOfTheTestModel) {
  const kernels::PageShape shape{16, 2, 64};
  EXPECT_EQ(2 * kernels::PageBytes(Format::kBF16, shape), kBf16);
  EXPECT_EQ(2 * kernels::PageBytes(Format::kINT4, shape), kInt4);
  EXPECT_EQ(2 * kernels::PageBytes(Format::kINT2, shape), kInt2);
}

TEST_F(CoreTest, OpenSplitsSpansIntoAlignedBlocksWithPartialWaste) {
  // Given spans system 20, user 5, assistant 33 at T = 16,
  auto seq =
      Open({S(Role::kSystem, 20), S(Role::kUser, 5), S(Role::kAssistant, 33)});
  ASSERT_THAT(seq, IsOk());
  // Expect blocks 16+4 | 5 | 16+16+1, never mixing spans.
  std::vector<uint32_t> tokens;
  std::vector<uint64_t> firsts;
  uint64_t waste = 0;
  for (const auto& b : seq->blocks) {
    tokens.push_back(b.num_tokens);
    firsts.push_back(b.first_token);
    EXPECT_EQ(b.capacity, 16u);
    EXPECT_EQ(b.refcount, 1u);
    waste += b.capacity - b.num_tokens;
  }
  EXPECT_THAT(tokens, ElementsAre(16, 4, 5, 16, 16, 1));
  EXPECT_THAT(firsts, ElementsAre(0, 16, 20, 25, 41, 57));
  EXPECT_EQ(waste, 6 * 16 - 58u);
  EXPECT_EQ(seq->num_tokens, 58u);
  EXPECT_EQ(seq->turns, 1u);
  EXPECT_EQ(seq->policy, "triaxial-static");
  EXPECT_EQ(seq->worker_id, "w1");
  // Tags: the first block is the sink; the rest of turn 0 is current.
  EXPECT_THAT(Temporals(*seq),
              ElementsAre(Temporal::kSink, Temporal::kCurrentTurn,
                          Temporal::kCurrentTurn, Temporal::kCurrentTurn,
                          Temporal::kCurrentTurn, Temporal::kCurrentTurn));
  EXPECT_EQ(seq->blocks[1].tag.role, Role::kSystem);
  EXPECT_EQ(seq->blocks[2].tag.role, Role::kUser);
  // Formats: sink BF16, system INT4, current BF16.
  EXPECT_EQ(seq->blocks[0].encoding, Format::kBF16);
  EXPECT_EQ(seq->blocks[1].encoding, Format::kINT4);
  for (int i = 2; i < 6; ++i) EXPECT_EQ(seq->blocks[i].encoding, Format::kBF16);
  EXPECT_EQ(seq->bytes, 5 * kBf16 + kInt4);
  EXPECT_EQ(DeviceUsage(), 5 * kBf16 + kInt4);
  EXPECT_EQ(CountKind(EventKind::kBlockCreated), 6u);
  EXPECT_EQ(CountKind(EventKind::kSequenceOpened), 1u);
}

TEST_F(CoreTest, LineageIdsAreDenseAndUniqueAcrossSequences) {
  auto a = Open({S(Role::kUser, 40)});
  auto b = Open({S(Role::kUser, 17)});
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  std::vector<uint64_t> ids;
  for (const auto& blk : a->blocks) ids.push_back(blk.lineage_id);
  for (const auto& blk : b->blocks) ids.push_back(blk.lineage_id);
  EXPECT_THAT(ids, ElementsAre(1, 2, 3, 4, 5));
  EXPECT_NE(a->sequence_id, b->sequence_id);
}

TEST_F(CoreTest, TemporalTagsAgeOverTurns) {
  // Given turn 0 with three blocks (recent_turns = 2): system 16 (the sink),
  // system 4, user 16,
  auto seq = Open({S(Role::kSystem, 20), S(Role::kUser, 16)});
  ASSERT_THAT(seq, IsOk());
  const std::string id = seq->sequence_id;
  // When turn 1 starts: turn-0 blocks (except the sink) become recent.
  auto t1 = Extend(id, {S(Role::kUser, 16)}, true);
  ASSERT_THAT(t1, IsOk());
  EXPECT_EQ(t1->retagged_blocks.size(), 2u);
  EXPECT_THAT(Temporals(t1->sequence),
              ElementsAre(Temporal::kSink, Temporal::kRecentTurns,
                          Temporal::kRecentTurns, Temporal::kCurrentTurn));
  // Appending within the turn retags nothing.
  auto t1b = Extend(id, {S(Role::kAssistant, 16)}, false);
  ASSERT_THAT(t1b, IsOk());
  EXPECT_TRUE(t1b->retagged_blocks.empty());
  EXPECT_EQ(t1b->new_blocks[0].tag.temporal, Temporal::kCurrentTurn);
  // Turns 2 and 3: turn 0 leaves the recent window at turn 3.
  auto t2 = Extend(id, {S(Role::kUser, 16)}, true);
  ASSERT_THAT(t2, IsOk());
  EXPECT_EQ(t2->retagged_blocks.size(), 2u);  // the two turn-1 blocks
  auto t3 = Extend(id, {S(Role::kUser, 16)}, true);
  ASSERT_THAT(t3, IsOk());
  EXPECT_THAT(Temporals(t3->sequence),
              ElementsAre(Temporal::kSink, Temporal::kOlder, Temporal::kOlder,
                          Temporal::kRecentTurns, Temporal::kRecentTurns,
                          Temporal::kRecentTurns, Temporal::kCurrentTurn));
  EXPECT_EQ(t3->retagged_blocks.size(),
            3u);  // turn 0 -> older, turn 2 -> recent
  EXPECT_EQ(t3->sequence.turns, 4u);
  // Format is fixed at creation; role keeps its override.
  EXPECT_EQ(t3->sequence.blocks[0].encoding, Format::kBF16);  // sink
  EXPECT_EQ(t3->sequence.blocks[1].encoding, Format::kINT4);  // system
  EXPECT_EQ(t3->sequence.blocks[2].encoding, Format::kBF16);  // created current
  EXPECT_EQ(CountKind(EventKind::kBlockRetagged), 2u + 2u + 3u);
}

TEST_F(CoreTest, ZeroRecentTurnsAgesStraightToOlder) {
  ManagerOptions o;
  o.recent_turns = 0;
  Make(o);
  auto seq = Open({S(Role::kUser, 48)});
  ASSERT_THAT(seq, IsOk());
  auto t1 = Extend(seq->sequence_id, {S(Role::kUser, 1)}, true);
  ASSERT_THAT(t1, IsOk());
  EXPECT_THAT(Temporals(t1->sequence),
              ElementsAre(Temporal::kSink, Temporal::kOlder, Temporal::kOlder,
                          Temporal::kCurrentTurn));
}

TEST_F(CoreTest, ContinueLastSpanFillsFreeSlotsWhenRoleMatches) {
  auto seq = Open({S(Role::kSystem, 16), S(Role::kUser, 5)});
  ASSERT_THAT(seq, IsOk());
  const uint64_t usage = DeviceUsage();
  // Given a user block with 11 free slots, continuing with 20 user tokens
  auto r = Extend(seq->sequence_id, {S(Role::kUser, 20)}, false, true);
  ASSERT_THAT(r, IsOk());
  // fills it to 16 and puts the remaining 9 in one new block.
  ASSERT_EQ(r->grown_blocks.size(), 1u);
  EXPECT_EQ(r->grown_blocks[0].lineage_id, seq->blocks[1].lineage_id);
  EXPECT_EQ(r->grown_blocks[0].num_tokens, 16u);
  ASSERT_EQ(r->new_blocks.size(), 1u);
  EXPECT_EQ(r->new_blocks[0].first_token, 32u);  // 21 + 11 filled
  EXPECT_EQ(r->new_blocks[0].num_tokens, 9u);
  EXPECT_EQ(r->sequence.num_tokens, 41u);
  EXPECT_EQ(DeviceUsage(), usage + kBf16);  // only the new block costs
  // A span of another role never fills: it starts a new block.
  auto r2 = Extend(seq->sequence_id, {S(Role::kAssistant, 3)}, false, true);
  ASSERT_THAT(r2, IsOk());
  EXPECT_TRUE(r2->grown_blocks.empty());
  EXPECT_EQ(r2->new_blocks[0].first_token, 41u);
  // Without continue_last_span, the same role starts a new block too.
  auto r3 = Extend(seq->sequence_id, {S(Role::kAssistant, 3)}, false, false);
  ASSERT_THAT(r3, IsOk());
  EXPECT_TRUE(r3->grown_blocks.empty());
  EXPECT_EQ(r3->sequence.blocks.size(), 5u);
}

TEST_F(CoreTest, GrownBlockJoinsTheNewTurn) {
  auto seq = Open({S(Role::kUser, 20)});  // blocks 16 (sink) + 4
  ASSERT_THAT(seq, IsOk());
  auto t1 = Extend(seq->sequence_id, {S(Role::kUser, 4)}, true, true);
  ASSERT_THAT(t1, IsOk());
  ASSERT_EQ(t1->grown_blocks.size(), 1u);
  EXPECT_EQ(t1->grown_blocks[0].tag.temporal, Temporal::kCurrentTurn);
  EXPECT_TRUE(t1->new_blocks.empty());
  // At the next turn it ages with turn 1.
  auto t2 = Extend(seq->sequence_id, {S(Role::kUser, 1)}, true);
  ASSERT_THAT(t2, IsOk());
  EXPECT_EQ(t2->sequence.blocks[1].tag.temporal, Temporal::kRecentTurns);
}

TEST_F(CoreTest, PolicyTablesPickFormats) {
  auto i2 = Open({S(Role::kSystem, 16), S(Role::kUser, 16)}, "acme", "int2");
  ASSERT_THAT(i2, IsOk());
  for (const auto& b : i2->blocks) EXPECT_EQ(b.encoding, Format::kINT2);
  EXPECT_EQ(i2->bytes, 2 * kInt2);
  auto bf =
      Open({S(Role::kSystem, 16), S(Role::kToolSchema, 16)}, "acme", "bf16");
  ASSERT_THAT(bf, IsOk());
  for (const auto& b : bf->blocks) EXPECT_EQ(b.encoding, Format::kBF16);
  // Triaxial: tool schema -> INT4; delimiter follows its temporal class.
  auto tri = Open({S(Role::kDelimiter, 1), S(Role::kToolSchema, 16),
                   S(Role::kDelimiter, 1)});
  ASSERT_THAT(tri, IsOk());
  EXPECT_EQ(tri->blocks[0].encoding, Format::kBF16);  // sink
  EXPECT_EQ(tri->blocks[1].encoding, Format::kINT4);
  EXPECT_EQ(tri->blocks[2].encoding, Format::kBF16);  // current delimiter
  EXPECT_THAT(Open({S(Role::kUser, 1)}, "acme", "fp3"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy \"fp3\" is not a known policy")));
  // A tenant default policy applies when the request names none.
  ASSERT_THAT(core_->CreateTenant({"", "cheap", {}, "int4"}), IsOk());
  auto c = Open({S(Role::kUser, 16)}, "cheap");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->policy, "int4");
  EXPECT_EQ(c->blocks[0].encoding, Format::kINT4);
  EXPECT_THAT(core_->CreateTenant({"", "bad", {}, "nope"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("default_policy")));
  auto table = FindBuiltinPolicy("triaxial-static");
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(table->EncodingFor(
                {Temporal::kRecentTurns, Modality::kText, Role::kUser}),
            Format::kINT4);
  EXPECT_EQ(
      table->EncodingFor({Temporal::kOlder, Modality::kText, Role::kDelimiter}),
      Format::kINT2);
  EXPECT_EQ(
      table->EncodingFor({Temporal::kSink, Modality::kText, Role::kSystem}),
      Format::kBF16);
  EXPECT_EQ(table->EncodingFor(
                {Temporal::kOlder, Modality::kImage, Role::kToolSchema}),
            Format::kINT4);
}

TEST_F(CoreTest, ForkSharesWholeBlocksAndCopiesTheCutOne) {
  // Given a parent of 40 user tokens: blocks 16 | 16 | 8 (all BF16),
  auto parent = Open({S(Role::kUser, 40)});
  ASSERT_THAT(parent, IsOk());
  EXPECT_EQ(DeviceUsage(), 3 * kBf16);
  // When forked at 20 tokens,
  auto child = core_->ForkSequence({"", "acme", parent->sequence_id, 20});
  ASSERT_THAT(child, IsOk());
  // Expect block 0 shared (refcount 2) and block 1 copied into lineage 4.
  ASSERT_EQ(child->blocks.size(), 2u);
  EXPECT_EQ(child->blocks[0].lineage_id, parent->blocks[0].lineage_id);
  EXPECT_EQ(child->blocks[0].refcount, 2u);
  EXPECT_EQ(child->blocks[1].lineage_id, 4u);
  EXPECT_EQ(child->blocks[1].num_tokens, 4u);
  EXPECT_EQ(child->blocks[1].first_token, 16u);
  EXPECT_EQ(child->blocks[1].refcount, 1u);
  EXPECT_EQ(child->num_tokens, 20u);
  EXPECT_EQ(child->parent_sequence_id, parent->sequence_id);
  EXPECT_EQ(child->worker_id, parent->worker_id);
  EXPECT_EQ(DeviceUsage(), 4 * kBf16);  // only the copy is charged
  EXPECT_EQ(CountKind(EventKind::kBlockShared), 1u);
  EXPECT_EQ(CountKind(EventKind::kSequenceForked), 1u);
  // Closing the parent frees only what the child does not hold.
  auto closed = core_->CloseSequence({"", "acme", parent->sequence_id});
  ASSERT_THAT(closed, IsOk());
  EXPECT_THAT(closed->freed_lineage_ids, ElementsAre(2, 3));
  EXPECT_EQ(DeviceUsage(), 2 * kBf16);
  EXPECT_EQ(CountKind(EventKind::kBlockReleased), 3u);
  EXPECT_EQ(CountKind(EventKind::kBlockFreed), 2u);
  auto child_now = core_->GetSequence("acme", child->sequence_id);
  ASSERT_THAT(child_now, IsOk());
  EXPECT_EQ(child_now->blocks[0].refcount, 1u);
  // Then closing the child frees the rest.
  auto closed2 = core_->CloseSequence({"", "acme", child->sequence_id});
  ASSERT_THAT(closed2, IsOk());
  EXPECT_THAT(closed2->freed_lineage_ids, ElementsAre(1, 4));
  EXPECT_EQ(DeviceUsage(), 0u);
  EXPECT_EQ(core_->ListWorkers()[0].reserved_bytes, 0u);
}

TEST_F(CoreTest, ForkOfAllTokensSharesEverythingAndChargesNothing) {
  auto parent = Open({S(Role::kUser, 20)});
  ASSERT_THAT(parent, IsOk());
  auto child = core_->ForkSequence({"", "acme", parent->sequence_id, 0});
  ASSERT_THAT(child, IsOk());
  EXPECT_EQ(child->blocks.size(), 2u);
  EXPECT_EQ(DeviceUsage(), 2 * kBf16);
  // The shared partial block is immutable: continuing fills nothing.
  auto r = Extend(child->sequence_id, {S(Role::kUser, 3)}, false, true);
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->grown_blocks.empty());
  EXPECT_THAT(core_->ForkSequence({"", "acme", parent->sequence_id, 21}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_tokens 21 exceeds the 20 tokens")));
}

TEST_F(CoreTest, AdmissionChargesExactBytesAndRejectsOverCeiling) {
  // Given a ceiling of three BF16 blocks,
  ASSERT_THAT(core_->CreateTenant(
                  {"", "small", {Budget{Tier::kDevice, 0, 3 * kBf16}}, "bf16"}),
              IsOk());
  auto a = Open({S(Role::kUser, 32)}, "small");
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(DeviceUsage("small"), 2 * kBf16);
  // When a request needs two more blocks, expect the exact shortfall.
  EXPECT_THAT(
      Open({S(Role::kUser, 17)}, "small"),
      StatusIs(
          absl::StatusCode::kResourceExhausted,
          HasSubstr("tenant \"small\" tier TIER_DEVICE: request needs 32768 "
                    "bytes, 32768 of ceiling 49152 in use; over by 16384 "
                    "bytes")));
  EXPECT_THAT(Extend(a->sequence_id, {S(Role::kUser, 17)}, true),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("another tenant")));
  ExtendSequenceRequest ext{"",   "small", a->sequence_id, {S(Role::kUser, 17)},
                            true, false};
  EXPECT_THAT(core_->ExtendSequence(ext),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("over by 16384")));
  EXPECT_THAT(core_->ForkSequence({"", "small", a->sequence_id, 0}), IsOk());
  // Nothing changed on failure: usage, counts and lineage ids.
  EXPECT_EQ(DeviceUsage("small"), 2 * kBf16);
  auto fits = Open({S(Role::kUser, 16)}, "small");
  ASSERT_THAT(fits, IsOk());
  EXPECT_EQ(fits->blocks[0].lineage_id, 3u);
  EXPECT_EQ(DeviceUsage("small"), 3 * kBf16);
  // Close releases usage; raising the ceiling admits more.
  ASSERT_THAT(core_->CloseSequence({"", "small", fits->sequence_id}), IsOk());
  EXPECT_EQ(DeviceUsage("small"), 2 * kBf16);
  auto raised =
      core_->SetBudget({"", "small", Budget{Tier::kDevice, 0, 10 * kBf16}});
  ASSERT_THAT(raised, IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 17)}, "small"), IsOk());
  // Budget validation.
  EXPECT_THAT(
      core_->SetBudget({"", "small", Budget{Tier::kDevice, 5, 4}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("budget.floor_bytes 5 exceeds ceiling_bytes 4")));
  EXPECT_THAT(core_->SetBudget({"", "small", Budget{Tier::kUnspecified, 0, 4}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("budget.tier is TIER_UNSPECIFIED")));
  EXPECT_THAT(
      core_->CreateTenant({"", "small", {}, ""}),
      StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("\"small\"")));
}

TEST_F(CoreTest, SilentWorkerGoesDownAndItsSequencesAreLost) {
  auto seq = Open({S(Role::kUser, 40)});
  ASSERT_THAT(seq, IsOk());
  // Heartbeats keep it up.
  clock_.AdvanceMs(2000);
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  clock_.AdvanceMs(2000);
  EXPECT_TRUE(core_->CheckWorkers().empty());
  // Silence past the timeout makes it suspect, past the down timeout down
  // (manager_core_workers_test has the SUSPECT cases).
  clock_.AdvanceMs(1001);
  EXPECT_TRUE(core_->CheckWorkers().empty());
  EXPECT_EQ(core_->ListWorkers()[0].state, WorkerState::kSuspect);
  clock_.AdvanceMs(27000);
  EXPECT_THAT(core_->CheckWorkers(), ElementsAre("w1"));
  auto lost = core_->GetSequence("acme", seq->sequence_id);
  ASSERT_THAT(lost, IsOk());
  EXPECT_EQ(lost->state, SequenceState::kLost);
  EXPECT_THAT(lost->lost_lineage_ids, ElementsAre(1, 2, 3));
  EXPECT_EQ(DeviceUsage(), 0u);
  EXPECT_EQ(core_->GetTenant("acme")->open_sequences, 0u);
  EXPECT_EQ(CountKind(EventKind::kBlockLost), 3u);
  EXPECT_EQ(CountKind(EventKind::kWorkerDown), 1u);
  std::vector<Event> seq_lost;
  for (const Event& e : AllEvents()) {
    if (e.kind == EventKind::kSequenceLost) seq_lost.push_back(e);
  }
  ASSERT_EQ(seq_lost.size(), 1u);
  EXPECT_THAT(seq_lost[0].lineage_ids, ElementsAre(1, 2, 3));
  // The lost blocks are still traceable.
  auto trace = core_->QueryTrace(2);
  ASSERT_THAT(trace, IsOk());
  EXPECT_EQ(trace->sequence_id, seq->sequence_id);
  EXPECT_EQ(trace->events.back().kind, EventKind::kBlockLost);
  // Down worker: heartbeats are refused, lost sequences are read-only, and
  // there is nowhere to place.
  EXPECT_THAT(core_->Heartbeat("w1", Inventory{}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("re-register")));
  EXPECT_THAT(
      Extend(seq->sequence_id, {S(Role::kUser, 1)}, false),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lost")));
  EXPECT_THAT(
      Open({S(Role::kUser, 1)}),
      StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no worker is up")));
  EXPECT_EQ(core_->ListWorkers()[0].state, WorkerState::kDown);
}

TEST_F(CoreTest, WorkerWithAFailedDeviceTakesNoNewSequences) {
  auto before = Open({S(Role::kUser, 16)});
  ASSERT_THAT(before, IsOk());
  Inventory bad;
  bad.device_error = "UNAVAILABLE: CUDA error 700 (illegal address)";
  ASSERT_THAT(core_->Heartbeat("w1", bad), IsOk());
  EXPECT_EQ(core_->ListWorkers()[0].inventory.device_error, bad.device_error);
  EXPECT_THAT(
      Open({S(Role::kUser, 1)}),
      StatusIs(absl::StatusCode::kUnavailable, HasSubstr("healthy device")));
  // A healthy heartbeat (e.g. after a restart) makes it placeable again.
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 1)}), IsOk());
}

TEST_F(CoreTest, ReRegistrationLosesThePreviousSequences) {
  auto seq = Open({S(Role::kUser, 16)});
  ASSERT_THAT(seq, IsOk());
  // A different worker cannot take an id that is up.
  EXPECT_THAT(core_->RegisterWorker({"", "w1", "10.0.0.9:1", "cpu", 1 << 20}),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("worker_id \"w1\" is up at address")));
  EXPECT_EQ(core_->GetSequence("", seq->sequence_id)->state,
            SequenceState::kOpen);
  // The same worker re-registering (it restarted) loses its sequences.
  auto again =
      core_->RegisterWorker({"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40});
  ASSERT_THAT(again, IsOk());
  EXPECT_THAT(again->lost_sequence_ids, ElementsAre(seq->sequence_id));
  EXPECT_EQ(again->heartbeat_interval_ms, 1000u);
  EXPECT_EQ(core_->GetSequence("", seq->sequence_id)->state,
            SequenceState::kLost);
  EXPECT_EQ(DeviceUsage(), 0u);
  // Once down, another address may take the id.
  clock_.AdvanceMs(3001);
  core_->CheckWorkers();
  EXPECT_THAT(core_->RegisterWorker({"", "w1", "10.0.0.9:1", "cpu", 1 << 20}),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("worker_id \"w1\" is suspect at address")));
  clock_.AdvanceMs(27000);
  core_->CheckWorkers();
  EXPECT_THAT(core_->RegisterWorker({"", "w1", "10.0.0.9:1", "cpu", 1 << 20}),
              IsOk());
  EXPECT_THAT(core_->Heartbeat("w2", Inventory{}),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("\"w2\" is not registered")));
}

TEST_F(CoreTest, PlacementPicksTheMostFreeBytesAndSaysWhenNothingFits) {
  ManagerOptions o;
  auto core = ManagerCore::Create(o, &clock_);
  ASSERT_THAT(core, IsOk());
  core_ = std::move(*core);
  ASSERT_THAT(core_->CreateTenant({"", "acme", {}, "bf16"}), IsOk());
  ASSERT_THAT(core_->RegisterWorker({"", "small", "h:1", "cpu", 3 * kBf16}),
              IsOk());
  ASSERT_THAT(core_->RegisterWorker({"", "big", "h:2", "cpu", 4 * kBf16}),
              IsOk());
  auto a = Open({S(Role::kUser, 32)});  // 2 blocks -> big (2 left)
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->worker_id, "big");
  EXPECT_EQ(a->worker_address, "h:2");
  auto b = Open({S(Role::kUser, 16)});  // small has 3 free, big 2
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->worker_id, "small");
  EXPECT_THAT(
      Open({S(Role::kUser, 48)}),
      StatusIs(
          absl::StatusCode::kResourceExhausted,
          HasSubstr("needs 49152 bytes; the largest free space is 32768")));
  EXPECT_THAT(Extend(a->sequence_id, {S(Role::kUser, 48)}, false),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("worker \"big\" has 32768 free bytes")));
  auto workers = core_->ListWorkers();
  EXPECT_EQ(workers[0].worker_id, "big");
  EXPECT_EQ(workers[0].reserved_bytes, 2 * kBf16);
  EXPECT_EQ(workers[0].sequences, 1u);
}

TEST_F(CoreTest, SequenceAccessChecks) {
  ASSERT_THAT(core_->CreateTenant({"", "other", {}, ""}), IsOk());
  auto seq = Open({S(Role::kUser, 16)});
  ASSERT_THAT(seq, IsOk());
  const std::string id = seq->sequence_id;
  EXPECT_THAT(core_->CloseSequence({"", "other", id}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(id)));
  EXPECT_THAT(core_->GetSequence("other", id),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(id)));
  EXPECT_THAT(core_->CloseSequence({"", "acme", "seq-999"}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"seq-999\"")));
  EXPECT_THAT(
      core_->CloseSequence({"", "nobody", id}),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("tenant_id \"nobody\"")));
  ASSERT_THAT(core_->CloseSequence({"", "acme", id}), IsOk());
  EXPECT_THAT(
      core_->CloseSequence({"", "acme", id}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
  EXPECT_THAT(
      core_->ForkSequence({"", "acme", id, 0}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
  auto closed = core_->GetSequence("", id);
  ASSERT_THAT(closed, IsOk());
  EXPECT_EQ(closed->state, SequenceState::kClosed);
  EXPECT_TRUE(closed->blocks.empty());
  EXPECT_EQ(core_->ListSequences("acme", false)->size(), 0u);
  EXPECT_EQ(core_->ListSequences("acme", true)->size(), 1u);
}

TEST_F(CoreTest, OpenOnANamedWorker) {
  // w2 has less room than w1: placement would take w1.
  ASSERT_THAT(core_->RegisterWorker(
                  {"", "w2", "127.0.0.1:9002", "cpu", 4 * kBf16, 0, 0, "i2"}),
              IsOk());
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kUser, 16)};
  auto placed = core_->OpenSequence(req);
  ASSERT_THAT(placed, IsOk());
  EXPECT_EQ(placed->worker_id, "w1");
  req.worker_id = "w2";
  auto named = core_->OpenSequence(req);
  ASSERT_THAT(named, IsOk());
  EXPECT_EQ(named->worker_id, "w2");
  // Refusals name the field and the worker; nothing is charged.
  const uint64_t used = DeviceUsage();
  req.spans = {S(Role::kUser, 16 * 4)};  // 4 blocks, 3 free on w2
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("worker \"w2\"")));
  req.spans = {S(Role::kUser, 16)};
  req.worker_id = "w9";
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("worker_id \"w9\" is not a known worker")));
  req.worker_id = "bad id";
  EXPECT_THAT(
      core_->OpenSequence(req),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker_id")));
  EXPECT_EQ(DeviceUsage(), used);
  // A SUSPECT worker takes nothing new.
  clock_.AdvanceMs(3001);
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  core_->CheckWorkers();
  req.worker_id = "w2";
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("worker_id \"w2\" is suspect")));
}

TEST_F(CoreTest, OpenValidatesEveryField) {
  auto open = [&](auto mutate) {
    OpenSequenceRequest req;
    req.tenant_id = "acme";
    req.model = Model();
    req.spans = {S(Role::kUser, 4)};
    mutate(req);
    return core_->OpenSequence(req);
  };
  using R = OpenSequenceRequest;
  const std::vector<std::pair<std::function<void(R&)>, std::string>> cases = {
      {[](R& r) { r.model.n_layers = 0; }, "model.n_layers=0"},
      {[](R& r) { r.model.n_layers = 1025; }, "model.n_layers=1025"},
      {[](R& r) { r.model.n_kv_heads = 0; }, "model.n_kv_heads=0"},
      {[](R& r) { r.model.n_q_heads = 5; }, "model.n_q_heads=5"},
      {[](R& r) { r.model.n_q_heads = 0; }, "model.n_q_heads=0"},
      {[](R& r) { r.model.head_dim = 63; }, "model.head_dim=63"},
      {[](R& r) { r.model.head_dim = 514; }, "model.head_dim=514"},
      {[](R& r) { r.spans.clear(); }, "spans is empty"},
      {[](R& r) { r.spans[0].num_tokens = 0; }, "spans[0].num_tokens is 0"},
      {[](R& r) { r.spans[0].role = Role::kUnspecified; },
       "spans[0].role is ROLE_UNSPECIFIED"},
      {[](R& r) { r.spans[0].role = static_cast<Role>(42); },
       "spans[0].role is ROLE(42)"},
      {[](R& r) { r.spans[0].modality = static_cast<Modality>(9); },
       "spans[0].modality is MODALITY(9)"},
      {[](R& r) { r.block_tokens = 4097; }, "block_tokens 4097"},
      {[](R& r) {
         r.spans = {S(Role::kUser, 1u << 24), S(Role::kUser, 1)};
       },
       "tokens; the limit is 16777216"},
      {[](R& r) {
         r.block_tokens = 1;
         r.spans[0].num_tokens = 70000;
       },
       "the limit is 65536"},
      {[](R& r) { r.tenant_id = ""; }, "tenant_id is empty"},
      {[](R& r) { r.tenant_id = "a b"; }, "tenant_id \"a b\""},
      {[](R& r) { r.request_id = "bad id"; }, "request_id \"bad id\""},
  };
  for (const auto& [mutate, msg] : cases) {
    EXPECT_THAT(open(mutate),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(msg)))
        << msg;
  }
  EXPECT_THAT(open([](R& r) { r.tenant_id = "ghost"; }),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"ghost\"")));
  // Unspecified modality means text; nothing above changed state.
  auto ok = open([](R& r) { r.spans[0].modality = Modality::kUnspecified; });
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ(ok->blocks[0].tag.modality, Modality::kText);
  EXPECT_EQ(ok->blocks[0].lineage_id, 1u);
  EXPECT_EQ(ok->sequence_id, "seq-1");
}

TEST_F(CoreTest, RequestIdMakesMutationsIdempotent) {
  OpenSequenceRequest req{"r-1", "acme", Model(), {S(Role::kUser, 40)}, 0, ""};
  auto a = core_->OpenSequence(req);
  auto b = core_->OpenSequence(req);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(a->sequence_id, b->sequence_id);
  EXPECT_EQ(b->blocks.back().lineage_id, 3u);
  EXPECT_EQ(DeviceUsage(), 3 * kBf16);
  EXPECT_EQ(core_->ListSequences("", false)->size(), 1u);
  CloseSequenceRequest close{"c-1", "acme", a->sequence_id};
  auto c1 = core_->CloseSequence(close);
  auto c2 = core_->CloseSequence(close);
  ASSERT_THAT(c1, IsOk());
  ASSERT_THAT(c2, IsOk());
  EXPECT_EQ(c1->freed_lineage_ids, c2->freed_lineage_ids);
  // The same id under another tenant is a different request.
  ASSERT_THAT(core_->CreateTenant({"t-1", "other", {}, ""}), IsOk());
  auto again = core_->CreateTenant({"t-1", "other", {}, ""});
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->tenant_id, "other");
  req.tenant_id = "other";
  auto d = core_->OpenSequence(req);
  ASSERT_THAT(d, IsOk());
  EXPECT_NE(d->sequence_id, a->sequence_id);
}

// The service sets each request's fingerprint from its wire form; here the
// core is given them directly.
TEST_F(CoreTest, ARequestIdReusedForAnotherPayloadIsRefused) {
  const auto reused = [](const std::string& id, const std::string& method) {
    return StatusIs(absl::StatusCode::kFailedPrecondition,
                    HasSubstr(absl::StrCat("request_id=\"", id,
                                           "\" was used for a different ",
                                           method, " request")));
  };
  OpenSequenceRequest open{"o-1", "acme", Model(), {S(Role::kUser, 40)}, 0, ""};
  open.fingerprint = 11;
  auto a = core_->OpenSequence(open);
  ASSERT_THAT(a, IsOk());
  open.spans = {S(Role::kUser, 80)};
  open.fingerprint = 12;
  EXPECT_THAT(core_->OpenSequence(open), reused("o-1", "OpenSequence"));
  EXPECT_EQ(core_->ListSequences("", false)->size(), 1u);
  open.spans = {S(Role::kUser, 40)};
  open.fingerprint = 11;
  auto again = core_->OpenSequence(open);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->sequence_id, a->sequence_id);

  ExtendSequenceRequest extend;
  extend.request_id = "e-1";
  extend.tenant_id = "acme";
  extend.sequence_id = a->sequence_id;
  extend.spans = {S(Role::kAssistant, 8)};
  extend.fingerprint = 21;
  ASSERT_THAT(core_->ExtendSequence(extend), IsOk());
  extend.spans = {S(Role::kAssistant, 30)};
  extend.fingerprint = 22;
  EXPECT_THAT(core_->ExtendSequence(extend), reused("e-1", "ExtendSequence"));
  EXPECT_EQ(core_->GetSequence("acme", a->sequence_id)->num_tokens, 48u);

  ForkSequenceRequest fork{"f-1", "acme", a->sequence_id, 16, 31};
  auto child = core_->ForkSequence(fork);
  ASSERT_THAT(child, IsOk());
  fork.num_tokens = 32;
  fork.fingerprint = 32;
  EXPECT_THAT(core_->ForkSequence(fork), reused("f-1", "ForkSequence"));

  TruncateSequenceRequest truncate{"t-1", "acme", a->sequence_id, 40, 41};
  ASSERT_THAT(core_->TruncateSequence(truncate), IsOk());
  truncate.num_tokens = 20;
  truncate.fingerprint = 42;
  EXPECT_THAT(core_->TruncateSequence(truncate),
              reused("t-1", "TruncateSequence"));
  EXPECT_EQ(core_->GetSequence("acme", a->sequence_id)->num_tokens, 40u);

  // Close: the id reused for another sequence leaves that one open.
  CloseSequenceRequest close{"c-1", "acme", a->sequence_id, 51};
  ASSERT_THAT(core_->CloseSequence(close), IsOk());
  close.sequence_id = child->sequence_id;
  close.fingerprint = 52;
  EXPECT_THAT(core_->CloseSequence(close), reused("c-1", "CloseSequence"));
  EXPECT_EQ(core_->GetSequence("acme", child->sequence_id)->state,
            SequenceState::kOpen);

  CreateTenantRequest tenant{"ct-1", "other", {}, "", "", 61};
  ASSERT_THAT(core_->CreateTenant(tenant), IsOk());
  tenant.tenant_id = "third";
  tenant.fingerprint = 62;
  EXPECT_THAT(core_->CreateTenant(tenant), reused("ct-1", "CreateTenant"));
  EXPECT_EQ(core_->ListTenants().size(), 2u);

  SetBudgetRequest budget{"sb-1", "other", Budget{Tier::kDevice, 0, 1 << 20},
                          71};
  ASSERT_THAT(core_->SetBudget(budget), IsOk());
  budget.budget.ceiling_bytes = 2 << 20;
  budget.fingerprint = 72;
  EXPECT_THAT(core_->SetBudget(budget), reused("sb-1", "SetBudget"));

  RegisterWorkerRequest worker{"rw-1", "w9", "127.0.0.1:9009", "cpu", 1 << 20};
  worker.fingerprint = 81;
  ASSERT_THAT(core_->RegisterWorker(worker), IsOk());
  worker.capacity_bytes = 2 << 20;
  worker.fingerprint = 82;
  EXPECT_THAT(core_->RegisterWorker(worker), reused("rw-1", "RegisterWorker"));
}

TEST_F(CoreTest, QueryTraceFollowsALineageThroughItsLife) {
  auto seq = Open({S(Role::kUser, 20)});
  ASSERT_THAT(seq, IsOk());
  auto fork = core_->ForkSequence({"", "acme", seq->sequence_id, 16});
  ASSERT_THAT(fork, IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "acme", seq->sequence_id}), IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "acme", fork->sequence_id}), IsOk());
  auto trace = core_->QueryTrace(1);
  ASSERT_THAT(trace, IsOk());
  EXPECT_EQ(trace->sequence_id, seq->sequence_id);
  EXPECT_EQ(trace->block.lineage_id, 1u);
  EXPECT_EQ(trace->block.num_tokens, 16u);
  std::vector<EventKind> kinds;
  for (const Event& e : trace->events) kinds.push_back(e.kind);
  EXPECT_THAT(kinds,
              ElementsAre(EventKind::kBlockCreated, EventKind::kBlockShared,
                          EventKind::kBlockReleased, EventKind::kBlockReleased,
                          EventKind::kBlockFreed));
  EXPECT_THAT(core_->QueryTrace(99), StatusIs(absl::StatusCode::kNotFound,
                                              HasSubstr("lineage_id 99")));
  EXPECT_THAT(core_->QueryTrace(0), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("lineage_id is 0")));
}

// --- Rendered text (the tagger) ----------------------------------------------

// A ChatML conversation of `turns` user messages, each answered.
std::string ChatMl(int turns, int first = 0) {
  std::string s;
  if (first == 0) {
    s = "<|im_start|>system\nYou are a helpful assistant.\n"
        "{\"name\": \"lookup\", \"parameters\": {}}<|im_end|>\n";
  }
  for (int t = first; t < first + turns; ++t) {
    absl::StrAppend(&s, "<|im_start|>user\nQuestion number ", t,
                    " <image><|im_end|>\n<|im_start|>assistant\n<think>",
                    "let me think about it</think><tool_call>[lookup()]",
                    "</tool_call><|im_end|>\n<|im_start|>tool\nresult ", t,
                    "<|im_end|>\n<|im_start|>assistant\nAnswer ", t,
                    "<|im_end|>\n");
  }
  return s;
}

RenderedText ChatMlText(const std::string& text) {
  RenderedText r;
  r.text = text;
  r.chat_template = ChatTemplate::kChatML;
  return r;
}

// first_token, num_tokens and tag of every block.
std::vector<std::tuple<uint64_t, uint32_t, int, int, int>> Plan(
    const SequenceInfo& s) {
  std::vector<std::tuple<uint64_t, uint32_t, int, int, int>> out;
  for (const BlockPlan& b : s.blocks) {
    out.emplace_back(
        b.first_token, b.num_tokens, static_cast<int>(b.tag.temporal),
        static_cast<int>(b.tag.role), static_cast<int>(b.tag.modality));
  }
  return out;
}

// Spans of the tagger grouped by turn.
std::vector<std::vector<Span>> ByTurn(const RenderedText& r,
                                      TurnNumbering numbering) {
  auto tagged = TagRendered(r, numbering);
  EXPECT_THAT(tagged, IsOk());
  std::vector<std::vector<Span>> out;
  if (!tagged.ok()) return out;
  for (const Span& sp : ToSpans(*tagged)) {
    if (out.size() <= sp.turn_offset) out.resize(sp.turn_offset + 1);
    out[sp.turn_offset].push_back(Span{sp.role, sp.modality, sp.num_tokens});
  }
  return out;
}

TEST_F(CoreTest, OpenWithRenderedTextEqualsOpenPlusOneExtendPerTurn) {
  const RenderedText r = ChatMlText(ChatMl(4));
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.rendered = r;
  auto rendered = core_->OpenSequence(req);
  ASSERT_THAT(rendered, IsOk());
  EXPECT_EQ(rendered->turns, 4u);
  EXPECT_EQ(rendered->num_tokens, r.text.size());
  // The same spans, one call per turn.
  const auto turns = ByTurn(r, TurnNumbering::kOpen);
  ASSERT_EQ(turns.size(), 4u);
  auto seq = Open(turns[0]);
  ASSERT_THAT(seq, IsOk());
  absl::StatusOr<ExtendSequenceResult> last;
  for (size_t t = 1; t < turns.size(); ++t) {
    last = Extend(seq->sequence_id, turns[t], true);
    ASSERT_THAT(last, IsOk());
  }
  EXPECT_EQ(Plan(*rendered), Plan(last->sequence));
  // Encodings follow the tag at creation: blocks of older turns are created
  // in their (smaller) formats at once, so the rendered open costs less.
  EXPECT_LT(rendered->bytes, last->sequence.bytes);
  for (const BlockPlan& b : rendered->blocks) {
    if (b.tag.role == Role::kUser && b.tag.modality == Modality::kText) {
      EXPECT_EQ(b.encoding, b.tag.temporal == Temporal::kOlder ? Format::kINT2
                            : b.tag.temporal == Temporal::kRecentTurns
                                ? Format::kINT4
                                : Format::kBF16)
          << b.index;
    }
  }
  // Every temporal class, role and modality shows up.
  std::set<int> temporals, roles, modalities;
  for (const auto& [first, n, temporal, role, modality] : Plan(*rendered)) {
    temporals.insert(temporal);
    roles.insert(role);
    modalities.insert(modality);
  }
  EXPECT_EQ(temporals.size(), 4u);
  EXPECT_EQ(roles.size(), 8u);
  EXPECT_EQ(modalities.size(), 2u);
}

TEST_F(CoreTest, ExtendWithRenderedTextOfSeveralTurnsAgesLikeSeparateCalls) {
  // Open one turn, then extend with text that finishes the open assistant
  // message and brings three more user turns (recent_turns = 2).
  const std::string open_text =
      ChatMl(1) + "<|im_start|>assistant\n<think>still";
  RenderedText more =
      ChatMlText(" thinking</think>Done.<|im_end|>\n" + ChatMl(3, /*first=*/1));
  more.continues = Role::kReasoning;
  OpenSequenceRequest oreq;
  oreq.tenant_id = "acme";
  oreq.model = Model();
  oreq.rendered = ChatMlText(open_text);
  auto a = core_->OpenSequence(oreq);
  ASSERT_THAT(a, IsOk());
  ExtendSequenceRequest ereq;
  ereq.tenant_id = "acme";
  ereq.sequence_id = a->sequence_id;
  ereq.rendered = more;
  ereq.continue_last_span = true;
  auto ext = core_->ExtendSequence(ereq);
  ASSERT_THAT(ext, IsOk());
  EXPECT_EQ(ext->sequence.turns, 4u);
  EXPECT_EQ(ext->grown_blocks.size(), 1u);  // "<think>still" + " thinking"

  // Reference: the same spans, one call per turn.
  const auto open_turns = ByTurn(ChatMlText(open_text), TurnNumbering::kOpen);
  ASSERT_EQ(open_turns.size(), 1u);
  auto b = Open(open_turns[0]);
  ASSERT_THAT(b, IsOk());
  const auto turns = ByTurn(more, TurnNumbering::kContinue);
  ASSERT_EQ(turns.size(), 4u);
  std::set<uint64_t> retagged;  // by first token
  absl::StatusOr<ExtendSequenceResult> last;
  for (size_t t = 0; t < turns.size(); ++t) {
    last = Extend(b->sequence_id, turns[t], t > 0, /*cont=*/t == 0);
    ASSERT_THAT(last, IsOk());
    for (const BlockPlan& p : last->retagged_blocks) {
      retagged.insert(p.first_token);
    }
  }
  EXPECT_EQ(Plan(ext->sequence), Plan(last->sequence));
  // Blocks retagged in one call: those whose class differs from before it.
  std::set<uint64_t> got;
  for (const BlockPlan& p : ext->retagged_blocks) got.insert(p.first_token);
  std::set<uint64_t> changed;
  for (size_t i = 0; i < a->blocks.size(); ++i) {
    const BlockPlan& before = a->blocks[i];
    const BlockPlan& after = ext->sequence.blocks[i];
    if (before.tag.temporal != after.tag.temporal) {
      changed.insert(before.first_token);
    }
  }
  EXPECT_EQ(got, changed);
  EXPECT_FALSE(got.empty());
  // The sink stays a sink; the newest turn is current.
  EXPECT_EQ(ext->sequence.blocks.front().tag.temporal, Temporal::kSink);
  EXPECT_EQ(ext->sequence.blocks.back().tag.temporal, Temporal::kCurrentTurn);
}

TEST_F(CoreTest, RenderedRequestsAreValidatedWithoutChangingState) {
  auto seq = Open({S(Role::kUser, 4)});
  ASSERT_THAT(seq, IsOk());
  const uint64_t usage = DeviceUsage();
  const size_t events = AllEvents().size();
  using C = absl::StatusCode;
  OpenSequenceRequest o;
  o.tenant_id = "acme";
  o.model = Model();
  EXPECT_THAT(core_->OpenSequence(o),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("exactly one of spans and rendered")));
  o.spans = {S(Role::kUser, 1)};
  o.rendered = ChatMlText("<|im_start|>user\nhi<|im_end|>\n");
  EXPECT_THAT(core_->OpenSequence(o),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("spans has 1 entries and rendered is set; "
                                 "exactly one of spans and rendered")));
  o.spans.clear();
  o.rendered = ChatMlText("<|im_start|>user\nhi");
  EXPECT_THAT(core_->OpenSequence(o),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("rendered.text byte 0: the ROLE_USER message "
                                 "has no <|im_end|>")));
  ExtendSequenceRequest e;
  e.tenant_id = "acme";
  e.sequence_id = seq->sequence_id;
  EXPECT_THAT(core_->ExtendSequence(e),
              StatusIs(C::kInvalidArgument, HasSubstr("exactly one of")));
  e.rendered = ChatMlText("<|im_start|>user\nhi<|im_end|>\n");
  e.spans = {S(Role::kUser, 1)};
  EXPECT_THAT(core_->ExtendSequence(e),
              StatusIs(C::kInvalidArgument, HasSubstr("exactly one of")));
  e.spans.clear();
  e.new_turn = true;
  EXPECT_THAT(core_->ExtendSequence(e),
              StatusIs(C::kInvalidArgument, HasSubstr("new_turn is true")));
  e.new_turn = false;
  e.rendered->token_offsets = {0, 3, 2};
  EXPECT_THAT(core_->ExtendSequence(e),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("rendered.token_offsets[2] is 2")));
  // Spans with decreasing turn offsets (only the tagger sets them).
  Span late = S(Role::kUser, 1);
  late.turn_offset = 1;
  e.rendered.reset();
  e.spans = {late, S(Role::kUser, 1)};
  EXPECT_THAT(core_->ExtendSequence(e),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("spans[1].turn_offset 0 is below")));
  EXPECT_EQ(DeviceUsage(), usage);
  EXPECT_EQ(AllEvents().size(), events);
  auto info = core_->GetSequence("acme", seq->sequence_id);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->num_tokens, 4u);
  EXPECT_EQ(info->turns, 1u);
}

}  // namespace
}  // namespace triax::manager
