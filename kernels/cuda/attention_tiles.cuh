// Tile operations of the full-layout tensor-core attention kernel
// (MmaAttentionKernel with kSmall == false), one 16-token tile of one warp
// at a time: INT/FP8 keys straight into fp16 mma B operands (ScoresReg),
// INT/FP8 values into a swizzled fp16 tile (DecodeValuesF16), TQ tiles into
// a BF16 tile of codebook levels (DecodeStaged), and the rotation of the
// P V accumulator between the TQ and the plain value domain (RotateAcc).
// The *Any helpers switch once per tensor and tile from a runtime format
// (FormatCode) to the templates.
//
// Layout contracts: tiles are [16][kD] with 16-byte chunks swizzled by
// TileOff; a staged tile's byte ranges sit in the warp's ring (see
// attention_kernel.cuh) with each range's global alignment mod 16 kept;
// accumulators are m16n8k16 fragments (lane (g, q) = (lane / 4, lane % 4)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/device_primitives.cuh"
#include "kernels/layout.h"

namespace triax::kernels::cuda {
namespace {

// Byte offset of 16-byte chunk c of row r in a swizzled [16][kD] bf16 tile.
template <int kD>
__device__ __forceinline__ int TileOff(int r, int c) {
  constexpr int kCh = kD / 8;
  constexpr int kSw = (kCh < 8 ? kCh : 8) - 1;
  return (r * kCh + (c ^ (r & kSw))) * 16;
}

// ---- Packed FP16 dequantization (INT and FP8 tensors) ---------------------
//
// INT and FP8 keys never go through shared memory as BF16: each lane turns
// its codes straight into the fp16 B operands of mma.m16n8k16 (S = Q K^T
// with Q in fp16), two values per instruction. The reduction over dims is
// order-free, so lane q (= lane % 4) of an n-tile owns the contiguous run
// of kD / 4 dims [q * kD / 4, (q + 1) * kD / 4) of its token rows, and the
// query tile Qp is stored with the same permutation (PermDim). Pair p of a
// run (dims 2p, 2p+1) feeds k-step p / 2, register p % 2. INT and FP8
// values are dequantized into an fp16 tile (pairs of adjacent dims, the
// layout ldmatrix.trans expects) and multiplied by P in fp16.
//
// Code -> fp16 without conversions: the code bits are OR-ed into the
// mantissa of a power of two whose mantissa unit is 1 at the code's bit
// position (1024 = 0x6400 for bits 0.., 256 = 0x5C00 for bits 2.., 64 =
// 0x5400 for bits 4.., 16 = 0x4C00 for bits 6..) and that power is
// subtracted: exact, one LOP3 + one HSUB2 per two codes. The value is then
// one HFMA2 (code * scale + zero, fp16 metadata used as stored; FP8
// metadata converted exactly), rounded once to fp16.

// Logical k index L (0..kD-1) of the fp16 query tile -> physical dim.
template <int kD>
__host__ __device__ __forceinline__ int PermDim(int L) {
  const int kk = L / 16, cc = L % 16;
  const int reg = cc / 8, q = (cc % 8) / 2, half = cc % 2;
  return q * (kD / 4) + 2 * (2 * kk + reg) + half;
}

// Metadata element i (E4M3 if kFp8Meta, else fp16) as fp16, exact.
template <bool kFp8Meta>
__device__ __forceinline__ __half MetaHalf(const uint8_t* base, int i) {
  if constexpr (kFp8Meta) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(
        static_cast<__nv_fp8_storage_t>(base[i]), __NV_E4M3);
    return __half(h);
  }
  return __ushort_as_half(LoadU16(base + 2 * i));
}
// Four adjacent metadata elements i..i+3 (i a multiple of 4) as two fp16
// pairs.
template <bool kFp8Meta>
__device__ __forceinline__ void MetaQuad(const uint8_t* base, int i,
                                         __half2 (&out)[2]) {
  if constexpr (kFp8Meta) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(base + i);
    out[0] = Fp8x2ToHalf2(w);
    out[1] = Fp8x2ToHalf2(w >> 16);
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(base + 2 * i);
    out[0] = U32AsHalf2(w.x);
    out[1] = U32AsHalf2(w.y);
  }
}

// Eight adjacent metadata elements i..i+7 (i a multiple of 8) as four fp16
// pairs: one 16-byte (FP16) or 8-byte (FP8) load.
template <bool kFp8Meta>
__device__ __forceinline__ void MetaOct(const uint8_t* base, int i,
                                        __half2 (&out)[4]) {
  if constexpr (kFp8Meta) {
    const uint2 w = *reinterpret_cast<const uint2*>(base + i);
    out[0] = Fp8x2ToHalf2(w.x);
    out[1] = Fp8x2ToHalf2(w.x >> 16);
    out[2] = Fp8x2ToHalf2(w.y);
    out[3] = Fp8x2ToHalf2(w.y >> 16);
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(base + 2 * i);
    out[0] = U32AsHalf2(w.x);
    out[1] = U32AsHalf2(w.y);
    out[2] = U32AsHalf2(w.z);
    out[3] = U32AsHalf2(w.w);
  }
}

// Pair p (dims 2p, 2p+1) of a run of INT codes held in w (low bits first)
// as exact fp16 codes. p is a compile-time constant after unrolling.
template <Format F>
__device__ __forceinline__ __half2 CodePair(const uint32_t* w, int p) {
  uint32_t x, magic;
  if constexpr (F ==
                Format::kINT8) {  // int8: bytes 2p, 2p+1 under a 0x64 high byte
    x = __byte_perm(w[p / 2], 0x64646464u, (p % 2) ? 0x4342u : 0x4140u);
    magic = 0x64006400u;
  } else if constexpr (F ==
                       Format::kINT4) {  // int4: byte p, low nibble then high
    const uint32_t by = static_cast<uint32_t>(p % 4);
    const uint32_t b = __byte_perm(w[p / 4], 0u, 0x4040u | by | (by << 8));
    magic = 0x54006400u;
    x = AndOr(b, 0x00f0000fu, magic);
  } else {  // int2: byte p / 2, bit pairs 0-1 / 2-3 or 4-5 / 6-7
    const uint32_t by = static_cast<uint32_t>((p / 2) % 4);
    const uint32_t b = __byte_perm(w[p / 8], 0u, 0x4040u | by | (by << 8));
    magic = p % 2 == 0 ? 0x5c006400u : 0x4c005400u;
    x = AndOr(b, p % 2 == 0 ? 0x000c0003u : 0x00c00030u, magic);
  }
  return __hsub2(U32AsHalf2(x), U32AsHalf2(magic));
}

// S += Qp K^T for one staged tile whose keys are INT (F 2, 3, 5) or FP8
// (F 4), operands built in registers. codes: row 0 of the tile in the
// ring; sc/zr: the key group's per-channel scale/zero (INT) or the head's
// float scale (FP8, applied to S). Rows >= nt yield finite or non-finite
// garbage in their S columns, which the caller masks.
template <Format F, int kD, bool kFp8Meta>
__device__ __forceinline__ void ScoresReg(const uint8_t* codes,
                                          const uint8_t* sc, const uint8_t* zr,
                                          uint32_t qp_addr, int lane,
                                          float (&s)[2][4]) {
  constexpr int kRowBytes = kD * FormatBits(F) / 8;
  constexpr int kR = kRowBytes / 4;  // bytes of a lane's run of dims
  const int g = lane / 4, q = lane % 4;
  uint32_t w[2][kR >= 4 ? kR / 4 : 1];
  LoadRun<kR>(codes + g * kRowBytes + q * kR, w[0]);
  LoadRun<kR>(codes + (g + 8) * kRowBytes + q * kR, w[1]);
  const int m0 = q * (kD / 4);  // first channel of the run
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t af[4];
    Ldm4(qp_addr + TileOff<kD>(lane % 16, kk * 2 + lane / 16), af);
    __half2 s2[2], z2[2];
    if constexpr (F != Format::kFP8) {
      MetaQuad<kFp8Meta>(sc, m0 + 4 * kk, s2);
      MetaQuad<kFp8Meta>(zr, m0 + 4 * kk, z2);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t b[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int p = 2 * kk + r;
        if constexpr (F == Format::kFP8) {
          b[r] = Half2AsU32(Fp8x2ToHalf2(w[j][p / 2] >> (16 * (p % 2))));
        } else {
          b[r] = Half2AsU32(__hfma2(CodePair<F>(w[j], p), s2[r], z2[r]));
        }
      }
      MmaF16(s[j], af, b[0], b[1]);
    }
  }
  if constexpr (F == Format::kFP8) {
    const float f = *reinterpret_cast<const float*>(sc);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] *= f;
    }
  }
}

// Calls fn(F, M) with F the INT/FP8 format (INT4, INT2, FP8, else INT8) and
// M whether its metadata is FP8 (FP8 tensors have none), both as
// std::integral_constant, so one switch serves every *Any helper.
template <typename Fn>
__device__ __forceinline__ void DispatchIntFp8(FormatCode f, ScaleDtypeCode sdt,
                                               Fn&& fn) {
  using std::integral_constant;
  using Int4 = integral_constant<Format, Format::kINT4>;
  using Int2 = integral_constant<Format, Format::kINT2>;
  using Fp8 = integral_constant<Format, Format::kFP8>;
  using Int8 = integral_constant<Format, Format::kINT8>;
  using Fp8Meta = integral_constant<bool, true>;
  using Fp16Meta = integral_constant<bool, false>;
  const bool m8 = sdt == ScaleDtypeCode::kFP8;
  switch (f) {
    case FormatCode::kINT4:
      m8 ? fn(Int4{}, Fp8Meta{}) : fn(Int4{}, Fp16Meta{});
      break;
    case FormatCode::kINT2:
      m8 ? fn(Int2{}, Fp8Meta{}) : fn(Int2{}, Fp16Meta{});
      break;
    case FormatCode::kFP8:
      fn(Fp8{}, Fp16Meta{});
      break;
    default:
      m8 ? fn(Int8{}, Fp8Meta{}) : fn(Int8{}, Fp16Meta{});
      break;
  }
}

template <int kD>
__device__ __forceinline__ void ScoresRegAny(
    FormatCode f, const uint8_t* codes, const uint8_t* sc, const uint8_t* zr,
    ScaleDtypeCode sdt, uint32_t qp_addr, int lane, float (&s)[2][4]) {
  DispatchIntFp8(f, sdt, [&](auto F, auto M) {
    ScoresReg<decltype(F)::value, kD, decltype(M)::value>(codes, sc, zr,
                                                          qp_addr, lane, s);
  });
}

// Dequantizes one staged INT (F 2, 3, 5) or FP8 (F 4) value tile from the
// ring into a swizzled fp16 [16][kD] tile (rows >= nt repeat row nt - 1).
// sc/zr: the rows' per-group scale/zero (2^lg_gv dims per group) or the head's
// FP8 float scale (rounded to fp16, applied with one HMUL2 per pair).
template <Format F, int kD, bool kFp8Meta>
__device__ __forceinline__ void DecodeValuesF16(const uint8_t* codes,
                                                const uint8_t* sc,
                                                const uint8_t* zr, int lg_gv,
                                                int nt, uint8_t* out,
                                                int lane) {
  constexpr int kCh = kD / 8, kIt = kCh / 2;  // 16 * kCh chunks / 32 lanes
  constexpr int kB = FormatBits(F);           // bytes per 8-dim chunk
  constexpr int kRowBytes = kD * kB / 8;
  __half2 fs = __float2half2_rn(1.f);
  if constexpr (F == Format::kFP8) {
    fs = __float2half2_rn(*reinterpret_cast<const float*>(sc));
  }
  // A lane keeps one chunk column (kCh divides 32): its value group is
  // fixed, the row advances by 32 / kCh per iteration. Rows >= nt decode
  // row nt - 1 again (finite values; their probabilities are 0).
  const int per_row = kD >> lg_gv;
  if constexpr (kCh >= 4) {
    // Two adjacent chunks (16 dims, one value group: groups are >= 32
    // dims) per lane and iteration: one code load and one scale/zero pair
    // for 16 values.
    constexpr int kPc = kCh / 2, kStep = 32 / kPc;
    const int pc = lane % kPc, r0 = lane / kPc;
    const int mcol = (pc * 16) >> lg_gv;
#pragma unroll
    for (int it = 0; it < 16 / kStep; ++it) {
      const int r = r0 + it * kStep;
      const int rr = min(r, nt - 1);
      uint32_t w[kB / 2];
      LoadRun<2 * kB>(codes + rr * kRowBytes + pc * 2 * kB, w);
      uint32_t res[8];
      if constexpr (F == Format::kFP8) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          res[i] =
              Half2AsU32(__hmul2(Fp8x2ToHalf2(w[i / 2] >> (16 * (i % 2))), fs));
      } else {
        const int m = rr * per_row + mcol;
        const __half2 s2 = __half2half2(MetaHalf<kFp8Meta>(sc, m));
        const __half2 z2 = __half2half2(MetaHalf<kFp8Meta>(zr, m));
#pragma unroll
        for (int i = 0; i < 8; ++i)
          res[i] = Half2AsU32(__hfma2(CodePair<F>(w, i), s2, z2));
      }
      *reinterpret_cast<uint4*>(out + TileOff<kD>(r, 2 * pc)) =
          make_uint4(res[0], res[1], res[2], res[3]);
      *reinterpret_cast<uint4*>(out + TileOff<kD>(r, 2 * pc + 1)) =
          make_uint4(res[4], res[5], res[6], res[7]);
    }
    return;
  }
  const int ch = lane % kCh, r0 = lane / kCh;
  const int mcol = (ch * 8) >> lg_gv;
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    const int r = r0 + it * (32 / kCh);
    const int rr = min(r, nt - 1);
    uint4 o;
    {
      uint32_t w[kB >= 4 ? kB / 4 : 1];
      LoadRun<kB>(codes + rr * kRowBytes + ch * kB, w);
      uint32_t res[4];
      if constexpr (F == Format::kFP8) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          res[i] =
              Half2AsU32(__hmul2(Fp8x2ToHalf2(w[i / 2] >> (16 * (i % 2))), fs));
      } else {
        const int m = rr * per_row + mcol;
        const __half2 s2 = __half2half2(MetaHalf<kFp8Meta>(sc, m));
        const __half2 z2 = __half2half2(MetaHalf<kFp8Meta>(zr, m));
#pragma unroll
        for (int i = 0; i < 4; ++i)
          res[i] = Half2AsU32(__hfma2(CodePair<F>(w, i), s2, z2));
      }
      o = make_uint4(res[0], res[1], res[2], res[3]);
    }
    *reinterpret_cast<uint4*>(out + TileOff<kD>(r, ch)) = o;
  }
}

template <int kD>
__device__ __forceinline__ void DecodeValuesF16Any(
    FormatCode f, const uint8_t* codes, const uint8_t* sc, const uint8_t* zr,
    ScaleDtypeCode sdt, int lg_gv, int nt, uint8_t* out, int lane) {
  DispatchIntFp8(f, sdt, [&](auto F, auto M) {
    DecodeValuesF16<decltype(F)::value, kD, decltype(M)::value>(
        codes, sc, zr, lg_gv, nt, out, lane);
  });
}

// ---- TQ tiles (full layout) -------------------------------------------------

// Dequantizes one staged TQ tile (F 6, 7, 8) of one tensor from the warp's
// ring into a swizzled BF16 tile (rows >= nt zero). `codes` points at row 0
// of the tile, `sc` at the rows' FP16 norms. All reads are shared memory;
// the ring keeps each range's global alignment mod 16, so the vector loads
// are aligned as in the page. kNorm == false leaves out the row norms
// (the attention kernel scales S or P instead). TQ keys stay in the
// rotated domain (norm * level; scored against Q' = R Q); with kKey ==
// false TQ values are rotated back here,
// v = sign * FWHT(v') / sqrt(kD), the FWHT running in registers across the
// kD / 8 lanes holding a row.
template <Format F, bool kKey, int kD, bool kNorm = true>
__device__ __forceinline__ void DecodeStaged(const uint8_t* codes,
                                             const uint8_t* sc, int nt,
                                             uint8_t* out, const float* s_cb,
                                             const float* s_sign, int lane) {
  static_assert(IsTqFormat(F), "TQ formats only");
  constexpr int kCh = kD / 8, kIt = kCh / 2;  // 16 * kCh chunks / 32 lanes
  constexpr int kB = FormatBits(F);           // bytes per 8-dim chunk
  constexpr int kRowBytes = kD * kB / 8;
  const float* lv = s_cb + 16 * (FormatBits(F) - 2);
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    const int c = lane + 32 * it, r = c / kCh, ch = c % kCh;
    float x[8];
    if (r < nt) {
      const uint8_t* p = codes + r * kRowBytes + ch * kB;
      uint32_t w;
      if constexpr (kB == 4) {
        w = *reinterpret_cast<const uint32_t*>(p);
      } else if constexpr (kB == 2) {
        w = *reinterpret_cast<const uint16_t*>(p);
      } else {
        w = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
            (static_cast<uint32_t>(p[2]) << 16);
      }
      const float norm = kNorm ? HalfBits(LoadU16(sc + 2 * r)) : 1.f;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        x[i] = lv[(w >> (kB * i)) & ((1u << kB) - 1u)] * norm;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.f;
    }
    if constexpr (!kKey) {
      // Lanes of one row are kCh consecutive lanes: strides 1..4 in
      // registers, 8..kD/2 by shuffles (all lanes take part).
#pragma unroll
      for (int len = 1; len < 8; len <<= 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if ((i & len) == 0) {
            const float u = x[i], w = x[i + len];
            x[i] = u + w;
            x[i + len] = u - w;
          }
        }
      }
#pragma unroll
      for (int m = 1; m < kCh; m <<= 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float q = __shfl_xor_sync(0xffffffffu, x[i], m);
          x[i] = (lane & m) ? q - x[i] : x[i] + q;
        }
      }
      constexpr float kNrm = 1.f / (kD == 16    ? 4.f
                                    : kD == 32  ? 5.656854249492381f
                                    : kD == 64  ? 8.f
                                    : kD == 128 ? 11.313708498984761f
                                                : 16.f);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] *= kNrm * s_sign[ch * 8 + i];
    }
    *reinterpret_cast<uint4*>(out + TileOff<kD>(r, ch)) = Pack8(x);
  }
}

// TQ tile of format f into a BF16 tile (one switch per tensor and tile).
template <bool kKey, int kD, bool kNorm = true>
__device__ __forceinline__ void DecodeStagedAny(
    FormatCode f, const uint8_t* codes, const uint8_t* sc, int nt,
    uint8_t* tile, const float* s_cb, const float* s_sign, int lane) {
  switch (f) {
    case FormatCode::kTQ4:
      DecodeStaged<Format::kTQ4, kKey, kD, kNorm>(codes, sc, nt, tile, s_cb,
                                                  s_sign, lane);
      break;
    case FormatCode::kTQ3:
      DecodeStaged<Format::kTQ3, kKey, kD, kNorm>(codes, sc, nt, tile, s_cb,
                                                  s_sign, lane);
      break;
    default:
      DecodeStaged<Format::kTQ2, kKey, kD, kNorm>(codes, sc, nt, tile, s_cb,
                                                  s_sign, lane);
      break;
  }
}

// Rotates the P V accumulator between the plain and the TQ value domain,
// in registers. TQ values are v = S H v' (S = diag(sign), H = FWHT /
// sqrt(kD), H H = I), and P V is linear, so the kernel accumulates the
// TQ tiles' P V' in the rotated domain and rotates once: forward
// o' = H S o when a warp meets a TQ value tile with a plain accumulator,
// back o = S H o' before a non-TQ value tile and at the end. Lane
// (g, q) = (lane / 4, lane % 4) holds dims 8 j + 2 q + c (c = 0, 1) of
// rows g (o[j][c]) and g + 8 (o[j][2 + c]): dim bit 0 is c, bits 1-2 are
// q (shuffles within the quad), bits 3.. are j.
template <int kD>
__device__ __forceinline__ void RotateAcc(float (&o)[kD / 8][4], bool back,
                                          const float* s_sign, int lane) {
  constexpr int kNt = kD / 8;
  const int q = lane % 4;
  auto sign = [&]() {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const float2 sg =
          *reinterpret_cast<const float2*>(s_sign + 8 * j + 2 * q);
      o[j][0] *= sg.x;
      o[j][1] *= sg.y;
      o[j][2] *= sg.x;
      o[j][3] *= sg.y;
    }
  };
  if (!back) sign();
#pragma unroll
  for (int j = 0; j < kNt; ++j) {
#pragma unroll
    for (int r = 0; r < 4; r += 2) {
      const float u = o[j][r], w = o[j][r + 1];
      o[j][r] = u + w;
      o[j][r + 1] = u - w;
    }
  }
#pragma unroll
  for (int m = 1; m < 4; m <<= 1) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float y = __shfl_xor_sync(0xffffffffu, o[j][c], m);
        o[j][c] = (lane & m) ? y - o[j][c] : o[j][c] + y;
      }
    }
  }
#pragma unroll
  for (int len = 1; len < kNt; len <<= 1) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      if ((j & len) == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float u = o[j][c], w = o[j + len][c];
          o[j][c] = u + w;
          o[j + len][c] = u - w;
        }
      }
    }
  }
  constexpr float kNrm = 1.f / (kD == 16    ? 4.f
                                : kD == 32  ? 5.656854249492381f
                                : kD == 64  ? 8.f
                                : kD == 128 ? 11.313708498984761f
                                            : 16.f);
#pragma unroll
  for (int j = 0; j < kNt; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) o[j][c] *= kNrm;
  }
  if (back) sign();
}

}  // namespace
}  // namespace triax::kernels::cuda
