// SequenceStore::Fork: shared and copied blocks, sealed pages copied
// byte for byte, plans refused without change, shared blocks that cannot
// grow, and the plan's tier fields ignored.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "worker/sequence_store.h"
#include "worker/store_test_util.h"

namespace triax::worker {
namespace {

using store_testing::ExpectFiniteNonZero;
using store_testing::kBf16;
using store_testing::kInt2;
using store_testing::kInt4;
using store_testing::kTenant;
using store_testing::Plan;
using store_testing::Shape;
using store_testing::StoreTest;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

TEST_F(StoreTest, ForkSharesFullBlocksAndCopiesThePartialOne) {
  Make(16);
  const ModelShape m = Shape(2, 2, 4, 32);
  const auto plan = Plan({{16, kInt4}, {16, kInt2}, {16, kInt4}, {6, kBf16}});
  ASSERT_THAT(store_->AllocatePages(kTenant, "p", m, 16, plan).status(),
              IsOk());
  auto kv = RandomLayers(m, 54, 41);
  WriteAll("p", m, kv, 54, 9);
  EXPECT_THAT(store_->Describe("p")->sealed, ElementsAre(2u, 2u));

  // Child keeps 40 tokens: blocks 0-1 shared, block 2 copied (new lineage),
  // planned to grow to 16 tokens.
  auto child_plan = Plan({{16, kInt4}, {16, kInt2}, {16, kInt4}});
  child_plan[2].lineage_id = 900;
  auto r = store_->Fork(kTenant, "p", "c", 40, child_plan);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_shared, 4u);  // 2 blocks x 2 layers
  EXPECT_EQ(r->pages_copied, 2u);
  auto shared_page = store_->TargetPage("c", 1, 0);
  ASSERT_THAT(shared_page.status(), IsOk());
  EXPECT_EQ(*shared_page, *store_->TargetPage("p", 1, 0));
  EXPECT_EQ(alloc_->RefCount(*shared_page), 2);
  EXPECT_NE(*store_->TargetPage("c", 2, 0), *store_->TargetPage("p", 2, 0));
  auto d = store_->Describe("c");
  EXPECT_THAT(d->written, ElementsAre(40u, 40u));
  EXPECT_THAT(d->sealed, ElementsAre(2u, 2u));

  auto q = RandomQueries(m, 1, 6);
  std::vector<float> parent_layer0;
  for (uint32_t l = 0; l < 2; ++l) {
    auto parent_out = Attend("p", l, q, 1, {39});
    if (l == 0 && parent_out.ok()) parent_layer0 = *parent_out;
    auto child_out = Attend("c", l, q, 1, {39});
    ASSERT_THAT(parent_out.status(), IsOk());
    ASSERT_THAT(child_out.status(), IsOk());
    ExpectFiniteNonZero(*child_out);
    EXPECT_EQ(*child_out, *parent_out);
  }
  // The child continues on its own copy; the parent is untouched.
  auto other = RandomLayers(m, 48, 99);
  WriteAll("c", m, other, 48, 8, 40);
  EXPECT_THAT(store_->Describe("c")->sealed, ElementsAre(2u, 2u));
  auto parent_again = Attend("p", 0, q, 1, {39});
  ASSERT_THAT(parent_again.status(), IsOk());
  EXPECT_EQ(*parent_again, parent_layer0);
  auto parent_read = store_->Read(kTenant, "p", 0, 32, 22);
  ASSERT_THAT(parent_read.status(), IsOk());
  EXPECT_EQ(parent_read->k,
            std::vector<float>(kv[0].kr.begin() + std::ptrdiff_t{32} * 64,
                               kv[0].kr.end()));

  // Freeing the parent keeps the shared pages alive for the child.
  auto child_before = Attend("c", 1, q, 1, {20});
  auto freed = store_->Free(kTenant, "p");
  ASSERT_THAT(freed.status(), IsOk());
  EXPECT_EQ(alloc_->RefCount(*shared_page), 1);
  auto child_after = Attend("c", 1, q, 1, {20});
  ASSERT_THAT(child_after.status(), IsOk());
  EXPECT_EQ(*child_after, *child_before);
  ASSERT_THAT(store_->Free(kTenant, "c").status(), IsOk());
  const AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.held_bytes, 0u);
  EXPECT_TRUE(store_->Inventory().sequence_ids.empty());
}

TEST_F(StoreTest, ForkCopiesSealedBlocksAndRejectsBadPlans) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  ASSERT_THAT(store_
                  ->AllocatePages(kTenant, "p", m, 8,
                                  Plan({{8, kInt4}, {8, kInt2}, {8, kInt4}}))
                  .status(),
              IsOk());
  auto kv = RandomLayers(m, 24, 8);
  WriteAll("p", m, kv, 20, 20);
  // Copy everything under new lineage ids: block 0/1 byte-copied sealed,
  // block 2 (4 tokens) into the window.
  auto r = store_->Fork(kTenant, "p", "c", 20,
                        Plan({{8, kInt4}, {8, kInt2}, {8, kInt4}}, 700));
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_shared, 0u);
  EXPECT_EQ(r->pages_copied, 3u);
  EXPECT_THAT(store_->Describe("c")->sealed, ElementsAre(2u));
  auto pr = store_->Read(kTenant, "p", 0, 0, 0);
  auto cr = store_->Read(kTenant, "c", 0, 0, 0);
  ASSERT_TRUE(pr.ok() && cr.ok());
  EXPECT_EQ(pr->k, cr->k);
  EXPECT_EQ(pr->v, cr->v);

  const InventorySnapshot before = store_->Inventory();
  // Shared block 2 is not fully written (20 of 24).
  EXPECT_THAT(
      store_
          ->Fork(kTenant, "p", "d", 24,
                 Plan({{8, kInt4}, {8, kInt2}, {8, kInt4}}))
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("blocks[2] (lineage_id=102) is not fully written")));
  // Shared block crossing num_tokens.
  EXPECT_THAT(
      store_->Fork(kTenant, "p", "d", 12, Plan({{8, kInt4}, {8, kInt2}}))
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("past num_tokens=12")));
  auto moved = Plan({{8, kInt4}, {8, kInt2}});
  moved[1].lineage_id = 100;
  moved[0].lineage_id = 600;
  EXPECT_THAT(store_->Fork(kTenant, "p", "d", 16, moved).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("blocks[1] (lineage_id=100)")));
  EXPECT_THAT(store_->Fork(kTenant, "p", "c", 8, Plan({{8, kInt4}})).status(),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("child_sequence_id=\"c\"")));
  EXPECT_THAT(store_->Fork(kTenant, "x", "d", 8, Plan({{8, kInt4}})).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("parent_sequence_id=\"x\"")));
  EXPECT_THAT(
      store_->Fork("tenant-b", "p", "d", 8, Plan({{8, kInt4}})).status(),
      StatusIs(absl::StatusCode::kPermissionDenied,
               HasSubstr("tenant_id=\"tenant-b\"")));
  EXPECT_THAT(
      store_->Fork(kTenant, "p", "d", 0, Plan({{8, kInt4}})).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_tokens=0")));
  EXPECT_THAT(
      store_->Fork(kTenant, "p", "d", 30, Plan({{8, kInt4}})).status(),
      StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("num_tokens=30")));
  const InventorySnapshot after = store_->Inventory();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.sequence_ids, before.sequence_ids);
}

TEST_F(StoreTest, SharedBlocksCannotGrow) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  const auto plan = Plan({{8, kInt4}, {5, kInt4}});
  ASSERT_THAT(store_->AllocatePages(kTenant, "p", m, 8, plan).status(), IsOk());
  auto kv = RandomLayers(m, 13, 12);
  WriteAll("p", m, kv, 13, 13);
  ASSERT_THAT(store_->Fork(kTenant, "p", "c", 13, plan).status(), IsOk());
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "p", m, 8, Plan({{8, kInt4}, {8, kInt4}}))
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("blocks[1] (lineage_id=101) is shared by 2")));
  ASSERT_THAT(store_->Free(kTenant, "c").status(), IsOk());
  // Once the child is gone the block is private again and may grow.
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "p", m, 8, Plan({{8, kInt4}, {8, kInt4}}))
          .status(),
      IsOk());
  EXPECT_THAT(store_->Describe("p")->sealed, ElementsAre(1u));
}

// A fork's plan tier fields are ignored: shared and copied blocks are on the
// device and not evicted, whatever the plan says.
TEST_F(StoreTest, ForkIgnoresThePlansTierFields) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "p", m, 8, Plan({{8, kInt4}, {8, kInt4}}))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 16, 5);
  WriteAll("p", m, kv, 16, 16);
  auto child = Plan({{8, kInt4}, {8, kInt2}});
  child[0].tier = Tier::kDisk;  // shared
  child[1].lineage_id = 900;    // copied
  child[1].tier = Tier::kHost;
  child[1].evicted = true;
  auto r = store_->Fork(kTenant, "p", "c", 16, child);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_shared, 1u);
  EXPECT_EQ(r->pages_copied, 1u);
  auto d = store_->Describe("c");
  ASSERT_THAT(d.status(), IsOk());
  ASSERT_EQ(d->blocks.size(), 2u);
  for (const BlockSpec& b : d->blocks) {
    EXPECT_EQ(b.tier, Tier::kDevice) << "block " << b.index;
    EXPECT_FALSE(b.evicted) << "block " << b.index;
  }
  EXPECT_EQ(d->blocks[0].encoding.k, kInt4);  // the parent's
  EXPECT_EQ(d->blocks[1].encoding.k, kInt2);  // the child plan's
  EXPECT_EQ(d->blocks[1].lineage_id, 900u);
  EXPECT_THAT(d->sealed, ElementsAre(2u));
  auto pr = store_->Read(kTenant, "p", 0, 0, 8);
  auto cr = store_->Read(kTenant, "c", 0, 0, 8);
  ASSERT_TRUE(pr.ok() && cr.ok());
  EXPECT_EQ(pr->k, cr->k);
  auto q = RandomQueries(m, 1, 3);
  auto out = Attend("c", 0, q, 1, {});
  ASSERT_THAT(out.status(), IsOk());
  ExpectFiniteNonZero(*out);
}

TEST_F(StoreTest, ForkOfAnotherTenantsParentNamesItsTenant) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  ASSERT_THAT(
      store_->AllocatePages("owner", "p", m, 8, Plan({{8, kInt4}, {8, kInt4}}))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 16, 5);
  std::string kb, vb;
  ASSERT_THAT(store_
                  ->Write("owner", "p",
                          store_testing::Chunk(0, 0, 16, kv[0], 16, &kb, &vb))
                  .status(),
              IsOk());
  // Block 0 shared, block 1 the child's own (allocated, nothing copied).
  auto child = Plan({{8, kInt4}, {8, kInt4}});
  child[1].lineage_id = 900;
  // Without parent_tenant_id the parent is not the caller's.
  EXPECT_THAT(store_->Fork(kTenant, "p", "c", 8, child),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(store_->Fork(kTenant, "p", "c", 8, child, "bad tenant"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parent_tenant_id")));
  auto r = store_->Fork(kTenant, "p", "c", 8, child, "owner");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_shared, 1u);
  // The child is the caller's, not the parent tenant's.
  EXPECT_THAT(store_->Read("owner", "c", 0, 0, 8).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  auto pr = store_->Read("owner", "p", 0, 0, 8);
  auto cr = store_->Read(kTenant, "c", 0, 0, 8);
  ASSERT_TRUE(pr.ok() && cr.ok());
  EXPECT_EQ(pr->k, cr->k);
}

}  // namespace
}  // namespace triax::worker
