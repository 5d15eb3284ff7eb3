// CUDA kernels for KV pages; see kv_cuda.cuh for the API and layout.h for
// the byte layout. Each page's encoding is packed into DevicePage::format
// and its section offsets are computed on the device by ComputeLayout
// (layout.h, host and device code); CudaPageLayout unpacks on the host so a
// test pins the unpacking to ComputeLayout for every supported encoding.
//
// Numerics that must match the CPU reference bit for bit (encode) use
// explicitly rounded intrinsics (__fdiv_rn, __fsub_rn, rintf) so that nvcc's
// contraction into FMA cannot change a code. Decode uses __fmul_rn/__fadd_rn
// for the same reason; attention lets FMA contract (tolerance-checked).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_cuda.cuh"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/tq_codebook.h"

namespace triax::kernels::cuda {
namespace {

#define KV_RETURN_IF_ERROR(expr)             \
  do {                                       \
    absl::Status kv_status_ = (expr);        \
    if (!kv_status_.ok()) return kv_status_; \
  } while (false)

constexpr float kFp16Max = 65504.f;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroupTimesDim = 4096;  // query heads per KV head x D
constexpr int kTile = 32;  // tokens per attention tile (= warp size)
constexpr int kAttnThreads = 128;
constexpr int kCodecThreads = 256;

// DevicePage::format (PackEncoding): V 0 means K's format, group 0 32 and
// scale dtype 0 FP16.
__host__ __device__ __forceinline__ UnpackedEncoding Unpack(int32_t packed) {
  const uint32_t p = static_cast<uint32_t>(packed);
  UnpackedEncoding e;
  const int k = p & 0xff;
  e.k = static_cast<FormatCode>(k);
  const int v = (p >> 8) & 0xff;
  e.v = static_cast<FormatCode>(v == 0 ? k : v);
  const int group = (p >> 16) & 0xff;
  e.group = group == 0 ? 32 : group;
  const int sdt = (p >> 24) & 0xff;
  e.scale_dtype = static_cast<ScaleDtypeCode>(sdt == 0 ? 1 : sdt);
  return e;
}

// A page the kernels can read or write (ValidateEncoding's checks for a
// shape that passed ValidateShape: head_dim % 8 == 0).
__host__ __device__ __forceinline__ bool Supported(const UnpackedEncoding& e,
                                                   const PageShape& s) {
  return EncodingFitsShape(e, s, /*head_dim_multiple=*/8);
}

__device__ __forceinline__ float Bf16Bits(uint32_t h) {
  return __uint_as_float(h << 16);
}
__device__ __forceinline__ float HalfBits(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t LoadU16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

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

// ---- TQ tables and the warp-level Hadamard transform ---------------------

// Codebooks and signs for D = 16 << i (i in 0..4), bits 2..4; uploaded on
// first use per device (EnsureTqTables).
__device__ float g_tq_cb[5][3][16];
__device__ float g_tq_sign[5][256];

__host__ __device__ __forceinline__ int Log2Dim(int d) {
  int l = 0;
  while ((16 << l) < d) ++l;
  return l;
}
__device__ __forceinline__ const float* TqLevels(FormatCode f, int D) {
  return g_tq_cb[Log2Dim(D)][FormatBits(f) - 2];
}
__device__ __forceinline__ const float* TqSignsDev(int D) {
  return g_tq_sign[Log2Dim(D)];
}

// In-place FWHT of one vector of D (power of two, 16..256) floats spread
// over a warp: lane holds dims lane * E + i, E = max(1, D / 32), in x[0..E).
// Butterflies in the same stage order and with the same operations as
// kernels/tq_codebook.cc (a + b low, a - b high), so results match bit for
// bit.
__device__ __forceinline__ void WarpFwht(float (&x)[8], int D, int lane) {
  const int E = D >= 32 ? D / 32 : 1;
#pragma unroll
  for (int lg = 0; lg < 3; ++lg) {
    const int len = 1 << lg;
    if (len < E) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if ((i & len) == 0 && i + len < 8 && i + len < E) {
          const float a = x[i], b = x[i + len];
          x[i] = __fadd_rn(a, b);
          x[i + len] = __fsub_rn(a, b);
        }
      }
    }
  }
  for (int len = E; len < D; len <<= 1) {
    const int m = len / E;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float p = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = (lane & m) ? __fsub_rn(p, x[i]) : __fadd_rn(x[i], p);
    }
  }
}

// Code of dim d in a TQ row (little-endian bit stream).
__device__ __forceinline__ uint32_t TqCode(const uint8_t* row, int row_bytes,
                                           int d, int bits) {
  const int bit = d * bits;
  uint32_t w = row[bit / 8];
  if (bit / 8 + 1 < row_bytes)
    w |= static_cast<uint32_t>(row[bit / 8 + 1]) << 8;
  return (w >> (bit % 8)) & ((1u << bits) - 1u);
}

// Row (h, t) of a TQ tensor decoded to the original domain, dims
// lane * E + i in x (as DecodePage: norm * level, then R^T).
__device__ __forceinline__ void TqDecodeRowWarp(
    FormatCode f, const TensorLayout& L, const uint8_t* page,
    const PageShape& s, int h, int t, int lane, float (&x)[8]) {
  const int T = s.tokens, D = s.head_dim, bits = FormatBits(f);
  const int E = D >= 32 ? D / 32 : 1;
  const int row_bytes = D * bits / 8;
  const float* cb = TqLevels(f, D);
  const float* sg = TqSignsDev(D);
  const size_t row = static_cast<size_t>(h) * T + t;
  const float norm = HalfBits(LoadU16(page + L.scale + 2 * row));
  const uint8_t* codes = page + L.codes + row * row_bytes;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane * E + i;
    x[i] = (i < E && d < D)
               ? __fmul_rn(norm, cb[TqCode(codes, row_bytes, d, bits)])
               : 0.f;
  }
  WarpFwht(x, D, lane);
  const float nrm = __fdiv_rn(1.f, __fsqrt_rn(static_cast<float>(D)));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane * E + i;
    if (i < E && d < D) x[i] = __fmul_rn(x[i], __fmul_rn(nrm, sg[d]));
  }
}

// Encodes one TQ tensor (the whole CTA; one warp per (head, token) vector).
// s_row: 32 words per warp of scratch.
__device__ void EncodeTqTensor(FormatCode f, const PageShape& shape,
                               const TensorLayout& L, int n,
                               const uint16_t* src, uint8_t* page,
                               unsigned* s_row) {
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int bits = FormatBits(f), levels = 1 << bits;
  const int E = D >= 32 ? D / 32 : 1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  const int row_bytes = D * bits / 8;
  const float* cb = TqLevels(f, D);
  const float* sg = TqSignsDev(D);
  float mid[15];
#pragma unroll
  for (int i = 0; i < 15; ++i)
    mid[i] = i + 1 < levels ? __fmul_rn(0.5f, __fadd_rn(cb[i], cb[i + 1]))
                            : INFINITY;
  const float nrm = __fdiv_rn(1.f, __fsqrt_rn(static_cast<float>(D)));
  unsigned* row = s_row + 32 * warp;
  for (int v = warp; v < H * n; v += nwarps) {
    const int h = v / n, t = v % n;
    const uint16_t* xs = src + (static_cast<size_t>(t) * H + h) * D;
    float x[8];
    double sq = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int d = lane * E + i;
      x[i] = (i < E && d < D) ? Bf16Bits(xs[d]) : 0.f;
      sq += static_cast<double>(x[i]) * x[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const double norm = sqrt(sq);
    if (lane == 0) {
      *reinterpret_cast<uint16_t*>(page + L.scale +
                                   2 * (static_cast<size_t>(h) * T + t)) =
          __half_as_ushort(__float2half_rn(
              static_cast<float>(norm < 65504.0 ? norm : 65504.0)));
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int d = lane * E + i;
      if (i < E && d < D) x[i] = __fmul_rn(x[i], sg[d]);
    }
    WarpFwht(x, D, lane);
    const float inv = norm > 0 ? static_cast<float>(1.0 / norm) : 0.f;
    row[lane] = 0u;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int d = lane * E + i;
      if (i < E && d < D) {
        const float u = __fmul_rn(__fmul_rn(x[i], nrm), inv);
        uint32_t code = 0;
#pragma unroll
        for (int j = 0; j < 15; ++j) code += u > mid[j] ? 1u : 0u;
        const int bit = d * bits;
        atomicOr(&row[bit / 32], code << (bit % 32));
        if (bit % 32 + bits > 32)
          atomicOr(&row[bit / 32 + 1], code >> (32 - bit % 32));
      }
    }
    __syncwarp();
    uint8_t* dst =
        page + L.codes + (static_cast<size_t>(h) * T + t) * row_bytes;
    for (int j = lane; j < row_bytes; j += 32)
      dst[j] = static_cast<uint8_t>(row[j / 4] >> (8 * (j % 4)));
    __syncwarp();
  }
}

// ---- Encode
// ------------------------------------------------------------------

// Encodes one tensor of one page (the whole CTA cooperates).
__device__ void EncodeTensor(FormatCode f, bool key, const UnpackedEncoding& e,
                             const PageShape& shape, const TensorLayout& L,
                             int n, const uint16_t* src, uint8_t* page,
                             float* s_ks, float* s_kz, unsigned* s_amax,
                             unsigned* s_row) {
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  if (IsTqFormat(f)) {
    EncodeTqTensor(f, shape, L, n, src, page, s_row);
    return;
  }
  if (f == FormatCode::kBF16) {
    const int chunks = D / 8;
    const size_t items = static_cast<size_t>(n) * H * chunks;
    for (size_t i = threadIdx.x; i < items; i += blockDim.x) {
      const int c = static_cast<int>(i % chunks);
      const size_t th = i / chunks;  // t * H + h
      const int h = static_cast<int>(th % H);
      const int t = static_cast<int>(th / H);
      const size_t dst = ((static_cast<size_t>(h) * T + t) * D + c * 8) * 2;
      *reinterpret_cast<uint4*>(page + L.codes + dst) =
          *reinterpret_cast<const uint4*>(src + th * D + c * 8);
    }
    return;
  }
  if (f == FormatCode::kFP8) {
    for (int h = 0; h < H; ++h) {
      if (threadIdx.x == 0) *s_amax = 0u;
      __syncthreads();
      float local = 0.f;
      for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int t = i / D, d = i % D;
        const float a =
            fabsf(Bf16Bits(src[(static_cast<size_t>(t) * H + h) * D + d]));
        if (a > local && a <= 3.402823466e38f) local = a;
      }
      atomicMax(s_amax, __float_as_uint(local));  // non-negative floats
      __syncthreads();
      const float amax = __uint_as_float(*s_amax);
      const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
      if (threadIdx.x == 0) {
        *reinterpret_cast<float*>(page + L.scale + 4 * static_cast<size_t>(h)) =
            scale;
      }
      for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int t = i / D, d = i % D;
        const float x = Bf16Bits(src[(static_cast<size_t>(t) * H + h) * D + d]);
        page[L.codes + (static_cast<size_t>(h) * T + t) * D + d] =
            static_cast<uint8_t>(FloatToFp8E4M3Bits(__fdiv_rn(x, scale)));
      }
      __syncthreads();
    }
    return;
  }
  const int bits = FormatBits(f);
  const int per_byte = 8 / bits;
  const int qmax = (1 << bits) - 1;
  const int row_bytes = D * bits / 8;
  if (key) {
    const int gk = shape.KeyGroup(e);
    const int groups = T / gk;
    for (int h = 0; h < H; ++h) {
      for (int gi = 0; gi * gk < n; ++gi) {
        const int t0 = gi * gk, t1 = min(n, t0 + gk);
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
          float lo = INFINITY, hi = -INFINITY;
          for (int t = t0; t < t1; ++t) {
            const float x =
                Bf16Bits(src[(static_cast<size_t>(t) * H + h) * D + d]);
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
          }
          const Quant q = MakeQuant(lo, hi, qmax, e.scale_dtype);
          const size_t meta = (static_cast<size_t>(h) * groups + gi) * D + d;
          StoreMeta(page + L.scale, meta, q.scale_bits, e.scale_dtype);
          StoreMeta(page + L.zero, meta, q.zero_bits, e.scale_dtype);
          s_ks[d] = q.scale;
          s_kz[d] = q.zero;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < (t1 - t0) * row_bytes; i += blockDim.x) {
          const int t = t0 + i / row_bytes, j = i % row_bytes;
          const uint16_t* x = src + (static_cast<size_t>(t) * H + h) * D;
          uint32_t byte = 0;
          for (int b = 0; b < per_byte; ++b) {
            const int d = j * per_byte + b;
            Quant q;
            q.scale = s_ks[d];
            q.zero = s_kz[d];
            byte |= Quantize(Bf16Bits(x[d]), q, qmax) << (b * bits);
          }
          page[L.codes + (static_cast<size_t>(h) * T + t) * row_bytes + j] =
              static_cast<uint8_t>(byte);
        }
        __syncthreads();  // s_ks/s_kz are rewritten for the next group
      }
    }
    return;
  }
  // Values: one thread per (head, token, group); Gv % 8 == 0 keeps groups
  // byte aligned for every bit width.
  const int gv = shape.ValueGroup(e);
  const int groups = D / gv;
  for (int i = threadIdx.x; i < H * n * groups; i += blockDim.x) {
    const int g = i % groups, t = (i / groups) % n, h = i / (groups * n);
    const uint16_t* x = src + (static_cast<size_t>(t) * H + h) * D + g * gv;
    float lo = INFINITY, hi = -INFINITY;
    for (int d = 0; d < gv; ++d) {
      lo = fminf(lo, Bf16Bits(x[d]));
      hi = fmaxf(hi, Bf16Bits(x[d]));
    }
    const Quant q = MakeQuant(lo, hi, qmax, e.scale_dtype);
    const size_t meta = (static_cast<size_t>(h) * T + t) * groups + g;
    StoreMeta(page + L.scale, meta, q.scale_bits, e.scale_dtype);
    StoreMeta(page + L.zero, meta, q.zero_bits, e.scale_dtype);
    uint8_t* row =
        page + L.codes + (static_cast<size_t>(h) * T + t) * row_bytes;
    for (int jb = 0; jb < gv / per_byte; ++jb) {
      uint32_t byte = 0;
      for (int b = 0; b < per_byte; ++b) {
        byte |= Quantize(Bf16Bits(x[jb * per_byte + b]), q, qmax) << (b * bits);
      }
      row[(g * gv) / per_byte + jb] = static_cast<uint8_t>(byte);
    }
  }
}

// Zeroes one page and encodes n tokens of K and V into it (whole CTA).
__device__ void EncodePageBody(const PageShape& shape,
                               const UnpackedEncoding& e, uint8_t* page, int n,
                               const uint16_t* k_in, const uint16_t* v_in,
                               float* s_ks, float* s_kz, unsigned* s_amax,
                               unsigned* s_row) {
  const PageLayout L = ComputeLayout(e, shape);
  uint4* page16 = reinterpret_cast<uint4*>(page);
  for (size_t i = threadIdx.x; i < L.total / 16; i += blockDim.x)
    page16[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  EncodeTensor(e.k, true, e, shape, L.k, n, k_in, page, s_ks, s_kz, s_amax,
               s_row);
  __syncthreads();
  EncodeTensor(e.v, false, e, shape, L.v, n, v_in, page, s_ks, s_kz, s_amax,
               s_row);
}

// One CTA per page: zero the page, then encode K and V.
__global__ void EncodeKernel(PageShape shape, const DevicePage* pages,
                             const uint16_t* k_in, const uint16_t* v_in) {
  __shared__ float s_ks[kMaxHeadDim];
  __shared__ float s_kz[kMaxHeadDim];
  __shared__ unsigned s_amax;
  __shared__ unsigned s_row[kCodecThreads];
  const DevicePage pg = pages[blockIdx.x];
  const UnpackedEncoding e = Unpack(pg.format);
  if (!Supported(e, shape)) return;
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int n = min(max(pg.num_tokens, 0), T);
  const size_t in_base = static_cast<size_t>(blockIdx.x) * T * H * D;
  EncodePageBody(shape, e, pg.data, n, k_in + in_base, v_in + in_base, s_ks,
                 s_kz, &s_amax, s_row);
}

// ---- Shared decode of 8 consecutive dims ---------------------------------

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

// ---- Decode ----------------------------------------------------------------

// Decodes tokens [0, n) of one tensor of head h of a page (whole CTA):
// non-TQ one thread per (token, 8-dim chunk), TQ one warp per token.
// store(t, d0, x, count) receives `count` consecutive dims starting at d0.
template <typename Store>
__device__ void DecodeTensorHead(FormatCode f, bool key,
                                 const UnpackedEncoding& e, bool ok,
                                 const TensorLayout& L, const uint8_t* page,
                                 const PageShape& shape, int h, int n,
                                 Store store) {
  const int D = shape.head_dim;
  if (ok && IsTqFormat(f)) {
    const int lane = threadIdx.x % 32, E = D >= 32 ? D / 32 : 1;
    for (int t = threadIdx.x / 32; t < n; t += blockDim.x / 32) {
      float x[8];
      TqDecodeRowWarp(f, L, page, shape, h, t, lane, x);
      if (lane * E < D) store(t, lane * E, x, E);
    }
    return;
  }
  const int chunks = D / 8;
  for (int i = threadIdx.x; i < n * chunks; i += blockDim.x) {
    const int t = i / chunks, d0 = (i % chunks) * 8;
    float x[8];
    if (ok) {
      LoadRow8(f, key, e, L, page, shape, h, t, d0, x);
    } else {
      for (int j = 0; j < 8; ++j) x[j] = __uint_as_float(0x7fc00000u);
    }
    store(t, d0, x, 8);
  }
}

// One CTA per (page, head).
__global__ void DecodeKernel(PageShape shape, const DevicePage* pages,
                             float* k_out, float* v_out) {
  const int H = shape.heads;
  const int pi = blockIdx.x / H, h = blockIdx.x % H;
  const DevicePage pg = pages[pi];
  const UnpackedEncoding e = Unpack(pg.format);
  const bool ok = Supported(e, shape);
  const int T = shape.tokens, D = shape.head_dim;
  const int n = min(max(pg.num_tokens, 0), T);
  const PageLayout L = ComputeLayout(e, shape);
  for (int which = 0; which < 2; ++which) {
    float* out = which == 0 ? k_out : v_out;
    if (out == nullptr) continue;
    auto store = [&](int t, int d0, const float* x, int count) {
      float* o = out + ((static_cast<size_t>(pi) * T + t) * H + h) * D + d0;
      for (int j = 0; j < count; ++j) o[j] = x[j];
    };
    if (which == 0) {
      DecodeTensorHead(e.k, true, e, ok, L.k, pg.data, shape, h, n, store);
    } else {
      DecodeTensorHead(e.v, false, e, ok, L.v, pg.data, shape, h, n, store);
    }
  }
}

// ---- Demote ----------------------------------------------------------------

// One CTA per page: decode src to BF16 in the page's scratch slice
// ([T][H][D] K then V), barrier, encode into dst.
__global__ void DemoteKernel(PageShape shape, const DevicePage* src,
                             const DevicePage* dst, uint16_t* scratch) {
  __shared__ float s_ks[kMaxHeadDim];
  __shared__ float s_kz[kMaxHeadDim];
  __shared__ unsigned s_amax;
  __shared__ unsigned s_row[kCodecThreads];
  const DevicePage ps = src[blockIdx.x], pd = dst[blockIdx.x];
  const UnpackedEncoding es = Unpack(ps.format), ed = Unpack(pd.format);
  if (!Supported(es, shape) || !Supported(ed, shape)) return;
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int n = min(max(ps.num_tokens, 0), T);
  const size_t elems = static_cast<size_t>(T) * H * D;
  uint16_t* k = scratch + 2 * elems * blockIdx.x;
  uint16_t* v = k + elems;
  const PageLayout L = ComputeLayout(es, shape);
  for (int h = 0; h < H; ++h) {
    for (int which = 0; which < 2; ++which) {
      uint16_t* out = which == 0 ? k : v;
      auto store = [&](int t, int d0, const float* x, int count) {
        uint16_t* o = out + (static_cast<size_t>(t) * H + h) * D + d0;
        for (int j = 0; j < count; ++j)
          o[j] = __bfloat16_as_ushort(__float2bfloat16_rn(x[j]));
      };
      if (which == 0) {
        DecodeTensorHead(es.k, true, es, true, L.k, ps.data, shape, h, n,
                         store);
      } else {
        DecodeTensorHead(es.v, false, es, true, L.v, ps.data, shape, h, n,
                         store);
      }
    }
  }
  __syncthreads();  // every byte of src read before dst (maybe src) is written
  EncodePageBody(shape, ed, pd.data, n, k, v, s_ks, s_kz, &s_amax, s_row);
}

// ---- Attention
// -----------------------------------------------------------------

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Shared memory plan (floats) for one CTA of the attention kernel.
struct AttnSmem {
  int q, acc, ks, kz, kt, vt, sc, m, l, corr, total;
  __host__ __device__ AttnSmem(int group, int D) {
    int o = 0;
    q = o;
    o += group * D;  // pre-scaled queries
    acc = o;
    o += group * D;  // unnormalized outputs
    ks = o;
    o += D;  // key scale of the current page
    kz = o;
    o += D;  // key zero
    kt = o;
    o += kTile * (D + 1);  // key tile, rows padded: conflict-free dots
    vt = o;
    o += kTile * D;  // value tile
    sc = o;
    o += group * kTile;  // scores, then probabilities
    m = o;
    o += group;
    l = o;
    o += group;
    corr = o;
    o += group;
    total = o;
  }
};

// One CTA per (sequence, KV head) serving the `group` query heads that share
// the KV head, so each page is decoded once for all of them. Per tile of 32
// tokens: decode K and V into shared memory, scores (one warp per query head,
// one lane per token), an online-softmax update per query head, then the
// weighted V sum (one thread per (query head, dim)).
template <int kD>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionKernel(PageShape shape, int n_q_heads, float scale,
                    const float* __restrict__ q, float* __restrict__ out,
                    const DevicePage* __restrict__ pages,
                    const int32_t* __restrict__ indptr,
                    const int32_t* __restrict__ attend_tokens) {
  extern __shared__ float smem[];
  const int H = shape.heads, T = shape.tokens;
  const int D = kD > 0 ? kD : shape.head_dim;
  const int group = n_q_heads / H;
  const int b = blockIdx.x / H, h = blockIdx.x % H;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = kAttnThreads / 32;
  const AttnSmem plan(group, D);
  float* s_q = smem + plan.q;
  float* s_acc = smem + plan.acc;
  float* s_kt = smem + plan.kt;
  float* s_vt = smem + plan.vt;
  float* s_sc = smem + plan.sc;
  float* s_m = smem + plan.m;
  float* s_l = smem + plan.l;
  float* s_corr = smem + plan.corr;

  const size_t q_base = (static_cast<size_t>(b) * n_q_heads + h * group) * D;
  for (int i = tid; i < group * D; i += kAttnThreads) {
    s_q[i] = q[q_base + i] * scale;
    s_acc[i] = 0.f;
  }
  for (int g = tid; g < group; g += kAttnThreads) {
    s_m[g] = -INFINITY;
    s_l[g] = 0.f;
  }
  __syncthreads();

  const int first = indptr[b], last = indptr[b + 1];
  int remaining = attend_tokens[b];
  const int chunks = D / 8;
  bool poisoned = false;
  for (int pi = first; pi < last && remaining > 0; ++pi) {
    const DevicePage pg = pages[pi];
    const UnpackedEncoding e = Unpack(pg.format);
    if (!Supported(e, shape)) {  // never silently wrong: NaN output
      poisoned = true;
      break;
    }
    const int n = min(min(max(pg.num_tokens, 0), T), remaining);
    remaining -= n;
    const PageLayout L = ComputeLayout(e, shape);
    const uint8_t* page = pg.data;
    for (int t0 = 0; t0 < n; t0 += kTile) {
      const int nt = min(kTile, n - t0);
      // Decode the tile.
      for (int i = tid; i < nt * chunks; i += kAttnThreads) {
        const int tt = i / chunks, d0 = (i % chunks) * 8;
        float x[8];
        LoadRow8(e.k, true, e, L.k, page, shape, h, t0 + tt, d0, x);
#pragma unroll
        for (int j = 0; j < 8; ++j) s_kt[tt * (D + 1) + d0 + j] = x[j];
        LoadRow8(e.v, false, e, L.v, page, shape, h, t0 + tt, d0, x);
        *reinterpret_cast<float4*>(s_vt + tt * D + d0) =
            make_float4(x[0], x[1], x[2], x[3]);
        *reinterpret_cast<float4*>(s_vt + tt * D + d0 + 4) =
            make_float4(x[4], x[5], x[6], x[7]);
      }
      __syncthreads();
      // Scores and the online-softmax update: warp w owns query heads
      // w, w + 4, ...; lane = token in the tile.
      for (int g = warp; g < group; g += kWarps) {
        float s = -INFINITY;
        if (lane < nt) {
          const float* qr = s_q + g * D;
          const float* kr = s_kt + lane * (D + 1);
          float dot = 0.f;
#pragma unroll 8
          for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
          s = dot;
        }
        const float m_old = s_m[g];
        const float m_new = fmaxf(m_old, WarpMax(s));
        const float p = lane < nt ? __expf(s - m_new) : 0.f;
        const float sum = WarpSum(p);
        s_sc[g * kTile + lane] = p;
        if (lane == 0) {
          const float corr = __expf(m_old - m_new);  // 0 on the first tile
          s_corr[g] = corr;
          s_l[g] = s_l[g] * corr + sum;
          s_m[g] = m_new;
        }
      }
      __syncthreads();
      for (int i = tid; i < group * D; i += kAttnThreads) {
        const int g = i / D, d = i % D;
        const float* pr = s_sc + g * kTile;
        float a = s_acc[i] * s_corr[g];
        for (int tt = 0; tt < nt; ++tt) a += pr[tt] * s_vt[tt * D + d];
        s_acc[i] = a;
      }
      __syncthreads();
    }
  }
  float* o = out + q_base;
  for (int i = tid; i < group * D; i += kAttnThreads) {
    const float l = s_l[i / D];
    o[i] = poisoned ? __uint_as_float(0x7fc00000u)
                    : (l > 0.f ? s_acc[i] / l : 0.f);
  }
}

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
// (mixed pools no longer switch format tile by tile), and the reduce kernel
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

constexpr int kMmaWarps = 4;
constexpr int kMaxInFlight = 16;
constexpr int kPlans = 8;        // per-warp TilePlan cache (formats)
constexpr int kPlanBytes = 256;  // shared-memory slot of one TilePlan
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;
// Encoding classes: pages are grouped by their K format (any byte value
// maps to one of kClasses), each class of a sequence is its own set of
// split-K partitions, and CTAs are ordered class-major so that the SMs run
// one class's code at a time (mixed pools otherwise thrash the instruction
// cache switching formats tile by tile). Classes 1-4 (K INT4, INT2, FP8,
// INT8) run the transposed kSmall kernel, which needs INT/FP8 values too
// and head_dim >= 64 (small_ok); other pages with such keys join class 0,
// whose kernel takes every format. Likewise classes 5 and 7 (K TQ4, TQ2)
// run its kTq variant with TQ4/TQ2 values (else they join class 6).
constexpr int kClasses = 8;
__host__ __device__ __forceinline__ int ClassOf(int32_t packed_format,
                                                bool small_ok) {
  const UnpackedEncoding e = Unpack(packed_format);
  const uint32_t fk = static_cast<uint32_t>(e.k),
                 fv = static_cast<uint32_t>(e.v);
  constexpr uint32_t kInt4 = static_cast<uint32_t>(Format::kINT4),
                     kInt8 = static_cast<uint32_t>(Format::kINT8),
                     kTq4 = static_cast<uint32_t>(Format::kTQ4),
                     kTq2 = static_cast<uint32_t>(Format::kTQ2);
  static_assert(kInt4 == 2 && static_cast<uint32_t>(Format::kINT2) == 3 &&
                    static_cast<uint32_t>(Format::kFP8) == 4 && kInt8 == 5,
                "INT4, INT2, FP8, INT8 are the Format values 2..5");
  // INT4, INT2, FP8, INT8: the formats of the transposed kernel's tiles.
  const bool k_small = fk >= kInt4 && fk <= kInt8,
             v_small = fv >= kInt4 && fv <= kInt8;
  if (k_small && !(small_ok && v_small)) return 0;
  // TQ4/TQ2 keys take the transposed kTq kernel with TQ4/TQ2 values only;
  // with other values they join class 6 (TQ3 keys: the full kernel, whose
  // CTAs of that class build Q' = R Q).
  const bool k_tq = fk == kTq4 || fk == kTq2, v_tq = fv == kTq4 || fv == kTq2;
  if (small_ok && k_tq && !v_tq) return 6;
  // Class c holds K format c + 1 (any byte value maps to a class).
  return (fk - 1u) & (kClasses - 1);
}
// head_dims whose kSmall kernel is built (ValuesRegT: runs of >= 2 bytes).
__host__ __device__ constexpr bool SmallOk(int d) { return d >= 64; }

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

// Classes per launch (MmaArgs::classes): with head_dim >= 64, the full
// kernel runs classes 0 and 6 (BF16 and TQ3 keys, and the pages that fit
// no transposed class: INT/FP8 keys join 0, TQ keys 6), the transposed
// kernel 1-2 (INT4/INT2 keys), 3-4
// (FP8/INT8 keys) and 5, 7 (TQ4/TQ2, its kTq variant); below 64 the full
// kernel runs 0 and 5-7 (classes 1-4 get no pages then).
constexpr int kLaunchClasses = 4;  // the most classes in one launch
constexpr uint32_t ClassList(int c0, int c1, int c2 = 0, int c3 = 0) {
  return static_cast<uint32_t>(c0 | c1 << 4 | c2 << 8 | c3 << 12);
}
// Registers of the kSmall kernel are capped for this many CTAs per SM:
// measured on the H100 (batch 64 x 32k), INT4/INT2 keys run fastest at 4
// (16 warps, 128 registers), FP8/INT8 keys at 3 (fewer spills and moves
// matter more than warps for their larger tiles).
constexpr int kSmallCtas(int d, bool low_bit) {
  return d > 128 ? 2 : (low_bit ? 4 : 3);
}

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

// 2^x by the SFU alone (ex2.approx.ftz: relative error ~2^-22, results
// below 2^-126 flushed to 0, 2^-inf = 0). exp2f adds a range check and two
// multiplies per call to keep denormal results, which softmax weights that
// small do not need.
__device__ __forceinline__ float Exp2Fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                          int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// mbarrier helpers (shared-memory addresses).
__device__ __forceinline__ void BarInit(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void BarArriveTx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], "
      "%1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}
// Waits for the completion of the phase of parity `parity`.
__device__ __forceinline__ void BarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nKV_BAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra KV_BAR_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) global ->
// shared through the TMA unit, completing `bytes` transactions on bar.
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src,
                                         uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Waits until at most n (< kMaxInFlight) groups are pending.
__device__ __forceinline__ void CpWaitAtMost(int n) {
  switch (n) {
#define KV_WAIT_CASE(i) \
  case i:               \
    CpWait<i>();        \
    break;
    KV_WAIT_CASE(1)
    KV_WAIT_CASE(2)
    KV_WAIT_CASE(3)
    KV_WAIT_CASE(4)
    KV_WAIT_CASE(5)
    KV_WAIT_CASE(6)
    KV_WAIT_CASE(7)
    KV_WAIT_CASE(8)
    KV_WAIT_CASE(9)
    KV_WAIT_CASE(10)
    KV_WAIT_CASE(11)
    KV_WAIT_CASE(12)
    KV_WAIT_CASE(13)
    KV_WAIT_CASE(14)
    KV_WAIT_CASE(15)
#undef KV_WAIT_CASE
    default:
      CpWait<0>();
  }
}
// Byte offset of 16-byte chunk c of row r in a swizzled [16][kD] bf16 tile.
template <int kD>
__device__ __forceinline__ int TileOff(int r, int c) {
  constexpr int kCh = kD / 8;
  constexpr int kSw = (kCh < 8 ? kCh : 8) - 1;
  return (r * kCh + (c ^ (r & kSw))) * 16;
}
__device__ __forceinline__ void Ldm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldm4T(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4],
                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint4 Pack8(const float* x) {
  return make_uint4(PackBf16(x[0], x[1]), PackBf16(x[2], x[3]),
                    PackBf16(x[4], x[5]), PackBf16(x[6], x[7]));
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

__device__ __forceinline__ __half2 U32AsHalf2(uint32_t x) {
  __half2 h;
  memcpy(&h, &x, 4);
  return h;
}
__device__ __forceinline__ uint32_t Half2AsU32(__half2 h) {
  uint32_t x;
  memcpy(&x, &h, 4);
  return x;
}
// Two E4M3 codes (bits 0-15 of x, low byte first) -> exact fp16 pair.
__device__ __forceinline__ __half2 Fp8x2ToHalf2(uint32_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3);
  return __half2(h);
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
// (a & mask) | bits in one LOP3 (constants in registers, hoisted).
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t mask,
                                          uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n"
      : "=r"(d)
      : "r"(a), "r"(mask), "r"(bits));
  return d;
}
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

// kR bytes at p (aligned to min(kR, 16)) into words, low byte first.
template <int kR>
__device__ __forceinline__ void LoadRun(const uint8_t* p,
                                        uint32_t (&w)[kR >= 4 ? kR / 4 : 1]) {
  if constexpr (kR >= 16) {
#pragma unroll
    for (int i = 0; i < kR / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (kR == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else if constexpr (kR == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (kR == 2) {
    w[0] = LoadU16(p);
  } else {
    w[0] = p[0];
  }
}

__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4],
                                       uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t PackHalf(float lo, float hi) {
  return Half2AsU32(__floats2half2_rn(lo, hi));
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

// Transposes an 8x8 b16 matrix held one row pair per lane (row lane / 4,
// columns 2 (lane % 4), + 1) into the same layout.
__device__ __forceinline__ uint32_t Movm(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n"
               : "=r"(y)
               : "r"(x));
  return y;
}

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

// In-place FWHT over the rows of a float [rows][kD] array in shared memory
// by `nthreads` threads starting at thread index `tid`, synchronized by
// `sync` after each stage.
template <int kD, typename Sync>
__device__ __forceinline__ void SmemFwht(float* x, int rows, int tid,
                                         int nthreads, Sync sync) {
  for (int len = 1; len < kD; len <<= 1) {
    for (int i = tid; i < rows * kD / 2; i += nthreads) {
      const int r = i / (kD / 2), j = i % (kD / 2);
      const int lo = (j / len) * 2 * len + j % len;
      float* row = x + r * kD;
      const float a = row[lo], b = row[lo + len];
      row[lo] = a + b;
      row[lo + len] = a - b;
    }
    sync();
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
  const UnpackedEncoding e = Unpack(fmt);
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
            if (!Supported(Unpack(pfmt), shape)) {
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
    const UnpackedEncoding e = Unpack(d.format);
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
  const float nan = __uint_as_float(0x7fc00000u);
  if constexpr (kSmall) {
    // O^T: m-tile i, lane (g, q) holds dims g * kD / 8 + 2i, + 1 of query
    // heads 2q (o[i][0], o[i][2]) and 2q + 1 (o[i][1], o[i][3]).
    if constexpr (kTq) RotateAccT<kD>(o, s_sign, lane);
    const int g = lane / 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = 2 * (lane % 4) + j;
      if (r >= nrows) continue;
      const size_t qh =
          static_cast<size_t>(b) * a.n_q_heads + h * a.group + row0 + r;
      const size_t slot = qh * parts + part;
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
    return;
  } else {
    CpWait<0>();
    if (rot) RotateAcc<kD>(o, true, s_sign, lane);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lane / 4 + 8 * i;
      if (r >= nrows) continue;
      const size_t qh =
          static_cast<size_t>(b) * a.n_q_heads + h * a.group + row0 + r;
      const size_t slot = qh * parts + part;
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
}

// Shares (split-K partitions, splits x 4 warps) of each class: each launch
// configuration has its own split count (PlanMma).
struct ClassShares {
  int s[kClasses];
};

// One CTA per sequence b: splits its pages of each encoding class c into
// shares.s[c] shares of equal page count (+-1) for the attention warps, in
// page order: share v is pages [plan[b][c][v].x, plan[b][c][v + 1].x) of
// the table, of which those of class c are that warp's, and plan[b][c][v].y
// tokens (clipped per page to [0, T], capped at attend[b]) precede it.
// Pages without tokens belong to no class. Bit c of mask[b] is set when
// class c has pages (entries of absent classes are not written).
constexpr int kPartThreads = 512;
__global__ void __launch_bounds__(kPartThreads)
    PartitionKernel(const DevicePage* __restrict__ pages,
                    const int32_t* __restrict__ indptr,
                    const int32_t* __restrict__ attend, int T, int s_max,
                    ClassShares shares, int pages_per_share, bool small_ok,
                    int2* __restrict__ plan, uint32_t* __restrict__ mask) {
  constexpr int kW = kPartThreads / 32;
  __shared__ int s_total[kClasses];     // class pages in the sequence
  __shared__ int s_run[kClasses];       // class pages before this chunk
  __shared__ int s_wcnt[kW][kClasses];  // per warp, then its prefix
  __shared__ long long s_wtok[kW];      // tokens per warp, then prefix
  __shared__ long long s_before;        // tokens before this chunk
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int b = blockIdx.x;
  const int first = indptr[b], P = indptr[b + 1] - first;
  const long long att = attend[b];
  int2* out = plan + static_cast<size_t>(b) * kClasses * (s_max + 1);
  if (tid < kClasses) s_total[tid] = s_run[tid] = 0;
  if (tid == 0) s_before = 0;
  __syncthreads();
  auto page_at = [&](int i, int* n, int* c) {
    *n = 0;
    *c = kClasses;  // none
    if (i < P) {
      const int4 pg = __ldg(reinterpret_cast<const int4*>(pages + first + i));
      *n = min(max(pg.z, 0), T);                 // num_tokens
      if (*n > 0) *c = ClassOf(pg.w, small_ok);  // format
    }
  };
  for (int i = tid; i < P; i += kPartThreads) {
    int n, c;
    page_at(i, &n, &c);
    if (c < kClasses) atomicAdd(&s_total[c], 1);
  }
  __syncthreads();
  if (tid == 0) {
    uint32_t m = 0;
    for (int c = 0; c < kClasses; ++c) m |= (s_total[c] > 0 ? 1u : 0u) << c;
    mask[b] = m;
  }
  // Shares of class c in this sequence: shares.s[c], or with
  // pages_per_share > 0 one per pages_per_share class pages (at most
  // shares.s[c]), a count that depends on the sequence alone. Shares past
  // it start at the terminator: empty.
  __shared__ int s_parts[kClasses];
  if (tid < kClasses) {
    int parts = shares.s[tid];
    if (pages_per_share > 0) {
      parts = min(parts, max(1, (s_total[tid] + pages_per_share - 1) /
                                    pages_per_share));
    }
    s_parts[tid] = parts;
    for (int v = parts; v <= shares.s[tid]; ++v)
      out[tid * (s_max + 1) + v] = make_int2(first + P, static_cast<int>(att));
  }
  for (int base = 0; base < P; base += kPartThreads) {
    if (tid < kW * kClasses) s_wcnt[tid / kClasses][tid % kClasses] = 0;
    __syncthreads();
    int n, c;
    page_at(base + tid, &n, &c);
    const unsigned same = __match_any_sync(0xffffffffu, c);
    const int rank_w = __popc(same & ((1u << lane) - 1u));
    if (c < kClasses && rank_w == 0) s_wcnt[warp][c] = __popc(same);
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) s_wtok[warp] = incl;
    __syncthreads();
    if (tid < kClasses) {
      int run = s_run[tid];
      for (int w = 0; w < kW; ++w) {
        const int x = s_wcnt[w][tid];
        s_wcnt[w][tid] = run;
        run += x;
      }
      s_run[tid] = run;
    } else if (tid == 32) {
      long long run = s_before;
      for (int w = 0; w < kW; ++w) {
        const long long x = s_wtok[w];
        s_wtok[w] = run;
        run += x;
      }
      s_before = run;
    }
    __syncthreads();
    if (c < kClasses) {
      const long long rank = s_wcnt[warp][c] + rank_w, cnt = s_total[c];
      const int parts = s_parts[c];
      const long long before = min(s_wtok[warp] + incl - n, att);
      // The shares v whose first class page has this rank:
      // floor(v * cnt / parts) == rank.
      const int v_lo = static_cast<int>((rank * parts + cnt - 1) / cnt);
      const int v_end = static_cast<int>(min(
          static_cast<long long>(parts), ((rank + 1) * parts + cnt - 1) / cnt));
      for (int v = v_lo; v < v_end; ++v) {
        out[c * (s_max + 1) + v] =
            make_int2(first + base + tid, static_cast<int>(before));
      }
    }
    __syncthreads();
  }
}

// One CTA per (sequence, query head): merges the shares.s[c] partial
// results of each class c present in the sequence (S = the slot stride per
// class; absent classes' slots are never written).
__global__ void ReduceKernel(int S, ClassShares shares, uint32_t launched,
                             int D, int n_q,
                             const uint32_t* __restrict__ cls_mask,
                             const float* __restrict__ ws_o,
                             const float* __restrict__ ws_lse,
                             float* __restrict__ out) {
  const size_t qh = blockIdx.x;
  const uint32_t present = cls_mask[qh / n_q];
  const int parts = kClasses * S;
  const float* lse = ws_lse + qh * parts;
  float mx = -INFINITY;
  // A class with pages whose kernel was not launched (formats_present left
  // it out): the sequence's output is NaN, as for unsupported pages.
  bool nan = (present & ~launched) != 0;
  const uint32_t live = present & launched;
  for (int c = 0; c < kClasses; ++c) {
    if (((live >> c) & 1u) == 0) continue;
    for (int s = c * S; s < c * S + shares.s[c]; ++s) {
      nan = nan || isnan(lse[s]);
      mx = fmaxf(mx, lse[s]);
    }
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f, wsum = 0.f;
    if (mx > -INFINITY) {
      for (int c = 0; c < kClasses; ++c) {
        if (((live >> c) & 1u) == 0) continue;
        for (int s = c * S; s < c * S + shares.s[c]; ++s) {
          if (lse[s] == -INFINITY) continue;  // empty partition
          const float w = exp2f(lse[s] - mx);
          wsum += w;
          acc += w * ws_o[(qh * parts + s) * D + d];
        }
      }
    }
    out[qh * D + d] =
        nan ? __uint_as_float(0x7fc00000u) : (wsum > 0.f ? acc / wsum : 0.f);
  }
}

// ---- Host side
// -----------------------------------------------------------------

absl::Status ValidateShape(const PageShape& s) {
  if (s.tokens < 1 || s.tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.tokens must be in [1, 4096], got ", s.tokens));
  }
  if (s.heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.heads must be >= 1, got ", s.heads));
  }
  if (s.head_dim < 8 || s.head_dim > kMaxHeadDim || s.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.head_dim must be a multiple of 8 in [8, 256], got ",
                     s.head_dim));
  }
  return absl::OkStatus();
}

size_t Align16(size_t n) { return (n + 15) & ~size_t{15}; }

absl::Status LaunchStatus(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat(what, " launch failed: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <int kD>
absl::Status LaunchAttention(const AttentionParams& p, int group) {
  const AttnSmem plan(group, p.shape.head_dim);
  const size_t bytes = static_cast<size_t>(plan.total) * sizeof(float);
  auto* kernel = &AttentionKernel<kD>;
  if (bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(bytes));
    if (e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("attention needs ", bytes,
                       " bytes of shared memory: ", cudaGetErrorString(e)));
    }
  }
  const dim3 grid(static_cast<unsigned>(p.batch) * p.shape.heads);
  kernel<<<grid, kAttnThreads, bytes, p.stream>>>(
      p.shape, p.n_q_heads, p.scale, p.q, p.out, p.pages, p.page_indptr,
      p.attend_tokens);
  return LaunchStatus("DecodeAttentionCuda");
}

// Uploads the TQ codebooks and signs to the current device once.
absl::Status EnsureTqTables() {
  // kernels_cuda links no absl::synchronization; a process-wide std::mutex
  // guards the set of devices already holding the tables.
  static std::mutex* mu = new std::mutex();
  static std::set<int>* done = new std::set<int>();
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    return absl::InternalError("cudaGetDevice failed");
  }
  std::lock_guard<std::mutex> lock(*mu);
  if (done->count(dev) > 0) return absl::OkStatus();
  static float cb[5][3][16];
  static float sign[5][256];
  for (int i = 0; i < 5; ++i) {
    const int d = 16 << i;
    for (int bits = 2; bits <= 4; ++bits) {
      const float* c = TqCodebook(bits, d);
      for (int j = 0; j < 16; ++j)
        cb[i][bits - 2][j] = j < (1 << bits) ? c[j] : 0.f;
    }
    const int8_t* sg = TqSigns(d);
    for (int j = 0; j < 256; ++j) sign[i][j] = j < d ? sg[j] : 0.f;
  }
  cudaError_t e = cudaMemcpyToSymbol(g_tq_cb, cb, sizeof(cb));
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(g_tq_sign, sign, sizeof(sign));
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("uploading TQ tables: ", cudaGetErrorString(e)));
  }
  done->insert(dev);
  return absl::OkStatus();
}

bool MmaHeadDim(int d) {
  return d == 16 || d == 32 || d == 64 || d == 128 || d == 256;
}

int SmCount() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  }
  return sms;
}

// CTAs of each launch configuration resident per SM (the BF16/TQ kernel,
// the transposed kernel for INT4/INT2 keys and for FP8/INT8 keys; 0 when
// head_dim has no transposed kernel), from the occupancy calculator.
struct Residency {
  int sms = 132, big = 1, low_bit = 0, eight_bit = 0, tq = 0;
};

template <typename Kernel>
int ResidentCtas(Kernel* kernel, int smem) {
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         smem);
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kMmaWarps * 32,
                                                    smem) != cudaSuccess) {
    cudaGetLastError();  // no device: any positive count will do
    n = 1;
  }
  return std::max(n, 1);
}

template <int kD>
Residency QueryResidency() {
  Residency r;
  r.sms = SmCount();
  r.big = ResidentCtas(&MmaAttentionKernel<kD, false, 1>,
                       MmaSmem<kD, false>::kTotal);
  if constexpr (SmallOk(kD)) {
    r.low_bit =
        ResidentCtas(&MmaAttentionKernel<kD, true, kSmallCtas(kD, true)>,
                     MmaSmem<kD, true>::kTotal);
    r.eight_bit =
        ResidentCtas(&MmaAttentionKernel<kD, true, kSmallCtas(kD, false)>,
                     MmaSmem<kD, true>::kTotal);
    r.tq =
        ResidentCtas(&MmaAttentionKernel<kD, true, kSmallCtas(kD, true), true>,
                     MmaSmem<kD, true>::kTotal);
  }
  return r;
}

// Cached per (device, head_dim).
Residency ResidencyFor(int d) {
  static std::mutex* mu = new std::mutex();
  static std::map<std::pair<int, int>, Residency>* cache =
      new std::map<std::pair<int, int>, Residency>();
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
  std::lock_guard<std::mutex> lock(*mu);
  const auto key = std::make_pair(dev, d);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  Residency r;
  switch (d) {
    case 16:
      r = QueryResidency<16>();
      break;
    case 32:
      r = QueryResidency<32>();
      break;
    case 64:
      r = QueryResidency<64>();
      break;
    case 128:
      r = QueryResidency<128>();
      break;
    default:
      r = QueryResidency<256>();
      break;
  }
  cache->emplace(key, r);
  return r;
}

// Fraction of the CTA slots of its waves that n CTAs fill.
double WaveEfficiency(long long n, long long slots) {
  const long long waves = (n + slots - 1) / slots;
  return static_cast<double>(n) / static_cast<double>(waves * slots);
}

// Splits of one launch configuration: the fewest whose grid (ctas x
// splits CTAs, per_sm x SMs resident at a time) fills at least 90% of the
// slots of its waves (so: at least 0.9 of one wave, and a last wave that
// is not mostly empty); when none does (tiny batches), the best filled.
// Measured on the H100 (bench/results/attention.md, num_splits sweep):
// e.g. batch 16 x 8 KV heads picks 2 for the BF16/TQ kernel (2 CTAs per
// SM: 256 of 264 slots), 3 for FP8/INT8 keys (3 per SM) and 4 for
// INT4/INT2 keys (4 per SM), each the fastest of 1-24 for its format, where
// a split count shared by the three configurations lost up to 0.1 of
// streaming read to half-empty last waves.
int SplitsFor(long long ctas, int per_sm, int sms) {
  const long long slots = 1LL * std::max(per_sm, 1) * std::max(sms, 1);
  int best_s = 1;
  double best = 0.0;
  for (int s = 1; s <= kMaxSplits; ++s) {
    const double e = WaveEfficiency(ctas * s, slots);
    if (e >= 0.9) return s;
    if (e > best + 1e-9) {
      best = e;
      best_s = s;
    }
  }
  return best_s;
}

// Launch configurations: 0 the full kernel, 1 the transposed kernel for
// INT4/INT2 keys (classes 1-2), 2 for FP8/INT8 keys (classes 3-4), 3 its
// TQ variant (classes 5, 7; head_dim >= 64, else they are the full
// kernel's).
constexpr int kConfigs = 4;
__host__ __device__ constexpr int ConfigOf(int cls, bool small_ok) {
  return cls == 1 || cls == 2                 ? 1
         : cls == 3 || cls == 4               ? 2
         : (cls == 5 || cls == 7) && small_ok ? 3
                                              : 0;
}

struct MmaPlan {
  int group, row_blocks, small_row_blocks;
  int splits[kConfigs];  // per launch configuration (ConfigOf)
  int s_max;             // largest splits x kMmaWarps: the share stride
  size_t ws_bytes;
};

MmaPlan PlanMma(const AttentionParams& p) {
  MmaPlan m;
  m.group = p.n_q_heads / p.shape.heads;
  m.row_blocks = (m.group + 15) / 16;
  m.small_row_blocks = (m.group + 7) / 8;
  if (p.num_splits > 0) {
    for (int c = 0; c < kConfigs; ++c)
      m.splits[c] = std::min(p.num_splits, kMaxSplits);
  } else {
    const long long base = static_cast<long long>(p.batch) * p.shape.heads;
    const Residency r = ResidencyFor(p.shape.head_dim);
    m.splits[0] = SplitsFor(base * m.row_blocks, r.big, r.sms);
    m.splits[1] = SplitsFor(base * m.small_row_blocks, r.low_bit, r.sms);
    m.splits[2] = SplitsFor(base * m.small_row_blocks, r.eight_bit, r.sms);
    m.splits[3] = SplitsFor(base * m.small_row_blocks, r.tq, r.sms);
    if (r.low_bit == 0) m.splits[1] = m.splits[2] = m.splits[3] = 1;  // unused
  }
  m.s_max = 0;
  for (int c = 0; c < kConfigs; ++c)
    m.s_max = std::max(m.s_max, m.splits[c] * kMmaWarps);
  const size_t slots =
      static_cast<size_t>(p.batch) * p.n_q_heads * kClasses * m.s_max;
  // Class masks, partition plans, then partial LSEs, then partial outputs
  // (16-aligned each).
  m.ws_bytes = Align16(static_cast<size_t>(p.batch) * 4) +
               Align16(static_cast<size_t>(p.batch) * kClasses * (m.s_max + 1) *
                       sizeof(int2)) +
               Align16(slots * sizeof(float)) +
               slots * p.shape.head_dim * sizeof(float);
  return m;
}

// Launches the classes of one configuration (n_classes x the CTAs of one
// class).
template <int kD, bool kSmall, int kCtas, bool kTq = false>
absl::Status LaunchMmaConfig(const MmaArgs& a, long long class_ctas,
                             int n_classes, cudaStream_t stream) {
  using Sm = MmaSmem<kD, kSmall>;
  auto* kernel = &MmaAttentionKernel<kD, kSmall, kCtas, kTq>;
  if (Sm::kTotal > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sm::kTotal);
    if (e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("attention needs ", Sm::kTotal,
                       " bytes of shared memory: ", cudaGetErrorString(e)));
    }
  }
  kernel<<<static_cast<unsigned>(n_classes * class_ctas), kMmaWarps * 32,
           Sm::kTotal, stream>>>(a);
  return LaunchStatus("DecodeAttentionCuda");
}

template <int kD>
absl::Status LaunchMma(const AttentionParams& p, const MmaPlan& plan,
                       float* ws) {
  MmaArgs a{};
  a.shape = p.shape;
  a.batch = p.batch;
  a.n_q_heads = p.n_q_heads;
  a.group = plan.group;
  a.row_blocks = plan.row_blocks;
  a.splits = plan.splits[0];
  a.s_max = plan.s_max;
  a.scale_log2 = p.scale * kLog2e;
  a.q = p.q;
  a.pages = p.pages;
  a.indptr = p.page_indptr;
  a.attend = p.attend_tokens;
  const int S = plan.s_max;
  const size_t slots =
      static_cast<size_t>(p.batch) * p.n_q_heads * kClasses * S;
  ClassShares shares;
  for (int c = 0; c < kClasses; ++c)
    shares.s[c] = plan.splits[ConfigOf(c, SmallOk(kD))] * kMmaWarps;
  uint8_t* w8 = reinterpret_cast<uint8_t*>(ws);
  uint32_t* mask = reinterpret_cast<uint32_t*>(w8);
  w8 += Align16(static_cast<size_t>(p.batch) * 4);
  int2* part_plan = reinterpret_cast<int2*>(w8);
  w8 +=
      Align16(static_cast<size_t>(p.batch) * kClasses * (S + 1) * sizeof(int2));
  a.cls_mask = mask;
  a.part_plan = part_plan;
  a.ws_lse = reinterpret_cast<float*>(w8);
  a.ws_o = reinterpret_cast<float*>(w8 + Align16(slots * sizeof(float)));
  PartitionKernel<<<p.batch, kPartThreads, 0, p.stream>>>(
      p.pages, p.page_indptr, p.attend_tokens, p.shape.tokens, S, shares,
      p.pages_per_share, SmallOk(kD), part_plan, mask);
  KV_RETURN_IF_ERROR(LaunchStatus("DecodeAttentionCuda partition"));
  const long long class_ctas = static_cast<long long>(p.batch) * p.shape.heads *
                               plan.row_blocks * plan.splits[0];
  // Launches whose classes the caller's formats_present leaves out are
  // skipped; `launched` tells the reduce which classes ran.
  const uint32_t want = p.formats_present != 0 ? p.formats_present : 0xffu;
  uint32_t launched = 0;
  auto wanted = [&](uint32_t classes, int n) {
    uint32_t bits = 0;
    for (int i = 0; i < n; ++i) bits |= 1u << ((classes >> (4 * i)) & 0xf);
    if ((bits & want) == 0) return false;
    launched |= bits;
    return true;
  };
  if constexpr (SmallOk(kD)) {
    a.classes = ClassList(0, 6);
    if (wanted(a.classes, 2)) {
      KV_RETURN_IF_ERROR(
          (LaunchMmaConfig<kD, false, 1>(a, class_ctas, 2, p.stream)));
    }
    // Transposed kernel: 8 query heads per CTA; classes 1-2 (INT4/INT2
    // keys), 3-4 (FP8/INT8 keys), then 5 and 7 (TQ4/TQ2).
    MmaArgs as = a;
    as.row_blocks = plan.small_row_blocks;
    const long long small_ctas =
        static_cast<long long>(p.batch) * p.shape.heads * as.row_blocks;
    as.classes = ClassList(1, 2);
    as.splits = plan.splits[1];
    if (wanted(as.classes, 2)) {
      KV_RETURN_IF_ERROR((LaunchMmaConfig<kD, true, kSmallCtas(kD, true)>(
          as, small_ctas * as.splits, 2, p.stream)));
    }
    as.classes = ClassList(3, 4);
    as.splits = plan.splits[2];
    if (wanted(as.classes, 2)) {
      KV_RETURN_IF_ERROR((LaunchMmaConfig<kD, true, kSmallCtas(kD, false)>(
          as, small_ctas * as.splits, 2, p.stream)));
    }
    as.classes = ClassList(5, 7);
    as.splits = plan.splits[3];
    if (wanted(as.classes, 2)) {
      KV_RETURN_IF_ERROR((LaunchMmaConfig<kD, true, kSmallCtas(kD, true), true>(
          as, small_ctas * as.splits, 2, p.stream)));
    }
  } else {
    a.classes = ClassList(0, 5, 6, 7);
    if (wanted(a.classes, 4)) {
      KV_RETURN_IF_ERROR(
          (LaunchMmaConfig<kD, false, 1>(a, class_ctas, 4, p.stream)));
    }
  }
  ReduceKernel<<<static_cast<unsigned>(static_cast<size_t>(p.batch) *
                                       p.n_q_heads),
                 std::min(kD, 128), 0, p.stream>>>(
      S, shares, launched, kD, p.n_q_heads, mask, a.ws_o, a.ws_lse, p.out);
  return LaunchStatus("DecodeAttentionCuda reduce");
}

absl::Status DispatchMma(const AttentionParams& p, const MmaPlan& plan,
                         float* ws) {
  switch (p.shape.head_dim) {
    case 16:
      return LaunchMma<16>(p, plan, ws);
    case 32:
      return LaunchMma<32>(p, plan, ws);
    case 64:
      return LaunchMma<64>(p, plan, ws);
    case 128:
      return LaunchMma<128>(p, plan, ws);
    default:
      return LaunchMma<256>(p, plan, ws);
  }
}

}  // namespace

size_t AttentionWorkspaceBytes(const AttentionParams& p) {
  if (!ValidateShape(p.shape).ok() || p.batch <= 0 || p.n_q_heads < 1 ||
      p.n_q_heads % p.shape.heads != 0 || !MmaHeadDim(p.shape.head_dim)) {
    return 0;
  }
  return PlanMma(p).ws_bytes;
}

uint32_t AttentionFormatBit(int32_t packed_format, int head_dim) {
  return 1u << ClassOf(packed_format, SmallOk(head_dim));
}

namespace internal {
int AttentionClassOf(int32_t packed_format, int head_dim) {
  return ClassOf(packed_format, SmallOk(head_dim));
}
int AttentionSplitsFor(long long ctas, int ctas_per_sm, int sms) {
  return SplitsFor(ctas, ctas_per_sm, sms);
}
}  // namespace internal

size_t DemoteScratchBytes(const PageShape& shape, int num_pages) {
  return static_cast<size_t>(std::max(num_pages, 0)) * 2 *
         static_cast<size_t>(std::max(shape.tokens, 0)) *
         std::max(shape.heads, 0) * std::max(shape.head_dim, 0) *
         sizeof(uint16_t);
}

absl::Status DemotePagesCuda(const DemotePagesParams& p) {
  KV_RETURN_IF_ERROR(ValidateShape(p.shape));
  if (p.num_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be >= 0, got ", p.num_pages));
  }
  if (p.num_pages == 0) return absl::OkStatus();
  if (p.src == nullptr || p.dst == nullptr || p.scratch == nullptr) {
    return absl::InvalidArgumentError("src, dst and scratch must be non-null");
  }
  const size_t need = DemoteScratchBytes(p.shape, p.num_pages);
  if (p.scratch_bytes < need || !Aligned16(p.scratch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scratch must be 16-byte aligned and hold ", need,
                     " bytes, got ", p.scratch_bytes));
  }
  KV_RETURN_IF_ERROR(EnsureTqTables());
  DemoteKernel<<<p.num_pages, kCodecThreads, 0, p.stream>>>(
      p.shape, p.src, p.dst, static_cast<uint16_t*>(p.scratch));
  return LaunchStatus("DemotePagesCuda");
}

absl::Status CheckEncodingCuda(const Encoding& e, const PageShape& shape) {
  if (absl::Status s = ValidateShape(shape); !s.ok()) return s;
  if (const char* why = ValidateEncoding(e, shape); why != nullptr) {
    char name[64];
    return absl::InvalidArgumentError(absl::StrCat(
        "encoding ", EncodingName(e, name, sizeof(name)), ": ", why));
  }
  return absl::OkStatus();
}

PageLayout CudaPageLayout(const Encoding& e, const PageShape& shape) {
  return ComputeLayout(Unpack(PackEncoding(e)), shape);
}

absl::Status EncodePagesCuda(const EncodePagesParams& p) {
  if (absl::Status s = ValidateShape(p.shape); !s.ok()) return s;
  if (p.num_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be >= 0, got ", p.num_pages));
  }
  if (p.num_pages == 0) return absl::OkStatus();
  if (p.pages == nullptr || p.k_bf16 == nullptr || p.v_bf16 == nullptr) {
    return absl::InvalidArgumentError(
        "pages, k_bf16 and v_bf16 must be non-null");
  }
  if (!Aligned16(p.k_bf16) || !Aligned16(p.v_bf16)) {
    return absl::InvalidArgumentError(
        "k_bf16 and v_bf16 must be 16-byte aligned");
  }
  KV_RETURN_IF_ERROR(EnsureTqTables());
  EncodeKernel<<<p.num_pages, kCodecThreads, 0, p.stream>>>(p.shape, p.pages,
                                                            p.k_bf16, p.v_bf16);
  return LaunchStatus("EncodePagesCuda");
}

absl::Status DecodePagesCuda(const DecodePagesParams& p) {
  if (absl::Status s = ValidateShape(p.shape); !s.ok()) return s;
  if (p.num_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be >= 0, got ", p.num_pages));
  }
  if (p.num_pages == 0 || (p.k_out == nullptr && p.v_out == nullptr))
    return absl::OkStatus();
  if (p.pages == nullptr)
    return absl::InvalidArgumentError("pages must be non-null");
  const long long blocks = static_cast<long long>(p.num_pages) * p.shape.heads;
  if (blocks > 0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages * heads too large: ", blocks));
  }
  KV_RETURN_IF_ERROR(EnsureTqTables());
  DecodeKernel<<<static_cast<unsigned>(blocks), kCodecThreads, 0, p.stream>>>(
      p.shape, p.pages, p.k_out, p.v_out);
  return LaunchStatus("DecodePagesCuda");
}

absl::Status DecodeAttentionCuda(const AttentionParams& p) {
  if (absl::Status s = ValidateShape(p.shape); !s.ok()) return s;
  if (p.batch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch must be >= 0, got ", p.batch));
  }
  if (p.pages_per_share < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pages_per_share must be >= 0, got ", p.pages_per_share));
  }
  if ((p.formats_present >> kClasses) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "formats_present has bits outside AttentionFormatBit's 8: 0x",
        absl::Hex(p.formats_present)));
  }
  if (p.n_q_heads < 1 || p.n_q_heads % p.shape.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_q_heads must be a positive multiple of KV heads ",
                     p.shape.heads, ", got ", p.n_q_heads));
  }
  const int group = p.n_q_heads / p.shape.heads;
  if (group * p.shape.head_dim > kMaxGroupTimesDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "(n_q_heads / heads) * head_dim must be <= ", kMaxGroupTimesDim,
        ", got ", group * p.shape.head_dim));
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.q == nullptr || p.out == nullptr || p.pages == nullptr ||
      p.page_indptr == nullptr || p.attend_tokens == nullptr) {
    return absl::InvalidArgumentError(
        "q, out, pages, page_indptr and attend_tokens must be non-null");
  }
  if (static_cast<long long>(p.batch) * p.shape.heads > 0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch * heads too large: ", p.batch));
  }
  if (!MmaHeadDim(p.shape.head_dim)) {
    // CUDA-core kernel for head_dims that are not a multiple of 16.
    return LaunchAttention<0>(p, group);
  }
  KV_RETURN_IF_ERROR(EnsureTqTables());
  const MmaPlan plan = PlanMma(p);
  if (static_cast<long long>(kLaunchClasses) * p.batch * p.shape.heads *
          plan.small_row_blocks * (plan.s_max / kMmaWarps) >
      0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch * heads too large: ", p.batch));
  }
  if (p.workspace != nullptr) {
    if (p.workspace_bytes < plan.ws_bytes || !Aligned16(p.workspace)) {
      return absl::InvalidArgumentError(
          absl::StrCat("workspace must be 16-byte aligned and hold ",
                       plan.ws_bytes, " bytes, got ", p.workspace_bytes));
    }
    return DispatchMma(p, plan, static_cast<float*>(p.workspace));
  }
  void* ws = nullptr;
  cudaError_t e = cudaMallocAsync(&ws, plan.ws_bytes, p.stream);
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("attention workspace of ", plan.ws_bytes,
                     " bytes: ", cudaGetErrorString(e)));
  }
  const absl::Status s = DispatchMma(p, plan, static_cast<float*>(ws));
  e = cudaFreeAsync(ws, p.stream);
  KV_RETURN_IF_ERROR(s);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("freeing attention workspace: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace triax::kernels::cuda
