// Tile operations of the transposed tensor-core attention kernel
// (MmaAttentionKernel with kSmall == true: INT/FP8 pages, and its kTq
// variant for TQ4/TQ2 pages), with tokens on the mma's M side and at most 8
// query heads on its N side: S^T = K Q^T and O^T += V^T P^T, operands built
// in registers (no shared-memory value tile). See the section comments for
// the lane <-> token/dim mapping each operand uses.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/attention_tiles.cuh"
#include "kernels/cuda/device_primitives.cuh"
#include "kernels/layout.h"

namespace triax::kernels::cuda {
namespace {

// ---- Transposed tiles (kSmall CTAs: INT/FP8 keys and values) --------------
//
// With at most 8 query heads per CTA, the tile's tokens take the mma's M
// side and the query heads its N side: S^T = K Q^T and O^T += V^T P^T, each
// an m16n8k16 per 16 dims, half the mma count of the query-rows layout
// (whose 16 rows held 4 or 8 heads) and no shared-memory staging for the
// values. Keys: lane (g, q) = (lane / 4, lane % 4) builds the A operand
// from tokens g and g + 8, dims of its run [q * kD / 4, (q + 1) * kD / 4)
// (PermDim order, as ScoresReg); the query tile is the B operand, kept in
// registers for the CTA's life (QueryRegsT). S^T leaves the accumulators
// with lane (g, q) holding tokens g, g + 8 of query heads 2q, 2q + 1; the
// softmax runs per column, and P^T is packed to fp16 and transposed into
// the B operand with movmatrix. Values: lane (g, q) owns the run of
// kD / 8 dims [g * kD / 8, (g + 1) * kD / 8) for tokens 2q, 2q + 1,
// 2q + 8, 2q + 9; each A register is one dim of a token pair, built from
// the two tokens' code bytes with one byte permute (ValuesRegT). Output row
// (dim) 2i, 2i + 1 of m-tile i is dim g * kD / 8 + 2i, + 1 of that run.
// Token slot m of the mma (S^T row, P^T row) holds token TokOf(m): swapping
// slots 2j and 2j + 1 for odd j puts the four rows that the lanes of one
// group g read in one load on both halves of the banks (value rows of
// INT4 are 64 bytes: without it the 4 lanes share a bank pair).
__device__ __forceinline__ int TokOf(int m) { return m ^ ((m >> 1) & 1); }

// B operand of S^T = K Q^T for query head `row` (< nrows, else zeros) of
// the CTA's row block: pair p of lane q's run (PermDim order), scaled.
template <int kD>
__device__ __forceinline__ void QueryRegsT(const float* q_row, bool in,
                                           float scale, int lane,
                                           uint32_t (&qb)[kD / 8]) {
  const float* run = q_row + (lane % 4) * (kD / 4);
#pragma unroll
  for (int p = 0; p < kD / 8; ++p) {
    const float2 v = in ? *reinterpret_cast<const float2*>(run + 2 * p)
                        : make_float2(0.f, 0.f);
    qb[p] = PackHalf(v.x * scale, v.y * scale);
  }
}

// S^T += K Q^T for one staged tile whose keys are INT (F 2, 3, 5) or FP8
// (F 4): s[0], s[1] = token TokOf(g), query heads 2q, 2q + 1; s[2], s[3] =
// token TokOf(g) + 8. Same operands as ScoresReg, in the A slot. Rows >= nt
// yield garbage that the caller masks.
template <Format F, int kD, bool kFp8Meta>
__device__ __forceinline__ void ScoresRegT(const uint8_t* codes,
                                           const uint8_t* sc, const uint8_t* zr,
                                           const uint32_t (&qb)[kD / 8],
                                           int lane, float (&s)[4]) {
  constexpr int kRowBytes = kD * FormatBits(F) / 8;
  constexpr int kR = kRowBytes / 4;  // bytes of a lane's run of dims
  const int g = lane / 4, q = lane % 4, t = TokOf(g);
  uint32_t w[2][kR >= 4 ? kR / 4 : 1];
  LoadRun<kR>(codes + t * kRowBytes + q * kR, w[0]);
  LoadRun<kR>(codes + (t + 8) * kRowBytes + q * kR, w[1]);
  const int m0 = q * (kD / 4);  // first channel of the run
  __half2 s8[4], z8[4];         // channels m0 + 8 (kk / 2) .. + 7
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    if constexpr (F != Format::kFP8) {
      if (kk % 2 == 0) {
        MetaOct<kFp8Meta>(sc, m0 + 4 * kk, s8);
        MetaOct<kFp8Meta>(zr, m0 + 4 * kk, z8);
      }
    }
    const __half2* s2 = s8 + 2 * (kk % 2);
    const __half2* z2 = z8 + 2 * (kk % 2);
    uint32_t af[4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int p = 2 * kk + r;
        if constexpr (F == Format::kFP8) {
          af[2 * r + j] =
              Half2AsU32(Fp8x2ToHalf2(w[j][p / 2] >> (16 * (p % 2))));
        } else {
          af[2 * r + j] =
              Half2AsU32(__hfma2(CodePair<F>(w[j], p), s2[r], z2[r]));
        }
      }
    }
    MmaF16(s, af, qb[2 * kk], qb[2 * kk + 1]);
  }
  if constexpr (F == Format::kFP8) {
    const float f = *reinterpret_cast<const float*>(sc);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] *= f;
  }
}

template <int kD>
__device__ __forceinline__ void ScoresRegTAny(
    FormatCode f, const uint8_t* codes, const uint8_t* sc, const uint8_t* zr,
    ScaleDtypeCode sdt, const uint32_t (&qb)[kD / 8], int lane, float (&s)[4]) {
  DispatchIntFp8(f, sdt, [&](auto F, auto M) {
    ScoresRegT<decltype(F)::value, kD, decltype(M)::value>(codes, sc, zr, qb,
                                                           lane, s);
  });
}

// Two metadata elements as an fp16 pair (i0 in the low half).
template <bool kFp8Meta>
__device__ __forceinline__ __half2 MetaPair(const uint8_t* base, int i0,
                                            int i1) {
  return __halves2half2(MetaHalf<kFp8Meta>(base, i0),
                        MetaHalf<kFp8Meta>(base, i1));
}

// O^T += V^T P^T for one staged tile whose values are INT (F 2, 3, 5) or
// FP8 (F 4). pb0/pb1: the B operand (P^T, fp16; token slots 2q, 2q + 1
// and 2q + 8, 2q + 9 of query head g, tokens TokOf(slot)). Tokens >= nt read
// token nt - 1 again (finite values; their probabilities are 0). sc/zr: the
// rows' per-group scale/zero (2^lg_gv dims per group; a lane's run lies in one
// group) or the head's FP8 float scale.
template <Format F, int kD, bool kFp8Meta>
__device__ __forceinline__ void ValuesRegT(const uint8_t* codes,
                                           const uint8_t* sc, const uint8_t* zr,
                                           int lg_gv, int nt, uint32_t pb0,
                                           uint32_t pb1, int lane,
                                           float (&o)[kD / 16][4]) {
  constexpr int kBits = FormatBits(F);
  constexpr int kRowBytes = kD * kBits / 8;
  constexpr int kRv = kD / 8;           // dims of a lane's run
  constexpr int kRb = kRv * kBits / 8;  // bytes of a lane's run (>= 2)
  constexpr int kW = kRb >= 4 ? kRb / 4 : 1;
  constexpr int kHw = kRb / 2;    // half-words (2 bytes) per run
  constexpr int kDh = kRv / kHw;  // dims per half-word
  static_assert(kRb >= 2, "ValuesRegT needs runs of two bytes or more");
  const int g = lane / 4, q = lane % 4;
  // Token pair tp: tokens 2q + 8 tp (low half), 2q + 8 tp + 1 (high half).
  int tok[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    tok[k] = min(TokOf(2 * q + 8 * (k / 2) + k % 2), nt - 1);
  uint32_t w[4][kW];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    LoadRun<kRb>(codes + tok[k] * kRowBytes + g * kRb, w[k]);
  __half2 s2[2], z2[2];
  if constexpr (F == Format::kFP8) {
    s2[0] = s2[1] = __float2half2_rn(*reinterpret_cast<const float*>(sc));
  } else {
    const int per_row = kD >> lg_gv, mcol = (g * kRv) >> lg_gv;
#pragma unroll
    for (int tp = 0; tp < 2; ++tp) {
      const int i0 = tok[2 * tp] * per_row + mcol,
                i1 = tok[2 * tp + 1] * per_row + mcol;
      s2[tp] = MetaPair<kFp8Meta>(sc, i0, i1);
      z2[tp] = MetaPair<kFp8Meta>(zr, i0, i1);
    }
  }
  // v[tp][e]: dim e of the run for token pair tp, exact codes then values.
  uint32_t v[2][kRv];
#pragma unroll
  for (int tp = 0; tp < 2; ++tp) {
#pragma unroll
    for (int hw = 0; hw < kHw; ++hw) {
      const uint32_t a = w[2 * tp][hw / 2], b = w[2 * tp + 1][hw / 2];
      const int e0 = hw * kDh;
      if constexpr (F == Format::kFP8) {
        // Bytes a0 b0 a1 b1 of the half-word: one E4M3 pair per dim.
        const uint32_t y = __byte_perm(a, b, (hw % 2) ? 0x7362u : 0x5140u);
        v[tp][e0] = Half2AsU32(__hmul2(Fp8x2ToHalf2(y), s2[tp]));
        v[tp][e0 + 1] = Half2AsU32(__hmul2(Fp8x2ToHalf2(y >> 16), s2[tp]));
      } else {
        // Half-word hw of both tokens: low 16 bits token a, high token b.
        const uint32_t x = __byte_perm(a, b, (hw % 2) ? 0x7632u : 0x5410u);
        __half2 c[kDh];
        if constexpr (F == Format::kINT8) {  // int8: bytes 0 and 1 under 0x64
          c[0] = U32AsHalf2(__byte_perm(x, 0x64646464u, 0x4240u));
          c[1] = U32AsHalf2(__byte_perm(x, 0x64646464u, 0x4341u));
          c[0] = __hsub2(c[0], U32AsHalf2(0x64006400u));
          c[1] = __hsub2(c[1], U32AsHalf2(0x64006400u));
        } else if constexpr (F ==
                             Format::kINT4) {  // int4: nibbles of bytes 0, 1
          const uint32_t y = x >> 8;
          const uint32_t m0 = 0x64006400u, m1 = 0x54005400u;
          c[0] = __hsub2(U32AsHalf2(AndOr(x, 0x000f000fu, m0)), U32AsHalf2(m0));
          c[1] = __hsub2(U32AsHalf2(AndOr(x, 0x00f000f0u, m1)), U32AsHalf2(m1));
          c[2] = __hsub2(U32AsHalf2(AndOr(y, 0x000f000fu, m0)), U32AsHalf2(m0));
          c[3] = __hsub2(U32AsHalf2(AndOr(y, 0x00f000f0u, m1)), U32AsHalf2(m1));
        } else {  // int2: bit pairs of bytes 0, 1
          const uint32_t y = x >> 8;
          constexpr uint32_t kMask[4] = {0x00030003u, 0x000c000cu, 0x00300030u,
                                         0x00c000c0u};
          constexpr uint32_t kMagic[4] = {0x64006400u, 0x5c005c00u, 0x54005400u,
                                          0x4c004c00u};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            c[k] = __hsub2(U32AsHalf2(AndOr(x, kMask[k], kMagic[k])),
                           U32AsHalf2(kMagic[k]));
            c[4 + k] = __hsub2(U32AsHalf2(AndOr(y, kMask[k], kMagic[k])),
                               U32AsHalf2(kMagic[k]));
          }
        }
#pragma unroll
        for (int k = 0; k < kDh; ++k)
          v[tp][e0 + k] = Half2AsU32(__hfma2(c[k], s2[tp], z2[tp]));
      }
    }
  }
  const uint32_t pb[2] = {pb0, pb1};
#pragma unroll
  for (int i = 0; i < kRv / 2; ++i) {
    const uint32_t af[4] = {v[0][2 * i], v[0][2 * i + 1], v[1][2 * i],
                            v[1][2 * i + 1]};
    MmaF16(o[i], af, pb[0], pb[1]);
  }
}

template <int kD>
__device__ __forceinline__ void ValuesRegTAny(
    FormatCode f, const uint8_t* codes, const uint8_t* sc, const uint8_t* zr,
    ScaleDtypeCode sdt, int lg_gv, int nt, uint32_t pb0, uint32_t pb1, int lane,
    float (&o)[kD / 16][4]) {
  DispatchIntFp8(f, sdt, [&](auto F, auto M) {
    ValuesRegT<decltype(F)::value, kD, decltype(M)::value>(
        codes, sc, zr, lg_gv, nt, pb0, pb1, lane, o);
  });
}

// ---- Transposed TQ tiles (kSmall, kTq: TQ4/TQ2 keys and values) ----------
//
// Codes become fp16 levels through a table in shared memory indexed by one
// byte: kLut4[b] = (level4[b & 15], level4[b >> 4]), kLut2[n] =
// (level2[n & 3], level2[n >> 2]) — for keys, a byte (TQ4) or nibble (TQ2)
// of a token's codes is one A register (dims 2p, 2p + 1); for values, the
// same index is built from one dim of two tokens (low half token a). Keys
// score against Q' = R Q (QueryRegsRotT) and their row norms scale S^T's
// rows; value norms scale P (after the softmax sums); values accumulate in
// the rotated domain and O^T is rotated back once (RotateAccT).

// QueryRegsT for TQ keys: the B operand of Q' = R Q = H (signs * q) /
// sqrt(D). Lane q holds its run of D / 4 dims; the FWHT's strides below
// D / 4 run in registers, the two above across lanes q ^ 1, q ^ 2.
template <int kD>
__device__ __forceinline__ void QueryRegsRotT(const float* q_row, bool in,
                                              float scale, const float* sign,
                                              int lane,
                                              uint32_t (&qb)[kD / 8]) {
  constexpr int kR = kD / 4;
  const int q = lane % 4, d0 = q * kR;
  float x[kR];
#pragma unroll
  for (int j = 0; j < kR; j += 2) {
    const float2 v = in ? *reinterpret_cast<const float2*>(q_row + d0 + j)
                        : make_float2(0.f, 0.f);
    x[j] = v.x * sign[d0 + j];
    x[j + 1] = v.y * sign[d0 + j + 1];
  }
#pragma unroll
  for (int len = 1; len < kR; len <<= 1) {
#pragma unroll
    for (int j = 0; j < kR; ++j) {
      if ((j & len) == 0) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 4; m <<= 1) {
#pragma unroll
    for (int j = 0; j < kR; ++j) {
      const float y = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = (q & m) ? y - x[j] : x[j] + y;
    }
  }
  const float f = scale * rsqrtf(static_cast<float>(kD));
#pragma unroll
  for (int p = 0; p < kD / 8; ++p)
    qb[p] = PackHalf(x[2 * p] * f, x[2 * p + 1] * f);
}

// S^T += K' Q'^T for one staged TQ4 (F 6) or TQ2 (F 8) key tile, then each
// row times its token's norm (`norms`: the tile's f16 row norms). Rows >=
// nt yield garbage that the caller masks.
template <Format F, int kD>
__device__ __forceinline__ void ScoresTqT(const uint8_t* codes,
                                          const uint8_t* norms,
                                          const uint32_t* lut,
                                          const uint32_t (&qb)[kD / 8],
                                          int lane, float (&s)[4]) {
  constexpr int kBits = F == Format::kTQ4 ? 4 : 2;
  constexpr int kRowBytes = kD * kBits / 8;
  constexpr int kR = kRowBytes / 4;  // bytes of a lane's run of dims
  const int g = lane / 4, q = lane % 4, t = TokOf(g);
  uint32_t w[2][kR >= 4 ? kR / 4 : 1];
  LoadRun<kR>(codes + t * kRowBytes + q * kR, w[0]);
  LoadRun<kR>(codes + (t + 8) * kRowBytes + q * kR, w[1]);
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t af[4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int p = 2 * kk + r;  // dims 2p, 2p + 1 of the run
        uint32_t idx;
        if constexpr (F == Format::kTQ4) {
          idx = (w[j][p / 4] >> (8 * (p % 4))) & 0xffu;
        } else {
          idx = (w[j][p / 8] >> (4 * (p % 8))) & 0xfu;
        }
        af[2 * r + j] = lut[idx];
      }
    }
    MmaF16(s, af, qb[2 * kk], qb[2 * kk + 1]);
  }
  const float n0 = HalfBits(LoadU16(norms + 2 * t)),
              n1 = HalfBits(LoadU16(norms + 2 * (t + 8)));
  s[0] *= n0;
  s[1] *= n0;
  s[2] *= n1;
  s[3] *= n1;
}

template <int kD>
__device__ __forceinline__ void ScoresTqTAny(FormatCode f, const uint8_t* codes,
                                             const uint8_t* norms,
                                             const uint32_t* lut4,
                                             const uint32_t* lut2,
                                             const uint32_t (&qb)[kD / 8],
                                             int lane, float (&s)[4]) {
  if (f == FormatCode::kTQ4) {
    ScoresTqT<Format::kTQ4, kD>(codes, norms, lut4, qb, lane, s);
  } else {
    ScoresTqT<Format::kTQ2, kD>(codes, norms, lut2, qb, lane, s);
  }
}

// O'^T += V'^T P'^T for one staged TQ4 (F 6) or TQ2 (F 8) value tile (levels
// only: the caller scaled P by the row norms). Token slots as ValuesRegT.
template <Format F, int kD>
__device__ __forceinline__ void ValuesTqT(const uint8_t* codes,
                                          const uint32_t* lut, int nt,
                                          uint32_t pb0, uint32_t pb1, int lane,
                                          float (&o)[kD / 16][4]) {
  constexpr int kBits = F == Format::kTQ4 ? 4 : 2;
  constexpr int kRowBytes = kD * kBits / 8;
  constexpr int kRv = kD / 8;           // dims of a lane's run
  constexpr int kRb = kRv * kBits / 8;  // bytes of a lane's run (>= 2)
  constexpr int kW = kRb >= 4 ? kRb / 4 : 1;
  constexpr int kPerWord = 32 / kBits;  // dims per 32-bit word
  static_assert(kRb >= 2, "ValuesTqT needs runs of two bytes or more");
  const int g = lane / 4, q = lane % 4;
  int tok[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    tok[k] = min(TokOf(2 * q + 8 * (k / 2) + k % 2), nt - 1);
  uint32_t w[4][kW];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    LoadRun<kRb>(codes + tok[k] * kRowBytes + g * kRb, w[k]);
  uint32_t v[2][kRv];
#pragma unroll
  for (int tp = 0; tp < 2; ++tp) {
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const uint32_t a = w[2 * tp][i], b = w[2 * tp + 1][i];
      // lo: indices of the even dims of the word, hi: the odd dims (one
      // byte (TQ4) or nibble (TQ2) each: token a's code low, b's high).
      uint32_t lo, hi;
      if constexpr (F == Format::kTQ4) {
        lo = (a & 0x0f0f0f0fu) | ((b << 4) & 0xf0f0f0f0u);
        hi = ((a >> 4) & 0x0f0f0f0fu) | (b & 0xf0f0f0f0u);
      } else {
        lo = (a & 0x33333333u) | ((b << 2) & 0xccccccccu);
        hi = ((a >> 2) & 0x33333333u) | (b & 0xccccccccu);
      }
#pragma unroll
      for (int k = 0; k < kPerWord / 2; ++k) {
        const int e = i * kPerWord + 2 * k;
        if (e < kRv) {
          constexpr int kIdxBits = 2 * kBits, kMask = (1 << kIdxBits) - 1;
          v[tp][e] = lut[(lo >> (kIdxBits * k)) & kMask];
          v[tp][e + 1] = lut[(hi >> (kIdxBits * k)) & kMask];
        }
      }
    }
  }
  const uint32_t pb[2] = {pb0, pb1};
#pragma unroll
  for (int i = 0; i < kRv / 2; ++i) {
    const uint32_t af[4] = {v[0][2 * i], v[0][2 * i + 1], v[1][2 * i],
                            v[1][2 * i + 1]};
    MmaF16(o[i], af, pb[0], pb[1]);
  }
}

template <int kD>
__device__ __forceinline__ void ValuesTqTAny(FormatCode f, const uint8_t* codes,
                                             const uint32_t* lut4,
                                             const uint32_t* lut2, int nt,
                                             uint32_t pb0, uint32_t pb1,
                                             int lane, float (&o)[kD / 16][4]) {
  if (f == FormatCode::kTQ4) {
    ValuesTqT<Format::kTQ4, kD>(codes, lut4, nt, pb0, pb1, lane, o);
  } else {
    ValuesTqT<Format::kTQ2, kD>(codes, lut2, nt, pb0, pb1, lane, o);
  }
}

// O^T = R^T O'^T = signs * H O'^T / sqrt(D) on the transposed accumulator:
// lane (g, q) holds dims g * D / 8 + e, e = 2i + h (o[i][2h], o[i][2h + 1]
// for query heads 2q, 2q + 1). Strides below D / 8 in registers, the three
// above across lanes g ^ 1, g ^ 2, g ^ 4.
template <int kD>
__device__ __forceinline__ void RotateAccT(float (&o)[kD / 16][4],
                                           const float* sign, int lane) {
  constexpr int kM = kD / 16;
  const int g = lane / 4;
#pragma unroll
  for (int i = 0; i < kM; ++i) {  // stride 1: h = 0 <-> h = 1
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float a = o[i][c], b = o[i][2 + c];
      o[i][c] = a + b;
      o[i][2 + c] = a - b;
    }
  }
#pragma unroll
  for (int len = 1; len < kM; len <<= 1) {  // strides 2 .. D / 16
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      if ((i & len) == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float a = o[i][c], b = o[i + len][c];
          o[i][c] = a + b;
          o[i + len][c] = a - b;
        }
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) {  // strides D / 8 .. D / 2
#pragma unroll
    for (int i = 0; i < kM; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float y = __shfl_xor_sync(0xffffffffu, o[i][c], 4 * m);
        o[i][c] = (g & m) ? y - o[i][c] : o[i][c] + y;
      }
    }
  }
  const float f = rsqrtf(static_cast<float>(kD));
#pragma unroll
  for (int i = 0; i < kM; ++i) {
    const float2 sg =
        *reinterpret_cast<const float2*>(sign + g * (kD / 8) + 2 * i);
    o[i][0] *= sg.x * f;
    o[i][1] *= sg.x * f;
    o[i][2] *= sg.y * f;
    o[i][3] *= sg.y * f;
  }
}

}  // namespace
}  // namespace triax::kernels::cuda
