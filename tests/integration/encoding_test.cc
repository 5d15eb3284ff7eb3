// Mixed encodings end to end with real processes: an operator policy mixing
// BF16, FP8/INT4 (K/V split) and TQ3; Attend against a float64 reference over
// exactly the values the pages decode to (built locally with the CPU
// reference EncodePage/DecodePage); then DemoteBlocks through the manager,
// which has the worker re-encode the pages, and the same check over the
// re-encoded values, plus the plan, the tenant usage delta, the
// BLOCK_DEMOTED events and PERMISSION_DENIED for another tenant.
//
// The sequence is opened with window_tokens 0 and all its blocks are full,
// so every page is sealed into its planned encoding once written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
using triax::v1::ROLE_ASSISTANT;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

class EncodingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClusterOptions o;
    o.window_tokens = 32;  // the sequence overrides it with 0
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    {
      auto worker = cluster_->GetWorker("w0");
      ASSERT_THAT(worker, IsOk());
      tol_ = ToleranceFor(worker->backend());
    }
    ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
    ASSERT_THAT(cluster_->CreateTenant("other"), IsOk());
    auto cl = cluster_->NewClient("acme");
    ASSERT_THAT(cl, IsOk());
    client_ = std::move(*cl);
    shape_ = kernels::PageShape{16, static_cast<int>(model_.n_kv_heads()),
                                static_cast<int>(model_.head_dim())};
  }

  size_t Elems() const {
    return size_t{model_.n_kv_heads()} * model_.head_dim();
  }

  // What the pages of `seq` decode to, per layer, from the values written.
  void Decoded(const client::SequenceHandle& seq,
               std::vector<std::vector<float>>* k,
               std::vector<std::vector<float>>* v) {
    k->assign(model_.n_layers(), std::vector<float>(seq.num_tokens * Elems()));
    v->assign(model_.n_layers(), std::vector<float>(seq.num_tokens * Elems()));
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      for (const auto& b : seq.blocks) {
        const size_t off = b.first_token() * Elems();
        EXPECT_TRUE(RoundTripPage(EncodingFromProto(b), shape_,
                                  &written_k_[l][off], &written_v_[l][off],
                                  static_cast<int>(b.num_tokens()),
                                  &(*k)[l][off], &(*v)[l][off])
                        .ok());
      }
    }
  }

  std::vector<float> Attend(const client::SequenceHandle& h, uint32_t layer,
                            const std::vector<uint64_t>& positions,
                            const std::vector<float>& q) {
    std::vector<float> out(q.size(), std::nanf(""));
    client::Client::AttendArgs a;
    a.layer = layer;
    a.num_queries = positions.size();
    a.positions = positions.data();
    a.q = q.data();
    a.out = out.data();
    EXPECT_THAT(client_->Attend(h, a), IsOk());
    return out;
  }

  triax::v1::ModelShape model_ = SmallModel();
  kernels::PageShape shape_;
  std::mt19937 rng_{20261123};
  AttendTolerance tol_ = ToleranceFor("cpu");
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<client::Client> client_;
  std::vector<std::vector<float>> written_k_, written_v_;
};

TEST_F(EncodingTest, MixedPolicyAttendThenDemoteThroughTheManager) {
  std::printf("seed 20261123\n");
  // sink bf16 | system k=fp8 v=int4 g=64 | everything else tq3.
  triax::v1::PutPolicyRequest put;
  put.set_request_id("it-policy-1");
  put.mutable_policy()->set_name("it-mixed");
  {
    auto* r = put.mutable_policy()->add_rules();
    r->set_temporal(triax::v1::TEMPORAL_SINK);
    r->set_format(triax::v1::FORMAT_BF16);
    r = put.mutable_policy()->add_rules();
    r->set_role(ROLE_SYSTEM);
    r->set_format(triax::v1::FORMAT_FP8_E4M3);
    r->set_format_v(triax::v1::FORMAT_INT4);
    r->set_group_size(64);
    r = put.mutable_policy()->add_rules();
    r->set_format(triax::v1::FORMAT_TQ3);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    triax::v1::PutPolicyResponse resp;
    ASSERT_TRUE(cluster_->manager()->PutPolicy(&ctx, put, &resp).ok());
  }

  client::OpenOptions open;
  open.policy = "it-mixed";
  open.block_tokens = 16;
  open.window_tokens = 0;
  auto opened =
      client_->Open(model_,
                    {MakeSpan(ROLE_SYSTEM, 32), MakeSpan(ROLE_USER, 32),
                     MakeSpan(ROLE_ASSISTANT, 16)},
                    open);
  ASSERT_THAT(opened, IsOk());
  client::SequenceHandle seq = *opened;
  ASSERT_EQ(seq.blocks.size(), 5u);
  ASSERT_EQ(seq.window_tokens, std::optional<uint32_t>(0));
  EXPECT_EQ(seq.blocks[0].format(), triax::v1::FORMAT_BF16);
  EXPECT_EQ(seq.blocks[1].format(), triax::v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(seq.blocks[1].format_v(), triax::v1::FORMAT_INT4);
  EXPECT_EQ(seq.blocks[1].group_size(), 64u);
  for (int i = 2; i < 5; ++i) {
    EXPECT_EQ(seq.blocks[i].format(), triax::v1::FORMAT_TQ3);
  }

  written_k_.resize(model_.n_layers());
  written_v_.resize(model_.n_layers());
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    written_k_[l] = RandomVector(seq.num_tokens * Elems(), &rng_);
    written_v_[l] = RandomVector(seq.num_tokens * Elems(), &rng_);
    ASSERT_THAT(client_->WriteKV(seq, l, 0, seq.num_tokens,
                                 written_k_[l].data(), written_v_[l].data()),
                IsOk());
  }
  const std::vector<uint64_t> positions = {20, 47, seq.num_tokens - 1};
  const size_t qn = positions.size() * model_.n_q_heads() * model_.head_dim();
  std::vector<std::vector<float>> queries;
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    queries.push_back(RandomVector(qn, &rng_));
  }

  std::vector<std::vector<float>> dk, dv;
  ASSERT_NO_FATAL_FAILURE(Decoded(seq, &dk, &dv));
  std::vector<std::vector<double>> before_ref;
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    before_ref.push_back(
        ReferenceAttention(model_, queries[l], positions, dk[l], dv[l]));
    const std::vector<float> out = Attend(seq, l, positions, queries[l]);
    EXPECT_LT(RelativeError(out, before_ref[l]), tol_.relative)
        << "layer " << l;
  }

  // Demote the system block and the first user block to INT2.
  auto tenant_before = cluster_->GetTenant("acme");
  ASSERT_THAT(tenant_before, IsOk());
  const auto old_plan = seq.blocks;
  const std::vector<triax::v1::BlockEncoding> demote = {
      client::MakeBlockEncoding(seq.blocks[1].lineage_id(),
                                triax::v1::FORMAT_INT2),
      client::MakeBlockEncoding(seq.blocks[2].lineage_id(),
                                triax::v1::FORMAT_INT2)};
  // Another tenant may not.
  {
    auto other = cluster_->NewClient("other");
    ASSERT_THAT(other, IsOk());
    client::SequenceHandle copy = seq;
    EXPECT_THAT((*other)->DemoteBlocks(&copy, demote),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("belongs to another tenant")));
  }
  auto delta = client_->DemoteBlocks(&seq, demote);
  ASSERT_THAT(delta, IsOk());
  ASSERT_EQ(seq.blocks.size(), 5u);
  EXPECT_EQ(seq.blocks[0].format(), triax::v1::FORMAT_BF16);
  for (int i : {1, 2}) {
    EXPECT_EQ(seq.blocks[i].format(), triax::v1::FORMAT_INT2) << i;
    EXPECT_EQ(seq.blocks[i].format_v(), triax::v1::FORMAT_INT2) << i;
    EXPECT_EQ(seq.blocks[i].lineage_id(), old_plan[i].lineage_id()) << i;
  }
  EXPECT_EQ(seq.blocks[3].format(), triax::v1::FORMAT_TQ3);
  const int64_t want = static_cast<int64_t>(model_.n_layers()) *
                       (2 * static_cast<int64_t>(kernels::PageBytes(
                                kernels::Format::kINT2, shape_)) -
                        static_cast<int64_t>(kernels::PageBytes(
                            EncodingFromProto(old_plan[1]), shape_)) -
                        static_cast<int64_t>(kernels::PageBytes(
                            EncodingFromProto(old_plan[2]), shape_)));
  EXPECT_EQ(*delta, want);
  auto tenant_after = cluster_->GetTenant("acme");
  ASSERT_THAT(tenant_after, IsOk());
  EXPECT_EQ(static_cast<int64_t>(tenant_after->usage(0).used_bytes()) -
                static_cast<int64_t>(tenant_before->usage(0).used_bytes()),
            want);

  // One BLOCK_DEMOTED event per block, old -> new in the detail.
  for (int i : {1, 2}) {
    triax::v1::QueryTraceRequest req;
    req.set_lineage_id(seq.blocks[i].lineage_id());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    triax::v1::QueryTraceResponse resp;
    ASSERT_TRUE(cluster_->manager()->QueryTrace(&ctx, req, &resp).ok());
    int demoted = 0;
    for (const auto& e : resp.events()) {
      if (e.kind() != triax::v1::EVENT_BLOCK_DEMOTED) continue;
      ++demoted;
      EXPECT_THAT(e.detail(),
                  HasSubstr(i == 1 ? "from=k=fp8,v=int4,g=64" : "from=tq3"));
      EXPECT_THAT(e.detail(), HasSubstr("to=int2"));
    }
    EXPECT_EQ(demoted, 1) << "block " << i;
  }

  // Attention now matches the re-encoded values: the demoted pages are the
  // old pages decoded, rounded to BF16 and encoded into INT2.
  std::vector<std::vector<float>> ek(dk), ev(dv);
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    for (int i : {1, 2}) {
      const size_t off = seq.blocks[i].first_token() * Elems();
      ASSERT_TRUE(RoundTripPage(kernels::Format::kINT2, shape_, &dk[l][off],
                                &dv[l][off], 16, &ek[l][off], &ev[l][off])
                      .ok());
    }
    const auto after_ref =
        ReferenceAttention(model_, queries[l], positions, ek[l], ev[l]);
    const std::vector<float> out = Attend(seq, l, positions, queries[l]);
    const double err_new = RelativeError(out, after_ref);
    const double err_old = RelativeError(out, before_ref[l]);
    EXPECT_LT(err_new, 5e-3) << "layer " << l;
    // The change is real: the old reference no longer fits.
    EXPECT_GT(err_old, 4 * err_new) << "layer " << l;
  }
  EXPECT_THAT(client_->Close(seq), IsOk());
}

}  // namespace
}  // namespace triax::testing
