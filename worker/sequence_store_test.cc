// SequenceStore: installing and extending plans, writes, the BF16 window and
// sealing, reads, Free, the per-sequence preamble (ids, owner, liveness)
// and sequences running in parallel. Attention, Fork and Demote have their
// own test files (store_attend_test.cc, store_fork_test.cc,
// store_demote_test.cc); spill tiers are in spill_store_test.cc.
#include "worker/sequence_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "worker/store_test_util.h"

namespace triax::worker {
namespace {

using kernels::Format;
using store_testing::Bytes;
using store_testing::Chunk;
using store_testing::ExpectFiniteNonZero;
using store_testing::kBf16;
using store_testing::kInt2;
using store_testing::kInt4;
using store_testing::kTenant;
using store_testing::LayerKv;
using store_testing::Plan;
using store_testing::RefAttention;
using store_testing::RelError;
using store_testing::Shape;
using store_testing::StoreTest;
using store_testing::UniformPlan;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

TEST_F(StoreTest, Bf16WriteReadRoundTripIsExact) {
  Make(32);
  const ModelShape m = Shape(2, 2, 4, 16);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(54, 16, kBf16))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 54, 7);
  WriteAll("s", m, kv, 54, 7);
  for (uint32_t l = 0; l < 2; ++l) {
    auto r = store_->Read(kTenant, "s", l, 0, 0);
    ASSERT_THAT(r.status(), IsOk());
    EXPECT_EQ(r->num_tokens, 54u);
    EXPECT_EQ(r->k, kv[l].kr);
    EXPECT_EQ(r->v, kv[l].vr);
    auto part = store_->Read(kTenant, "s", l, 13, 20);
    ASSERT_THAT(part.status(), IsOk());
    EXPECT_EQ(part->first_token, 13u);
    EXPECT_EQ(std::vector<float>(part->k.begin(), part->k.end()),
              std::vector<float>(kv[l].kr.begin() + ptrdiff_t{13} * 32,
                                 kv[l].kr.begin() + ptrdiff_t{33} * 32));
  }
  auto d = store_->Describe("s");
  ASSERT_THAT(d.status(), IsOk());
  EXPECT_THAT(d->written, ElementsAre(54u, 54u));
  EXPECT_THAT(d->window_pages, ElementsAre(0u, 0u));  // BF16 needs no window
}

TEST_F(StoreTest, SealingFollowsTheWindow) {
  const ModelShape m = Shape(1, 1, 1, 32);
  for (uint32_t window : {32u, 0u}) {
    SCOPED_TRACE(window);
    Make(window);
    ASSERT_THAT(
        store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(70, 16, kInt4))
            .status(),
        IsOk());
    auto kv = RandomLayers(m, 70, 3);
    WriteAll("s", m, kv, 40, 5);
    auto d = store_->Describe("s");
    // 40 written: window 32 seals blocks ending <= 8 (none); window 0 seals
    // the full blocks 0 and 1.
    EXPECT_THAT(d->sealed, ElementsAre(window == 32 ? 0u : 2u));
    WriteAll("s", m, kv, 70, 5, 40);
    d = store_->Describe("s");
    // 70 written: window 32 seals blocks ending <= 38 (0, 1); window 0 seals
    // every block, the 6-token last one included (it is full).
    EXPECT_THAT(d->sealed, ElementsAre(window == 32 ? 2u : 5u));
    EXPECT_THAT(d->window_pages, ElementsAre(window == 32 ? 3u : 0u));
    const InventorySnapshot inv = store_->Inventory();
    const size_t bf16_page = kernels::PageBytes(Format::kBF16, {16, 1, 32});
    EXPECT_EQ(inv.window_bytes, (window == 32 ? 3 : 0) * bf16_page);
    EXPECT_EQ(inv.formats.at(Format::kINT4).pages, 5u);
  }
}

// The manager's EVENT_BLOCK_SEALED: a block is reported once, when the
// last of its layers seals, with the time of that seal.
TEST_F(StoreTest, ABlockIsReportedSealedWhenItsLastLayerSeals) {
  const ModelShape m = Shape(2, 1, 1, 32);
  Make(0);
  const std::vector<BlockSpec> plan = UniformPlan(40, 16, kInt4);
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", m, 16, plan).status(),
              IsOk());
  auto kv = RandomLayers(m, 40, 3);
  const size_t per = size_t{m.n_kv_heads} * m.head_dim;
  std::string kb, vb;
  ASSERT_THAT(store_->Write(kTenant, "s", Chunk(0, 0, 40, kv[0], per, &kb, &vb))
                  .status(),
              IsOk());
  EXPECT_TRUE(store_->TakeSealed().empty());  // layer 1 is not written
  const int64_t before = absl::ToUnixMillis(absl::Now());
  ASSERT_THAT(store_->Write(kTenant, "s", Chunk(1, 0, 20, kv[1], per, &kb, &vb))
                  .status(),
              IsOk());
  // Layer 1 seals block 0 (full), not block 1 (4 of 16 tokens).
  std::vector<std::pair<uint64_t, int64_t>> sealed = store_->TakeSealed();
  ASSERT_EQ(sealed.size(), 1u);
  EXPECT_EQ(sealed[0].first, plan[0].lineage_id);
  EXPECT_GE(sealed[0].second, before);
  EXPECT_LE(sealed[0].second, absl::ToUnixMillis(absl::Now()));
  EXPECT_TRUE(store_->TakeSealed().empty());  // taken once
  ASSERT_THAT(
      store_->Write(kTenant, "s", Chunk(1, 20, 20, kv[1], per, &kb, &vb))
          .status(),
      IsOk());
  sealed = store_->TakeSealed();
  ASSERT_EQ(sealed.size(), 2u);  // block 1, and the 8-token last block
  EXPECT_EQ(sealed[0].first, plan[1].lineage_id);
  EXPECT_EQ(sealed[1].first, plan[2].lineage_id);
  // A heartbeat that failed gives them back.
  store_->ReturnSealed(sealed);
  EXPECT_EQ(store_->TakeSealed(), sealed);
  EXPECT_EQ(store_->SealReportsDropped(), 0u);
}

TEST_F(StoreTest, WindowKeepsRecentTokensInBf16) {
  // With a window larger than the sequence nothing is sealed, so even an
  // INT2 plan attends at BF16 precision.
  Make(1000);
  const ModelShape m = Shape(1, 1, 2, 32);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(40, 16, kInt2))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 40, 4);
  WriteAll("s", m, kv, 40, 3);
  EXPECT_THAT(store_->Describe("s")->sealed, ElementsAre(0u));
  auto q = RandomQueries(m, 1, 2);
  auto out = Attend("s", 0, q, 1, {});
  ASSERT_THAT(out.status(), IsOk());
  auto want = RefAttention(m, q, kv[0].kr, kv[0].vr, 40, 1.0 / std::sqrt(32.0));
  EXPECT_LT(RelError(*out, want), 1e-5);
}

TEST_F(StoreTest, OddSpansAndChunksReadBackWithinFormatTolerance) {
  Make(8);
  const ModelShape m = Shape(1, 3, 3, 32);
  const auto plan =
      Plan({{5, kInt4}, {16, kBf16}, {3, kInt2}, {16, kInt4}, {11, kBf16}});
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", m, 16, plan).status(),
              IsOk());
  auto kv = RandomLayers(m, 51, 77);
  WriteAll("s", m, kv, 51, 7);
  auto d = store_->Describe("s");
  EXPECT_THAT(d->sealed, ElementsAre(4u));  // blocks ending <= 43
  auto r = store_->Read(kTenant, "s", 0, 0, 0);
  ASSERT_THAT(r.status(), IsOk());
  const size_t per = size_t{3} * 32;
  for (const BlockSpec& b : plan) {
    const bool sealed_quant = b.index < 4 && b.encoding.k != kBf16;
    double max_err = 0;
    for (size_t i = b.first_token * per;
         i < (b.first_token + b.num_tokens) * per; ++i) {
      max_err = std::max(max_err, double(std::abs(r->k[i] - kv[0].kr[i])));
      max_err = std::max(max_err, double(std::abs(r->v[i] - kv[0].vr[i])));
    }
    if (!sealed_quant) {
      EXPECT_EQ(max_err, 0.0) << "block " << b.index;
    } else {
      // Half a quantization step of a ~[-4, 4] range, plus fp16 metadata.
      const double step = 8.0 / ((b.encoding.k == kInt4 ? 15 : 3));
      EXPECT_LT(max_err, 0.5 * step + 0.05) << "block " << b.index;
      EXPECT_GT(max_err, 0.0) << "block " << b.index;
    }
  }
  auto q = RandomQueries(m, 3, 1);
  auto out = Attend("s", 0, q, 3, {4, 23, 50});
  ASSERT_THAT(out.status(), IsOk());
  ExpectFiniteNonZero(*out);
}

TEST_F(StoreTest, GrowingTheLastBlockUnsealsAndExtends) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  auto plan = Plan({{10, kInt4}});
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", m, 16, plan).status(),
              IsOk());
  auto kv = RandomLayers(m, 40, 5);
  WriteAll("s", m, kv, 10, 10);
  EXPECT_THAT(store_->Describe("s")->sealed, ElementsAre(1u));
  std::string kb, vb;
  EXPECT_THAT(store_->Write(kTenant, "s", Chunk(0, 10, 1, kv[0], 16, &kb, &vb))
                  .status(),
              StatusIs(absl::StatusCode::kOutOfRange,
                       AllOf(HasSubstr("first_token=10"),
                             HasSubstr("planned total of 10"))));
  // continue_last_span: block 0 grows to 16, and a block 1 is added.
  plan = Plan({{16, kInt4}, {8, kBf16}});
  auto grown = store_->AllocatePages(kTenant, "s", m, 16, plan);
  ASSERT_THAT(grown.status(), IsOk());
  EXPECT_EQ(grown->pages_allocated, 1u);
  auto d = store_->Describe("s");
  EXPECT_THAT(d->sealed, ElementsAre(0u));
  EXPECT_THAT(d->window_pages, ElementsAre(1u));
  EXPECT_EQ(d->planned_tokens, 24u);
  WriteAll("s", m, kv, 24, 4, 10);
  EXPECT_THAT(store_->Describe("s")->sealed, ElementsAre(2u));
  // Same plan again: nothing new.
  auto again = store_->AllocatePages(kTenant, "s", m, 16, plan);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(again->pages_allocated, 0u);
  auto q = RandomQueries(m, 1, 3);
  auto out = Attend("s", 0, q, 1, {});
  ASSERT_THAT(out.status(), IsOk());
  auto want = RefAttention(m, q, kv[0].kr, kv[0].vr, 24, 0.25);
  EXPECT_LT(RelError(*out, want), 0.1);
}

TEST_F(StoreTest, AllocateMismatchesAreRejected) {
  Make(32);
  const ModelShape m = Shape(2, 1, 1, 16);
  ASSERT_THAT(
      store_
          ->AllocatePages(kTenant, "s", m, 16, Plan({{16, kInt4}, {4, kInt4}}))
          .status(),
      IsOk());
  const InventorySnapshot before = store_->Inventory();
  auto other_lineage = Plan({{16, kInt4}, {4, kInt4}}, 500);
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, other_lineage).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("blocks[0]"), HasSubstr("lineage_id=500"))));
  // Another encoding for an installed block is accepted; the installed one
  // wins (Demote may have changed it after the caller's plan was fetched).
  EXPECT_THAT(
      store_
          ->AllocatePages(kTenant, "s", m, 16, Plan({{16, kInt2}, {4, kInt4}}))
          .status(),
      IsOk());
  EXPECT_EQ(store_->Describe("s")->blocks[0].encoding.k, kInt4);
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, Plan({{16, kInt4}})).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("plans only grow")));
  EXPECT_THAT(
      store_
          ->AllocatePages(kTenant, "s", m, 16, Plan({{16, kInt4}, {3, kInt4}}))
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("blocks[1].num_tokens=3")));
  EXPECT_THAT(store_
                  ->AllocatePages(kTenant, "s", Shape(3, 1, 1, 16), 16,
                                  Plan({{16, kInt4}, {4, kInt4}}))
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("model.n_layers=3")));
  EXPECT_THAT(store_
                  ->AllocatePages("tenant-b", "s", m, 16,
                                  Plan({{16, kInt4}, {4, kInt4}}))
                  .status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("tenant_id=\"tenant-b\"")));
  // Malformed plans and shapes.
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "t", m, 16, Plan({{17, kInt4}})).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("blocks[0].num_tokens=17")));
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "t", m, 16, Plan({{0, kInt4}})).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("blocks[0].num_tokens=0")));
  EXPECT_THAT(store_
                  ->AllocatePages(kTenant, "t", m, 16,
                                  Plan({{4, static_cast<Format>(0)}}))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].format=0")));
  EXPECT_THAT(store_->AllocatePages(kTenant, "t", m, 16, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks is empty")));
  EXPECT_THAT(store_
                  ->AllocatePages(kTenant, "t", Shape(1, 2, 3, 16), 16,
                                  Plan({{4, kInt4}}))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.n_q_heads=3")));
  EXPECT_THAT(store_
                  ->AllocatePages(kTenant, "t", Shape(1, 1, 1, 7), 16,
                                  Plan({{4, kInt4}}))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.head_dim=7")));
  EXPECT_THAT(store_
                  ->AllocatePages(kTenant, "t", Shape(1, 1, 1, 6), 16,
                                  Plan({{4, kInt2}}))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[0]: encoding int2"),
                             HasSubstr("head_dim=6"))));
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "t", m, 0, Plan({{4, kInt4}})).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("block_tokens=0")));
  const InventorySnapshot after = store_->Inventory();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.sequence_ids, before.sequence_ids);
}

TEST_F(StoreTest, ExhaustionIsAtomic) {
  const ModelShape m = Shape(4, 4, 4, 64);
  const size_t int4_page = kernels::PageBytes(Format::kINT4, {16, 4, 64});
  // Two frames of 4 INT4 pages (a BF16 page of this shape fits a frame) and
  // a tail of 2 pages: 8 pages fit, the 16 of a 4-block plan do not.
  Make(0, 10 * int4_page, 4 * int4_page);
  ASSERT_THAT(
      store_
          ->AllocatePages(kTenant, "s", m, 16, Plan({{16, kInt4}, {16, kInt4}}))
          .status(),
      IsOk());
  const InventorySnapshot before = store_->Inventory();
  EXPECT_THAT(
      store_
          ->AllocatePages(
              kTenant, "s", m, 16,
              Plan({{16, kInt4}, {16, kInt4}, {16, kInt4}, {16, kInt4}}))
          .status(),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("needs 8 new pages"), HasSubstr("int4/"),
                     HasSubstr("bytes free"), HasSubstr("0 free frames"),
                     HasSubstr("compaction moved 0 pages"))));
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "big", m, 16, UniformPlan(64, 16, kBf16))
          .status(),
      StatusIs(absl::StatusCode::kResourceExhausted,
               HasSubstr("sequence_id=\"big\"")));
  const InventorySnapshot after = store_->Inventory();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.sequence_ids, std::vector<std::string>{"s"});
  EXPECT_EQ(store_->Describe("s")->blocks.size(), 2u);
}

TEST_F(StoreTest, WriteErrorsNameTheFieldAndChangeNothing) {
  Make(32);
  const ModelShape m = Shape(2, 2, 2, 16);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(20, 16, kInt4))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 24, 1);  // room for the too-long chunk
  WriteAll("s", m, kv, 5, 5);
  std::string kb, vb;
  auto chunk = [&](uint32_t l, uint64_t first, uint32_t n) {
    return Chunk(l, first, n, kv[l], 32, &kb, &vb);
  };
  EXPECT_THAT(store_->Write(kTenant, "s", chunk(0, 6, 2)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("first_token=6"),
                             HasSubstr("5 written tokens"))));
  EXPECT_THAT(store_->Write(kTenant, "s", chunk(0, 3, 2)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("first_token=3")));
  EXPECT_THAT(store_->Write(kTenant, "s", chunk(0, 5, 16)).status(),
              StatusIs(absl::StatusCode::kOutOfRange,
                       AllOf(HasSubstr("num_tokens=16"),
                             HasSubstr("planned total of 20"))));
  KvWrite bad = chunk(0, 5, 2);
  bad.layer = 2;
  EXPECT_THAT(
      store_->Write(kTenant, "s", bad).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer=2")));
  bad = chunk(0, 5, 2);
  bad.k = bad.k.substr(1);
  EXPECT_THAT(store_->Write(kTenant, "s", bad).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("k has 255 bytes; expected 256")));
  bad = chunk(0, 5, 2);
  bad.dtype = 0;
  EXPECT_THAT(
      store_->Write(kTenant, "s", bad).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype=0")));
  bad = chunk(0, 5, 2);
  bad.num_tokens = 0;
  EXPECT_THAT(
      store_->Write(kTenant, "s", bad).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_tokens=0")));
  EXPECT_THAT(store_->Write("tenant-b", "s", chunk(0, 5, 2)).status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("tenant_id=\"tenant-b\"")));
  EXPECT_THAT(
      store_->Write(kTenant, "nope", chunk(0, 5, 2)).status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("sequence_id=\"nope\"")));
  EXPECT_THAT(store_->Describe("s")->written, ElementsAre(5u, 5u));
  // Reads and attention past what is written.
  EXPECT_THAT(store_->Read(kTenant, "s", 0, 3, 5).status(),
              StatusIs(absl::StatusCode::kOutOfRange,
                       HasSubstr("first_token=3 num_tokens=5")));
  EXPECT_THAT(
      store_->Read(kTenant, "s", 9, 0, 0).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer=9")));
  auto q = RandomQueries(m, 1, 1);
  EXPECT_THAT(
      Attend("s", 0, q, 1, {5}).status(),
      StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("positions[0]=5")));
  EXPECT_THAT(Attend("s", 0, q, 2, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("queries has 128 bytes; expected 256")));
  EXPECT_THAT(Attend("s", 0, q, 1, {1, 2}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("positions has 2 entries")));
  EXPECT_THAT(
      Attend("s", 0, q, 0, {}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_queries=0")));
}

TEST_F(StoreTest, FreeReturnsEveryPage) {
  Make(8);
  const ModelShape m = Shape(3, 2, 2, 32);
  for (int s = 0; s < 4; ++s) {
    const std::string id = "s" + std::to_string(s);
    ASSERT_THAT(
        store_
            ->AllocatePages(kTenant, id, m, 16,
                            Plan({{16, kBf16}, {16, kInt4}, {7, kInt2}}))
            .status(),
        IsOk());
    auto kv = RandomLayers(m, 39, 50 + s);
    WriteAll(id, m, kv, 30 + s, 6);
  }
  EXPECT_GT(store_->Inventory().window_bytes, 0u);
  uint64_t freed_bytes = 0;
  const uint64_t used = store_->Inventory().used_bytes;
  for (int s = 0; s < 4; ++s) {
    auto f = store_->Free(kTenant, "s" + std::to_string(s));
    ASSERT_THAT(f.status(), IsOk());
    freed_bytes += f->bytes_freed;
  }
  EXPECT_EQ(freed_bytes, used);
  const InventorySnapshot inv = store_->Inventory();
  EXPECT_EQ(inv.used_bytes, 0u);
  EXPECT_EQ(inv.window_bytes, 0u);
  EXPECT_TRUE(inv.formats.empty());
  EXPECT_EQ(alloc_->Stats().held_bytes, 0u);
  EXPECT_THAT(
      store_->Free(kTenant, "s0").status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("sequence_id=\"s0\"")));
}

TEST_F(StoreTest, SequencesRunInParallel) {
  Make(16);
  const ModelShape m = Shape(2, 2, 4, 32);
  constexpr int kThreads = 4;
  std::vector<std::vector<LayerKv>> data;
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_THAT(store_
                    ->AllocatePages(kTenant, "s" + std::to_string(t), m, 16,
                                    UniformPlan(64, 16, kInt4))
                    .status(),
                IsOk());
    data.push_back(RandomLayers(m, 64, 200 + t));
  }
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string id = "s" + std::to_string(t);
      auto q = RandomQueries(m, 1, t);
      std::string qb = Bytes(q.data(), q.size());
      for (uint64_t tok = 0; tok < 64; ++tok) {
        for (uint32_t l = 0; l < 2; ++l) {
          std::string kb, vb;
          KvWrite w = Chunk(l, tok, 1, data[t][l], 64, &kb, &vb);
          AttendSpec spec;
          spec.layer = l;
          spec.num_queries = 1;
          spec.queries = qb;
          spec.append = &w;
          if (!store_->Attend(kTenant, id, spec).ok()) ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0);
    EXPECT_THAT(store_->Describe("s" + std::to_string(t))->written,
                ElementsAre(64u, 64u));
  }
}

// Every operation on one of a tenant's sequences starts with the same
// preamble: malformed ids, unknown or freed sequences and other tenants'
// sequences answer alike, and change nothing.
TEST_F(StoreTest, EveryOperationChecksIdsOwnerAndLivenessAlike) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 8, Plan({{8, kInt4}})).status(),
      IsOk());
  auto kv = RandomLayers(m, 9, 1);
  WriteAll("s", m, kv, 8, 8);
  std::string kb, vb;
  const KvWrite chunk = Chunk(0, 8, 1, kv[0], 16, &kb, &vb);
  const std::vector<BlockSpec> demote = Plan({{8, kInt2}});
  const uint64_t lineage[] = {100};
  const auto q = RandomQueries(m, 1, 2);
  const std::string qb = Bytes(q.data(), q.size());
  AttendSpec spec;
  spec.num_queries = 1;
  spec.queries = qb;
  using Op = std::function<absl::Status(const char*, const char*)>;
  const std::vector<std::pair<const char*, Op>> ops = {
      {"Write",
       [&](const char* t, const char* id) {
         return store_->Write(t, id, chunk).status();
       }},
      {"Demote",
       [&](const char* t, const char* id) {
         return store_->Demote(t, id, demote).status();
       }},
      {"Read",
       [&](const char* t, const char* id) {
         return store_->Read(t, id, 0, 0, 0).status();
       }},
      {"Attend",
       [&](const char* t, const char* id) {
         return store_->Attend(t, id, spec).status();
       }},
      {"AttendBatch",
       [&](const char* t, const char* id) {
         AttendBatchItem item;
         item.sequence_id = id;
         item.spec = spec;
         return store_->AttendBatch(t, {item})[0].status();
       }},
      {"Restore",
       [&](const char* t, const char* id) {
         return store_->Restore(t, id, lineage, false).status();
       }},
      {"Evict",
       [&](const char* t, const char* id) {
         return store_->Evict(t, id, lineage).status();
       }},
      {"Free", [&](const char* t,
                   const char* id) { return store_->Free(t, id).status(); }},
  };
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    EXPECT_THAT(
        op("bad tenant", "s"),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("tenant_id \"bad tenant\" has a character")));
    EXPECT_THAT(op(kTenant, ""), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("sequence_id is empty")));
    EXPECT_THAT(op(kTenant, "nope"),
                StatusIs(absl::StatusCode::kNotFound,
                         HasSubstr("sequence_id=\"nope\" is not on this "
                                   "worker")));
    EXPECT_THAT(op("tenant-b", "s"),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("sequence_id=\"s\" belongs to another "
                                   "tenant than tenant_id=\"tenant-b\"")));
  }
  auto d = store_->Describe("s");
  ASSERT_THAT(d.status(), IsOk());
  EXPECT_THAT(d->written, ElementsAre(8u));
  EXPECT_THAT(d->sealed, ElementsAre(1u));
  EXPECT_EQ(d->blocks[0].encoding.k, kInt4);
  EXPECT_EQ(d->blocks[0].tier, Tier::kDevice);
  EXPECT_FALSE(d->blocks[0].evicted);

  ASSERT_THAT(store_->Free(kTenant, "s").status(), IsOk());
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    EXPECT_THAT(op(kTenant, "s"),
                StatusIs(absl::StatusCode::kNotFound,
                         HasSubstr("sequence_id=\"s\" is not on this worker")));
  }
}

// An operation's own argument checks answer after the lookup (an unknown
// sequence is NOT_FOUND first) but before the owner check.
TEST_F(StoreTest, ArgumentChecksAnswerBetweenLookupAndOwnerCheck) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 8, Plan({{8, kInt4}})).status(),
      IsOk());
  const uint64_t lineage[] = {100};
  EXPECT_THAT(store_->Demote("tenant-b", "s", {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks is empty")));
  EXPECT_THAT(
      store_->Demote(kTenant, "nope", {}).status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("sequence_id=\"nope\"")));
  EXPECT_THAT(store_->Evict("tenant-b", "s", {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids is empty")));
  EXPECT_THAT(store_->Spill("tenant-b", "s", lineage, Tier::kDevice).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not a spill tier")));
  EXPECT_THAT(store_->Spill("tenant-b", "s", {}, Tier::kHost).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids is empty")));
  // This store has no tiers: refused before the owner is looked at.
  EXPECT_THAT(store_->Spill("tenant-b", "s", lineage, Tier::kHost).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no spill tiers configured")));
  EXPECT_THAT(
      store_->Spill(kTenant, "nope", lineage, Tier::kDevice).status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("sequence_id=\"nope\"")));
}

// A plan's tier fields name where the caller thinks a block is; a new
// block, unspecified or device, is installed on the device.
TEST_F(StoreTest, NewBlocksAreInstalledOnTheDevice) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 16);
  auto plan = Plan({{8, kInt4}, {8, kInt4}});
  plan[0].tier = Tier::kUnspecified;
  plan[1].tier = Tier::kDevice;
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", m, 8, plan).status(), IsOk());
  auto d = store_->Describe("s");
  ASSERT_THAT(d.status(), IsOk());
  for (const BlockSpec& b : d->blocks) {
    EXPECT_EQ(b.tier, Tier::kDevice) << "block " << b.index;
    EXPECT_FALSE(b.evicted) << "block " << b.index;
  }
}

}  // namespace
}  // namespace triax::worker
