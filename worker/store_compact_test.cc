// Frames and compaction through the store: mixed-encoding sequences leave
// sparse frames when some close; an Open that needs all the free space
// succeeds through compaction, and the survivors' Attend and Read answers
// are bit-identical before and after their pages moved.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/sequence_store.h"
#include "worker/store_test_util.h"

namespace triax::worker {
namespace {

using namespace store_testing;  // NOLINT(google-build-using-namespace)
using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::StatusIs;

constexpr uint32_t kT = 16;

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CompactStoreTest : public StoreTest {
 protected:
  const ModelShape m_ = Shape(2, 2, 4, 64);

  void Open(const std::string& id, Format f, uint32_t tokens, uint32_t seed) {
    ASSERT_THAT(store_
                    ->AllocatePages(kTenant, id, m_, kT,
                                    UniformPlan(tokens, kT, f), uint32_t{0})
                    .status(),
                IsOk())
        << id;
    kv_[id] = RandomLayers(m_, tokens, seed);
    WriteAll(id, m_, kv_[id], tokens, 7);
  }

  // Attend outputs of every layer at the last position, and Read of layer 1.
  struct Answers {
    std::vector<std::vector<float>> attend;
    std::vector<float> read_k, read_v;
  };
  Answers Ask(const std::string& id) {
    Answers a;
    const std::vector<float> q = RandomQueries(m_, 1, 99);
    for (uint32_t l = 0; l < m_.n_layers; ++l) {
      auto out = Attend(id, l, q, 1, {});
      EXPECT_THAT(out.status(), IsOk()) << id;
      a.attend.push_back(out.ok() ? *out : std::vector<float>{});
      ExpectFiniteNonZero(a.attend.back());
    }
    auto r = store_->Read(kTenant, id, 1, 0, 0);
    EXPECT_THAT(r.status(), IsOk()) << id;
    if (r.ok()) {
      a.read_k = r->k;
      a.read_v = r->v;
    }
    return a;
  }

  std::map<std::string, std::vector<LayerKv>> kv_;
};

TEST_F(CompactStoreTest, OpenNeedingAllFreeSpaceSucceedsAndSurvivorsAreExact) {
  // Frames of two BF16 pages of this shape.
  const size_t bf16_page = kernels::PageBytes(kBf16, {kT, 2, 64});
  Make(0, size_t{24} * 2 * bf16_page, 2 * bf16_page);
  const Format formats[] = {kInt4, kInt2, kBf16};
  std::vector<std::string> ids;
  for (int i = 0; i < 12; ++i) {
    ids.push_back(absl::StrCat("s", i));
    Open(ids.back(), formats[i % 3], 3 * kT, 10 + i);
  }
  // Close the first and third of every four-sequence group per encoding,
  // leaving holes in every pool's frames.
  std::vector<std::string> survivors;
  for (int i = 0; i < 12; ++i) {
    if ((i / 3) % 2 == 0) {
      ASSERT_THAT(store_->Free(kTenant, ids[i]).status(), IsOk());
    } else {
      survivors.push_back(ids[i]);
    }
  }
  std::map<std::string, Answers> before;
  for (const std::string& id : survivors) before[id] = Ask(id);

  const AllocatorStats s = alloc_->Stats();
  // Frames a full compaction leaves free: every pool packed into
  // ceil(pages / pages_per_frame) frames.
  uint64_t packed = 0, bf16_slots_after = 0, bf16_slots_now = 0;
  for (const PoolStats& p : s.pools) {
    const uint64_t frames =
        (p.pages_used + p.pages_per_frame - 1) / p.pages_per_frame;
    packed += frames;
    if (p.page_bytes == bf16_page) {
      bf16_slots_after = frames * p.pages_per_frame - p.pages_used;
      bf16_slots_now = p.free_slots;
    }
  }
  const uint64_t free_after = s.frames - packed;
  const uint64_t can_now = s.free_frames * 2 + bf16_slots_now;
  const uint64_t can_after = free_after * 2 + bf16_slots_after;
  ASSERT_GT(s.fragmentation, 0.0);
  // One BF16 block per 2 pages (2 layers); the Open needs more than the
  // frames hold now, and no more than compaction can give.
  const uint32_t blocks = static_cast<uint32_t>(can_after / 2);
  ASSERT_GT(uint64_t{blocks} * 2, can_now)
      << "the closes left no fragmentation to compact";
  ASSERT_THAT(
      store_
          ->AllocatePages(kTenant, "big", m_, kT,
                          UniformPlan(blocks * kT, kT, kBf16), uint32_t{0})
          .status(),
      IsOk());
  const AllocatorStats after = alloc_->Stats();
  EXPECT_EQ(after.compactions, 1u);
  EXPECT_GT(after.pages_moved, 0u);
  EXPECT_EQ(after.free_frames, 0u);
  EXPECT_EQ(after.frames_freed_by_compaction, free_after - s.free_frames);

  for (const std::string& id : survivors) {
    const Answers now = Ask(id);
    for (uint32_t l = 0; l < m_.n_layers; ++l) {
      EXPECT_TRUE(SameFloats(now.attend[l], before[id].attend[l]))
          << id << " layer " << l;
    }
    EXPECT_TRUE(SameFloats(now.read_k, before[id].read_k)) << id;
    EXPECT_TRUE(SameFloats(now.read_v, before[id].read_v)) << id;
  }
  // One more block does not fit (at most one BF16 slot is left): the
  // refusal says what compaction did and what is free.
  EXPECT_LT(can_after - uint64_t{blocks} * 2, 2u);
  auto more = store_->AllocatePages(kTenant, "more", m_, kT,
                                    UniformPlan(kT, kT, kBf16), uint32_t{0});
  EXPECT_THAT(more.status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("bf16"), HasSubstr("needs"),
                             HasSubstr("bytes free"), HasSubstr("free frames"),
                             HasSubstr("compaction moved"))));
}

TEST_F(CompactStoreTest, ShapesWhosePagesExceedAFrameAreRefusedAtOpen) {
  Make(0, 1 << 20, 16 << 10);
  // BF16 pages of 64 tokens x 2 heads x 64 dims are 32 KiB.
  EXPECT_THAT(
      store_
          ->AllocatePages(kTenant, "s", m_, 64, UniformPlan(64, 64, kInt4),
                          uint32_t{0})
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("block_tokens=64"), HasSubstr("32768"),
                     HasSubstr("frame_bytes 16384"), HasSubstr("--frame_kb"))));
  EXPECT_TRUE(store_->Inventory().sequence_ids.empty());
}

// Readers attend while the main thread frees, allocates and compacts: every
// answer equals the one before any page moved.
TEST_F(CompactStoreTest, CompactionNeverRacesReaders) {
  const size_t bf16_page = kernels::PageBytes(kBf16, {kT, 2, 64});
  Make(0, size_t{64} * 2 * bf16_page, 2 * bf16_page);
  for (int i = 0; i < 6; ++i) {
    Open(absl::StrCat("r", i), i % 2 == 0 ? kInt4 : kBf16, 2 * kT, 40 + i);
  }
  const std::vector<float> q = RandomQueries(m_, 1, 5);
  std::vector<std::vector<float>> want;
  for (int i = 1; i < 6; i += 2) {
    auto out = Attend(absl::StrCat("r", i), 1, q, 1, {});
    ASSERT_THAT(out.status(), IsOk());
    want.push_back(*out);
  }
  std::atomic<bool> stop{false};
  std::atomic<int> mismatches{0}, answers{0};
  std::vector<std::thread> readers;
  readers.reserve(2);
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        for (int k = 0; k < 3; ++k) {
          auto out = Attend(absl::StrCat("r", 2 * k + 1), 1, q, 1, {});
          if (!out.ok() || !SameFloats(*out, want[k])) mismatches.fetch_add(1);
          answers.fetch_add(1);
        }
      }
    });
  }
  uint64_t moved = 0;
  for (int round = 0; round < 20; ++round) {
    const std::string id = absl::StrCat("churn", round);
    Open(id, round % 2 == 0 ? kInt2 : kInt4, 2 * kT, 100 + round);
    if (round % 2 == 1) {
      ASSERT_THAT(
          store_->Free(kTenant, absl::StrCat("churn", round - 1)).status(),
          IsOk());
    }
    if (round == 0) {
      ASSERT_THAT(store_->Free(kTenant, "r0").status(), IsOk());
      ASSERT_THAT(store_->Free(kTenant, "r4").status(), IsOk());
    }
    auto c = store_->Compact();
    ASSERT_THAT(c.status(), IsOk());
    moved += c->pages_moved;
  }
  while (answers.load() < 30) std::this_thread::yield();
  stop.store(true);
  for (auto& t : readers) t.join();
  EXPECT_GT(moved, 0u);
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace triax::worker
