// The tensor-core split-K decode attention kernel (MmaAttentionKernel) with
// its launch arguments (MmaArgs), shared-memory plan (MmaSmem) and the
// per-warp tile pipeline structures (TileDesc, TilePlan). Instantiated per
// head_dim in attention_hd<D>.cu through attention_launch.cuh.
//
// The kernel's body stays one function (setup, the producer `fill`, the
// per-tile consumer of each configuration; ~600 lines) with only the
// epilogues moved out (StorePartials*, same PTX). Its phases share ~40 live
// values of warp state; as __forceinline__ functions the tile consumers
// changed the generated code (scripts/ptx_compare.py: head_dim 64 full
// kernel 161 -> 159 registers, 256 full kernel 460 -> 440 bytes of spill
// loads, other instruction orders in the kTq variant) and the query setup
// reordered instructions of the head_dim 16 and 64 full kernels. The
// register budgets (up to 255, 3 or 4 CTAs per SM for the transposed
// kernel) were measured on this code, so the phases are marked by comments.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/attention_tiles.cuh"
#include "kernels/cuda/attention_tiles_transposed.cuh"
#include "kernels/cuda/device_page.h"
#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/packed_encoding.h"
#include "kernels/cuda/tq.cuh"
#include "kernels/layout.h"

namespace triax::kernels::cuda {
namespace {

// ---- Tensor-core split-K attention
// -------------------------------------------
//
// Grid: one CTA per (encoding class c, sequence b, row block rb of <= 16
// query heads of the group (<= 8 in kSmall), KV head h, split), class
// outermost, in up to four launches (head_dim >= 64: the full kernel for
// classes 0 and 6, 2 CTAs per SM; the transposed kSmall kernel for INT4/
// INT2 keys, 4 per SM, for FP8/INT8 keys, 3 per SM, and its TQ variant for
// TQ4/TQ2, 4 per SM; below 64 the full kernel alone), each with its own
// split count (SplitsFor) and skipped when AttentionParams::
// formats_present says no page needs it. A page's class is its K format
// (ClassOf; pages the transposed kernel cannot take fall back to classes
// 0 and 6). PartitionKernel first splits
// each sequence's pages of each class into S = splits * 4 equal shares
// (splits of the class's launch; page ranges whose class-c
// pages number equally, +-1) with the tokens before each share; warp
// v = split * 4 + warp of a class-c CTA takes share v, skips the other
// classes' pages in it (a ballot over each 32-descriptor window) and keeps
// its own online softmax. A CTA whose class has no page in the sequence
// exits at once. So every warp of an SM runs one format's code at a time
// (a mixed pool never switches format tile by tile), and the reduce kernel
// merges the kClasses * S partial results of each query head (skipping
// absent classes and empty shares). Per 16-token tile a warp
// gets K and V of its head as mma operands (see below; shared-memory tiles
// swizzled in 16-byte chunks), computes S = Q K^T with mma.m16n8k16 (rows =
// query heads, padded to 16; the transposed kernel computes S^T, see
// "Transposed tiles"), the online softmax on the accumulators, and
// O += P V with P from registers. TQ keys use the rotated query tile
// Q' = R Q, and their row norms scale S's columns (the key tile holds
// codebook levels only). TQ value tiles (levels only, the norms scale P's
// columns) are accumulated in the rotated domain and the accumulator is
// rotated back once (RotateAcc / RotateAccT).
//
// Memory pipeline: each warp streams its tiles' raw page bytes (codes and
// the tile's scale/zero/norm ranges, whatever the page's format) into a
// per-warp byte ring in shared memory with cp.async (kSmall:
// cp.async.bulk, one copy per range, whole-tile plans), up to kMaxInFlight
// tiles ahead (as many as the ring holds: 2 BF16 tiles, ~6 INT4 tiles),
// page descriptors fetched 32 at a time, byte ranges from a per-warp cache
// of per-format TilePlans (lanes 0-5 size one range each, a shuffle scan
// packs them in the ring; a tile without BF16 ranges is one cp.async loop
// over all its 16-byte chunks). BF16 tiles land swizzled and feed the tensor
// cores in place; INT/FP8 keys become fp16 mma operands in registers
// (ScoresReg), INT/FP8 values an fp16 tile (DecodeValuesF16), TQ tensors a
// BF16 tile (DecodeStaged); one switch per tensor and tile.

constexpr int kMaxInFlight = 16;
constexpr int kPlans = 8;        // per-warp TilePlan cache (formats)
constexpr int kPlanBytes = 256;  // shared-memory slot of one TilePlan

struct MmaArgs {
  PageShape shape;
  int batch, n_q_heads, group, row_blocks;
  int splits;  // CTAs per (sequence, KV head, row block) in this launch
  int s_max;   // share stride: the largest shares (splits x 4) of any class
  // The launch's classes, 4 bits each (ClassList; outermost grid index).
  uint32_t classes;
  const uint32_t* cls_mask;  // [batch]: bit c set when class c has pages
  const int2* part_plan;     // [batch][kClasses][S + 1], PartitionKernel
  float scale_log2;
  const float* q;
  const DevicePage* pages;
  const int32_t* indptr;
  const int32_t* attend;
  float* ws_o;    // [batch][n_q][kClasses][S][D]
  float* ws_lse;  // [batch][n_q][kClasses][S]
};

// Two configurations. kSmall (the transposed kernel: INT/FP8 or TQ4/TQ2
// pages): the query lives in registers, no decoded tile, and a smaller
// ring (low-bit tiles are small) so that 4 CTAs (16 warps) fit an SM; else
// the full layout, 2 CTAs per SM.
template <int kD, bool kSmall>
struct MmaSmem {
  static constexpr int kTileBytes = 16 * kD * 2;  // one bf16 [16][kD] tile
  // Query tiles (the kSmall configuration keeps its query in registers).
  static constexpr int kQp = 0;                // Q, fp16, dims permuted
  static constexpr int kQ = kQp + kTileBytes;  // Q, bf16
  static constexpr int kQr = kQ + kTileBytes;  // Q' = R Q, bf16
  static constexpr int kWarp0 = kSmall ? 0 : kQr + kTileBytes;
  // Per warp: a byte ring of raw page bytes filled by cp.async, or by
  // cp.async.bulk in the kSmall configuration (two BF16 tiles of K and V
  // fit, more of the smaller formats), one decoded tile (TQ keys, then
  // non-BF16 values; none in kSmall, whose operands are built in
  // registers), and one TileDesc (with its mbarrier) per tile in flight.
  static constexpr int kRing =
      kSmall ? 5 * kTileBytes / 2 : 4 * kTileBytes + 512;
  static constexpr int kDec = kRing;
  static constexpr int kDesc = kDec + (kSmall ? 0 : kTileBytes);
  static constexpr int kPlan = kDesc + kMaxInFlight * 32;  // TilePlan[]
  static constexpr int kWarpBytes = kPlan + kPlans * kPlanBytes;
  static constexpr int kCb = kWarp0 + kMmaWarps * kWarpBytes;  // float[3][16]
  static constexpr int kSign = kCb + 48 * 4;                   // float[kD]
  // kSmall: the TQ level-pair tables (ScoresTqT): 256 + 16 fp16 pairs.
  static constexpr int kLut = kSign + kD * 4;
  static constexpr int kTotal = kLut + (kSmall ? (256 + 16) * 4 : 0);
  // The largest tile (K and V BF16, or INT8 with metadata) fits the ring,
  // and so does the float32 Q staged through warp 0's ring.
  static_assert(kRing >= 2 * kTileBytes + 4 * (2 * kD + 32), "ring too small");
  static_assert(kSmall || kRing >= 16 * kD * 4, "ring holds the float32 Q");
  static_assert(kRing + kTileBytes <= 65535, "TileDesc offsets are 16-bit");
};

// One staged tile: its page's packed format, its valid rows and where each
// range sits in the warp's ring (bytes from the ring start to the range's
// first byte): K codes, V codes, K scale, K zero, V scale, V zero.
struct TileDesc {
  int32_t format;
  int32_t nt;
  uint32_t end;  // ring bytes allocated through this tile (monotonic)
  uint16_t pos[6];
  // mbarrier of this slot (MmaAttentionKernel): one phase per staged tile;
  // tiles without a swizzled BF16 range land by cp.async.bulk and complete
  // the phase by transaction bytes, the others arrive on it at once.
  uint64_t bar;
};
static_assert(sizeof(TileDesc) == 32, "TileDesc is 32 bytes");

// Where a tile's bytes lie in a page of one format, for the warp's head h
// (built once per format change, kept in shared memory). Ranges: 0 K codes,
// 1 V codes, 2 K scale, 3 K zero, 4 V scale, 5 V zero (scale = the FP8
// scale or the TQ norms; unused ranges have length 0). The range of rows
// [t0, t0 + nt) starts at off + t0 * row (+ (t0 >> kg_shift) * kg_bytes
// for INT key metadata: the key group) and is fixed + nt * per bytes long.
//
// Whole tiles (pages whose token count T is a multiple of 16, or below 16):
// every tile copies rows [t0, t0 + min(16, T)) of each range whatever its
// valid rows, and t0 * row (+ the key group's offset) is a multiple of 16,
// so each range keeps the 16-byte alignment it has at t0 = 0: its ring
// bytes (whole_size), place in the tile (whole_excl) and the tile's ring
// bytes (whole_total) are fixed per format, and the producer needs no scan.
struct TilePlan {
  int32_t fmt;       // packed format described
  uint32_t bound;    // ring bytes of a 16-row tile, an upper bound
  uint32_t bf_mask;  // bit 0: K is BF16, bit 1: V is BF16
  uint32_t kg_shift, kg_bytes;
  uint32_t off[6], row[6], fixed[6], per[6];
  uint32_t whole_size[6], whole_excl[6], whole_total;
};
static_assert(sizeof(TilePlan) <= kPlanBytes, "TilePlan fits its slot");

template <int kD>
__device__ TilePlan MakeTilePlan(int32_t fmt, const PageShape& s, int h) {
  const UnpackedEncoding e = UnpackEncoding(fmt);
  const PageLayout L = ComputeLayout(e, s);
  const uint32_t T = s.tokens;
  TilePlan pl;
  pl.fmt = fmt;
  pl.bf_mask = (e.k == FormatCode::kBF16 ? 1u : 0u) |
               (e.v == FormatCode::kBF16 ? 2u : 0u);
  pl.kg_shift = 31;
  pl.kg_bytes = 0;
  for (int i = 0; i < 6; ++i)
    pl.off[i] = pl.row[i] = pl.fixed[i] = pl.per[i] = 0;
  for (int t = 0; t < 2; ++t) {
    const bool key = t == 0;
    const FormatCode f = key ? e.k : e.v;
    const TensorLayout& tl = key ? L.k : L.v;
    const uint32_t rb = kD * FormatBits(f) / 8;
    pl.off[t] = static_cast<uint32_t>(tl.codes) + h * T * rb;
    pl.row[t] = pl.per[t] = rb;
    const int ms = 2 + 2 * t, mz = ms + 1;  // metadata ranges
    if (f == FormatCode::kFP8) {
      pl.off[ms] = static_cast<uint32_t>(tl.scale) + 4u * h;
      pl.fixed[ms] = 4;
    } else if (IsTqFormat(f)) {
      pl.off[ms] = static_cast<uint32_t>(tl.scale) + 2u * h * T;
      pl.row[ms] = pl.per[ms] = 2;
    } else if (IsIntFormat(f)) {
      const uint32_t elem = e.scale_dtype == ScaleDtypeCode::kFP8 ? 1 : 2;
      if (key) {
        const uint32_t gk = s.KeyGroup(e);
        const uint32_t first = h * (T / gk) * kD;
        pl.off[ms] = static_cast<uint32_t>(tl.scale) + first * elem;
        pl.off[mz] = static_cast<uint32_t>(tl.zero) + first * elem;
        pl.fixed[ms] = pl.fixed[mz] = kD * elem;
        // gk < T only for gk = group, a power of two; else t0 < gk.
        pl.kg_shift = gk == T ? 31u : static_cast<uint32_t>(__ffs(gk) - 1);
        pl.kg_bytes = kD * elem;
      } else {
        const uint32_t per_row = kD / min(e.Group(), kD);
        pl.off[ms] = static_cast<uint32_t>(tl.scale) + h * T * per_row * elem;
        pl.off[mz] = static_cast<uint32_t>(tl.zero) + h * T * per_row * elem;
        pl.row[ms] = pl.per[ms] = pl.row[mz] = pl.per[mz] = per_row * elem;
      }
    }
  }
  pl.bound = 0;
  for (int i = 0; i < 6; ++i) {
    const uint32_t len = pl.fixed[i] + 16 * pl.per[i];
    if (i < 2 && ((pl.bf_mask >> i) & 1u)) {
      pl.bound += 16 * kD * 2;
    } else if (len > 0) {
      pl.bound += len + 30;  // 16-byte alignment of both ends
    }
  }
  const uint32_t rows = min(16u, T);
  pl.whole_total = 0;
  for (int i = 0; i < 6; ++i) {
    const uint32_t len = pl.fixed[i] + rows * pl.per[i];
    uint32_t size = 0;
    if (i < 2 && ((pl.bf_mask >> i) & 1u)) {
      size = 16 * kD * 2;
    } else if (len > 0) {
      size = ((pl.off[i] + len + 15) & ~15u) - (pl.off[i] & ~15u);
    }
    pl.whole_size[i] = size;
    pl.whole_excl[i] = pl.whole_total;
    pl.whole_total += size;
  }
  return pl;
}

// Epilogue of the transposed configuration: the warp's partial result
// (O^T unnormalized, running max m and sum l of query heads 2 (lane % 4)
// and + 1) to ws_o / ws_lse slot part of each query head qh0 + r < nrows.
// O^T: m-tile i, lane (g, q) holds dims g * kD / 8 + 2i, + 1 of query
// heads 2q (o[i][0], o[i][2]) and 2q + 1 (o[i][1], o[i][3]).
template <int kD>
__device__ __forceinline__ void StorePartialsT(
    const MmaArgs& a, size_t qh0, int nrows, int parts, int part,
    const float (&m)[2], const float (&l)[2], bool poisoned,
    const float (&o)[kD / 16][4], int lane) {
  constexpr int kAcc = kD / 16;
  const float nan = __uint_as_float(0x7fc00000u);
  const int g = lane / 4;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = 2 * (lane % 4) + j;
    if (r >= nrows) continue;
    const size_t slot = (qh0 + r) * parts + part;
    const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
    if (g == 0) {
      a.ws_lse[slot] =
          poisoned ? nan : (l[j] > 0.f ? m[j] + __log2f(l[j]) : -INFINITY);
    }
    // An empty share (lse -inf) is skipped by the reduce: no output.
    if (!poisoned && !(l[j] > 0.f)) continue;
    float* dst = a.ws_o + slot * kD + g * (kD / 8);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const float2 val = poisoned
                             ? make_float2(nan, nan)
                             : make_float2(o[i][j] * inv, o[i][2 + j] * inv);
      *reinterpret_cast<float2*>(dst + 2 * i) = val;
    }
  }
}

// Epilogue of the full configuration: as StorePartialsT for mma rows
// lane / 4 and lane / 4 + 8 (O: n-tile j holds dims 8 j + 2 (lane % 4), + 1).
template <int kD>
__device__ __forceinline__ void StorePartials(
    const MmaArgs& a, size_t qh0, int nrows, int parts, int part,
    const float (&m)[2], const float (&l)[2], bool poisoned,
    const float (&o)[kD / 8][4], int lane) {
  constexpr int kNt = kD / 8;
  const float nan = __uint_as_float(0x7fc00000u);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane / 4 + 8 * i;
    if (r >= nrows) continue;
    const size_t slot = (qh0 + r) * parts + part;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    if (lane % 4 == 0) {
      a.ws_lse[slot] =
          poisoned ? nan : (l[i] > 0.f ? m[i] + __log2f(l[i]) : -INFINITY);
    }
    if (!poisoned && !(l[i] > 0.f)) continue;  // empty share: see above
    float* dst = a.ws_o + slot * kD;
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const int d = 8 * j + 2 * (lane % 4);
      const float2 val =
          poisoned ? make_float2(nan, nan)
                   : make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
      *reinterpret_cast<float2*>(dst + d) = val;
    }
  }
}

// kCtas: CTAs per SM the registers are capped for (kSmallCtas). kTq
// (kSmall only): the TQ4/TQ2 variant of the transposed kernel.
template <int kD, bool kSmall, int kCtas, bool kTq = false>
__global__ void __launch_bounds__(kMmaWarps * 32, kCtas)
    MmaAttentionKernel(const MmaArgs a) {
  extern __shared__ __align__(16) uint8_t sm[];
  using Sm = MmaSmem<kD, kSmall>;
  constexpr int kNt = kD / 8;  // 8-dim output tiles
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const PageShape shape = a.shape;
  const int H = shape.heads, T = shape.tokens;
  int x = blockIdx.x;
  const int split = x % a.splits;
  x /= a.splits;
  const int h = x % H;
  x /= H;
  const int rb = x % a.row_blocks;
  x /= a.row_blocks;
  const int b = x % a.batch;
  // Outermost: CTAs run class by class.
  const int cls = (a.classes >> (4 * (x / a.batch))) & 0xf;
  // No page of this class in the sequence: its partitions are skipped by
  // the reduce (same mask), nothing to write.
  if (((a.cls_mask[b] >> cls) & 1u) == 0) return;
  // Query heads per CTA: 16 mma rows, or 8 mma columns (kSmall).
  constexpr int kRows = kSmall ? 8 : 16;
  const int row0 = rb * kRows, nrows = min(kRows, a.group - row0);
  const bool hi_rows = nrows > 8;  // mma rows 8-15 hold query heads
  const bool tq_ok = (!kSmall || kTq) && IsTqHeadDim(kD);
  // Q' = R Q only for classes whose keys are TQ (class c: K format c + 1).
  const bool tq_keys =
      !kSmall && tq_ok && IsTqFormat(static_cast<FormatCode>(cls + 1));
  float* s_cb = reinterpret_cast<float*>(sm + Sm::kCb);
  float* s_sign = reinterpret_cast<float*>(sm + Sm::kSign);
  if (tq_ok) {
    const int l = Log2Dim(kD);
    for (int i = tid; i < 48; i += blockDim.x)
      s_cb[i] = g_tq_cb[l][i / 16][i % 16];
    for (int i = tid; i < kD; i += blockDim.x) s_sign[i] = g_tq_sign[l][i];
  }
  const uint32_t* s_lut4 = reinterpret_cast<const uint32_t*>(sm + Sm::kLut);
  const uint32_t* s_lut2 = s_lut4 + 256;
  if constexpr (kTq) {
    const int l = Log2Dim(kD);
    const float* cb4 = g_tq_cb[l][2];
    const float* cb2 = g_tq_cb[l][0];
    uint32_t* lut = reinterpret_cast<uint32_t*>(sm + Sm::kLut);
    for (int i = tid; i < 256 + 16; i += blockDim.x) {
      lut[i] = i < 256 ? PackHalf(cb4[i & 15], cb4[i >> 4])
                       : PackHalf(cb2[(i - 256) & 3], cb2[(i - 256) >> 2]);
    }
    __syncthreads();
  }
  // Q (scaled, rows >= nrows zero): kSmall lanes hold their B operand
  // (QueryRegsT); else via warp 0's ring into shared tiles, then Q' = R Q.
  const size_t qbase =
      (static_cast<size_t>(b) * a.n_q_heads + h * a.group + row0) * kD;
  uint32_t qb[kSmall ? kD / 8 : 1];
  if constexpr (kTq) {
    QueryRegsRotT<kD>(a.q + qbase + (lane / 4) * kD, lane / 4 < nrows,
                      a.scale_log2, s_sign, lane, qb);
  } else if constexpr (kSmall) {
    QueryRegsT<kD>(a.q + qbase + (lane / 4) * kD, lane / 4 < nrows,
                   a.scale_log2, lane, qb);
  } else {
    float* qf = reinterpret_cast<float*>(sm + Sm::kWarp0);
    for (int i = tid; i < 16 * kD; i += blockDim.x)
      qf[i] = i / kD < nrows ? a.q[qbase + i] * a.scale_log2 : 0.f;
    __syncthreads();
    for (int i = tid; i < 16 * kNt; i += blockDim.x) {
      const int r = i / kNt, c = i % kNt;
      *reinterpret_cast<uint4*>(sm + Sm::kQ + TileOff<kD>(r, c)) =
          Pack8(qf + r * kD + c * 8);
      uint32_t w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int col = c * 8 + 2 * u;
        w[u] = PackHalf(qf[r * kD + PermDim<kD>(col)],
                        qf[r * kD + PermDim<kD>(col + 1)]);
      }
      *reinterpret_cast<uint4*>(sm + Sm::kQp + TileOff<kD>(r, c)) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (tq_keys) {
      __syncthreads();
      for (int i = tid; i < 16 * kD; i += blockDim.x) qf[i] *= s_sign[i % kD];
      __syncthreads();
      SmemFwht<kD>(qf, 16, tid, blockDim.x, [] { __syncthreads(); });
      const float nrm = rsqrtf(static_cast<float>(kD));
      for (int i = tid; i < 16 * kNt; i += blockDim.x) {
        const int r = i / kNt, c = i % kNt;
        float v[8];
        for (int j = 0; j < 8; ++j) v[j] = qf[r * kD + c * 8 + j] * nrm;
        *reinterpret_cast<uint4*>(sm + Sm::kQr + TileOff<kD>(r, c)) = Pack8(v);
      }
    }
    __syncthreads();
  }

  uint8_t* wbase = sm + Sm::kWarp0 + warp * Sm::kWarpBytes;
  uint8_t* ring = wbase;
  const uint32_t ring_addr = SmemAddr(ring);
  uint8_t* sDec = wbase + Sm::kDec;
  TileDesc* descs = reinterpret_cast<TileDesc*>(wbase + Sm::kDesc);
  const uint32_t bar0 = SmemAddr(&descs[0].bar);
  if constexpr (kSmall) {
    if (lane < kMaxInFlight) BarInit(bar0 + lane * sizeof(TileDesc));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
  }

  const int S = a.s_max, v = split * kMmaWarps + warp;
  const int part = cls * S + v, parts = kClasses * S;
  // This warp's pages: [p0, p1) holds an equal share (+-1) of the
  // sequence's pages of this class, `before` tokens precede p0.
  const int2* wplan =
      a.part_plan + (static_cast<size_t>(b) * kClasses + cls) * (S + 1) + v;
  const int2 w0 = wplan[0];
  const int p0 = w0.x, p1 = wplan[1].x;
  long before = w0.y;
  const long attend = a.attend[b];

  // Producer state (warp-uniform): the next tile to stage is rows
  // [t0, t0 + 16) of page pi, `valid` rows of which are attended.
  // Page descriptors come 32 at a time, lane i holding page win + i.
  int pi = p0, win = p0 - 32, t0 = 0, valid = 0;
  bool page_ready = false, done = false, poisoned = false;
  const uint8_t* pdata = nullptr;
  int pfmt = 0, plan_fmt = 0;  // 0: no plan yet (not a valid format)
  TilePlan* plans = reinterpret_cast<TilePlan*>(wbase + Sm::kPlan);
  const TilePlan* plan = plans;
  int slot_fmt = 0, next_slot = 0;
  uint32_t plan_bound = 0;  // ring bytes a tile of the current plan needs
  DevicePage lane_pg{};
  // Per window: lane's clipped token count, the inclusive prefix of those
  // counts and the lanes holding pages of this CTA's class.
  int lane_n = 0, lane_incl = 0;
  unsigned cls_lanes = 0;
  uint32_t head = 0, tail = 0;  // ring bytes allocated / released
  uint32_t hpos = 0;            // ring offset of head (head mod kRing)
  const bool whole_tiles = T % 16 == 0 || T < 16;  // see TilePlan
  int issued = 0, consumed = 0;

  // Stages tiles until kMaxInFlight are pending, the ring is full or the
  // warp's pages are done.
  auto fill = [&]() {
    while (!done && issued - consumed < kMaxInFlight) {
      if (!page_ready) {
        if (pi >= p1 || before >= attend) {
          done = true;
          break;
        }
        if (pi >= win + 32) {
          win = pi;
          const bool in = win + lane < p1;
          if (in) lane_pg = a.pages[win + lane];
          lane_n = in ? min(max(lane_pg.num_tokens, 0), T) : 0;
          lane_incl = lane_n;
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, lane_incl, o);
            if (lane >= o) lane_incl += y;
          }
          cls_lanes = __ballot_sync(
              0xffffffffu,
              lane_n > 0 && ClassOf(lane_pg.format, SmallOk(kD)) == cls);
        }
        int src = pi - win;
        if (((cls_lanes >> src) & 1u) == 0) {
          // skip to the window's next page of this class
          const unsigned ahead = cls_lanes & (0xffffffffu << src);
          const int j = ahead != 0 ? __ffs(ahead) - 1 : 32;
          const int excl_src =
              __shfl_sync(0xffffffffu, lane_incl - lane_n, src);
          const int excl_j =
              __shfl_sync(0xffffffffu, lane_incl - lane_n, j & 31);
          before +=
              (j < 32 ? excl_j : __shfl_sync(0xffffffffu, lane_incl, 31)) -
              excl_src;
          pi = win + j;
          if (j == 32) continue;
          src = j;
        }
        pdata = reinterpret_cast<const uint8_t*>(__shfl_sync(
            0xffffffffu, reinterpret_cast<unsigned long long>(lane_pg.data),
            src));
        const int n =
            min(max(__shfl_sync(0xffffffffu, lane_pg.num_tokens, src), 0), T);
        pfmt = __shfl_sync(0xffffffffu, lane_pg.format, src);
        valid = static_cast<int>(min(static_cast<long>(n), attend - before));
        before += n;
        if (valid <= 0) {
          ++pi;
          continue;
        }
        if (pfmt != plan_fmt) {
          // The warp keeps kPlans plans; lane i < kPlans knows slot i's
          // format (mixed pools switch formats page by page).
          const unsigned hit =
              __ballot_sync(0xffffffffu, lane < kPlans && slot_fmt == pfmt);
          int slot;
          if (hit != 0) {
            slot = __ffs(hit) - 1;
          } else {
            if (!SupportedEncoding(UnpackEncoding(pfmt), shape)) {
              poisoned = true;
              done = true;
              break;
            }
            slot = next_slot;
            next_slot = (next_slot + 1) % kPlans;
            if (lane == 0) plans[slot] = MakeTilePlan<kD>(pfmt, shape, h);
            if (lane == slot) slot_fmt = pfmt;
            __syncwarp();
          }
          plan = plans + slot;
          plan_fmt = pfmt;
          plan_bound = kSmall && whole_tiles ? plan->whole_total : plan->bound;
        }
        t0 = 0;
        page_ready = true;
      }
      if (issued == consumed) head = tail = hpos = 0;
      uint32_t pos = hpos;
      const bool whole = kSmall && whole_tiles;
      {  // ring full for a 16-row tile of this format?
        const uint32_t bound = plan_bound;
        const uint32_t wrap = pos + bound > Sm::kRing ? Sm::kRing - pos : 0;
        if (head - tail + bound + wrap > Sm::kRing) break;
      }
      const int nt = min(16, valid - t0);
      const uint32_t bf_mask = plan->bf_mask;
      // Lane i < 6 works out range i (page offset, ring bytes); the ring
      // places the ranges back to back (from the plan for whole tiles, else
      // an exclusive scan over lanes 0-7).
      const bool r_bf = !whole && lane < 2 && ((bf_mask >> lane) & 1u);
      uint32_t r_off = 0, r_size = 0, excl = 0, total;
      if (whole) {
        if (lane < 6) {
          r_off = plan->off[lane];
          if (t0 != 0) {
            r_off += t0 * plan->row[lane];
            if (lane == 2 || lane == 3) {
              r_off += (static_cast<uint32_t>(t0) >> plan->kg_shift) *
                       plan->kg_bytes;
            }
          }
          r_size = plan->whole_size[lane];
          excl = plan->whole_excl[lane];
        }
        total = plan->whole_total;
      } else {
        const uint32_t kg_off =
            (static_cast<uint32_t>(t0) >> plan->kg_shift) * plan->kg_bytes;
        if (lane < 6) {
          r_off = plan->off[lane] + t0 * plan->row[lane] +
                  (lane == 2 || lane == 3 ? kg_off : 0u);
          const uint32_t len = plan->fixed[lane] + nt * plan->per[lane];
          if (r_bf) {
            r_size = Sm::kTileBytes;
          } else if (len != 0) {
            r_size = ((r_off + len + 15) & ~15u) - (r_off & ~15u);
          }
        }
        uint32_t incl = r_size;
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
          const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        total = __shfl_sync(0xffffffffu, incl, 7);
        excl = incl - r_size;  // ring bytes before range lane
      }
      uint32_t need = total;
      if (pos + total > Sm::kRing) {
        need += Sm::kRing - pos;
        pos = 0;
      }
      head += need;
      hpos = pos + total;
      TileDesc* dd = descs + issued % kMaxInFlight;
      if (lane < 6) {
        dd->pos[lane] =
            static_cast<uint16_t>(pos + excl + (r_bf ? 0u : (r_off & 15u)));
      }
      if (lane == 0) {
        dd->format = pfmt;
        dd->nt = nt;
        dd->end = head;
      }
      const uint32_t bar = bar0 + static_cast<uint32_t>(issued % kMaxInFlight) *
                                      sizeof(TileDesc);
      if (kSmall) {  // no BF16 range in kSmall classes (ClassOf)
        // No swizzled BF16 range: lane i < 6 copies range i whole through
        // the TMA unit (16-byte aligned chunks of the page, back to back
        // in the ring); lane 0 expects the tile's bytes on the slot's
        // mbarrier. The proxy fence orders this warp's earlier generic
        // reads of the ring bytes before the async-proxy writes.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        if (lane == 0) BarArriveTx(bar, total);
        if (lane < 6 && r_size != 0) {
          BulkCopy(ring_addr + pos + excl, pdata + (r_off & ~15u), r_size, bar);
        }
      } else if (!kSmall && bf_mask == 0) {
        // BF16/TQ configuration, no swizzled BF16 range (TQ pages): the
        // tile's 16-byte chunks, all ranges in a row, round-robin over the
        // lanes. Chunk at ring byte cb of range i comes from page byte
        // (off_i & ~15) + cb - excl_i.
        const uint32_t r_delta = (r_off & ~15u) - excl;
        uint32_t e[6], dl[6];
#pragma unroll
        for (int i = 0; i < 6; ++i) {
          e[i] = __shfl_sync(0xffffffffu, excl, i);
          dl[i] = __shfl_sync(0xffffffffu, r_delta, i);
        }
        for (uint32_t cb = lane * 16; cb < total; cb += 32 * 16) {
          uint32_t dsel = dl[0];
#pragma unroll
          for (int i = 1; i < 6; ++i) dsel = cb >= e[i] ? dl[i] : dsel;
          CpAsync16(ring_addr + pos + cb, pdata + (dsel + cb), 16);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 6; ++i) {
          const uint32_t sz = __shfl_sync(0xffffffffu, r_size, i);
          const uint32_t so = __shfl_sync(0xffffffffu, r_off, i);
          const uint32_t dst =
              ring_addr + pos + __shfl_sync(0xffffffffu, excl, i);
          if (sz == 0) continue;
          if (i < 2 && ((bf_mask >> i) & 1u)) {
            constexpr int kCh = kD / 8;
            const uint8_t* src = pdata + so;
#pragma unroll
            for (int j = lane; j < 16 * kCh; j += 32) {
              const int r = j / kCh, ch = j % kCh;
              const bool in = r < nt;
              CpAsync16(dst + TileOff<kD>(r, ch),
                        in ? src + r * (kD * 2) + ch * 16 : pdata, in ? 16 : 0);
            }
          } else {
            const uint8_t* src = pdata + (so & ~15u);
            for (uint32_t j = lane * 16; j < sz; j += 32 * 16)
              CpAsync16(dst + j, src + j, 16);
          }
        }
      }
      if constexpr (!kSmall) CpCommit();
      ++issued;
      t0 += 16;
      if (t0 >= valid) {
        page_ready = false;
        ++pi;
      }
    }
  };

  // Running max and sum: of mma rows lane / 4 and lane / 4 + 8, or
  // (kSmall) of query heads 2 (lane % 4) and 2 (lane % 4) + 1.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  // O (rows = query heads, kD / 8 n-tiles) or O^T (kSmall: rows = dims,
  // kD / 16 m-tiles).
  constexpr int kAcc = kSmall ? kD / 16 : kNt;
  float o[kAcc][4];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // kSmall == false: o holds H S (P V) (TQ value domain) while rot.
  bool rot = false;

  const uint32_t q_addr = SmemAddr(sm + Sm::kQ),
                 qr_addr = SmemAddr(sm + Sm::kQr),
                 qp_addr = SmemAddr(sm + Sm::kQp);
  for (;;) {
    fill();
    if (issued == consumed) break;
    if constexpr (!kSmall) CpWaitAtMost(issued - consumed - 1);
    if constexpr (kSmall) {
      BarWait(bar0 + static_cast<uint32_t>(consumed % kMaxInFlight) *
                         sizeof(TileDesc),
              static_cast<uint32_t>(consumed / kMaxInFlight) & 1u);
    }
    __syncwarp();
    const TileDesc d = descs[consumed % kMaxInFlight];
    const UnpackedEncoding e = UnpackEncoding(d.format);
    const int nt = d.nt;
    const int lg_gv = 31 - __clz(min(e.Group(), kD));  // group: power of 2
    if constexpr (kSmall) {
      // Transposed tile (see ValuesRegT): S^T = K Q^T, softmax per column,
      // O^T += V^T P^T. Keys and values are INT or FP8 (ClassOf).
      const int g = lane / 4;
      float st[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (kTq) {
        ScoresTqTAny<kD>(e.k, ring + d.pos[0], ring + d.pos[2], s_lut4, s_lut2,
                         qb, lane, st);
      } else {
        ScoresRegTAny<kD>(e.k, ring + d.pos[0], ring + d.pos[2],
                          ring + d.pos[3], e.scale_dtype, qb, lane, st);
      }
      if (TokOf(g) >= nt) st[0] = st[1] = -INFINITY;
      if (TokOf(g) + 8 >= nt) st[2] = st[3] = -INFINITY;
      float corr[2], p[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float mx = fmaxf(st[j], st[2 + j]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[j], mx);
        corr[j] = Exp2Fast(m[j] - m_new);
        p[j] = Exp2Fast(st[j] - m_new);
        p[2 + j] = Exp2Fast(st[2 + j] - m_new);
        float sum = p[j] + p[2 + j];
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        sum += __shfl_xor_sync(0xffffffffu, sum, 8);
        sum += __shfl_xor_sync(0xffffffffu, sum, 16);
        l[j] = l[j] * corr[j] + sum;
        m[j] = m_new;
      }
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          o[i][0] *= corr[0];
          o[i][1] *= corr[1];
          o[i][2] *= corr[0];
          o[i][3] *= corr[1];
        }
      }
      if constexpr (kTq) {
        // TQ values: P's rows times the value norms (after l took the plain
        // sums); rows >= nt have p = 0 and must not meet non-finite norms.
        const uint8_t* nv = ring + d.pos[4];
        const int t = TokOf(g);
        const float n0 = t < nt ? HalfBits(LoadU16(nv + 2 * t)) : 0.f;
        const float n1 = t + 8 < nt ? HalfBits(LoadU16(nv + 2 * (t + 8))) : 0.f;
        p[0] *= n0;
        p[1] *= n0;
        p[2] *= n1;
        p[3] *= n1;
      }
      // P^T as the B operand: tokens 0-7 and 8-15 of query head g.
      const uint32_t pb0 = Movm(PackHalf(p[0], p[1]));
      const uint32_t pb1 = Movm(PackHalf(p[2], p[3]));
      if constexpr (kTq) {
        ValuesTqTAny<kD>(e.v, ring + d.pos[1], s_lut4, s_lut2, nt, pb0, pb1,
                         lane, o);
      } else {
        ValuesRegTAny<kD>(e.v, ring + d.pos[1], ring + d.pos[4],
                          ring + d.pos[5], e.scale_dtype, lg_gv, nt, pb0, pb1,
                          lane, o);
      }
    } else {
      // S = Q K^T: rows = query heads, cols = tokens (two n-tiles of 8).
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      // kSmall CTAs never see BF16/TQ keys (their class is the K format).
      if (!kSmall && (e.k == FormatCode::kBF16 || IsTqFormat(e.k))) {
        uint32_t k_addr;
        if (e.k == FormatCode::kBF16) {
          k_addr = ring_addr + d.pos[0];
        } else {
          // Levels only; the row norms scale S's columns below.
          DecodeStagedAny<true, kD, false>(e.k, ring + d.pos[0],
                                           ring + d.pos[2], nt, sDec, s_cb,
                                           s_sign, lane);
          k_addr = SmemAddr(sDec);
          __syncwarp();
        }
        const uint32_t qa = e.k == FormatCode::kBF16 ? q_addr : qr_addr;
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t af[4], bfr[4];
          Ldm4(qa + TileOff<kD>(lane % 16, kk * 2 + lane / 16), af);
          Ldm4(k_addr + TileOff<kD>((lane % 8) + (lane / 16) * 8,
                                    kk * 2 + (lane / 8) % 2),
               bfr);
          Mma(sc[0], af, bfr[0], bfr[1]);
          Mma(sc[1], af, bfr[2], bfr[3]);
        }
        if (e.k != FormatCode::kBF16) {
          // S column t *= norm_t (q' . (norm level) = norm (q' . level));
          // columns >= nt are masked below whatever their norm bytes.
          const uint8_t* nk = ring + d.pos[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float nm =
                  HalfBits(LoadU16(nk + 2 * (8 * j + 2 * (lane % 4) + c)));
              sc[j][c] *= nm;
              sc[j][2 + c] *= nm;
            }
          }
        }
        __syncwarp();  // sDec reads done before the values reuse it
      } else {
        ScoresRegAny<kD>(e.k, ring + d.pos[0], ring + d.pos[2], ring + d.pos[3],
                         e.scale_dtype, qp_addr, lane, sc);
      }
      // Values: BF16 in place (bf16 P), TQ rotated back into a bf16 tile
      // (bf16 P), INT and FP8 dequantized into an fp16 tile (fp16 P).
      uint32_t v_addr;
      const bool v16 = e.v != FormatCode::kBF16 && !IsTqFormat(e.v);
      if (e.v == FormatCode::kBF16) {
        v_addr = ring_addr + d.pos[1];
      } else {
        if (v16) {
          DecodeValuesF16Any<kD>(e.v, ring + d.pos[1], ring + d.pos[4],
                                 ring + d.pos[5], e.scale_dtype, lg_gv, nt,
                                 sDec, lane);
        } else if constexpr (kSmall) {
          DecodeStagedAny<false, kD>(e.v, ring + d.pos[1], ring + d.pos[4], nt,
                                     sDec, s_cb, s_sign, lane);
        } else {
          // TQ values stay rotated (RotateAcc) and unscaled: the row norms
          // scale P's columns below.
          DecodeStagedAny<true, kD, false>(e.v, ring + d.pos[1],
                                           ring + d.pos[4], nt, sDec, s_cb,
                                           s_sign, lane);
        }
        v_addr = SmemAddr(sDec);
        __syncwarp();
      }
      // Online softmax; lane holds rows lane/4 (i=0) and lane/4+8 (i=1).
      // Rows 8-15 are only computed when they hold query heads (group > 8).
      float corr[2], p[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (i == 1 && !hi_rows) {
          corr[1] = 1.f;
          p[0][2] = p[0][3] = p[1][2] = p[1][3] = 0.f;
          break;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * j + 2 * (lane % 4) + c;
            float& s_ = sc[j][2 * i + c];
            if (col >= nt) s_ = -INFINITY;
            mx = fmaxf(mx, s_);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[i], mx);
        corr[i] = Exp2Fast(m[i] - m_new);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            p[j][2 * i + c] = Exp2Fast(sc[j][2 * i + c] - m_new);
            sum += p[j][2 * i + c];
          }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l[i] = l[i] * corr[i] + sum;
        m[i] = m_new;
      }
      // Rescale only when some row's running max moved (corr != 1).
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          o[j][0] *= corr[0];
          o[j][1] *= corr[0];
        }
        if (hi_rows) {
#pragma unroll
          for (int j = 0; j < kNt; ++j) {
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
          }
        }
      }
      if constexpr (!kSmall) {
        const bool vtq = IsTqFormat(e.v);
        if (vtq != rot) {
          RotateAcc<kD>(o, rot, s_sign, lane);
          rot = vtq;
        }
        if (vtq) {
          // P column t *= norm_t (after l took the plain sum); columns >= nt
          // have p = 0 and must not meet non-finite norm bytes.
          const uint8_t* nv = ring + d.pos[4];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int col = 8 * j + 2 * (lane % 4) + c;
              const float nm = col < nt ? HalfBits(LoadU16(nv + 2 * col)) : 0.f;
              p[j][c] *= nm;
              p[j][2 + c] *= nm;
            }
          }
        }
      }
      if (v16) {
        const uint32_t pa[4] = {
            PackHalf(p[0][0], p[0][1]), PackHalf(p[0][2], p[0][3]),
            PackHalf(p[1][0], p[1][1]), PackHalf(p[1][2], p[1][3])};
#pragma unroll
        for (int j = 0; j < kNt; j += 2) {
          uint32_t bfr[4];
          Ldm4T(v_addr + TileOff<kD>((lane % 8) + ((lane / 8) % 2) * 8,
                                     j + lane / 16),
                bfr);
          MmaF16(o[j], pa, bfr[0], bfr[1]);
          MmaF16(o[j + 1], pa, bfr[2], bfr[3]);
        }
      } else {
        const uint32_t pa[4] = {
            PackBf16(p[0][0], p[0][1]), PackBf16(p[0][2], p[0][3]),
            PackBf16(p[1][0], p[1][1]), PackBf16(p[1][2], p[1][3])};
#pragma unroll
        for (int j = 0; j < kNt; j += 2) {
          uint32_t bfr[4];
          Ldm4T(v_addr + TileOff<kD>((lane % 8) + ((lane / 8) % 2) * 8,
                                     j + lane / 16),
                bfr);
          Mma(o[j], pa, bfr[0], bfr[1]);
          Mma(o[j + 1], pa, bfr[2], bfr[3]);
        }
      }
    }
    __syncwarp();  // tile reads done before its ring bytes are reused
    tail = d.end;
    ++consumed;
  }
  const size_t qh0 = static_cast<size_t>(b) * a.n_q_heads + h * a.group + row0;
  if constexpr (kSmall) {
    if constexpr (kTq) RotateAccT<kD>(o, s_sign, lane);
    StorePartialsT<kD>(a, qh0, nrows, parts, part, m, l, poisoned, o, lane);
  } else {
    CpWait<0>();
    if (rot) RotateAcc<kD>(o, true, s_sign, lane);
    StorePartials<kD>(a, qh0, nrows, parts, part, m, l, poisoned, o, lane);
  }
}

}  // namespace
}  // namespace triax::kernels::cuda
