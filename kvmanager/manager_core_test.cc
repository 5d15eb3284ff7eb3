// Deterministic scenarios for the manager core: FakeClock, no sleeps, exact
// byte numbers. Model shape used throughout: 2 layers, 2 KV heads, head_dim
// 64, T = 16, so a block costs 2 * PageBytes(encoding, {16, 2, 64}):
// BF16 16384, INT4 5632, INT2 3584 bytes.
#include "kvmanager/manager_core.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kvmanager/tagger.h"

namespace triax::manager {
namespace {

using ::testing::_;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr uint64_t kBf16 = 16384;
constexpr uint64_t kInt4 = 5632;
constexpr uint64_t kInt2 = 3584;

ModelShape Model() { return ModelShape{"test", 2, 2, 4, 64}; }
Span S(Role r, uint32_t n, Modality m = Modality::kText) {
  return Span{r, m, n};
}

class CoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(ManagerOptions{}); }

  void Make(ManagerOptions options) {
    auto core = ManagerCore::Create(options, &clock_);
    ASSERT_THAT(core, IsOk());
    core_ = std::move(*core);
    ASSERT_THAT(
        core_->RegisterWorker({"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40}),
        IsOk());
    ASSERT_THAT(core_->CreateTenant({"", "acme", {}, ""}), IsOk());
  }

  absl::StatusOr<SequenceInfo> Open(std::vector<Span> spans,
                                    const std::string& tenant = "acme",
                                    const std::string& policy = "") {
    OpenSequenceRequest req;
    req.tenant_id = tenant;
    req.model = Model();
    req.spans = std::move(spans);
    req.policy = policy;
    return core_->OpenSequence(req);
  }

  absl::StatusOr<ExtendSequenceResult> Extend(const std::string& seq,
                                              std::vector<Span> spans,
                                              bool new_turn,
                                              bool cont = false) {
    ExtendSequenceRequest req;
    req.tenant_id = "acme";
    req.sequence_id = seq;
    req.spans = std::move(spans);
    req.new_turn = new_turn;
    req.continue_last_span = cont;
    return core_->ExtendSequence(req);
  }

  uint64_t DeviceUsage(const std::string& tenant = "acme") {
    auto t = core_->GetTenant(tenant);
    EXPECT_THAT(t, IsOk());
    return t->usage[0].used_bytes;  // usage[0] is TIER_DEVICE
  }

  std::vector<Event> AllEvents() {
    return core_->events().Retained(1, EventFilter{});
  }
  size_t CountKind(EventKind k, const std::string& seq = "") {
    size_t n = 0;
    for (const Event& e : AllEvents()) {
      if (e.kind == k && (seq.empty() || e.sequence_id == seq)) ++n;
    }
    return n;
  }

  FakeClock clock_;
  std::unique_ptr<ManagerCore> core_;
};

std::vector<Temporal> Temporals(const SequenceInfo& s) {
  std::vector<Temporal> out;
  for (const auto& b : s.blocks) out.push_back(b.tag.temporal);
  return out;
}

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
  // Silence past the timeout marks it down.
  clock_.AdvanceMs(1001);
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

// --- EventLog
// ------------------------------------------------------------------

Event Ev(EventKind kind, uint64_t lineage, const std::string& seq,
         const std::string& tenant = "t") {
  Event e;
  e.kind = kind;
  e.lineage_id = lineage;
  e.sequence_id = seq;
  e.tenant_id = tenant;
  return e;
}

TEST(EventLogTest, RetentionDropsOldestAndPrunesTheLineageIndex) {
  EventLog log({/*retention=*/5, /*watcher_queue_limit=*/100});
  std::vector<Event> batch;
  for (uint64_t i = 1; i <= 8; ++i)
    batch.push_back(Ev(EventKind::kBlockCreated, i % 3 + 1, "s"));
  log.Append(&batch);
  EXPECT_EQ(batch[7].id, 8u);
  EXPECT_EQ(log.next_id(), 9u);
  auto kept = log.Retained(1, EventFilter{});
  ASSERT_EQ(kept.size(), 5u);
  EXPECT_EQ(kept.front().id, 4u);
  // Lineage 2 had ids 1, 4, 7: only 4 and 7 remain.
  auto l2 = log.EventsForLineage(2);
  ASSERT_EQ(l2.size(), 2u);
  EXPECT_EQ(l2[0].id, 4u);
  EXPECT_EQ(l2[1].id, 7u);
  BlockPlan last;
  last.lineage_id = 2;
  last.num_tokens = 5;
  last.capacity = 16;
  log.RecordLastPlan(last, "s");
  ASSERT_TRUE(log.FindLastPlan(2).has_value());
  EXPECT_EQ(log.FindLastPlan(2)->plan.num_tokens, 5u);
  // When the lineage's last event leaves retention, its entry goes too.
  std::vector<Event> more;
  for (int i = 0; i < 5; ++i)
    more.push_back(Ev(EventKind::kSequenceOpened, 0, "x"));
  log.Append(&more);
  EXPECT_TRUE(log.EventsForLineage(2).empty());
  EXPECT_FALSE(log.FindLastPlan(2).has_value());
}

TEST(EventLogTest, FiltersMatchTenantSequenceAndLineage) {
  EventLog log({100, 100});
  std::vector<Event> batch = {Ev(EventKind::kBlockCreated, 1, "s1", "a"),
                              Ev(EventKind::kBlockCreated, 2, "s2", "b"),
                              Ev(EventKind::kSequenceLost, 0, "s1", "a")};
  batch[2].lineage_ids = {1, 7};
  log.Append(&batch);
  EXPECT_EQ(log.Retained(1, EventFilter{"a", "", 0}).size(), 2u);
  EXPECT_EQ(log.Retained(1, EventFilter{"", "s2", 0}).size(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{"", "", 7}).size(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{"", "", 1}).size(), 2u);
  EXPECT_EQ(log.Retained(3, EventFilter{}).size(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{}, 2).size(), 2u);
}

TEST(EventLogTest, SubscriptionReplaysThenDeliversLiveAndNotifies) {
  EventLog log({100, 100});
  std::vector<Event> first = {Ev(EventKind::kBlockCreated, 1, "s1"),
                              Ev(EventKind::kBlockCreated, 2, "s2"),
                              Ev(EventKind::kBlockCreated, 3, "s1")};
  log.Append(&first);
  auto sub = log.Subscribe(EventFilter{"", "s1", 0}, 1);
  int notified = 0;
  sub->SetNotify([&] { ++notified; });
  Event e;
  absl::Status end;
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 1u);
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 3u);
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEmpty);
  std::vector<Event> live = {Ev(EventKind::kBlockFreed, 2, "s2"),
                             Ev(EventKind::kBlockFreed, 1, "s1")};
  log.Append(&live);
  EXPECT_EQ(notified, 1);
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 5u);
  EXPECT_EQ(e.kind, EventKind::kBlockFreed);
  // A live-only subscription sees nothing from before.
  auto live_only = log.Subscribe(EventFilter{}, 0);
  EXPECT_EQ(live_only->Next(&e, &end), EventSubscription::Result::kEmpty);
  sub->Cancel();
  live_only->Cancel();
  EXPECT_EQ(log.subscribers(), 0u);
  std::vector<Event> after = {Ev(EventKind::kBlockFreed, 1, "s1")};
  log.Append(&after);
  EXPECT_EQ(notified, 1);
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEnded);
  EXPECT_EQ(end.code(), absl::StatusCode::kCancelled);
}

TEST(EventLogTest, SlowWatcherIsEndedWithResourceExhausted) {
  EventLog log({1000, 3});
  auto sub = log.Subscribe(EventFilter{}, 0);
  std::vector<Event> batch;
  for (int i = 0; i < 5; ++i)
    batch.push_back(Ev(EventKind::kBlockCreated, 1, "s"));
  log.Append(&batch);
  Event e;
  absl::Status end;
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEnded);
  EXPECT_EQ(end.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(end.message()),
              HasSubstr("fell behind by more than 3 events"));
  // A replay that falls out of retention ends the same way.
  EventLog small({2, 100});
  std::vector<Event> three = {Ev(EventKind::kBlockCreated, 1, "s"),
                              Ev(EventKind::kBlockCreated, 1, "s")};
  small.Append(&three);
  auto replay = small.Subscribe(EventFilter{}, 1);
  std::vector<Event> two = {Ev(EventKind::kBlockCreated, 1, "s"),
                            Ev(EventKind::kBlockCreated, 1, "s")};
  small.Append(&two);
  EXPECT_EQ(replay->Next(&e, &end), EventSubscription::Result::kEnded);
  EXPECT_THAT(std::string(end.message()), HasSubstr("left retention"));
  sub->Cancel();
  replay->Cancel();
}

// --- Policies, encodings and DemoteBlocks -----------------------------------

uint64_t Bytes(const Encoding& e) {
  return 2 * kernels::PageBytes(e, kernels::PageShape{16, 2, 64});
}

PolicyRuleInfo R(Temporal t, Role r, Format k, Format v = Format(0),
                 uint32_t group = 0, int scale = 0) {
  PolicyRuleInfo rule;
  rule.temporal = t;
  rule.role = r;
  rule.encoding = EncodingSpec{k, v, group, scale};
  return rule;
}

// sink bf16, system k=fp8 v=int4 g=64 scale=fp8, everything else tq3.
PolicyInfo Mixed(const std::string& name = "mixed") {
  PolicyInfo p;
  p.name = name;
  p.rules = {R(Temporal::kSink, Role::kUnspecified, Format::kBF16),
             R(Temporal::kUnspecified, Role::kSystem, Format::kFP8,
               Format::kINT4, 64, 2),
             R(Temporal::kUnspecified, Role::kUnspecified, Format::kTQ3)};
  return p;
}

DemoteBlocksRequest Demote(const std::string& seq,
                           std::vector<BlockEncoding> blocks,
                           const std::string& tenant = "acme",
                           const std::string& request_id = "") {
  DemoteBlocksRequest req;
  req.request_id = request_id;
  req.tenant_id = tenant;
  req.sequence_id = seq;
  req.blocks = std::move(blocks);
  return req;
}

BlockEncoding To(uint64_t lineage, Format f) {
  return BlockEncoding{lineage, EncodingSpec{f, Format(0), 0, 0}};
}

TEST(PolicyTest, BuiltinsAndCanonicalEncodings) {
  std::vector<std::string> names;
  for (const auto& p : BuiltinPolicies()) {
    names.push_back(p->name);
    EXPECT_TRUE(p->builtin);
    EXPECT_TRUE(p->rules.back().IsCatchAll());
  }
  EXPECT_THAT(names, ElementsAre("triaxial-static", "bf16", "fp8", "int8",
                                 "int4", "int2", "tq4", "tq3", "tq2"));
  EXPECT_EQ(FindBuiltinPolicy("tq2")->EncodingFor({}), Format::kTQ2);
  EXPECT_EQ(FindBuiltinPolicy("nope"), nullptr);
  // Group and scale dtype only matter with an INT format.
  const Encoding tq = CanonicalEncoding(
      Encoding(Format::kTQ3, Format::kTQ3, 64, ScaleDtype::kFP8));
  EXPECT_EQ(tq.group, 0);
  EXPECT_EQ(tq.scale_dtype, ScaleDtype::kFP16);
  auto e =
      ResolveEncoding("x", EncodingSpec{Format::kFP8, Format::kINT4, 0, 2});
  ASSERT_THAT(e, IsOk());
  EXPECT_EQ(e->k, Format::kFP8);
  EXPECT_EQ(e->v, Format::kINT4);
  EXPECT_EQ(e->group, 32);
  EXPECT_EQ(e->scale_dtype, ScaleDtype::kFP8);
  const EncodingSpec spec = SpecOf(*e);
  EXPECT_EQ(spec.group_size, 32u);
  EXPECT_EQ(spec.scale_dtype, 2);
  EXPECT_EQ(SpecOf(Format::kBF16).group_size, 0u);
  EXPECT_EQ(SpecOf(Format::kBF16).format_v, Format::kBF16);
}

TEST(PolicyTest, FirstMatchingRuleWins) {
  PolicyInfo info;
  info.name = "p";
  PolicyRuleInfo img =
      R(Temporal::kUnspecified, Role::kUnspecified, Format::kINT8);
  img.modality = Modality::kImage;
  info.rules = {R(Temporal::kOlder, Role::kUser, Format::kINT2), img,
                R(Temporal::kOlder, Role::kUnspecified, Format::kINT4),
                R(Temporal::kUnspecified, Role::kUnspecified, Format::kFP8)};
  auto p = BuildPolicy(info);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ((*p)->EncodingFor({Temporal::kOlder, Modality::kText, Role::kUser}),
            Format::kINT2);
  EXPECT_EQ(
      (*p)->EncodingFor({Temporal::kOlder, Modality::kImage, Role::kUser}),
      Format::kINT2);
  EXPECT_EQ(
      (*p)->EncodingFor({Temporal::kOlder, Modality::kImage, Role::kSystem}),
      Format::kINT8);
  EXPECT_EQ(
      (*p)->EncodingFor({Temporal::kOlder, Modality::kText, Role::kSystem}),
      Format::kINT4);
  EXPECT_EQ((*p)->EncodingFor({Temporal::kSink, Modality::kText, Role::kUser}),
            Format::kFP8);
}

TEST_F(CoreTest, PutPolicyValidatesAndReplaces) {
  auto put = [&](PolicyInfo p, const std::string& rid = "") {
    return core_->PutPolicy(PutPolicyRequest{rid, std::move(p)});
  };
  using C = absl::StatusCode;
  PolicyInfo p = Mixed();
  p.name = "bad name!";
  EXPECT_THAT(put(p), StatusIs(C::kInvalidArgument, HasSubstr("policy.name")));
  p = Mixed();
  p.rules.clear();
  EXPECT_THAT(put(p), StatusIs(C::kInvalidArgument,
                               HasSubstr("policy.rules is empty")));
  p = Mixed();
  p.rules.pop_back();
  EXPECT_THAT(put(p), StatusIs(C::kInvalidArgument,
                               HasSubstr("policy.rules[1] (the last rule")));
  p = Mixed();
  p.rules[1].encoding.format = Format(0);
  EXPECT_THAT(
      put(p),
      StatusIs(C::kInvalidArgument,
               HasSubstr("policy.rules[1].format is FORMAT_UNSPECIFIED")));
  p = Mixed();
  p.rules[0].encoding.format_v = Format(9);
  EXPECT_THAT(put(p),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("policy.rules[0].format_v is FORMAT(9)")));
  p = Mixed();
  p.rules[1].encoding.group_size = 48;
  EXPECT_THAT(put(p), StatusIs(C::kInvalidArgument,
                               HasSubstr("policy.rules[1].group_size 48")));
  p = Mixed();
  p.rules[1].encoding.scale_dtype = 3;
  EXPECT_THAT(put(p), StatusIs(C::kInvalidArgument,
                               HasSubstr("policy.rules[1].scale_dtype 3")));
  p = Mixed();
  p.rules[0].role = Role(42);
  EXPECT_THAT(put(p),
              StatusIs(C::kInvalidArgument, HasSubstr("policy.rules[0].role")));
  EXPECT_THAT(put(Mixed("int4")),
              StatusIs(C::kFailedPrecondition, HasSubstr("built-in")));
  // Nothing was stored by the failures.
  EXPECT_EQ(core_->ListPolicies().size(), BuiltinPolicies().size());

  auto stored = put(Mixed(), "r1");
  ASSERT_THAT(stored, IsOk());
  EXPECT_FALSE(stored->builtin);
  ASSERT_EQ(stored->rules.size(), 3u);
  EXPECT_EQ(stored->rules[1].encoding.format_v, Format::kINT4);
  EXPECT_EQ(stored->rules[1].encoding.group_size, 64u);
  EXPECT_EQ(stored->rules[2].encoding.group_size, 0u);
  auto seq = Open({S(Role::kSystem, 32), S(Role::kUser, 16)}, "acme", "mixed");
  ASSERT_THAT(seq, IsOk());

  // Replace it: a later open uses the new rules, the open sequence keeps its
  // encodings. A repeat of request r1 changes nothing.
  PolicyInfo v2;
  v2.name = "mixed";
  v2.rules = {R(Temporal::kUnspecified, Role::kUnspecified, Format::kINT8)};
  ASSERT_THAT(put(v2, "r2"), IsOk());
  auto again = put(Mixed(), "r1");
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->rules.size(), 3u);
  auto list = core_->ListPolicies();
  ASSERT_EQ(list.size(), BuiltinPolicies().size() + 1);
  EXPECT_EQ(list.back().name, "mixed");
  ASSERT_EQ(list.back().rules.size(), 1u);  // r2's, not r1's again
  auto later = Open({S(Role::kSystem, 16)}, "acme", "mixed");
  ASSERT_THAT(later, IsOk());
  EXPECT_EQ(later->blocks[0].encoding, Format::kINT8);
  auto first = core_->GetSequence("acme", seq->sequence_id);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->blocks[1].encoding,
            Encoding(Format::kFP8, Format::kINT4, 64, ScaleDtype::kFP8));
  // A tenant may default to an operator policy.
  EXPECT_THAT(core_->CreateTenant({"", "ops", {}, "mixed"}), IsOk());
}

TEST_F(CoreTest, MixedPolicyEncodingsAndBytes) {
  ASSERT_THAT(core_->PutPolicy({"", Mixed()}), IsOk());
  const uint64_t before = DeviceUsage();
  // sink (system) | system | user | user
  auto seq = Open({S(Role::kSystem, 32), S(Role::kUser, 20)}, "acme", "mixed");
  ASSERT_THAT(seq, IsOk());
  ASSERT_EQ(seq->blocks.size(), 4u);
  const Encoding sys(Format::kFP8, Format::kINT4, 64, ScaleDtype::kFP8);
  EXPECT_EQ(seq->blocks[0].encoding, Format::kBF16);
  EXPECT_EQ(seq->blocks[1].encoding, sys);
  EXPECT_EQ(seq->blocks[2].encoding, Format::kTQ3);
  EXPECT_EQ(seq->blocks[3].encoding, Format::kTQ3);
  const uint64_t want =
      Bytes(Format::kBF16) + Bytes(sys) + 2 * Bytes(Format::kTQ3);
  EXPECT_EQ(seq->bytes, want);
  EXPECT_EQ(DeviceUsage() - before, want);
  EXPECT_LT(Bytes(Format::kTQ3), Bytes(Format::kINT4));
  EXPECT_LT(Bytes(sys), Bytes(Format::kBF16));
}

TEST_F(CoreTest, PolicyInvalidForTheShapeIsRejectedAtOpen) {
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = ModelShape{"odd", 2, 2, 4, 48};  // head_dim not a power of two
  req.spans = {S(Role::kUser, 16)};
  req.policy = "tq3";
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("policy \"tq3\" rules[0]"),
                             HasSubstr("head_dim 48"))));
  ASSERT_THAT(core_->PutPolicy({"", Mixed()}), IsOk());
  req.policy = "mixed";
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy \"mixed\" rules[2]")));
  // INT keys group min(g, T) tokens, which must divide T = 48.
  req.model = Model();
  req.block_tokens = 48;
  req.policy = "int4";
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy \"int4\" rules[0]")));
  req.block_tokens = 64;
  EXPECT_THAT(core_->OpenSequence(req), IsOk());
  EXPECT_EQ(CountKind(EventKind::kSequenceOpened), 1u);
}

TEST_F(CoreTest, DemoteShrinksBytesAndEmitsEvents) {
  auto seq = Open({S(Role::kUser, 48)}, "acme", "bf16");
  ASSERT_THAT(seq, IsOk());
  const uint64_t usage = DeviceUsage();
  const uint64_t reserved = core_->ListWorkers()[0].reserved_bytes;
  const uint64_t l1 = seq->blocks[1].lineage_id;
  const uint64_t l2 = seq->blocks[2].lineage_id;
  BlockEncoding mixed{l2, EncodingSpec{Format::kINT4, Format::kINT2, 64, 2}};
  auto prep = core_->PrepareDemote(
      Demote(seq->sequence_id, {To(l1, Format::kINT2), mixed}, "acme", "d1"));
  ASSERT_THAT(prep, IsOk());
  EXPECT_FALSE(prep->done);
  EXPECT_EQ(prep->worker_address, "127.0.0.1:9001");
  EXPECT_EQ(prep->worker_request_id, "d1");
  ASSERT_EQ(prep->blocks.size(), 2u);
  EXPECT_EQ(prep->blocks[0].lineage_id, l1);
  EXPECT_EQ(prep->blocks[0].index, 1u);
  EXPECT_EQ(prep->blocks[0].encoding, Format::kINT2);
  const Encoding m(Format::kINT4, Format::kINT2, 64, ScaleDtype::kFP8);
  EXPECT_EQ(prep->blocks[1].encoding, m);
  const int64_t delta = static_cast<int64_t>(Bytes(Format::kINT2) + Bytes(m)) -
                        2 * static_cast<int64_t>(kBf16);
  EXPECT_EQ(prep->bytes_delta, delta);
  // Nothing applied before the commit (shrinkage is not released early).
  EXPECT_EQ(DeviceUsage(), usage);
  auto mid = core_->GetSequence("acme", seq->sequence_id);
  EXPECT_EQ(mid->blocks[1].encoding, Format::kBF16);

  auto done = core_->CommitDemote(prep->token);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->bytes_delta, delta);
  EXPECT_EQ(done->sequence.blocks[0].encoding, Format::kBF16);
  EXPECT_EQ(done->sequence.blocks[1].encoding, Format::kINT2);
  EXPECT_EQ(done->sequence.blocks[2].encoding, m);
  EXPECT_EQ(done->sequence.bytes, kBf16 + Bytes(Format::kINT2) + Bytes(m));
  EXPECT_EQ(static_cast<int64_t>(DeviceUsage()),
            static_cast<int64_t>(usage) + delta);
  EXPECT_EQ(static_cast<int64_t>(core_->ListWorkers()[0].reserved_bytes),
            static_cast<int64_t>(reserved) + delta);
  std::vector<Event> demoted;
  for (const Event& e : AllEvents()) {
    if (e.kind == EventKind::kBlockDemoted) demoted.push_back(e);
  }
  ASSERT_EQ(demoted.size(), 2u);
  EXPECT_EQ(demoted[0].lineage_id, l1);
  EXPECT_EQ(demoted[0].format, Format::kINT2);
  EXPECT_THAT(demoted[0].detail, HasSubstr("from=bf16 to=int2"));
  EXPECT_THAT(demoted[1].detail, HasSubstr("to=k=int4,v=int2,g=64,scale=fp8"));
  EXPECT_EQ(core_->CommitDemote(prep->token).status().code(),
            absl::StatusCode::kNotFound);

  // The same request id again: the remembered reply, nothing applied.
  auto repeat = core_->PrepareDemote(
      Demote(seq->sequence_id, {To(l1, Format::kINT2), mixed}, "acme", "d1"));
  ASSERT_THAT(repeat, IsOk());
  ASSERT_TRUE(repeat->done);
  EXPECT_EQ(repeat->done->bytes_delta, delta);
  // A demote to the current encoding has nothing for the worker.
  auto noop =
      core_->PrepareDemote(Demote(seq->sequence_id, {To(l1, Format::kINT2)}));
  ASSERT_THAT(noop, IsOk());
  EXPECT_TRUE(noop->blocks.empty());
  EXPECT_EQ(noop->bytes_delta, 0);
  ASSERT_THAT(core_->CommitDemote(noop->token), IsOk());
  EXPECT_EQ(CountKind(EventKind::kBlockDemoted), 2u);
  // Closing releases the demoted bytes exactly.
  ASSERT_THAT(core_->CloseSequence({"", "acme", seq->sequence_id}), IsOk());
  EXPECT_EQ(DeviceUsage(), usage - seq->bytes);
}

TEST_F(CoreTest, DemoteGrowthIsChargedAndBounded) {
  CreateTenantRequest t{"", "small", {Budget{Tier::kDevice, 0, 0}}, "int2"};
  t.budgets[0].ceiling_bytes = 3 * kInt2 + (kInt4 - kInt2) + 100;
  ASSERT_THAT(core_->CreateTenant(t), IsOk());
  auto seq = Open({S(Role::kUser, 48)}, "small");
  ASSERT_THAT(seq, IsOk());
  EXPECT_EQ(DeviceUsage("small"), 3 * kInt2);
  const uint64_t l0 = seq->blocks[0].lineage_id;
  const uint64_t l1 = seq->blocks[1].lineage_id;
  // Two blocks to BF16 would be over the ceiling.
  EXPECT_THAT(
      core_->PrepareDemote(
          Demote(seq->sequence_id, {To(l0, Format::kBF16)}, "small")),
      StatusIs(
          absl::StatusCode::kResourceExhausted,
          AllOf(HasSubstr("tenant \"small\""),
                HasSubstr(absl::StrCat("over by ", kBf16 - kInt4 - 100)))));
  EXPECT_EQ(DeviceUsage("small"), 3 * kInt2);
  // One block to INT4 fits, and is reserved at prepare.
  auto prep = core_->PrepareDemote(
      Demote(seq->sequence_id, {To(l0, Format::kINT4)}, "small"));
  ASSERT_THAT(prep, IsOk());
  EXPECT_EQ(prep->bytes_delta, static_cast<int64_t>(kInt4 - kInt2));
  EXPECT_EQ(DeviceUsage("small"), 2 * kInt2 + kInt4);
  // The reservation counts against a second prepare.
  EXPECT_THAT(core_->PrepareDemote(
                  Demote(seq->sequence_id, {To(l1, Format::kINT4)}, "small")),
              StatusIs(absl::StatusCode::kResourceExhausted, _));
  // Abort returns it.
  core_->AbortDemote(prep->token);
  EXPECT_EQ(DeviceUsage("small"), 3 * kInt2);
  EXPECT_EQ(core_->CommitDemote(prep->token).status().code(),
            absl::StatusCode::kNotFound);
  // Prepare again and commit: usage stays at the charged value.
  prep = core_->PrepareDemote(
      Demote(seq->sequence_id, {To(l1, Format::kINT4)}, "small"));
  ASSERT_THAT(prep, IsOk());
  ASSERT_THAT(core_->CommitDemote(prep->token), IsOk());
  EXPECT_EQ(DeviceUsage("small"), 2 * kInt2 + kInt4);
}

TEST_F(CoreTest, DemoteAbortsWhenTheSequenceChanged) {
  auto seq = Open({S(Role::kUser, 32)}, "acme", "int2");
  ASSERT_THAT(seq, IsOk());
  const uint64_t usage = DeviceUsage();
  auto prep = core_->PrepareDemote(
      Demote(seq->sequence_id, {To(seq->blocks[1].lineage_id, Format::kINT4)},
             "acme", "d9"));
  ASSERT_THAT(prep, IsOk());
  // The same request id while it is in flight.
  EXPECT_THAT(
      core_->PrepareDemote(
          Demote(seq->sequence_id,
                 {To(seq->blocks[1].lineage_id, Format::kINT4)}, "acme", "d9")),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("in progress")));
  auto ext = Extend(seq->sequence_id, {S(Role::kAssistant, 16)}, false);
  ASSERT_THAT(ext, IsOk());
  const uint64_t after_extend = DeviceUsage();
  EXPECT_EQ(after_extend, usage + kInt2 + (kInt4 - kInt2));  // + reservation
  EXPECT_THAT(core_->CommitDemote(prep->token),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("changed while its blocks were re-encoded")));
  EXPECT_EQ(DeviceUsage(), usage + kInt2);  // reservation returned
  auto now = core_->GetSequence("acme", seq->sequence_id);
  EXPECT_EQ(now->blocks[1].encoding, Format::kINT2);
  EXPECT_EQ(CountKind(EventKind::kBlockDemoted), 0u);
  // A retry with the same id now goes through (the failure was not cached).
  auto retry = core_->PrepareDemote(
      Demote(seq->sequence_id, {To(seq->blocks[1].lineage_id, Format::kINT4)},
             "acme", "d9"));
  ASSERT_THAT(retry, IsOk());
  ASSERT_THAT(core_->CommitDemote(retry->token), IsOk());
  EXPECT_EQ(CountKind(EventKind::kBlockDemoted), 1u);
}

TEST_F(CoreTest, DemoteRejectsBadRequestsWithoutChanges) {
  using C = absl::StatusCode;
  ASSERT_THAT(core_->CreateTenant({"", "other", {}, ""}), IsOk());
  auto seq = Open({S(Role::kUser, 40)}, "acme", "bf16");
  ASSERT_THAT(seq, IsOk());
  auto mine = Open({S(Role::kUser, 16)}, "acme", "bf16");
  ASSERT_THAT(mine, IsOk());
  const std::string id = seq->sequence_id;
  const uint64_t l0 = seq->blocks[0].lineage_id;
  const uint64_t usage = DeviceUsage();
  const size_t events = AllEvents().size();
  EXPECT_THAT(core_->PrepareDemote(Demote(id, {})),
              StatusIs(C::kInvalidArgument, HasSubstr("blocks is empty")));
  EXPECT_THAT(
      core_->PrepareDemote(Demote(id, {To(0, Format::kINT2)})),
      StatusIs(C::kInvalidArgument, HasSubstr("blocks[0].lineage_id is 0")));
  EXPECT_THAT(core_->PrepareDemote(
                  Demote(id, {To(l0, Format::kINT2), To(l0, Format::kINT4)})),
              StatusIs(C::kInvalidArgument, HasSubstr("blocks[1].lineage_id")));
  EXPECT_THAT(core_->PrepareDemote(Demote(id, {To(l0, Format(0))})),
              StatusIs(C::kInvalidArgument, HasSubstr("blocks[0].format")));
  EXPECT_THAT(
      core_->PrepareDemote(
          Demote(id, {BlockEncoding{l0, {Format::kINT4, Format(0), 16, 0}}})),
      StatusIs(C::kInvalidArgument, HasSubstr("blocks[0].group_size 16")));
  EXPECT_THAT(
      core_->PrepareDemote(Demote(id, {To(l0, Format::kINT2)}, "other")),
      StatusIs(C::kPermissionDenied, HasSubstr("another tenant")));
  EXPECT_THAT(core_->PrepareDemote(Demote(id, {To(l0, Format::kINT2)}, "nope")),
              StatusIs(C::kNotFound, HasSubstr("tenant_id \"nope\"")));
  EXPECT_THAT(core_->PrepareDemote(Demote("seq-99", {To(l0, Format::kINT2)})),
              StatusIs(C::kNotFound, HasSubstr("sequence_id \"seq-99\"")));
  EXPECT_THAT(
      core_->PrepareDemote(
          Demote(id, {To(mine->blocks[0].lineage_id, Format::kINT2)})),
      StatusIs(C::kNotFound, HasSubstr("is not a block of sequence_id")));
  // A fork shares the whole blocks: they are immutable.
  ASSERT_THAT(core_->ForkSequence({"", "acme", id, 32}), IsOk());
  EXPECT_THAT(
      core_->PrepareDemote(Demote(id, {To(l0, Format::kINT2)})),
      StatusIs(C::kFailedPrecondition, HasSubstr("shared with a fork")));
  EXPECT_EQ(DeviceUsage(), usage);
  // Only the fork's events were added.
  EXPECT_EQ(CountKind(EventKind::kBlockDemoted), 0u);
  EXPECT_GT(AllEvents().size(), events);
  // An encoding invalid for the shape.
  OpenSequenceRequest odd;
  odd.tenant_id = "acme";
  odd.model = ModelShape{"odd", 1, 1, 1, 48};
  odd.spans = {S(Role::kUser, 16)};
  odd.policy = "bf16";
  auto o = core_->OpenSequence(odd);
  ASSERT_THAT(o, IsOk());
  EXPECT_THAT(
      core_->PrepareDemote(
          Demote(o->sequence_id, {To(o->blocks[0].lineage_id, Format::kTQ2)})),
      StatusIs(C::kInvalidArgument, AllOf(HasSubstr("blocks[0] encoding tq2"),
                                          HasSubstr("head_dim 48"))));
  // Closed sequences cannot be demoted.
  ASSERT_THAT(core_->CloseSequence({"", "acme", mine->sequence_id}), IsOk());
  EXPECT_THAT(
      core_->PrepareDemote(Demote(
          mine->sequence_id, {To(mine->blocks[0].lineage_id, Format::kINT2)})),
      StatusIs(C::kFailedPrecondition, HasSubstr("closed")));
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
