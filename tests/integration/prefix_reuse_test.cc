// Prefix reuse by content hash against real kvmanager and kvworker
// processes (docs/manager.md "Prefix reuse"): a second Open with the same
// prompt prefix shares the first sequence's pages and reads its KV back
// byte for byte; another tenant (private salt) does not; an unwritten prefix
// makes the client open again without reuse; the index empties as the
// sequences close.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

std::vector<uint32_t> Ids(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

class PrefixReuseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = Cluster::Start(ClusterOptions{});
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    ASSERT_THAT(cluster_->CreateTenant("acme", 0, "bf16"), IsOk());
    ASSERT_THAT(cluster_->CreateTenant("other", 0, "bf16"), IsOk());
    auto a = cluster_->NewClient("acme");
    ASSERT_THAT(a, IsOk());
    acme_ = std::move(*a);
    auto o = cluster_->NewClient("other");
    ASSERT_THAT(o, IsOk());
    other_ = std::move(*o);
  }

  absl::StatusOr<client::SequenceHandle> Open(
      client::Client* c, const std::vector<uint32_t>& ids) {
    std::vector<triax::v1::Span> spans(2);
    spans[0].set_role(ROLE_SYSTEM);
    spans[0].set_num_tokens(32);
    spans[1].set_role(ROLE_USER);
    spans[1].set_num_tokens(static_cast<uint32_t>(ids.size() - 32));
    client::OpenOptions o;
    o.block_tokens = 16;
    o.token_ids = ids;
    return c->Open(model_, spans, o);
  }

  void Write(client::Client* c, const client::SequenceHandle& h, uint64_t first,
             uint32_t n) {
    const size_t elems = size_t{model_.n_kv_heads()} * model_.head_dim();
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      auto k = RandomVector(n * elems, &rng_);
      auto v = RandomVector(n * elems, &rng_);
      ASSERT_THAT(c->WriteKV(h, l, first, n, k.data(), v.data()), IsOk());
    }
  }

  uint64_t Indexed() {
    grpc::ClientContext ctx;
    triax::v1::GetPressureRequest req;
    triax::v1::GetPressureResponse resp;
    EXPECT_TRUE(cluster_->manager()->GetPressure(&ctx, req, &resp).ok());
    return resp.prefix_index_blocks();
  }

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<client::Client> acme_, other_;
  triax::v1::ModelShape model_ = SmallModel();
  std::mt19937 rng_{20260525};
};

TEST_F(PrefixReuseTest, SecondOpenReadsTheFirstOnesPrefixBackByteExact) {
  auto a = Open(acme_.get(), Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->prefix_tokens, 0u);
  Write(acme_.get(), *a, 0, 64);
  EXPECT_EQ(Indexed(), 4u);

  std::vector<uint32_t> ids = Ids(1, 48);
  for (uint32_t t : Ids(5000, 16)) ids.push_back(t);
  auto b = Open(acme_.get(), ids);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_sequence_id, a->sequence_id);
  EXPECT_EQ(b->prefix_tokens, 48u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(b->blocks[i].lineage_id(), a->blocks[i].lineage_id());
  }
  // Only the rest is prefilled.
  Write(acme_.get(), *b, 48, 16);
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    std::vector<float> ka, va, kb, vb;
    ASSERT_THAT(acme_->ReadKV(*a, l, 0, 48, &ka, &va), IsOk());
    ASSERT_THAT(acme_->ReadKV(*b, l, 0, 48, &kb, &vb), IsOk());
    ASSERT_EQ(ka.size(), kb.size());
    ASSERT_FALSE(ka.empty());
    EXPECT_EQ(std::memcmp(ka.data(), kb.data(), ka.size() * sizeof(float)), 0)
        << "layer " << l;
    EXPECT_EQ(std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)), 0)
        << "layer " << l;
    std::vector<float> kt, vt;
    ASSERT_THAT(acme_->ReadKV(*b, l, 48, 16, &kt, &vt), IsOk());
    EXPECT_EQ(kt.size(), 16 * size_t{model_.n_kv_heads()} * model_.head_dim());
  }
  // B's own full block joins the index.
  EXPECT_EQ(Indexed(), 5u);

  // Another tenant with the same tokens reuses nothing.
  auto c = Open(other_.get(), Ids(1, 64));
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_tokens, 0u);
  EXPECT_TRUE(c->prefix_sequence_id.empty());
  EXPECT_EQ(Indexed(), 9u);

  // A's last block goes; B still holds its first three.
  ASSERT_THAT(acme_->Close(*a), IsOk());
  EXPECT_EQ(Indexed(), 8u);
  ASSERT_THAT(acme_->Close(*b), IsOk());
  ASSERT_THAT(other_->Close(*c), IsOk());
  EXPECT_EQ(Indexed(), 0u);
}

TEST_F(PrefixReuseTest, UnwrittenPrefixFallsBackToAFreshOpen) {
  auto a = Open(acme_.get(), Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  // Nothing written: the worker refuses the fork, the client opens again.
  auto b = Open(acme_.get(), Ids(1, 64));
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_tokens, 0u);
  Write(acme_.get(), *b, 0, 64);
  std::vector<float> k, v;
  ASSERT_THAT(acme_->ReadKV(*b, 0, 0, 64, &k, &v), IsOk());
  EXPECT_EQ(k.size(), 64 * size_t{model_.n_kv_heads()} * model_.head_dim());
  ASSERT_THAT(acme_->Close(*a), IsOk());
  ASSERT_THAT(acme_->Close(*b), IsOk());
  EXPECT_EQ(Indexed(), 0u);
}

TEST_F(PrefixReuseTest, TenantsOfOneSaltShareAcrossTenants) {
  for (const char* t : {"s1", "s2"}) {
    grpc::ClientContext ctx;
    triax::v1::CreateTenantRequest req;
    req.set_tenant_id(t);
    req.set_default_policy("bf16");
    req.set_prefix_salt("team");
    triax::v1::CreateTenantResponse resp;
    ASSERT_TRUE(cluster_->manager()->CreateTenant(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.tenant().prefix_salt(), "team");
  }
  auto c1 = cluster_->NewClient("s1");
  ASSERT_THAT(c1, IsOk());
  auto c2 = cluster_->NewClient("s2");
  ASSERT_THAT(c2, IsOk());
  auto a = Open(c1->get(), Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  Write(c1->get(), *a, 0, 64);
  auto b = Open(c2->get(), Ids(1, 64));
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_sequence_id, a->sequence_id);
  // All but the block with the prompt's last token, which the client runs
  // for the first output's logits.
  EXPECT_EQ(b->prefix_tokens, 48u);
  Write(c2->get(), *b, 48, 16);
  std::vector<float> ka, va, kb, vb;
  ASSERT_THAT((*c1)->ReadKV(*a, 1, 0, 48, &ka, &va), IsOk());
  ASSERT_THAT((*c2)->ReadKV(*b, 1, 0, 48, &kb, &vb), IsOk());
  ASSERT_EQ(ka.size(), kb.size());
  EXPECT_EQ(std::memcmp(ka.data(), kb.data(), ka.size() * sizeof(float)), 0);
  // acme (private salt) reuses neither.
  auto c = Open(acme_.get(), Ids(1, 64));
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_tokens, 0u);
  ASSERT_THAT((*c1)->Close(*a), IsOk());
  ASSERT_THAT((*c2)->Close(*b), IsOk());
  ASSERT_THAT(acme_->Close(*c), IsOk());
  EXPECT_EQ(Indexed(), 0u);
}

}  // namespace
}  // namespace triax::testing
