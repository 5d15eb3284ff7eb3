// Workers that go silent and come back, through the ManagerCore facade
// (manager_core.h "Workers"): UP -> SUSPECT -> UP, SUSPECT -> DOWN (LOST,
// parked), DOWN -> the same incarnation re-registering (sequences OPEN again,
// the rest to release), a new incarnation (LOST as a restart), placement
// around SUSPECT workers, and bad or stale incarnations. FakeClock, no
// sleeps.
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
using C = absl::StatusCode;

constexpr char kBoot[] = "boot-1";

class WorkersTest : public CoreTest {
 protected:
  void SetUp() override {
    CoreTest::SetUp();
    // w1 again with an incarnation (it holds nothing yet).
    ASSERT_THAT(core_->RegisterWorker(Registration(kBoot, {})), IsOk());
  }

  static RegisterWorkerRequest Registration(const std::string& incarnation,
                                            std::vector<std::string> held) {
    RegisterWorkerRequest req{"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40};
    req.incarnation = incarnation;
    req.inventory.sequence_ids = std::move(held);
    return req;
  }
  static Inventory Holding(std::vector<std::string> held) {
    Inventory inv;
    inv.sequence_ids = std::move(held);
    return inv;
  }

  WorkerState StateOf(const std::string& id) {
    for (const WorkerInfo& w : core_->ListWorkers()) {
      if (w.worker_id == id) return w.state;
    }
    return WorkerState::kUnspecified;
  }
  SequenceState SeqState(const std::string& id) {
    auto s = core_->GetSequence("", id);
    EXPECT_THAT(s, IsOk());
    return s.ok() ? s->state : SequenceState::kUnspecified;
  }
  uint64_t Reserved(const std::string& id = "w1") {
    for (const WorkerInfo& w : core_->ListWorkers()) {
      if (w.worker_id == id) return w.reserved_bytes;
    }
    return 0;
  }
  absl::Status Close(const std::string& seq) {
    return core_->CloseSequence({"", "acme", seq}).status();
  }
  std::vector<std::string> Details(EventKind k) {
    std::vector<std::string> out;
    for (const Event& e : AllEvents()) {
      if (e.kind == k) out.push_back(e.detail);
    }
    return out;
  }
  // Silent past worker_timeout_ms (3000), then past worker_down_timeout_ms
  // (30000) when `down`.
  void Silence(bool down) {
    clock_.AdvanceMs(3001);
    std::vector<std::string> suspect;
    EXPECT_THAT(core_->CheckWorkers(&suspect), IsEmpty());
    EXPECT_THAT(suspect, ElementsAre("w1"));
    if (!down) return;
    clock_.AdvanceMs(27000);
    EXPECT_THAT(core_->CheckWorkers(), ElementsAre("w1"));
  }
};

TEST_F(WorkersTest, ASilentWorkerIsSuspectThenUpAgainWithNothingLost) {
  auto seq = Open({S(Role::kUser, 40)});
  auto gone = Open({S(Role::kUser, 16)});
  ASSERT_THAT(seq, IsOk());
  ASSERT_THAT(gone, IsOk());
  const uint64_t usage = DeviceUsage();
  // At the timeout exactly nothing happens; past it, SUSPECT.
  clock_.AdvanceMs(3000);
  EXPECT_THAT(core_->CheckWorkers(), IsEmpty());
  EXPECT_EQ(StateOf("w1"), WorkerState::kUp);
  clock_.AdvanceMs(1);
  std::vector<std::string> suspect;
  EXPECT_THAT(core_->CheckWorkers(&suspect), IsEmpty());
  EXPECT_THAT(suspect, ElementsAre("w1"));
  EXPECT_EQ(StateOf("w1"), WorkerState::kSuspect);
  EXPECT_THAT(Details(EventKind::kWorkerSuspect),
              ElementsAre("silent_ms=3001 sequences=2"));
  // Its sequences stay OPEN and charged; nothing is lost.
  EXPECT_EQ(SeqState(seq->sequence_id), SequenceState::kOpen);
  EXPECT_EQ(DeviceUsage(), usage);
  EXPECT_EQ(CountKind(EventKind::kBlockLost), 0u);
  // Calls that need the worker are UNAVAILABLE naming it; nothing new is
  // placed on it.
  EXPECT_THAT(
      Extend(seq->sequence_id, {S(Role::kUser, 1)}, false),
      StatusIs(C::kUnavailable, HasSubstr("worker \"w1\" of sequence_id \"" +
                                          seq->sequence_id + "\" is suspect")));
  EXPECT_THAT(core_->ForkSequence({"", "acme", seq->sequence_id, 0}),
              StatusIs(C::kUnavailable, HasSubstr("is suspect")));
  EXPECT_THAT(Open({S(Role::kUser, 1)}),
              StatusIs(C::kUnavailable, HasSubstr("no worker is up")));
  // Close works: the worker frees the pages when it is back.
  ASSERT_THAT(Close(gone->sequence_id), IsOk());
  // Staying SUSPECT does not repeat the event.
  clock_.AdvanceMs(1000);
  EXPECT_THAT(core_->CheckWorkers(), IsEmpty());
  EXPECT_EQ(CountKind(EventKind::kWorkerSuspect), 1u);

  // Back with the same incarnation: UP, the closed sequence and an id the
  // manager never knew are to be released, the open one kept.
  auto hb = core_->Heartbeat(
      "w1", Holding({seq->sequence_id, gone->sequence_id, "seq-999"}), kBoot);
  ASSERT_THAT(hb, IsOk());
  EXPECT_THAT(hb->release_sequence_ids,
              ElementsAre(gone->sequence_id, "seq-999"));
  EXPECT_EQ(StateOf("w1"), WorkerState::kUp);
  EXPECT_THAT(Details(EventKind::kWorkerRecovered),
              ElementsAre("from=suspect silent_ms=4001 sequences=1"));
  EXPECT_THAT(Extend(seq->sequence_id, {S(Role::kUser, 1)}, false), IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 1)}), IsOk());
  // An ordinary heartbeat releases nothing it should keep.
  auto hb2 = core_->Heartbeat("w1", Holding({seq->sequence_id}), kBoot);
  ASSERT_THAT(hb2, IsOk());
  EXPECT_THAT(hb2->release_sequence_ids, IsEmpty());
  EXPECT_EQ(CountKind(EventKind::kWorkerRecovered), 1u);
}

// Inventory.sealed_blocks: one EVENT_BLOCK_SEALED per live block of the
// reporting worker, at the worker's time (never ahead of the manager's).
TEST_F(WorkersTest, SealedBlocksTheWorkerReportsBecomeEvents) {
  auto seq = Open({S(Role::kUser, 40)});
  ASSERT_THAT(seq, IsOk());
  ASSERT_GE(seq->blocks.size(), 2u);
  const int64_t now = clock_.NowMs();
  Inventory inv = Holding({seq->sequence_id});
  inv.sealed_blocks = {{seq->blocks[0].lineage_id, now - 50},
                       {999999, now - 40},  // not a block: skipped
                       {seq->blocks[1].lineage_id, now + 1000}};
  ASSERT_THAT(core_->Heartbeat("w1", inv, kBoot), IsOk());
  std::vector<Event> sealed;
  for (const Event& e : AllEvents()) {
    if (e.kind == EventKind::kBlockSealed) sealed.push_back(e);
  }
  ASSERT_EQ(sealed.size(), 2u);
  EXPECT_EQ(sealed[0].lineage_id, seq->blocks[0].lineage_id);
  EXPECT_EQ(sealed[0].unix_ms, now - 50);
  EXPECT_EQ(sealed[0].worker_id, "w1");
  EXPECT_EQ(sealed[0].sequence_id, seq->sequence_id);
  EXPECT_EQ(sealed[0].tenant_id, "acme");
  EXPECT_THAT(sealed[0].detail, HasSubstr("encoding="));
  EXPECT_EQ(sealed[1].lineage_id, seq->blocks[1].lineage_id);
  EXPECT_EQ(sealed[1].unix_ms, now);  // clamped to the manager's clock
  // Reported once: the next heartbeat carries nothing new.
  ASSERT_THAT(core_->Heartbeat("w1", Holding({seq->sequence_id}), kBoot),
              IsOk());
  EXPECT_EQ(CountKind(EventKind::kBlockSealed), 2u);
  // Another worker's report of w1's block is not news.
  RegisterWorkerRequest w2{"", "w2", "127.0.0.1:9002", "cpu", 1ull << 40};
  w2.inventory.sealed_blocks = {{seq->blocks[0].lineage_id, now}};
  ASSERT_THAT(core_->RegisterWorker(w2), IsOk());
  EXPECT_EQ(CountKind(EventKind::kBlockSealed), 2u);
}

TEST_F(WorkersTest, SuspectPastTheDownTimeoutLosesItsSequences) {
  auto seq = Open({S(Role::kUser, 40)});
  ASSERT_THAT(seq, IsOk());
  Silence(/*down=*/true);
  EXPECT_EQ(StateOf("w1"), WorkerState::kDown);
  EXPECT_EQ(SeqState(seq->sequence_id), SequenceState::kLost);
  EXPECT_EQ(DeviceUsage(), 0u);
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(CountKind(EventKind::kBlockLost), 3u);
  EXPECT_EQ(CountKind(EventKind::kWorkerDown), 1u);
  // Heartbeats of a DOWN worker are refused so that it re-registers.
  EXPECT_THAT(core_->Heartbeat("w1", Holding({seq->sequence_id}), kBoot),
              StatusIs(C::kNotFound, HasSubstr("re-register")));
}

TEST_F(WorkersTest, DownThenTheSameIncarnationTakesItsSequencesBack) {
  auto parent = Open({S(Role::kSystem, 16), S(Role::kUser, 20)});
  ASSERT_THAT(parent, IsOk());
  auto fork = core_->ForkSequence({"", "acme", parent->sequence_id, 0});
  ASSERT_THAT(fork, IsOk());
  auto closed = Open({S(Role::kUser, 16)});
  auto dropped = Open({S(Role::kUser, 16)});
  ASSERT_THAT(closed, IsOk());
  ASSERT_THAT(dropped, IsOk());
  ASSERT_THAT(Close(closed->sequence_id), IsOk());
  const uint64_t usage = DeviceUsage();
  const uint64_t reserved = Reserved();
  ASSERT_GT(usage, 0u);

  Silence(/*down=*/true);
  ASSERT_EQ(DeviceUsage(), 0u);
  ASSERT_EQ(SeqState(parent->sequence_id), SequenceState::kLost);
  EXPECT_THAT(Extend(parent->sequence_id, {S(Role::kUser, 1)}, false),
              StatusIs(C::kFailedPrecondition, HasSubstr("lost")));

  // It returns holding the parent, the fork, the sequence closed before and
  // an unknown one; `dropped` is not in its inventory.
  auto reg = core_->RegisterWorker(
      Registration(kBoot, {parent->sequence_id, fork->sequence_id,
                           closed->sequence_id, "seq-777"}));
  ASSERT_THAT(reg, IsOk());
  EXPECT_THAT(reg->lost_sequence_ids, IsEmpty());
  EXPECT_THAT(reg->recovered_sequence_ids,
              ElementsAre(parent->sequence_id, fork->sequence_id));
  EXPECT_THAT(reg->release_sequence_ids,
              ElementsAre(closed->sequence_id, "seq-777"));
  EXPECT_EQ(StateOf("w1"), WorkerState::kUp);

  // OPEN again with the same blocks (lineage ids, shares) and bytes.
  auto p = core_->GetSequence("acme", parent->sequence_id);
  auto f = core_->GetSequence("acme", fork->sequence_id);
  ASSERT_THAT(p, IsOk());
  ASSERT_THAT(f, IsOk());
  EXPECT_EQ(p->state, SequenceState::kOpen);
  EXPECT_EQ(f->state, SequenceState::kOpen);
  EXPECT_TRUE(p->lost_lineage_ids.empty());
  ASSERT_EQ(p->blocks.size(), parent->blocks.size());
  for (size_t i = 0; i < p->blocks.size(); ++i) {
    EXPECT_EQ(p->blocks[i].lineage_id, parent->blocks[i].lineage_id);
    EXPECT_EQ(p->blocks[i].refcount, 2u);  // shared with the fork again
    EXPECT_EQ(f->blocks[i].lineage_id, parent->blocks[i].lineage_id);
  }
  EXPECT_EQ(p->bytes, parent->bytes);
  EXPECT_EQ(p->turns, parent->turns);
  EXPECT_EQ(SeqState(dropped->sequence_id), SequenceState::kLost);
  const uint64_t dropped_bytes = dropped->bytes;
  EXPECT_EQ(DeviceUsage(), usage - dropped_bytes);
  EXPECT_EQ(Reserved(), reserved - dropped_bytes);
  EXPECT_EQ(core_->GetTenant("acme")->open_sequences, 2u);
  EXPECT_EQ(CountKind(EventKind::kSequenceRecovered), 2u);
  EXPECT_THAT(Details(EventKind::kWorkerRecovered),
              ElementsAre("from=down recovered_sequences=2"));
  auto trace = core_->QueryTrace(parent->blocks[0].lineage_id);
  ASSERT_THAT(trace, IsOk());
  EXPECT_EQ(trace->sequence_id, parent->sequence_id);

  // They work as before, and closing them returns every byte.
  EXPECT_THAT(Extend(parent->sequence_id, {S(Role::kUser, 5)}, true), IsOk());
  ASSERT_THAT(Close(fork->sequence_id), IsOk());
  ASSERT_THAT(Close(parent->sequence_id), IsOk());
  EXPECT_EQ(DeviceUsage(), 0u);
  EXPECT_EQ(Reserved(), 0u);
  // The parked copies were taken once: a second return recovers nothing.
  Silence(/*down=*/true);
  auto again =
      core_->RegisterWorker(Registration(kBoot, {dropped->sequence_id}));
  ASSERT_THAT(again, IsOk());
  EXPECT_THAT(again->recovered_sequence_ids, IsEmpty());
  EXPECT_THAT(again->release_sequence_ids, ElementsAre(dropped->sequence_id));
  EXPECT_EQ(SeqState(dropped->sequence_id), SequenceState::kLost);
}

TEST_F(WorkersTest, ANewIncarnationIsARestart) {
  auto seq = Open({S(Role::kUser, 40)});
  auto up = Open({S(Role::kUser, 40)});
  ASSERT_THAT(seq, IsOk());
  ASSERT_THAT(up, IsOk());
  Silence(/*down=*/true);
  auto reg = core_->RegisterWorker(Registration("boot-2", {seq->sequence_id}));
  ASSERT_THAT(reg, IsOk());
  EXPECT_THAT(reg->recovered_sequence_ids, IsEmpty());
  EXPECT_THAT(reg->release_sequence_ids, ElementsAre(seq->sequence_id));
  EXPECT_EQ(SeqState(seq->sequence_id), SequenceState::kLost);
  EXPECT_EQ(CountKind(EventKind::kWorkerRecovered), 0u);
  EXPECT_EQ(DeviceUsage(), 0u);
  // Its parked sequences are gone for good: the old incarnation coming back
  // later (boot-2 silent for two heartbeat intervals) is a restart too.
  clock_.AdvanceMs(2000);
  auto old = core_->RegisterWorker(Registration(kBoot, {seq->sequence_id}));
  ASSERT_THAT(old, IsOk());
  EXPECT_THAT(old->recovered_sequence_ids, IsEmpty());
  EXPECT_EQ(SeqState(seq->sequence_id), SequenceState::kLost);

  // While UP: another incarnation loses what it had; the same one (a
  // retried registration) keeps it.
  auto open = Open({S(Role::kUser, 16)});
  ASSERT_THAT(open, IsOk());
  auto same = core_->RegisterWorker(Registration(kBoot, {open->sequence_id}));
  ASSERT_THAT(same, IsOk());
  EXPECT_THAT(same->lost_sequence_ids, IsEmpty());
  EXPECT_THAT(same->release_sequence_ids, IsEmpty());
  EXPECT_EQ(SeqState(open->sequence_id), SequenceState::kOpen);
  clock_.AdvanceMs(2000);  // the old incarnation missed two heartbeats
  auto other = core_->RegisterWorker(Registration("boot-3", {}));
  ASSERT_THAT(other, IsOk());
  EXPECT_THAT(other->lost_sequence_ids, ElementsAre(open->sequence_id));
  EXPECT_EQ(SeqState(open->sequence_id), SequenceState::kLost);
}

TEST_F(WorkersTest, SecondProcessUnderALiveIdIsRefused) {
  auto open = Open({S(Role::kUser, 16)});
  ASSERT_THAT(open, IsOk());
  // Given w1 heartbeating under kBoot, when another incarnation registers at
  // the same address, it is refused and w1 keeps its sequence.
  clock_.AdvanceMs(900);
  ASSERT_THAT(core_->Heartbeat("w1", Holding({open->sequence_id}), kBoot),
              IsOk());
  clock_.AdvanceMs(1999);
  EXPECT_THAT(core_->RegisterWorker(Registration("boot-2", {})),
              StatusIs(C::kAlreadyExists,
                       HasSubstr("worker_id \"w1\" is up at address "
                                 "\"127.0.0.1:9001\" with incarnation "
                                 "\"boot-1\" (last heartbeat 1999 ms ago); "
                                 "incarnation \"boot-2\" cannot take it")));
  EXPECT_EQ(SeqState(open->sequence_id), SequenceState::kOpen);
  EXPECT_THAT(core_->Heartbeat("w1", Holding({open->sequence_id}), kBoot),
              IsOk());
  // The same incarnation (a retried registration) is still let in.
  EXPECT_THAT(core_->RegisterWorker(Registration(kBoot, {open->sequence_id})),
              IsOk());
  EXPECT_EQ(SeqState(open->sequence_id), SequenceState::kOpen);
  // When w1 has been silent for two heartbeat intervals, the new incarnation
  // is a restart: w1's sequence is LOST.
  clock_.AdvanceMs(2000);
  auto restarted = core_->RegisterWorker(Registration("boot-2", {}));
  ASSERT_THAT(restarted, IsOk());
  EXPECT_THAT(restarted->lost_sequence_ids, ElementsAre(open->sequence_id));
  EXPECT_EQ(SeqState(open->sequence_id), SequenceState::kLost);
  EXPECT_EQ(core_->ListWorkers()[0].incarnation, "boot-2");
  // The old process's heartbeat is now stale.
  EXPECT_THAT(core_->Heartbeat("w1", Inventory{}, kBoot),
              StatusIs(C::kFailedPrecondition, HasSubstr("stale")));
}

TEST_F(WorkersTest, RestartOfASuspectWorkerIsTakenAtOnce) {
  auto open = Open({S(Role::kUser, 16)});
  ASSERT_THAT(open, IsOk());
  Silence(/*down=*/false);
  ASSERT_EQ(StateOf("w1"), WorkerState::kSuspect);
  auto restarted = core_->RegisterWorker(Registration("boot-2", {}));
  ASSERT_THAT(restarted, IsOk());
  EXPECT_THAT(restarted->lost_sequence_ids, ElementsAre(open->sequence_id));
  EXPECT_EQ(StateOf("w1"), WorkerState::kUp);
}

TEST_F(WorkersTest, RecoveryChargesEvenAboveALoweredCeiling) {
  auto seq = Open({S(Role::kUser, 48)});  // 3 BF16 blocks
  ASSERT_THAT(seq, IsOk());
  Silence(/*down=*/true);
  ASSERT_THAT(
      core_->SetBudget({"", "acme", Budget{Tier::kDevice, 0, 2 * kBf16}}),
      IsOk());
  auto reg = core_->RegisterWorker(Registration(kBoot, {seq->sequence_id}));
  ASSERT_THAT(reg, IsOk());
  EXPECT_THAT(reg->recovered_sequence_ids, ElementsAre(seq->sequence_id));
  EXPECT_EQ(DeviceUsage(), 3 * kBf16);
  EXPECT_THAT(Details(EventKind::kSequenceRecovered),
              ElementsAre(HasSubstr("over_ceiling_bytes=16384")));
  // The pressure loop has something to do: bring the tenant to its ceiling.
  EXPECT_TRUE(core_->NeedsReclaim());
}

TEST_F(WorkersTest, PlacementGoesAroundASuspectWorker) {
  ASSERT_THAT(
      core_->RegisterWorker({"", "w2", "127.0.0.1:9002", "cpu", 1 << 20}),
      IsOk());
  // w1 has far more room; SUSPECT, it takes nothing.
  clock_.AdvanceMs(2000);
  ASSERT_THAT(core_->Heartbeat("w2", Inventory{}), IsOk());
  clock_.AdvanceMs(1001);
  std::vector<std::string> suspect;
  core_->CheckWorkers(&suspect);
  EXPECT_THAT(suspect, ElementsAre("w1"));
  auto seq = Open({S(Role::kUser, 16)});
  ASSERT_THAT(seq, IsOk());
  EXPECT_EQ(seq->worker_id, "w2");
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}, kBoot), IsOk());
  auto next = Open({S(Role::kUser, 16)});
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->worker_id, "w1");
}

TEST_F(WorkersTest, ReclaimTakesNothingOnASuspectWorker) {
  // Given blocks ranked while w1 was UP (200 tokens: 13 blocks, those
  // before the 64-token window guard rankable)
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(Open({S(Role::kUser, 200)}), IsOk());
  }
  // and a tenant at its device ceiling (the ceiling's reclaim looks at
  // every worker),
  ASSERT_THAT(
      core_->SetBudget({"", "acme", Budget{Tier::kDevice, 0, DeviceUsage()}}),
      IsOk());
  core_->RefreshRanking();
  const AdmissionShortfall need{"acme", "w1", 4 * kBf16};
  // when w1 goes SUSPECT, a reclaim plan takes none of its blocks (the
  // worker calls could not run);
  Silence(/*down=*/false);
  EXPECT_EQ(core_->PlanAdmission(need).token, 0u);
  // back UP, the same ranking serves again.
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}, kBoot), IsOk());
  const TierPlan plan = core_->PlanAdmission(need);
  ASSERT_NE(plan.token, 0u);
  for (const TierCommand& c : plan.commands) EXPECT_EQ(c.worker_id, "w1");
  ASSERT_THAT(core_->FinishTierPlan(
                  plan.token, std::vector<absl::Status>(plan.commands.size(),
                                                        absl::OkStatus())),
              IsOk());
}

TEST_F(WorkersTest, BadAndStaleIncarnationsAreRefused) {
  EXPECT_THAT(core_->Heartbeat("w1", Inventory{}),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("incarnation is empty; worker_id \"w1\" "
                                 "registered with incarnation \"boot-1\"")));
  EXPECT_THAT(core_->Heartbeat("w1", Inventory{}, "boot 1"),
              StatusIs(C::kInvalidArgument, HasSubstr("incarnation")));
  EXPECT_THAT(core_->Heartbeat("w1", Inventory{}, "boot-0"),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("incarnation \"boot-0\" is stale")));
  EXPECT_THAT(core_->RegisterWorker(Registration("bad/incarnation", {})),
              StatusIs(C::kInvalidArgument, HasSubstr("incarnation")));
  EXPECT_THAT(core_->RegisterWorker(Registration(std::string(200, 'a'), {})),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("incarnation is 200 bytes long")));
  // A refused heartbeat changes nothing: still UP under boot-1.
  EXPECT_THAT(core_->Heartbeat("w1", Inventory{}, kBoot), IsOk());
  EXPECT_EQ(core_->ListWorkers()[0].incarnation, kBoot);
}

// Blocks spilled to the host tier before the worker went DOWN come back in
// that tier, charged there, not on the device.
TEST(WorkersSpillTest, SpilledBlocksComeBackInTheirTier) {
  FakeClock clock;
  auto made = ManagerCore::Create(ManagerOptions{}, &clock);
  ASSERT_THAT(made, IsOk());
  ManagerCore& core = **made;
  RegisterWorkerRequest reg{"",    "w1",       "127.0.0.1:9001",
                            "cpu", 28 * kBf16, 64 * kBf16};
  reg.incarnation = kBoot;
  ASSERT_THAT(core.RegisterWorker(reg), IsOk());
  CreateTenantRequest t;
  t.tenant_id = "t";
  t.default_policy = "bf16";
  ASSERT_THAT(core.CreateTenant(t), IsOk());
  auto open = [&]() {
    OpenSequenceRequest req;
    req.tenant_id = "t";
    req.model = Model();
    req.spans = {S(Role::kSystem, 16), S(Role::kUser, 128)};
    return core.OpenSequence(req);
  };
  auto usage = [&]() {
    std::vector<uint64_t> out;
    const absl::StatusOr<TenantInfo> tenant = core.GetTenant("t");
    EXPECT_THAT(tenant, IsOk());
    for (const TierUsage& u : tenant->usage) out.push_back(u.used_bytes);
    return out;
  };
  auto idle = open();
  ASSERT_THAT(idle, IsOk());
  clock.AdvanceMs(int64_t{10} * 60 * 1000);
  ASSERT_THAT(core.Heartbeat("w1", Inventory{}, kBoot), IsOk());
  ASSERT_THAT(open(), IsOk());
  ASSERT_THAT(open(), IsOk());
  core.RefreshRanking();
  TierPlan plan = core.PlanPressure();
  ASSERT_NE(plan.token, 0u);
  ASSERT_THAT(core.FinishTierPlan(
                  plan.token, std::vector<absl::Status>(plan.commands.size())),
              IsOk());
  auto before = core.GetSequence("", idle->sequence_id);
  ASSERT_THAT(before, IsOk());
  size_t on_host = 0;
  for (const BlockPlan& b : before->blocks) on_host += b.tier == Tier::kHost;
  ASSERT_GT(on_host, 0u);
  const std::vector<uint64_t> used = usage();
  const uint64_t reserved = core.ListWorkers()[0].reserved_bytes;

  clock.AdvanceMs(3001);
  core.CheckWorkers();
  clock.AdvanceMs(27000);
  ASSERT_THAT(core.CheckWorkers(), ElementsAre("w1"));
  for (uint64_t u : usage()) EXPECT_EQ(u, 0u);
  reg.inventory.sequence_ids = {"seq-1", "seq-2", "seq-3"};
  auto back = core.RegisterWorker(reg);
  ASSERT_THAT(back, IsOk());
  EXPECT_THAT(back->recovered_sequence_ids,
              ElementsAre("seq-1", "seq-2", "seq-3"));
  EXPECT_EQ(usage(), used);
  EXPECT_EQ(core.ListWorkers()[0].reserved_bytes, reserved);
  auto after = core.GetSequence("", idle->sequence_id);
  ASSERT_THAT(after, IsOk());
  ASSERT_EQ(after->blocks.size(), before->blocks.size());
  for (size_t i = 0; i < after->blocks.size(); ++i) {
    EXPECT_EQ(after->blocks[i].tier, before->blocks[i].tier);
    EXPECT_EQ(after->blocks[i].lineage_id, before->blocks[i].lineage_id);
  }
  EXPECT_EQ(after->bytes, before->bytes);
  // It still counts as spilled: a prefetch plans its restores (or says
  // what room they need).
  AdmissionShortfall sf;
  TierPlan prefetch = core.PlanPrefetch(idle->sequence_id, &sf);
  EXPECT_TRUE(prefetch.token != 0 || sf.request_bytes > 0);
  if (prefetch.token != 0) {
    ASSERT_THAT(core.FinishTierPlan(
                    prefetch.token,
                    std::vector<absl::Status>(prefetch.commands.size())),
                IsOk());
  }
  for (const std::string& id : back->recovered_sequence_ids) {
    ASSERT_THAT(core.CloseSequence({"", "t", id}), IsOk());
  }
  for (uint64_t u : usage()) EXPECT_EQ(u, 0u);
  EXPECT_EQ(core.ListWorkers()[0].reserved_bytes, 0u);
}

TEST(WorkersOptionsTest, TheDownTimeoutMustBeAboveTheSuspectTimeout) {
  FakeClock clock;
  ManagerOptions o;
  o.worker_timeout_ms = 3000;
  o.worker_down_timeout_ms = 3000;
  EXPECT_THAT(ManagerCore::Create(o, &clock),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("worker_down_timeout_ms 3000 must be > "
                                 "worker_timeout_ms 3000")));
  o.worker_down_timeout_ms = 3001;
  EXPECT_THAT(ManagerCore::Create(o, &clock), IsOk());
}

}  // namespace
}  // namespace triax::manager
