#include "kernels/numeric.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace triax::kernels {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

bool IsFp16Nan(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}

// Value of an FP16 bit pattern computed independently of numeric.cc.
double Fp16Value(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant ? NAN : sign * INFINITY;
  return sign * std::ldexp(1024 + mant, exp - 25);
}

TEST(Fp16Test, EveryBitPatternRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = Fp16ToFloat(h);
    if (IsFp16Nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      const uint16_t back = FloatToFp16(f);
      ASSERT_TRUE(IsFp16Nan(back)) << std::hex << i;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), Fp16Value(h)) << std::hex << i;
    ASSERT_EQ(FloatToFp16(f), h) << std::hex << i;
  }
}

TEST(Fp16Test, RoundsToNearestEven) {
  // Between 1.0 (0x3c00) and 1 + 2^-10 (0x3c01): halfway ties to even.
  EXPECT_EQ(FloatToFp16(1.f + std::ldexp(1.f, -11)), 0x3c00);
  EXPECT_EQ(FloatToFp16(1.f + 3 * std::ldexp(1.f, -11)), 0x3c02);
  EXPECT_EQ(FloatToFp16(1.f + std::ldexp(1.f, -11) + std::ldexp(1.f, -20)),
            0x3c01);
  EXPECT_EQ(FloatToFp16(1.f + std::ldexp(1.f, -11) - std::ldexp(1.f, -20)),
            0x3c00);
  EXPECT_EQ(FloatToFp16(-2.f), 0xc000);
  EXPECT_EQ(FloatToFp16(-0.f), 0x8000);
  EXPECT_EQ(FloatToFp16(0.1f), 0x2e66);
  // Mantissa carry into the exponent: 2 - 2^-12 rounds up to 2.0.
  EXPECT_EQ(FloatToFp16(2.f - std::ldexp(1.f, -12)), 0x4000);
}

TEST(Fp16Test, OverflowGoesToInfinity) {
  EXPECT_EQ(FloatToFp16(65504.f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65519.f), 0x7bff);  // below the halfway point 65520
  EXPECT_EQ(FloatToFp16(65520.f), 0x7c00);  // tie rounds to even = infinity
  EXPECT_EQ(FloatToFp16(1e6f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-1e6f), 0xfc00);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToFp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(IsFp16Nan(FloatToFp16(std::numeric_limits<float>::quiet_NaN())));
}

TEST(Fp16Test, Subnormals) {
  EXPECT_EQ(FloatToFp16(std::ldexp(1.f, -24)), 0x0001);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.f, -25)), 0x0000);      // tie to even (0)
  EXPECT_EQ(FloatToFp16(3 * std::ldexp(1.f, -25)), 0x0002);  // 1.5 -> 2
  EXPECT_EQ(FloatToFp16(std::ldexp(1.f, -14)), 0x0400);      // smallest normal
  EXPECT_EQ(FloatToFp16(std::ldexp(1.f, -14) - std::ldexp(1.f, -25)), 0x0400);
  // 1022.5 * 2^-24 ties to the even 1022; 1022.75 rounds up to 1023.
  EXPECT_EQ(FloatToFp16(std::ldexp(1.f, -14) - 3 * std::ldexp(1.f, -25)),
            0x03fe);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.f, -14) - 5 * std::ldexp(1.f, -26)),
            0x03ff);
  EXPECT_EQ(FloatToFp16(1e-10f), 0x0000);
  EXPECT_EQ(FloatToFp16(-std::ldexp(1.f, -24)), 0x8001);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(Fp16ToFloat(0x83ff), -1023 * std::ldexp(1.f, -24));
}

// Random floats against a nearest-neighbour search over all finite FP16
// values (ties to the even pattern). Seed 20240611.
TEST(Fp16Test, RandomFloatsRoundToNearest) {
  std::vector<double> pos;  // positive finite fp16 values, ascending by bits
  for (uint32_t h = 0; h < 0x7c00; ++h)
    pos.push_back(Fp16Value(static_cast<uint16_t>(h)));
  std::mt19937 rng(20240611);
  std::uniform_int_distribution<uint32_t> bits(0, 0x477fe000u);  // |x| < 65520
  for (int i = 0; i < 200000; ++i) {
    const float x = FromBits(bits(rng));
    const auto it =
        std::lower_bound(pos.begin(), pos.end(), static_cast<double>(x));
    size_t hi = it - pos.begin();
    uint16_t want;
    if (hi < pos.size() && pos[hi] == x) {
      want = static_cast<uint16_t>(hi);
    } else {
      ASSERT_GT(hi, 0u);
      const double dlo = x - pos[hi - 1], dhi = pos[hi] - x;
      if (dlo < dhi || (dlo == dhi && (hi - 1) % 2 == 0)) {
        want = static_cast<uint16_t>(hi - 1);
      } else {
        want = static_cast<uint16_t>(hi);
      }
    }
    ASSERT_EQ(FloatToFp16(x), want)
        << "x=" << x << " bits=" << std::hex << Bits(x);
    ASSERT_EQ(FloatToFp16(-x), want | 0x8000) << "x=" << -x;
  }
}

TEST(Bf16Test, EveryBitPatternRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = Bf16ToFloat(h);
    EXPECT_EQ(Bits(f), i << 16);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f)))) << std::hex << i;
    } else {
      ASSERT_EQ(FloatToBf16(f), h) << std::hex << i;
    }
  }
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.f + std::ldexp(1.f, -8)), 0x3f80);      // tie -> even
  EXPECT_EQ(FloatToBf16(1.f + 3 * std::ldexp(1.f, -8)), 0x3f82);  // tie -> even
  EXPECT_EQ(FloatToBf16(1.f + std::ldexp(1.f, -8) + std::ldexp(1.f, -20)),
            0x3f81);
  EXPECT_EQ(FloatToBf16(-1.f), 0xbf80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()),
            0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  // A signalling NaN whose payload sits in the low 16 bits stays NaN.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7f800001u)))));
  // Subnormal floats keep their upper bits.
  EXPECT_EQ(FloatToBf16(FromBits(0x00010000u)), 0x0001);
}

// Value of an FP8 E4M3 code computed independently of numeric.cc.
double Fp8Value(uint8_t c) {
  const int exp = (c >> 3) & 0xf;
  const int mant = c & 7;
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  if (exp == 15 && mant == 7) return NAN;
  if (exp == 0) return sign * std::ldexp(mant, -9);
  return sign * std::ldexp(8 + mant, exp - 10);
}

TEST(Fp8Test, EveryCodeRoundTrips) {
  int nans = 0;
  for (int i = 0; i < 256; ++i) {
    const uint8_t c = static_cast<uint8_t>(i);
    const float f = Fp8E4M3ToFloat(c);
    if ((c & 0x7f) == 0x7f) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_EQ(FloatToFp8E4M3(f), 0x7f) << std::hex << i;
      ++nans;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), Fp8Value(c)) << std::hex << i;
    // -0 (0x80) encodes back to itself: the sign is kept.
    ASSERT_EQ(FloatToFp8E4M3(f), c) << std::hex << i;
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.f, -6));
}

// Every float between two adjacent codes goes to the nearer one, ties to the
// even code; checked at the midpoint and just either side of it, for every
// pair of adjacent finite positive codes and their negatives.
TEST(Fp8Test, RoundsToNearestEven) {
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    const float hi = Fp8E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);  // exact: few mantissa bits
    const uint8_t even = (c % 2 == 0) ? c : c + 1;
    ASSERT_EQ(FloatToFp8E4M3(mid), even) << c;
    ASSERT_EQ(FloatToFp8E4M3(-mid), even | 0x80) << c;
    ASSERT_EQ(FloatToFp8E4M3(std::nextafter(mid, 0.f)), c) << c;
    ASSERT_EQ(FloatToFp8E4M3(std::nextafter(mid, 1e9f)), c + 1) << c;
    ASSERT_EQ(FloatToFp8E4M3(-std::nextafter(mid, 1e9f)), (c + 1) | 0x80) << c;
  }
  // Examples: 1 + 1/16 is a tie between 1 (0x38) and 1.125 (0x39) -> 0x38;
  // 1 + 3/16 between 1.125 and 1.25 (0x3a) -> 0x3a.
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);
  // Below half the smallest subnormal: zero, keeping the sign.
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.f, -11)), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-std::ldexp(1.f, -11)), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(3.f, -11)), 0x01);  // 0.75 ulp -> 1
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(3.f, -10)), 0x02);  // 1.5 ulp tie -> 2
}

TEST(Fp8Test, SaturatesAndMapsNanTo7f) {
  EXPECT_EQ(FloatToFp8E4M3(448.f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(463.f), 0x7e);  // would round to 448 anyway
  EXPECT_EQ(FloatToFp8E4M3(464.f), 0x7e);  // would round to 480: saturates
  EXPECT_EQ(FloatToFp8E4M3(1e6f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-1e6f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(FromBits(0x7f800001u)), 0x7f);  // signalling
  // Saturation never produces the NaN code.
  for (float f = 448.f; f < 1000.f; f += 0.25f) {
    ASSERT_EQ(FloatToFp8E4M3(f), 0x7e) << f;
    ASSERT_EQ(FloatToFp8E4M3(-f), 0xfe) << f;
  }
}

}  // namespace
}  // namespace triax::kernels
