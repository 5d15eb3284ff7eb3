#include "kernels/numeric.h"

#include <cmath>
#include <limits>

namespace triax::kernels {

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: value = mant * 2^-24
      float f = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToFp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal
    float a;
    std::memcpy(&a, &abs, 4);
    // value / 2^-24, rounded to nearest even
    const float q = std::nearbyint(std::ldexp(a, 24));
    return sign | static_cast<uint16_t>(q);
  }
  const uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  const uint32_t r = abs + rounding;
  return sign |
         static_cast<uint16_t>(((r >> 23) - 112) << 10 | ((r >> 13) & 0x3ffu));
}

uint8_t FloatToFp8E4M3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;          // NaN
  if (abs >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and Inf): saturate
  if (abs < 0x3c800000u) {                     // below 2^-6: subnormal
    float a;
    std::memcpy(&a, &abs, 4);
    // value / 2^-9, rounded to nearest even; 8 becomes the smallest normal.
    const float q = std::nearbyint(std::ldexp(a, 9));
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: keep 3 mantissa bits, round to nearest even (a carry into the
  // exponent is the correct result). 448 < x < 464 rounds down to 448 and
  // x >= 448 was handled above, so the result never reaches 0x7f.
  const uint32_t rounding = 0x7ffffu + ((abs >> 20) & 1u);
  const uint32_t r = abs + rounding;
  const uint32_t code = (((r >> 23) - 120) << 3) | ((r >> 20) & 7u);
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

float Fp8E4M3ToFloat(uint8_t c) {
  const float sign = (c & 0x80) ? -1.f : 1.f;
  const int exp = (c >> 3) & 0xf;
  const int mant = c & 7;
  if (exp == 0xf && mant == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

}  // namespace triax::kernels
