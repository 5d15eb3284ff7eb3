#include "worker/page_allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "common/status_matchers.h"
#include "worker/device.h"

namespace triax::worker {
namespace {

using kernels::Format;
using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

TEST(ArenaTest, FirstFitAndCoalescing) {
  Arena a(1000);
  size_t x, y, z;
  ASSERT_TRUE(a.Take(300, &x));
  ASSERT_TRUE(a.Take(300, &y));
  ASSERT_TRUE(a.Take(400, &z));
  EXPECT_EQ(x, 0u);
  EXPECT_EQ(y, 300u);
  EXPECT_EQ(z, 600u);
  EXPECT_EQ(a.free_bytes(), 0u);
  size_t w;
  EXPECT_FALSE(a.Take(1, &w));
  a.Give(x, 300);
  a.Give(z, 400);
  EXPECT_EQ(a.LargestFreeRun(), 400u);  // not adjacent yet
  EXPECT_FALSE(a.Take(500, &w));
  a.Give(y, 300);  // joins both neighbours
  EXPECT_EQ(a.LargestFreeRun(), 1000u);
  ASSERT_TRUE(a.Take(1000, &w));
  EXPECT_EQ(w, 0u);
}

class PageAllocatorTest : public ::testing::Test {
 protected:
  void Make(size_t capacity) {
    auto a = PageAllocator::Create(&device_, capacity);
    ASSERT_THAT(a.status(), IsOk());
    alloc_ = *std::move(a);
  }
  CpuDevice device_;
  std::unique_ptr<PageAllocator> alloc_;
};

TEST_F(PageAllocatorTest, CarvesDistinctAlignedPagesFromOneSlab) {
  Make(1 << 20);
  std::set<uint8_t*> seen;
  std::vector<Page*> pages;
  for (int i = 0; i < 10; ++i) {
    auto p = alloc_->Allocate(Format::kINT4, 4096, PageUse::kTarget);
    ASSERT_THAT(p.status(), IsOk());
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*p)->data) % 16, 0u);
    EXPECT_TRUE(seen.insert((*p)->data).second);
    pages.push_back(*p);
  }
  // Consecutive pages of one slab: addresses step by the page size.
  for (size_t i = 1; i < pages.size(); ++i) {
    EXPECT_EQ(pages[i]->data - pages[i - 1]->data, 4096);
  }
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.used_bytes, 10u * 4096);
  EXPECT_EQ(s.target[Format::kINT4].pages, 10u);
  // A 1 MiB arena carves slabs of 1 MiB / 64 = 16 KiB: 3 slabs of 4 pages.
  EXPECT_EQ(alloc_->SlabBytes(), 16u << 10);
  EXPECT_EQ(s.slab_bytes, 3u * (16u << 10));
  EXPECT_EQ(s.free_pages, 2u);
  for (Page* p : pages) EXPECT_TRUE(alloc_->Unref(p));
  s = alloc_->Stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.slab_bytes, 0u);  // the empty slab went back to the arena
  EXPECT_TRUE(s.target.empty());
}

TEST_F(PageAllocatorTest, FreeListReusesPages) {
  Make(1 << 20);
  auto a = alloc_->Allocate(Format::kBF16, 1024, PageUse::kTarget);
  auto b = alloc_->Allocate(Format::kBF16, 1024, PageUse::kTarget);
  ASSERT_TRUE(a.ok() && b.ok());
  uint8_t* freed = (*a)->data;
  EXPECT_TRUE(alloc_->Unref(*a));
  auto c = alloc_->Allocate(Format::kBF16, 1024, PageUse::kTarget);
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_EQ((*c)->data, freed);
  alloc_->Unref(*b);
  alloc_->Unref(*c);
}

TEST_F(PageAllocatorTest, RefcountsKeepSharedPagesAlive) {
  Make(1 << 20);
  auto p = alloc_->Allocate(Format::kINT2, 512, PageUse::kTarget);
  ASSERT_THAT(p.status(), IsOk());
  alloc_->Ref(*p);
  alloc_->Ref(*p);
  EXPECT_EQ(alloc_->RefCount(*p), 3);
  EXPECT_FALSE(alloc_->Unref(*p));
  EXPECT_FALSE(alloc_->Unref(*p));
  EXPECT_EQ(alloc_->Stats().used_bytes, 512u);
  EXPECT_TRUE(alloc_->Unref(*p));
  EXPECT_EQ(alloc_->Stats().used_bytes, 0u);
}

TEST_F(PageAllocatorTest, WindowPagesAreCountedApart) {
  Make(1 << 20);
  auto t = alloc_->Allocate(Format::kBF16, 2048, PageUse::kTarget);
  auto w = alloc_->Allocate(Format::kBF16, 2048, PageUse::kWindow);
  ASSERT_TRUE(t.ok() && w.ok());
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.window.pages, 1u);
  EXPECT_EQ(s.window.bytes, 2048u);
  EXPECT_EQ(s.target[Format::kBF16].pages, 1u);
  EXPECT_EQ(s.used_bytes, 4096u);
  alloc_->Unref(*t);
  alloc_->Unref(*w);
}

TEST_F(PageAllocatorTest, ExhaustionNamesPoolAndBytes) {
  // 10 KiB arena: two 4 KiB pages fit, a third does not.
  Make(10 * 1024);
  auto a = alloc_->Allocate(Format::kINT4, 4096, PageUse::kTarget);
  auto b = alloc_->Allocate(Format::kINT4, 4096, PageUse::kTarget);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  auto c = alloc_->Allocate(Format::kINT4, 4096, PageUse::kTarget);
  EXPECT_THAT(c.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                   AllOf(HasSubstr("int4/4096B"),
                                         HasSubstr("requested 4096 bytes"),
                                         HasSubstr("2048 bytes free"))));
  // A smaller pool still fits into the leftover run.
  auto d = alloc_->Allocate(Format::kINT2, 2048, PageUse::kTarget);
  EXPECT_THAT(d.status(), IsOk());
  // Freeing the first pool's pages gives its slab back for other pools.
  alloc_->Unref(*a);
  alloc_->Unref(*b);
  auto e = alloc_->Allocate(Format::kBF16, 8192, PageUse::kTarget);
  EXPECT_THAT(e.status(), IsOk());
  alloc_->Unref(*d);
  alloc_->Unref(*e);
  EXPECT_EQ(alloc_->Stats().slab_bytes, 0u);
}

TEST_F(PageAllocatorTest, RejectsBadPageSize) {
  Make(1 << 16);
  EXPECT_THAT(
      alloc_->Allocate(Format::kBF16, 0, PageUse::kTarget).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_bytes 0")));
  EXPECT_THAT(alloc_->Allocate(Format::kBF16, 100, PageUse::kTarget).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("page_bytes 100")));
}

}  // namespace
}  // namespace triax::worker
