// End-to-end sessions through the client library against real kvmanager and
// kvworker processes: open, write, attend (checked against a float64
// oracle), read back, extend, fork, close; and quantized policies.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::Ne;
using triax::v1::ROLE_ASSISTANT;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

// K/V as written, per layer, token-major; what the test compares against.
struct Written {
  std::vector<std::vector<float>> k, v;
};

class SessionTest : public ::testing::Test {
 protected:
  void StartCluster(int window_tokens) {
    ClusterOptions o;
    o.window_tokens = window_tokens;
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    auto worker = cluster_->GetWorker("w0");
    ASSERT_THAT(worker, IsOk());
    tol_ = ToleranceFor(worker->backend());
    ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
    auto cl = cluster_->NewClient("acme");
    ASSERT_THAT(cl, IsOk());
    client_ = std::move(*cl);
    written_.k.assign(model_.n_layers(), {});
    written_.v.assign(model_.n_layers(), {});
  }

  size_t Elems() const {
    return size_t{model_.n_kv_heads()} * model_.head_dim();
  }

  // Writes random K/V for tokens [first, first + n) of every layer.
  void WriteAll(const client::SequenceHandle& h, uint64_t first, uint32_t n) {
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      ASSERT_EQ(written_.k[l].size(), first * Elems());
      auto k = RandomVector(n * Elems(), &rng_);
      auto v = RandomVector(n * Elems(), &rng_);
      ASSERT_THAT(client_->WriteKV(h, l, first, n, k.data(), v.data()), IsOk());
      written_.k[l].insert(written_.k[l].end(), k.begin(), k.end());
      written_.v[l].insert(written_.v[l].end(), v.begin(), v.end());
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

  std::vector<float> RandomQueries(size_t n) {
    return RandomVector(n * model_.n_q_heads() * model_.head_dim(), &rng_);
  }

  triax::v1::ModelShape model_ = SmallModel();
  std::mt19937 rng_{20261122};
  AttendTolerance tol_ = ToleranceFor("cpu");
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<client::Client> client_;
  Written written_;
};

uint64_t PagesUsed(const triax::v1::Inventory& inv) {
  uint64_t n = 0;
  for (const auto& f : inv.formats()) n += f.pages_used();
  return n;
}

TEST_F(SessionTest, Bf16SessionOpenWriteAttendReadExtendForkClose) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*window_tokens=*/16));
  std::printf("seed 20261122\n");

  // Open: system 20 + user 13 tokens, 16-token blocks -> 16+4 | 13.
  auto opened = client_->Open(
      model_, {MakeSpan(ROLE_SYSTEM, 20), MakeSpan(ROLE_USER, 13)}, "bf16", 16);
  ASSERT_THAT(opened, IsOk());
  client::SequenceHandle seq = *opened;
  ASSERT_EQ(seq.blocks.size(), 3u);
  EXPECT_EQ(seq.num_tokens, 33u);
  EXPECT_EQ(seq.block_tokens, 16u);
  EXPECT_FALSE(seq.worker_address.empty());
  EXPECT_EQ(seq.blocks[0].tag().temporal(), triax::v1::TEMPORAL_SINK);
  EXPECT_EQ(seq.blocks[1].tag().role(), ROLE_SYSTEM);
  EXPECT_EQ(seq.blocks[1].num_tokens(), 4u);
  EXPECT_EQ(seq.blocks[2].tag().role(), ROLE_USER);
  EXPECT_EQ(seq.blocks[2].tag().temporal(), triax::v1::TEMPORAL_CURRENT_TURN);
  std::set<uint64_t> lineages;
  for (const auto& b : seq.blocks) {
    EXPECT_EQ(b.format(), triax::v1::FORMAT_BF16);
    EXPECT_NE(b.lineage_id(), 0u);
    lineages.insert(b.lineage_id());
  }
  EXPECT_EQ(lineages.size(), 3u);

  // Two writes per layer: the second continues where the first ended.
  ASSERT_NO_FATAL_FAILURE(WriteAll(seq, 0, 20));
  ASSERT_NO_FATAL_FAILURE(WriteAll(seq, 20, 13));

  // The worker reports pages in its next heartbeat.
  ASSERT_THAT(
      Cluster::WaitFor("pages in the worker inventory", absl::Seconds(5),
                       [&]() -> absl::StatusOr<bool> {
                         auto w = cluster_->GetWorker("w0");
                         if (!w.ok()) return w.status();
                         return PagesUsed(w->inventory()) > 0 &&
                                w->inventory().used_bytes() > 0;
                       }),
      IsOk());

  // Attention against float64 over the BF16-rounded K/V.
  const std::vector<uint64_t> pos = {32, 19, 0};
  for (uint32_t layer = 0; layer < model_.n_layers(); ++layer) {
    auto q = RandomQueries(pos.size());
    auto out = Attend(seq, layer, pos, q);
    auto ref =
        ReferenceAttention(model_, q, pos, RoundToBf16(written_.k[layer]),
                           RoundToBf16(written_.v[layer]));
    EXPECT_LE(WorstToleranceRatio(out, ref, tol_.atol, tol_.rtol), 1.0)
        << "layer " << layer;
    EXPECT_GT(RelativeError(std::vector<float>(out.size(), 0.f), ref), 0.5)
        << "reference is all zero";
  }

  // ReadKV returns exactly the BF16-rounded values.
  std::vector<float> rk, rv;
  ASSERT_THAT(client_->ReadKV(seq, 0, 0, 33, &rk, &rv), IsOk());
  EXPECT_EQ(rk, RoundToBf16(written_.k[0]));
  EXPECT_EQ(rv, RoundToBf16(written_.v[0]));
  ASSERT_THAT(client_->ReadKV(seq, 1, 5, 0, &rk, &rv), IsOk());  // to the end
  EXPECT_EQ(rk.size(), 28 * Elems());
  const std::vector<float> v1 = RoundToBf16(written_.v[1]);
  EXPECT_EQ(rv, std::vector<float>(v1.begin() + 5 * Elems(), v1.end()));

  // A new turn: the user block ages, the new assistant block is current.
  const uint64_t user_lineage = seq.blocks[2].lineage_id();
  ASSERT_THAT(client_->Extend(&seq, {MakeSpan(ROLE_ASSISTANT, 10)},
                              /*new_turn=*/true, /*continue_last_span=*/false),
              IsOk());
  ASSERT_EQ(seq.blocks.size(), 4u);
  EXPECT_EQ(seq.num_tokens, 43u);
  EXPECT_EQ(seq.blocks[0].tag().temporal(), triax::v1::TEMPORAL_SINK);
  EXPECT_EQ(seq.blocks[2].lineage_id(), user_lineage);
  EXPECT_THAT(seq.blocks[2].tag().temporal(),
              Ne(triax::v1::TEMPORAL_CURRENT_TURN));
  EXPECT_EQ(seq.blocks[3].tag().temporal(), triax::v1::TEMPORAL_CURRENT_TURN);
  EXPECT_EQ(seq.blocks[3].tag().role(), ROLE_ASSISTANT);
  ASSERT_NO_FATAL_FAILURE(WriteAll(seq, 33, 10));

  // A decode step: one more token in the same block, appended by Attend.
  ASSERT_THAT(client_->Extend(&seq, {MakeSpan(ROLE_ASSISTANT, 1)},
                              /*new_turn=*/false, /*continue_last_span=*/true),
              IsOk());
  ASSERT_EQ(seq.blocks.size(), 4u);
  EXPECT_EQ(seq.blocks[3].num_tokens(), 11u);
  EXPECT_EQ(seq.num_tokens, 44u);
  {
    auto k = RandomVector(Elems(), &rng_), v = RandomVector(Elems(), &rng_);
    auto k1 = RandomVector(Elems(), &rng_), v1 = RandomVector(Elems(), &rng_);
    ASSERT_THAT(client_->WriteKV(seq, 1, 43, 1, k1.data(), v1.data()), IsOk());
    written_.k[1].insert(written_.k[1].end(), k1.begin(), k1.end());
    written_.v[1].insert(written_.v[1].end(), v1.begin(), v1.end());
    written_.k[0].insert(written_.k[0].end(), k.begin(), k.end());
    written_.v[0].insert(written_.v[0].end(), v.begin(), v.end());
    const std::vector<uint64_t> dpos = {43, 40};
    auto q = RandomQueries(dpos.size());
    std::vector<float> out(q.size());
    client::Client::AttendArgs a;
    a.layer = 0;
    a.num_queries = 2;
    a.positions = dpos.data();
    a.q = q.data();
    a.out = out.data();
    a.append_k = k.data();
    a.append_v = v.data();
    a.append_first = 43;
    a.append_tokens = 1;
    ASSERT_THAT(client_->Attend(seq, a), IsOk());
    auto ref = ReferenceAttention(model_, q, dpos, RoundToBf16(written_.k[0]),
                                  RoundToBf16(written_.v[0]));
    EXPECT_LE(WorstToleranceRatio(out, ref, tol_.atol, tol_.rtol), 1.0);
  }

  // Fork everything: blocks are shared, attention is identical.
  auto child = client_->Fork(seq, 0);
  ASSERT_THAT(child, IsOk());
  EXPECT_NE(child->sequence_id, seq.sequence_id);
  EXPECT_EQ(child->num_tokens, 44u);
  ASSERT_EQ(child->blocks.size(), seq.blocks.size());
  for (size_t i = 0; i < seq.blocks.size(); ++i) {
    EXPECT_EQ(child->blocks[i].lineage_id(), seq.blocks[i].lineage_id());
    EXPECT_EQ(child->blocks[i].refcount(), 2u);
  }
  {
    const std::vector<uint64_t> p = {43};
    auto q = RandomQueries(1);
    EXPECT_EQ(Attend(*child, 1, p, q), Attend(seq, 1, p, q));
  }

  // Fork mid-block: block 2 (tokens 20..32) is cut at 30 and copied.
  auto cut = client_->Fork(seq, 30);
  ASSERT_THAT(cut, IsOk());
  EXPECT_EQ(cut->num_tokens, 30u);
  ASSERT_EQ(cut->blocks.size(), 3u);
  EXPECT_EQ(cut->blocks[0].lineage_id(), seq.blocks[0].lineage_id());
  EXPECT_EQ(cut->blocks[1].lineage_id(), seq.blocks[1].lineage_id());
  EXPECT_NE(cut->blocks[2].lineage_id(), seq.blocks[2].lineage_id());
  EXPECT_EQ(cut->blocks[2].num_tokens(), 10u);
  {
    const std::vector<uint64_t> p = {29, 25};
    auto q = RandomQueries(2);
    auto out = Attend(*cut, 0, p, q);
    auto ref = ReferenceAttention(model_, q, p, RoundToBf16(written_.k[0]),
                                  RoundToBf16(written_.v[0]));
    EXPECT_LE(WorstToleranceRatio(out, ref, tol_.atol, tol_.rtol), 1.0);
  }

  // Close all three: usage and inventory go back to zero.
  EXPECT_THAT(client_->Close(*cut), IsOk());
  EXPECT_THAT(client_->Close(*child), IsOk());
  EXPECT_THAT(client_->Close(seq), IsOk());
  auto tenant = cluster_->GetTenant("acme");
  ASSERT_THAT(tenant, IsOk());
  EXPECT_EQ(tenant->open_sequences(), 0u);
  for (const auto& u : tenant->usage()) {
    EXPECT_EQ(u.used_bytes(), 0u) << triax::v1::Tier_Name(u.tier());
  }
  EXPECT_THAT(Cluster::WaitFor("an empty worker inventory", absl::Seconds(5),
                               [&]() -> absl::StatusOr<bool> {
                                 auto w = cluster_->GetWorker("w0");
                                 if (!w.ok()) return w.status();
                                 return PagesUsed(w->inventory()) == 0 &&
                                        w->inventory().used_bytes() == 0 &&
                                        w->inventory().sequence_ids().empty();
                               }),
              IsOk());
}

// Quantized policies: the worker's attention matches the same math over K/V
// quantized by the CPU reference (blocks that left the BF16 window) within
// float32 accumulation error, and stays within a written error budget of
// exact BF16 attention.
struct QuantCase {
  const char* policy;
  triax::v1::Format format;
  double budget;  // relative L2 error of attention vs exact BF16
};

class QuantizedSessionTest : public SessionTest,
                             public ::testing::WithParamInterface<QuantCase> {};

TEST_P(QuantizedSessionTest, AttentionWithinBudget) {
  const QuantCase& qc = GetParam();
  constexpr int kWindow = 16;
  constexpr uint32_t kBlock = 16;
  ASSERT_NO_FATAL_FAILURE(StartCluster(kWindow));
  std::printf("seed 20261122 policy %s\n", qc.policy);
  auto opened = client_->Open(
      model_, {MakeSpan(ROLE_SYSTEM, 16), MakeSpan(ROLE_USER, 64)}, qc.policy,
      kBlock);
  ASSERT_THAT(opened, IsOk());
  const client::SequenceHandle seq = *opened;
  ASSERT_EQ(seq.blocks.size(), 5u);
  for (const auto& b : seq.blocks) EXPECT_EQ(b.format(), qc.format);
  ASSERT_NO_FATAL_FAILURE(WriteAll(seq, 0, 80));

  // What the worker holds: blocks whose end <= written - window are sealed
  // into their format; the rest are BF16 window pages.
  const uint64_t written = 80;
  triax::kernels::PageShape shape;
  shape.tokens = kBlock;
  shape.heads = model_.n_kv_heads();
  shape.head_dim = model_.head_dim();
  const auto fmt = static_cast<triax::kernels::Format>(qc.format);
  std::vector<uint8_t> page(triax::kernels::PageBytes(fmt, shape));
  for (uint32_t layer = 0; layer < model_.n_layers(); ++layer) {
    std::vector<float> qk = RoundToBf16(written_.k[layer]);
    std::vector<float> qv = RoundToBf16(written_.v[layer]);
    for (const auto& b : seq.blocks) {
      if (b.first_token() + b.num_tokens() + kWindow > written) continue;
      const size_t off = b.first_token() * Elems(),
                   n = b.num_tokens() * Elems();
      std::vector<uint16_t> kb(n), vb(n);
      for (size_t i = 0; i < n; ++i) {
        kb[i] = triax::kernels::FloatToBf16(written_.k[layer][off + i]);
        vb[i] = triax::kernels::FloatToBf16(written_.v[layer][off + i]);
      }
      triax::kernels::EncodePage(fmt, shape, kb.data(), vb.data(),
                                 b.num_tokens(), page.data());
      triax::kernels::DecodePage(fmt, shape, page.data(), b.num_tokens(),
                                 &qk[off], &qv[off]);
    }

    std::vector<float> rk, rv;
    ASSERT_THAT(client_->ReadKV(seq, layer, 0, 80, &rk, &rv), IsOk());
    ASSERT_EQ(rk.size(), qk.size());
    double max_diff = 0, max_quant_err = 0;
    const auto exact_k = RoundToBf16(written_.k[layer]);
    for (size_t i = 0; i < rk.size(); ++i) {
      max_diff = std::max({max_diff, std::abs(double(rk[i]) - qk[i]),
                           std::abs(double(rv[i]) - qv[i])});
      max_quant_err =
          std::max(max_quant_err, std::abs(double(qk[i]) - exact_k[i]));
    }
    EXPECT_LE(max_diff, 1e-5) << "layer " << layer;
    EXPECT_GT(max_quant_err, 1e-3) << "nothing was quantized";

    const std::vector<uint64_t> pos = {79, 50, 20};
    auto q = RandomQueries(pos.size());
    auto out = Attend(seq, layer, pos, q);
    auto ref_q = ReferenceAttention(model_, q, pos, qk, qv);
    auto ref_exact = ReferenceAttention(model_, q, pos, exact_k,
                                        RoundToBf16(written_.v[layer]));
    EXPECT_LE(WorstToleranceRatio(out, ref_q, tol_.atol, tol_.rtol), 1.0)
        << "layer " << layer;
    const double err = RelativeError(out, ref_exact);
    std::printf("policy %s layer %u relative error %.4f (budget %.2f)\n",
                qc.policy, layer, err, qc.budget);
    EXPECT_LE(err, qc.budget) << "layer " << layer;
    EXPECT_GT(err, 1e-4) << "no quantization error at all";
  }
  EXPECT_THAT(client_->Close(seq), IsOk());
}

// Budgets for N(0,1) K/V, 16-token pages, head_dim 32 (value groups of 32):
// INT4 has 15 steps over ~4.5 sigma (step 0.3, RMS error ~0.09 per value);
// INT2 has 3 (step 1.5, RMS error ~0.43).
INSTANTIATE_TEST_SUITE_P(
    Policies, QuantizedSessionTest,
    ::testing::Values(QuantCase{"int4", triax::v1::FORMAT_INT4, 0.15},
                      QuantCase{"int2", triax::v1::FORMAT_INT2, 0.70}),
    [](const ::testing::TestParamInfo<QuantCase>& info) {
      return std::string(info.param.policy);
    });

}  // namespace
}  // namespace triax::testing
