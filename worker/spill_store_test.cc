// SequenceStore over the spill tiers: Spill / Restore / Evict, attention
// across them, background restores and the refusals.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "worker/sequence_store.h"
#include "worker/tier_store.h"

namespace triax::worker {
namespace {

namespace fs = std::filesystem;
using ::testing::_;
using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr int kBf16 = 1, kInt4 = 2, kInt2 = 3;
constexpr char kTenant[] = "tenant-a";
constexpr uint32_t kLayers = 2, kKvHeads = 2, kQHeads = 4, kDim = 32;
constexpr size_t kPerToken = size_t{kKvHeads} * kDim;

ModelShape Model() {
  ModelShape m;
  m.name = "test";
  m.n_layers = kLayers;
  m.n_kv_heads = kKvHeads;
  m.n_q_heads = kQHeads;
  m.head_dim = kDim;
  return m;
}

// Blocks of 16 tokens in the given formats (the last may be shorter);
// lineage ids 100, 101, ...
std::vector<BlockSpec> Plan(const std::vector<int>& formats,
                            uint32_t last_tokens = 16) {
  std::vector<BlockSpec> plan;
  for (size_t i = 0; i < formats.size(); ++i) {
    BlockSpec b;
    b.index = static_cast<uint32_t>(i);
    b.lineage_id = 100 + i;
    b.first_token = 16 * i;
    b.num_tokens = i + 1 == formats.size() ? last_tokens : 16;
    b.encoding = static_cast<Format>(formats[i]);
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

std::string Bytes(const float* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n * 4);
}

std::string MakeTempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl =
      std::string(base != nullptr && *base ? base : "/tmp") + "/spill.XXXXXX";
  char* made = ::mkdtemp(tmpl.data());
  return made == nullptr ? "" : std::string(made);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class SpillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    store_.reset();
    tiers_.reset();
    alloc_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  struct Config {
    size_t pool = 8 << 20;
    uint64_t host = 1 << 20;
    uint64_t disk = 4 << 20;
    bool restore_on_attend = true;
    bool prefetch_thread = false;
    bool tiers = true;
  };

  void Make(const Config& c) {
    store_.reset();
    tiers_.reset();
    alloc_.reset();
    auto a = PageAllocator::Create(&device_, c.pool);
    ASSERT_THAT(a.status(), IsOk());
    alloc_ = *std::move(a);
    TierStoreOptions to;
    to.host_capacity_bytes = c.host;
    to.disk_dir = dir_;
    to.disk_capacity_bytes = c.disk;
    to.owner = "w";
    auto t = TierStore::Create(&device_, to);
    ASSERT_THAT(t.status(), IsOk());
    tiers_ = *std::move(t);
    StoreOptions so;
    so.window_tokens = 16;
    so.tiers = c.tiers ? tiers_.get() : nullptr;
    so.restore_on_attend = c.restore_on_attend;
    so.prefetch_thread = c.prefetch_thread;
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(), so);
  }

  // Installs `seq` with blocks of `formats` and writes `tokens` tokens on
  // every layer (seed per layer).
  void Install(const std::string& seq, const std::vector<int>& formats,
               uint32_t tokens, uint32_t seed = 1) {
    ASSERT_THAT(
        store_
            ->AllocatePages(kTenant, seq, Model(), 16,
                            Plan(formats, tokens - 16 * (formats.size() - 1)))
            .status(),
        IsOk());
    for (uint32_t l = 0; l < kLayers; ++l) {
      const std::vector<float> k = Random(tokens * kPerToken, seed + 2 * l);
      const std::vector<float> v = Random(tokens * kPerToken, seed + 2 * l + 1);
      const std::string kb = Bytes(k.data(), k.size());
      const std::string vb = Bytes(v.data(), v.size());
      KvWrite w;
      w.layer = l;
      w.first_token = 0;
      w.num_tokens = tokens;
      w.dtype = static_cast<int>(KvDtype::kF32);
      w.k = kb;
      w.v = vb;
      ASSERT_THAT(store_->Write(kTenant, seq, w).status(), IsOk());
    }
  }

  absl::StatusOr<std::vector<float>> Attend(
      const std::string& seq, uint32_t layer,
      const std::vector<uint64_t>& positions, const KvWrite* append = nullptr) {
    const uint32_t nq = positions.empty() ? 1 : positions.size();
    const std::vector<float> q = Random(size_t{nq} * kQHeads * kDim, 77);
    const std::string qb = Bytes(q.data(), q.size());
    AttendSpec spec;
    spec.layer = layer;
    spec.num_queries = nq;
    spec.positions = positions;
    spec.queries = qb;
    spec.append = append;
    return store_->Attend(kTenant, seq, spec);
  }

  // Both layers' attention for queries at the given positions.
  std::vector<std::vector<float>> AttendAll(
      const std::string& seq, const std::vector<uint64_t>& positions) {
    std::vector<std::vector<float>> out;
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto o = Attend(seq, l, positions);
      EXPECT_THAT(o.status(), IsOk()) << "layer " << l;
      out.push_back(o.ok() ? *o : std::vector<float>{});
    }
    return out;
  }

  int BlockTier(const std::string& seq, size_t b) {
    auto d = store_->Describe(seq);
    return d.ok() ? static_cast<int>(d->blocks[b].tier) : -1;
  }

  CpuDevice device_;
  std::string dir_;
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<TierStore> tiers_;
  std::unique_ptr<SequenceStore> store_;
};

// 60 tokens in blocks [bf16, int4, int2, int4(12)] with a 16-token window:
// blocks 0-1 are sealed on both layers, 2-3 are in the window.
const std::vector<int> kFormats = {kBf16, kInt4, kInt2, kInt4};
constexpr uint32_t kTokens = 60;

TEST_F(SpillTest, SpillAndRestoreKeepAttentionBitExact) {
  Make({});
  Install("s", kFormats, kTokens);
  const std::vector<uint64_t> pos = {59, 20, 3};
  const auto before = AttendAll("s", pos);
  const uint64_t used = store_->Inventory().used_bytes;
  const uint64_t block_bytes =
      kLayers * (kernels::PageBytes(kernels::Encoding(kernels::Format::kBF16),
                                    {16, kKvHeads, kDim}) +
                 kernels::PageBytes(kernels::Encoding(kernels::Format::kINT4),
                                    {16, kKvHeads, kDim}));
  const uint64_t ids[] = {100, 101};
  int round = 0;
  for (Tier tier : {Tier::kHost, Tier::kDisk}) {
    SCOPED_TRACE(TierName(tier));
    auto r = store_->Spill(kTenant, "s", ids, tier);
    ASSERT_THAT(r.status(), IsOk());
    EXPECT_EQ(r->pages_moved, 4u);
    EXPECT_EQ(r->bytes_moved, block_bytes);
    EXPECT_EQ(r->device_bytes_freed, block_bytes);
    EXPECT_EQ(BlockTier("s", 0), static_cast<int>(tier));
    EXPECT_EQ(BlockTier("s", 1), static_cast<int>(tier));
    EXPECT_EQ(BlockTier("s", 2), static_cast<int>(Tier::kDevice));
    InventorySnapshot inv = store_->Inventory();
    EXPECT_EQ(inv.used_bytes, used - block_bytes);
    const TierUsage& u = tier == Tier::kHost ? inv.host : inv.disk;
    EXPECT_EQ(u.used_bytes, block_bytes);
    EXPECT_EQ(u.blocks, 2u);
    if (tier == Tier::kDisk) {
      EXPECT_EQ(std::distance(fs::directory_iterator(tiers_->disk_dir()),
                              fs::directory_iterator()),
                4);
    }
    // Spilling again to the same tier is a no-op.
    auto again = store_->Spill(kTenant, "s", ids, tier);
    ASSERT_THAT(again.status(), IsOk());
    EXPECT_EQ(again->pages_moved, 0u);

    if (round++ == 0) {
      // Restore on attend (the default) brings them back first.
      const auto after = AttendAll("s", pos);
      for (uint32_t l = 0; l < kLayers; ++l) {
        EXPECT_TRUE(SameBits(after[l], before[l])) << "layer " << l;
      }
    } else {
      auto rr = store_->Restore(kTenant, "s", {}, /*background=*/false);
      ASSERT_THAT(rr.status(), IsOk());
      EXPECT_EQ(rr->pages_restored, 4u);
      EXPECT_EQ(rr->bytes_restored, block_bytes);
      EXPECT_EQ(rr->blocks_queued, 0u);
      const auto after = AttendAll("s", pos);
      for (uint32_t l = 0; l < kLayers; ++l) {
        EXPECT_TRUE(SameBits(after[l], before[l])) << "layer " << l;
      }
    }
    inv = store_->Inventory();
    EXPECT_EQ(inv.used_bytes, used);
    EXPECT_EQ(inv.host.used_bytes + inv.disk.used_bytes, 0u);
    EXPECT_EQ(BlockTier("s", 0), static_cast<int>(Tier::kDevice));
  }
  // Host -> disk -> read back: still exact, and ReadKV restores too.
  auto read_before = store_->Read(kTenant, "s", 1, 0, 32);
  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kHost).status(), IsOk());
  auto moved = store_->Spill(kTenant, "s", ids, Tier::kDisk);
  ASSERT_THAT(moved.status(), IsOk());
  EXPECT_EQ(moved->pages_moved, 4u);
  EXPECT_EQ(moved->device_bytes_freed, 0u);
  EXPECT_EQ(store_->Inventory().host.used_bytes, 0u);
  EXPECT_EQ(store_->Inventory().disk.used_bytes, block_bytes);
  auto read_after = store_->Read(kTenant, "s", 1, 0, 32);
  ASSERT_THAT(read_after.status(), IsOk());
  EXPECT_TRUE(SameBits(read_after->k, read_before->k));
  EXPECT_TRUE(SameBits(read_after->v, read_before->v));
  const InventorySnapshot inv = store_->Inventory();
  EXPECT_EQ(inv.spills, 8u);  // 2 blocks x (host, disk, host, disk)
  EXPECT_EQ(inv.restores, 6u);
  EXPECT_EQ(inv.checksum_failures, 0u);
}

// The replayed failure: a host tier left fragmented by spills and restores
// of small INT4 blocks, with no free run as long as one BF16 page, still
// takes a BF16 block (its pages scattered), and attention over it after the
// restore is bit-exact.
TEST_F(SpillTest, FragmentedHostTierStillTakesABlockItsFreeBytesCover) {
  const kernels::PageShape shape{16, kKvHeads, kDim};
  const size_t int4 =
      (kernels::PageBytes(kernels::Encoding(kernels::Format::kINT4), shape) +
       255) /
      256 * 256;
  const size_t bf16 =
      kernels::PageBytes(kernels::Encoding(kernels::Format::kBF16), shape);
  Config c;
  c.host = 8 * kLayers * int4;  // block 0 of s0..s7 fills it
  Make(c);
  for (int i = 0; i < 8; ++i) {
    const std::string seq = absl::StrCat("s", i);
    Install(seq, {kInt4, kInt4, kInt4, kInt4}, kTokens, 10 + i);
    const uint64_t ids[] = {100};
    ASSERT_THAT(store_->Spill(kTenant, seq, ids, Tier::kHost).status(), IsOk());
  }
  EXPECT_EQ(store_->Inventory().host.free_bytes, 0u);
  for (int i = 0; i < 8; i += 2) {
    ASSERT_THAT(store_
                    ->Restore(kTenant, absl::StrCat("s", i), {},
                              /*background=*/false)
                    .status(),
                IsOk());
  }
  const TierUsage frag = store_->Inventory().host;
  EXPECT_EQ(frag.free_runs, 4u);
  ASSERT_LT(frag.largest_free_run, bf16);      // no run holds a page
  ASSERT_GE(frag.free_bytes, kLayers * bf16);  // the free bytes do

  Install("b", kFormats, kTokens, 40);  // block 0 is BF16
  const std::vector<uint64_t> pos = {59, 20, 3};
  const auto before = AttendAll("b", pos);
  const uint64_t ids[] = {100};
  auto r = store_->Spill(kTenant, "b", ids, Tier::kHost);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->bytes_moved, kLayers * bf16);
  EXPECT_EQ(BlockTier("b", 0), static_cast<int>(Tier::kHost));
  const TierUsage after = store_->Inventory().host;
  EXPECT_EQ(after.scattered_pages, kLayers);
  EXPECT_EQ(after.free_bytes, frag.free_bytes - kLayers * bf16);
  ASSERT_THAT(store_->Restore(kTenant, "b", {}, /*background=*/false).status(),
              IsOk());
  const auto back = AttendAll("b", pos);
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(SameBits(back[l], before[l])) << "layer " << l;
  }
  for (int i = 1; i < 8; i += 2) {
    ASSERT_THAT(store_
                    ->Restore(kTenant, absl::StrCat("s", i), {},
                              /*background=*/false)
                    .status(),
                IsOk());
  }
  const TierUsage empty = store_->Inventory().host;
  EXPECT_EQ(empty.free_bytes, c.host);
  EXPECT_EQ(empty.free_runs, 1u);
  EXPECT_EQ(empty.scattered_pages, 0u);
}

TEST_F(SpillTest, RestoresOnTheWorkersOwnInitiativeAreReportedOnce) {
  Make({});
  Install("s", kFormats, kTokens);
  const uint64_t ids[] = {100, 101};
  // A manager-driven (synchronous) Restore is not reported: the manager
  // accounts for it itself.
  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kHost).status(), IsOk());
  ASSERT_THAT(store_->Restore(kTenant, "s", ids, false).status(), IsOk());
  EXPECT_TRUE(store_->TakeSelfRestored().empty());
  // Restore on Attend is, once.
  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kDisk).status(), IsOk());
  AttendAll("s", {59});
  std::vector<uint64_t> got = store_->TakeSelfRestored();
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<uint64_t>{100, 101}));
  EXPECT_TRUE(store_->TakeSelfRestored().empty());
  // A heartbeat that failed gives them back for the next one.
  store_->ReturnSelfRestored(got);
  EXPECT_EQ(store_->TakeSelfRestored().size(), 2u);
}

TEST_F(SpillTest, WithoutRestoreOnAttendAnswersUnavailableThenServes) {
  Config c;
  c.restore_on_attend = false;
  Make(c);
  Install("s", kFormats, kTokens);
  const auto before = AttendAll("s", {59});
  const uint64_t ids[] = {101};
  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kDisk).status(), IsOk());

  // The refusal names the block, carries the retry delay and changes
  // nothing: the append is not written.
  const std::vector<float> k = Random(kPerToken, 5), v = Random(kPerToken, 6);
  const std::string kb = Bytes(k.data(), k.size()),
                    vb = Bytes(v.data(), v.size());
  KvWrite append;
  append.layer = 0;
  append.first_token = kTokens;
  append.num_tokens = 1;
  append.dtype = static_cast<int>(KvDtype::kF32);
  append.k = kb;
  append.v = vb;
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", Model(), 16, Plan(kFormats, 13))
          .status(),
      IsOk());
  auto refused = Attend("s", 0, {}, &append);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kUnavailable,
                                AllOf(HasSubstr("lineage_id=101"),
                                      HasSubstr("disk tier"),
                                      HasSubstr("retry after 20 ms"))));
  EXPECT_EQ(RetryAfterMs(refused.status()), 20u);
  EXPECT_EQ(store_->Describe("s")->written[0], kTokens);
  EXPECT_EQ(store_->Inventory().restores, 0u);

  // The background restore (the queue, served here) brings it back.
  EXPECT_EQ(store_->ServePrefetchQueue(), 1u);
  EXPECT_EQ(store_->Inventory().restores, 1u);
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kDevice));
  const auto after = AttendAll("s", {59});
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(SameBits(after[l], before[l]));
  }
  ASSERT_THAT(Attend("s", 0, {}, &append).status(), IsOk());

  // A block already queued is waited for (restored in line), not bounced.
  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kHost).status(), IsOk());
  auto q = store_->Restore(kTenant, "s", ids, /*background=*/true);
  ASSERT_THAT(q.status(), IsOk());
  EXPECT_EQ(q->blocks_queued, 1u);
  EXPECT_EQ(q->pages_restored, 0u);
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kHost));
  const auto waited = AttendAll("s", {59});
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(SameBits(waited[l], before[l]));
  }
  EXPECT_EQ(store_->ServePrefetchQueue(), 1u);  // finds nothing left to do
  EXPECT_EQ(store_->Inventory().restores, 2u);
}

TEST_F(SpillTest, BlocksPastTheAttendedPositionsStaySpilled) {
  Config c;
  c.restore_on_attend = false;
  Make(c);
  Install("s", kFormats, kTokens);
  const auto before = AttendAll("s", {10});
  const uint64_t one[] = {101};
  ASSERT_THAT(store_->Spill(kTenant, "s", one, Tier::kHost).status(), IsOk());
  // Position 10 reads block 0 only: served without touching block 1.
  const auto after = AttendAll("s", {10});
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(SameBits(after[l], before[l]));
  }
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kHost));
  EXPECT_THAT(store_->Read(kTenant, "s", 0, 0, 16).status(), IsOk());
  EXPECT_THAT(Attend("s", 0, {16}),
              StatusIs(absl::StatusCode::kUnavailable, _));
}

TEST_F(SpillTest, PrefetchThreadRestoresInTheBackground) {
  Config c;
  c.restore_on_attend = false;
  c.prefetch_thread = true;
  Make(c);
  Install("s", kFormats, kTokens);
  const auto before = AttendAll("s", {40});
  const uint64_t ids[] = {100, 101};
  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kHost).status(), IsOk());
  auto r = store_->Restore(kTenant, "s", {}, /*background=*/true);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->blocks_queued, 2u);
  store_->WaitPrefetchIdle();
  EXPECT_EQ(BlockTier("s", 0), static_cast<int>(Tier::kDevice));
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kDevice));
  EXPECT_EQ(store_->Inventory().restores, 2u);

  ASSERT_THAT(store_->Spill(kTenant, "s", ids, Tier::kDisk).status(), IsOk());
  auto refused = Attend("s", 1, {40});
  if (!refused.ok()) {  // unless the thread was quicker than this call
    EXPECT_THAT(refused, StatusIs(absl::StatusCode::kUnavailable, _));
  }
  store_->WaitPrefetchIdle();
  const auto after = AttendAll("s", {40});
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(SameBits(after[l], before[l]));
  }
}

// Reference for attention with evicted blocks: the kernel over the pages
// of the remaining blocks, attending to their tokens up to each position.
std::vector<float> RemainingRef(SequenceStore& store, const std::string& seq,
                                uint32_t layer,
                                const std::vector<uint32_t>& kept,
                                const std::vector<int>& formats,
                                uint64_t attend_tokens) {
  std::vector<kernels::PageRef> refs;
  for (uint32_t b : kept) {
    kernels::PageRef r;
    r.encoding = kernels::Encoding(static_cast<kernels::Format>(formats[b]));
    r.data = (*store.TargetPage(seq, b, layer))->data;
    r.num_tokens = 16;
    refs.push_back(r);
  }
  const std::vector<float> q = Random(size_t{kQHeads} * kDim, 77);
  std::vector<float> out(q.size());
  kernels::DecodeParams p;
  p.q = q.data();
  p.out = out.data();
  p.n_q_heads = kQHeads;
  p.shape = {16, kKvHeads, kDim};
  p.scale = 1.f / std::sqrt(float{kDim});
  p.pages = refs.data();
  p.num_pages = static_cast<int>(refs.size());
  p.attend_tokens = static_cast<long>(attend_tokens);
  kernels::DecodeAttentionRef(p);
  return out;
}

TEST_F(SpillTest, EvictedBlocksAreSkippedButPositionsCount) {
  Make({});
  // 64 tokens, 4 full blocks; blocks 0-2 sealed.
  Install("s", kFormats, 64);
  const auto full = AttendAll("s", {47});
  const uint64_t evict_ids[] = {101};
  auto e = store_->Evict(kTenant, "s", evict_ids);
  ASSERT_THAT(e.status(), IsOk());
  EXPECT_EQ(e->pages_freed, 2u);
  EXPECT_GT(e->bytes_freed, 0u);
  auto d = store_->Describe("s");
  EXPECT_TRUE(d->blocks[1].evicted);
  EXPECT_EQ(store_->Inventory().evictions, 1u);

  for (uint32_t l = 0; l < kLayers; ++l) {
    // Position 47 (end of block 2): blocks 0 and 2 remain, 32 tokens.
    auto got = Attend("s", l, {47});
    ASSERT_THAT(got.status(), IsOk());
    EXPECT_TRUE(
        SameBits(*got, RemainingRef(*store_, "s", l, {0, 2}, kFormats, 32)));
    EXPECT_FALSE(SameBits(*got, full[l]));
    // Position 20 lies in the evicted block: block 0's 16 tokens remain.
    auto inside = Attend("s", l, {20});
    ASSERT_THAT(inside.status(), IsOk());
    EXPECT_TRUE(
        SameBits(*inside, RemainingRef(*store_, "s", l, {0, 2}, kFormats, 16)));
  }
  // Reads of the evicted range are refused; around it they work.
  EXPECT_THAT(
      store_->Read(kTenant, "s", 0, 10, 10),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("lineage_id=101"), HasSubstr("evicted"))));
  EXPECT_THAT(store_->Read(kTenant, "s", 0, 0, 16).status(), IsOk());
  EXPECT_THAT(store_->Read(kTenant, "s", 0, 32, 0).status(), IsOk());

  // Evicting again is a no-op; restoring, spilling or demoting it is not.
  auto again = store_->Evict(kTenant, "s", evict_ids);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(again->pages_freed, 0u);
  EXPECT_THAT(
      store_->Restore(kTenant, "s", evict_ids, false),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("evicted")));
  EXPECT_THAT(
      store_->Spill(kTenant, "s", evict_ids, Tier::kHost),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("evicted")));
  std::vector<BlockSpec> demote = {Plan(kFormats)[1]};
  demote[0].encoding = static_cast<Format>(kInt2);
  EXPECT_THAT(
      store_->Demote(kTenant, "s", demote),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("evicted")));

  // A spilled block can be evicted: its files go.
  const uint64_t zero[] = {100};
  ASSERT_THAT(store_->Spill(kTenant, "s", zero, Tier::kDisk).status(), IsOk());
  EXPECT_GT(store_->Inventory().disk.used_bytes, 0u);
  auto e0 = store_->Evict(kTenant, "s", zero);
  ASSERT_THAT(e0.status(), IsOk());
  EXPECT_EQ(e0->pages_freed, 2u);
  EXPECT_EQ(store_->Inventory().disk.used_bytes, 0u);
  EXPECT_TRUE(fs::is_empty(tiers_->disk_dir()));
  // Every token up to position 20 is now evicted.
  EXPECT_THAT(Attend("s", 0, {20}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no tokens to attend to")));
  EXPECT_THAT(Attend("s", 0, {40}).status(), IsOk());
}

TEST_F(SpillTest, RefusalsNameTheBlockAndChangeNothing) {
  Make({});
  Install("s", kFormats, kTokens);
  const uint64_t unsealed[] = {102};
  EXPECT_THAT(store_->Spill(kTenant, "s", unsealed, Tier::kHost),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("lineage_id=102"),
                             HasSubstr("not sealed on layer 0"))));
  EXPECT_THAT(
      store_->Evict(kTenant, "s", unsealed),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not sealed")));
  const uint64_t mixed[] = {100, 102};  // all or nothing
  EXPECT_THAT(store_->Spill(kTenant, "s", mixed, Tier::kHost),
              StatusIs(absl::StatusCode::kFailedPrecondition, _));
  EXPECT_EQ(BlockTier("s", 0), static_cast<int>(Tier::kDevice));
  const uint64_t unknown[] = {100, 555};
  EXPECT_THAT(
      store_->Spill(kTenant, "s", unknown, Tier::kHost),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("lineage_ids[1]=555")));
  EXPECT_THAT(store_->Restore(kTenant, "s", unknown, false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("555")));
  EXPECT_THAT(store_->Evict(kTenant, "s", unknown),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("555")));
  const uint64_t twice[] = {100, 100};
  EXPECT_THAT(store_->Spill(kTenant, "s", twice, Tier::kHost),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("more than once")));
  EXPECT_THAT(store_->Spill(kTenant, "s", {}, Tier::kHost),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids is empty")));
  EXPECT_THAT(store_->Evict(kTenant, "s", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids is empty")));
  const uint64_t ok[] = {100};
  EXPECT_THAT(
      store_->Spill(kTenant, "s", ok, Tier::kDevice),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tier=1")));
  EXPECT_THAT(store_->Spill("tenant-b", "s", ok, Tier::kHost),
              StatusIs(absl::StatusCode::kPermissionDenied, _));
  EXPECT_THAT(store_->Evict("tenant-b", "s", ok),
              StatusIs(absl::StatusCode::kPermissionDenied, _));
  EXPECT_THAT(store_->Spill(kTenant, "nope", ok, Tier::kHost),
              StatusIs(absl::StatusCode::kNotFound, _));

  // Shared with a fork: refused.
  ASSERT_THAT(
      store_->Fork(kTenant, "s", "child", 32, Plan({kBf16, kInt4})).status(),
      IsOk());
  EXPECT_THAT(store_->Spill(kTenant, "s", ok, Tier::kHost),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shared by 2")));
  EXPECT_THAT(
      store_->Evict(kTenant, "child", ok),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("shared")));
  ASSERT_THAT(store_->Free(kTenant, "child").status(), IsOk());

  // Spilled: no demote, no fork over it, no growing it.
  ASSERT_THAT(store_->Spill(kTenant, "s", ok, Tier::kHost).status(), IsOk());
  std::vector<BlockSpec> demote = {Plan(kFormats)[0]};
  demote[0].encoding = static_cast<Format>(kInt4);
  EXPECT_THAT(store_->Demote(kTenant, "s", demote),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("Restore it before demoting")));
  EXPECT_THAT(store_->Fork(kTenant, "s", "child2", 32, Plan({kBf16, kInt4})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("Restore it before forking")));
  // The store without tiers refuses Spill outright.
  Config none;
  none.tiers = false;
  Make(none);
  Install("s", kFormats, kTokens);
  EXPECT_THAT(store_->Spill(kTenant, "s", ok, Tier::kHost),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no spill tiers")));
}

TEST_F(SpillTest, PlansNamingOtherTierStatesAreAcceptedForInstalledBlocks) {
  Make({});
  Install("s", kFormats, kTokens);
  const uint64_t ok[] = {100};
  ASSERT_THAT(store_->Spill(kTenant, "s", ok, Tier::kDisk).status(), IsOk());
  // A plan fetched before the spill (tier device), one after with the block
  // evicted: both accepted, the installed state wins.
  std::vector<BlockSpec> plan = Plan({kBf16, kInt4, kInt2, kInt4, kInt4}, 4);
  plan[3].num_tokens = 16;
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", Model(), 16, plan).status(),
              IsOk());
  plan[0].evicted = true;
  plan[1].tier = Tier::kHost;
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", Model(), 16, plan).status(),
              IsOk());
  auto d = store_->Describe("s");
  EXPECT_EQ(d->blocks[0].tier, Tier::kDisk);
  EXPECT_FALSE(d->blocks[0].evicted);
  EXPECT_EQ(d->blocks[1].tier, Tier::kDevice);
  // A new block cannot arrive spilled or evicted.
  std::vector<BlockSpec> grown = plan;
  grown[4].num_tokens = 16;
  BlockSpec extra = grown[4];
  extra.index = 5;
  extra.lineage_id = 105;
  extra.first_token = 80;
  extra.tier = Tier::kHost;
  grown.push_back(extra);
  EXPECT_THAT(store_->AllocatePages(kTenant, "s", Model(), 16, grown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[5]"), HasSubstr("tier 2"))));
  grown[5].tier = Tier::kUnspecified;
  grown[5].evicted = true;
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "s", Model(), 16, grown),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("evicted")));
  grown[5].evicted = false;
  grown[5].tier = static_cast<Tier>(7);
  EXPECT_THAT(store_->AllocatePages(kTenant, "s", Model(), 16, grown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[5].tier=7")));
}

TEST_F(SpillTest, FullTierOrPoolIsAllOrNothing) {
  Config c;
  // Block 0 (bf16, 2 x 4096 bytes) fits the host tier; 0 and 1 together
  // do not.
  c.host = 10 << 10;
  c.pool = 4 << 20;  // room for one 1 MiB slab per pool
  Make(c);
  Install("s", kFormats, kTokens);
  const uint64_t both[] = {100, 101};
  const uint64_t pool_used = store_->Inventory().used_bytes;
  EXPECT_THAT(store_->Spill(kTenant, "s", both, Tier::kHost),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("host tier"), HasSubstr("over"),
                             HasSubstr("nothing was spilled"))));
  EXPECT_EQ(BlockTier("s", 0), static_cast<int>(Tier::kDevice));
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kDevice));
  EXPECT_EQ(store_->Inventory().host.used_bytes, 0u);
  EXPECT_EQ(store_->Inventory().used_bytes, pool_used);
  EXPECT_EQ(store_->Inventory().spills, 0u);

  // Restore into a full pool: nothing changes; after room is made it runs.
  ASSERT_THAT(store_->Spill(kTenant, "s", both, Tier::kDisk).status(), IsOk());
  int fillers = 0;
  for (int format : {kBf16, kInt4, kInt2}) {
    for (;;) {
      const std::string id = "fill" + std::to_string(fillers);
      if (!store_->AllocatePages(kTenant, id, Model(), 16, Plan({format}))
               .ok()) {
        break;
      }
      ++fillers;
    }
  }
  ASSERT_GT(fillers, 0);
  const uint64_t full_used = store_->Inventory().used_bytes;
  EXPECT_THAT(store_->Restore(kTenant, "s", {}, false),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("needs 4 device pages"),
                             HasSubstr("nothing was restored"))));
  EXPECT_THAT(Attend("s", 0, {59}),
              StatusIs(absl::StatusCode::kResourceExhausted, _));
  EXPECT_EQ(BlockTier("s", 0), static_cast<int>(Tier::kDisk));
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kDisk));
  EXPECT_EQ(store_->Inventory().used_bytes, full_used);
  EXPECT_GT(store_->Inventory().disk.used_bytes, 0u);
  for (int i = 0; i < fillers; ++i) {
    ASSERT_THAT(store_->Free(kTenant, "fill" + std::to_string(i)).status(),
                IsOk());
  }
  EXPECT_THAT(store_->Restore(kTenant, "s", {}, false).status(), IsOk());
  EXPECT_EQ(store_->Inventory().used_bytes, pool_used);
}

TEST_F(SpillTest, ChecksumFailuresAreDataLossAndNeverServed) {
  Config c;
  Make(c);
  Install("s", kFormats, kTokens);
  const uint64_t zero[] = {100}, one[] = {101};
  ASSERT_THAT(store_->Spill(kTenant, "s", zero, Tier::kDisk).status(), IsOk());
  ASSERT_THAT(store_->Spill(kTenant, "s", one, Tier::kHost).status(), IsOk());
  // Corrupt block 0's layer-1 file and one byte of block 1's host copy.
  auto disk = store_->SpilledPages("s", 0);
  ASSERT_THAT(disk.status(), IsOk());
  {
    std::fstream f(disk->pages[1].path,
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(TierStore::kHeaderBytes + 77);
    f.put('\x5a');
  }
  auto host = store_->SpilledPages("s", 1);
  ASSERT_THAT(host.status(), IsOk());
  tiers_->HostPageBytes(host->pages[0])[9] ^= 0x80;

  EXPECT_THAT(Attend("s", 0, {59}),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("sequence_id=\"s\""),
                             HasSubstr("lineage_id=100"), HasSubstr("layer 1"),
                             HasSubstr("disk tier"))));
  EXPECT_THAT(store_->Restore(kTenant, "s", one, false),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("lineage_id=101"), HasSubstr("layer 0"),
                             HasSubstr("host tier"))));
  EXPECT_THAT(store_->Read(kTenant, "s", 0, 0, 8),
              StatusIs(absl::StatusCode::kDataLoss, _));
  EXPECT_EQ(BlockTier("s", 0), static_cast<int>(Tier::kDisk));
  EXPECT_EQ(BlockTier("s", 1), static_cast<int>(Tier::kHost));
  EXPECT_EQ(store_->Inventory().checksum_failures, 3u);
  EXPECT_EQ(store_->Inventory().restores, 0u);

  // Evicting the bad blocks is the way on; their space is released.
  const uint64_t both[] = {100, 101};
  ASSERT_THAT(store_->Evict(kTenant, "s", both).status(), IsOk());
  EXPECT_EQ(store_->Inventory().host.used_bytes, 0u);
  EXPECT_EQ(store_->Inventory().disk.used_bytes, 0u);
  EXPECT_THAT(Attend("s", 0, {59}).status(), IsOk());
}

TEST_F(SpillTest, FailedBackgroundRestoreAnswersDataLossNotRetry) {
  Config c;
  c.restore_on_attend = false;
  Make(c);
  Install("s", kFormats, kTokens);
  const uint64_t zero[] = {100};
  ASSERT_THAT(store_->Spill(kTenant, "s", zero, Tier::kHost).status(), IsOk());
  auto host = store_->SpilledPages("s", 0);
  ASSERT_THAT(host.status(), IsOk());
  tiers_->HostPageBytes(host->pages[1])[0] ^= 0x01;
  EXPECT_THAT(Attend("s", 0, {59}),
              StatusIs(absl::StatusCode::kUnavailable, _));
  store_->ServePrefetchQueue();
  EXPECT_EQ(store_->Inventory().checksum_failures, 1u);
  for (int i = 0; i < 2; ++i) {
    auto r = Attend("s", 0, {59});
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kDataLoss,
                            HasSubstr("checksum mismatch")));
    EXPECT_EQ(RetryAfterMs(r.status()), 0u);
  }
}

TEST_F(SpillTest, FreeAndDropReleaseTierSpace) {
  Make({});
  Install("a", kFormats, kTokens, 1);
  Install("b", kFormats, kTokens, 9);
  const uint64_t ids[] = {100, 101};
  ASSERT_THAT(store_->Spill(kTenant, "a", ids, Tier::kDisk).status(), IsOk());
  const uint64_t one[] = {100};
  ASSERT_THAT(store_->Spill(kTenant, "a", one, Tier::kHost).status(), IsOk());
  ASSERT_THAT(store_->Spill(kTenant, "b", ids, Tier::kDisk).status(), IsOk());
  EXPECT_EQ(store_->Inventory().disk.blocks, 3u);
  EXPECT_EQ(store_->Inventory().host.blocks, 1u);
  ASSERT_THAT(store_->Free(kTenant, "a").status(), IsOk());
  EXPECT_EQ(store_->Inventory().host.used_bytes, 0u);
  EXPECT_EQ(store_->Inventory().disk.blocks, 2u);
  ASSERT_THAT(store_->Drop("b").status(), IsOk());
  EXPECT_EQ(store_->Inventory().disk.used_bytes, 0u);
  EXPECT_TRUE(fs::is_empty(tiers_->disk_dir()));
  EXPECT_EQ(store_->Inventory().used_bytes, 0u);
}

}  // namespace
}  // namespace triax::worker
