// Compaction on the CUDA backend: PageAllocator::Compact moves pages with
// device-to-device copies (bytes preserved, read back through the host), and
// a SequenceStore over GPU pages answers Attend and Read bit-identically
// before and after its pages moved. Skips without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "worker/cuda_device.h"
#include "worker/device.h"
#include "worker/page_allocator.h"
#include "worker/sequence_store.h"

namespace triax::worker {
namespace {

using kernels::Format;
using triax::testing::IsOk;

class CudaCompactTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status s = CudaAvailable(); !s.ok()) GTEST_SKIP() << s.message();
    auto d = CudaDevice::Create(0);
    ASSERT_THAT(d.status(), IsOk());
    gpu_ = std::move(*d);
  }
  void TearDown() override {
    if (gpu_ != nullptr) EXPECT_THAT(gpu_->Health(), IsOk());
  }
  std::unique_ptr<CudaDevice> gpu_;
};

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  std::mt19937 rng(seed);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST_F(CudaCompactTest, MovedPagesKeepTheirBytes) {
  auto alloc = PageAllocator::Create(gpu_.get(), size_t{16} * 4096, 4096);
  ASSERT_THAT(alloc.status(), IsOk());
  PageAllocator& a = **alloc;
  // Two encodings in turns: INT4 pages of 1024 bytes, 4 to a frame (4
  // frames), INT2 pages of 512, 8 to a frame (2 frames); then 3 of every 4
  // pages freed, leaving one page in each INT4 frame and two in each INT2
  // frame.
  std::vector<Page*> pages;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) {
      auto p = a.Allocate(i % 2 == 0 ? Format::kINT4 : Format::kINT2,
                          i % 2 == 0 ? 1024 : 512, PageUse::kTarget);
      ASSERT_THAT(p.status(), IsOk());
      pages.push_back(*p);
    }
  }
  std::vector<Page*> kept;
  std::vector<std::vector<uint8_t>> bytes;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (i % 4 == 1) {
      bytes.push_back(Pattern(pages[i]->bytes, static_cast<uint32_t>(i)));
      ASSERT_THAT(gpu_->CopyFromHost(pages[i]->data, bytes.back().data(),
                                     pages[i]->bytes),
                  IsOk());
      kept.push_back(pages[i]);
    } else {
      a.Unref(pages[i]);
    }
  }
  auto r = a.Compact();
  ASSERT_THAT(r.status(), IsOk());
  // INT4: 3 pages move into the fourth's frame, 3 frames freed; INT2: 2
  // pages move, 1 frame freed.
  EXPECT_EQ(r->pages_moved, 5u);
  EXPECT_EQ(r->frames_freed, 4u);
  for (size_t i = 0; i < kept.size(); ++i) {
    std::vector<uint8_t> back(kept[i]->bytes);
    ASSERT_THAT(gpu_->CopyToHost(back.data(), kept[i]->data, back.size()),
                IsOk());
    EXPECT_EQ(back, bytes[i]) << "page " << i;
    a.Unref(kept[i]);
  }
}

TEST_F(CudaCompactTest, StoreAnswersAreBitIdenticalAcrossCompaction) {
  ModelShape m;
  m.name = "m";
  m.n_layers = 2;
  m.n_kv_heads = 2;
  m.n_q_heads = 4;
  m.head_dim = 64;
  const kernels::PageShape shape{16, 2, 64};
  const size_t frame = 2 * kernels::PageBytes(Format::kBF16, shape);
  auto alloc = PageAllocator::Create(gpu_.get(), 32 * frame, frame);
  ASSERT_THAT(alloc.status(), IsOk());
  StoreOptions opts;
  opts.window_tokens = 0;
  SequenceStore store(gpu_.get(), alloc->get(), opts);
  const Format formats[] = {Format::kINT4, Format::kFP8, Format::kBF16,
                            Format::kINT8};
  const uint32_t tokens = 48;
  const size_t per = size_t{m.n_kv_heads} * m.head_dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int i = 0; i < 8; ++i) {
    std::vector<BlockSpec> plan;
    for (uint32_t b = 0; b < tokens / 16; ++b) {
      BlockSpec s;
      s.index = b;
      s.lineage_id = 1000 * (i + 1) + b;
      s.first_token = uint64_t{16} * b;
      s.num_tokens = 16;
      s.encoding = formats[i % 4];
      plan.push_back(s);
    }
    const std::string id = absl::StrCat("s", i);
    ASSERT_THAT(store.AllocatePages("t", id, m, 16, plan).status(), IsOk());
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      std::vector<float> k(tokens * per), v(tokens * per);
      for (float& x : k) x = dist(rng);
      for (float& x : v) x = dist(rng);
      KvWrite w;
      w.layer = l;
      w.num_tokens = tokens;
      w.dtype = static_cast<int>(KvDtype::kF32);
      w.k = absl::string_view(reinterpret_cast<const char*>(k.data()),
                              k.size() * 4);
      w.v = absl::string_view(reinterpret_cast<const char*>(v.data()),
                              v.size() * 4);
      ASSERT_THAT(store.Write("t", id, w).status(), IsOk());
    }
  }
  for (int i : {0, 1, 2, 3}) {
    ASSERT_THAT(store.Free("t", absl::StrCat("s", i)).status(), IsOk());
  }
  std::vector<float> q(size_t{m.n_q_heads} * m.head_dim);
  for (float& x : q) x = dist(rng);
  const std::string qb(reinterpret_cast<const char*>(q.data()), q.size() * 4);
  auto answers = [&](const std::string& id) {
    std::vector<std::vector<float>> out;
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      AttendSpec spec;
      spec.layer = l;
      spec.num_queries = 1;
      spec.queries = qb;
      auto o = store.Attend("t", id, spec);
      EXPECT_THAT(o.status(), IsOk());
      out.push_back(o.ok() ? *o : std::vector<float>{});
      auto r = store.Read("t", id, l, 0, 0);
      EXPECT_THAT(r.status(), IsOk());
      if (r.ok()) {
        out.push_back(r->k);
        out.push_back(r->v);
      }
    }
    return out;
  };
  std::vector<std::vector<std::vector<float>>> before;
  for (int i = 4; i < 8; ++i) before.push_back(answers(absl::StrCat("s", i)));
  auto c = store.Compact();
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_GT(c->pages_moved, 0u);
  for (int i = 4; i < 8; ++i) {
    const auto now = answers(absl::StrCat("s", i));
    ASSERT_EQ(now.size(), before[i - 4].size());
    for (size_t k = 0; k < now.size(); ++k) {
      ASSERT_EQ(now[k].size(), before[i - 4][k].size());
      EXPECT_EQ(std::memcmp(now[k].data(), before[i - 4][k].data(),
                            now[k].size() * sizeof(float)),
                0)
          << "s" << i << " answer " << k;
    }
  }
}

}  // namespace
}  // namespace triax::worker
