// TransferSequence of shared blocks and prefix hits through the ManagerCore
// facade: a sequence whose blocks a fork shares moves them as copies (both
// workers charged while both hold them); a fork of it then moves with
// first_block = the shared blocks and the moved one as the destination's
// prefix sequence: only the other blocks are reserved and charged, the
// shared ones join the destination's copy, events say which blocks moved
// and which were shared, an abort returns everything, and every rule of the
// request is refused by name. Deterministic: FakeClock, exact byte numbers.
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

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

const TransferImportFigures kFigures{2,        2 * 8192, 2 * 8192,
                                     2 * 8192, 0.01,     "stream"};

class PrefixTransferTest : public CoreTest {
 protected:
  // S0 (32 system tokens: 2 full blocks) on w1; S1 forks all of it and
  // adds 12 user tokens (block 2, its own). bf16: kBf16 per block.
  void SetUp() override {
    CoreTest::SetUp();
    ASSERT_THAT(core_->RegisterWorker({"", "w2", "127.0.0.1:9002", "cpu",
                                       1ull << 30, 0, 0, "inc-w2"}),
                IsOk());
    ASSERT_THAT(core_->CreateTenant({"", "t", {}, "bf16"}), IsOk());
    auto s0 = Open({S(Role::kSystem, 32)}, "t");
    ASSERT_THAT(s0, IsOk());
    ASSERT_EQ(s0->worker_id, "w1");
    ASSERT_EQ(s0->blocks.size(), 2u);
    s0_ = s0->sequence_id;
    auto s1 = core_->ForkSequence({"", "t", s0_, 0});
    ASSERT_THAT(s1, IsOk());
    s1_ = s1->sequence_id;
    ExtendSequenceRequest ext;
    ext.tenant_id = "t";
    ext.sequence_id = s1_;
    ext.spans = {S(Role::kUser, 12)};
    ext.new_turn = true;
    ASSERT_THAT(core_->ExtendSequence(ext), IsOk());
    auto info = core_->GetSequence("t", s1_);
    ASSERT_THAT(info, IsOk());
    ASSERT_EQ(info->blocks.size(), 3u);
    for (const BlockPlan& b : info->blocks) lineages_.push_back(b.lineage_id);
    ASSERT_EQ(DeviceUsage("t"), 3 * kBf16);
  }

  TransferSequenceRequest Req(const std::string& seq, uint32_t first_block,
                              const std::string& prefix,
                              const std::string& dest = "") {
    TransferSequenceRequest r;
    r.tenant_id = "t";
    r.sequence_id = seq;
    r.destination_worker_id = dest;
    r.first_block = first_block;
    r.destination_prefix_sequence_id = prefix;
    return r;
  }
  uint64_t Reserved(const std::string& worker) {
    for (const WorkerInfo& w : core_->ListWorkers()) {
      if (w.worker_id == worker) return w.reserved_bytes;
    }
    ADD_FAILURE() << "no worker " << worker;
    return 0;
  }
  std::vector<Event> Kind(EventKind k, const std::string& seq) {
    std::vector<Event> out;
    for (const Event& e : AllEvents()) {
      if (e.kind == k && e.sequence_id == seq) out.push_back(e);
    }
    return out;
  }
  // S0 moves to w2: its two blocks are shared with S1, so they move as
  // copies and w1 keeps its copies for S1.
  void MoveS0() {
    auto p = core_->PrepareTransfer(Req(s0_, 0, "", "w2"));
    ASSERT_THAT(p, IsOk());
    EXPECT_EQ(p->reserved_bytes, 2 * kBf16);
    EXPECT_EQ(p->prefix_blocks, 0u);
    ASSERT_THAT(core_->CommitTransfer(p->token, kFigures), IsOk());
  }

  std::string s0_, s1_;
  std::vector<uint64_t> lineages_;
};

TEST_F(PrefixTransferTest, ASharedBlockMovesAsACopy) {
  MoveS0();
  // Both workers hold blocks 0 and 1: the tenant pays for both copies.
  EXPECT_EQ(Reserved("w1"), 3 * kBf16);
  EXPECT_EQ(Reserved("w2"), 2 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 5 * kBf16);
  auto moved = Kind(EventKind::kBlockTransferred, s0_);
  ASSERT_EQ(moved.size(), 2u);
  EXPECT_THAT(moved[0].detail, HasSubstr("copy=true refcount=2"));
  auto s0 = core_->GetSequence("t", s0_);
  ASSERT_THAT(s0, IsOk());
  EXPECT_EQ(s0->worker_id, "w2");
  EXPECT_EQ(s0->bytes, 2 * kBf16);
  // Each copy is returned with its last holder on its worker.
  ASSERT_THAT(core_->CloseSequence({"", "t", s1_}), IsOk());
  EXPECT_EQ(Reserved("w1"), 0u);
  EXPECT_EQ(Reserved("w2"), 2 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 2 * kBf16);
  ASSERT_THAT(core_->CloseSequence({"", "t", s0_}), IsOk());
  EXPECT_EQ(Reserved("w2"), 0u);
  EXPECT_EQ(DeviceUsage("t"), 0u);
}

TEST_F(PrefixTransferTest, APrefixHitReservesAndMovesOnlyTheOtherBlocks) {
  MoveS0();
  auto p = core_->PrepareTransfer(Req(s1_, 2, s0_));
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->destination_worker_id, "w2");  // the prefix's worker
  EXPECT_EQ(p->prefix_sequence_id, s0_);
  EXPECT_EQ(p->prefix_blocks, 2u);
  ASSERT_EQ(p->blocks.size(), 3u);  // the whole plan
  EXPECT_EQ(p->blocks[0].lineage_id, lineages_[0]);
  EXPECT_EQ(p->blocks[2].lineage_id, lineages_[2]);
  // Only block 2 is reserved.
  EXPECT_EQ(p->reserved_bytes, kBf16);
  EXPECT_EQ(Reserved("w2"), 3 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 6 * kBf16);
  auto started = Kind(EventKind::kTransferStarted, s1_);
  ASSERT_EQ(started.size(), 1u);
  EXPECT_THAT(started[0].detail,
              AllOf(HasSubstr("blocks=1 reserved_bytes=16384"),
                    HasSubstr(absl::StrCat("first_block=2 prefix=", s0_))));

  auto c = core_->CommitTransfer(p->token, kFigures);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->result.blocks, 1u);
  EXPECT_EQ(c->result.shared_blocks, 2u);
  EXPECT_EQ(c->result.source_bytes, kBf16);
  EXPECT_EQ(c->result.sequence.worker_id, "w2");
  EXPECT_EQ(c->result.sequence.bytes, 3 * kBf16);
  // w1 held blocks 0..2 for S1 only: all returned. w2 holds each once.
  EXPECT_EQ(Reserved("w1"), 0u);
  EXPECT_EQ(Reserved("w2"), 3 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 3 * kBf16);
  // Events: the shared blocks, then the moved one.
  auto blocks = Kind(EventKind::kBlockTransferred, s1_);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_THAT(blocks[0].detail,
              HasSubstr(absl::StrCat("index=0 shared=true prefix=", s0_)));
  EXPECT_THAT(blocks[1].detail, HasSubstr("index=1 shared=true"));
  EXPECT_THAT(blocks[2].detail, HasSubstr("index=2 from=bf16"));
  auto done = Kind(EventKind::kSequenceTransferred, s1_);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_THAT(done[0].detail,
              HasSubstr(absl::StrCat("shared_blocks=2 prefix=", s0_)));
  // The trace of a shared block shows it on the destination for S1 too.
  auto trace = core_->QueryTrace(lineages_[0]);
  ASSERT_THAT(trace, IsOk());
  bool seen = false;
  for (const Event& e : trace->events) {
    seen = seen ||
           (e.kind == EventKind::kBlockTransferred && e.sequence_id == s1_ &&
            e.worker_id == "w2" && e.source_worker_id == "w1");
  }
  EXPECT_TRUE(seen);
  // Closing the prefix leaves S1's blocks charged once on w2.
  ASSERT_THAT(core_->CloseSequence({"", "t", s0_}), IsOk());
  EXPECT_EQ(Reserved("w2"), 3 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 3 * kBf16);
  ASSERT_THAT(core_->CloseSequence({"", "t", s1_}), IsOk());
  EXPECT_EQ(Reserved("w2"), 0u);
  EXPECT_EQ(DeviceUsage("t"), 0u);
}

// S2 forks all of S0: with first_block = its 2 blocks nothing is reserved
// or moved; w1 keeps its copies while S1 holds them there.
TEST_F(PrefixTransferTest, EveryBlockSharedMovesNothing) {
  auto s2 = core_->ForkSequence({"", "t", s0_, 0});
  ASSERT_THAT(s2, IsOk());
  MoveS0();
  EXPECT_EQ(Reserved("w1"), 3 * kBf16);
  EXPECT_EQ(Reserved("w2"), 2 * kBf16);
  auto p = core_->PrepareTransfer(Req(s2->sequence_id, 2, s0_));
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reserved_bytes, 0u);
  auto c = core_->CommitTransfer(p->token, TransferImportFigures{});
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->result.blocks, 0u);
  EXPECT_EQ(c->result.shared_blocks, 2u);
  EXPECT_EQ(c->result.sequence.bytes, 2 * kBf16);
  EXPECT_EQ(Reserved("w1"), 3 * kBf16);  // S1 still holds blocks 0, 1 there
  EXPECT_EQ(Reserved("w2"), 2 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 5 * kBf16);
  // S1 closes: w1's copies go; S0 closes: S2 keeps w2's.
  ASSERT_THAT(core_->CloseSequence({"", "t", s1_}), IsOk());
  EXPECT_EQ(Reserved("w1"), 0u);
  ASSERT_THAT(core_->CloseSequence({"", "t", s0_}), IsOk());
  EXPECT_EQ(Reserved("w2"), 2 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 2 * kBf16);
  ASSERT_THAT(core_->CloseSequence({"", "t", s2->sequence_id}), IsOk());
  EXPECT_EQ(Reserved("w2"), 0u);
  EXPECT_EQ(DeviceUsage("t"), 0u);
}

TEST_F(PrefixTransferTest, AnAbortReturnsEveryReservation) {
  MoveS0();
  const uint64_t w1 = Reserved("w1"), w2 = Reserved("w2");
  const uint64_t usage = DeviceUsage("t");
  auto p = core_->PrepareTransfer(Req(s1_, 2, s0_));
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(Reserved("w2"), w2 + kBf16);
  core_->AbortTransfer(p->token, absl::UnavailableError("boom"));
  EXPECT_EQ(Reserved("w1"), w1);
  EXPECT_EQ(Reserved("w2"), w2);
  EXPECT_EQ(DeviceUsage("t"), usage);
  auto s1 = core_->GetSequence("t", s1_);
  ASSERT_THAT(s1, IsOk());
  EXPECT_EQ(s1->worker_id, "w1");
  EXPECT_TRUE(s1->transfer_id.empty());
  auto failed = Kind(EventKind::kTransferFailed, s1_);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_THAT(failed[0].detail, HasSubstr("released_bytes=16384"));
  // Nothing is left busy: the same transfer runs again.
  auto again = core_->PrepareTransfer(Req(s1_, 2, s0_));
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT(core_->CommitTransfer(again->token, kFigures), IsOk());
}

TEST_F(PrefixTransferTest, ThePrefixClosedMidTransferIsChargedAtTheCommit) {
  MoveS0();
  auto p = core_->PrepareTransfer(Req(s1_, 2, s0_));
  ASSERT_THAT(p, IsOk());
  // The prefix may close (the destination's import holds its pages).
  ASSERT_THAT(core_->CloseSequence({"", "t", s0_}), IsOk());
  EXPECT_EQ(Reserved("w2"), kBf16);  // the reservation of block 2
  ASSERT_THAT(core_->CommitTransfer(p->token, kFigures), IsOk());
  EXPECT_EQ(Reserved("w1"), 0u);
  EXPECT_EQ(Reserved("w2"), 3 * kBf16);
  EXPECT_EQ(DeviceUsage("t"), 3 * kBf16);
  ASSERT_THAT(core_->CloseSequence({"", "t", s1_}), IsOk());
  EXPECT_EQ(Reserved("w2"), 0u);
  EXPECT_EQ(DeviceUsage("t"), 0u);
}

TEST_F(PrefixTransferTest, EveryRuleIsRefusedByName) {
  // Before S0 moved: the prefix is on the source.
  EXPECT_THAT(
      core_->PrepareTransfer(Req(s1_, 2, s0_)),
      StatusIs(C::kFailedPrecondition, HasSubstr("the source of sequence")));
  MoveS0();
  const uint64_t w1 = Reserved("w1"), w2 = Reserved("w2");
  EXPECT_THAT(core_->PrepareTransfer(Req(s1_, 2, "")),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("first_block 2 needs "
                                 "destination_prefix_sequence_id")));
  EXPECT_THAT(
      core_->PrepareTransfer(Req(s1_, 0, s0_)),
      StatusIs(C::kInvalidArgument, HasSubstr("is named with first_block 0")));
  EXPECT_THAT(core_->PrepareTransfer(Req(s1_, 2, s1_)),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("is the sequence being transferred")));
  EXPECT_THAT(core_->PrepareTransfer(Req(s1_, 2, "bad id!")),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("destination_prefix_sequence_id")));
  EXPECT_THAT(
      core_->PrepareTransfer(Req(s1_, 4, s0_)),
      StatusIs(C::kInvalidArgument, HasSubstr("first_block 4 is past the 3")));
  EXPECT_THAT(core_->PrepareTransfer(Req(s1_, 2, "seq-99")),
              StatusIs(C::kNotFound, HasSubstr("seq-99")));
  ASSERT_THAT(core_->RegisterWorker({"", "w3", "127.0.0.1:9003", "cpu",
                                     1ull << 30, 0, 0, "inc-w3"}),
              IsOk());
  EXPECT_THAT(
      core_->PrepareTransfer(Req(s1_, 2, s0_, "w3")),
      StatusIs(C::kFailedPrecondition,
               HasSubstr("destination_worker_id \"w3\" is not worker \"w2\"")));
  // Block 2 of S1 is not S0's (S0 has 2 blocks).
  EXPECT_THAT(core_->PrepareTransfer(Req(s1_, 3, s0_)),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("has 2 blocks, fewer than first_block 3")));
  // Another sequence on w2: other lineages.
  OpenSequenceRequest open;
  open.tenant_id = "t";
  open.model = Model();
  open.spans = {S(Role::kSystem, 32)};
  open.worker_id = "w2";
  auto other = core_->OpenSequence(open);
  ASSERT_THAT(other, IsOk());
  EXPECT_THAT(
      core_->PrepareTransfer(Req(s1_, 2, other->sequence_id)),
      StatusIs(C::kFailedPrecondition,
               AllOf(HasSubstr(absl::StrCat("block 0: lineage ", lineages_[0],
                                            " of sequence \"", s1_, "\"")),
                     HasSubstr(absl::StrCat("differs from lineage ",
                                            other->blocks[0].lineage_id)))));
  // Without first_block, blocks w2 holds already would be there twice.
  EXPECT_THAT(
      core_->PrepareTransfer(Req(s1_, 0, "", "w2")),
      StatusIs(
          C::kFailedPrecondition,
          AllOf(HasSubstr(absl::StrCat("lineage ", lineages_[0], " (block 0)")),
                HasSubstr("is on destination worker \"w2\" "
                          "already"))));
  // The prefix being transferred itself.
  auto moving = core_->PrepareTransfer(Req(s0_, 0, "", "w3"));
  ASSERT_THAT(moving, IsOk());
  EXPECT_THAT(core_->PrepareTransfer(Req(s1_, 2, s0_)),
              StatusIs(C::kAborted, HasSubstr("retry")));
  core_->AbortTransfer(moving->token, absl::UnavailableError("test"));
  EXPECT_EQ(Reserved("w1"), w1);
  EXPECT_EQ(Reserved("w2"), w2 + 2 * kBf16);  // `other`
  EXPECT_EQ(Kind(EventKind::kTransferStarted, s1_).size(), 0u);
}

}  // namespace
}  // namespace triax::manager
