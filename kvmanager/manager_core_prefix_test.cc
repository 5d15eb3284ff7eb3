// Prefix reuse by content hash through the facade (manager_core.h,
// prefix_index.h): the hash layout, the longest cached prefix, salts and
// tenant isolation, chains grown by Extend, the index's cleanup, bad input.
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "kvmanager/manager_core_test_fixture.h"
#include "kvmanager/prefix_index.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

std::vector<uint32_t> Ids(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

class PrefixTest : public CoreTest {
 protected:
  // System 32 + user `user` tokens (blocks of 16) with the given token ids.
  absl::StatusOr<SequenceInfo> OpenIds(const std::vector<uint32_t>& ids,
                                       const std::string& tenant = "acme",
                                       bool no_reuse = false) {
    OpenSequenceRequest req;
    req.tenant_id = tenant;
    req.model = Model();
    req.spans = {S(Role::kSystem, 32),
                 S(Role::kUser, static_cast<uint32_t>(ids.size() - 32))};
    req.token_ids = ids;
    req.no_reuse = no_reuse;
    return core_->OpenSequence(req);
  }
  uint64_t Indexed() { return core_->GetPressure(0).prefix_index_blocks; }
  absl::Status Close(const std::string& seq, const std::string& t = "acme") {
    return core_->CloseSequence({"", t, seq}).status();
  }
  void Tenant(const std::string& id, const std::string& salt) {
    CreateTenantRequest req;
    req.tenant_id = id;
    req.prefix_salt = salt;
    ASSERT_THAT(core_->CreateTenant(req), IsOk());
  }
};

TEST(PrefixHashTest, LayoutIsSha256OfTheDocumentedBytes) {
  // Known answers computed independently (Python hashlib over the layout of
  // prefix_index.h).
  const std::string model = ModelIdentity(Model());
  EXPECT_EQ(model, "test/2/2/4/64");
  const std::string salt = PrefixSalt("acme", "");
  EXPECT_EQ(salt, "tenant/acme");
  EXPECT_EQ(PrefixSalt("acme", "team"), "shared/team");
  const std::vector<std::string> chain =
      ChainHashes("", model, salt, 4, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  ASSERT_EQ(chain.size(), 2u);  // the partial third chunk has no hash
  EXPECT_EQ(HashHex(chain[0]),
            "d0ba25eeae45dc15326ef39db0d3aeca82797b768dc3a638ac71ffe8f6e0f3a4");
  EXPECT_EQ(HashHex(chain[1]),
            "a357c0a64fca8dc9f47b9e876e175df0ddf3164f9cce88998aed165ecebae0c2");
  EXPECT_EQ(chain[1], BlockHash(chain[0], model, salt,
                                std::vector<uint32_t>{5, 6, 7, 8}));
  // A partial block's hash covers its own token count.
  EXPECT_EQ(HashHex(BlockHash(chain[1], model, salt, std::vector<uint32_t>{9})),
            "c29d9ea5d9df08006243e8b57078777786e9ad8e80f5f8a6878829b36b23e65a");
  // Another salt or model gives another chain.
  EXPECT_NE(ChainHashes("", model, "tenant/other", 4, {1, 2, 3, 4})[0],
            chain[0]);
  EXPECT_NE(ChainHashes("", "x/2/2/4/64", salt, 4, {1, 2, 3, 4})[0], chain[0]);
}

TEST_F(PrefixTest, ReusesTheLongestCachedPrefixAndAllocatesTheRest) {
  auto a = OpenIds(Ids(100, 64));  // 4 full blocks
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->prefix_blocks, 0u);
  EXPECT_EQ(a->hashed_blocks, 4u);
  EXPECT_EQ(Indexed(), 4u);
  const uint64_t used = DeviceUsage();
  // Same first 48 tokens, then different ones.
  std::vector<uint32_t> ids = Ids(100, 48);
  for (uint32_t t : Ids(9000, 32)) ids.push_back(t);
  auto b = OpenIds(ids);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_sequence_id, a->sequence_id);
  EXPECT_EQ(b->prefix_blocks, 3u);
  EXPECT_EQ(b->prefix_tokens, 48u);
  ASSERT_EQ(b->blocks.size(), 5u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(b->blocks[i].lineage_id, a->blocks[i].lineage_id) << i;
    EXPECT_EQ(b->blocks[i].encoding, a->blocks[i].encoding) << i;
    EXPECT_EQ(b->blocks[i].tag, a->blocks[i].tag) << i;
  }
  EXPECT_NE(b->blocks[3].lineage_id, a->blocks[3].lineage_id);
  // Only B's two new blocks are charged.
  uint64_t new_bytes = 0;
  for (int i = 3; i < 5; ++i) new_bytes += Bytes(b->blocks[i].encoding);
  EXPECT_EQ(DeviceUsage() - used, new_bytes);
  EXPECT_EQ(CountKind(EventKind::kBlockShared, b->sequence_id), 3u);
  // B's own full blocks 3 and 4 are indexed too.
  EXPECT_EQ(b->hashed_blocks, 5u);
  EXPECT_EQ(Indexed(), 6u);
  const PressureState p = core_->GetPressure(0);
  EXPECT_EQ(p.prefix_hits, 1u);
  EXPECT_EQ(p.prefix_reused_blocks, 3u);

  // A third prompt equal to B's first 65 tokens reuses B's 4 blocks (3 of
  // them A's).
  ids.resize(65);
  auto c = OpenIds(ids);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_sequence_id, b->sequence_id);
  EXPECT_EQ(c->prefix_blocks, 4u);
  // The same 64 tokens as A: the block holding the last token is not
  // reused (the client runs that token for the first output's logits).
  auto d = OpenIds(Ids(100, 64));
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(d->prefix_blocks, 3u);
  EXPECT_EQ(d->hashed_blocks, 4u);
}

TEST_F(PrefixTest, NoReuseRegistersButSharesNothing) {
  ASSERT_THAT(OpenIds(Ids(1, 64)), IsOk());
  auto b = OpenIds(Ids(1, 65), "acme", /*no_reuse=*/true);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, 0u);
  EXPECT_EQ(b->hashed_blocks, 4u);  // the 65th token's block is partial
  EXPECT_EQ(Indexed(), 8u);
}

TEST_F(PrefixTest, PrivateSaltsIsolateTenants) {
  Tenant("other", "");
  auto a = OpenIds(Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  auto c = OpenIds(Ids(1, 64), "other");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_blocks, 0u);
  EXPECT_TRUE(c->prefix_sequence_id.empty());
  // Hashes computed with acme's salt do not open acme's blocks to "other".
  OpenSequenceRequest req;
  req.tenant_id = "other";
  req.model = Model();
  req.spans = {S(Role::kSystem, 32), S(Role::kUser, 32)};
  req.block_hashes = ChainHashes("", ModelIdentity(Model()),
                                 PrefixSalt("acme", ""), 16, Ids(1, 64));
  auto d = core_->OpenSequence(req);
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(d->prefix_blocks, 0u);
  // The same hashes from acme itself reuse (all but the last block).
  req.tenant_id = "acme";
  auto e = core_->OpenSequence(req);
  ASSERT_THAT(e, IsOk());
  EXPECT_EQ(e->prefix_sequence_id, a->sequence_id);
  EXPECT_EQ(e->prefix_blocks, 3u);
}

TEST_F(PrefixTest, TenantsOptedIntoOneSaltShare) {
  Tenant("t1", "team");
  Tenant("t2", "team");
  Tenant("t3", "other-team");
  auto a = OpenIds(Ids(1, 64), "t1");
  ASSERT_THAT(a, IsOk());
  const uint64_t t1_used = DeviceUsage("t1");
  auto b = OpenIds(Ids(1, 64), "t2");
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_sequence_id, a->sequence_id);
  EXPECT_EQ(b->prefix_tenant_id, "t1");
  EXPECT_EQ(b->prefix_blocks, 3u);
  // The shared blocks stay charged to the tenant that created them; t2 pays
  // for its own last block.
  EXPECT_EQ(DeviceUsage("t2"), Bytes(b->blocks[3].encoding));
  EXPECT_EQ(DeviceUsage("t1"), t1_used);
  auto c = OpenIds(Ids(1, 64), "t3");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_blocks, 0u);
  auto info = core_->GetTenant("t2");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->prefix_salt, "team");
}

TEST_F(PrefixTest, ExtendGrowsTheChain) {
  // 16 system + 8 user: block 1 is partial, then filled by an Extend.
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kSystem, 16), S(Role::kUser, 8)};
  req.token_ids = Ids(1, 24);
  auto a = core_->OpenSequence(req);
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->hashed_blocks, 1u);
  ExtendSequenceRequest ext;
  ext.tenant_id = "acme";
  ext.sequence_id = a->sequence_id;
  ext.spans = {S(Role::kUser, 8), S(Role::kAssistant, 16)};
  ext.continue_last_span = true;
  ext.token_ids = Ids(25, 24);
  auto x = core_->ExtendSequence(ext);
  ASSERT_THAT(x, IsOk());
  EXPECT_EQ(x->sequence.hashed_blocks, 3u);
  EXPECT_EQ(Indexed(), 3u);
  // A later conversation with the same 48 tokens reuses all three.
  req.spans = {S(Role::kSystem, 16), S(Role::kUser, 48)};
  req.token_ids = Ids(1, 64);
  auto b = core_->OpenSequence(req);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, 3u);
  // An Extend without ids ends the chain.
  ext.sequence_id = b->sequence_id;
  ext.spans = {S(Role::kUser, 16)};
  ext.continue_last_span = false;
  ext.token_ids.clear();
  auto y = core_->ExtendSequence(ext);
  ASSERT_THAT(y, IsOk());
  EXPECT_EQ(y->sequence.hashed_blocks, 4u);
}

TEST_F(PrefixTest, APartialBlockIsSealedOnceAnotherFollowsIt) {
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kSystem, 20), S(Role::kUser, 32)};  // 16, 4, 16, 16
  req.token_ids = Ids(1, 52);
  auto a = core_->OpenSequence(req);
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->hashed_blocks, 4u);
  EXPECT_EQ(Indexed(), 4u);
  // The same system turn and the first 16 user tokens, then others: blocks
  // 16, 4 and 16 are reused (36 tokens).
  req.token_ids = Ids(1, 36);
  for (uint32_t t : Ids(800, 16)) req.token_ids.push_back(t);
  auto b = core_->OpenSequence(req);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, 3u);
  EXPECT_EQ(b->prefix_tokens, 36u);
  // Another span layout over the same tokens is another chain: the
  // system turn of 16 tokens then 36 user tokens shares only block 0.
  req.spans = {S(Role::kSystem, 16), S(Role::kUser, 36)};  // 16, 16, 16, 4
  req.token_ids = Ids(1, 52);
  auto c = core_->OpenSequence(req);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_blocks, 1u);
  EXPECT_EQ(c->prefix_tokens, 16u);
  // A partial last block waits for an Extend; a new block seals it.
  EXPECT_EQ(c->hashed_blocks, 3u);
  ExtendSequenceRequest ext;
  ext.tenant_id = "acme";
  ext.sequence_id = c->sequence_id;
  ext.spans = {S(Role::kAssistant, 5)};
  ext.new_turn = true;
  ext.token_ids = Ids(900, 5);
  auto x = core_->ExtendSequence(ext);
  ASSERT_THAT(x, IsOk());
  EXPECT_EQ(x->sequence.hashed_blocks, 4u);
}

TEST_F(PrefixTest, IndexIsCleanedWhenBlocksGo) {
  auto a = OpenIds(Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  auto b = OpenIds(Ids(1, 65));
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, 4u);
  EXPECT_EQ(Indexed(), 4u);
  // A closes: B still holds the blocks, which stay reusable through B.
  ASSERT_THAT(Close(a->sequence_id), IsOk());
  EXPECT_EQ(Indexed(), 4u);
  auto c = OpenIds(Ids(1, 49));
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_blocks, 3u);
  EXPECT_EQ(c->prefix_sequence_id, b->sequence_id);
  ASSERT_THAT(Close(b->sequence_id), IsOk());
  EXPECT_EQ(Indexed(), 3u);  // C's share of them
  ASSERT_THAT(Close(c->sequence_id), IsOk());
  EXPECT_EQ(Indexed(), 0u);
  // Nothing left to reuse.
  auto d = OpenIds(Ids(1, 64));
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(d->prefix_blocks, 0u);
  // Truncating into a hashed block takes it out.
  TruncateSequenceRequest tr;
  tr.tenant_id = "acme";
  tr.sequence_id = d->sequence_id;
  tr.num_tokens = 40;
  auto t = core_->TruncateSequence(tr);
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(t->sequence.hashed_blocks, 2u);
  EXPECT_EQ(Indexed(), 2u);
  // A lost sequence's blocks leave too.
  clock_.AdvanceMs(ManagerOptions{}.worker_down_timeout_ms + 1);
  core_->CheckWorkers();
  clock_.AdvanceMs(ManagerOptions{}.worker_down_timeout_ms + 1);
  core_->CheckWorkers();
  EXPECT_EQ(Indexed(), 0u);
}

TEST_F(PrefixTest, ForkKeepsTheChainUpToItsCut) {
  auto a = OpenIds(Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  auto f = core_->ForkSequence({"", "acme", a->sequence_id, 40});
  ASSERT_THAT(f, IsOk());
  EXPECT_EQ(f->hashed_blocks, 2u);
  auto g = core_->ForkSequence({"", "acme", a->sequence_id, 48});
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->hashed_blocks, 3u);
  // g's chain is open at a block boundary: an Extend with ids grows it.
  ExtendSequenceRequest ext;
  ext.tenant_id = "acme";
  ext.sequence_id = g->sequence_id;
  ext.spans = {S(Role::kUser, 16)};
  ext.token_ids = Ids(7000, 16);
  auto x = core_->ExtendSequence(ext);
  ASSERT_THAT(x, IsOk());
  EXPECT_EQ(x->sequence.hashed_blocks, 4u);
}

TEST_F(PrefixTest, OnlyASequenceWithTheSameWindowIsAPrefix) {
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kSystem, 32), S(Role::kUser, 33)};
  req.token_ids = Ids(1, 65);
  req.window_tokens = 8;
  auto a = core_->OpenSequence(req);
  ASSERT_THAT(a, IsOk());
  req.window_tokens.reset();  // the worker's default: maybe another window
  auto b = core_->OpenSequence(req);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->prefix_blocks, 0u);
  req.window_tokens = 8;
  auto c = core_->OpenSequence(req);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->prefix_blocks, 4u);
  EXPECT_EQ(c->prefix_sequence_id, a->sequence_id);
}

TEST_F(PrefixTest, BadInputNamesTheField) {
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kSystem, 32), S(Role::kUser, 32)};
  req.token_ids = Ids(1, 63);
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("token_ids has 63 ids")));
  req.token_ids.clear();
  req.block_hashes = {std::string(31, 'x')};
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block_hashes[0] has 31 bytes")));
  req.block_hashes.assign(5, std::string(32, 'x'));
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block_hashes has 5 hashes")));
  req.block_hashes.assign(2, std::string(32, 'x'));
  req.token_ids = Ids(1, 64);
  EXPECT_THAT(core_->OpenSequence(req),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block_hashes[0]")));
  auto a = OpenIds(Ids(1, 64));
  ASSERT_THAT(a, IsOk());
  ExtendSequenceRequest ext;
  ext.tenant_id = "acme";
  ext.sequence_id = a->sequence_id;
  ext.spans = {S(Role::kUser, 16)};
  ext.token_ids = Ids(1, 3);
  EXPECT_THAT(core_->ExtendSequence(ext),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("token_ids has 3 ids")));
  CreateTenantRequest ct;
  ct.tenant_id = "bad";
  ct.prefix_salt = "no spaces";
  EXPECT_THAT(
      core_->CreateTenant(ct),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix_salt")));
  // Nothing was indexed by the refused calls.
  EXPECT_EQ(Indexed(), 4u);
}

TEST_F(PrefixTest, IdempotentOpenReusesOnce) {
  OpenSequenceRequest req;
  req.request_id = "r1";
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kSystem, 32), S(Role::kUser, 32)};
  req.token_ids = Ids(1, 64);
  ASSERT_THAT(core_->OpenSequence(req), IsOk());
  req.request_id = "r2";
  auto b = core_->OpenSequence(req);
  ASSERT_THAT(b, IsOk());
  auto again = core_->OpenSequence(req);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->sequence_id, b->sequence_id);
  EXPECT_EQ(core_->GetPressure(0).prefix_hits, 1u);
}

}  // namespace
}  // namespace triax::manager
