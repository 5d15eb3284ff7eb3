// A prefix hit (ImportPlan::prefix_blocks): an import whose first K blocks
// share the pages of a sequence the destination holds, the rest pulled from
// the source. Pages are shared (no new pages for blocks < K), reads and
// attention equal the source's, the shared blocks take no writes, the
// prefix may be freed mid-import, an abort returns everything, and every
// refusal names its field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "worker/recording_device.h"
#include "worker/sequence_store.h"
#include "worker/store_transfer.h"

namespace triax::worker {
namespace {

using kernels::Encoding;
using kernels::Format;
using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr char kTenant[] = "tenant-a";
constexpr uint32_t kLayers = 2, kKv = 2, kQ = 4, kDim = 32, kBlock = 16;
constexpr size_t kPerToken = size_t{kKv} * kDim;
// The source sequence: 71 tokens, blocks 0..2 sealed, 3 and 4 in the
// window. The prefix on the destination: its first 48 tokens (blocks 0 and
// 1 sealed, 2 in the window), written with the same values.
constexpr uint32_t kTokens = 71, kPrefixTokens = 48, kShared = 2;

ModelShape Model() {
  ModelShape m;
  m.name = "test";
  m.n_layers = kLayers;
  m.n_kv_heads = kKv;
  m.n_q_heads = kQ;
  m.head_dim = kDim;
  return m;
}

std::vector<BlockSpec> Plan(uint32_t tokens, const Encoding& e) {
  std::vector<BlockSpec> plan;
  for (uint32_t first = 0, i = 0; first < tokens; first += kBlock, ++i) {
    BlockSpec b;
    b.index = i;
    b.lineage_id = 100 + i;
    b.first_token = first;
    b.num_tokens = std::min(kBlock, tokens - first);
    b.encoding = e;
    plan.push_back(b);
  }
  return plan;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (float& f : x) f = dist(rng);
  return x;
}

class PrefixImportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    src_alloc_ = *std::move(a);
    a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    dst_alloc_ = *std::move(a);
    StoreOptions so;
    so.window_tokens = 16;
    so.prefetch_thread = false;
    src_ = std::make_unique<SequenceStore>(&device_, src_alloc_.get(), so);
    dst_ = std::make_unique<SequenceStore>(&device_, dst_alloc_.get(), so);
    plan_ = Plan(kTokens, Encoding(Format::kINT8));
    Install(src_.get(), "s", plan_, kTokens);
    Install(dst_.get(), "p", Plan(kPrefixTokens, Encoding(Format::kINT8)),
            kPrefixTokens);
  }

  void Install(SequenceStore* store, const std::string& seq,
               const std::vector<BlockSpec>& plan, uint32_t written,
               const std::string& tenant = kTenant, uint32_t seed = 1) {
    ASSERT_THAT(
        store->AllocatePages(tenant, seq, Model(), kBlock, plan).status(),
        IsOk());
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_THAT(Write(store, seq, l, 0, written, tenant, seed), IsOk());
    }
  }
  absl::Status Write(SequenceStore* store, const std::string& seq,
                     uint32_t layer, uint32_t first, uint32_t n,
                     const std::string& tenant = kTenant, uint32_t seed = 1) {
    const std::vector<float> k =
        Random((first + n) * kPerToken, seed + 2 * layer);
    const std::vector<float> v =
        Random((first + n) * kPerToken, seed + 2 * layer + 1);
    KvWrite w;
    w.layer = layer;
    w.first_token = first;
    w.num_tokens = n;
    w.dtype = static_cast<int>(KvDtype::kF32);
    const std::string kb(
        reinterpret_cast<const char*>(k.data() + first * kPerToken),
        n * kPerToken * 4);
    const std::string vb(
        reinterpret_cast<const char*>(v.data() + first * kPerToken),
        n * kPerToken * 4);
    w.k = kb;
    w.v = vb;
    return store->Write(tenant, seq, w).status();
  }

  // The source's pages of blocks [from, n): what a prefix hit pulls.
  std::vector<TransferPage> Suffix(uint32_t from) {
    std::vector<ExportBlock> blocks;
    for (const BlockSpec& b : plan_) {
      if (b.index >= from)
        blocks.push_back({b.index, b.lineage_id, b.encoding});
    }
    std::vector<TransferPage> all;
    EXPECT_THAT(src_->Export(kTenant, "s", blocks, ExportOptions{},
                             [&](uint32_t, std::vector<TransferPage>* pages) {
                               for (TransferPage& p : *pages) {
                                 all.push_back(std::move(p));
                               }
                               return absl::OkStatus();
                             }),
                IsOk());
    return all;
  }

  ImportPlan DstPlan(const std::string& seq, uint32_t prefix_blocks,
                     const std::string& prefix = "p") {
    ImportPlan p;
    p.tenant_id = kTenant;
    p.sequence_id = seq;
    p.model = Model();
    p.block_tokens = kBlock;
    p.window_tokens = 16;
    p.blocks = plan_;
    p.source = "source worker-a at 127.0.0.1:1";
    p.prefix_sequence_id = prefix;
    p.prefix_blocks = prefix_blocks;
    return p;
  }

  void ExpectSameReads(const std::string& a, const std::string& b) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto ra = src_->Read(kTenant, a, l, 0, 0);
      auto rb = dst_->Read(kTenant, b, l, 0, 0);
      ASSERT_THAT(ra.status(), IsOk());
      ASSERT_THAT(rb.status(), IsOk());
      ASSERT_EQ(ra->num_tokens, rb->num_tokens);
      ASSERT_EQ(ra->num_tokens, kTokens);
      EXPECT_EQ(0, std::memcmp(ra->k.data(), rb->k.data(), ra->k.size() * 4));
      EXPECT_EQ(0, std::memcmp(ra->v.data(), rb->v.data(), ra->v.size() * 4));
    }
  }
  void ExpectSameAttention(const std::string& a, const std::string& b) {
    const std::vector<float> q = Random(size_t{2} * kQ * kDim, 77);
    AttendSpec spec;
    spec.num_queries = 2;
    const std::vector<uint64_t> pos = {20, kTokens - 1};
    spec.positions = pos;
    const std::string qb(reinterpret_cast<const char*>(q.data()), q.size() * 4);
    spec.queries = qb;
    for (uint32_t l = 0; l < kLayers; ++l) {
      spec.layer = l;
      auto oa = src_->Attend(kTenant, a, spec);
      auto ob = dst_->Attend(kTenant, b, spec);
      ASSERT_THAT(oa.status(), IsOk());
      ASSERT_THAT(ob.status(), IsOk());
      ASSERT_EQ(oa->size(), ob->size());
      float norm = 0;
      for (float x : *oa) norm += x * x;
      EXPECT_GT(norm, 0.f);
      EXPECT_EQ(0, std::memcmp(oa->data(), ob->data(), oa->size() * 4));
    }
  }
  // The prefix's data as read now (layer 0 and the last layer).
  std::vector<std::vector<float>> ReadPrefix() {
    std::vector<std::vector<float>> out;
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto r = dst_->Read(kTenant, "p", l, 0, 0);
      EXPECT_THAT(r.status(), IsOk());
      if (!r.ok()) return out;
      out.push_back(r->k);
      out.push_back(r->v);
    }
    return out;
  }

  RecordingDevice device_;
  std::unique_ptr<PageAllocator> src_alloc_, dst_alloc_;
  std::unique_ptr<SequenceStore> src_, dst_;
  std::vector<BlockSpec> plan_;
};

TEST_F(PrefixImportTest, SharesThePrefixPagesAndPullsTheRest) {
  // A full import of the same plan, for the pool bytes it takes.
  uint64_t full_bytes = 0;
  {
    auto session = dst_->BeginImport(DstPlan("full", 0, ""));
    ASSERT_THAT(session.status(), IsOk());
    for (const TransferPage& p : Suffix(0)) {
      ASSERT_THAT((*session)->Install(p), IsOk());
    }
    auto r = (*session)->Commit();
    ASSERT_THAT(r.status(), IsOk());
    full_bytes = r->page_bytes;
    ASSERT_THAT(dst_->Free(kTenant, "full").status(), IsOk());
  }
  const std::vector<std::vector<float>> prefix_before = ReadPrefix();
  const uint64_t used_before = dst_alloc_->Stats().used_bytes;
  auto session = dst_->BeginImport(DstPlan("d", kShared));
  ASSERT_THAT(session.status(), IsOk());
  const std::vector<TransferPage> pages = Suffix(kShared);
  EXPECT_EQ(pages.size(), (plan_.size() - kShared) * kLayers);
  for (const TransferPage& p : pages) {
    ASSERT_THAT((*session)->Install(p), IsOk());
  }
  auto r = (*session)->Commit();
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_shared, kShared * kLayers);
  EXPECT_EQ(r->pages, pages.size());
  const uint64_t shared_bytes =
      uint64_t{kShared} * kLayers *
      kernels::PageBytes(Encoding(Format::kINT8), PageShapeOf(Model(), kBlock));
  EXPECT_EQ(r->page_bytes, full_bytes - shared_bytes);
  // Only the pulled blocks took pool bytes; the shared ones are the
  // prefix's pages, one more reference each.
  EXPECT_EQ(dst_alloc_->Stats().used_bytes - used_before, r->page_bytes);
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t i = 0; i < kShared; ++i) {
      auto pd = dst_->TargetPage("d", i, l);
      auto pp = dst_->TargetPage("p", i, l);
      ASSERT_THAT(pd.status(), IsOk());
      ASSERT_THAT(pp.status(), IsOk());
      EXPECT_EQ(*pd, *pp);
      EXPECT_EQ(dst_alloc_->RefCount(*pd), 2);
    }
    auto own = dst_->TargetPage("d", kShared, l);
    ASSERT_THAT(own.status(), IsOk());
    EXPECT_EQ(dst_alloc_->RefCount(*own), 1);
  }
  ExpectSameReads("s", "d");
  ExpectSameAttention("s", "d");
  // The shared blocks take no writes (a fork's rule); the prefix keeps its
  // values, and the new sequence still appends.
  EXPECT_THAT(Write(dst_.get(), "d", 0, 0, kBlock, kTenant, 99),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_EQ(ReadPrefix(), prefix_before);
  // Freeing the prefix leaves the new sequence whole.
  ASSERT_THAT(dst_->Free(kTenant, "p").status(), IsOk());
  ExpectSameReads("s", "d");
  ExpectSameAttention("s", "d");
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto pd = dst_->TargetPage("d", 0, l);
    ASSERT_THAT(pd.status(), IsOk());
    EXPECT_EQ(dst_alloc_->RefCount(*pd), 1);
  }
  ASSERT_THAT(dst_->Free(kTenant, "d").status(), IsOk());
  EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
}

TEST_F(PrefixImportTest, ThePrefixMayBeFreedWhileTheImportRuns) {
  auto session = dst_->BeginImport(DstPlan("d", kShared));
  ASSERT_THAT(session.status(), IsOk());
  ASSERT_THAT(dst_->Free(kTenant, "p").status(), IsOk());
  // Pages allocated after the free (other values) may not be the shared
  // ones.
  Install(dst_.get(), "other", Plan(kPrefixTokens, Encoding(Format::kINT8)),
          kPrefixTokens, kTenant, /*seed=*/9);
  for (const TransferPage& p : Suffix(kShared)) {
    ASSERT_THAT((*session)->Install(p), IsOk());
  }
  ASSERT_THAT((*session)->Commit().status(), IsOk());
  ExpectSameReads("s", "d");
  ExpectSameAttention("s", "d");
}

TEST_F(PrefixImportTest, AnAbortReturnsEverything) {
  const uint64_t used_before = dst_alloc_->Stats().used_bytes;
  std::vector<Page*> prefix_pages;
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto pp = dst_->TargetPage("p", 0, l);
    ASSERT_THAT(pp.status(), IsOk());
    prefix_pages.push_back(*pp);
  }
  {
    auto session = dst_->BeginImport(DstPlan("d", kShared));
    ASSERT_THAT(session.status(), IsOk());
    for (Page* p : prefix_pages) EXPECT_EQ(dst_alloc_->RefCount(p), 2);
    const std::vector<TransferPage> pages = Suffix(kShared);
    ASSERT_THAT((*session)->Install(pages[0]), IsOk());
    EXPECT_GT(dst_alloc_->Stats().used_bytes, used_before);
  }  // destroyed without a commit
  EXPECT_EQ(dst_alloc_->Stats().used_bytes, used_before);
  for (Page* p : prefix_pages) EXPECT_EQ(dst_alloc_->RefCount(p), 1);
  EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::ElementsAre("p"));
  // The prefix freed meanwhile: the aborted import's references were the
  // last ones, and nothing stays.
  {
    auto session = dst_->BeginImport(DstPlan("d", kShared));
    ASSERT_THAT(session.status(), IsOk());
    ASSERT_THAT(dst_->Free(kTenant, "p").status(), IsOk());
    EXPECT_GT(dst_alloc_->Stats().used_bytes, 0u);
  }
  EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
}

TEST_F(PrefixImportTest, RefusalsNameTheFieldAndReserveNothing) {
  const uint64_t used_before = dst_alloc_->Stats().used_bytes;
  // Lineage mismatch at block 1: both lineage ids named.
  ImportPlan bad = DstPlan("d", kShared);
  bad.blocks[1].lineage_id = 555;
  EXPECT_THAT(dst_->BeginImport(bad).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("block 1 mismatches"),
                             HasSubstr("lineage_id=555"),
                             HasSubstr("lineage_id=101"))));
  // Block 2 of the prefix is partial and in the window.
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", 3)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("block 2 (lineage_id=102)")));
  // More blocks than the prefix has, or than the plan has.
  Install(dst_.get(), "short", Plan(kBlock, Encoding(Format::kINT8)), kBlock);
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", kShared, "short")).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("prefix sequence has 1 blocks")));
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", 6)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("prefix_blocks=6")));
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", kShared, "nope")).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("prefix_sequence_id=\"nope\"")));
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", kShared, "d")).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("equals sequence_id")));
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", 0, "p")).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("prefix_blocks=0")));
  Install(dst_.get(), "theirs", Plan(kPrefixTokens, Encoding(Format::kINT8)),
          kPrefixTokens, "tenant-b");
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", kShared, "theirs")).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  ASSERT_THAT(dst_->Free(kTenant, "short").status(), IsOk());
  ASSERT_THAT(dst_->Free("tenant-b", "theirs").status(), IsOk());
  EXPECT_EQ(dst_alloc_->Stats().used_bytes, used_before);
  // A page of a shared block is not expected.
  auto session = dst_->BeginImport(DstPlan("d", kShared));
  ASSERT_THAT(session.status(), IsOk());
  const std::vector<TransferPage> all = Suffix(0);
  EXPECT_THAT((*session)->Install(all[0]),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shares the prefix sequence's pages")));
}

}  // namespace
}  // namespace triax::worker
