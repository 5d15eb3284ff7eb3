// Scenarios through the ManagerCore facade: operator policies (PutPolicy,
// mixed encodings, shape checks at Open) and the two phases of DemoteBlocks
// (prepare, commit, abort, growth, a sequence changed in between, bad
// requests). Deterministic: FakeClock, exact byte numbers
// (manager_core_test_fixture.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/manager_core_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::_;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

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
  // The id naming other blocks (another fingerprint; the service sets it
  // from the wire request): refused, nothing prepared.
  DemoteBlocksRequest other =
      Demote(seq->sequence_id, {To(l1, Format::kINT4)}, "acme", "d1");
  other.fingerprint = 2;
  EXPECT_THAT(core_->PrepareDemote(other),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("request_id=\"d1\" was used for a "
                                 "different DemoteBlocks request")));
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

}  // namespace
}  // namespace triax::manager
