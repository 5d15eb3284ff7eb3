// SequenceStore attention: Attend against a float64 reference (GQA groups,
// quantized pages within budget, mixed plans equal to the kernel over the
// same pages), appends written first and atomically, a batch's appends
// written in one device call, and AttendBatch from several threads agreeing
// with single Attends.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "worker/sequence_store.h"
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
using store_testing::Plan;
using store_testing::RefAttention;
using store_testing::RelError;
using store_testing::Shape;
using store_testing::StoreTest;
using store_testing::UniformPlan;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

class GqaTest : public StoreTest,
                public ::testing::WithParamInterface<uint32_t> {};

TEST_P(GqaTest, Bf16AttentionMatchesFloat64Reference) {
  Make(32);
  const uint32_t group = GetParam();
  const ModelShape m = Shape(2, 2, 2 * group, 64);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(54, 16, kBf16))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 54, 11);
  WriteAll("s", m, kv, 54, 54);
  const std::vector<uint64_t> positions = {0, 15, 16, 31, 53};
  auto q = RandomQueries(m, 5, 5);
  for (uint32_t l = 0; l < 2; ++l) {
    auto out = Attend("s", l, q, 5, positions);
    ASSERT_THAT(out.status(), IsOk());
    ExpectFiniteNonZero(*out);
    const size_t per = size_t{m.n_q_heads} * m.head_dim;
    for (size_t i = 0; i < positions.size(); ++i) {
      std::vector<float> qi(q.begin() + i * per, q.begin() + (i + 1) * per);
      auto want = RefAttention(m, qi, kv[l].kr, kv[l].vr, positions[i] + 1,
                               1.0 / std::sqrt(64.0));
      for (size_t j = 0; j < per; ++j) {
        ASSERT_NEAR((*out)[i * per + j], want[j],
                    1e-5 + 1e-5 * std::abs(want[j]))
            << "query " << i << " value " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, GqaTest, ::testing::Values(1u, 2u, 4u));

TEST_F(StoreTest, QuantizedAttentionWithinBudget) {
  // Relative L2 error of the attention output against the unquantized
  // float64 reference; budgets are ~1.4x the errors measured with these
  // seeds (int4 0.108, int2 0.521).
  const ModelShape m = Shape(1, 2, 4, 64);
  for (auto [format, budget] : {std::pair<Format, double>{kInt4, 0.15},
                                std::pair<Format, double>{kInt2, 0.75}}) {
    SCOPED_TRACE(kernels::FormatName(format));
    Make(0);
    ASSERT_THAT(
        store_->AllocatePages(kTenant, "s", m, 16, UniformPlan(96, 16, format))
            .status(),
        IsOk());
    auto kv = RandomLayers(m, 96, 21);
    WriteAll("s", m, kv, 96, 16);
    EXPECT_THAT(store_->Describe("s")->sealed, ElementsAre(6u));
    auto q = RandomQueries(m, 1, 9);
    auto out = Attend("s", 0, q, 1, {});
    ASSERT_THAT(out.status(), IsOk());
    ExpectFiniteNonZero(*out);
    auto want = RefAttention(m, q, kv[0].kr, kv[0].vr, 96, 1.0 / 8.0);
    const double err = RelError(*out, want);
    std::printf("format %s relative error %.4f (budget %.2f)\n",
                kernels::FormatName(format), err, budget);
    EXPECT_LT(err, budget);
    EXPECT_GT(err, 1e-4);  // it really went through quantization
  }
}

TEST_F(StoreTest, MixedPlanAttentionEqualsKernelOverTheSamePages) {
  Make(0);
  const ModelShape m = Shape(2, 2, 4, 32);
  const auto plan = Plan({{16, kBf16}, {16, kInt4}, {16, kInt2}, {16, kInt4}});
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", m, 16, plan).status(),
              IsOk());
  auto kv = RandomLayers(m, 64, 31);
  WriteAll("s", m, kv, 64, 10);
  EXPECT_THAT(store_->Describe("s")->sealed, ElementsAre(4u, 4u));
  auto q = RandomQueries(m, 2, 8);
  const std::vector<uint64_t> positions = {40, 63};
  for (uint32_t l = 0; l < 2; ++l) {
    auto out = Attend("s", l, q, 2, positions);
    ASSERT_THAT(out.status(), IsOk());
    std::vector<kernels::PageRef> refs;
    for (uint32_t b = 0; b < 4; ++b) {
      auto page = store_->TargetPage("s", b, l);
      ASSERT_THAT(page.status(), IsOk());
      refs.push_back({plan[b].encoding, (*page)->data, 16});
    }
    const size_t per = size_t{m.n_q_heads} * m.head_dim;
    for (size_t i = 0; i < 2; ++i) {
      std::vector<float> want(per);
      kernels::DecodeParams p;
      p.q = q.data() + i * per;
      p.out = want.data();
      p.n_q_heads = 4;
      p.shape = {16, 2, 32};
      p.scale = 1.f / std::sqrt(32.f);
      p.pages = refs.data();
      p.num_pages = 4;
      p.attend_tokens = static_cast<long>(positions[i] + 1);
      kernels::DecodeAttentionRef(p);
      EXPECT_EQ(std::vector<float>(out->begin() + i * per,
                                   out->begin() + (i + 1) * per),
                want);
    }
    // And the quantized result stays near the unquantized one.
    std::vector<float> q1(q.begin() + per, q.end());
    auto ref =
        RefAttention(m, q1, kv[l].kr, kv[l].vr, 64, 1.0 / std::sqrt(32.0));
    EXPECT_LT(RelError(std::vector<float>(out->begin() + per, out->end()), ref),
              0.5);
  }
}

TEST_F(StoreTest, AttendAppendWritesFirstAndIsAtomic) {
  Make(4);
  const ModelShape m = Shape(1, 1, 2, 16);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 4, UniformPlan(12, 4, kInt4))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 12, 2);
  WriteAll("s", m, kv, 8, 8);
  auto q = RandomQueries(m, 1, 4);
  std::string kb, vb, qb = Bytes(q.data(), q.size());
  KvWrite append = Chunk(0, 8, 1, kv[0], 16, &kb, &vb);
  AttendSpec spec;
  spec.layer = 0;
  spec.num_queries = 1;
  spec.queries = qb;
  spec.append = &append;
  uint64_t pos[] = {9};
  spec.positions = pos;  // past even the appended token: rejected, no write
  EXPECT_THAT(
      store_->Attend(kTenant, "s", spec).status(),
      StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("positions[0]=9")));
  EXPECT_THAT(store_->Describe("s")->written, ElementsAre(8u));
  spec.positions = {};
  auto out = store_->Attend(kTenant, "s", spec);
  ASSERT_THAT(out.status(), IsOk());
  EXPECT_THAT(store_->Describe("s")->written, ElementsAre(9u));
  // Window 4: blocks ending <= 5 are sealed (block 0), the rest is BF16.
  EXPECT_THAT(store_->Describe("s")->sealed, ElementsAre(1u));
  auto want = RefAttention(m, q, kv[0].kr, kv[0].vr, 9, 0.25);
  EXPECT_LT(RelError(*out, want), 0.1);
}

// Queries in BF16 are the same queries widened: the output equals that of
// the float32 queries rounded to BF16, bit for bit. Other dtypes and sizes
// that do not fit the dtype are refused naming them.
TEST_F(StoreTest, Bf16QueriesAttendAsTheirFloat32Values) {
  Make(4);
  const ModelShape m = Shape(1, 2, 4, 32);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 4, UniformPlan(12, 4, kInt4))
          .status(),
      IsOk());
  auto kv = RandomLayers(m, 12, 5);
  WriteAll("s", m, kv, 12, 12);
  const auto q = RandomQueries(m, 2, 6);
  std::vector<float> rounded(q.size());
  std::string bf16(q.size() * 2, '\0');
  for (size_t i = 0; i < q.size(); ++i) {
    const uint16_t h = kernels::FloatToBf16(q[i]);
    rounded[i] = kernels::Bf16ToFloat(h);
    std::memcpy(bf16.data() + 2 * i, &h, 2);
  }
  const std::string f32 = Bytes(rounded.data(), rounded.size());
  AttendSpec spec;
  spec.num_queries = 2;
  spec.queries = f32;
  auto want = store_->Attend(kTenant, "s", spec);
  ASSERT_THAT(want.status(), IsOk());
  spec.dtype = KvDtype::kBF16;
  spec.queries = bf16;
  auto got = store_->Attend(kTenant, "s", spec);
  ASSERT_THAT(got.status(), IsOk());
  EXPECT_EQ(*got, *want);
  spec.queries = f32;  // float32 bytes, BF16 said
  EXPECT_THAT(store_->Attend(kTenant, "s", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("queries has 1024 bytes; expected 512")));
  spec.dtype = static_cast<KvDtype>(7);
  EXPECT_THAT(store_->Attend(kTenant, "s", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dtype=7 is not F32 (1) or BF16 (2)")));
}

// A decode step's appends reach the device as one WriteBf16TokensBatch, not
// one write per item, the blocks they fill are checksummed in one Checksum,
// and nothing else changes: every output, written count,
// sealed count and page byte equals what the items give one by one on twin
// sequences (blocks that fill in the step seal before the attention reads
// them). A second append to a sequence, or a read of a layer an earlier
// item appends to, starts a new batch; an item whose append is refused
// writes nothing and the others go on.
TEST_F(StoreTest, BatchAppendsAreOneDeviceWriteAndEqualOneByOne) {
  Make(4);
  const ModelShape m = Shape(2, 2, 4, 32);
  const size_t per = size_t{m.n_kv_heads} * m.head_dim;
  constexpr int kSeqs = 4;
  std::vector<std::vector<store_testing::LayerKv>> kv(kSeqs);
  const uint64_t tokens[kSeqs] = {5, 11, 9, 19};
  for (const char* copy : {"a", "b"}) {
    for (int s = 0; s < kSeqs; ++s) {
      const std::string id = absl::StrCat(copy, s);
      ASSERT_THAT(store_
                      ->AllocatePages(kTenant, id, m, 8,
                                      UniformPlan(32, 8, s % 2 ? kInt2 : kInt4))
                      .status(),
                  IsOk());
      if (kv[s].empty()) kv[s] = RandomLayers(m, 32, 40 + s);
      // Blocks of 8, a window of 4: a block seals once 4 tokens follow it,
      // so the step's append seals a block of s1 (11 -> 12) and of s3
      // (19 -> 20), none of s0 and s2.
      WriteAll(id, m, kv[s], tokens[s], 3);
    }
  }
  const auto q = RandomQueries(m, 1, 9);
  const std::string qb = Bytes(q.data(), q.size());
  // Per item: sequence, layer, append (or not). Items 0-3 append one token
  // each to layer 0; item 4 reads a1's layer 1 (no append pending there:
  // same batch); item 5 reads a2's layer 0, which item 2 appends to (the
  // batch runs first); item 6 appends again to a0 (pending no more: same
  // batch as 5); item 7's append skips a token (refused, nothing written).
  struct Item {
    int seq;
    uint32_t layer;
    int append;  // 0: none, 1: the next token, 2: a token past it
  };
  const std::vector<Item> plan = {{0, 0, 1}, {1, 0, 1}, {2, 0, 1}, {3, 0, 1},
                                  {1, 1, 0}, {2, 0, 0}, {0, 0, 1}, {3, 1, 2}};
  auto run = [&](const char* copy, absl::Span<const size_t> which,
                 std::vector<absl::StatusOr<std::vector<float>>>* out) {
    std::vector<AttendBatchItem> items(which.size());
    std::vector<std::string> kb(which.size()), vb(which.size());
    std::vector<KvWrite> appends(which.size());
    std::vector<std::string> ids(which.size());  // items hold views
    for (size_t j = 0; j < which.size(); ++j) {
      const Item& it = plan[which[j]];
      const std::string& id = ids[j] = absl::StrCat(copy, it.seq);
      items[j].sequence_id = id;
      items[j].spec.layer = it.layer;
      items[j].spec.num_queries = 1;
      items[j].spec.queries = qb;
      if (it.append > 0) {
        // The next token (after an earlier item's append to the same layer
        // in this call), or one past it.
        uint64_t at = store_->Describe(id)->written[it.layer] + (it.append - 1);
        for (size_t e = 0; e < j; ++e) {
          if (ids[e] == id && items[e].spec.append != nullptr &&
              items[e].spec.layer == it.layer) {
            at += items[e].spec.append->num_tokens;
          }
        }
        appends[j] =
            Chunk(it.layer, at, 1, kv[it.seq][it.layer], per, &kb[j], &vb[j]);
        items[j].spec.append = &appends[j];
      }
    }
    *out = store_->AttendBatch(kTenant, items);
  };
  std::vector<size_t> all(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) all[i] = i;
  device_.ClearRecord();
  device_.ClearChecksums();
  std::vector<absl::StatusOr<std::vector<float>>> batched;
  run("a", all, &batched);
  // The two blocks the first batch sealed (a1's and a3's) are checksummed
  // in one device call.
  EXPECT_THAT(device_.checksums(), ElementsAre(2u));
  // Items 0-4: one device write of 4 appends, one attention batch of 5;
  // items 5-6: a write of 1, attention of 2.
  EXPECT_THAT(device_.token_write_batches(), ElementsAre(4u, 1u));
  EXPECT_EQ(device_.single_token_writes(), 0u);
  EXPECT_THAT(device_.attention_batches(), ElementsAre(5u, 2u));
  ASSERT_EQ(batched.size(), plan.size());
  EXPECT_THAT(batched[7].status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("append.first_token")));
  for (size_t i = 0; i < plan.size(); ++i) {
    std::vector<absl::StatusOr<std::vector<float>>> alone;
    run("b", absl::MakeConstSpan(&all[i], 1), &alone);
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(batched[i].status().code(), alone[0].status().code())
        << i << ": " << batched[i].status() << " / " << alone[0].status();
    if (batched[i].ok() && alone[0].ok()) {
      EXPECT_EQ(*batched[i], *alone[0]) << "item " << i;
    }
  }
  for (int s = 0; s < kSeqs; ++s) {
    const auto a = store_->Describe(absl::StrCat("a", s));
    const auto b = store_->Describe(absl::StrCat("b", s));
    EXPECT_EQ(a->written, b->written) << s;
    EXPECT_EQ(a->sealed, b->sealed) << s;
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      auto ra = store_->Read(kTenant, absl::StrCat("a", s), l, 0, 0);
      auto rb = store_->Read(kTenant, absl::StrCat("b", s), l, 0, 0);
      ASSERT_THAT(ra.status(), IsOk());
      ASSERT_THAT(rb.status(), IsOk());
      EXPECT_EQ(ra->k, rb->k) << s << " layer " << l;
      EXPECT_EQ(ra->v, rb->v) << s << " layer " << l;
    }
  }
  // a0 took two tokens, a1-a3 one each on layer 0; a1 and a3 sealed a
  // block of layer 0 in the step.
  EXPECT_EQ(store_->Describe("a0")->written[0], 7u);
  EXPECT_EQ(store_->Describe("a1")->written[0], 12u);
  EXPECT_EQ(store_->Describe("a2")->written[0], 10u);
  EXPECT_EQ(store_->Describe("a3")->written[0], 20u);
  EXPECT_EQ(store_->Describe("a3")->written[1], 19u);
  EXPECT_EQ(store_->Describe("a1")->sealed[0], 1u);
  EXPECT_EQ(store_->Describe("a1")->sealed[1], 0u);
  EXPECT_EQ(store_->Describe("a3")->sealed[0], 2u);
  EXPECT_EQ(store_->Describe("a3")->sealed[1], 1u);
}

// A batch whose token writes the device refuses (a poisoned device) fails
// the appending items naming the append, moves no written count, and a
// retry once the device is healthy appends as if nothing had happened.
TEST_F(StoreTest, RefusedBatchWriteAppendsNothingAndRetries) {
  Make(4);
  const ModelShape m = Shape(1, 2, 4, 32);
  const size_t per = size_t{m.n_kv_heads} * m.head_dim;
  auto kv = RandomLayers(m, 16, 77);
  std::vector<std::string> ids = {"x", "y"};
  for (const std::string& id : ids) {
    ASSERT_THAT(
        store_->AllocatePages(kTenant, id, m, 8, UniformPlan(16, 8, kInt4))
            .status(),
        IsOk());
    WriteAll(id, m, kv, 6, 3);
  }
  const auto q = RandomQueries(m, 1, 3);
  const std::string qb = Bytes(q.data(), q.size());
  std::vector<std::string> kb(2), vb(2);
  std::vector<KvWrite> appends(2);
  std::vector<AttendBatchItem> items(2);
  for (size_t j = 0; j < 2; ++j) {
    appends[j] = Chunk(0, 6, 1, kv[0], per, &kb[j], &vb[j]);
    items[j].sequence_id = ids[j];
    items[j].spec.num_queries = 1;
    items[j].spec.queries = qb;
    items[j].spec.append = &appends[j];
  }
  device_.SetUnhealthy("device lost (test)");
  auto refused = store_->AttendBatch(kTenant, items);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_THAT(refused[j].status(),
                StatusIs(absl::StatusCode::kUnavailable,
                         HasSubstr("append: writes[0]: device lost (test)")))
        << j;
    EXPECT_THAT(store_->Describe(ids[j])->written, ElementsAre(6u)) << j;
  }
  device_.SetUnhealthy("");
  auto again = store_->AttendBatch(kTenant, items);
  for (size_t j = 0; j < 2; ++j) {
    ASSERT_THAT(again[j].status(), IsOk()) << j;
    EXPECT_THAT(store_->Describe(ids[j])->written, ElementsAre(7u)) << j;
    auto want = RefAttention(m, q, kv[0].kr, kv[0].vr, 7, 1 / std::sqrt(32.0));
    EXPECT_LT(RelError(*again[j], want), 0.1) << j;
  }
  EXPECT_EQ(*again[0], *again[1]);
}

// Threads batching the same sequences in opposite orders neither deadlock
// (locks are taken in id order) nor disturb each other: every batch equals
// the per-item answers.
TEST_F(StoreTest, ConcurrentBatchesInAnyOrderAgreeWithSingleAttends) {
  Make(16);
  const ModelShape m = Shape(1, 2, 4, 32);
  constexpr int kSeqs = 4;
  std::vector<std::string> ids;
  for (int s = 0; s < kSeqs; ++s) {
    ids.push_back("s" + std::to_string(s));
    ASSERT_THAT(store_
                    ->AllocatePages(kTenant, ids[s], m, 16,
                                    UniformPlan(48, 16, s % 2 ? kInt2 : kInt4))
                    .status(),
                IsOk());
    WriteAll(ids[s], m, RandomLayers(m, 48, 300 + s), 40 + s, 7);
  }
  const auto q = RandomQueries(m, 1, 5);
  const std::string qb = Bytes(q.data(), q.size());
  std::vector<std::vector<float>> want(kSeqs);
  for (int s = 0; s < kSeqs; ++s) {
    auto r = Attend(ids[s], 0, q, 1, {});
    ASSERT_THAT(r.status(), IsOk());
    want[s] = *r;
  }
  device_.ClearRecord();
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<AttendBatchItem> items(kSeqs);
      for (int i = 0; i < kSeqs; ++i) {
        const int s = t % 2 ? kSeqs - 1 - i : i;  // odd threads: reversed
        items[i].sequence_id = ids[s];
        items[i].spec.num_queries = 1;
        items[i].spec.queries = qb;
      }
      for (int rep = 0; rep < 20; ++rep) {
        auto rs = store_->AttendBatch(kTenant, items);
        for (int i = 0; i < kSeqs; ++i) {
          const int s = t % 2 ? kSeqs - 1 - i : i;
          if (!rs[i].ok() || *rs[i] != want[s]) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
  const auto batches = device_.attention_batches();
  ASSERT_EQ(batches.size(), 80u);
  for (size_t b : batches) EXPECT_EQ(b, size_t{kSeqs});
}

}  // namespace
}  // namespace triax::worker
