#include "kernels/ref/kv_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
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

size_t Elems(const PageShape& s, int n) {
  return static_cast<size_t>(n) * s.heads * s.head_dim;
}

std::string Name(const Encoding& e) {
  char buf[64];
  return EncodingName(e, buf, sizeof(buf));
}

double Nmse(const std::vector<float>& want, const std::vector<float>& got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return num / den;
}

// Encodes 64 pages of T tokens each from N(0,1) data and returns the
// normalized MSE of K and V after decode, against the float data before
// BF16 rounding.
void MeasureRoundTrip(const Encoding& e, const PageShape& s, uint32_t seed,
                      double* k_nmse, double* v_nmse) {
  std::mt19937 rng(seed);
  std::vector<float> k_all, v_all, k_dec_all, v_dec_all;
  std::vector<uint8_t> page(PageBytes(e, s));
  for (int p = 0; p < 64; ++p) {
    const auto kf = testing::RandomFloat(rng, Elems(s, s.tokens));
    const auto vf = testing::RandomFloat(rng, Elems(s, s.tokens));
    std::vector<uint16_t> k(kf.size()), v(vf.size());
    for (size_t i = 0; i < kf.size(); ++i) {
      k[i] = FloatToBf16(kf[i]);
      v[i] = FloatToBf16(vf[i]);
    }
    EncodePage(e, s, k.data(), v.data(), s.tokens, page.data());
    std::vector<float> kd(kf.size(), NAN), vd(vf.size(), NAN);
    DecodePage(e, s, page.data(), s.tokens, kd.data(), vd.data());
    k_all.insert(k_all.end(), kf.begin(), kf.end());
    v_all.insert(v_all.end(), vf.begin(), vf.end());
    k_dec_all.insert(k_dec_all.end(), kd.begin(), kd.end());
    v_dec_all.insert(v_dec_all.end(), vd.begin(), vd.end());
  }
  *k_nmse = Nmse(k_all, k_dec_all);
  *v_nmse = Nmse(v_all, v_dec_all);
}

// Normalized MSE against the original float data (before BF16 rounding), on
// N(0,1) inputs, T=32, H=2, D=128, 64 pages, seed 7. Measured K / V:
//   bf16                         K 2.76e-06  V 2.76e-06
//   fp8                          K 0.000703  V 0.000704
//   int8                         K 2.4e-05  V 2.39e-05
//   int4                         K 0.00613  V 0.00612
//   int2                         K 0.155  V 0.154
//   tq4                          K 0.00932  V 0.00925
//   tq3                          K 0.034  V 0.0339
//   tq2                          K 0.116  V 0.116
//   k=int8,v=int8,scale=fp8      K 0.000511  V 0.000499
//   k=int8,v=int8,g=64           K 2.4e-05  V 3.04e-05
//   k=int8,v=int8,g=64,scale=fp8 K 0.000511  V 0.00029
//   k=int8,v=int8,g=128          K 2.4e-05  V 3.71e-05
//   k=int8,v=int8,g=128,scale=fp8 K 0.000511  V 0.000177
//   k=int4,v=int4,scale=fp8      K 0.00664  V 0.00663
//   k=int4,v=int4,g=64           K 0.00613  V 0.00801
//   k=int4,v=int4,g=64,scale=fp8 K 0.00664  V 0.00837
//   k=int4,v=int4,g=128          K 0.00613  V 0.00993
//   k=int4,v=int4,g=128,scale=fp8 K 0.00664  V 0.0102
//   k=int2,v=int2,scale=fp8      K 0.155  V 0.155
//   k=int2,v=int2,g=64           K 0.155  V 0.202
//   k=int2,v=int2,g=64,scale=fp8 K 0.155  V 0.202
//   k=int2,v=int2,g=128          K 0.155  V 0.25
//   k=int2,v=int2,g=128,scale=fp8 K 0.155  V 0.25
//   k=int4,v=int2                K 0.00613  V 0.154
//   k=tq4,v=int8                 K 0.00932  V 2.39e-05
// Budgets are about 1.3x the larger of K and V (and at least 5e-6): an
// off-by-one in a scale, a wrong group or a lost bit fails them.
// FP8 metadata costs little at 2-4 bits but much at 8 bits, where a
// 3-bit-mantissa zero point is far coarser than the step (scale/255).
TEST(KvRefTest, RoundTripErrorBudgetPerEncoding) {
  const PageShape s{32, 2, 128};
  struct Budget {
    Encoding e;
    double max_nmse;
  };
  const ScaleDtype f16 = ScaleDtype::kFP16, f8 = ScaleDtype::kFP8;
  const Budget budgets[] = {
      {Encoding(Format::kBF16), 5.1e-06},
      {Encoding(Format::kFP8), 0.00092},
      {Encoding(Format::kINT8), 3.2e-05},
      {Encoding(Format::kINT4), 0.008},
      {Encoding(Format::kINT2), 0.21},
      {Encoding(Format::kTQ4), 0.013},
      {Encoding(Format::kTQ3), 0.045},
      {Encoding(Format::kTQ2), 0.16},
      {Encoding(Format::kINT8, Format::kINT8, 32, f8), 0.00067},
      {Encoding(Format::kINT8, Format::kINT8, 64, f16), 4e-05},
      {Encoding(Format::kINT8, Format::kINT8, 64, f8), 0.00067},
      {Encoding(Format::kINT8, Format::kINT8, 128, f16), 4.9e-05},
      {Encoding(Format::kINT8, Format::kINT8, 128, f8), 0.00067},
      {Encoding(Format::kINT4, Format::kINT4, 32, f8), 0.0087},
      {Encoding(Format::kINT4, Format::kINT4, 64, f16), 0.011},
      {Encoding(Format::kINT4, Format::kINT4, 64, f8), 0.011},
      {Encoding(Format::kINT4, Format::kINT4, 128, f16), 0.013},
      {Encoding(Format::kINT4, Format::kINT4, 128, f8), 0.014},
      {Encoding(Format::kINT2, Format::kINT2, 32, f8), 0.21},
      {Encoding(Format::kINT2, Format::kINT2, 64, f16), 0.27},
      {Encoding(Format::kINT2, Format::kINT2, 64, f8), 0.27},
      {Encoding(Format::kINT2, Format::kINT2, 128, f16), 0.33},
      {Encoding(Format::kINT2, Format::kINT2, 128, f8), 0.33},
      {Encoding(Format::kINT4, Format::kINT2), 0.21},
      {Encoding(Format::kTQ4, Format::kINT8), 0.013},
  };
  for (const Budget& b : budgets) {
    ASSERT_EQ(ValidateEncoding(b.e, s), nullptr);
    double kn, vn;
    MeasureRoundTrip(b.e, s, 7, &kn, &vn);
    std::printf("//   %-28s K %.3g  V %.3g\n", Name(b.e).c_str(), kn, vn);
    EXPECT_LE(kn, b.max_nmse) << Name(b.e);
    EXPECT_LE(vn, b.max_nmse) << Name(b.e);
    EXPECT_GT(kn, 0.0) << Name(b.e);  // N(0,1) data is not representable
    EXPECT_GT(vn, 0.0) << Name(b.e);
  }
}

// Every INT-decoded element lies within half a quantization step of its
// input, plus the rounding of the stored scale and zero (FP16: 2^-11
// relative; FP8: 2^-4 relative, and a rounded-up zero or rounded-down scale
// clamps codes at the group's edges, so the bound adds rel * range and
// rel * magnitude).
TEST(KvRefTest, IntElementErrorWithinHalfStep) {
  std::mt19937 rng(11);
  for (Format f : {Format::kINT8, Format::kINT4, Format::kINT2}) {
    for (int g : {32, 64, 128}) {
      for (ScaleDtype sd : {ScaleDtype::kFP16, ScaleDtype::kFP8}) {
        const Encoding e(f, f, g, sd);
        for (int T : {9, 64}) {
          const PageShape s{T, 3, 128};
          if (ValidateEncoding(e, s) != nullptr) continue;
          const int n = T == 9 ? 9 : 50, H = 3, D = 128;
          const int gk = s.KeyGroup(e), gv = s.ValueGroup(e);
          const auto k = RandomBf16(rng, Elems(s, n), 3.f);
          const auto v = RandomBf16(rng, Elems(s, n), 3.f);
          std::vector<uint8_t> page(PageBytes(e, s));
          EncodePage(e, s, k.data(), v.data(), n, page.data());
          std::vector<float> kd(k.size()), vd(v.size());
          DecodePage(e, s, page.data(), n, kd.data(), vd.data());
          const int qmax = (1 << FormatBits(f)) - 1;
          const double rel = sd == ScaleDtype::kFP8 ? 0.07 : 1e-3;
          auto bound = [&](float lo, float hi) {
            return 0.5 * (hi - lo) / qmax * (1 + rel) + rel * (hi - lo) +
                   rel * std::max(-lo, hi) + 1e-6;
          };
          for (int h = 0; h < H; ++h) {
            for (int t0 = 0; t0 < n; t0 += gk) {  // keys: channel x group
              for (int d = 0; d < D; ++d) {
                float lo = INFINITY, hi = -INFINITY;
                for (int t = t0; t < std::min(n, t0 + gk); ++t) {
                  lo = std::min(lo, Bf16ToFloat(k[(t * H + h) * D + d]));
                  hi = std::max(hi, Bf16ToFloat(k[(t * H + h) * D + d]));
                }
                for (int t = t0; t < std::min(n, t0 + gk); ++t) {
                  const size_t i = (t * H + h) * D + d;
                  ASSERT_LE(std::fabs(kd[i] - Bf16ToFloat(k[i])), bound(lo, hi))
                      << Name(e) << " T=" << T << " K h=" << h << " d=" << d
                      << " t=" << t;
                }
              }
            }
            for (int t = 0; t < n; ++t) {  // values: token x group
              for (int d0 = 0; d0 < D; d0 += gv) {
                float lo = INFINITY, hi = -INFINITY;
                for (int d = d0; d < d0 + gv; ++d) {
                  lo = std::min(lo, Bf16ToFloat(v[(t * H + h) * D + d]));
                  hi = std::max(hi, Bf16ToFloat(v[(t * H + h) * D + d]));
                }
                for (int d = d0; d < d0 + gv; ++d) {
                  const size_t i = (t * H + h) * D + d;
                  ASSERT_LE(std::fabs(vd[i] - Bf16ToFloat(v[i])), bound(lo, hi))
                      << Name(e) << " V h=" << h << " d=" << d << " t=" << t;
                }
              }
            }
          }
        }
      }
    }
  }
}

// FP8 format: each element within half an E4M3 step (2^-4 relative, or the
// subnormal step 2^-9 * scale) of its input; the per-head scale is
// amax / 448, so the largest element of each head maps to +-448 exactly.
TEST(KvRefTest, Fp8ElementError) {
  std::mt19937 rng(12);
  const PageShape s{16, 2, 64};
  const int H = 2, D = 64;
  const auto k = RandomBf16(rng, Elems(s, 16), 5.f);
  const auto v = RandomBf16(rng, Elems(s, 16), 0.01f);
  std::vector<uint8_t> page(PageBytes(Format::kFP8, s));
  EncodePage(Format::kFP8, s, k.data(), v.data(), 16, page.data());
  std::vector<float> kd(k.size()), vd(v.size());
  DecodePage(Format::kFP8, s, page.data(), 16, kd.data(), vd.data());
  for (const auto* pair : {&k, &v}) {
    const auto& in = *pair;
    const auto& out = pair == &k ? kd : vd;
    for (int h = 0; h < H; ++h) {
      float amax = 0;
      for (int t = 0; t < 16; ++t) {
        for (int d = 0; d < D; ++d) {
          amax =
              std::max(amax, std::fabs(Bf16ToFloat(in[(t * H + h) * D + d])));
        }
      }
      const float scale = amax / 448.f;
      for (int t = 0; t < 16; ++t) {
        for (int d = 0; d < D; ++d) {
          const size_t i = (t * H + h) * D + d;
          const float x = Bf16ToFloat(in[i]);
          ASSERT_LE(
              std::fabs(out[i] - x),
              std::max(std::fabs(x) / 16.f, scale * std::ldexp(1.f, -10)) *
                  1.0001f)
              << "h=" << h << " t=" << t << " d=" << d;
          if (std::fabs(x) == amax) {
            ASSERT_NEAR(std::fabs(out[i]), amax, 1e-6f * amax);
          }
        }
      }
    }
  }
}

TEST(KvRefTest, Bf16IsExact) {
  std::mt19937 rng(3);
  const PageShape s{16, 4, 24};
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
  std::memcpy(&stored, page.data() + (size_t{2 * 16 + 5} * 24 + 3) * 2, 2);
  EXPECT_EQ(stored, k[(5 * 4 + 2) * 24 + 3]);
}

// Constant channels (keys, per token group) and constant groups (values)
// have scale 0 and decode exactly when the constant is representable in the
// metadata type (multiples of 1/4 below 4 are, in FP8 and FP16 alike).
TEST(KvRefTest, ConstantInputDecodesExactly) {
  const PageShape s{16, 2, 64};
  const int n = 16, H = 2, D = 64;
  std::vector<uint16_t> k(Elems(s, n)), v(Elems(s, n));
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < D; ++d) {
        k[(t * H + h) * D + d] = FloatToBf16(0.25f * (d % 16 - 8) + h);
        v[(t * H + h) * D + d] =
            FloatToBf16(-0.25f * (t % 8) + static_cast<float>(d >> 5));
      }
    }
  }
  for (Format f :
       {Format::kBF16, Format::kINT8, Format::kINT4, Format::kINT2}) {
    for (ScaleDtype sd : {ScaleDtype::kFP16, ScaleDtype::kFP8}) {
      const Encoding e(f, f, 0, sd);
      std::vector<uint8_t> page(PageBytes(e, s));
      EncodePage(e, s, k.data(), v.data(), n, page.data());
      std::vector<float> kd(k.size()), vd(v.size());
      DecodePage(e, s, page.data(), n, kd.data(), vd.data());
      EXPECT_EQ(kd, Bf16VecToFloat(k)) << Name(e);
      EXPECT_EQ(vd, Bf16VecToFloat(v)) << Name(e);
    }
  }
}

// The encodings most tests loop over: every format for K and V alike, plus
// K != V pairs and group / scale variants.
std::vector<Encoding> TestEncodings() {
  std::vector<Encoding> out;
  for (Format f : kAllFormats) out.emplace_back(f);
  out.emplace_back(Format::kINT4, Format::kINT2);
  out.emplace_back(Format::kFP8, Format::kINT4);
  out.emplace_back(Format::kTQ4, Format::kINT8);
  out.emplace_back(Format::kINT8, Format::kTQ3);
  out.emplace_back(Format::kBF16, Format::kTQ2);
  out.emplace_back(Format::kINT4, Format::kINT4, 64, ScaleDtype::kFP8);
  out.emplace_back(Format::kINT2, Format::kINT8, 128, ScaleDtype::kFP16);
  return out;
}

// A page prefilled with garbage encodes to the same bytes as a clean one:
// padding and slots past num_tokens are zeroed.
TEST(KvRefTest, PartialPagesAndDeterministicBytes) {
  std::mt19937 rng(5);
  for (const Encoding& e : TestEncodings()) {
    for (int T : {1, 16}) {
      for (int n : {1, 5, 16}) {
        if (n > T) continue;
        const PageShape s{T, 3, 32};
        ASSERT_EQ(ValidateEncoding(e, s), nullptr) << Name(e);
        const auto k = RandomBf16(rng, Elems(s, n));
        const auto v = RandomBf16(rng, Elems(s, n));
        std::vector<uint8_t> a(PageBytes(e, s), 0xab), b(PageBytes(e, s), 0);
        EncodePage(e, s, k.data(), v.data(), n, a.data());
        EncodePage(e, s, k.data(), v.data(), n, b.data());
        EXPECT_EQ(a, b) << Name(e) << " T=" << T << " n=" << n;
        // Code rows of tokens >= n are zero in both tensors.
        const PageLayout l = ComputeLayout(e, s);
        for (int x = 0; x < 2; ++x) {
          const TensorLayout& tl = x == 0 ? l.k : l.v;
          const size_t row = s.head_dim * FormatBits(x == 0 ? e.k : e.v) / 8;
          for (int h = 0; h < s.heads; ++h) {
            for (int t = n; t < T; ++t) {
              for (size_t j = 0; j < row; ++j) {
                ASSERT_EQ(a[tl.codes + (h * T + t) * row + j], 0) << Name(e);
              }
            }
          }
        }
        std::vector<float> kd(k.size(), NAN), vd(v.size(), NAN);
        DecodePage(e, s, a.data(), n, kd.data(), vd.data());
        const auto kf = Bf16VecToFloat(k), vf = Bf16VecToFloat(v);
        double worst = 0;
        for (size_t i = 0; i < kd.size(); ++i) {
          ASSERT_TRUE(std::isfinite(kd[i]) && std::isfinite(vd[i])) << Name(e);
          worst = std::max({worst, double(std::fabs(kd[i] - kf[i])),
                            double(std::fabs(vd[i] - vf[i]))});
        }
        const bool exact = e.k == Format::kBF16 && e.v == Format::kBF16;
        EXPECT_LE(worst, exact ? 0.0 : 2.5) << Name(e);
        if (n == 1 && IsIntFormat(e.k) && e.scale_dtype == ScaleDtype::kFP16) {
          // One token: channels are constant and FP16 holds BF16 values.
          EXPECT_EQ(kd, kf) << Name(e);
        }
      }
    }
  }
}

TEST(KvRefTest, DecodeOutputsAreOptional) {
  std::mt19937 rng(9);
  const PageShape s{8, 2, 16};
  const auto k = RandomBf16(rng, Elems(s, 8));
  const auto v = RandomBf16(rng, Elems(s, 8));
  for (const Encoding& e : TestEncodings()) {
    std::vector<uint8_t> page(PageBytes(e, s));
    EncodePage(e, s, k.data(), v.data(), 8, page.data());
    std::vector<float> k1(k.size()), v1(v.size()), k2(k.size(), NAN),
        v2(v.size(), NAN);
    DecodePage(e, s, page.data(), 8, k1.data(), v1.data());
    DecodePage(e, s, page.data(), 8, k2.data(), nullptr);
    DecodePage(e, s, page.data(), 8, nullptr, v2.data());
    EXPECT_EQ(k1, k2) << Name(e);
    EXPECT_EQ(v1, v2) << Name(e);
  }
}

// K and V sections are independent: a K!=V page's K bytes equal those of
// a page encoded with K's format for both, and likewise for V (when the
// other tensor has the same size, the offsets agree too).
TEST(KvRefTest, MixedEncodingTensorsMatchUniformOnes) {
  std::mt19937 rng(19);
  const PageShape s{16, 2, 64};
  const auto k = RandomBf16(rng, Elems(s, 16));
  const auto v = RandomBf16(rng, Elems(s, 16));
  for (const Encoding& e : TestEncodings()) {
    std::vector<uint8_t> mixed(PageBytes(e, s));
    EncodePage(e, s, k.data(), v.data(), 16, mixed.data());
    const Encoding ke(e.k, e.k, e.group, e.scale_dtype);
    const Encoding ve(e.v, e.v, e.group, e.scale_dtype);
    std::vector<uint8_t> kp(PageBytes(ke, s)), vp(PageBytes(ve, s));
    EncodePage(ke, s, k.data(), v.data(), 16, kp.data());
    EncodePage(ve, s, k.data(), v.data(), 16, vp.data());
    const PageLayout lm = ComputeLayout(e, s), lv = ComputeLayout(ve, s);
    // K: bytes [0, end of K) agree.
    EXPECT_TRUE(
        std::equal(mixed.begin(), mixed.begin() + lm.v.codes, kp.begin()))
        << Name(e);
    // V: the V section of the mixed page equals the uniform page's V.
    EXPECT_EQ(lm.total - lm.v.codes, lv.total - lv.v.codes) << Name(e);
    EXPECT_TRUE(std::equal(mixed.begin() + lm.v.codes, mixed.end(),
                           vp.begin() + lv.v.codes))
        << Name(e);
  }
}

TEST(KvRefTest, WriteBf16TokenMatchesEncode) {
  std::mt19937 rng(13);
  const PageShape s{7, 3, 16};
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

// Attention cases use TestEncodings()[i] for every page, or (kMixed) a
// random encoding per page from kMixPool.
constexpr int kMixed = -1;
const std::vector<Encoding>& MixPool() {
  static const std::vector<Encoding> pool = [] {
    std::vector<Encoding> p = TestEncodings();
    p.emplace_back(Format::kTQ2, Format::kFP8, 0, ScaleDtype::kFP8);
    p.emplace_back(Format::kINT8, Format::kINT2, 64, ScaleDtype::kFP8);
    return p;
  }();
  return pool;
}

std::string CaseName(int enc) {
  if (enc == kMixed) return "mixed";
  std::string n = Name(TestEncodings()[enc]);
  for (char& c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return n;
}

struct BuiltSequence {
  PageShape shape;
  std::vector<std::vector<uint8_t>> pages;
  std::vector<PageRef> refs;
  std::vector<float> k_orig, v_orig;  // token-major [tokens][H][D]
  std::vector<float> k_dec, v_dec;    // decoded, same shape
};

BuiltSequence Build(int enc, int total_tokens, int page_tokens, int kv_heads,
                    int head_dim, std::mt19937& rng) {
  BuiltSequence b;
  b.shape = PageShape{page_tokens, kv_heads, head_dim};
  const size_t tok = static_cast<size_t>(kv_heads) * head_dim;
  const auto k = RandomBf16(rng, total_tokens * tok);
  const auto v = RandomBf16(rng, total_tokens * tok);
  b.k_orig = Bf16VecToFloat(k);
  b.v_orig = Bf16VecToFloat(v);
  b.k_dec.assign(k.size(), NAN);
  b.v_dec.assign(v.size(), NAN);
  std::uniform_int_distribution<int> pick(0, MixPool().size() - 1);
  for (int start = 0; start < total_tokens; start += page_tokens) {
    const int n = std::min(page_tokens, total_tokens - start);
    const Encoding e =
        enc == kMixed ? MixPool()[pick(rng)] : TestEncodings()[enc];
    EXPECT_EQ(ValidateEncoding(e, b.shape), nullptr) << Name(e);
    b.pages.emplace_back(PageBytes(e, b.shape));
    EncodePage(e, b.shape, k.data() + start * tok, v.data() + start * tok, n,
               b.pages.back().data());
    DecodePage(e, b.shape, b.pages.back().data(), n,
               b.k_dec.data() + start * tok, b.v_dec.data() + start * tok);
    b.refs.push_back(PageRef{e, b.pages.back().data(), n});
  }
  return b;
}

// Attention output error on the grid below (N(0,1) q, K, V; scale
// 1/sqrt(D); 2 KV heads), worst case over lengths 54/97, page sizes
// 1/7/16/32, GQA 1/2/4/8, D 64/128, 2 cut points each;
// rel_l2 = ||out - ref|| / ||ref||:
//   vs float64 attention on the DECODED values (TQ pages: decoded to the
//     original domain by DecodePage, while attention works rotated): max_abs
//     <= 7.8e-07 for every encoding (float32 accumulation only).
//     Budget 2e-5.
//   vs float64 attention on the original BF16 values, measured worst rel_l2
//   and budget (about 1.3x):
//     mixed                          0.555      budget 0.73
//     bf16                           3.58e-07   budget 1e-05
//     fp8                            0.048      budget 0.063
//     int8                           0.00708    budget 0.0093
//     int4                           0.119      budget 0.16
//     int2                           0.842      budget 1.1
//     tq4                            0.176      budget 0.23
//     tq3                            0.328      budget 0.43
//     tq2                            0.549      budget 0.72
//     k_int4_v_int2                  0.457      budget 0.6
//     k_fp8_v_int4                   0.0941     budget 0.13
//     k_tq4_v_int8                   0.127      budget 0.17
//     k_int8_v_tq3                   0.221      budget 0.29
//     k_bf16_v_tq2                   0.376      budget 0.49
//     k_int4_v_int4_g_64_scale_fp8   0.139      budget 0.19
//     k_int2_v_int8_g_128            0.536      budget 0.7
// The quantized errors are inherent: the output averages many V rows,
// shrinking signal and per-token noise alike, so rel_l2 tracks
// sqrt(value nmse) plus the score perturbation from K. The tight
// decoded-value oracle is the one that catches kernel bugs; the
// original-value budgets catch a wrong head, group, rotation or dropped
// page (rel_l2 >= 1) for every encoding but int2, whose worst case (short
// sequences, GQA 1) is itself 0.84: there the decoded-value oracle is the
// sharp check.
double OrigBudget(int enc) {
  if (enc == kMixed) return 0.73;
  const Encoding e = TestEncodings()[enc];
  const struct {
    Encoding e;
    double budget;
  } kBudgets[] = {
      {Encoding(Format::kBF16), 1e-05},
      {Encoding(Format::kFP8), 0.063},
      {Encoding(Format::kINT8), 0.0093},
      {Encoding(Format::kINT4), 0.16},
      {Encoding(Format::kINT2), 1.1},
      {Encoding(Format::kTQ4), 0.23},
      {Encoding(Format::kTQ3), 0.43},
      {Encoding(Format::kTQ2), 0.72},
      {Encoding(Format::kINT4, Format::kINT2), 0.6},
      {Encoding(Format::kFP8, Format::kINT4), 0.13},
      {Encoding(Format::kTQ4, Format::kINT8), 0.17},
      {Encoding(Format::kINT8, Format::kTQ3), 0.29},
      {Encoding(Format::kBF16, Format::kTQ2), 0.49},
      {Encoding(Format::kINT4, Format::kINT4, 64, ScaleDtype::kFP8), 0.19},
      {Encoding(Format::kINT2, Format::kINT8, 128, ScaleDtype::kFP16), 0.7},
  };
  for (const auto& b : kBudgets) {
    if (b.e == e) return b.budget;
  }
  ADD_FAILURE() << "no budget for " << Name(e);
  return 0;
}

// Worst errors per encoding over the grid, printed once at the end so the
// measured numbers above can be refreshed.
struct Worst {
  double dec_max_abs = 0, orig_rel_l2 = 0;
};
std::map<int, Worst>& WorstTable() {
  static std::map<int, Worst> t;
  return t;
}
void RecordWorst(int enc, double dec, double orig) {
  Worst& w = WorstTable()[enc];
  w.dec_max_abs = std::max(w.dec_max_abs, dec);
  w.orig_rel_l2 = std::max(w.orig_rel_l2, orig);
}
class PrintWorst : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& [enc, w] : WorstTable()) {
      std::printf("//   %-24s dec max_abs %.2g  orig rel_l2 %.3g\n",
                  CaseName(enc).c_str(), w.dec_max_abs, w.orig_rel_l2);
    }
  }
};
const auto* const kPrintWorst =
    ::testing::AddGlobalTestEnvironment(new PrintWorst);

class AttentionTest
    : public ::testing::TestWithParam<std::tuple<int, int, int, int, int>> {};

TEST_P(AttentionTest, MatchesFloat64Reference) {
  const auto [enc, total, T, group, D] = GetParam();
  const int kv_heads = 2;
  const int n_q = kv_heads * group;
  const uint32_t seed =
      1000u + total * 31u + T * 7u + group * 3u + D + 101u * (enc + 1);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  BuiltSequence b = Build(enc, total, T, kv_heads, D, rng);
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

    const auto want_dec =
        AttentionF64(q, b.k_dec, b.v_dec, n_q, kv_heads, D, attend, scale);
    const ErrorStats dec = Compare(out.data(), want_dec);
    const ErrorStats orig = Compare(
        out.data(),
        AttentionF64(q, b.k_orig, b.v_orig, n_q, kv_heads, D, attend, scale));
    // Guards: no NaN slipped through, the output is not zero, and the
    // reference itself is far from zero (so "all zeros" cannot match it).
    ASSERT_TRUE(dec.all_finite);
    EXPECT_GT(dec.norm, 1e-3);
    double want_norm = 0;
    for (double x : want_dec) want_norm += x * x;
    EXPECT_GT(std::sqrt(want_norm), 1e-2);
    EXPECT_LE(dec.max_abs, 2e-5);
    EXPECT_LE(orig.rel_l2, OrigBudget(enc)) << CaseName(enc);
    RecordWorst(enc, dec.max_abs, orig.rel_l2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, AttentionTest,
    ::testing::Combine(
        ::testing::Range(kMixed, static_cast<int>(TestEncodings().size())),
        ::testing::Values(54, 97), ::testing::Values(1, 7, 16, 32),
        ::testing::Values(1, 2, 4, 8), ::testing::Values(64, 128)),
    [](const auto& info) {
      return CaseName(std::get<0>(info.param)) + "_L" +
             std::to_string(std::get<1>(info.param)) + "_T" +
             std::to_string(std::get<2>(info.param)) + "_G" +
             std::to_string(std::get<3>(info.param)) + "_D" +
             std::to_string(std::get<4>(info.param));
    });

// A page past attend_tokens is never read: poisoning it changes nothing.
TEST(KvRefAttentionTest, PagesPastAttendAreNotRead) {
  std::mt19937 rng(21);
  BuiltSequence b = Build(kMixed, 40, 16, 2, 64, rng);
  const auto q = testing::RandomFloat(rng, size_t{4} * 64);
  std::vector<float> out1(size_t{4} * 64, NAN), out2(size_t{4} * 64, NAN);
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
