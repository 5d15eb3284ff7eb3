// Element-level (de)quantization of page sections, shared by the codec
// kernels (codec.cu) and the CUDA-core attention kernel: INT/FP8 metadata
// loads and stores, the quantizer of kernels/ref/kv_ref.cc (MakeQuant,
// Quantize) and LoadRow8, 8 consecutive dims of one row of any non-TQ
// tensor.
//
// Numerics that must match the CPU reference bit for bit (encode) use
// explicitly rounded intrinsics (__fdiv_rn, __fsub_rn, rintf) so that
// nvcc's contraction into FMA cannot change a code; decode uses
// __fmul_rn / __fadd_rn for the same reason.
#pragma once

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device_primitives.cuh"
#include "kernels/layout.h"
#include "kernels/numeric.h"

namespace triax::kernels::cuda {
namespace {

constexpr float kFp16Max = 65504.f;

__device__ __forceinline__ float LoadMeta(const uint8_t* base, size_t i,
                                          ScaleDtypeCode sdt) {
  return sdt == ScaleDtypeCode::kFP8 ? Fp8E4M3ToFloat(base[i])
                                     : HalfBits(LoadU16(base + 2 * i));
}

// Same arithmetic as MakeQuant/Quantize in kernels/ref/kv_ref.cc.
struct Quant {
  float scale, zero;
  uint32_t scale_bits, zero_bits;
};

__device__ __forceinline__ Quant MakeQuant(float lo, float hi, int qmax,
                                           ScaleDtypeCode sdt) {
  const float lim = sdt == ScaleDtypeCode::kFP8 ? 448.f : kFp16Max;
  float zero = fminf(fmaxf(lo, -lim), lim);
  float scale = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(qmax));
  if (!(scale > 0.f)) scale = 0.f;
  scale = fminf(scale, lim);
  Quant q;
  if (sdt == ScaleDtypeCode::kFP8) {
    q.scale_bits = FloatToFp8E4M3Bits(scale);
    q.zero_bits = FloatToFp8E4M3Bits(zero);
    q.scale = Fp8E4M3ToFloat(q.scale_bits);
    q.zero = Fp8E4M3ToFloat(q.zero_bits);
  } else {
    q.scale_bits = __half_as_ushort(__float2half_rn(scale));
    q.zero_bits = __half_as_ushort(__float2half_rn(zero));
    q.scale = HalfBits(q.scale_bits);
    q.zero = HalfBits(q.zero_bits);
  }
  return q;
}

__device__ __forceinline__ void StoreMeta(uint8_t* base, size_t i,
                                          uint32_t bits, ScaleDtypeCode sdt) {
  if (sdt == ScaleDtypeCode::kFP8) {
    base[i] = static_cast<uint8_t>(bits);
  } else {
    *reinterpret_cast<uint16_t*>(base + 2 * i) = static_cast<uint16_t>(bits);
  }
}

__device__ __forceinline__ uint32_t Quantize(float x, const Quant& q,
                                             int qmax) {
  if (q.scale == 0.f) return 0;
  float c = rintf(__fdiv_rn(__fsub_rn(x, q.zero), q.scale));
  if (!(c >= 0.f)) c = 0.f;
  if (c > static_cast<float>(qmax)) c = static_cast<float>(qmax);
  return static_cast<uint32_t>(c);
}

// Dims [d0, d0 + 8) of row (h, t) of one tensor, dequantized. Row byte
// offsets are multiples of the load width because D % 8 == 0 and sections
// are 16-byte aligned. Same operations as DecodePage (explicit rounding so
// no FMA contraction changes a value).
__device__ __forceinline__ void LoadRow8(
    FormatCode f, bool key, const UnpackedEncoding& e, const TensorLayout& L,
    const uint8_t* page, const PageShape& s, int h, int t, int d0, float* out) {
  const int T = s.tokens, D = s.head_dim;
  const size_t row = static_cast<size_t>(h) * T + t;
  const uint8_t* codes = page + L.codes;
  if (f == FormatCode::kBF16) {
    const uint4 w = *reinterpret_cast<const uint4*>(codes + (row * D + d0) * 2);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = Bf16Bits(u[i] & 0xffffu);
      out[2 * i + 1] = Bf16Bits(u[i] >> 16);
    }
    return;
  }
  uint32_t c[8];
  if (f == FormatCode::kFP8 || f == FormatCode::kINT8) {
    const uint2 w = *reinterpret_cast<const uint2*>(codes + row * D + d0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      c[i] = (w.x >> (8 * i)) & 0xffu;
      c[4 + i] = (w.y >> (8 * i)) & 0xffu;
    }
  } else if (f == FormatCode::kINT4) {
    const uint32_t w =
        *reinterpret_cast<const uint32_t*>(codes + row * (D / 2) + d0 / 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = (w >> (4 * i)) & 0xfu;
  } else {
    const uint32_t w =
        *reinterpret_cast<const uint16_t*>(codes + row * (D / 4) + d0 / 4);
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = (w >> (2 * i)) & 0x3u;
  }
  if (f == FormatCode::kFP8) {
    const float scale = *reinterpret_cast<const float*>(
        page + L.scale + 4 * static_cast<size_t>(h));
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(Fp8E4M3ToFloat(c[i]), scale);
    return;
  }
  if (key) {
    const int gk = s.KeyGroup(e);
    const size_t base = (static_cast<size_t>(h) * (T / gk) + t / gk) * D + d0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = __fadd_rn(
          __fmul_rn(static_cast<float>(c[i]),
                    LoadMeta(page + L.scale, base + i, e.scale_dtype)),
          LoadMeta(page + L.zero, base + i, e.scale_dtype));
    }
    return;
  }
  const int gv = s.ValueGroup(e);
  const size_t m = row * (D / gv) + d0 / gv;
  const float sc = LoadMeta(page + L.scale, m, e.scale_dtype);
  const float z = LoadMeta(page + L.zero, m, e.scale_dtype);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    out[i] = __fadd_rn(__fmul_rn(static_cast<float>(c[i]), sc), z);
}

}  // namespace
}  // namespace triax::kernels::cuda
