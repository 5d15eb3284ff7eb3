// SequenceStore::Demote through a recording device: one DemotePages batch
// per call, and a device failure in the middle of a Demote leaving the
// sequence and the pool as they were. Demotion across every encoding and
// its refusals are in encoding_store_test.cc.
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
using store_testing::RelError;
using store_testing::Shape;
using store_testing::StoreTest;
using store_testing::UniformPlan;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

// Demote re-encodes every sealed page of the call in one DemotePages batch
// (blocks x layers), and sealing uses DemotePages too; attention afterwards
// reads the new encoding.
TEST_F(StoreTest, DemoteRunsOneDevicePageBatch) {
  Make(0);
  const ModelShape m = Shape(2, 2, 4, 32);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(48, 16, kInt4))
          .status(),
      IsOk());
  device_.ClearRecord();
  WriteAll("s", m, RandomLayers(m, 48, 9), 48, 48);
  // Window 0: each full block seals as written, one page per call.
  EXPECT_THAT(device_.demote_batches(), ElementsAre(1, 1, 1, 1, 1, 1));
  const auto q = RandomQueries(m, 1, 2);
  auto before = Attend("s", 1, q, 1, {});
  ASSERT_THAT(before.status(), IsOk());
  std::vector<BlockSpec> demote = UniformPlan(48, 16, kInt2);
  demote.erase(demote.begin());  // blocks 1 and 2
  device_.ClearRecord();
  auto r = store_->Demote(kTenant, "s", demote);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_reencoded, 4u);
  EXPECT_THAT(device_.demote_batches(), ElementsAre(4));
  auto after = Attend("s", 1, q, 1, {});
  ASSERT_THAT(after.status(), IsOk());
  ExpectFiniteNonZero(*after);
  EXPECT_NE(*after, *before);  // INT2 pages now, not the INT4 ones
  EXPECT_LT(RelError(*after, *before), 0.5);
}

// A device failure while filling the new pages (re-encoding a sealed page,
// or moving an unsealed BF16 block's tokens to a window page) releases
// every page reserved and leaves the blocks as they were; once the device
// is healthy the same Demote goes through.
TEST_F(StoreTest, DeviceFailureMidDemoteChangesNothing) {
  Make(8);
  const ModelShape m = Shape(1, 1, 1, 16);
  ASSERT_THAT(store_
                  ->AllocatePages(kTenant, "s", m, 8,
                                  Plan({{8, kInt4}, {8, kInt4}, {8, kBf16}}))
                  .status(),
              IsOk());
  auto kv = RandomLayers(m, 24, 17);
  WriteAll("s", m, kv, 24, 24);
  // Window 8: blocks 0 and 1 are sealed, block 2 (BF16) is not.
  ASSERT_THAT(store_->Describe("s")->sealed, ElementsAre(2u));
  auto read_before = store_->Read(kTenant, "s", 0, 0, 0);
  ASSERT_THAT(read_before.status(), IsOk());
  const InventorySnapshot before = store_->Inventory();
  std::vector<BlockSpec> sealed = Plan({{8, kInt2}});
  std::vector<BlockSpec> unsealed = Plan({{8, kInt4}, {8, kInt4}, {8, kInt4}});
  unsealed.erase(unsealed.begin(), unsealed.begin() + 2);

  device_.SetUnhealthy("device poisoned: test");
  EXPECT_THAT(store_->Demote(kTenant, "s", sealed).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("sequence_id=\"s\" re-encoding 1 "
                                       "sealed pages"),
                             HasSubstr("device poisoned: test"))));
  EXPECT_THAT(store_->Demote(kTenant, "s", unsealed).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("sequence_id=\"s\" block 2 layer 0")));
  const InventorySnapshot during = store_->Inventory();
  EXPECT_EQ(during.used_bytes, before.used_bytes);
  EXPECT_EQ(during.window_bytes, before.window_bytes);
  auto d = store_->Describe("s");
  EXPECT_EQ(d->blocks[0].encoding.k, kInt4);
  EXPECT_EQ(d->blocks[2].encoding.k, kBf16);
  EXPECT_THAT(d->window_pages, ElementsAre(0u));

  device_.SetUnhealthy("");
  auto read_after = store_->Read(kTenant, "s", 0, 0, 0);
  ASSERT_THAT(read_after.status(), IsOk());
  EXPECT_EQ(read_after->k, read_before->k);
  EXPECT_EQ(read_after->v, read_before->v);
  auto r = store_->Demote(kTenant, "s", unsealed);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_reencoded, 1u);
  d = store_->Describe("s");
  EXPECT_EQ(d->blocks[2].encoding.k, kInt4);
  EXPECT_THAT(d->window_pages, ElementsAre(1u));  // its tokens moved there
  auto moved = store_->Read(kTenant, "s", 0, 16, 8);
  ASSERT_THAT(moved.status(), IsOk());
  EXPECT_EQ(moved->k,
            std::vector<float>(read_before->k.begin() + ptrdiff_t{16} * 16,
                               read_before->k.end()));
}

}  // namespace
}  // namespace triax::worker
