// Scalar conversions shared by the CPU reference and host code. Round to
// nearest even; NaN stays NaN; overflow goes to infinity (FP16) or saturates
// (FP8 E4M3, which has no infinity).
//
// The FP8 E4M3 pair is TRIAX_HOST_DEVICE: the CUDA kernels encode and decode
// FP8 codes and metadata with this code, so their bytes equal the CPU
// reference's. On the device the few floating-point steps use explicitly
// rounded intrinsics (nvcc must not contract them into FMAs).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace triax::kernels {
namespace numeric_internal {

TRIAX_HOST_DEVICE_FORCEINLINE float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

TRIAX_HOST_DEVICE_FORCEINLINE uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// x * 512 (exact: a power-of-two scale of a value below 2^-6) rounded to the
// nearest integer, ties to even.
TRIAX_HOST_DEVICE_FORCEINLINE float RoundTimes512(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(__fmul_rn(x, 512.f));
#else
  return std::nearbyint(x * 512.f);
#endif
}

}  // namespace numeric_internal

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
// included) and maps NaN to 0x7f. Fp8E4M3ToFloat is exact (NaN codes give
// the quiet NaN 0x7fc00000 whatever their sign); it reads the code from the
// low 8 bits of c (device code holds codes in 32-bit registers).
// FloatToFp8E4M3's code zero-extended to 32 bits (device code keeps codes in
// 32-bit registers; a uint8_t result costs 16-bit instructions there).
TRIAX_HOST_DEVICE_FORCEINLINE uint32_t FloatToFp8E4M3Bits(float f) {
  const uint32_t u = numeric_internal::FloatToBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;          // NaN
  if (abs >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and Inf): saturate
  if (abs < 0x3c800000u) {                      // below 2^-6: subnormal
    // value / 2^-9, rounded to nearest even; 8 becomes the smallest normal.
    return sign | static_cast<uint32_t>(numeric_internal::RoundTimes512(
                      numeric_internal::BitsToFloat(abs)));
  }
  // Normal: keep 3 mantissa bits, round to nearest even (a carry into the
  // exponent is the correct result). 448 < x < 464 rounds down to 448 and
  // x >= 448 was handled above, so the result never reaches 0x7f.
  const uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);
  const uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  return sign | (code < 0x7eu ? code : 0x7eu);
}

TRIAX_HOST_DEVICE_FORCEINLINE uint8_t FloatToFp8E4M3(float f) {
  return static_cast<uint8_t>(FloatToFp8E4M3Bits(f));
}

TRIAX_HOST_DEVICE_FORCEINLINE float Fp8E4M3ToFloat(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15u && m == 7u) return numeric_internal::BitsToFloat(0x7fc00000u);
  const float v =
      e == 0 ? static_cast<float>(m) * (1.f / 512.f)
             : numeric_internal::BitsToFloat(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -v : v;
}

}  // namespace triax::kernels
