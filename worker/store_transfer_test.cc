// SequenceStore::Export and ImportSession between two stores (a source
// with spill tiers, a destination): round trips in every encoding,
// re-encoding on the way (byte-equal to Demote), window pages, spilled and
// evicted blocks, follow_writes, and every refusal of a bad payload with no
// page left behind.
#include "worker/store_transfer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "kernels/numeric.h"
#include "worker/checksum.h"
#include "worker/recording_device.h"
#include "worker/sequence_store.h"
#include "worker/tier_store.h"

namespace triax::worker {
namespace {

namespace fs = std::filesystem;
using kernels::Encoding;
using kernels::Format;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr char kTenant[] = "tenant-a";
constexpr uint32_t kLayers = 2, kKv = 2, kQ = 4, kDim = 32, kBlock = 16;
constexpr size_t kPerToken = size_t{kKv} * kDim;

ModelShape Model() {
  ModelShape m;
  m.name = "test";
  m.n_layers = kLayers;
  m.n_kv_heads = kKv;
  m.n_q_heads = kQ;
  m.head_dim = kDim;
  return m;
}

// Blocks of kBlock tokens covering `tokens` (the last one partial), in `e`.
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

std::vector<ExportBlock> ExportList(const std::vector<BlockSpec>& plan) {
  std::vector<ExportBlock> out;
  for (const BlockSpec& b : plan) {
    if (!b.evicted) out.push_back({b.index, b.lineage_id, b.encoding});
  }
  return out;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (float& f : x) f = dist(rng);
  return x;
}

std::string Name(const Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

class TransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("triax_transfer_test_" + std::to_string(::getpid()));
    auto a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    src_alloc_ = *std::move(a);
    a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    dst_alloc_ = *std::move(a);
    TierStoreOptions to;
    to.host_capacity_bytes = 1 << 20;
    to.disk_dir = dir_.string();
    to.disk_capacity_bytes = 4 << 20;
    to.owner = "src";
    auto t = TierStore::Create(&device_, to);
    ASSERT_THAT(t.status(), IsOk());
    tiers_ = *std::move(t);
    StoreOptions so;
    so.window_tokens = 16;
    so.tiers = tiers_.get();
    so.prefetch_thread = false;
    src_ = std::make_unique<SequenceStore>(&device_, src_alloc_.get(), so);
    so.tiers = nullptr;
    dst_ = std::make_unique<SequenceStore>(&device_, dst_alloc_.get(), so);
  }
  void TearDown() override {
    src_.reset();
    dst_.reset();
    tiers_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Installs `seq` on `store` and writes `written` tokens on every layer.
  void Install(SequenceStore* store, const std::string& seq,
               const std::vector<BlockSpec>& plan, uint32_t written,
               uint32_t seed = 1) {
    ASSERT_THAT(
        store->AllocatePages(kTenant, seq, Model(), kBlock, plan).status(),
        IsOk());
    for (uint32_t l = 0; l < kLayers; ++l)
      Write(store, seq, l, 0, written, seed);
  }
  void Write(SequenceStore* store, const std::string& seq, uint32_t layer,
             uint32_t first, uint32_t n, uint32_t seed = 1) {
    const std::vector<float> k =
        Random((first + n) * kPerToken, seed + 2 * layer);
    const std::vector<float> v =
        Random((first + n) * kPerToken, seed + 2 * layer + 1);
    const std::string kb(
        reinterpret_cast<const char*>(k.data() + first * kPerToken),
        n * kPerToken * 4);
    const std::string vb(
        reinterpret_cast<const char*>(v.data() + first * kPerToken),
        n * kPerToken * 4);
    KvWrite w;
    w.layer = layer;
    w.first_token = first;
    w.num_tokens = n;
    w.dtype = static_cast<int>(KvDtype::kF32);
    w.k = kb;
    w.v = vb;
    ASSERT_THAT(store->Write(kTenant, seq, w).status(), IsOk());
  }

  absl::StatusOr<std::vector<TransferPage>> Export(
      const std::string& seq, const std::vector<ExportBlock>& blocks,
      ExportOptions options = {}) {
    std::vector<TransferPage> all;
    std::vector<uint32_t> layers;
    absl::Status s =
        src_->Export(kTenant, seq, blocks, options,
                     [&](uint32_t layer, std::vector<TransferPage>* pages) {
                       layers.push_back(layer);
                       for (TransferPage& p : *pages)
                         all.push_back(std::move(p));
                       return absl::OkStatus();
                     });
    if (!s.ok()) return s;
    // Layer by layer, in order.
    for (size_t i = 0; i < layers.size(); ++i) EXPECT_EQ(layers[i], i);
    return all;
  }

  ImportPlan DstPlan(const std::string& seq, std::vector<BlockSpec> blocks) {
    ImportPlan p;
    p.tenant_id = kTenant;
    p.sequence_id = seq;
    p.model = Model();
    p.block_tokens = kBlock;
    p.window_tokens = 16;
    p.blocks = std::move(blocks);
    p.source = "source worker-a at 127.0.0.1:1";
    return p;
  }

  absl::StatusOr<ImportResult> Import(const ImportPlan& plan,
                                      const std::vector<TransferPage>& pages) {
    auto session = dst_->BeginImport(plan);
    if (!session.ok()) return session.status();
    for (const TransferPage& p : pages) {
      if (absl::Status s = (*session)->Install(p); !s.ok()) return s;
    }
    return (*session)->Commit();
  }

  // Read of every layer, src `a` vs dst `b`, equal float for float.
  void ExpectSameReads(SequenceStore* sa, const std::string& a,
                       SequenceStore* sb, const std::string& b) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto ra = sa->Read(kTenant, a, l, 0, 0);
      auto rb = sb->Read(kTenant, b, l, 0, 0);
      ASSERT_THAT(ra.status(), IsOk());
      ASSERT_THAT(rb.status(), IsOk());
      ASSERT_EQ(ra->num_tokens, rb->num_tokens);
      EXPECT_EQ(0, std::memcmp(ra->k.data(), rb->k.data(), ra->k.size() * 4));
      EXPECT_EQ(0, std::memcmp(ra->v.data(), rb->v.data(), ra->v.size() * 4));
    }
  }
  void ExpectSameAttention(SequenceStore* sa, const std::string& a,
                           SequenceStore* sb, const std::string& b) {
    const std::vector<float> q = Random(size_t{2} * kQ * kDim, 77);
    const std::string qb(reinterpret_cast<const char*>(q.data()), q.size() * 4);
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto written = sa->Describe(a);
      ASSERT_THAT(written.status(), IsOk());
      const std::vector<uint64_t> pos = {20, written->written[l] - 1};
      AttendSpec spec;
      spec.layer = l;
      spec.num_queries = 2;
      spec.positions = pos;
      spec.queries = qb;
      auto oa = sa->Attend(kTenant, a, spec);
      auto ob = sb->Attend(kTenant, b, spec);
      ASSERT_THAT(oa.status(), IsOk());
      ASSERT_THAT(ob.status(), IsOk());
      ASSERT_EQ(oa->size(), ob->size());
      EXPECT_EQ(0, std::memcmp(oa->data(), ob->data(), oa->size() * 4));
    }
  }
  void ExpectSameTargetBytes(SequenceStore* sa, const std::string& a,
                             SequenceStore* sb, const std::string& b,
                             uint32_t blocks) {
    auto da = sa->Describe(a);
    ASSERT_THAT(da.status(), IsOk());
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t i = 0; i < std::min(blocks, da->sealed[l]); ++i) {
        auto pa = sa->TargetPage(a, i, l);
        auto pb = sb->TargetPage(b, i, l);
        ASSERT_THAT(pa.status(), IsOk());
        ASSERT_THAT(pb.status(), IsOk());
        ASSERT_EQ((*pa)->bytes, (*pb)->bytes);
        EXPECT_EQ(0, std::memcmp((*pa)->data, (*pb)->data, (*pa)->bytes))
            << "block " << i << " layer " << l;
      }
    }
  }

  RecordingDevice device_;
  fs::path dir_;
  std::unique_ptr<PageAllocator> src_alloc_, dst_alloc_;
  std::unique_ptr<TierStore> tiers_;
  std::unique_ptr<SequenceStore> src_, dst_;
};

// 71 tokens in blocks of 16: blocks 0..2 sealed, 3 and 4 (partial) in the
// window (window_tokens 16).
constexpr uint32_t kTokens = 71;

class EveryEncodingTransferTest
    : public TransferTest,
      public ::testing::WithParamInterface<Encoding> {};

TEST_P(EveryEncodingTransferTest, RoundTripIsByteExact) {
  const Encoding e = GetParam();
  SCOPED_TRACE(Name(e));
  const std::vector<BlockSpec> plan = Plan(kTokens, e);
  Install(src_.get(), "s", plan, kTokens);
  auto pages = Export("s", ExportList(plan));
  ASSERT_THAT(pages.status(), IsOk());
  ASSERT_EQ(pages->size(), plan.size() * kLayers);
  const bool bf16 = e.k == Format::kBF16 && e.v == Format::kBF16;
  for (const TransferPage& p : *pages) {
    EXPECT_EQ(p.crc32c, Crc32c(p.data.data(), p.data.size()));
    EXPECT_EQ(p.sealed, p.block_index < 3) << p.block_index;
    EXPECT_EQ(p.num_tokens, plan[p.block_index].num_tokens);
  }
  auto r = Import(DstPlan("d", plan), *pages);
  ASSERT_THAT(r.status(), IsOk());
  const kernels::PageShape shape = PageShapeOf(Model(), kBlock);
  const size_t page = kernels::PageBytes(e, shape);
  const size_t bf16_page = kernels::PageBytes(Format::kBF16, shape);
  EXPECT_EQ(r->pages, plan.size() * kLayers);
  EXPECT_EQ(r->wire_bytes, kLayers * (3 * page + 2 * bf16_page));
  EXPECT_EQ(r->bf16_bytes, kLayers * 5 * bf16_page);
  EXPECT_EQ(r->page_bytes, kLayers * (5 * page + (bf16 ? 0 : 2 * bf16_page)));
  ASSERT_EQ(r->layer_done_seconds.size(), kLayers);
  EXPECT_LE(r->layer_done_seconds[0], r->layer_done_seconds[1]);

  auto ds = dst_->Describe("d");
  auto ss = src_->Describe("s");
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_EQ(ds->written, ss->written);
  EXPECT_EQ(ds->sealed, ss->sealed);
  EXPECT_EQ(ds->window_pages, ss->window_pages);
  ExpectSameTargetBytes(src_.get(), "s", dst_.get(), "d", 5);
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
  ExpectSameAttention(src_.get(), "s", dst_.get(), "d");

  // The destination keeps going: its window seals into its own target
  // encoding exactly as the source's does.
  ASSERT_THAT(
      src_->AllocatePages(kTenant, "s", Model(), kBlock, Plan(kTokens + 40, e))
          .status(),
      IsOk());
  ASSERT_THAT(
      dst_->AllocatePages(kTenant, "d", Model(), kBlock, Plan(kTokens + 40, e))
          .status(),
      IsOk());
  for (uint32_t l = 0; l < kLayers; ++l) {
    Write(src_.get(), "s", l, kTokens, 40, 9);
    Write(dst_.get(), "d", l, kTokens, 40, 9);
  }
  ExpectSameTargetBytes(src_.get(), "s", dst_.get(), "d", 8);
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
}

INSTANTIATE_TEST_SUITE_P(
    Encodings, EveryEncodingTransferTest,
    ::testing::Values(
        Encoding(Format::kBF16), Encoding(Format::kFP8),
        Encoding(Format::kINT8), Encoding(Format::kINT4),
        Encoding(Format::kINT2), Encoding(Format::kTQ4), Encoding(Format::kTQ3),
        Encoding(Format::kTQ2), Encoding(Format::kINT8, Format::kINT4),
        Encoding(Format::kBF16, Format::kINT2),
        Encoding(Format::kTQ3, Format::kINT4),
        Encoding(Format::kINT4, Format::kINT4, 64),
        Encoding(Format::kINT4, Format::kINT2, 128),
        Encoding(Format::kINT4, Format::kINT4, 32, ScaleDtype::kFP8),
        Encoding(Format::kINT2, Format::kINT8, 64, ScaleDtype::kFP8)));

// Encoding on the way: the destination holds what a Demote on the source
// would have stored, byte for byte.
TEST_F(TransferTest, ReencodeOnTheWayEqualsDemote) {
  struct Case {
    Encoding from, to;
  };
  const Case cases[] = {
      {Encoding(Format::kBF16), Encoding(Format::kINT4)},
      {Encoding(Format::kINT8), Encoding(Format::kTQ3)},
      {Encoding(Format::kBF16), Encoding(Format::kINT8, Format::kINT4)},
      {Encoding(Format::kFP8), Encoding(Format::kINT2, Format::kINT4, 64)},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(Name(c.from) + " -> " + Name(c.to));
    const std::string s = "s" + std::to_string(n), d = "d" + std::to_string(n),
                      ref = "ref" + std::to_string(n);
    ++n;
    Install(src_.get(), s, Plan(kTokens, c.from), kTokens, n);
    Install(src_.get(), ref, Plan(kTokens, c.from), kTokens, n);
    const std::vector<BlockSpec> to = Plan(kTokens, c.to);
    std::vector<BlockSpec> demote = to;
    ASSERT_THAT(src_->Demote(kTenant, ref, demote).status(), IsOk());
    auto pages = Export(s, ExportList(to));
    ASSERT_THAT(pages.status(), IsOk());
    ASSERT_THAT(Import(DstPlan(d, to), *pages).status(), IsOk());
    ExpectSameTargetBytes(src_.get(), ref, dst_.get(), d, 5);
    ExpectSameReads(src_.get(), ref, dst_.get(), d);
    ExpectSameAttention(src_.get(), ref, dst_.get(), d);
  }
}

TEST_F(TransferTest, SpilledBlocksAreReadFromTheirTier) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT8));
  Install(src_.get(), "s", plan, kTokens);
  Install(src_.get(), "ref", plan, kTokens);
  const uint64_t host[] = {100}, disk[] = {101};
  ASSERT_THAT(src_->Spill(kTenant, "s", host, Tier::kHost).status(), IsOk());
  ASSERT_THAT(src_->Spill(kTenant, "s", disk, Tier::kDisk).status(), IsOk());
  // Same encoding, then INT4 on the way (Demote of the resident copy).
  auto pages = Export("s", ExportList(plan));
  ASSERT_THAT(pages.status(), IsOk());
  ASSERT_THAT(Import(DstPlan("d", plan), *pages).status(), IsOk());
  ExpectSameReads(src_.get(), "ref", dst_.get(), "d");
  const std::vector<BlockSpec> to = Plan(kTokens, Encoding(Format::kINT4));
  pages = Export("s", ExportList(to));
  ASSERT_THAT(pages.status(), IsOk());
  ASSERT_THAT(Import(DstPlan("d4", to), *pages).status(), IsOk());
  ASSERT_THAT(src_->Demote(kTenant, "ref", to).status(), IsOk());
  ExpectSameTargetBytes(src_.get(), "ref", dst_.get(), "d4", 5);
  // The source still has them spilled (export only reads).
  auto ss = src_->Describe("s");
  ASSERT_THAT(ss.status(), IsOk());
  EXPECT_EQ(ss->blocks[0].tier, Tier::kHost);
  EXPECT_EQ(ss->blocks[1].tier, Tier::kDisk);

  // A corrupted spilled page: DATA_LOSS from the export.
  auto spilled = src_->SpilledPages("s", 0);
  ASSERT_THAT(spilled.status(), IsOk());
  HostPageView view = tiers_->HostPageBytes(spilled->pages[1]);
  ASSERT_FALSE(view.empty());
  view[3] ^= 0x10;
  EXPECT_THAT(Export("s", ExportList(plan)).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("lineage")));
}

TEST_F(TransferTest, EvictedBlocksMoveNoBytes) {
  std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens);
  const uint64_t evict[] = {100};
  ASSERT_THAT(src_->Evict(kTenant, "s", evict).status(), IsOk());
  // Naming the evicted block is refused.
  EXPECT_THAT(
      Export("s", ExportList(plan)).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is evicted")));
  plan[0].evicted = true;
  auto pages = Export("s", ExportList(plan));
  ASSERT_THAT(pages.status(), IsOk());
  EXPECT_EQ(pages->size(), 4u * kLayers);
  ASSERT_THAT(Import(DstPlan("d", plan), *pages).status(), IsOk());
  auto ds = dst_->Describe("d");
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_TRUE(ds->blocks[0].evicted);
  EXPECT_THAT(dst_->Read(kTenant, "d", 0, 0, 0).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto ra = src_->Read(kTenant, "s", l, 16, 0);
    auto rb = dst_->Read(kTenant, "d", l, 16, 0);
    ASSERT_THAT(ra.status(), IsOk());
    ASSERT_THAT(rb.status(), IsOk());
    EXPECT_EQ(ra->k, rb->k);
    EXPECT_EQ(ra->v, rb->v);
  }
  ExpectSameAttention(src_.get(), "s", dst_.get(), "d");
}

TEST_F(TransferTest, ExportRefusals) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, 40);
  EXPECT_THAT(Export("nope", ExportList(plan)).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(
      Export("s", {}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks")));
  std::vector<ExportBlock> bad = ExportList(plan);
  bad[1].index = 9;
  EXPECT_THAT(Export("s", bad).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("index=9")));
  bad = ExportList(plan);
  bad[1].lineage_id = 7;
  EXPECT_THAT(Export("s", bad).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("lineage_id=7")));
  bad = ExportList(plan);
  bad[1].encoding.k = static_cast<Format>(42);
  EXPECT_THAT(Export("s", bad).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[1].format")));
  // Written only up to token 40: the blocks end at 71.
  EXPECT_THAT(Export("s", ExportList(plan)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("layer 0 has 40 written tokens")));
  EXPECT_THAT(src_->Export("other", "s", ExportList(plan), {},
                           [](uint32_t, std::vector<TransferPage>*) {
                             return absl::OkStatus();
                           }),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
}

TEST_F(TransferTest, FollowWritesWaitsForEachLayer) {
  const std::vector<BlockSpec> plan = Plan(40, Encoding(Format::kINT4));
  ASSERT_THAT(src_->AllocatePages(kTenant, "s", Model(), kBlock, plan).status(),
              IsOk());
  std::vector<uint32_t> layers_seen;
  std::vector<TransferPage> pages;
  absl::Mutex mu;
  absl::Status result;
  absl::Notification done;
  std::thread exporter([&] {
    ExportOptions o;
    o.follow_writes = true;
    o.deadline = absl::Now() + absl::Seconds(30);
    result = src_->Export(kTenant, "s", ExportList(plan), o,
                          [&](uint32_t l, std::vector<TransferPage>* p) {
                            absl::MutexLock lock(&mu);
                            layers_seen.push_back(l);
                            for (auto& x : *p) pages.push_back(std::move(x));
                            return absl::OkStatus();
                          });
    done.Notify();
  });
  // Layer 0 written in two chunks: layer 0 is sent, layer 1 is not.
  Write(src_.get(), "s", 0, 0, 20);
  Write(src_.get(), "s", 0, 20, 20);
  {
    absl::MutexLock lock(&mu);
    auto one = [&] { return !layers_seen.empty(); };
    mu.Await(absl::Condition(&one));
    EXPECT_EQ(layers_seen, std::vector<uint32_t>{0});
  }
  EXPECT_FALSE(done.HasBeenNotified());
  Write(src_.get(), "s", 1, 0, 40);
  done.WaitForNotification();
  exporter.join();
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(layers_seen, (std::vector<uint32_t>{0, 1}));
  ASSERT_THAT(Import(DstPlan("d", plan), pages).status(), IsOk());
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
}

TEST_F(TransferTest, FollowWritesEndsAtTheDeadlineOrOnCancel) {
  const std::vector<BlockSpec> plan = Plan(40, Encoding(Format::kINT4));
  ASSERT_THAT(src_->AllocatePages(kTenant, "s", Model(), kBlock, plan).status(),
              IsOk());
  Write(src_.get(), "s", 0, 0, 40);
  ExportOptions o;
  o.follow_writes = true;
  o.deadline = absl::Now() + absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  int sent = 0;
  auto sink = [&](uint32_t, std::vector<TransferPage>*) {
    ++sent;
    return absl::OkStatus();
  };
  EXPECT_THAT(src_->Export(kTenant, "s", ExportList(plan), o, sink),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("layer 1 to be written up to token 40")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(sent, 1);
  std::atomic<bool> cancel{false};
  o.deadline = absl::InfiniteFuture();
  o.cancelled = [&] { return cancel.load(); };
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    cancel = true;
  });
  EXPECT_THAT(src_->Export(kTenant, "s", ExportList(plan), o, sink),
              StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  canceller.join();
  // Free wakes a waiting export: NOT_FOUND.
  o.cancelled = nullptr;
  std::thread freer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_THAT(src_->Free(kTenant, "s").status(), IsOk());
  });
  EXPECT_THAT(src_->Export(kTenant, "s", ExportList(plan), o, sink),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  freer.join();
}

TEST_F(TransferTest, BadPayloadsAreRefusedAndNothingLeaks) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens);
  auto pages = Export("s", ExportList(plan));
  ASSERT_THAT(pages.status(), IsOk());
  const AllocatorStats before = dst_alloc_->Stats();

  struct Case {
    std::string name;
    std::function<void(TransferPage*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"size", [](TransferPage* p) { p->data.pop_back(); },
       absl::StatusCode::kInvalidArgument, "bytes"},
      {"encoding",
       [](TransferPage* p) { p->encoding = Encoding(Format::kINT8); },
       absl::StatusCode::kInvalidArgument, "format (encoding int8"},
      {"crc", [](TransferPage* p) { p->data[5] ^= 1; },
       absl::StatusCode::kDataLoss, "CRC32C"},
      {"lineage", [](TransferPage* p) { p->lineage_id = 5; },
       absl::StatusCode::kInvalidArgument, "lineage_id=5"},
      {"layer", [](TransferPage* p) { p->layer = 7; },
       absl::StatusCode::kInvalidArgument, "layer=7"},
      {"block", [](TransferPage* p) { p->block_index = 70; },
       absl::StatusCode::kInvalidArgument, "block_index=70"},
      {"tokens", [](TransferPage* p) { p->num_tokens = 3; },
       absl::StatusCode::kInvalidArgument, "num_tokens=3"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<TransferPage> bad = *pages;
    c.mutate(&bad[3]);
    auto r = Import(DstPlan("d", plan), bad);
    EXPECT_THAT(r.status(), StatusIs(c.code, HasSubstr(c.message)));
    EXPECT_THAT(r.status().message(), HasSubstr("sequence_id=\"d\""));
    EXPECT_THAT(r.status().message(), HasSubstr("source worker-a"));
    EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::IsEmpty());
    EXPECT_EQ(dst_alloc_->Stats().used_bytes, before.used_bytes);
  }
  // The CRC message names the sequence, block, lineage and layer.
  {
    std::vector<TransferPage> bad = *pages;
    bad[7].data[0] ^= 0x80;  // block 2 layer 1 (5 blocks per layer)
    EXPECT_THAT(Import(DstPlan("d", plan), bad).status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         HasSubstr("block 2 (lineage_id=102) layer 1")));
  }
  // A page twice.
  {
    std::vector<TransferPage> bad = *pages;
    bad.push_back(bad[2]);
    EXPECT_THAT(Import(DstPlan("d", plan), bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("duplicate page")));
  }
  // A page missing: the commit refuses it.
  {
    std::vector<TransferPage> bad = *pages;
    bad.erase(bad.begin() + 6);
    EXPECT_THAT(Import(DstPlan("d", plan), bad).status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         HasSubstr("block 1 (lineage_id=101) layer 1 never "
                                   "arrived")));
  }
  // A page for an evicted block of the plan.
  {
    std::vector<BlockSpec> evicted = plan;
    evicted[0].evicted = true;
    EXPECT_THAT(Import(DstPlan("d", evicted), *pages).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("evicted in the plan")));
  }
  EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::IsEmpty());
  const AllocatorStats after = dst_alloc_->Stats();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.free_bytes, before.free_bytes);
  EXPECT_EQ(after.free_frames, before.free_frames);
  // And the good pages still import.
  ASSERT_THAT(Import(DstPlan("d", plan), *pages).status(), IsOk());
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
}

TEST_F(TransferTest, ImportIsInvisibleUntilCommitAndIdsAreExclusive) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens);
  auto pages = Export("s", ExportList(plan));
  ASSERT_THAT(pages.status(), IsOk());
  auto session = dst_->BeginImport(DstPlan("d", plan));
  ASSERT_THAT(session.status(), IsOk());
  EXPECT_THAT(
      dst_->BeginImport(DstPlan("d", plan)).status(),
      StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already running")));
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_THAT((*session)->Install((*pages)[i]), IsOk());
  }
  EXPECT_THAT(dst_->Read(kTenant, "d", 0, 0, 0).status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::IsEmpty());
  for (size_t i = 4; i < pages->size(); ++i) {
    ASSERT_THAT((*session)->Install((*pages)[i]), IsOk());
  }
  ASSERT_THAT((*session)->Commit().status(), IsOk());
  EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::ElementsAre("d"));
  session->reset();  // a committed session leaves the sequence alone
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
  EXPECT_THAT(dst_->BeginImport(DstPlan("d", plan)).status(),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("already on this worker")));
  // Plan errors name the field.
  std::vector<BlockSpec> bad = plan;
  bad[2].first_token = 5;
  EXPECT_THAT(dst_->BeginImport(DstPlan("e", bad)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[2].first_token=5")));
  ImportPlan p = DstPlan("e", plan);
  p.model.head_dim = 0;
  EXPECT_THAT(
      dst_->BeginImport(p).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  p = DstPlan("bad id!", plan);
  EXPECT_THAT(
      dst_->BeginImport(p).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence_id")));
  // No room: RESOURCE_EXHAUSTED and nothing kept.
  auto small = PageAllocator::Create(&device_, 64 << 10, 16 << 10);
  ASSERT_THAT(small.status(), IsOk());
  SequenceStore tiny(&device_, small->get(), StoreOptions{16});
  ImportPlan big = DstPlan("big", Plan(16 * 64, Encoding(Format::kBF16)));
  EXPECT_THAT(tiny.BeginImport(big).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_EQ((*small)->Stats().used_bytes, 0u);
}

// ---------------------------------------------------------------------------
// The ipc path: a shared export (pages pinned, named by arena offset) and
// ImportSession::InstallShared, with the source's arena as the peer's.

class SharedTransferTest : public TransferTest {
 protected:
  // A shared export of `blocks` of `seq` into `pins`.
  absl::StatusOr<std::vector<TransferPage>> ExportShared(
      const std::string& seq, const std::vector<ExportBlock>& blocks,
      PagePins* pins) {
    ExportOptions options;
    options.pins = pins;
    return Export(seq, blocks, options);
  }
  absl::StatusOr<ImportResult> ImportShared(
      const ImportPlan& plan, const std::vector<TransferPage>& pages) {
    auto session = dst_->BeginImport(plan);
    if (!session.ok()) return session.status();
    if (absl::Status s = (*session)->InstallShared(
            pages, src_alloc_->arena_base(), src_alloc_->arena_bytes());
        !s.ok()) {
      return s;
    }
    return (*session)->Commit();
  }
};

// Every page is pinned and named by its offset with the CRC32C of its
// bytes; the destination ends with the bytes a stream import gives, stored,
// re-encoded on the way or read from a tier.
TEST_F(SharedTransferTest, InstallsTheBytesTheStreamInstalls) {
  struct Case {
    Encoding from, to;
    bool spill;
  };
  const Case cases[] = {
      {Encoding(Format::kBF16), Encoding(Format::kBF16), false},
      {Encoding(Format::kINT4), Encoding(Format::kINT4), false},
      {Encoding(Format::kTQ3), Encoding(Format::kTQ3), false},
      {Encoding(Format::kINT8, Format::kINT4),
       Encoding(Format::kINT8, Format::kINT4), false},
      {Encoding(Format::kBF16), Encoding(Format::kINT4), false},
      {Encoding(Format::kINT8), Encoding(Format::kINT8), true},
      {Encoding(Format::kINT8), Encoding(Format::kINT2), true},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(Name(c.from) + " -> " + Name(c.to) +
                 (c.spill ? " spilled" : ""));
    const std::string s = "s" + std::to_string(n);
    const std::string viastream = "t" + std::to_string(n);
    const std::string viaipc = "i" + std::to_string(n);
    ++n;
    Install(src_.get(), s, Plan(kTokens, c.from), kTokens, n);
    if (c.spill) {
      const uint64_t host[] = {100}, disk[] = {101};
      ASSERT_THAT(src_->Spill(kTenant, s, host, Tier::kHost).status(), IsOk());
      ASSERT_THAT(src_->Spill(kTenant, s, disk, Tier::kDisk).status(), IsOk());
    }
    const std::vector<BlockSpec> to = Plan(kTokens, c.to);
    auto streamed = Export(s, ExportList(to));
    ASSERT_THAT(streamed.status(), IsOk());
    ASSERT_THAT(Import(DstPlan(viastream, to), *streamed).status(), IsOk());
    const uint64_t used_before = src_alloc_->Stats().used_bytes;
    {
      PagePins pins(src_alloc_.get());
      auto shared = ExportShared(s, ExportList(to), &pins);
      ASSERT_THAT(shared.status(), IsOk());
      ASSERT_EQ(shared->size(), streamed->size());
      EXPECT_EQ(pins.size(), shared->size());
      EXPECT_EQ(pins.held(), shared->size());
      for (size_t i = 0; i < shared->size(); ++i) {
        const TransferPage& p = (*shared)[i];
        EXPECT_TRUE(p.shared);
        EXPECT_TRUE(p.data.empty());
        ASSERT_EQ(p.shared_bytes, (*streamed)[i].data.size());
        ASSERT_LE(p.arena_offset + p.shared_bytes, src_alloc_->arena_bytes());
        const uint8_t* bytes = src_alloc_->arena_base() + p.arena_offset;
        EXPECT_EQ(
            0, std::memcmp(bytes, (*streamed)[i].data.data(), p.shared_bytes))
            << "page " << i;
        EXPECT_EQ(p.crc32c, (*streamed)[i].crc32c);
      }
      auto r = ImportShared(DstPlan(viaipc, to), *shared);
      ASSERT_THAT(r.status(), IsOk());
      EXPECT_EQ(r->pages, shared->size());
      ExpectSameTargetBytes(dst_.get(), viastream, dst_.get(), viaipc, 5);
      ExpectSameReads(dst_.get(), viastream, dst_.get(), viaipc);
    }
    // The pins are gone with their set: scratch pages are back in the pool.
    EXPECT_EQ(src_alloc_->Stats().used_bytes, used_before);
  }
}

// On a device whose processes time-slice, a shared export of stored pages
// takes its checksums in one pass per group of layers (the whole sequence
// here) before the group goes out; one that re-encodes (scratch pages)
// goes layer by layer. Both name the same pages with the same CRC32Cs.
TEST_F(SharedTransferTest, TimeSlicedDeviceChecksumsStoredPagesInOnePass) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens, 5);
  PagePins layered_pins(src_alloc_.get());
  device_.ClearChecksums();
  auto layered = ExportShared("s", ExportList(plan), &layered_pins);
  ASSERT_THAT(layered.status(), IsOk());
  EXPECT_EQ(device_.checksums().size(), kLayers);

  device_.set_time_slices_processes(true);
  device_.ClearChecksums();
  PagePins pins(src_alloc_.get());
  std::vector<uint32_t> layers_seen;
  ExportOptions options;
  options.pins = &pins;
  std::vector<TransferPage> at_once;
  ASSERT_THAT(src_->Export(kTenant, "s", ExportList(plan), options,
                           [&](uint32_t layer, std::vector<TransferPage>* p) {
                             layers_seen.push_back(layer);
                             // Every page is pinned before the first layer.
                             EXPECT_EQ(pins.size(), plan.size() * kLayers);
                             at_once.insert(at_once.end(), p->begin(),
                                            p->end());
                             return absl::OkStatus();
                           }),
              IsOk());
  EXPECT_EQ(device_.checksums(), std::vector<size_t>{plan.size() * kLayers});
  EXPECT_EQ(layers_seen, (std::vector<uint32_t>{0, 1}));
  ASSERT_EQ(at_once.size(), layered->size());
  for (size_t i = 0; i < at_once.size(); ++i) {
    EXPECT_EQ(at_once[i].arena_offset, (*layered)[i].arena_offset);
    EXPECT_EQ(at_once[i].crc32c, (*layered)[i].crc32c) << i;
  }
  ASSERT_THAT(ImportShared(DstPlan("d", plan), at_once).status(), IsOk());
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");

  // Groups of layers: one byte per group makes each layer its own group,
  // checksummed and pinned only when its turn comes.
  {
    auto alloc = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(alloc.status(), IsOk());
    StoreOptions so;
    so.window_tokens = 16;
    so.prefetch_thread = false;
    so.shared_checksum_group_bytes = 1;
    SequenceStore grouped(&device_, alloc->get(), so);
    Install(&grouped, "g", plan, kTokens, 5);
    device_.ClearChecksums();
    PagePins group_pins(alloc->get());
    ExportOptions go;
    go.pins = &group_pins;
    std::vector<size_t> pinned_at_sink;
    ASSERT_THAT(grouped.Export(kTenant, "g", ExportList(plan), go,
                               [&](uint32_t, std::vector<TransferPage>* p) {
                                 pinned_at_sink.push_back(group_pins.size());
                                 for (const TransferPage& page : *p) {
                                   EXPECT_EQ(page.crc32c,
                                             Crc32c(alloc->get()->arena_base() +
                                                        page.arena_offset,
                                                    page.shared_bytes));
                                 }
                                 return absl::OkStatus();
                               }),
                IsOk());
    EXPECT_EQ(device_.checksums(),
              (std::vector<size_t>{plan.size(), plan.size()}));
    EXPECT_EQ(pinned_at_sink,
              (std::vector<size_t>{plan.size(), 2 * plan.size()}));
  }

  // Re-encoded on the way: layer by layer even here.
  device_.ClearChecksums();
  PagePins int2_pins(src_alloc_.get());
  const std::vector<BlockSpec> int2 = Plan(kTokens, Encoding(Format::kINT2));
  ASSERT_THAT(ExportShared("s", ExportList(int2), &int2_pins).status(), IsOk());
  EXPECT_EQ(device_.checksums().size(), kLayers);
  device_.set_time_slices_processes(false);
}

// A pinned page keeps its bytes where the peer reads them while the source
// frees the sequence and compacts its arena.
TEST_F(SharedTransferTest, PinnedPagesOutliveAFreeAndACompaction) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens, 3);
  Install(src_.get(), "ref", plan, kTokens, 3);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  ASSERT_THAT(src_->Free(kTenant, "s").status(), IsOk());
  ASSERT_THAT(src_->Compact().status(), IsOk());
  // The pages still hold what was exported (their CRC32Cs match).
  for (const TransferPage& p : *shared) {
    EXPECT_EQ(p.crc32c, Crc32c(src_alloc_->arena_base() + p.arena_offset,
                               p.shared_bytes));
  }
  ASSERT_THAT(ImportShared(DstPlan("d", plan), *shared).status(), IsOk());
  ExpectSameReads(src_.get(), "ref", dst_.get(), "d");
  ExpectSameAttention(src_.get(), "ref", dst_.get(), "d");
  // Released halfway, then all: the freed sequence's pages go back.
  const uint64_t ref_only = src_alloc_->Stats().used_bytes;
  pins.ReleaseFirst(pins.size() / 2);
  EXPECT_EQ(pins.held(), pins.size() - pins.size() / 2);
  EXPECT_LT(src_alloc_->Stats().used_bytes, ref_only);
  pins.ReleaseFirst(pins.size());
  EXPECT_EQ(pins.held(), 0u);
  ASSERT_THAT(src_->Free(kTenant, "ref").status(), IsOk());
  EXPECT_EQ(src_alloc_->Stats().used_bytes, 0u);
}

// A hostile or broken source: offsets outside its arena, a page with bytes,
// a page twice in one batch, a CRC32C that does not match the bytes. Each
// is refused, nothing of the batch counts, and an aborted session leaves
// the destination empty.
TEST_F(SharedTransferTest, InstallSharedRefusesBadPages) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  struct Case {
    std::function<void(std::vector<TransferPage>*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  const uint64_t arena = src_alloc_->arena_bytes();
  const std::vector<Case> cases = {
      {[&](auto* p) { (*p)[1].arena_offset = arena - 8; },
       absl::StatusCode::kInvalidArgument, "outside the source's arena"},
      {[&](auto* p) { (*p)[0].shared_bytes = ~uint64_t{0}; },
       absl::StatusCode::kInvalidArgument, "outside the source's arena"},
      {[](auto* p) { (*p)[2].shared = false; },
       absl::StatusCode::kInvalidArgument, "a page with bytes"},
      {[](auto* p) { (*p)[3] = (*p)[2]; }, absl::StatusCode::kInvalidArgument,
       "twice in one batch"},
      {[](auto* p) { (*p)[4].shared_bytes -= 16; },
       absl::StatusCode::kInvalidArgument, "data has"},
      {[](auto* p) { (*p)[5].crc32c ^= 1; }, absl::StatusCode::kDataLoss,
       "CRC32C of the copied page"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    std::vector<TransferPage> bad = *shared;
    c.mutate(&bad);
    EXPECT_THAT(ImportShared(DstPlan("d", plan), bad).status(),
                StatusIs(c.code, HasSubstr(c.message)));
    EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
    EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::IsEmpty());
  }
  // Stream pages are refused by the stream's Install the other way round.
  auto session = dst_->BeginImport(DstPlan("d", plan));
  ASSERT_THAT(session.status(), IsOk());
  EXPECT_THAT(
      (*session)->Install((*shared)[0]),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared page")));
}

}  // namespace
}  // namespace triax::worker
