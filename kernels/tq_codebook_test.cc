#include "kernels/tq_codebook.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"

namespace triax::kernels {
namespace {

TEST(TqCodebookTest, SignsAreFixedAndBalanced) {
  for (int d : {16, 32, 64, 128, 256}) {
    const int8_t* s = TqSigns(d);
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s, TqSigns(d));  // same table every call
    int plus = 0;
    for (int i = 0; i < d; ++i) {
      ASSERT_TRUE(s[i] == 1 || s[i] == -1);
      plus += s[i] == 1;
    }
    // Not all one sign: a constant sequence would make R a plain Hadamard.
    EXPECT_GT(plus, d / 8) << d;
    EXPECT_LT(plus, d - d / 8) << d;
  }
  EXPECT_EQ(TqSigns(8), nullptr);
  EXPECT_EQ(TqSigns(48), nullptr);
  EXPECT_EQ(TqSigns(512), nullptr);
  EXPECT_EQ(TqCodebook(5, 128), nullptr);
  EXPECT_EQ(TqCodebook(4, 100), nullptr);
}

// R is orthonormal: it preserves norms and inner products, R^T R = I, and
// it mixes: a basis vector spreads to +-1/sqrt(d) everywhere.
TEST(TqCodebookTest, RotationIsOrthonormal) {
  std::mt19937 rng(17);
  std::normal_distribution<float> n01;
  for (int d : {16, 64, 128, 256}) {
    std::vector<float> x(d), y(d);
    for (float& v : x) v = n01(rng);
    for (float& v : y) v = n01(rng);
    double xx = 0, xy = 0;
    for (int i = 0; i < d; ++i) {
      xx += double(x[i]) * x[i];
      xy += double(x[i]) * y[i];
    }
    std::vector<float> rx = x, ry = y;
    TqRotate(d, rx.data());
    TqRotate(d, ry.data());
    double rxx = 0, rxy = 0, moved = 0;
    for (int i = 0; i < d; ++i) {
      rxx += double(rx[i]) * rx[i];
      rxy += double(rx[i]) * ry[i];
      moved += std::fabs(rx[i] - x[i]);
    }
    EXPECT_NEAR(rxx, xx, 1e-5 * xx) << d;
    EXPECT_NEAR(rxy, xy, 1e-4 * std::sqrt(xx * d)) << d;
    EXPECT_GT(moved, 0.1 * d) << d;
    TqRotateInverse(d, rx.data());
    for (int i = 0; i < d; ++i) ASSERT_NEAR(rx[i], x[i], 1e-5) << d;
    std::vector<float> e(d, 0.f);
    e[3] = 1.f;
    TqRotate(d, e.data());
    for (int i = 0; i < d; ++i) {
      ASSERT_NEAR(std::fabs(e[i]), 1.0 / std::sqrt(d), 1e-6) << d;
    }
  }
}

// Levels ascend, are symmetric about 0 and scale like 1/sqrt(d). The 2-level
// (1-bit) optimum is known in closed form but not offered; for 2 bits at
// d = 128 the levels are close to the Gaussian Lloyd-Max levels
// +-0.4528, +-1.510 times sigma = 1/sqrt(128).
TEST(TqCodebookTest, CodebookShape) {
  for (int bits : {2, 3, 4}) {
    for (int d : {16, 32, 64, 128, 256}) {
      const float* c = TqCodebook(bits, d);
      ASSERT_NE(c, nullptr);
      EXPECT_EQ(c, TqCodebook(bits, d));
      const int n = 1 << bits;
      for (int i = 0; i + 1 < n; ++i) ASSERT_LT(c[i], c[i + 1]);
      for (int i = 0; i < n; ++i) ASSERT_NEAR(c[i], -c[n - 1 - i], 1e-7);
      EXPECT_LT(c[n - 1], 1.0f);
    }
  }
  const float* c = TqCodebook(2, 128);
  const double sigma = 1.0 / std::sqrt(128.0);
  EXPECT_NEAR(c[2] / sigma, 0.4528, 0.01);
  EXPECT_NEAR(c[3] / sigma, 1.510, 0.02);
}

// The acceptance test: E ||x - x_hat||^2 over random unit vectors at
// d = 128 within 5% of the TurboQuant numbers 0.1160 / 0.0340 / 0.0093
// (2 / 3 / 4 bits). Vectors go through the real page path (EncodePage with
// BF16 input, FP16 norm, DecodePage), so the measurement includes BF16
// input rounding (~1e-5 relative) and the FP16 norm (~3e-4 relative).
// Measured (seed 23, 8192 vectors): tq2 0.11563, tq3 0.03401, tq4 0.00933
// (ratios 0.997 / 1.000 / 1.003 to the targets). A codebook for the wrong d,
// a non-orthonormal rotation or a lost code bit moves these by far more
// than 5%.
TEST(TqCodebookTest, MseOnRandomUnitVectorsMatchesTurboQuant) {
  constexpr int kD = 128, kVectors = 8192;
  const PageShape s{64, 1, kD};
  std::mt19937 rng(23);
  std::normal_distribution<double> n01;
  struct Target {
    Format f;
    double mse;
  };
  for (const Target& tgt :
       {Target{Format::kTQ2, 0.1160}, Target{Format::kTQ3, 0.0340},
        Target{Format::kTQ4, 0.0093}}) {
    std::vector<uint16_t> k(static_cast<size_t>(s.tokens) * kD);
    std::vector<float> x(k.size()), dec(k.size());
    std::vector<uint8_t> page(PageBytes(tgt.f, s));
    double sum = 0;
    for (int p = 0; p < kVectors / s.tokens; ++p) {
      for (int t = 0; t < s.tokens; ++t) {
        double n2 = 0;
        std::vector<double> g(kD);
        for (double& v : g) {
          v = n01(rng);
          n2 += v * v;
        }
        for (int d = 0; d < kD; ++d) {
          k[t * kD + d] = FloatToBf16(static_cast<float>(g[d] / std::sqrt(n2)));
          x[t * kD + d] = Bf16ToFloat(k[t * kD + d]);
        }
      }
      EncodePage(tgt.f, s, k.data(), k.data(), s.tokens, page.data());
      DecodePage(tgt.f, s, page.data(), s.tokens, dec.data(), nullptr);
      for (size_t i = 0; i < x.size(); ++i) {
        sum += (double(dec[i]) - x[i]) * (double(dec[i]) - x[i]);
      }
    }
    const double mse = sum / kVectors;
    std::printf("%s d=128 mse %.5f (target %.4f, ratio %.3f)\n",
                FormatName(tgt.f), mse, tgt.mse, mse / tgt.mse);
    EXPECT_NEAR(mse, tgt.mse, 0.05 * tgt.mse) << FormatName(tgt.f);
  }
}

}  // namespace
}  // namespace triax::kernels
