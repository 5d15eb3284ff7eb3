#include "worker/page_allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
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

TEST(ArenaTest, TakeLargestTakesWholeUnitsFromTheLongestRun) {
  Arena a(4096);
  size_t x, y, z, w;
  ASSERT_TRUE(a.Take(1024, &x));  // [0, 1024)
  ASSERT_TRUE(a.Take(1024, &y));  // [1024, 2048)
  ASSERT_TRUE(a.Take(1536, &z));  // [2048, 3584)
  a.Give(x, 1024);                // free: [0, 1024) and [3584, 4096)
  EXPECT_EQ(a.free_runs(), 2u);
  EXPECT_EQ(a.LargestFreeRun(), 1024u);
  // Capped by max_bytes: taken from the start of the longest run.
  size_t off = 99;
  EXPECT_EQ(a.TakeLargest(256, 256, &off), 256u);
  EXPECT_EQ(off, 0u);
  // Then the longest left: 768 at 256, then 512 at 3584.
  EXPECT_EQ(a.TakeLargest(4096, 256, &off), 768u);
  EXPECT_EQ(off, 256u);
  EXPECT_EQ(a.TakeLargest(4096, 256, &off), 512u);
  EXPECT_EQ(off, 3584u);
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_EQ(a.free_runs(), 0u);
  off = 99;
  EXPECT_EQ(a.TakeLargest(4096, 256, &off), 0u);  // nothing left
  EXPECT_EQ(off, 99u);
  // Rounded down to the unit; a run shorter than the unit gives nothing.
  a.Give(0, 300);
  EXPECT_EQ(a.TakeLargest(4096, 256, &off), 256u);
  EXPECT_EQ(off, 0u);
  EXPECT_EQ(a.TakeLargest(4096, 256, &off), 0u);
  EXPECT_EQ(a.free_bytes(), 44u);
  // Equal longest runs: the lowest offset goes first.
  Arena b(3072);
  ASSERT_TRUE(b.Take(3072, &w));
  b.Give(2048, 512);
  b.Give(0, 512);
  EXPECT_EQ(b.TakeLargest(256, 256, &off), 256u);
  EXPECT_EQ(off, 0u);
}

TEST(ArenaTest, GatherTakesOneRunWhenOneHoldsTheBytes) {
  Arena a(8192);
  size_t x, y;
  ASSERT_TRUE(a.Take(1024, &x));
  ASSERT_TRUE(a.Take(1024, &y));
  a.Give(x, 1024);  // free: [0, 1024), [2048, 8192)
  std::vector<Arena::Run> runs;
  ASSERT_TRUE(a.Gather(768, 256, &runs));  // first fit: the first run
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].offset, 0u);
  EXPECT_EQ(runs[0].bytes, 768u);
  ASSERT_TRUE(a.Gather(2048, 256, &runs));  // appended
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[1].offset, 2048u);
  EXPECT_EQ(runs[1].bytes, 2048u);
  // Not a multiple of the unit, zero bytes, zero unit: refused, nothing
  // taken.
  EXPECT_FALSE(a.Gather(100, 256, &runs));
  EXPECT_FALSE(a.Gather(0, 256, &runs));
  EXPECT_FALSE(a.Gather(256, 0, &runs));
  EXPECT_EQ(runs.size(), 2u);
  EXPECT_EQ(a.free_bytes(), 8192u - 1024 - 768 - 2048);
}

TEST(ArenaTest, GatherScattersOverTheLargestRunsAllOrNothing) {
  // Ten 512-byte slots; the odd ones stay taken.
  Arena a(5120);
  std::vector<size_t> slot(10);
  for (size_t& o : slot) ASSERT_TRUE(a.Take(512, &o));
  for (int i = 0; i < 10; i += 2) a.Give(slot[i], 512);
  a.Give(slot[9], 512);  // joins slot 8: a 1024-byte run at 4096
  EXPECT_EQ(a.free_bytes(), 3072u);
  EXPECT_EQ(a.free_runs(), 5u);
  EXPECT_EQ(a.LargestFreeRun(), 1024u);

  std::vector<Arena::Run> runs;
  EXPECT_FALSE(a.Gather(3328, 256, &runs));  // 256 more than free
  EXPECT_TRUE(runs.empty());
  EXPECT_EQ(a.free_bytes(), 3072u);
  EXPECT_EQ(a.free_runs(), 5u);

  // 1792 bytes: all of the largest run, then the rest (768) in no run, so
  // the largest again (512 at 0), then 256 first fit (at 1024).
  ASSERT_TRUE(a.Gather(1792, 256, &runs));
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].offset, 4096u);
  EXPECT_EQ(runs[0].bytes, 1024u);
  EXPECT_EQ(runs[1].offset, 0u);
  EXPECT_EQ(runs[1].bytes, 512u);
  EXPECT_EQ(runs[2].offset, 1024u);
  EXPECT_EQ(runs[2].bytes, 256u);
  EXPECT_EQ(a.free_bytes(), 3072u - 1792);
  // Exactly the rest: every free byte, scattered.
  ASSERT_TRUE(a.Gather(1280, 256, &runs));
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_EQ(a.free_runs(), 0u);
  size_t total = 0;
  for (const Arena::Run& r : runs) {
    EXPECT_EQ(r.offset % 256, 0u);
    EXPECT_EQ(r.bytes % 256, 0u);
    total += r.bytes;
  }
  EXPECT_EQ(total, 3072u);
  for (const Arena::Run& r : runs) a.Give(r.offset, r.bytes);
  for (int i = 1; i < 9; i += 2) a.Give(slot[i], 512);
  EXPECT_EQ(a.free_bytes(), 5120u);
  EXPECT_EQ(a.free_runs(), 1u);
  EXPECT_EQ(a.LargestFreeRun(), 5120u);
}

// Random takes, gathers and gives in 256-byte units: a gather succeeds
// exactly when the free bytes cover it, no two live runs overlap, and
// giving everything back leaves one run.
TEST(ArenaTest, GatherSucceedsExactlyWhenFreeBytesCover) {
  constexpr size_t kUnit = 256, kUnits = 256;
  for (uint32_t seed : {1u, 2u, 3u, 17u}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937 rng(seed);
    Arena a(kUnits * kUnit);
    std::vector<bool> owned(kUnits, false);
    std::vector<std::vector<Arena::Run>> live;
    int scattered = 0;
    for (int step = 0; step < 3000; ++step) {
      if (!live.empty() && rng() % 3 == 0) {
        const size_t i = rng() % live.size();
        for (const Arena::Run& r : live[i]) {
          for (size_t u = r.offset / kUnit; u < (r.offset + r.bytes) / kUnit;
               ++u) {
            owned[u] = false;
          }
          a.Give(r.offset, r.bytes);
        }
        live.erase(live.begin() + i);
        continue;
      }
      const size_t bytes = (1 + rng() % 24) * kUnit;
      const size_t free_before = a.free_bytes();
      std::vector<Arena::Run> runs;
      const bool ok = a.Gather(bytes, kUnit, &runs);
      ASSERT_EQ(ok, bytes <= free_before) << "step " << step;
      if (!ok) {
        EXPECT_TRUE(runs.empty());
        EXPECT_EQ(a.free_bytes(), free_before);
        continue;
      }
      size_t sum = 0;
      for (const Arena::Run& r : runs) {
        ASSERT_EQ(r.offset % kUnit, 0u);
        ASSERT_GT(r.bytes, 0u);
        ASSERT_EQ(r.bytes % kUnit, 0u);
        for (size_t u = r.offset / kUnit; u < (r.offset + r.bytes) / kUnit;
             ++u) {
          ASSERT_FALSE(owned[u]) << "unit " << u << " handed out twice";
          owned[u] = true;
        }
        sum += r.bytes;
      }
      ASSERT_EQ(sum, bytes);
      if (runs.size() > 1) ++scattered;
      live.push_back(std::move(runs));
    }
    EXPECT_GT(scattered, 0);  // the mix did fragment the arena
    for (const auto& runs : live) {
      for (const Arena::Run& r : runs) a.Give(r.offset, r.bytes);
    }
    EXPECT_EQ(a.free_bytes(), kUnits * kUnit);
    EXPECT_EQ(a.free_runs(), 1u);
  }
}

class PageAllocatorTest : public ::testing::Test {
 protected:
  void Make(size_t capacity, size_t frame_bytes = 16 << 10) {
    auto a = PageAllocator::Create(&device_, capacity, frame_bytes);
    ASSERT_THAT(a.status(), IsOk());
    alloc_ = *std::move(a);
  }
  // Fills a page with a pattern derived from `seed`.
  static void Fill(Page* p, uint32_t seed) {
    for (size_t i = 0; i < p->bytes; ++i) {
      p->data[i] =
          static_cast<uint8_t>((size_t{seed} * 131 + i * 7 + (i >> 8)) & 0xFF);
    }
  }
  static bool Holds(const Page* p, uint32_t seed) {
    for (size_t i = 0; i < p->bytes; ++i) {
      if (p->data[i] != static_cast<uint8_t>(
                            (size_t{seed} * 131 + i * 7 + (i >> 8)) & 0xFF)) {
        return false;
      }
    }
    return true;
  }
  CpuDevice device_;
  std::unique_ptr<PageAllocator> alloc_;
};

TEST_F(PageAllocatorTest, CarvesDistinctAlignedPagesFromOneFrame) {
  Make(1 << 20);  // 64 frames of 16 KiB
  std::set<uint8_t*> seen;
  std::vector<Page*> pages;
  for (int i = 0; i < 10; ++i) {
    auto p = alloc_->Allocate(Format::kINT4, 4096, PageUse::kTarget);
    ASSERT_THAT(p.status(), IsOk());
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*p)->data) % 16, 0u);
    EXPECT_TRUE(seen.insert((*p)->data).second);
    pages.push_back(*p);
  }
  // Consecutive pages of one frame: addresses step by the page size.
  for (size_t i = 1; i < pages.size(); ++i) {
    EXPECT_EQ(pages[i]->data - pages[i - 1]->data, 4096);
  }
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.used_bytes, 10u * 4096);
  EXPECT_EQ(s.target[Format::kINT4].pages, 10u);
  // 4 pages a frame: 3 frames, 2 free slots.
  EXPECT_EQ(s.frames, 64u);
  EXPECT_EQ(s.free_frames, 61u);
  EXPECT_EQ(s.held_bytes, 3u * (16u << 10));
  EXPECT_EQ(s.free_slots, 2u);
  ASSERT_EQ(s.pools.size(), 1u);
  EXPECT_EQ(s.pools[0].pages_per_frame, 4u);
  EXPECT_EQ(s.pools[0].allocatable_pages, 2u + 61u * 4u);
  for (Page* p : pages) EXPECT_TRUE(alloc_->Unref(p));
  s = alloc_->Stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.held_bytes, 0u);  // the empty frames went back
  EXPECT_EQ(s.free_frames, 64u);
  EXPECT_TRUE(s.target.empty());
  EXPECT_TRUE(s.pools.empty());
}

TEST_F(PageAllocatorTest, FreeSlotsAreReused) {
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
  // Both come from one frame of the BF16/2048 pool.
  EXPECT_EQ(s.free_frames, s.frames - 1);
  alloc_->Unref(*t);
  alloc_->Unref(*w);
}

TEST_F(PageAllocatorTest, ExhaustionNamesPoolBytesAndFrames) {
  // Two 8 KiB frames (and a 2 KiB arena tail): two 8 KiB pages fit.
  Make(size_t{18} * 1024, 8 << 10);
  auto a = alloc_->Allocate(Format::kINT4, 8192, PageUse::kTarget);
  auto b = alloc_->Allocate(Format::kINT4, 8192, PageUse::kTarget);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  auto c = alloc_->Allocate(Format::kINT4, 8192, PageUse::kTarget);
  EXPECT_THAT(c.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                   AllOf(HasSubstr("int4/8192B"),
                                         HasSubstr("needs 8192 bytes"),
                                         HasSubstr("2048 bytes free"),
                                         HasSubstr("0 free frames of 2"))));
  EXPECT_TRUE(c.status().GetPayload(kShortfallPayload).has_value());
  // Freeing one page returns its frame, which another encoding takes.
  alloc_->Unref(*a);
  auto d = alloc_->Allocate(Format::kINT2, 2048, PageUse::kTarget);
  EXPECT_THAT(d.status(), IsOk());
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.free_frames, 0u);
  EXPECT_EQ(s.tail_bytes, 2048u);
  alloc_->Unref(*b);
  alloc_->Unref(*d);
  EXPECT_EQ(alloc_->Stats().held_bytes, 0u);
}

// AllocateMany: n pages under one lock, across frames; all or nothing.
TEST_F(PageAllocatorTest, AllocateManyIsAllOrNothing) {
  Make(size_t{4} * (16 << 10));       // 4 frames of 16 KiB: 16 pages of 4 KiB
  std::vector<Page*> pages{nullptr};  // appended after what is there
  ASSERT_THAT(
      alloc_->AllocateMany(Format::kINT4, 4096, PageUse::kTarget, 6, &pages),
      IsOk());
  ASSERT_EQ(pages.size(), 7u);
  EXPECT_EQ(pages[0], nullptr);
  std::set<uint8_t*> seen;
  for (size_t i = 1; i < pages.size(); ++i) {
    EXPECT_TRUE(seen.insert(pages[i]->data).second);
    EXPECT_EQ(alloc_->RefCount(pages[i]), 1);
  }
  EXPECT_EQ(alloc_->Stats().used_bytes, 6u * 4096);
  // 11 more do not fit (10 slots left): nothing is taken, *out unchanged.
  std::vector<Page*> more;
  EXPECT_THAT(
      alloc_->AllocateMany(Format::kINT4, 4096, PageUse::kTarget, 11, &more),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("int4/4096B")));
  EXPECT_TRUE(more.empty());
  EXPECT_EQ(alloc_->Stats().used_bytes, 6u * 4096);
  EXPECT_THAT(
      alloc_->AllocateMany(Format::kINT4, 4096, PageUse::kTarget, 10, &more),
      IsOk());
  EXPECT_EQ(more.size(), 10u);
  EXPECT_THAT(
      alloc_->AllocateMany(Format::kINT4, 100, PageUse::kTarget, 1, &more),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("page_bytes 100")));
  EXPECT_EQ(more.size(), 10u);
  for (size_t i = 1; i < pages.size(); ++i) alloc_->Unref(pages[i]);
  for (Page* p : more) alloc_->Unref(p);
  EXPECT_EQ(alloc_->Stats().held_bytes, 0u);
}

// AllocateMany takes slots run by run (the free slots of a frame with some,
// then whole fresh frames), yet hands out the very slots, in the same
// order, that as many Allocate calls would, over a history of frees that
// leaves partly used frames; freed Page objects are reused.
TEST_F(PageAllocatorTest, AllocateManyTakesTheSlotsAllocateWould) {
  CpuDevice other_device;
  auto other =
      PageAllocator::Create(&other_device, size_t{64} * (16 << 10), 16 << 10);
  ASSERT_THAT(other.status(), IsOk());
  Make(size_t{64} * (16 << 10));  // 64 frames of 16 KiB: 4 pages of 4 KiB
  PageAllocator* both[] = {alloc_.get(), other->get()};
  std::vector<Page*> held[2];
  std::mt19937 rng(7);
  for (int round = 0; round < 40; ++round) {
    const size_t n = 1 + rng() % 23;
    const bool window = rng() % 3 == 0;
    const PageUse use = window ? PageUse::kWindow : PageUse::kTarget;
    const Format f = window ? Format::kBF16 : Format::kINT4;
    // One AllocateMany here, n Allocate calls there.
    const size_t before = held[0].size();
    ASSERT_THAT(alloc_->AllocateMany(f, 4096, use, n, &held[0]), IsOk());
    for (size_t i = 0; i < n; ++i) {
      auto p = both[1]->Allocate(f, 4096, use);
      ASSERT_THAT(p.status(), IsOk());
      held[1].push_back(*p);
    }
    ASSERT_EQ(held[0].size(), held[1].size());
    for (size_t i = before; i < held[0].size(); ++i) {
      ASSERT_EQ(held[0][i]->data - alloc_->arena_base(),
                held[1][i]->data - both[1]->arena_base())
          << "round " << round << " page " << i;
      EXPECT_EQ(held[0][i]->use, use);
      EXPECT_EQ(alloc_->RefCount(held[0][i]), 1);
    }
    // Free a random third of what is held, the same pages on both.
    for (size_t i = 0; i < held[0].size();) {
      if (rng() % 3 == 0) {
        for (int a = 0; a < 2; ++a) {
          EXPECT_TRUE(both[a]->Unref(held[a][i]));
          held[a].erase(held[a].begin() + static_cast<std::ptrdiff_t>(i));
        }
      } else {
        ++i;
      }
    }
    const AllocatorStats s0 = alloc_->Stats(), s1 = both[1]->Stats();
    EXPECT_EQ(s0.used_bytes, s1.used_bytes);
    EXPECT_EQ(s0.free_frames, s1.free_frames);
    EXPECT_EQ(s0.free_slots, s1.free_slots);
    EXPECT_EQ(s0.window.pages, s1.window.pages);
  }
  // A reused Page object starts as a fresh one.
  for (int a = 0; a < 2; ++a) {
    for (Page* p : held[a]) both[a]->Unref(p);
  }
  EXPECT_EQ(alloc_->Stats().used_bytes, 0u);
  EXPECT_EQ(alloc_->Stats().free_frames, 64u);
  auto p = alloc_->Allocate(Format::kINT4, 4096, PageUse::kTarget);
  ASSERT_THAT(p.status(), IsOk());
  EXPECT_EQ((*p)->data, alloc_->arena_base());  // the lowest frame, slot 0
  EXPECT_EQ(alloc_->PinCount(*p), 0);
  {
    absl::MutexLock lock(&(*p)->seal_mu);
    EXPECT_FALSE((*p)->encoded);
    EXPECT_FALSE((*p)->crc_known);
  }
  alloc_->Unref(*p);
}

// UnrefAll drops one reference per entry under one lock: a page named
// twice loses two, shared pages survive, and the freed ones are counted.
TEST_F(PageAllocatorTest, UnrefAllCountsWhatItFrees) {
  Make(size_t{4} * (16 << 10));
  std::vector<Page*> pages;
  ASSERT_THAT(
      alloc_->AllocateMany(Format::kINT4, 4096, PageUse::kTarget, 5, &pages),
      IsOk());
  alloc_->Ref(pages[0]);
  alloc_->Ref(pages[1]);
  alloc_->Ref(pages[1]);
  uint64_t bytes = 7;
  // pages[1] named twice: 3 references less 2; pages[0]: 2 less 1.
  const std::vector<Page*> drop = {pages[0], pages[1], pages[1],
                                   pages[2], pages[3], pages[4]};
  EXPECT_EQ(alloc_->UnrefAll(drop, &bytes), 3u);
  EXPECT_EQ(bytes, 7u + 3 * 4096);
  EXPECT_EQ(alloc_->RefCount(pages[0]), 1);
  EXPECT_EQ(alloc_->RefCount(pages[1]), 1);
  EXPECT_EQ(alloc_->Stats().used_bytes, 2u * 4096);
  EXPECT_EQ(alloc_->UnrefAll({pages[0], pages[1]}, &bytes), 2u);
  EXPECT_EQ(alloc_->Stats().used_bytes, 0u);
  EXPECT_EQ(alloc_->Stats().free_frames, 4u);
}

TEST_F(PageAllocatorTest, RejectsBadPageAndFrameSizes) {
  Make(1 << 16);
  EXPECT_THAT(
      alloc_->Allocate(Format::kBF16, 0, PageUse::kTarget).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_bytes 0")));
  EXPECT_THAT(alloc_->Allocate(Format::kBF16, 100, PageUse::kTarget).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("page_bytes 100")));
  // A page larger than a frame never spans frames.
  EXPECT_THAT(
      alloc_->Allocate(Format::kBF16, 32 << 10, PageUse::kTarget).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("page_bytes 32768"),
                     HasSubstr("frame_bytes 16384"))));
  for (size_t frame : {size_t{0}, size_t{1000}, size_t{1} << 17}) {
    EXPECT_THAT(PageAllocator::Create(&device_, 1 << 16, frame).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("frame_bytes ", frame))))
        << frame;
  }
}

// Interleaved encodings leave sparse frames; a different encoding then needs
// whole frames, which only compaction can free.
TEST_F(PageAllocatorTest, CompactionFreesFramesForAnotherEncoding) {
  Make(size_t{8} * 4096, 4096);  // 8 frames of 4 KiB
  const kernels::Encoding a = Format::kINT4, b = Format::kINT2;
  // A: 1 KiB pages (4 a frame), B: 512 B pages (8 a frame). Allocate in turns
  // so each pool spreads over several frames.
  std::vector<Page*> as, bs;
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 4; ++i) {
      auto p = alloc_->Allocate(a, 1024, PageUse::kTarget);
      ASSERT_THAT(p.status(), IsOk());
      Fill(*p, static_cast<uint32_t>(as.size()));
      as.push_back(*p);
    }
    for (int i = 0; i < 8; ++i) {
      auto p = alloc_->Allocate(b, 512, PageUse::kTarget);
      ASSERT_THAT(p.status(), IsOk());
      Fill(*p, 1000 + static_cast<uint32_t>(bs.size()));
      bs.push_back(*p);
    }
  }
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.free_frames, 0u);
  // Free 3 of every 4 A pages and 7 of every 8 B pages: every frame stays
  // held by one page.
  std::vector<Page*> keep_a, keep_b;
  std::vector<uint32_t> seed_a, seed_b;
  for (size_t i = 0; i < as.size(); ++i) {
    if (i % 4 == 3) {
      keep_a.push_back(as[i]);
      seed_a.push_back(static_cast<uint32_t>(i));
    } else {
      EXPECT_TRUE(alloc_->Unref(as[i]));
    }
  }
  for (size_t i = 0; i < bs.size(); ++i) {
    if (i % 8 == 0) {
      keep_b.push_back(bs[i]);
      seed_b.push_back(1000 + static_cast<uint32_t>(i));
    } else {
      EXPECT_TRUE(alloc_->Unref(bs[i]));
    }
  }
  s = alloc_->Stats();
  EXPECT_EQ(s.free_frames, 0u);
  EXPECT_EQ(s.used_bytes, 4u * 1024 + 4u * 512);
  EXPECT_EQ(s.free_bytes, 8u * 4096 - 6144);
  EXPECT_EQ(s.free_slots, 4u * 3 + 4u * 7);
  // Nothing is in free frames: every free byte is stranded.
  EXPECT_DOUBLE_EQ(s.fragmentation, 1.0);
  // Packed, A fits one frame and B one: 6 frames would be free.
  EXPECT_EQ(s.free_frames_compacted, 6u);
  for (const PoolStats& p : s.pools) {
    EXPECT_EQ(p.free_slots_compacted, p.page_bytes == 1024 ? 0u : 4u);
  }
  // A third encoding finds no frame...
  auto c = alloc_->Allocate(Format::kFP8, 2048, PageUse::kTarget);
  EXPECT_THAT(c.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                   HasSubstr("0 free frames")));
  // ...until compaction packs A into one frame and B into one frame.
  auto r = alloc_->Compact();
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_moved, 3u + 3u);
  EXPECT_EQ(r->bytes_moved, 3u * 1024 + 3u * 512);
  EXPECT_EQ(r->frames_freed, 6u);
  s = alloc_->Stats();
  EXPECT_EQ(s.free_frames, 6u);
  EXPECT_EQ(s.free_slots, 0u + 4u);  // A's frame full, B's has 4 free
  // 26624 bytes free, 24576 of them in free frames: B's 4 free slots are
  // the stranded 2048.
  EXPECT_EQ(s.free_bytes, 26624u);
  EXPECT_DOUBLE_EQ(s.fragmentation, 2048.0 / 26624.0);
  EXPECT_EQ(s.compactions, 1u);
  EXPECT_EQ(s.pages_moved, 6u);
  EXPECT_EQ(s.frames_freed_by_compaction, 6u);
  // Page objects stayed put; their bytes moved with them.
  for (size_t i = 0; i < keep_a.size(); ++i) {
    EXPECT_TRUE(Holds(keep_a[i], seed_a[i])) << "A page " << i;
  }
  for (size_t i = 0; i < keep_b.size(); ++i) {
    EXPECT_TRUE(Holds(keep_b[i], seed_b[i])) << "B page " << i;
  }
  std::vector<Page*> cs;
  for (int i = 0; i < 12; ++i) {  // 2 a frame x 6 frames
    auto p = alloc_->Allocate(Format::kFP8, 2048, PageUse::kTarget);
    ASSERT_THAT(p.status(), IsOk()) << i;
    cs.push_back(*p);
  }
  // A second compaction has nothing to move.
  r = alloc_->Compact();
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_moved, 0u);
  EXPECT_EQ(alloc_->Stats().compactions, 1u);
  for (Page* p : keep_a) EXPECT_TRUE(alloc_->Unref(p));
  for (Page* p : keep_b) EXPECT_TRUE(alloc_->Unref(p));
  for (Page* p : cs) EXPECT_TRUE(alloc_->Unref(p));
  EXPECT_EQ(alloc_->Stats().free_frames, 8u);
}

// Compaction leaves pinned pages where they are (a peer process may be
// copying them by their arena offset); unpinned ones still move, and an
// Unpin of a page the store has freed meanwhile frees it.
TEST_F(PageAllocatorTest, CompactionDoesNotMovePinnedPages) {
  Make(size_t{4} * 4096, 4096);  // 4 frames of 4 KiB, 4 pages a frame
  const kernels::Encoding a = Format::kINT4;
  std::vector<Page*> pages;
  for (int i = 0; i < 16; ++i) {
    auto p = alloc_->Allocate(a, 1024, PageUse::kTarget);
    ASSERT_THAT(p.status(), IsOk());
    Fill(*p, static_cast<uint32_t>(i));
    pages.push_back(*p);
  }
  // Keep slot 0 of every frame; pin the kept pages of frames 2 and 3.
  for (int i = 0; i < 16; ++i) {
    if (i % 4 != 0) EXPECT_TRUE(alloc_->Unref(pages[i]));
  }
  alloc_->Pin(pages[8]);
  alloc_->Pin(pages[12]);
  EXPECT_EQ(alloc_->PinCount(pages[8]), 1);
  EXPECT_EQ(alloc_->RefCount(pages[8]), 2);
  uint8_t* const pinned8 = pages[8]->data;
  uint8_t* const pinned12 = pages[12]->data;
  auto r = alloc_->Compact();
  ASSERT_THAT(r.status(), IsOk());
  // Frame 1's page moves into frame 0; frames 2 and 3 keep their pinned
  // pages, so only frame 1 is freed.
  EXPECT_EQ(r->pages_moved, 1u);
  EXPECT_EQ(r->frames_freed, 1u);
  EXPECT_EQ(pages[8]->data, pinned8);
  EXPECT_EQ(pages[12]->data, pinned12);
  for (int i : {0, 4, 8, 12}) EXPECT_TRUE(Holds(pages[i], i)) << i;
  // The store lets go of page 8 while it is pinned: it stays until Unpin.
  EXPECT_FALSE(alloc_->Unref(pages[8]));
  EXPECT_TRUE(Holds(pages[8], 8));
  EXPECT_TRUE(alloc_->Unpin(pages[8]));
  // Unpinned, page 12 moves at the next compaction.
  EXPECT_FALSE(alloc_->Unpin(pages[12]));
  r = alloc_->Compact();
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_moved, 1u);
  EXPECT_TRUE(Holds(pages[12], 12));
  for (int i : {0, 4, 12}) EXPECT_TRUE(alloc_->Unref(pages[i]));
  EXPECT_EQ(alloc_->Stats().free_frames, 4u);
}

// A page shared three ways is one Page object: it moves once and every
// holder sees the new address.
TEST_F(PageAllocatorTest, SharedPageMovesOnce) {
  Make(size_t{4} * 4096, 4096);
  std::vector<Page*> first, second;
  for (int i = 0; i < 4; ++i) {
    auto p = alloc_->Allocate(Format::kINT4, 1024, PageUse::kTarget);
    ASSERT_THAT(p.status(), IsOk());
    first.push_back(*p);
  }
  for (int i = 0; i < 4; ++i) {
    auto p = alloc_->Allocate(Format::kINT4, 1024, PageUse::kTarget);
    ASSERT_THAT(p.status(), IsOk());
    second.push_back(*p);
  }
  Page* shared = second[3];
  Fill(shared, 77);
  alloc_->Ref(shared);
  alloc_->Ref(shared);
  uint8_t* before = shared->data;
  // Leave the first frame with one page, the second with only `shared`.
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(alloc_->Unref(first[i]));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(alloc_->Unref(second[i]));
  auto r = alloc_->Compact();
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_moved, 1u);
  EXPECT_EQ(r->frames_freed, 1u);
  EXPECT_NE(shared->data, before);
  EXPECT_TRUE(Holds(shared, 77));
  EXPECT_EQ(alloc_->RefCount(shared), 3);
  // Packed into first[0]'s frame (slot 0 of the first frame).
  EXPECT_GT(shared->data - first[0]->data, 0);
  EXPECT_LT(shared->data - first[0]->data, 4096);
  EXPECT_FALSE(alloc_->Unref(shared));
  EXPECT_FALSE(alloc_->Unref(shared));
  EXPECT_TRUE(alloc_->Unref(shared));
  EXPECT_TRUE(alloc_->Unref(first[0]));
  EXPECT_EQ(alloc_->Stats().free_frames, 4u);
}

}  // namespace
}  // namespace triax::worker
