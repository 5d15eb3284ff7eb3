// Scalar conversions shared by the CPU reference and host code. Round to
// nearest even; NaN stays NaN; overflow goes to infinity (FP16) or saturates
// (FP8 E4M3, which has no infinity).
#pragma once

#include <cstdint>
#include <cstring>

namespace triax::kernels {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

// FP8 E4M3 (OCP "fn" variant: bias 7, no infinities, 0x7f / 0xff are NaN,
// largest finite value 448, smallest subnormal 2^-9).
// FloatToFp8E4M3 rounds to nearest even, saturates to +-448 (infinities
// included) and maps NaN to 0x7f. Fp8E4M3ToFloat is exact.
uint8_t FloatToFp8E4M3(float f);
float Fp8E4M3ToFloat(uint8_t c);

}  // namespace triax::kernels
