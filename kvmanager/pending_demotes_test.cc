// PendingDemotes (pending_demotes.h) through its own interface: request
// checks, per-block checks against the sequence, growth reserved and
// returned, commit (bytes, events, version) and its abort when the sequence
// changed, requests in flight, and the aging demotions of an Extend.
// Records from manager_parts_testing.h; FakeClock.
#include "kvmanager/pending_demotes.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "kvmanager/manager_parts_testing.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr uint64_t kBf16 = 16384;
constexpr uint64_t kInt4 = 5632;
constexpr uint64_t kInt2 = 3584;

BlockEncoding To(uint64_t lineage, Format f) {
  return BlockEncoding{lineage, EncodingSpec{f, Format(0), 0, 0}};
}

DemoteBlocksRequest Req(const std::string& seq,
                        std::vector<BlockEncoding> blocks,
                        const std::string& request_id = "") {
  DemoteBlocksRequest req;
  req.request_id = request_id;
  req.tenant_id = "t";
  req.sequence_id = seq;
  req.blocks = std::move(blocks);
  return req;
}

struct DemoteWorld : PartsWorld {
  DemoteWorld()
      : demotes(&clock, &workers, &tenants, &sequences, &next_token) {}
  absl::StatusOr<DemotePrepared> Prepare(SequenceRecord* s,
                                         const DemoteBlocksRequest& req) {
    auto enc = PendingDemotes::ValidateRequest(req);
    if (!enc.ok()) return enc.status();
    return demotes.Prepare(req, *enc, s);
  }
  PendingDemotes demotes;
};

TEST(PendingDemotesTest, RequestsAreChecked) {
  using P = PendingDemotes;
  EXPECT_THAT(P::ValidateRequest(Req("s", {})),
              StatusIs(C::kInvalidArgument,
                       "blocks is empty; name at least one block to "
                       "re-encode"));
  EXPECT_THAT(P::ValidateRequest(Req("s", {To(0, Format::kINT2)})),
              StatusIs(C::kInvalidArgument,
                       "blocks[0].lineage_id is 0; lineage ids start at 1"));
  EXPECT_THAT(P::ValidateRequest(
                  Req("s", {To(4, Format::kINT2), To(4, Format::kINT4)})),
              StatusIs(C::kInvalidArgument,
                       "blocks[1].lineage_id 4 appears more than once"));
  EXPECT_THAT(P::ValidateRequest(Req("s", {To(4, Format(0))})),
              StatusIs(C::kInvalidArgument, HasSubstr("blocks[0].format")));
  std::vector<BlockEncoding> many(kMaxSequenceBlocks + 1, To(1, Format::kINT2));
  EXPECT_THAT(P::ValidateRequest(Req("s", many)),
              StatusIs(C::kInvalidArgument,
                       "blocks has 65537 entries; the limit is 65536"));
  auto ok = P::ValidateRequest(Req(
      "s", {BlockEncoding{4, EncodingSpec{Format::kINT4, Format(0), 0, 0}}}));
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ((*ok)[0].group, 32);  // canonical
}

TEST(PendingDemotesTest, ShrinkCommitsWithEventsAndReleasesBytes) {
  DemoteWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* s = w.AddSequence(t, wk, {Role::kUser, Role::kUser});
  w.next_token = 41;
  auto prep = w.Prepare(
      s, Req(s->id, {To(2, Format::kINT2), To(1, Format::kBF16)}));  // no-op
  ASSERT_THAT(prep, IsOk());
  EXPECT_EQ(prep->token, 41u);
  EXPECT_EQ(w.next_token, 42u);
  EXPECT_EQ(prep->worker_request_id, "demote-41");
  EXPECT_EQ(prep->worker_address, wk->info.address);
  ASSERT_EQ(prep->blocks.size(), 1u);  // the no-op is left out
  EXPECT_EQ(prep->blocks[0].lineage_id, 2u);
  EXPECT_EQ(prep->blocks[0].encoding, Format::kINT2);
  EXPECT_EQ(prep->bytes_delta,
            static_cast<int64_t>(kInt2) - static_cast<int64_t>(kBf16));
  EXPECT_EQ(t->used[kDev], 2 * kBf16);  // shrinkage waits for the commit
  EXPECT_EQ(w.demotes.size(), 1u);

  const uint64_t version = s->version;
  std::vector<Event> ev;
  auto done = w.demotes.Commit(41, &ev);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->result.bytes_delta, prep->bytes_delta);
  EXPECT_EQ(done->tenant_id, "t");
  EXPECT_EQ(done->result.sequence.blocks[1].encoding, Format::kINT2);
  EXPECT_EQ(s->blocks[1]->bytes, kInt2);
  EXPECT_EQ(s->bytes, kBf16 + kInt2);
  EXPECT_EQ(t->used[kDev], kBf16 + kInt2);
  EXPECT_EQ(wk->reserved, kBf16 + kInt2);
  EXPECT_EQ(s->version, version + 1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, EventKind::kBlockDemoted);
  EXPECT_EQ(ev[0].unix_ms, w.clock.NowMs());
  EXPECT_EQ(ev[0].detail,
            "index=1 from=bf16 to=int2 bytes_from=16384 bytes_to=3584");
  EXPECT_THAT(w.demotes.Commit(41, &ev),
              StatusIs(C::kNotFound, "demote token 41 is not pending"));
  EXPECT_EQ(w.demotes.size(), 0u);
}

TEST(PendingDemotesTest, GrowthIsReservedAndReturned) {
  DemoteWorld w;
  TenantRecord* t = w.AddTenant("t", /*ceiling=*/3 * kInt2 + 3000);
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* s =
      w.AddSequence(t, wk, {Role::kUser, Role::kUser, Role::kUser}, "int2");
  auto prep = w.Prepare(s, Req(s->id, {To(2, Format::kINT4)}, "r1"));
  ASSERT_THAT(prep, IsOk());
  EXPECT_EQ(prep->worker_request_id, "r1");
  EXPECT_EQ(t->used[kDev], 2 * kInt2 + kInt4);
  EXPECT_EQ(wk->reserved, 2 * kInt2 + kInt4);
  // The reservation counts against the next one.
  EXPECT_THAT(w.Prepare(s, Req(s->id, {To(3, Format::kINT4)})),
              StatusIs(C::kResourceExhausted,
                       HasSubstr("tenant \"t\" tier TIER_DEVICE")));
  // The same request id while it is pending.
  EXPECT_THAT(w.demotes.CheckDemoteNotInProgress("t", "r1"),
              StatusIs(C::kAborted,
                       "DemoteBlocks request_id \"r1\" is already in "
                       "progress; retry later"));
  EXPECT_THAT(w.demotes.CheckDemoteNotInProgress("other", "r1"), IsOk());
  EXPECT_THAT(w.demotes.CheckDemoteNotInProgress("t", ""), IsOk());
  w.demotes.Release(prep->token);
  w.demotes.Release(prep->token);  // unknown now: no-op
  EXPECT_EQ(t->used[kDev], 3 * kInt2);
  EXPECT_EQ(wk->reserved, 3 * kInt2);
  // The worker's room counts too.
  wk->info.capacity_bytes = 3 * kInt2 + 100;
  EXPECT_THAT(w.Prepare(s, Req(s->id, {To(2, Format::kINT4)})),
              StatusIs(C::kResourceExhausted,
                       HasSubstr("worker \"w\" has 100 free bytes")));
  EXPECT_EQ(w.demotes.size(), 0u);
}

TEST(PendingDemotesTest, ACommitAfterTheSequenceChangedIsAborted) {
  DemoteWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* s = w.AddSequence(t, wk, {Role::kUser, Role::kUser}, "int2");
  auto prep = w.Prepare(s, Req(s->id, {To(2, Format::kBF16)}));
  ASSERT_THAT(prep, IsOk());
  EXPECT_EQ(t->used[kDev], kInt2 + kBf16);
  ++s->version;  // e.g. an Extend in between
  std::vector<Event> ev;
  EXPECT_THAT(
      w.demotes.Commit(prep->token, &ev),
      StatusIs(C::kAborted, HasSubstr("sequence_id \"seq-1\" changed while its "
                                      "blocks were re-encoded")));
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(s->blocks[1]->encoding, Format::kINT2);
  EXPECT_EQ(t->used[kDev], 2 * kInt2);  // reservation returned
  EXPECT_EQ(w.demotes.size(), 0u);
}

TEST(PendingDemotesTest, BlocksAreCheckedAgainstTheSequence) {
  DemoteWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30, /*host=*/1 << 30);
  SequenceRecord* s = w.AddSequence(
      t, wk, {Role::kUser, Role::kUser, Role::kUser, Role::kUser});
  w.AddSequence(t, wk, {Role::kUser});  // lineage 5: another sequence's
  EXPECT_THAT(w.Prepare(s, Req(s->id, {To(5, Format::kINT2)})),
              StatusIs(C::kNotFound,
                       "blocks[0].lineage_id 5 is not a block of sequence_id "
                       "\"seq-1\""));
  s->blocks[0]->refcount = 2;
  EXPECT_THAT(w.Prepare(s, Req(s->id, {To(1, Format::kINT2)})),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("is shared with a fork (2 sequences)")));
  PartsWorld::Spill(s, s->blocks[1], Tier::kHost);
  EXPECT_THAT(w.Prepare(s, Req(s->id, {To(2, Format::kINT2)})),
              StatusIs(C::kFailedPrecondition,
                       "blocks[0].lineage_id 2 is spilled to TIER_HOST; only "
                       "blocks in the device pool can be demoted"));
  s->blocks[2]->busy = 9;
  EXPECT_THAT(w.Prepare(s, Req(s->id, {To(3, Format::kINT2)})),
              StatusIs(C::kAborted,
                       HasSubstr("is being moved by the pressure manager")));
  s->model.head_dim = 48;  // TQ needs a power of two
  EXPECT_THAT(
      w.Prepare(s, Req(s->id, {To(4, Format::kTQ2)})),
      StatusIs(C::kInvalidArgument,
               HasSubstr("blocks[0] encoding tq2 is invalid for "
                         "block_tokens 16, n_kv_heads 2, head_dim 48")));
  EXPECT_EQ(w.demotes.size(), 0u);
  EXPECT_EQ(w.next_token, 1u);  // failures take no token
}

TEST(PendingDemotesTest, AgingDemotionsOfAnExtend) {
  DemoteWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* s = w.AddSequence(
      t, wk, {Role::kSystem, Role::kUser, Role::kUser, Role::kAssistant});
  // An allocation that now wants INT4 for the user blocks and keeps BF16
  // for the sink and the assistant.
  PolicyInfo pi;
  pi.name = "alloc";
  pi.budget_bits = 8;
  pi.calibration_model = "cal";
  s->policy = *BuildPolicy(pi);
  const Tag user = s->blocks[1]->tag;
  const Tag assistant = s->blocks[3]->tag;
  s->allocation = {{s->blocks[0]->tag, Encoding(Format::kBF16)},
                   {user, Encoding(Format::kINT4)},
                   {assistant, Encoding(Format::kBF16)}};
  s->blocks[2]->refcount = 2;  // shared with a fork: immutable
  ExtendSequenceResult result;
  result.sequence.sequence_id = s->id;
  auto d = w.demotes.PrepareAging(s, 4, "t", "x1", 0, result);
  ASSERT_TRUE(d.has_value());
  ASSERT_EQ(d->blocks.size(), 1u);  // block 1 only
  EXPECT_EQ(d->blocks[0].lineage_id, 2u);
  EXPECT_EQ(d->blocks[0].encoding, Format::kINT4);
  EXPECT_EQ(d->worker_request_id, "seq-1-v0-extend-demote-1");
  EXPECT_EQ(d->bytes_delta,
            static_cast<int64_t>(kInt4) - static_cast<int64_t>(kBf16));
  EXPECT_EQ(t->used[kDev], 4 * kBf16);  // nothing reserved
  EXPECT_THAT(w.demotes.CheckExtendNotInProgress("t", "x1"),
              StatusIs(C::kAborted,
                       "ExtendSequence request_id \"x1\" is already in "
                       "progress (demoting blocks); retry later"));
  EXPECT_THAT(w.demotes.CheckDemoteNotInProgress("t", "x1"), IsOk());
  EXPECT_THAT(
      w.demotes.TakeExtend(99),
      StatusIs(C::kNotFound, "extend demotion token 99 is not pending"));
  auto ext = w.demotes.TakeExtend(d->token);
  ASSERT_THAT(ext, IsOk());
  EXPECT_EQ(ext->result.sequence.sequence_id, "seq-1");
  EXPECT_EQ(ext->request_id, "x1");
  EXPECT_EQ(ext->sequence_id, "seq-1");
  EXPECT_THAT(ext->lineages, ::testing::ElementsAre(2u));
  std::vector<Event> ev;
  auto c = w.demotes.Commit(d->token, &ev);
  ASSERT_THAT(c, IsOk());
  EXPECT_TRUE(c->request_id.empty());  // not a DemoteBlocks reply
  EXPECT_EQ(t->used[kDev], 3 * kBf16 + kInt4);
  // Nothing left to shrink: no demotion.
  EXPECT_FALSE(w.demotes.PrepareAging(s, 4, "t", "x2", 0, result).has_value());
  // A plain DemoteBlocks token is not an Extend's.
  auto plain = w.Prepare(s, Req(s->id, {To(4, Format::kINT8)}));
  ASSERT_THAT(plain, IsOk());
  EXPECT_THAT(w.demotes.TakeExtend(plain->token),
              StatusIs(C::kNotFound, HasSubstr("is not pending")));
}

}  // namespace
}  // namespace triax::manager
