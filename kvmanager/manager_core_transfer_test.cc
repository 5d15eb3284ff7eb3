// TransferSequence through the ManagerCore facade: prepare / commit / abort
// (reservations on the tenant and both workers before and after, events and
// their fields), re-encoding under a destination policy, refusals of every
// kind, idempotency, a worker going DOWN mid-transfer, and a transferring
// sequence refusing Extend / Fork / Truncate / Demote / Close and being
// skipped by pressure plans, the window named at Open travelling with the
// sequence, and the destination's admission under an Open's rules (room,
// tenant ceiling, resume reserve). Deterministic: FakeClock, exact byte numbers
// (manager_core_test_fixture.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/manager_core_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

class TransferTest : public CoreTest {
 protected:
  void SetUp() override {
    CoreTest::SetUp();
    // Less room than w1, so that Opens go to w1.
    ASSERT_THAT(core_->RegisterWorker({"", "w2", "127.0.0.1:9002", "cpu",
                                       1ull << 30, 0, 0, "inc-w2"}),
                IsOk());
    // bf16 everywhere: 20 system + 12 user tokens = 3 blocks of kBf16.
    ASSERT_THAT(core_->CreateTenant({"", "t", {}, "bf16"}), IsOk());
    auto s = Open({S(Role::kSystem, 20), S(Role::kUser, 12)}, "t");
    ASSERT_THAT(s, IsOk());
    ASSERT_EQ(s->worker_id, "w1");
    ASSERT_EQ(s->blocks.size(), 3u);
    seq_ = s->sequence_id;
  }

  TransferSequenceRequest Req(const std::string& dest = "",
                              const std::string& rid = "") {
    TransferSequenceRequest r;
    r.request_id = rid;
    r.tenant_id = "t";
    r.sequence_id = seq_;
    r.destination_worker_id = dest;
    return r;
  }

  uint64_t Reserved(const std::string& worker) {
    for (const WorkerInfo& w : core_->ListWorkers()) {
      if (w.worker_id == worker) return w.reserved_bytes;
    }
    ADD_FAILURE() << "no worker " << worker;
    return 0;
  }

  std::vector<Event> Kind(EventKind k) {
    std::vector<Event> out;
    for (const Event& e : AllEvents()) {
      if (e.kind == k) out.push_back(e);
    }
    return out;
  }

  // Everything a refused or aborted transfer must leave as it was.
  std::string Snapshot() {
    auto s = core_->GetSequence("", seq_);
    EXPECT_THAT(s, IsOk());
    std::string out = absl::StrCat(
        s->worker_id, " ", s->bytes, " ", s->transfer_id, " ", s->policy, " ",
        DeviceUsage("t"), " ", Reserved("w1"), " ", Reserved("w2"));
    for (const BlockPlan& b : s->blocks) {
      absl::StrAppend(&out, " ", b.lineage_id, ":", static_cast<int>(b.tier),
                      ":", EncodingString(b.encoding));
    }
    return out;
  }

  std::string seq_;
};

TEST_F(TransferTest, PrepareReservesAndCommitMovesTheSequence) {
  const uint64_t bytes = 3 * kBf16;
  ASSERT_EQ(DeviceUsage("t"), bytes);
  ASSERT_EQ(Reserved("w1"), bytes);
  ASSERT_EQ(Reserved("w2"), 0u);

  auto p = core_->PrepareTransfer(Req("", "x-1"));
  ASSERT_THAT(p, IsOk());
  EXPECT_FALSE(p->done.has_value());
  EXPECT_EQ(p->transfer_id, "xfer-1");
  EXPECT_EQ(p->source_worker_id, "w1");
  EXPECT_EQ(p->source_address, "127.0.0.1:9001");
  EXPECT_EQ(p->destination_worker_id, "w2");  // placement: the only other
  EXPECT_EQ(p->destination_address, "127.0.0.1:9002");
  EXPECT_EQ(p->worker_request_id, "xfer-1");
  EXPECT_EQ(p->tenant_id, "t");
  EXPECT_EQ(p->sequence_id, seq_);
  EXPECT_EQ(p->block_tokens, 16u);
  EXPECT_EQ(p->model.n_layers, 2u);
  EXPECT_EQ(p->timeout_ms, 10000u);  // ManagerOptions::transfer_timeout_ms
  EXPECT_EQ(p->reserved_bytes, bytes);
  ASSERT_EQ(p->blocks.size(), 3u);
  for (const BlockPlan& b : p->blocks) {
    EXPECT_EQ(b.encoding, Encoding(Format::kBF16));
    EXPECT_EQ(b.tier, Tier::kDevice);
    EXPECT_FALSE(b.evicted);
  }
  // Both copies are charged: the tenant twice, each worker once.
  EXPECT_EQ(DeviceUsage("t"), 2 * bytes);
  EXPECT_EQ(Reserved("w1"), bytes);
  EXPECT_EQ(Reserved("w2"), bytes);
  auto during = core_->GetSequence("t", seq_);
  ASSERT_THAT(during, IsOk());
  EXPECT_EQ(during->worker_id, "w1");  // the source serves until the commit
  EXPECT_EQ(during->transfer_id, "xfer-1");
  EXPECT_EQ(during->transfer_destination_worker_id, "w2");
  auto started = Kind(EventKind::kTransferStarted);
  ASSERT_EQ(started.size(), 1u);
  EXPECT_EQ(started[0].worker_id, "w2");
  EXPECT_EQ(started[0].source_worker_id, "w1");
  EXPECT_EQ(started[0].sequence_id, seq_);
  EXPECT_THAT(started[0].detail, HasSubstr("transfer=xfer-1 blocks=3"));
  EXPECT_THAT(started[0].detail, HasSubstr("placed=true"));

  clock_.AdvanceMs(250);
  TransferImportFigures f{6, 6 * 8192, 6 * 8192, 6 * 8192, 0.125, "ipc"};
  auto c = core_->CommitTransfer(p->token, f);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->source_address, "127.0.0.1:9001");
  EXPECT_EQ(c->tenant_id, "t");
  EXPECT_EQ(c->sequence_id, seq_);
  const TransferSequenceResult& r = c->result;
  EXPECT_EQ(r.transfer_id, "xfer-1");
  EXPECT_EQ(r.source_worker_id, "w1");
  EXPECT_EQ(r.destination_worker_id, "w2");
  EXPECT_EQ(r.blocks, 3u);
  EXPECT_EQ(r.pages, 6u);
  EXPECT_EQ(r.wire_bytes, 6u * 8192);
  EXPECT_EQ(r.bf16_bytes, 6u * 8192);
  EXPECT_EQ(r.source_bytes, bytes);
  EXPECT_DOUBLE_EQ(r.seconds, 0.25);
  EXPECT_DOUBLE_EQ(r.pull_seconds, 0.125);
  EXPECT_EQ(r.data_path, "ipc");
  EXPECT_EQ(r.sequence.worker_id, "w2");
  EXPECT_EQ(r.sequence.worker_address, "127.0.0.1:9002");
  EXPECT_TRUE(r.sequence.transfer_id.empty());
  EXPECT_TRUE(r.sequence.transfer_destination_worker_id.empty());
  // The reservation became the charge; the source's is gone.
  EXPECT_EQ(DeviceUsage("t"), bytes);
  EXPECT_EQ(Reserved("w1"), 0u);
  EXPECT_EQ(Reserved("w2"), bytes);
  for (const WorkerInfo& w : core_->ListWorkers()) {
    EXPECT_EQ(w.sequences, w.worker_id == "w2" ? 1u : 0u) << w.worker_id;
  }
  auto moved = Kind(EventKind::kBlockTransferred);
  ASSERT_EQ(moved.size(), 3u);
  for (size_t i = 0; i < moved.size(); ++i) {
    EXPECT_EQ(moved[i].lineage_id, r.sequence.blocks[i].lineage_id);
    EXPECT_EQ(moved[i].worker_id, "w2");
    EXPECT_EQ(moved[i].source_worker_id, "w1");
    EXPECT_EQ(moved[i].format, Format::kBF16);
    EXPECT_THAT(moved[i].detail, HasSubstr(absl::StrCat("bytes_from=", kBf16,
                                                        " bytes_to=", kBf16)));
  }
  auto done = Kind(EventKind::kSequenceTransferred);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].worker_id, "w2");
  EXPECT_EQ(done[0].source_worker_id, "w1");
  EXPECT_THAT(done[0].detail, HasSubstr("wire_bytes=49152"));
  // The lineage's trace shows the move; the lineage id is unchanged.
  auto trace = core_->QueryTrace(r.sequence.blocks[0].lineage_id);
  ASSERT_THAT(trace, IsOk());
  ASSERT_EQ(trace->events.size(), 2u);
  EXPECT_EQ(trace->events[0].kind, EventKind::kBlockCreated);
  EXPECT_EQ(trace->events[0].worker_id, "w1");
  EXPECT_EQ(trace->events[1].kind, EventKind::kBlockTransferred);

  // A repeat of the request id returns the reply, moving nothing.
  auto again = core_->PrepareTransfer(Req("", "x-1"));
  ASSERT_THAT(again, IsOk());
  ASSERT_TRUE(again->done.has_value());
  EXPECT_EQ(again->done->transfer_id, "xfer-1");
  EXPECT_EQ(again->done->sequence.worker_id, "w2");
  EXPECT_EQ(Kind(EventKind::kTransferStarted).size(), 1u);
  // The sequence lives on: Extend places its new block on w2.
  ExtendSequenceRequest ext;
  ext.tenant_id = "t";
  ext.sequence_id = seq_;
  ext.spans = {S(Role::kAssistant, 16)};
  ext.new_turn = true;
  ASSERT_THAT(core_->ExtendSequence(ext), IsOk());
  EXPECT_EQ(Reserved("w2"), bytes + kBf16);
  EXPECT_EQ(Reserved("w1"), 0u);
  // And it can go back, named.
  auto back = core_->PrepareTransfer(Req("w1"));
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->transfer_id, "xfer-2");
  EXPECT_EQ(back->destination_worker_id, "w1");
  ASSERT_THAT(core_->CommitTransfer(back->token, f), IsOk());
  EXPECT_EQ(Reserved("w1"), bytes + kBf16);
  EXPECT_EQ(Reserved("w2"), 0u);
}

TEST_F(TransferTest, DestinationPolicyReencodesOnTheWay) {
  PolicyInfo int4;
  int4.name = "all-int4";
  PolicyRuleInfo rule;
  rule.encoding = EncodingSpec{Format::kINT4, Format(0), 0, 0};
  int4.rules = {rule};
  ASSERT_THAT(core_->PutPolicy({"", int4}), IsOk());
  TransferSequenceRequest req = Req("w2");
  req.destination_policy = "all-int4";
  req.timeout_ms = 1234;
  req.follow_writes = true;
  auto p = core_->PrepareTransfer(req);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->timeout_ms, 1234u);
  EXPECT_TRUE(p->follow_writes);
  EXPECT_EQ(p->reserved_bytes, 3 * kInt4);
  for (const BlockPlan& b : p->blocks) {
    EXPECT_EQ(b.encoding.k, Format::kINT4);
  }
  EXPECT_EQ(DeviceUsage("t"), 3 * kBf16 + 3 * kInt4);
  EXPECT_EQ(Reserved("w2"), 3 * kInt4);
  auto c = core_->CommitTransfer(p->token, {});
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->result.source_bytes, 3 * kBf16);
  EXPECT_EQ(c->result.sequence.bytes, 3 * kInt4);
  EXPECT_EQ(c->result.sequence.policy, "all-int4");
  for (const BlockPlan& b : c->result.sequence.blocks) {
    EXPECT_EQ(b.encoding.k, Format::kINT4);
  }
  EXPECT_EQ(DeviceUsage("t"), 3 * kInt4);
  EXPECT_EQ(Reserved("w1"), 0u);
  EXPECT_EQ(Reserved("w2"), 3 * kInt4);
  auto moved = Kind(EventKind::kBlockTransferred);
  ASSERT_EQ(moved.size(), 3u);
  EXPECT_EQ(moved[0].format, Format::kINT4);
  EXPECT_THAT(moved[0].detail, HasSubstr(absl::StrCat("bytes_from=", kBf16,
                                                      " bytes_to=", kInt4)));
  // New blocks follow the destination policy.
  ExtendSequenceRequest ext;
  ext.tenant_id = "t";
  ext.sequence_id = seq_;
  ext.spans = {S(Role::kAssistant, 16)};
  auto e = core_->ExtendSequence(ext);
  ASSERT_THAT(e, IsOk());
  ASSERT_EQ(e->new_blocks.size(), 1u);
  EXPECT_EQ(e->new_blocks[0].encoding.k, Format::kINT4);
}

TEST_F(TransferTest, AbortReturnsEveryReservation) {
  const std::string before = Snapshot();
  auto p = core_->PrepareTransfer(Req("w2", "x-1"));
  ASSERT_THAT(p, IsOk());
  EXPECT_NE(Snapshot(), before);
  core_->AbortTransfer(p->token,
                       absl::DataLossError("page 3 checksum mismatch"));
  EXPECT_EQ(Snapshot(), before);
  auto failed = Kind(EventKind::kTransferFailed);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].worker_id, "w2");
  EXPECT_EQ(failed[0].source_worker_id, "w1");
  EXPECT_THAT(failed[0].detail, HasSubstr("transfer=xfer-1"));
  EXPECT_THAT(failed[0].detail, HasSubstr("code=DATA_LOSS"));
  EXPECT_THAT(failed[0].detail, HasSubstr("page 3 checksum mismatch"));
  // The token is gone: a commit is refused, a second abort is a no-op.
  EXPECT_THAT(core_->CommitTransfer(p->token, {}),
              StatusIs(C::kNotFound, HasSubstr("not pending")));
  core_->AbortTransfer(p->token, absl::InternalError("again"));
  EXPECT_EQ(Kind(EventKind::kTransferFailed).size(), 1u);
  // The request id's final reply is the error; a retry (a new request id)
  // succeeds: the sequence is mutable again.
  EXPECT_THAT(core_->PrepareTransfer(Req("w2", "x-1")),
              StatusIs(C::kDataLoss, HasSubstr("page 3 checksum mismatch")));
  auto retry = core_->PrepareTransfer(Req("w2", "x-2"));
  ASSERT_THAT(retry, IsOk());
  EXPECT_EQ(retry->transfer_id, "xfer-2");
  ASSERT_THAT(core_->CommitTransfer(retry->token, {}), IsOk());
  EXPECT_EQ(Reserved("w1"), 0u);
  EXPECT_EQ(Reserved("w2"), 3 * kBf16);
}

TEST_F(TransferTest, TransferringSequenceRefusesMutations) {
  auto p = core_->PrepareTransfer(Req("w2", "x-1"));
  ASSERT_THAT(p, IsOk());
  const auto refused = StatusIs(
      C::kFailedPrecondition,
      HasSubstr(absl::StrCat("sequence \"", seq_,
                             "\" is being transferred (transfer xfer-1")));
  ExtendSequenceRequest ext;
  ext.tenant_id = "t";
  ext.sequence_id = seq_;
  ext.spans = {S(Role::kUser, 4)};
  EXPECT_THAT(core_->ExtendSequence(ext), refused);
  EXPECT_THAT(core_->ForkSequence({"", "t", seq_, 0}), refused);
  EXPECT_THAT(core_->TruncateSequence({"", "t", seq_, 8}), refused);
  EXPECT_THAT(core_->CloseSequence({"", "t", seq_}), refused);
  DemoteBlocksRequest d;
  d.tenant_id = "t";
  d.sequence_id = seq_;
  d.blocks = {BlockEncoding{p->blocks[0].lineage_id,
                            EncodingSpec{Format::kINT4, Format(0), 0, 0}}};
  EXPECT_THAT(core_->PrepareDemote(d), refused);
  // A second transfer: refused; the same request id: in progress.
  EXPECT_THAT(core_->PrepareTransfer(Req("w2", "x-2")), refused);
  EXPECT_THAT(core_->PrepareTransfer(Req("w2", "x-1")),
              StatusIs(C::kAborted, HasSubstr("in progress")));
  // Reads and access reports go on (the source serves until the commit).
  EXPECT_THAT(core_->GetSequence("t", seq_), IsOk());
  ReportAccessRequest access;
  access.tenant_id = "t";
  access.sequence_id = seq_;
  access.lineage_ids = {p->blocks[0].lineage_id};
  EXPECT_THAT(core_->ReportAccess(access), IsOk());
  ASSERT_THAT(core_->CommitTransfer(p->token, {}), IsOk());
  EXPECT_THAT(core_->ExtendSequence(ext), IsOk());
}

TEST_F(TransferTest, PressurePlansSkipATransferringSequence) {
  // A longer sequence, so that blocks lie outside the window guard.
  auto big = Open({S(Role::kUser, 320)}, "t");
  ASSERT_THAT(big, IsOk());
  const std::string big_id = big->sequence_id;
  TransferSequenceRequest req = Req("w2");
  req.sequence_id = big_id;
  auto p = core_->PrepareTransfer(req);
  ASSERT_THAT(p, IsOk());
  // The tenant's ceiling drops below its use: the pressure loop would
  // demote or evict its blocks.
  ASSERT_THAT(core_->SetBudget({"", "t", Budget{Tier::kDevice, 0, 4 * kBf16}}),
              IsOk());
  ASSERT_TRUE(core_->NeedsReclaim());
  auto touches = [&](const TierPlan& plan, const std::string& seq) {
    for (const TierCommand& c : plan.commands) {
      if (c.sequence_id == seq) return true;
    }
    return false;
  };
  core_->RefreshRanking();
  TierPlan plan = core_->PlanPressure();
  EXPECT_FALSE(touches(plan, big_id));
  if (plan.token != 0) {
    ASSERT_THAT(core_->FinishTierPlan(plan.token,
                                      std::vector<absl::Status>(
                                          plan.commands.size(),
                                          absl::UnavailableError("not run"))),
                IsOk());
  }
  core_->AbortTransfer(p->token, absl::CancelledError("test"));
  core_->RefreshRanking();
  EXPECT_TRUE(touches(core_->PlanPressure(), big_id));
}

TEST_F(TransferTest, BadRequestsNameTheField) {
  auto with = [&](auto edit) {
    TransferSequenceRequest r = Req();
    edit(r);
    return core_->PrepareTransfer(r);
  };
  EXPECT_THAT(with([](auto& r) { r.request_id = "bad id!"; }),
              StatusIs(C::kInvalidArgument, HasSubstr("request_id")));
  EXPECT_THAT(with([](auto& r) { r.tenant_id = ""; }),
              StatusIs(C::kInvalidArgument, HasSubstr("tenant_id")));
  EXPECT_THAT(with([](auto& r) { r.sequence_id = "no/such"; }),
              StatusIs(C::kInvalidArgument, HasSubstr("sequence_id")));
  EXPECT_THAT(
      with([](auto& r) { r.destination_worker_id = "w 2"; }),
      StatusIs(C::kInvalidArgument, HasSubstr("destination_worker_id")));
  EXPECT_THAT(with([](auto& r) { r.destination_policy = "a policy"; }),
              StatusIs(C::kInvalidArgument, HasSubstr("destination_policy")));
  EXPECT_THAT(with([](auto& r) { r.timeout_ms = kMaxTransferTimeoutMs + 1; }),
              StatusIs(C::kInvalidArgument, HasSubstr("timeout_ms 3600001")));
  EXPECT_THAT(with([](auto& r) { r.tenant_id = "ghost"; }),
              StatusIs(C::kNotFound, HasSubstr("ghost")));
  EXPECT_THAT(with([](auto& r) { r.sequence_id = "seq-99"; }),
              StatusIs(C::kNotFound, HasSubstr("seq-99")));
  EXPECT_THAT(with([](auto& r) { r.tenant_id = "acme"; }),
              StatusIs(C::kPermissionDenied, HasSubstr("another tenant")));
  EXPECT_THAT(
      with([](auto& r) { r.destination_worker_id = "w1"; }),
      StatusIs(C::kInvalidArgument,
               HasSubstr("destination_worker_id \"w1\" is the worker")));
  EXPECT_THAT(
      with([](auto& r) { r.destination_worker_id = "w9"; }),
      StatusIs(C::kNotFound, HasSubstr("\"w9\" is not a known worker")));
  EXPECT_THAT(with([](auto& r) { r.destination_policy = "nope"; }),
              StatusIs(C::kNotFound, HasSubstr("nope")));
  EXPECT_EQ(Kind(EventKind::kTransferStarted).size(), 0u);
}

TEST_F(TransferTest, RefusalsReserveNothing) {
  const std::string before = Snapshot();
  // The tenant's ceiling: both copies must fit.
  ASSERT_THAT(core_->SetBudget({"", "t", Budget{Tier::kDevice, 0, 5 * kBf16}}),
              IsOk());
  EXPECT_THAT(core_->PrepareTransfer(Req("w2")),
              StatusIs(C::kResourceExhausted, HasSubstr("tenant \"t\"")));
  ASSERT_THAT(core_->SetBudget({"", "t", Budget{Tier::kDevice, 0, 1ull << 40}}),
              IsOk());
  // The destination's room.
  ASSERT_THAT(core_->RegisterWorker(
                  {"", "w3", "127.0.0.1:9003", "cpu", 2 * kBf16, 0, 0, "i3"}),
              IsOk());
  EXPECT_THAT(
      core_->PrepareTransfer(Req("w3")),
      StatusIs(C::kResourceExhausted, HasSubstr("destination worker \"w3\"")));
  EXPECT_EQ(Snapshot(), before);
  // Closed: refused.
  ASSERT_THAT(core_->CloseSequence({"", "t", seq_}), IsOk());
  EXPECT_THAT(core_->PrepareTransfer(Req("w2")),
              StatusIs(C::kFailedPrecondition, HasSubstr("closed")));
  EXPECT_EQ(Kind(EventKind::kTransferStarted).size(), 0u);
}

TEST_F(TransferTest, DestinationMustBeUp) {
  // w2 goes silent: SUSPECT, then DOWN, while w1 heartbeats.
  clock_.AdvanceMs(3001);
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  core_->CheckWorkers();
  EXPECT_THAT(core_->PrepareTransfer(Req("w2")),
              StatusIs(C::kUnavailable,
                       HasSubstr("destination worker \"w2\" is suspect")));
  EXPECT_THAT(
      core_->PrepareTransfer(Req()),
      StatusIs(C::kUnavailable, HasSubstr("besides the source \"w1\"")));
  clock_.AdvanceMs(30000);
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  core_->CheckWorkers();
  EXPECT_THAT(core_->PrepareTransfer(Req("w2")),
              StatusIs(C::kUnavailable,
                       HasSubstr("destination worker \"w2\" is down")));
}

TEST_F(TransferTest, DestinationDownMidTransferAborts) {
  auto p = core_->PrepareTransfer(Req("w2"));
  ASSERT_THAT(p, IsOk());
  // While the import runs, w2's inventory lists the sequence: it is not
  // released.
  Inventory inv;
  inv.sequence_ids = {seq_};
  auto hb = core_->Heartbeat("w2", inv, "inc-w2");
  ASSERT_THAT(hb, IsOk());
  EXPECT_TRUE(hb->release_sequence_ids.empty());
  clock_.AdvanceMs(3001);
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  core_->CheckWorkers();
  clock_.AdvanceMs(30000);
  ASSERT_THAT(core_->Heartbeat("w1", Inventory{}), IsOk());
  core_->CheckWorkers();
  // It comes back as another process before the commit: still refused.
  ASSERT_THAT(core_->RegisterWorker({"", "w2", "127.0.0.1:9002", "cpu",
                                     1ull << 30, 0, 0, "inc-w2b"}),
              IsOk());
  EXPECT_THAT(
      core_->CommitTransfer(p->token, {}),
      StatusIs(C::kAborted, HasSubstr("destination worker \"w2\" went down")));
  EXPECT_EQ(Reserved("w2"), 0u);
  EXPECT_EQ(Reserved("w1"), 3 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 3 * kBf16);
  auto s = core_->GetSequence("t", seq_);
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(s->state, SequenceState::kOpen);
  EXPECT_EQ(s->worker_id, "w1");
  EXPECT_TRUE(s->transfer_id.empty());
  auto failed = Kind(EventKind::kTransferFailed);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_THAT(failed[0].detail, HasSubstr("went down"));
  // Now w2 holds no import: its inventory's copy is released.
  auto hb2 = core_->Heartbeat("w2", inv, "inc-w2b");
  ASSERT_THAT(hb2, IsOk());
  EXPECT_EQ(hb2->release_sequence_ids, std::vector<std::string>{seq_});
}

TEST_F(TransferTest, SourceDownMidTransferAborts) {
  auto p = core_->PrepareTransfer(Req("w2"));
  ASSERT_THAT(p, IsOk());
  clock_.AdvanceMs(3001);
  ASSERT_THAT(core_->Heartbeat("w2", Inventory{}, "inc-w2"), IsOk());
  core_->CheckWorkers();
  clock_.AdvanceMs(30000);
  ASSERT_THAT(core_->Heartbeat("w2", Inventory{}, "inc-w2"), IsOk());
  core_->CheckWorkers();
  auto lost = core_->GetSequence("t", seq_);
  ASSERT_THAT(lost, IsOk());
  EXPECT_EQ(lost->state, SequenceState::kLost);
  EXPECT_THAT(
      core_->CommitTransfer(p->token, {}),
      StatusIs(C::kAborted, HasSubstr("source worker \"w1\" went down")));
  EXPECT_EQ(Reserved("w2"), 0u);
  EXPECT_EQ(DeviceUsage("t"), 0u);
  EXPECT_EQ(Kind(EventKind::kTransferFailed).size(), 1u);
}

TEST_F(TransferTest, WindowNamedAtOpenTravelsWithTheSequence) {
  // seq_ was opened without a window: the destination keeps its own.
  auto plain = core_->PrepareTransfer(Req("w2"));
  ASSERT_THAT(plain, IsOk());
  EXPECT_FALSE(plain->window_tokens.has_value());
  core_->AbortTransfer(plain->token, absl::CancelledError("test"));

  OpenSequenceRequest open;
  open.tenant_id = "t";
  open.model = Model();
  open.spans = {S(Role::kUser, 40)};
  open.window_tokens = 8;
  auto windowed = core_->OpenSequence(open);
  ASSERT_THAT(windowed, IsOk());
  TransferSequenceRequest req = Req("w2");
  req.sequence_id = windowed->sequence_id;
  auto p = core_->PrepareTransfer(req);
  ASSERT_THAT(p, IsOk());
  ASSERT_TRUE(p->window_tokens.has_value());
  EXPECT_EQ(*p->window_tokens, 8u);
  ASSERT_THAT(core_->CommitTransfer(p->token, {}), IsOk());

  // A fork inherits it (the worker's fork does too), and so does its
  // transfer back, after the parent is gone.
  auto fork = core_->ForkSequence({"", "t", windowed->sequence_id, 0});
  ASSERT_THAT(fork, IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "t", windowed->sequence_id}), IsOk());
  TransferSequenceRequest back = Req("w1");
  back.sequence_id = fork->sequence_id;
  auto q = core_->PrepareTransfer(back);
  ASSERT_THAT(q, IsOk());
  ASSERT_TRUE(q->window_tokens.has_value());
  EXPECT_EQ(*q->window_tokens, 8u);
  core_->AbortTransfer(q->token, absl::CancelledError("test"));

  // Window 0 (seal as soon as a block is full) is a window too.
  open.request_id = "";
  open.window_tokens = 0;
  auto zero = core_->OpenSequence(open);
  ASSERT_THAT(zero, IsOk());
  req.sequence_id = zero->sequence_id;
  auto z = core_->PrepareTransfer(req);
  ASSERT_THAT(z, IsOk());
  ASSERT_TRUE(z->window_tokens.has_value());
  EXPECT_EQ(*z->window_tokens, 0u);
  core_->AbortTransfer(z->token, absl::CancelledError("test"));
}

// w3: room for 12 BF16 blocks and a host tier, holding sequence `spilled`
// (11 blocks) of which the pressure manager spilled some blocks to host.
class TransferAdmissionTest : public TransferTest {
 protected:
  void SetUp() override {
    TransferTest::SetUp();
    RegisterWorkerRequest reg;
    reg.worker_id = "w3";
    reg.address = "127.0.0.1:9003";
    reg.backend = "cpu";
    reg.capacity_bytes = 12 * kBf16;
    reg.host_capacity_bytes = 64 * kBf16;
    reg.incarnation = "i3";
    ASSERT_THAT(core_->RegisterWorker(reg), IsOk());
    auto big = Open({S(Role::kSystem, 16), S(Role::kUser, 160)}, "t");
    ASSERT_THAT(big, IsOk());
    ASSERT_EQ(big->blocks.size(), 11u);
    spilled_ = big->sequence_id;
    TransferSequenceRequest req = Req("w3");
    req.sequence_id = spilled_;
    auto p = core_->PrepareTransfer(req);
    ASSERT_THAT(p, IsOk());
    ASSERT_THAT(core_->CommitTransfer(p->token, {}), IsOk());
    // 11 of 12 blocks: above the high watermark (0.9); `spilled_` idles
    // (no CheckWorkers: the workers stay UP).
    clock_.AdvanceMs(int64_t{10} * 60 * 1000);
    core_->RefreshRanking();
    TierPlan plan = core_->PlanPressure();
    ASSERT_NE(plan.token, 0u);
    ASSERT_THAT(core_->FinishTierPlan(
                    plan.token, std::vector<absl::Status>(plan.commands.size(),
                                                          absl::OkStatus())),
                IsOk());
    auto s = core_->GetSequence("t", spilled_);
    ASSERT_THAT(s, IsOk());
    ASSERT_EQ(s->worker_id, "w3");
    for (const BlockPlan& b : s->blocks) {
      if (b.tier == Tier::kHost) on_host_ += 1;
      if (b.tier == Tier::kDevice) on_device_ += 1;
    }
    ASSERT_GT(on_host_, 0u);
    ASSERT_EQ(on_host_ + on_device_, 11u);
  }

  std::string spilled_;
  uint64_t on_host_ = 0, on_device_ = 0;
};

TEST_F(TransferAdmissionTest, DestinationKeepsTheResumeReserveLikeAnOpen) {
  // seq_'s 3 blocks fit w3's pool beside what it holds on the device, but
  // not beside the host bytes held for `spilled_` to come back.
  ASSERT_LE(on_device_ + 3, 12u);
  ASSERT_GT(on_device_ + on_host_ + 3, 12u);
  EXPECT_EQ(Reserved("w3"), on_device_ * kBf16);
  const std::string before = Snapshot();
  EXPECT_THAT(
      core_->PrepareTransfer(Req("w3")),
      StatusIs(
          C::kResourceExhausted,
          ::testing::AllOf(
              HasSubstr("destination worker \"w3\": transfer of sequence"),
              HasSubstr("refused by the resume reserve"),
              HasSubstr(absl::StrCat("request needs ", 3 * kBf16, " bytes")),
              HasSubstr(absl::StrCat(on_host_ * kBf16,
                                     " held for spilled open sequences")),
              HasSubstr(absl::StrCat("over by ",
                                     (on_device_ + on_host_ + 3 - 12) * kBf16,
                                     " bytes")))));
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(Reserved("w3"), on_device_ * kBf16);
  EXPECT_EQ(Kind(EventKind::kTransferStarted).size(), 1u);  // SetUp's only
  // Placement passes over w3 for the same reason and takes w2.
  auto placed = core_->PrepareTransfer(Req());
  ASSERT_THAT(placed, IsOk());
  EXPECT_EQ(placed->destination_worker_id, "w2");
  core_->AbortTransfer(placed->token, absl::CancelledError("test"));
  // Once the spilled sequence is gone, the same transfer is admitted.
  ASSERT_THAT(core_->CloseSequence({"", "t", spilled_}), IsOk());
  auto p = core_->PrepareTransfer(Req("w3"));
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(Reserved("w3"), 3 * kBf16);
}

TEST_F(TransferAdmissionTest, MovingSpilledBlocksAreNotHeldTwice) {
  // `spilled_` moves to w2 whole: its host blocks come back onto w2's
  // device with the transfer, so under the tenant's ceiling they count
  // once (in the reservation), not also as held for resumption.
  const uint64_t need = 11 * kBf16;
  const uint64_t ceiling = DeviceUsage("t") + need;
  ASSERT_THAT(core_->SetBudget({"", "t", Budget{Tier::kDevice, 0, ceiling}}),
              IsOk());
  TransferSequenceRequest req = Req("w2");
  req.sequence_id = spilled_;
  auto p = core_->PrepareTransfer(req);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reserved_bytes, need);
  EXPECT_EQ(DeviceUsage("t"), ceiling);
  core_->AbortTransfer(p->token, absl::CancelledError("test"));
  // One byte less and the tenant's ceiling refuses, naming the rule.
  ASSERT_THAT(
      core_->SetBudget({"", "t", Budget{Tier::kDevice, 0, ceiling - 1}}),
      IsOk());
  EXPECT_THAT(core_->PrepareTransfer(req),
              StatusIs(C::kResourceExhausted,
                       ::testing::AllOf(HasSubstr("from worker \"w3\""),
                                        HasSubstr("the tenant's ceiling"),
                                        HasSubstr("over by 1 bytes"))));
}

}  // namespace
}  // namespace triax::manager
