// What the KV event publisher reads through the facade
// (ManagerCore::HashedBlocks, KeepBlockTokenIds): hashes and parents of the
// chain, token ids kept only when asked, blocks listed once, gone blocks
// absent.
#include <numeric>
#include <string>
#include <vector>

#include "kvmanager/manager_core_test_fixture.h"
#include "kvmanager/prefix_index.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAreArray;
using ::testing::IsEmpty;
using ::triax::testing::IsOk;

class HashedBlocksTest : public CoreTest {
 protected:
  // System 32 + user 32 tokens (four blocks of 16) with ids from `first`.
  absl::StatusOr<SequenceInfo> OpenIds(uint32_t first) {
    ids_.assign(64, 0);
    std::iota(ids_.begin(), ids_.end(), first);
    OpenSequenceRequest req;
    req.tenant_id = "acme";
    req.model = Model();
    req.spans = {S(Role::kSystem, 32), S(Role::kUser, 32)};
    req.block_tokens = 16;
    req.token_ids = ids_;
    return core_->OpenSequence(req);
  }
  std::vector<std::string> Chain() const {
    return ChainHashes("", ModelIdentity(Model()), PrefixSalt("acme", ""), 16,
                       ids_);
  }
  std::vector<uint32_t> ids_;
};

TEST_F(HashedBlocksTest, ChainAndParentsWithoutTokenIdsByDefault) {
  auto a = OpenIds(1);
  ASSERT_THAT(a, IsOk());
  const auto chain = Chain();
  const auto got = core_->HashedBlocks({a->sequence_id}, {}, false);
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].index, i);
    EXPECT_EQ(got[i].lineage_id, a->blocks[i].lineage_id);
    EXPECT_EQ(got[i].hash, chain[i]) << i;
    EXPECT_EQ(got[i].parent_hash, i == 0 ? "" : chain[i - 1]) << i;
    EXPECT_EQ(got[i].num_tokens, 16u);
    EXPECT_EQ(got[i].tier, Tier::kDevice);
    EXPECT_FALSE(got[i].evicted);
    EXPECT_THAT(got[i].token_ids, IsEmpty());  // not kept unless asked
  }
}

TEST_F(HashedBlocksTest, TokenIdsKeptOnceAskedAndForksListedOnce) {
  core_->KeepBlockTokenIds(true);
  auto a = OpenIds(100);
  ASSERT_THAT(a, IsOk());
  const auto chain = Chain();
  auto f = core_->ForkSequence({"", "acme", a->sequence_id, 48});
  ASSERT_THAT(f, IsOk());
  const auto all = core_->HashedBlocks({}, {}, true);
  ASSERT_EQ(all.size(), 4u);  // the fork's three shared blocks not again
  for (const auto& b : all) {
    EXPECT_EQ(b.hash, chain[b.index]);
    EXPECT_THAT(b.token_ids,
                ElementsAreArray(ids_.begin() + 16 * b.index,
                                 ids_.begin() + 16 * (b.index + 1)));
  }
  // Asked by lineage, a shared block reads its parent through its holder.
  const auto one = core_->HashedBlocks({}, {a->blocks[2].lineage_id}, false);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].parent_hash, chain[1]);
}

TEST_F(HashedBlocksTest, ClosedSequencesAndUnknownIdsAreAbsent) {
  auto a = OpenIds(7);
  ASSERT_THAT(a, IsOk());
  const uint64_t first = a->blocks[0].lineage_id;
  ASSERT_THAT(core_->CloseSequence({"", "acme", a->sequence_id}).status(),
              IsOk());
  EXPECT_THAT(
      core_->HashedBlocks({a->sequence_id, "seq-404"}, {first, 987654}, false),
      IsEmpty());
  EXPECT_THAT(core_->HashedBlocks({}, {}, true), IsEmpty());
}

}  // namespace
}  // namespace triax::manager
