// SequenceStore over every page encoding (kernels/layout.h): write, seal,
// attention and reads per encoding; Demote of sealed and unsealed blocks;
// per-sequence window_tokens.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "worker/sequence_store.h"

namespace triax::worker {
namespace {

using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;
using kernels::ScaleDtype;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr char kTenant[] = "tenant-a";

ModelShape Shape(uint32_t layers, uint32_t kv, uint32_t q, uint32_t d) {
  ModelShape m;
  m.name = "test";
  m.n_layers = layers;
  m.n_kv_heads = kv;
  m.n_q_heads = q;
  m.head_dim = d;
  return m;
}

// A BlockSpec naming `e`.
BlockSpec WithEncoding(BlockSpec b, const Encoding& e) {
  b.encoding = e;
  return b;
}

// Blocks of `t` tokens covering `tokens` (the last one partial), all in `e`.
std::vector<BlockSpec> Plan(uint32_t tokens, uint32_t t, const Encoding& e) {
  std::vector<BlockSpec> plan;
  for (uint32_t first = 0, i = 0; first < tokens; first += t, ++i) {
    BlockSpec b;
    b.index = i;
    b.lineage_id = 100 + i;
    b.first_token = first;
    b.num_tokens = std::min(t, tokens - first);
    plan.push_back(WithEncoding(b, e));
  }
  return plan;
}

// A Demote entry for block `index` of a Plan().
BlockSpec Target(uint32_t index, const Encoding& e) {
  BlockSpec b;
  b.index = index;
  b.lineage_id = 100 + index;
  return WithEncoding(b, e);
}

std::string Name(const Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

// One layer's K/V as BF16, token-major, and as float (the BF16 values).
struct LayerKv {
  std::vector<uint16_t> kb, vb;
  std::vector<float> kf, vf;
};

LayerKv RandomKv(size_t values, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  LayerKv kv;
  for (size_t i = 0; i < values; ++i) {
    kv.kb.push_back(kernels::FloatToBf16(dist(rng)));
    kv.vb.push_back(kernels::FloatToBf16(dist(rng)));
    kv.kf.push_back(kernels::Bf16ToFloat(kv.kb.back()));
    kv.vf.push_back(kernels::Bf16ToFloat(kv.vb.back()));
  }
  return kv;
}

double RelError(const float* got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

// Relative RMS error budget of one encoding's dequantized values on N(0, 1)
// data, about 1.4x what the kernels achieve (INT8 allows for FP8 scales).
double Budget(Format f) {
  switch (f) {
    case Format::kBF16:
      return 0.005;
    case Format::kFP8:
      return 0.04;
    case Format::kINT8:
      return 0.03;
    case Format::kINT4:
      return 0.125;
    case Format::kINT2:
      return 0.62;
    case Format::kTQ4:
      return 0.14;
    case Format::kTQ3:
      return 0.26;
    case Format::kTQ2:
      return 0.48;
  }
  return 0;
}

class EncodingStoreTest : public ::testing::Test {
 protected:
  void Make(uint32_t window_tokens, size_t capacity = 16 << 20) {
    store_.reset();
    auto a = PageAllocator::Create(&device_, capacity);
    ASSERT_THAT(a.status(), IsOk());
    alloc_ = *std::move(a);
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(),
                                             StoreOptions{window_tokens});
  }
  void TearDown() override {
    store_.reset();
    alloc_.reset();
  }

  // Random BF16 K/V per layer for `tokens` tokens of `m`.
  void Fill(const ModelShape& m, size_t tokens, uint32_t seed) {
    kv_.clear();
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      kv_.push_back(
          RandomKv(tokens * m.n_kv_heads * m.head_dim, seed * 100 + l));
    }
  }

  // Writes tokens [from, to) of kv_ on every layer, BF16, in one chunk.
  void Write(const std::string& seq, const ModelShape& m, uint64_t from,
             uint64_t to) {
    const size_t per = size_t{m.n_kv_heads} * m.head_dim;
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      KvWrite w;
      w.layer = l;
      w.first_token = from;
      w.num_tokens = static_cast<uint32_t>(to - from);
      w.dtype = static_cast<int>(KvDtype::kBF16);
      w.k = absl::string_view(
          reinterpret_cast<const char*>(kv_[l].kb.data() + from * per),
          (to - from) * per * 2);
      w.v = absl::string_view(
          reinterpret_cast<const char*>(kv_[l].vb.data() + from * per),
          (to - from) * per * 2);
      ASSERT_THAT(store_->Write(kTenant, seq, w).status(), IsOk())
          << "layer " << l;
    }
  }

  // The page bytes a block of tokens [first, first+n) of layer `l` has when
  // encoded straight from the BF16 input.
  std::vector<uint8_t> Encoded(const Encoding& e, const PageShape& shape,
                               uint32_t l, uint64_t first, uint32_t n) {
    const size_t per = size_t(shape.heads) * shape.head_dim;
    std::vector<uint8_t> page(kernels::PageBytes(e, shape));
    kernels::EncodePage(e, shape, kv_[l].kb.data() + first * per,
                        kv_[l].vb.data() + first * per, static_cast<int>(n),
                        page.data());
    return page;
  }

  std::vector<uint8_t> PageOf(const std::string& seq, uint32_t block,
                              uint32_t layer) {
    auto p = store_->TargetPage(seq, block, layer);
    EXPECT_THAT(p.status(), IsOk());
    if (!p.ok()) return {};
    return std::vector<uint8_t>((*p)->data, (*p)->data + (*p)->bytes);
  }

  // Checks the store's attention on `layer` against DecodeAttentionRef over
  // the given pages (bit for bit: same bytes, same kernel).
  void ExpectAttentionEqualsKernel(const std::string& seq, const ModelShape& m,
                                   const PageShape& shape, uint32_t layer,
                                   const std::vector<kernels::PageRef>& refs,
                                   uint64_t written, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, 1.f);
    const size_t per = size_t{m.n_q_heads} * m.head_dim;
    std::vector<float> q(2 * per);
    for (float& x : q) x = dist(rng);
    const std::vector<uint64_t> positions = {written / 2, written - 1};
    AttendSpec spec;
    spec.layer = layer;
    spec.num_queries = 2;
    spec.positions = positions;
    std::string qb(reinterpret_cast<const char*>(q.data()), q.size() * 4);
    spec.queries = qb;
    auto out = store_->Attend(kTenant, seq, spec);
    ASSERT_THAT(out.status(), IsOk());
    for (size_t i = 0; i < 2; ++i) {
      std::vector<float> want(per);
      kernels::DecodeParams p;
      p.q = q.data() + i * per;
      p.out = want.data();
      p.n_q_heads = static_cast<int>(m.n_q_heads);
      p.shape = shape;
      p.scale = 1.f / std::sqrt(static_cast<float>(m.head_dim));
      p.pages = refs.data();
      p.num_pages = static_cast<int>(refs.size());
      p.attend_tokens = static_cast<long>(positions[i] + 1);
      kernels::DecodeAttentionRef(p);
      EXPECT_EQ(std::vector<float>(out->begin() + i * per,
                                   out->begin() + (i + 1) * per),
                want)
          << "query " << i;
    }
  }

  CpuDevice device_;
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<SequenceStore> store_;
  std::vector<LayerKv> kv_;
};

// ---------------------------------------------------------------------------
// Every encoding through the store.

class EveryEncodingTest : public EncodingStoreTest,
                          public ::testing::WithParamInterface<Encoding> {};

TEST_P(EveryEncodingTest, WriteSealAttendAndReadMatchTheKernels) {
  const Encoding e = GetParam();
  SCOPED_TRACE(Name(e));
  Make(32);
  const ModelShape m = Shape(2, 2, 4, 64);
  const PageShape shape{32, 2, 64};
  const size_t per = size_t{2} * 64;
  // 80 tokens in blocks of 32, 32, 16; window 8 (per sequence) seals blocks
  // ending <= 72: blocks 0 and 1. Block 2 stays in the BF16 window.
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 32, Plan(80, 32, e), 8).status(),
      IsOk());
  Fill(m, 80, 5);
  Write("s", m, 0, 50);
  Write("s", m, 50, 80);
  auto d = store_->Describe("s");
  ASSERT_THAT(d.status(), IsOk());
  EXPECT_EQ(d->window_tokens, 8u);
  EXPECT_THAT(d->sealed, ElementsAre(2u, 2u));
  const bool bf16 = e.k == Format::kBF16 && e.v == Format::kBF16;
  EXPECT_THAT(d->window_pages, ElementsAre(bf16 ? 0u : 1u, bf16 ? 0u : 1u));

  for (uint32_t l = 0; l < 2; ++l) {
    SCOPED_TRACE(l);
    // Sealed pages hold exactly what the kernel encodes from the input.
    for (uint32_t b = 0; b < 2; ++b) {
      EXPECT_EQ(PageOf("s", b, l), Encoded(e, shape, l, size_t{32} * b, 32));
    }
    std::vector<uint8_t> window = Encoded(Format::kBF16, shape, l, 64, 16);
    std::vector<uint8_t> p0 = PageOf("s", 0, l), p1 = PageOf("s", 1, l);
    ExpectAttentionEqualsKernel("s", m, shape, l,
                                {{e, p0.data(), 32},
                                 {e, p1.data(), 32},
                                 {Format::kBF16, window.data(), 16}},
                                80, 9 + l);

    // ReadKV: decoded sealed pages, exact BF16 for the window, and within
    // the format's tolerance of the input.
    auto r = store_->Read(kTenant, "s", l, 0, 0);
    ASSERT_THAT(r.status(), IsOk());
    ASSERT_EQ(r->num_tokens, 80u);
    std::vector<float> k(64 * per), v(64 * per);
    kernels::DecodePage(e, shape, p0.data(), 32, k.data(), v.data());
    kernels::DecodePage(e, shape, p1.data(), 32, k.data() + 32 * per,
                        v.data() + 32 * per);
    EXPECT_EQ(std::vector<float>(r->k.begin(), r->k.begin() + 64 * per), k);
    EXPECT_EQ(std::vector<float>(r->v.begin(), r->v.begin() + 64 * per), v);
    EXPECT_EQ(
        std::vector<float>(r->k.begin() + 64 * per, r->k.end()),
        std::vector<float>(kv_[l].kf.begin() + 64 * per, kv_[l].kf.end()));
    const double ek = RelError(r->k.data(), kv_[l].kf.data(), 64 * per);
    const double ev = RelError(r->v.data(), kv_[l].vf.data(), 64 * per);
    std::printf("%-28s layer %u read error k %.4f v %.4f\n", Name(e).c_str(), l,
                ek, ev);
    EXPECT_LT(ek, Budget(e.k));
    EXPECT_LT(ev, Budget(e.v));
  }

  // Inventory: per encoding, and per K format.
  const InventorySnapshot inv = store_->Inventory();
  const size_t page = kernels::PageBytes(e, shape);
  ASSERT_EQ(inv.encodings.count(e), 1u);
  EXPECT_EQ(inv.encodings.at(e).pages, 6u);
  EXPECT_EQ(inv.encodings.at(e).bytes, 6 * page);
  EXPECT_EQ(inv.formats.at(e.k).bytes, 6 * page);
  EXPECT_EQ(inv.window_bytes,
            bf16 ? 0 : 2 * kernels::PageBytes(Format::kBF16, shape));
}

INSTANTIATE_TEST_SUITE_P(
    Encodings, EveryEncodingTest,
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

TEST_F(EncodingStoreTest, InvalidEncodingsNameTheBlockAndTheReason) {
  Make(32);
  BlockSpec b = Plan(16, 16, Format::kINT4)[0];
  auto alloc = [&](const ModelShape& m, uint32_t t, const BlockSpec& spec) {
    return store_->AllocatePages(kTenant, "s", m, t, {spec}).status();
  };
  // TQ needs a power-of-two head_dim.
  EXPECT_THAT(alloc(Shape(1, 1, 1, 48), 16, WithEncoding(b, Format::kTQ3)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[0]: encoding tq3"),
                             HasSubstr("head_dim=48"))));
  BlockSpec bad = b;
  bad.encoding.v = static_cast<Format>(9);
  EXPECT_THAT(alloc(Shape(1, 1, 1, 64), 16, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].format_v=9")));
  bad = b;
  bad.encoding.group = 48;
  EXPECT_THAT(alloc(Shape(1, 1, 1, 64), 16, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].group_size=48")));
  bad = b;
  bad.encoding.scale_dtype = static_cast<ScaleDtype>(3);
  EXPECT_THAT(alloc(Shape(1, 1, 1, 64), 16, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].scale_dtype=3")));
  // Key group 32 does not divide 48 tokens per page.
  BlockSpec g = Plan(48, 48, Format::kINT4)[0];
  EXPECT_THAT(alloc(Shape(1, 1, 1, 64), 48, g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[0]: encoding int4"),
                             HasSubstr("block_tokens=48"))));
  // INT4 value group 32 does not divide head_dim 48, BF16 needs no group.
  EXPECT_THAT(
      alloc(Shape(1, 1, 1, 48), 16, b),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim=48")));
  EXPECT_THAT(alloc(Shape(1, 1, 1, 48), 16, WithEncoding(b, Format::kBF16)),
              IsOk());
  EXPECT_EQ(store_->Inventory().sequence_ids, std::vector<std::string>{"s"});
}

// ---------------------------------------------------------------------------
// window_tokens per sequence

TEST_F(EncodingStoreTest, WindowTokensIsPerSequenceAndFixedByTheFirstCall) {
  Make(32);
  const ModelShape m = Shape(1, 1, 1, 32);
  auto plan = Plan(48, 16, Format::kINT4);
  ASSERT_THAT(store_->AllocatePages(kTenant, "zero", m, 16, plan, 0u).status(),
              IsOk());
  ASSERT_THAT(store_->AllocatePages(kTenant, "dflt", m, 16, plan).status(),
              IsOk());
  Fill(m, 48, 3);
  Write("zero", m, 0, 20);
  Write("dflt", m, 0, 20);
  // window 0 seals block 0 as soon as it is full; the default 32 does not.
  EXPECT_THAT(store_->Describe("zero")->sealed, ElementsAre(1u));
  EXPECT_THAT(store_->Describe("dflt")->sealed, ElementsAre(0u));
  EXPECT_EQ(store_->Describe("zero")->window_tokens, 0u);
  EXPECT_EQ(store_->Describe("dflt")->window_tokens, 32u);

  const uint64_t used = store_->Inventory().used_bytes;
  EXPECT_THAT(
      store_->AllocatePages(kTenant, "zero", m, 16, plan, 5u).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("window_tokens=5"), HasSubstr("installed 0"))));
  EXPECT_THAT(store_->AllocatePages(kTenant, "dflt", m, 16, plan, 0u).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("window_tokens=0")));
  // Absent or the same value is fine.
  EXPECT_THAT(store_->AllocatePages(kTenant, "zero", m, 16, plan).status(),
              IsOk());
  EXPECT_THAT(store_->AllocatePages(kTenant, "dflt", m, 16, plan, 32u).status(),
              IsOk());
  EXPECT_EQ(store_->Inventory().used_bytes, used);

  // A fork inherits its parent's window.
  auto child = Plan(48, 16, Format::kINT4);
  child[1].lineage_id = 901;  // partly inside num_tokens: copied
  child[2].lineage_id = 902;
  ASSERT_THAT(store_->Fork(kTenant, "zero", "kid", 20, child).status(), IsOk());
  EXPECT_EQ(store_->Describe("kid")->window_tokens, 0u);
}

TEST_F(EncodingStoreTest, InstalledAndSharedBlocksKeepTheirEncoding) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 32);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, Plan(32, 16, Format::kINT4))
          .status(),
      IsOk());
  Fill(m, 32, 2);
  Write("s", m, 0, 32);
  ASSERT_THAT(store_->Demote(kTenant, "s", {Target(0, Format::kINT2)}).status(),
              IsOk());
  // A plan fetched before the demotion still names int4 for block 0: it is
  // accepted and block 0 stays int2.
  auto stale = Plan(48, 16, Format::kINT4);
  ASSERT_THAT(store_->AllocatePages(kTenant, "s", m, 16, stale).status(),
              IsOk());
  EXPECT_EQ(store_->Describe("s")->blocks[0].encoding.k, Format::kINT2);
  EXPECT_EQ(store_->Describe("s")->blocks[2].encoding.k, Format::kINT4);
  // A fork sharing block 0 under a plan naming bf16 shares the int2 page.
  auto child = Plan(32, 16, Format::kBF16);
  child[1].lineage_id = 900;  // copied, in the child's plan encoding
  ASSERT_THAT(store_->Fork(kTenant, "s", "kid", 32, child).status(), IsOk());
  auto d = store_->Describe("kid");
  EXPECT_EQ(d->blocks[0].encoding.k, Format::kINT2);
  EXPECT_EQ(d->blocks[1].encoding.k, Format::kBF16);
  EXPECT_EQ(*store_->TargetPage("kid", 0, 0), *store_->TargetPage("s", 0, 0));
  auto rs = store_->Read(kTenant, "s", 0, 0, 16);
  auto rk = store_->Read(kTenant, "kid", 0, 0, 16);
  ASSERT_THAT(rk.status(), IsOk());
  EXPECT_EQ(rk->k, rs->k);
}

// ---------------------------------------------------------------------------
// Demote

TEST_F(EncodingStoreTest, DemoteSealedAndUnsealedBf16ToInt4ToInt2) {
  Make(16);
  const ModelShape m = Shape(2, 2, 4, 32);
  const PageShape shape{16, 2, 32};
  const size_t per = size_t{2} * 32;
  const size_t bf16 = kernels::PageBytes(Format::kBF16, shape);
  const size_t int4 = kernels::PageBytes(Format::kINT4, shape);
  const size_t int2 = kernels::PageBytes(Format::kINT2, shape);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, Plan(64, 16, Format::kBF16))
          .status(),
      IsOk());
  Fill(m, 80, 21);
  Write("s", m, 0, 56);
  // 56 written, window 16: blocks ending <= 40 are sealed (0, 1); block 2 is
  // full but in the window, block 3 partly written.
  ASSERT_THAT(store_->Describe("s")->sealed, ElementsAre(2u, 2u));

  uint64_t used = store_->Inventory().used_bytes;
  auto r = store_->Demote(kTenant, "s",
                          {Target(0, Format::kINT4), Target(2, Format::kINT4),
                           Target(3, Format::kINT4)});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_reencoded, 6u);
  // Sealed block 0: int4 replaces bf16. Unsealed blocks 2 and 3: a new int4
  // target each; their tokens move from the old bf16 target to a window page.
  EXPECT_EQ(r->bytes_delta, 2 * (int64_t(int4) - int64_t(bf16)) + 4 * int4);
  EXPECT_EQ(store_->Inventory().used_bytes, used + r->bytes_delta);
  auto d = store_->Describe("s");
  EXPECT_EQ(d->blocks[0].encoding.k, Format::kINT4);
  EXPECT_EQ(d->blocks[1].encoding.k, Format::kBF16);
  EXPECT_EQ(d->blocks[3].encoding.k, Format::kINT4);
  EXPECT_THAT(d->sealed, ElementsAre(2u, 2u));
  EXPECT_THAT(d->window_pages, ElementsAre(2u, 2u));
  for (uint32_t l = 0; l < 2; ++l) {
    // BF16 -> INT4 of a sealed page is the INT4 encoding of the input.
    EXPECT_EQ(PageOf("s", 0, l), Encoded(Format::kINT4, shape, l, 0, 16));
  }

  // Keep writing: block 2 and 3 seal into INT4 from their window pages.
  Write("s", m, 56, 64);
  d = store_->Describe("s");
  EXPECT_THAT(d->sealed, ElementsAre(3u, 3u));
  for (uint32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(PageOf("s", 2, l), Encoded(Format::kINT4, shape, l, 32, 16));
  }

  // INT4 -> INT2 of sealed block 0: decode, round to BF16, encode.
  used = store_->Inventory().used_bytes;
  r = store_->Demote(kTenant, "s", {Target(0, Format::kINT2)});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_reencoded, 2u);
  EXPECT_EQ(r->bytes_delta, 2 * (int64_t(int2) - int64_t(int4)));
  EXPECT_EQ(store_->Inventory().used_bytes, used + r->bytes_delta);
  for (uint32_t l = 0; l < 2; ++l) {
    SCOPED_TRACE(l);
    std::vector<uint8_t> old4 = Encoded(Format::kINT4, shape, l, 0, 16);
    std::vector<float> k(16 * per), v(16 * per);
    kernels::DecodePage(Format::kINT4, shape, old4.data(), 16, k.data(),
                        v.data());
    std::vector<uint16_t> kb, vb;
    for (float x : k) kb.push_back(kernels::FloatToBf16(x));
    for (float x : v) vb.push_back(kernels::FloatToBf16(x));
    std::vector<uint8_t> want(int2);
    kernels::EncodePage(Format::kINT2, shape, kb.data(), vb.data(), 16,
                        want.data());
    std::vector<uint8_t> p0 = PageOf("s", 0, l), p1 = PageOf("s", 1, l),
                         p2 = PageOf("s", 2, l);
    EXPECT_EQ(p0, want);
    std::vector<uint8_t> w3 = Encoded(Format::kBF16, shape, l, 48, 16);
    ExpectAttentionEqualsKernel("s", m, shape, l,
                                {{Format::kINT2, p0.data(), 16},
                                 {Format::kBF16, p1.data(), 16},
                                 {Format::kINT4, p2.data(), 16},
                                 {Format::kBF16, w3.data(), 16}},
                                64, 40 + l);
    // Reads see the demoted values.
    auto rd = store_->Read(kTenant, "s", l, 0, 16);
    ASSERT_THAT(rd.status(), IsOk());
    std::vector<float> k2(16 * per), v2(16 * per);
    kernels::DecodePage(Format::kINT2, shape, p0.data(), 16, k2.data(),
                        v2.data());
    EXPECT_EQ(rd->k, k2);
    EXPECT_EQ(rd->v, v2);
  }
}

TEST_F(EncodingStoreTest, DemoteInt8ToTq3AndToMixedKv) {
  Make(0);
  const ModelShape m = Shape(2, 1, 2, 64);
  const PageShape shape{32, 1, 64};
  const Encoding mixed(Format::kINT4, Format::kINT2, 64, ScaleDtype::kFP8);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 32, Plan(96, 32, Format::kINT8))
          .status(),
      IsOk());
  Fill(m, 96, 8);
  Write("s", m, 0, 96);
  ASSERT_THAT(store_->Describe("s")->sealed, ElementsAre(3u, 3u));
  const uint64_t used = store_->Inventory().used_bytes;
  auto r =
      store_->Demote(kTenant, "s", {Target(1, mixed), Target(0, Format::kTQ3)});
  ASSERT_THAT(r.status(), IsOk());
  const int64_t int8 = kernels::PageBytes(Format::kINT8, shape);
  EXPECT_EQ(r->pages_reencoded, 4u);
  EXPECT_EQ(r->bytes_delta,
            2 * (int64_t(kernels::PageBytes(Format::kTQ3, shape)) - int8) +
                2 * (int64_t(kernels::PageBytes(mixed, shape)) - int8));
  EXPECT_LT(r->bytes_delta, 0);
  const InventorySnapshot inv = store_->Inventory();
  EXPECT_EQ(inv.used_bytes, used + r->bytes_delta);
  EXPECT_EQ(inv.encodings.at(Format::kTQ3).pages, 2u);
  EXPECT_EQ(inv.encodings.at(mixed).pages, 2u);
  EXPECT_EQ(inv.encodings.at(Format::kINT8).pages, 2u);
  auto d = store_->Describe("s");
  EXPECT_EQ(d->blocks[0].encoding.k, Format::kTQ3);
  EXPECT_EQ(d->blocks[1].encoding.k, Format::kINT4);
  EXPECT_EQ(d->blocks[1].encoding.v, Format::kINT2);
  EXPECT_EQ(d->blocks[1].encoding.group, 64);
  EXPECT_EQ(d->blocks[1].encoding.scale_dtype, ScaleDtype::kFP8);
  for (uint32_t l = 0; l < 2; ++l) {
    std::vector<uint8_t> p0 = PageOf("s", 0, l), p1 = PageOf("s", 1, l),
                         p2 = PageOf("s", 2, l);
    ExpectAttentionEqualsKernel("s", m, shape, l,
                                {{Format::kTQ3, p0.data(), 32},
                                 {mixed, p1.data(), 32},
                                 {Format::kINT8, p2.data(), 32}},
                                96, 70 + l);
    auto rd = store_->Read(kTenant, "s", l, 0, 0);
    ASSERT_THAT(rd.status(), IsOk());
    const size_t n = size_t{32} * 64;
    // Two lossy steps (INT8 then TQ3 / INT4-INT2) stay within the coarser
    // format's budget of the input.
    EXPECT_LT(RelError(rd->k.data(), kv_[l].kf.data(), n),
              Budget(Format::kTQ3));
    EXPECT_LT(RelError(rd->v.data(), kv_[l].vf.data(), n),
              Budget(Format::kTQ3));
    EXPECT_LT(RelError(rd->k.data() + n, kv_[l].kf.data() + n, n),
              Budget(Format::kINT4));
    EXPECT_LT(RelError(rd->v.data() + n, kv_[l].vf.data() + n, n),
              Budget(Format::kINT2));
  }
}

TEST_F(EncodingStoreTest, DemoteUnsealedToBf16MovesTheWindowIntoTheTarget) {
  Make(32);
  const ModelShape m = Shape(1, 1, 1, 32);
  const PageShape shape{16, 1, 32};
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, Plan(32, 16, Format::kINT4))
          .status(),
      IsOk());
  Fill(m, 32, 4);
  Write("s", m, 0, 20);
  ASSERT_THAT(store_->Describe("s")->window_pages, ElementsAre(2u));
  const uint64_t used = store_->Inventory().used_bytes;
  auto r = store_->Demote(kTenant, "s",
                          {Target(0, Format::kBF16), Target(1, Format::kBF16)});
  ASSERT_THAT(r.status(), IsOk());
  const int64_t bf16 = kernels::PageBytes(Format::kBF16, shape);
  const int64_t int4 = kernels::PageBytes(Format::kINT4, shape);
  // New bf16 targets replace int4 ones and the two window pages go away.
  EXPECT_EQ(r->bytes_delta, 2 * (bf16 - int4) - 2 * bf16);
  EXPECT_EQ(store_->Inventory().used_bytes, used + r->bytes_delta);
  EXPECT_EQ(store_->Inventory().window_bytes, 0u);
  EXPECT_THAT(store_->Describe("s")->window_pages, ElementsAre(0u));
  Write("s", m, 20, 32);
  auto rd = store_->Read(kTenant, "s", 0, 0, 0);
  ASSERT_THAT(rd.status(), IsOk());
  EXPECT_EQ(rd->k, kv_[0].kf);
  EXPECT_EQ(rd->v, kv_[0].vf);
}

TEST_F(EncodingStoreTest, DemoteToTheSameEncodingIsANoOp) {
  Make(0);
  const ModelShape m = Shape(1, 1, 1, 32);
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, Plan(32, 16, Format::kINT4))
          .status(),
      IsOk());
  Fill(m, 32, 4);
  Write("s", m, 0, 32);
  const std::vector<uint8_t> before = PageOf("s", 0, 0);
  // Group 0 and 32 are the same encoding.
  Encoding same(Format::kINT4, Format::kINT4, 32);
  auto r = store_->Demote(kTenant, "s", {Target(0, same)});
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->pages_reencoded, 0u);
  EXPECT_EQ(r->bytes_delta, 0);
  EXPECT_EQ(PageOf("s", 0, 0), before);
}

TEST_F(EncodingStoreTest, DemoteRejectsBadInputWithoutChange) {
  Make(0);
  const ModelShape m = Shape(2, 1, 1, 96);
  const PageShape shape{16, 1, 96};
  ASSERT_THAT(
      store_->AllocatePages(kTenant, "s", m, 16, Plan(48, 16, Format::kINT2))
          .status(),
      IsOk());
  Fill(m, 48, 6);
  Write("s", m, 0, 48);
  const auto before = *store_->Describe("s");
  const InventorySnapshot inv0 = store_->Inventory();
  const std::vector<uint8_t> page0 = PageOf("s", 0, 1);
  auto demote = [&](absl::string_view tenant, absl::string_view seq,
                    const std::vector<BlockSpec>& blocks) {
    return store_->Demote(tenant, seq, blocks).status();
  };
  EXPECT_THAT(
      demote(kTenant, "nope", {Target(0, Format::kINT2)}),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("sequence_id=\"nope\"")));
  EXPECT_THAT(demote("tenant-b", "s", {Target(0, Format::kINT2)}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("tenant_id=\"tenant-b\"")));
  EXPECT_THAT(demote(kTenant, "s", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks is empty")));
  // A later entry failing leaves the earlier (valid) ones unapplied too.
  EXPECT_THAT(demote(kTenant, "s",
                     {Target(0, Format::kBF16), Target(7, Format::kINT2)}),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("blocks[1].index=7"),
                             HasSubstr("has 3 blocks"))));
  BlockSpec wrong = Target(1, Format::kBF16);
  wrong.lineage_id = 555;
  EXPECT_THAT(demote(kTenant, "s", {Target(0, Format::kBF16), wrong}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("blocks[1] (index=1) lineage_id=555"),
                             HasSubstr("lineage_id=101"))));
  EXPECT_THAT(demote(kTenant, "s",
                     {Target(0, Format::kBF16), Target(0, Format::kINT4)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[1].index=0 is named more than once")));
  // TQ needs a power-of-two head_dim (96 is not).
  EXPECT_THAT(demote(kTenant, "s", {Target(2, Format::kTQ3)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[0]: encoding tq3"),
                             HasSubstr("head_dim=96"))));
  BlockSpec bad = Target(0, Format::kINT4);
  bad.encoding.k = static_cast<Format>(9);
  EXPECT_THAT(demote(kTenant, "s", {bad}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].format=9")));
  bad = Target(0, Format::kINT4);
  bad.encoding.group = 16;
  EXPECT_THAT(demote(kTenant, "s", {bad}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].group_size=16")));

  // Oversized: promoting all 3 blocks x 2 layers to BF16 needs 6 BF16 pages;
  // leave exactly 5 free.
  const size_t bf16 = kernels::PageBytes(Format::kBF16, shape);
  std::vector<Page*> held;
  for (;;) {
    auto p = alloc_->Allocate(Format::kBF16, bf16, PageUse::kTarget);
    if (!p.ok()) break;
    held.push_back(*p);
  }
  ASSERT_GE(held.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    alloc_->Unref(held.back());
    held.pop_back();
  }
  const uint64_t used = store_->Inventory().used_bytes;
  EXPECT_THAT(demote(kTenant, "s",
                     {Target(0, Format::kBF16), Target(1, Format::kBF16),
                      Target(2, Format::kBF16)}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("Demote sequence_id=\"s\" needs 6 "
                                       "new pages"),
                             HasSubstr("exhausted"))));
  EXPECT_EQ(store_->Inventory().used_bytes, used);
  for (Page* p : held) alloc_->Unref(p);

  // A block shared with a fork is refused.
  ASSERT_THAT(store_->Fork(kTenant, "s", "kid", 48, Plan(48, 16, Format::kINT2))
                  .status(),
              IsOk());
  EXPECT_THAT(demote(kTenant, "s", {Target(1, Format::kBF16)}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("lineage_id=101"),
                             HasSubstr("shared by 2 sequences"))));
  EXPECT_THAT(
      demote(kTenant, "kid", {Target(1, Format::kBF16)}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("shared")));
  ASSERT_THAT(store_->Free(kTenant, "kid").status(), IsOk());

  // Nothing changed.
  const auto after = *store_->Describe("s");
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(after.blocks[i].encoding, before.blocks[i].encoding);
  }
  EXPECT_EQ(after.sealed, before.sealed);
  EXPECT_EQ(PageOf("s", 0, 1), page0);
  EXPECT_EQ(store_->Inventory().used_bytes, inv0.used_bytes);

  // And once unshared, demotion goes through.
  EXPECT_THAT(demote(kTenant, "s", {Target(1, Format::kINT4)}), IsOk());
  EXPECT_EQ(store_->Describe("s")->blocks[1].encoding.k, Format::kINT4);
}

}  // namespace
}  // namespace triax::worker
