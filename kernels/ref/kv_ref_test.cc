#include "kernels/ref/kv_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/testing/kv_test_util.h"

namespace triax::kernels {
namespace {

using testing::AttentionF64;
using testing::Bf16VecToFloat;
using testing::Compare;
using testing::ErrorStats;
using testing::RandomBf16;

constexpr Format kAllFormats[] = {Format::kBF16, Format::kINT4, Format::kINT2};

size_t Elems(const PageShape& s, int n) {
  return static_cast<size_t>(n) * s.heads * s.head_dim;
}

double Nmse(const std::vector<float>& want, const std::vector<float>& got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return num / den;
}

// Encodes `pages` pages of T tokens each from Gaussian data and returns the
// normalized MSE of K and V after decode.
void MeasureRoundTrip(Format f, const PageShape& s, uint32_t seed,
                      double* k_nmse, double* v_nmse) {
  std::mt19937 rng(seed);
  std::vector<float> k_all, v_all, k_dec_all, v_dec_all;
  std::vector<uint8_t> page(PageBytes(f, s));
  for (int p = 0; p < 64; ++p) {
    const auto kf = testing::RandomFloat(rng, Elems(s, s.tokens));
    const auto vf = testing::RandomFloat(rng, Elems(s, s.tokens));
    std::vector<uint16_t> k(kf.size()), v(vf.size());
    for (size_t i = 0; i < kf.size(); ++i) {
      k[i] = FloatToBf16(kf[i]);
      v[i] = FloatToBf16(vf[i]);
    }
    EncodePage(f, s, k.data(), v.data(), s.tokens, page.data());
    std::vector<float> kd(kf.size()), vd(vf.size());
    DecodePage(f, s, page.data(), s.tokens, kd.data(), vd.data());
    k_all.insert(k_all.end(), kf.begin(), kf.end());
    v_all.insert(v_all.end(), vf.begin(), vf.end());
    k_dec_all.insert(k_dec_all.end(), kd.begin(), kd.end());
    v_dec_all.insert(v_dec_all.end(), vd.begin(), vd.end());
  }
  *k_nmse = Nmse(k_all, k_dec_all);
  *v_nmse = Nmse(v_all, v_dec_all);
}

// Normalized MSE against the original float data (before BF16 rounding), on
// N(0,1) inputs, T=16, H=2, D=128, G=32, 64 pages. Measured (seed 7):
//   bf16: K 2.7e-6  V 2.8e-6   (BF16 rounding only)     budget 5e-6
//   int4: K 4.2e-3  V 6.1e-3                             budget 1e-2
//   int2: K 0.107   V 0.155                              budget 0.22
// Values are worse than keys at INT2: a 32-channel group spans a wider
// range than 16 tokens of one channel. Budgets are ~1.4-1.8x the measurement:
// an off-by-one in the scale, a wrong group or a lost bit fails them.
TEST(KvRefTest, RoundTripErrorBudgetPerFormat) {
  const PageShape s{16, 2, 128, 0};
  struct Budget {
    Format f;
    double max_nmse;
  };
  for (const Budget& b :
       {Budget{Format::kBF16, 5e-6}, Budget{Format::kINT4, 1e-2},
        Budget{Format::kINT2, 0.22}}) {
    double kn, vn;
    MeasureRoundTrip(b.f, s, 7, &kn, &vn);
    std::printf("seed 7 %s nmse K %.3g V %.3g\n", FormatName(b.f), kn, vn);
    EXPECT_LE(kn, b.max_nmse) << FormatName(b.f);
    EXPECT_LE(vn, b.max_nmse) << FormatName(b.f);
    EXPECT_GT(kn, 0.0);  // data is not exactly representable: must not be 0
  }
}

// Every decoded element lies within half a quantization step of its input,
// plus FP16 rounding of the stored scale and zero.
TEST(KvRefTest, ElementErrorWithinHalfStep) {
  const uint32_t seed = 11;
  std::mt19937 rng(seed);
  for (Format f : {Format::kINT4, Format::kINT2}) {
    for (int g : {8, 16, 64}) {
      const PageShape s{9, 3, 64, g};
      const int n = 9, H = 3, D = 64;
      const auto k = RandomBf16(rng, Elems(s, n), 3.f);
      const auto v = RandomBf16(rng, Elems(s, n), 3.f);
      std::vector<uint8_t> page(PageBytes(f, s));
      EncodePage(f, s, k.data(), v.data(), n, page.data());
      std::vector<float> kd(k.size()), vd(v.size());
      DecodePage(f, s, page.data(), n, kd.data(), vd.data());
      const int qmax = (1 << FormatBits(f)) - 1;
      auto bound = [&](float lo, float hi) {
        return 0.5 * (hi - lo) / qmax + 1e-3 * ((hi - lo) + std::max(-lo, hi));
      };
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {  // keys: per channel over tokens
          float lo = INFINITY, hi = -INFINITY;
          for (int t = 0; t < n; ++t) {
            const float x = Bf16ToFloat(k[(t * H + h) * D + d]);
            lo = std::min(lo, x);
            hi = std::max(hi, x);
          }
          for (int t = 0; t < n; ++t) {
            const size_t i = (t * H + h) * D + d;
            ASSERT_LE(std::fabs(kd[i] - Bf16ToFloat(k[i])), bound(lo, hi))
                << FormatName(f) << " K h=" << h << " d=" << d << " t=" << t;
          }
        }
        for (int t = 0; t < n; ++t) {  // values: per token per group
          for (int g0 = 0; g0 < D; g0 += g) {
            float lo = INFINITY, hi = -INFINITY;
            for (int d = g0; d < g0 + g; ++d) {
              const float x = Bf16ToFloat(v[(t * H + h) * D + d]);
              lo = std::min(lo, x);
              hi = std::max(hi, x);
            }
            for (int d = g0; d < g0 + g; ++d) {
              const size_t i = (t * H + h) * D + d;
              ASSERT_LE(std::fabs(vd[i] - Bf16ToFloat(v[i])), bound(lo, hi))
                  << FormatName(f) << " V h=" << h << " d=" << d << " t=" << t;
            }
          }
        }
      }
    }
  }
}

TEST(KvRefTest, Bf16IsExact) {
  std::mt19937 rng(3);
  const PageShape s{16, 4, 24, 0};
  const auto k = RandomBf16(rng, Elems(s, 13));
  const auto v = RandomBf16(rng, Elems(s, 13));
  std::vector<uint8_t> page(PageBytes(Format::kBF16, s));
  EncodePage(Format::kBF16, s, k.data(), v.data(), 13, page.data());
  std::vector<float> kd(k.size()), vd(v.size());
  DecodePage(Format::kBF16, s, page.data(), 13, kd.data(), vd.data());
  EXPECT_EQ(kd, Bf16VecToFloat(k));
  EXPECT_EQ(vd, Bf16VecToFloat(v));
  // Head-major placement: token 5, head 2, dim 3 of K.
  uint16_t stored;
  std::memcpy(&stored, page.data() + ((2 * 16 + 5) * 24 + 3) * 2, 2);
  EXPECT_EQ(stored, k[(5 * 4 + 2) * 24 + 3]);
}

// Constant channels (keys) and constant groups (values) have scale 0 and
// decode exactly; any value in BF16 within FP16 range is FP16-exact.
TEST(KvRefTest, ConstantInputDecodesExactly) {
  const PageShape s{16, 2, 64, 0};
  const int n = 16, H = 2, D = 64;
  std::vector<uint16_t> k(Elems(s, n)), v(Elems(s, n));
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < D; ++d) {
        k[(t * H + h) * D + d] =
            FloatToBf16(0.375f * (d - 20) + h);  // per channel
        v[(t * H + h) * D + d] =
            FloatToBf16(-1.5f * t + (d / 32) * 7.f);  // per group
      }
    }
  }
  for (Format f : kAllFormats) {
    std::vector<uint8_t> page(PageBytes(f, s));
    EncodePage(f, s, k.data(), v.data(), n, page.data());
    std::vector<float> kd(k.size()), vd(v.size());
    DecodePage(f, s, page.data(), n, kd.data(), vd.data());
    EXPECT_EQ(kd, Bf16VecToFloat(k)) << FormatName(f);
    EXPECT_EQ(vd, Bf16VecToFloat(v)) << FormatName(f);
  }
}

// A page prefilled with garbage encodes to the same bytes as a clean one:
// padding and slots past num_tokens are zeroed.
TEST(KvRefTest, PartialPagesAndDeterministicBytes) {
  std::mt19937 rng(5);
  for (Format f : kAllFormats) {
    for (int T : {1, 16}) {
      for (int n : {1, 5, 16}) {
        if (n > T) continue;
        const PageShape s{T, 3, 32, 0};
        const auto k = RandomBf16(rng, Elems(s, n));
        const auto v = RandomBf16(rng, Elems(s, n));
        std::vector<uint8_t> a(PageBytes(f, s), 0xab), b(PageBytes(f, s), 0x00);
        EncodePage(f, s, k.data(), v.data(), n, a.data());
        EncodePage(f, s, k.data(), v.data(), n, b.data());
        EXPECT_EQ(a, b) << FormatName(f) << " T=" << T << " n=" << n;
        // Rows of tokens >= n are zero in both code sections.
        const PageLayout l = ComputeLayout(f, s);
        const size_t row = s.head_dim * FormatBits(f) / 8;
        for (int h = 0; h < s.heads; ++h) {
          for (int t = n; t < T; ++t) {
            for (size_t j = 0; j < row; ++j) {
              ASSERT_EQ(a[l.k_codes + (h * T + t) * row + j], 0);
              ASSERT_EQ(a[l.v_codes + (h * T + t) * row + j], 0);
            }
          }
        }
        // Decoding n tokens matches a page holding only those n tokens:
        // a partial page's key scale covers exactly its n tokens.
        std::vector<float> kd(k.size()), vd(v.size());
        DecodePage(f, s, a.data(), n, kd.data(), vd.data());
        const auto kf = Bf16VecToFloat(k), vf = Bf16VecToFloat(v);
        const double tol =
            f == Format::kBF16 ? 0.0 : (f == Format::kINT4 ? 0.35 : 1.8);
        for (size_t i = 0; i < kd.size(); ++i) {
          ASSERT_LE(std::fabs(kd[i] - kf[i]), tol)
              << FormatName(f) << " i=" << i;
          ASSERT_LE(std::fabs(vd[i] - vf[i]), tol)
              << FormatName(f) << " i=" << i;
        }
        if (n == 1) {  // one token: key channels are constant, so exact
          EXPECT_EQ(kd, kf) << FormatName(f);
        }
      }
    }
  }
}

TEST(KvRefTest, DecodeOutputsAreOptional) {
  std::mt19937 rng(9);
  const PageShape s{8, 2, 16, 0};
  const auto k = RandomBf16(rng, Elems(s, 8));
  const auto v = RandomBf16(rng, Elems(s, 8));
  for (Format f : kAllFormats) {
    std::vector<uint8_t> page(PageBytes(f, s));
    EncodePage(f, s, k.data(), v.data(), 8, page.data());
    std::vector<float> k1(k.size()), v1(v.size()), k2(k.size(), NAN),
        v2(v.size(), NAN);
    DecodePage(f, s, page.data(), 8, k1.data(), v1.data());
    DecodePage(f, s, page.data(), 8, k2.data(), nullptr);
    DecodePage(f, s, page.data(), 8, nullptr, v2.data());
    EXPECT_EQ(k1, k2);
    EXPECT_EQ(v1, v2);
  }
}

TEST(KvRefTest, WriteBf16TokenMatchesEncode) {
  std::mt19937 rng(13);
  const PageShape s{7, 3, 16, 0};
  const auto k = RandomBf16(rng, Elems(s, 7));
  const auto v = RandomBf16(rng, Elems(s, 7));
  std::vector<uint8_t> encoded(PageBytes(Format::kBF16, s));
  EncodePage(Format::kBF16, s, k.data(), v.data(), 7, encoded.data());
  std::vector<uint8_t> written(encoded.size(), 0);
  for (int t = 0; t < 7; ++t) {
    WriteBf16Token(s, k.data() + Elems(s, t), v.data() + Elems(s, t), t,
                   written.data());
  }
  EXPECT_EQ(written, encoded);
}

// ---- Attention ------------------------------------------------------------

enum class Mix { kBF16, kINT4, kINT2, kMixed };
const char* MixName(Mix m) {
  switch (m) {
    case Mix::kBF16:
      return "bf16";
    case Mix::kINT4:
      return "int4";
    case Mix::kINT2:
      return "int2";
    case Mix::kMixed:
      return "mixed";
  }
  return "?";
}

struct AttnCase {
  Mix mix;
  int total_tokens;
  int page_tokens;
  int group;  // query heads per KV head
  int head_dim;
};

struct BuiltSequence {
  PageShape shape;
  std::vector<std::vector<uint8_t>> pages;
  std::vector<PageRef> refs;
  std::vector<float> k_orig, v_orig;  // token-major [tokens][H][D]
  std::vector<float> k_dec, v_dec;    // decoded, same shape
};

BuiltSequence Build(const AttnCase& c, int kv_heads, std::mt19937& rng) {
  BuiltSequence b;
  b.shape = PageShape{c.page_tokens, kv_heads, c.head_dim, 0};
  const size_t tok = static_cast<size_t>(kv_heads) * c.head_dim;
  const auto k = RandomBf16(rng, c.total_tokens * tok);
  const auto v = RandomBf16(rng, c.total_tokens * tok);
  b.k_orig = Bf16VecToFloat(k);
  b.v_orig = Bf16VecToFloat(v);
  b.k_dec.resize(k.size());
  b.v_dec.resize(v.size());
  std::uniform_int_distribution<int> pick(0, 2);
  for (int start = 0; start < c.total_tokens; start += c.page_tokens) {
    const int n = std::min(c.page_tokens, c.total_tokens - start);
    Format f =
        kAllFormats[c.mix == Mix::kMixed ? pick(rng) : static_cast<int>(c.mix)];
    b.pages.emplace_back(PageBytes(f, b.shape));
    EncodePage(f, b.shape, k.data() + start * tok, v.data() + start * tok, n,
               b.pages.back().data());
    DecodePage(f, b.shape, b.pages.back().data(), n,
               b.k_dec.data() + start * tok, b.v_dec.data() + start * tok);
    b.refs.push_back(PageRef{f, b.pages.back().data(), n});
  }
  return b;
}

// Attention output error, measured on the grid below (N(0,1) q, K, V;
// scale 1/sqrt(D); 2 KV heads), worst case over all 288 cases x 2 cut points;
// rel_l2 = ||out - ref|| / ||ref||:
//   vs float64 attention on the DECODED values: max_abs <= 9.4e-7 for every
//     format (float32 accumulation only). Budget 1e-5.
//   vs float64 attention on the original BF16 values:
//     bf16  rel_l2 5.3e-7            budget 1e-5
//     int4  rel_l2 0.07 .. 0.153     budget 0.25
//     int2  rel_l2 0.35 .. 0.66      budget 0.85
//     mixed rel_l2 <= 0.50           budget 0.85
// The quantized errors are inherent: the output averages many Gaussian V
// rows, shrinking signal and per-token quantization noise alike, so rel_l2
// is about sqrt(value nmse) (0.155 for INT2). The tight decoded-value oracle
// is the one that catches kernel bugs; the original-value budgets catch a
// wrong head, group or dropped page (rel_l2 >= 1).
double OrigBudget(Mix m) {
  switch (m) {
    case Mix::kBF16:
      return 1e-5;
    case Mix::kINT4:
      return 0.25;
    case Mix::kINT2:
      return 0.85;
    case Mix::kMixed:
      return 0.85;
  }
  return 0;
}

class AttentionTest
    : public ::testing::TestWithParam<std::tuple<Mix, int, int, int, int>> {};

TEST_P(AttentionTest, MatchesFloat64Reference) {
  const auto [mix, total, T, group, D] = GetParam();
  const AttnCase c{mix, total, T, group, D};
  const int kv_heads = 2;
  const int n_q = kv_heads * group;
  const uint32_t seed =
      1000u + total * 31u + T * 7u + group * 3u + D + static_cast<int>(mix);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  BuiltSequence b = Build(c, kv_heads, rng);
  const auto q = testing::RandomFloat(rng, static_cast<size_t>(n_q) * D);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Full length, and a causal cut in the middle of a page.
  for (long attend :
       {static_cast<long>(total), std::max<long>(1, total - T / 2 - 1)}) {
    SCOPED_TRACE("attend " + std::to_string(attend));
    std::vector<float> out(static_cast<size_t>(n_q) * D, NAN);
    DecodeParams p;
    p.q = q.data();
    p.out = out.data();
    p.n_q_heads = n_q;
    p.shape = b.shape;
    p.scale = scale;
    p.pages = b.refs.data();
    p.num_pages = static_cast<int>(b.refs.size());
    p.attend_tokens = attend;
    DecodeAttentionRef(p);

    const ErrorStats dec = Compare(
        out.data(),
        AttentionF64(q, b.k_dec, b.v_dec, n_q, kv_heads, D, attend, scale));
    const ErrorStats orig = Compare(
        out.data(),
        AttentionF64(q, b.k_orig, b.v_orig, n_q, kv_heads, D, attend, scale));
    ASSERT_TRUE(dec.all_finite);
    EXPECT_GT(dec.norm, 1e-3);
    EXPECT_LE(dec.max_abs, 1e-5);
    EXPECT_LE(orig.rel_l2, OrigBudget(mix)) << MixName(mix);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, AttentionTest,
    ::testing::Combine(::testing::Values(Mix::kBF16, Mix::kINT4, Mix::kINT2,
                                         Mix::kMixed),
                       ::testing::Values(54, 97), ::testing::Values(1, 16, 7),
                       ::testing::Values(1, 2, 4, 8),
                       ::testing::Values(8, 64, 128)),
    [](const auto& info) {
      return std::string(MixName(std::get<0>(info.param))) + "_L" +
             std::to_string(std::get<1>(info.param)) + "_T" +
             std::to_string(std::get<2>(info.param)) + "_G" +
             std::to_string(std::get<3>(info.param)) + "_D" +
             std::to_string(std::get<4>(info.param));
    });

// A page past attend_tokens is never read: poisoning it changes nothing.
TEST(KvRefAttentionTest, PagesPastAttendAreNotRead) {
  std::mt19937 rng(21);
  const AttnCase c{Mix::kMixed, 40, 16, 2, 64};
  BuiltSequence b = Build(c, 2, rng);
  const auto q = testing::RandomFloat(rng, 4 * 64);
  std::vector<float> out1(4 * 64, NAN), out2(4 * 64, NAN);
  DecodeParams p;
  p.q = q.data();
  p.out = out1.data();
  p.n_q_heads = 4;
  p.shape = b.shape;
  p.scale = 0.125f;
  p.pages = b.refs.data();
  p.num_pages = 3;
  p.attend_tokens = 20;  // page 1, token 4
  DecodeAttentionRef(p);
  b.refs[2].data = nullptr;  // would crash if touched
  p.pages = b.refs.data();
  p.out = out2.data();
  DecodeAttentionRef(p);
  ASSERT_TRUE(std::isfinite(out1[0]));
  EXPECT_EQ(out1, out2);
}

}  // namespace
}  // namespace triax::kernels
