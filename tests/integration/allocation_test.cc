// Allocation policy end to end with real processes: PutCalibration, an
// operator allocation policy "triaxial-4b" (budget 4.0 effective bits per
// value), a sequence over two turns through the client library. At the new
// turn the manager re-solves the allocation and demotes the previous turn's
// INT4 user blocks to INT2 on the worker before replying: the plan changes
// in place (same lineage ids), the tenant's bytes drop, and Attend matches a
// float64 reference over the re-encoded values (the old pages decoded,
// rounded to BF16, encoded into INT2), not the old ones. A second new turn
// through the raw ExtendSequence RPC shows demoted_blocks in the response.
//
// The sequence is opened with window_tokens 0 and full blocks, so every page
// is sealed into its planned encoding once written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
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

using triax::v1::ROLE_ASSISTANT;
using triax::v1::ROLE_USER;

template <typename Req, typename Resp>
grpc::Status Call(triax::v1::Manager::Stub* stub,
                  grpc::Status (triax::v1::Manager::Stub::*method)(
                      grpc::ClientContext*, const Req&, Resp*),
                  const Req& req, Resp* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return (stub->*method)(&ctx, req, resp);
}

TEST(AllocationIntegrationTest, NewTurnDemotesOnTheWorkerAndAttendFollows) {
  std::printf("seed 20261124\n");
  std::mt19937 rng(20261124);
  auto c = Cluster::Start(ClusterOptions{});
  ASSERT_THAT(c, IsOk());
  Cluster& cluster = **c;
  auto worker = cluster.GetWorker("w0");
  ASSERT_THAT(worker, IsOk());
  const AttendTolerance tol = ToleranceFor(worker->backend());
  ASSERT_THAT(cluster.CreateTenant("acme"), IsOk());
  auto cl = cluster.NewClient("acme");
  ASSERT_THAT(cl, IsOk());
  client::Client& client = **cl;
  const triax::v1::ModelShape model = SmallModel();
  const kernels::PageShape shape{16, static_cast<int>(model.n_kv_heads()),
                                 static_cast<int>(model.head_dim())};
  const size_t elems = size_t{model.n_kv_heads()} * model.head_dim();

  // Calibration: older tokens are cheaper to quantize.
  triax::v1::PutCalibrationRequest cal;
  cal.set_request_id("it-cal-1");
  auto* table = cal.mutable_table();
  table->set_model("it-small-cal");
  *table->mutable_shape() = model;
  table->set_block_tokens(16);
  const std::map<triax::v1::Temporal, std::pair<double, double>> dist = {
      {triax::v1::TEMPORAL_CURRENT_TURN, {1.0, 8.0}},
      {triax::v1::TEMPORAL_RECENT_TURNS, {0.5, 2.0}},
      {triax::v1::TEMPORAL_OLDER, {0.2, 0.3}}};
  for (triax::v1::Role role : {ROLE_USER, ROLE_ASSISTANT}) {
    for (const auto& [temporal, d] : dist) {
      for (auto [f, dd] : {std::make_pair(triax::v1::FORMAT_BF16, 0.0),
                           std::make_pair(triax::v1::FORMAT_INT4, d.first),
                           std::make_pair(triax::v1::FORMAT_INT2, d.second)}) {
        auto* e = table->add_entries();
        e->mutable_tag()->set_temporal(temporal);
        e->mutable_tag()->set_role(role);
        e->set_format(f);
        e->set_distortion(dd);
      }
    }
  }
  table->mutable_source()->set_tool("allocation_test");
  {
    triax::v1::PutCalibrationResponse resp;
    const grpc::Status st =
        Call(cluster.manager(), &triax::v1::Manager::Stub::PutCalibration, cal,
             &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(resp.entries(), 18u);
  }
  triax::v1::PutPolicyRequest put;
  put.set_request_id("it-policy-4b");
  put.mutable_policy()->set_name("triaxial-4b");
  put.mutable_policy()->set_budget_bits(4.0);
  put.mutable_policy()->set_calibration_model("it-small-cal");
  {
    triax::v1::PutPolicyResponse resp;
    const grpc::Status st = Call(
        cluster.manager(), &triax::v1::Manager::Stub::PutPolicy, put, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  // Turn 0: a BF16 sink, 48 user tokens and 576 assistant tokens. At 4 bits
  // the slack over all-INT2 pays for INT4 on the current user blocks only.
  client::OpenOptions open;
  open.policy = "triaxial-4b";
  open.block_tokens = 16;
  open.window_tokens = 0;
  auto opened = client.Open(
      model, {MakeSpan(ROLE_USER, 64), MakeSpan(ROLE_ASSISTANT, 576)}, open);
  ASSERT_THAT(opened, IsOk());
  client::SequenceHandle seq = *opened;
  ASSERT_EQ(seq.blocks.size(), 40u);
  EXPECT_EQ(seq.blocks[0].format(), triax::v1::FORMAT_BF16);  // sink
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(seq.blocks[i].format(), triax::v1::FORMAT_INT4) << i;
  }
  for (int i = 4; i < 40; ++i) {
    EXPECT_EQ(seq.blocks[i].format(), triax::v1::FORMAT_INT2) << i;
  }

  std::vector<std::vector<float>> wk(model.n_layers()), wv(model.n_layers());
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    wk[l] = RandomVector(seq.num_tokens * elems, &rng);
    wv[l] = RandomVector(seq.num_tokens * elems, &rng);
    ASSERT_THAT(
        client.WriteKV(seq, l, 0, seq.num_tokens, wk[l].data(), wv[l].data()),
        IsOk());
  }
  // What the pages decode to now.
  auto decoded = [&](const client::SequenceHandle& h, uint32_t l,
                     std::vector<float>* k, std::vector<float>* v) {
    k->assign(640 * elems, 0);
    v->assign(640 * elems, 0);
    for (const auto& b : h.blocks) {
      if (b.first_token() >= 640) continue;
      const size_t off = b.first_token() * elems;
      EXPECT_TRUE(RoundTripPage(EncodingFromProto(b), shape, &wk[l][off],
                                &wv[l][off], static_cast<int>(b.num_tokens()),
                                &(*k)[off], &(*v)[off])
                      .ok());
    }
  };
  const std::vector<uint64_t> positions = {40, 300, 639};
  const size_t qn = positions.size() * model.n_q_heads() * model.head_dim();
  std::vector<std::vector<float>> queries;
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    queries.push_back(RandomVector(qn, &rng));
  }
  auto attend = [&](const client::SequenceHandle& h, uint32_t l) {
    std::vector<float> out(qn, std::nanf(""));
    client::Client::AttendArgs a;
    a.layer = l;
    a.num_queries = positions.size();
    a.positions = positions.data();
    a.q = queries[l].data();
    a.out = out.data();
    EXPECT_THAT(client.Attend(h, a), IsOk());
    return out;
  };
  std::vector<std::vector<float>> dk(model.n_layers()), dv(model.n_layers());
  std::vector<std::vector<double>> before_ref;
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    ASSERT_NO_FATAL_FAILURE(decoded(seq, l, &dk[l], &dv[l]));
    before_ref.push_back(
        ReferenceAttention(model, queries[l], positions, dk[l], dv[l]));
    EXPECT_LT(RelativeError(attend(seq, l), before_ref[l]), tol.relative) << l;
  }

  // Turn 1: the new turn's blocks are planned and turn 0's user blocks
  // (now RECENT_TURNS) are demoted INT4 -> INT2 on the worker.
  auto tenant_before = cluster.GetTenant("acme");
  ASSERT_THAT(tenant_before, IsOk());
  const auto old_plan = seq.blocks;
  ASSERT_THAT(client.Extend(
                  &seq, {MakeSpan(ROLE_USER, 64), MakeSpan(ROLE_ASSISTANT, 64)},
                  /*new_turn=*/true, /*continue_last_span=*/false),
              IsOk());
  ASSERT_EQ(seq.blocks.size(), 48u);
  uint64_t new_bytes = 0;
  for (size_t i = 40; i < seq.blocks.size(); ++i) {
    new_bytes += model.n_layers() *
                 kernels::PageBytes(EncodingFromProto(seq.blocks[i]), shape);
  }
  int64_t freed = 0;
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(seq.blocks[i].lineage_id(), old_plan[i].lineage_id()) << i;
    EXPECT_EQ(seq.blocks[i].tag().temporal(), triax::v1::TEMPORAL_RECENT_TURNS);
    EXPECT_EQ(seq.blocks[i].format(), triax::v1::FORMAT_INT2) << i;
    freed += static_cast<int64_t>(model.n_layers()) *
             (static_cast<int64_t>(
                  kernels::PageBytes(EncodingFromProto(old_plan[i]), shape)) -
              static_cast<int64_t>(
                  kernels::PageBytes(EncodingFromProto(seq.blocks[i]), shape)));
  }
  EXPECT_GT(freed, 0);
  for (int i = 4; i < 40; ++i) {
    EXPECT_EQ(seq.blocks[i].format(), old_plan[i].format()) << i;
  }
  auto tenant_after = cluster.GetTenant("acme");
  ASSERT_THAT(tenant_after, IsOk());
  EXPECT_EQ(static_cast<int64_t>(tenant_after->usage(0).used_bytes()),
            static_cast<int64_t>(tenant_before->usage(0).used_bytes()) +
                static_cast<int64_t>(new_bytes) - freed);
  // The worker holds the re-encoded pages: attention over them matches.
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    std::vector<float> ek = dk[l], ev = dv[l];
    for (int i = 1; i < 4; ++i) {
      const size_t off = seq.blocks[i].first_token() * elems;
      ASSERT_TRUE(RoundTripPage(kernels::Format::kINT2, shape, &dk[l][off],
                                &dv[l][off], 16, &ek[off], &ev[off])
                      .ok());
    }
    const auto after_ref =
        ReferenceAttention(model, queries[l], positions, ek, ev);
    const std::vector<float> out = attend(seq, l);
    const double err_new = RelativeError(out, after_ref);
    EXPECT_LT(err_new, 5e-3) << l;
    EXPECT_GT(RelativeError(out, before_ref[l]), 4 * err_new) << l;
  }

  // Turn 2 through the raw RPC: the response lists what it demoted, and
  // those blocks carry their new (smaller) encoding in the plan.
  triax::v1::ExtendSequenceRequest ext;
  ext.set_request_id("it-ext-2");
  ext.set_tenant_id("acme");
  ext.set_sequence_id(seq.sequence_id);
  ext.set_new_turn(true);
  *ext.add_spans() = MakeSpan(ROLE_USER, 64);
  *ext.add_spans() = MakeSpan(ROLE_ASSISTANT, 64);
  triax::v1::ExtendSequenceResponse resp;
  const grpc::Status st = Call(
      cluster.manager(), &triax::v1::Manager::Stub::ExtendSequence, ext, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_FALSE(resp.demoted_blocks().empty());
  for (const auto& d : resp.demoted_blocks()) {
    ASSERT_LT(d.index(), seq.blocks.size());
    const auto& was = seq.blocks[d.index()];
    EXPECT_EQ(d.lineage_id(), was.lineage_id());
    EXPECT_LT(kernels::PageBytes(EncodingFromProto(d), shape),
              kernels::PageBytes(EncodingFromProto(was), shape))
        << d.index();
    EXPECT_EQ(resp.sequence().blocks(d.index()).format(), d.format());
  }
  // Unlisted existing blocks kept their encoding (never promoted).
  for (size_t i = 0; i < seq.blocks.size(); ++i) {
    bool listed = false;
    for (const auto& d : resp.demoted_blocks()) listed |= d.index() == i;
    if (!listed) {
      EXPECT_EQ(resp.sequence().blocks(i).format(), seq.blocks[i].format())
          << i;
    }
  }
  EXPECT_THAT(client.Close(seq), IsOk());
}

}  // namespace
}  // namespace triax::testing
