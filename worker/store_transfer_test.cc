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
#include <optional>
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
#include "worker/store_transfer_test_fixture.h"
#include "worker/tier_store.h"

namespace triax::worker::transfer_testing {
namespace {

using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

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

}  // namespace
}  // namespace triax::worker::transfer_testing
