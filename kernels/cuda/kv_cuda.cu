// CUDA kernels for KV pages; see kv_cuda.cuh for the API and layout.h for
// the byte layout. Each page's encoding is packed into DevicePage::format
// and its section offsets are computed on the device by LayoutOf, the same
// arithmetic as ComputeLayout; CudaPageLayout runs that code on the host
// so a test pins it to ComputeLayout for every supported encoding.
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
#include <mutex>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_cuda.cuh"
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

// Unpacked DevicePage::format (see PackEncoding).
struct DevEnc {
  int k, v, group, sdt;
};

__host__ __device__ __forceinline__ DevEnc Unpack(int32_t packed) {
  const uint32_t p = static_cast<uint32_t>(packed);
  DevEnc e;
  e.k = p & 0xff;
  e.v = (p >> 8) & 0xff;
  if (e.v == 0) e.v = e.k;
  e.group = (p >> 16) & 0xff;
  if (e.group == 0) e.group = 32;
  e.sdt = (p >> 24) & 0xff;
  if (e.sdt == 0) e.sdt = 1;
  return e;
}

// Format values (layout.h): 1 bf16, 2 int4, 3 int2, 4 fp8, 5 int8, 6-8 tq.
__host__ __device__ __forceinline__ int BitsOf(int f) {
  switch (f) {
    case 1:
      return 16;
    case 2:
    case 6:
      return 4;
    case 3:
    case 8:
      return 2;
    case 7:
      return 3;
    default:
      return 8;
  }
}
__host__ __device__ __forceinline__ bool IsInt(int f) {
  return f == 2 || f == 3 || f == 5;
}
__host__ __device__ __forceinline__ bool IsTq(int f) {
  return f >= 6 && f <= 8;
}
__host__ __device__ __forceinline__ bool CudaFormat(int f) {
  return f >= 1 && f <= 8;
}
__host__ __device__ __forceinline__ bool TqDim(int d) {
  return d >= 16 && d <= 256 && (d & (d - 1)) == 0;
}

__host__ __device__ __forceinline__ bool Supported(const DevEnc& e,
                                                   const PageShape& s) {
  if (!CudaFormat(e.k) || !CudaFormat(e.v)) return false;
  if (e.group != 32 && e.group != 64 && e.group != 128) return false;
  if (e.sdt != 1 && e.sdt != 2) return false;
  if ((IsTq(e.k) || IsTq(e.v)) && !TqDim(s.head_dim)) return false;
  const int gk = min(e.group, s.tokens), gv = min(e.group, s.head_dim);
  if (IsInt(e.k) && s.tokens % gk != 0) return false;
  if (IsInt(e.v) && s.head_dim % gv != 0) return false;
  return true;
}

__host__ __device__ __forceinline__ size_t Align16(size_t n) {
  return (n + 15) & ~size_t{15};
}

// Same arithmetic as LayoutTensor in kernels/layout.cc.
__host__ __device__ inline size_t TensorAt(int f, bool key, const DevEnc& e,
                                           const PageShape& s, size_t off,
                                           TensorLayout* t) {
  const size_t H = s.heads, T = s.tokens, D = s.head_dim;
  *t = TensorLayout{};
  t->codes = off;
  t->codes_bytes = H * T * (D * BitsOf(f) / 8);
  off = Align16(off + t->codes_bytes);
  if (f == 1) return off;
  if (f == 4) {
    t->scale = off;
    t->meta_bytes = H * 4;
    return Align16(off + t->meta_bytes);
  }
  if (IsTq(f)) {
    t->scale = off;
    t->meta_bytes = H * T * 2;
    return Align16(off + t->meta_bytes);
  }
  const size_t elem = e.sdt == 2 ? 1 : 2;
  const size_t gk = min(e.group, s.tokens), gv = min(e.group, s.head_dim);
  const size_t count = key ? H * (T / gk) * D : H * T * (D / gv);
  t->meta_bytes = count * elem;
  t->scale = off;
  off = Align16(off + t->meta_bytes);
  t->zero = off;
  return Align16(off + t->meta_bytes);
}

__host__ __device__ inline PageLayout LayoutOf(const DevEnc& e,
                                               const PageShape& s) {
  PageLayout l;
  size_t off = TensorAt(e.k, true, e, s, 0, &l.k);
  l.total = TensorAt(e.v, false, e, s, off, &l.v);
  return l;
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

// FP8 E4M3 <-> float, bit for bit as kernels/numeric.cc.
__device__ __forceinline__ float Fp8ToFloat(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
  const float v = e == 0 ? static_cast<float>(m) * (1.f / 512.f)
                         : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -v : v;
}
__device__ __forceinline__ uint32_t FloatToFp8(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;
  if (abs >= 0x43e00000u) return sign | 0x7eu;
  if (abs < 0x3c800000u) {
    return sign |
           static_cast<uint32_t>(rintf(__fmul_rn(__uint_as_float(abs), 512.f)));
  }
  const uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);
  const uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  return sign | min(code, 0x7eu);
}

__device__ __forceinline__ float LoadMeta(const uint8_t* base, size_t i,
                                          int sdt) {
  return sdt == 2 ? Fp8ToFloat(base[i]) : HalfBits(LoadU16(base + 2 * i));
}

// Same arithmetic as MakeQuant/Quantize in kernels/ref/kv_ref.cc.
struct Quant {
  float scale, zero;
  uint32_t scale_bits, zero_bits;
};

__device__ __forceinline__ Quant MakeQuant(float lo, float hi, int qmax,
                                           int sdt) {
  const float lim = sdt == 2 ? 448.f : kFp16Max;
  float zero = fminf(fmaxf(lo, -lim), lim);
  float scale = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(qmax));
  if (!(scale > 0.f)) scale = 0.f;
  scale = fminf(scale, lim);
  Quant q;
  if (sdt == 2) {
    q.scale_bits = FloatToFp8(scale);
    q.zero_bits = FloatToFp8(zero);
    q.scale = Fp8ToFloat(q.scale_bits);
    q.zero = Fp8ToFloat(q.zero_bits);
  } else {
    q.scale_bits = __half_as_ushort(__float2half_rn(scale));
    q.zero_bits = __half_as_ushort(__float2half_rn(zero));
    q.scale = HalfBits(q.scale_bits);
    q.zero = HalfBits(q.zero_bits);
  }
  return q;
}

__device__ __forceinline__ void StoreMeta(uint8_t* base, size_t i,
                                          uint32_t bits, int sdt) {
  if (sdt == 2) {
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
__device__ __forceinline__ const float* TqLevels(int f, int D) {
  return g_tq_cb[Log2Dim(D)][BitsOf(f) - 2];
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
__device__ __forceinline__ void TqDecodeRowWarp(int f, const TensorLayout& L,
                                                const uint8_t* page,
                                                const PageShape& s, int h,
                                                int t, int lane,
                                                float (&x)[8]) {
  const int T = s.tokens, D = s.head_dim, bits = BitsOf(f);
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
__device__ void EncodeTqTensor(int f, const PageShape& shape,
                               const TensorLayout& L, int n,
                               const uint16_t* src, uint8_t* page,
                               unsigned* s_row) {
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int bits = BitsOf(f), levels = 1 << bits;
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
__device__ void EncodeTensor(int f, bool key, const DevEnc& e,
                             const PageShape& shape, const TensorLayout& L,
                             int n, const uint16_t* src, uint8_t* page,
                             float* s_ks, float* s_kz, unsigned* s_amax,
                             unsigned* s_row) {
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  if (IsTq(f)) {
    EncodeTqTensor(f, shape, L, n, src, page, s_row);
    return;
  }
  if (f == 1) {
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
  if (f == 4) {
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
            static_cast<uint8_t>(FloatToFp8(__fdiv_rn(x, scale)));
      }
      __syncthreads();
    }
    return;
  }
  const int bits = BitsOf(f);
  const int per_byte = 8 / bits;
  const int qmax = (1 << bits) - 1;
  const int row_bytes = D * bits / 8;
  if (key) {
    const int gk = min(e.group, T);
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
          const Quant q = MakeQuant(lo, hi, qmax, e.sdt);
          const size_t meta = (static_cast<size_t>(h) * groups + gi) * D + d;
          StoreMeta(page + L.scale, meta, q.scale_bits, e.sdt);
          StoreMeta(page + L.zero, meta, q.zero_bits, e.sdt);
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
  const int gv = min(e.group, D);
  const int groups = D / gv;
  for (int i = threadIdx.x; i < H * n * groups; i += blockDim.x) {
    const int g = i % groups, t = (i / groups) % n, h = i / (groups * n);
    const uint16_t* x = src + (static_cast<size_t>(t) * H + h) * D + g * gv;
    float lo = INFINITY, hi = -INFINITY;
    for (int d = 0; d < gv; ++d) {
      lo = fminf(lo, Bf16Bits(x[d]));
      hi = fmaxf(hi, Bf16Bits(x[d]));
    }
    const Quant q = MakeQuant(lo, hi, qmax, e.sdt);
    const size_t meta = (static_cast<size_t>(h) * T + t) * groups + g;
    StoreMeta(page + L.scale, meta, q.scale_bits, e.sdt);
    StoreMeta(page + L.zero, meta, q.zero_bits, e.sdt);
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
__device__ void EncodePageBody(const PageShape& shape, const DevEnc& e,
                               uint8_t* page, int n, const uint16_t* k_in,
                               const uint16_t* v_in, float* s_ks, float* s_kz,
                               unsigned* s_amax, unsigned* s_row) {
  const PageLayout L = LayoutOf(e, shape);
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
  const DevEnc e = Unpack(pg.format);
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
__device__ __forceinline__ void LoadRow8(int f, bool key, const DevEnc& e,
                                         const TensorLayout& L,
                                         const uint8_t* page,
                                         const PageShape& s, int h, int t,
                                         int d0, float* out) {
  const int T = s.tokens, D = s.head_dim;
  const size_t row = static_cast<size_t>(h) * T + t;
  const uint8_t* codes = page + L.codes;
  if (f == 1) {
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
  if (f == 4 || f == 5) {
    const uint2 w = *reinterpret_cast<const uint2*>(codes + row * D + d0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      c[i] = (w.x >> (8 * i)) & 0xffu;
      c[4 + i] = (w.y >> (8 * i)) & 0xffu;
    }
  } else if (f == 2) {
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
  if (f == 4) {
    const float scale = *reinterpret_cast<const float*>(
        page + L.scale + 4 * static_cast<size_t>(h));
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(Fp8ToFloat(c[i]), scale);
    return;
  }
  if (key) {
    const int gk = min(e.group, T);
    const size_t base = (static_cast<size_t>(h) * (T / gk) + t / gk) * D + d0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = __fadd_rn(__fmul_rn(static_cast<float>(c[i]),
                                   LoadMeta(page + L.scale, base + i, e.sdt)),
                         LoadMeta(page + L.zero, base + i, e.sdt));
    }
    return;
  }
  const int gv = min(e.group, D);
  const size_t m = row * (D / gv) + d0 / gv;
  const float sc = LoadMeta(page + L.scale, m, e.sdt);
  const float z = LoadMeta(page + L.zero, m, e.sdt);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    out[i] = __fadd_rn(__fmul_rn(static_cast<float>(c[i]), sc), z);
}

// ---- Decode ----------------------------------------------------------------

// Decodes tokens [0, n) of one tensor of head h of a page (whole CTA):
// non-TQ one thread per (token, 8-dim chunk), TQ one warp per token.
// store(t, d0, x, count) receives `count` consecutive dims starting at d0.
template <typename Store>
__device__ void DecodeTensorHead(int f, bool key, const DevEnc& e, bool ok,
                                 const TensorLayout& L, const uint8_t* page,
                                 const PageShape& shape, int h, int n,
                                 Store store) {
  const int D = shape.head_dim;
  if (ok && IsTq(f)) {
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
  const DevEnc e = Unpack(pg.format);
  const bool ok = Supported(e, shape);
  const int T = shape.tokens, D = shape.head_dim;
  const int n = min(max(pg.num_tokens, 0), T);
  const PageLayout L = LayoutOf(e, shape);
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
  const DevEnc es = Unpack(ps.format), ed = Unpack(pd.format);
  if (!Supported(es, shape) || !Supported(ed, shape)) return;
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int n = min(max(ps.num_tokens, 0), T);
  const size_t elems = static_cast<size_t>(T) * H * D;
  uint16_t* k = scratch + 2 * elems * blockIdx.x;
  uint16_t* v = k + elems;
  const PageLayout L = LayoutOf(es, shape);
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
    const DevEnc e = Unpack(pg.format);
    if (!Supported(e, shape)) {  // never silently wrong: NaN output
      poisoned = true;
      break;
    }
    const int n = min(min(max(pg.num_tokens, 0), T), remaining);
    remaining -= n;
    const PageLayout L = LayoutOf(e, shape);
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
// Grid: one CTA per (sequence b, row block rb of <= 16 query heads of the
// group, KV head h, split). Each of the CTA's 4 warps owns a contiguous run
// of the sequence's pages (virtual split v = split * 4 + warp of
// S = splits * 4) and keeps its own online softmax; the reduce kernel merges
// the S partial results of each query head. Per 16-token tile a warp
// dequantizes K and V of its head into BF16 tiles in shared memory (rows
// swizzled in 16-byte chunks), computes S = Q K^T with mma.m16n8k16 (rows =
// query heads, padded to 16), the online softmax on the accumulators, and
// O += P V with P from registers. TQ keys use the rotated query tile
// Q' = R Q; TQ value tiles are rotated back (register FWHT) before P V.
//
// Memory pipeline: each warp streams its tiles' raw page bytes (codes and
// the tile's scale/zero/norm ranges, whatever the page's format) into a
// per-warp byte ring in shared memory with cp.async, up to kMaxInFlight
// tiles ahead (as many as the ring holds: 2 BF16 tiles, ~6 INT4 tiles),
// page descriptors fetched 32 at a time. BF16 tiles land swizzled and feed
// the tensor cores in place; other formats are dequantized from shared
// memory (one switch per tensor and tile, non-inlined decoders) into the
// warp's BF16 tiles.

constexpr int kMmaWarps = 4;
constexpr int kMaxInFlight = 16;
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;

struct MmaArgs {
  PageShape shape;
  int n_q_heads, group, row_blocks, splits;
  float scale_log2;
  const float* q;
  const DevicePage* pages;
  const int32_t* indptr;
  const int32_t* attend;
  float* ws_o;    // [batch][n_q][S][D]
  float* ws_lse;  // [batch][n_q][S]
};

template <int kD>
struct MmaSmem {
  static constexpr int kTileBytes = 16 * kD * 2;  // one bf16 [16][kD] tile
  static constexpr int kQ = 0;
  static constexpr int kQr = kQ + kTileBytes;
  static constexpr int kWarp0 = kQr + kTileBytes;
  // Per warp: a byte ring of raw page bytes filled by cp.async (two BF16
  // tiles of K and V fit, more of the smaller formats), the decoded K and V
  // tiles, and one TileDesc per tile in flight.
  static constexpr int kRing = 4 * kTileBytes + 512;
  static constexpr int kDec = kRing;
  static constexpr int kDesc = kDec + 2 * kTileBytes;
  static constexpr int kWarpBytes = kDesc + kMaxInFlight * 32;
  static constexpr int kCb = kWarp0 + kMmaWarps * kWarpBytes;  // float[3][16]
  static constexpr int kSign = kCb + 48 * 4;                   // float[kD]
  static constexpr int kTotal = kSign + kD * 4;
  // The largest tile (K and V BF16, or INT8 with metadata) fits the ring.
  static_assert(kRing >= 2 * kTileBytes + 4 * (2 * kD + 32), "ring too small");
  static_assert(kRing + 2 * kTileBytes <= 65535, "TileDesc offsets are 16-bit");
};

// One staged tile: its page's packed format, its valid rows and where each
// range sits in the warp's ring (bytes from the ring start to the range's
// first byte): K codes, V codes, K scale, K zero, V scale, V zero.
struct TileDesc {
  int32_t format;
  int32_t nt;
  uint32_t end;  // ring bytes allocated through this tile (monotonic)
  uint16_t pos[6];
  uint16_t pad[4];
};
static_assert(sizeof(TileDesc) == 32, "TileDesc is 32 bytes");

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

// Exact float of a small unsigned code without I2F (I2F issues at a
// quarter of the FP32 rate on Hopper): the code is placed in the mantissa
// of 2^23 and 2^23 subtracted.
__device__ __forceinline__ float CodeToFloat(uint32_t c) {
  return __uint_as_float(0x4b000000u | c) - 8388608.f;
}
// Two E4M3 codes (low bytes of lo/hi) through the hardware converter.
__device__ __forceinline__ float2 Fp8PairToFloat(uint32_t lo, uint32_t hi) {
  const __nv_fp8x2_storage_t v =
      static_cast<__nv_fp8x2_storage_t>(lo | (hi << 8));
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <int F>
struct FmtBits {
  static constexpr int v = F == 1               ? 16
                           : (F == 4 || F == 5) ? 8
                           : (F == 2 || F == 6) ? 4
                           : (F == 7)           ? 3
                                                : 2;
};

// Dequantizes one staged tile of one tensor of format F (not BF16) from the
// warp's ring into a swizzled BF16 tile (rows >= nt zero). `codes` points
// at row 0 of the tile; `sc`/`zr` at the tile's metadata: the key group's
// per-channel scale/zero (INT keys), the rows' per-group scale/zero (INT
// values, 2^lg_gv dims per group), the rows' TQ norms, or the head's FP8
// scale. All reads are shared memory; the ring keeps each range's global
// alignment mod 16, so the vector loads are aligned as in the page. TQ keys
// stay in the rotated domain (norm * level; scored against Q' = R Q); TQ
// values are rotated back here, v = sign * FWHT(v') / sqrt(kD), the FWHT
// running in registers across the kD / 8 lanes holding a row.
template <int F, bool kKey, int kD>
__device__ __forceinline__ void DecodeStaged(const uint8_t* codes,
                                             const uint8_t* sc,
                                             const uint8_t* zr, int sdt,
                                             int lg_gv, int nt, uint8_t* out,
                                             const float* s_cb,
                                             const float* s_sign, int lane) {
  constexpr int kCh = kD / 8, kIt = kCh / 2;  // 16 * kCh chunks / 32 lanes
  constexpr int kB = FmtBits<F>::v;           // bytes per 8-dim chunk
  constexpr int kRowBytes = kD * kB / 8;
  const float* lv = s_cb + 16 * (FmtBits<F>::v - 2);
  float fp8_scale = 1.f;
  if constexpr (F == 4) fp8_scale = *reinterpret_cast<const float*>(sc);
  // Every lane keeps one chunk column: ch = lane % kCh for kCh <= 32.
  float ks[8], kz[8];
  if constexpr (kKey && (F == 2 || F == 3 || F == 5)) {
    const int ch = lane % kCh;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ks[i] = LoadMeta(sc, ch * 8 + i, sdt);
      kz[i] = LoadMeta(zr, ch * 8 + i, sdt);
    }
  }
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    const int c = lane + 32 * it, r = c / kCh, ch = c % kCh;
    float x[8];
    if (r < nt) {
      const uint8_t* p = codes + r * kRowBytes + ch * kB;
      uint32_t cd[8];
      if constexpr (kB == 8) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          cd[i] = (w.x >> (8 * i)) & 0xffu;
          cd[4 + i] = (w.y >> (8 * i)) & 0xffu;
        }
      } else {
        uint32_t w;
        if constexpr (kB == 4) {
          w = *reinterpret_cast<const uint32_t*>(p);
        } else if constexpr (kB == 2) {
          w = *reinterpret_cast<const uint16_t*>(p);
        } else {
          w = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
              (static_cast<uint32_t>(p[2]) << 16);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) cd[i] = (w >> (kB * i)) & ((1u << kB) - 1u);
      }
      if constexpr (F == 4) {
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          const float2 f2 = Fp8PairToFloat(cd[i], cd[i + 1]);
          x[i] = f2.x * fp8_scale;
          x[i + 1] = f2.y * fp8_scale;
        }
      } else if constexpr (F >= 6) {
        const float norm = HalfBits(LoadU16(sc + 2 * r));
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = lv[cd[i]] * norm;
      } else if constexpr (kKey) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          x[i] = fmaf(CodeToFloat(cd[i]), ks[i], kz[i]);
      } else {
        const int m = ((r * kD) >> lg_gv) + ((ch * 8) >> lg_gv);
        const float s = LoadMeta(sc, m, sdt), z = LoadMeta(zr, m, sdt);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = fmaf(CodeToFloat(cd[i]), s, z);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.f;
    }
    if constexpr (!kKey && F >= 6) {
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

// Non-BF16 tile of format f into a BF16 tile (one switch per tensor and
// tile; BF16 tiles are staged swizzled and used in place).
template <bool kKey, int kD>
__device__ __forceinline__ void DecodeStagedAny(
    int f, const uint8_t* codes, const uint8_t* sc, const uint8_t* zr, int sdt,
    int lg_gv, int nt, uint8_t* tile, const float* s_cb, const float* s_sign,
    int lane) {
  switch (f) {
#define KV_DEC_CASE(F)                                                   \
  case F:                                                                \
    DecodeStaged<F, kKey, kD>(codes, sc, zr, sdt, lg_gv, nt, tile, s_cb, \
                              s_sign, lane);                             \
    break;
    KV_DEC_CASE(2)
    KV_DEC_CASE(3)
    KV_DEC_CASE(4)
    KV_DEC_CASE(5)
    KV_DEC_CASE(6)
    KV_DEC_CASE(7)
    KV_DEC_CASE(8)
#undef KV_DEC_CASE
    default:
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

// Where one tensor's bytes for rows [t0, t0 + nt) of head h lie in a page:
// codes, then scale and zero ranges (len 0 when absent).
struct Range {
  uint32_t off, len;
};
template <int kD>
__device__ __forceinline__ void TensorRanges(int f, bool key, const DevEnc& e,
                                             const TensorLayout& L, int T,
                                             int h, int t0, int nt,
                                             Range (&r)[3]) {
  const uint32_t row_bytes = kD * BitsOf(f) / 8;
  const uint32_t row0 = static_cast<uint32_t>(h) * T + t0;
  r[0] =
      Range{static_cast<uint32_t>(L.codes) + row0 * row_bytes, nt * row_bytes};
  r[1] = r[2] = Range{0, 0};
  if (f == 4) {
    r[1] = Range{static_cast<uint32_t>(L.scale) + 4u * h, 4u};
  } else if (IsTq(f)) {
    r[1] = Range{static_cast<uint32_t>(L.scale) + 2u * row0, 2u * nt};
  } else if (IsInt(f)) {
    const uint32_t elem = e.sdt == 2 ? 1 : 2;
    uint32_t first, count;
    if (key) {
      const int gk = min(e.group, T);
      first = (static_cast<uint32_t>(h) * (T / gk) + t0 / gk) * kD;
      count = kD;
    } else {
      const int per_row = kD / min(e.group, kD);
      first = row0 * per_row;
      count = nt * per_row;
    }
    r[1] = Range{static_cast<uint32_t>(L.scale) + first * elem, count * elem};
    r[2] = Range{static_cast<uint32_t>(L.zero) + first * elem, count * elem};
  }
}

template <int kD>
__global__ void __launch_bounds__(kMmaWarps * 32)
    MmaAttentionKernel(const MmaArgs a) {
  extern __shared__ __align__(16) uint8_t sm[];
  using Sm = MmaSmem<kD>;
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
  const int b = x / a.row_blocks;
  const int row0 = rb * 16, nrows = min(16, a.group - row0);
  const bool tq_ok = TqDim(kD);
  float* s_cb = reinterpret_cast<float*>(sm + Sm::kCb);
  float* s_sign = reinterpret_cast<float*>(sm + Sm::kSign);
  if (tq_ok) {
    const int l = Log2Dim(kD);
    for (int i = tid; i < 48; i += blockDim.x)
      s_cb[i] = g_tq_cb[l][i / 16][i % 16];
    for (int i = tid; i < kD; i += blockDim.x) s_sign[i] = g_tq_sign[l][i];
  }
  // Q (scaled, rows >= nrows zero) via warp 0's ring, then Q' = R Q.
  float* qf = reinterpret_cast<float*>(sm + Sm::kWarp0);
  const size_t qbase =
      (static_cast<size_t>(b) * a.n_q_heads + h * a.group + row0) * kD;
  for (int i = tid; i < 16 * kD; i += blockDim.x)
    qf[i] = i / kD < nrows ? a.q[qbase + i] * a.scale_log2 : 0.f;
  __syncthreads();
  for (int i = tid; i < 16 * kNt; i += blockDim.x) {
    const int r = i / kNt, c = i % kNt;
    *reinterpret_cast<uint4*>(sm + Sm::kQ + TileOff<kD>(r, c)) =
        Pack8(qf + r * kD + c * 8);
  }
  if (tq_ok) {
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

  uint8_t* wbase = sm + Sm::kWarp0 + warp * Sm::kWarpBytes;
  uint8_t* ring = wbase;
  const uint32_t ring_addr = SmemAddr(ring);
  uint8_t* sK = wbase + Sm::kDec;
  uint8_t* sV = sK + Sm::kTileBytes;
  TileDesc* descs = reinterpret_cast<TileDesc*>(wbase + Sm::kDesc);

  const int S = a.splits * kMmaWarps, v = split * kMmaWarps + warp;
  const int first = a.indptr[b], P = a.indptr[b + 1] - first;
  const int pp = (P + S - 1) / S;
  const int p0 = first + min(P, v * pp), p1 = first + min(P, (v + 1) * pp);
  long before = 0;
  for (int i = first + lane; i < p0; i += 32)
    before += min(max(a.pages[i].num_tokens, 0), T);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    before += __shfl_xor_sync(0xffffffffu, before, o);
  const long attend = a.attend[b];

  // Producer state (warp-uniform): the next tile to stage is rows
  // [t0, t0 + 16) of page pi, `valid` rows of which are attended.
  // Page descriptors come 32 at a time, lane i holding page win + i.
  int pi = p0, win = p0 - 32, t0 = 0, valid = 0;
  bool page_ready = false, done = false, poisoned = false;
  const uint8_t* pdata = nullptr;
  int pfmt = 0;
  DevicePage lane_pg{};
  uint32_t head = 0, tail = 0;  // ring bytes allocated / released
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
          if (win + lane < p1) lane_pg = a.pages[win + lane];
        }
        const int src = pi - win;
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
        if (!Supported(Unpack(pfmt), shape)) {
          poisoned = true;
          done = true;
          break;
        }
        t0 = 0;
        page_ready = true;
      }
      const DevEnc e = Unpack(pfmt);
      const PageLayout L = LayoutOf(e, shape);
      const int nt = min(16, valid - t0);
      Range rg[6];
      {
        Range k3[3], v3[3];
        TensorRanges<kD>(e.k, true, e, L.k, T, h, t0, nt, k3);
        TensorRanges<kD>(e.v, false, e, L.v, T, h, t0, nt, v3);
        rg[0] = k3[0];
        rg[1] = v3[0];
        rg[2] = k3[1];
        rg[3] = k3[2];
        rg[4] = v3[1];
        rg[5] = v3[2];
      }
      const bool bf[2] = {e.k == 1, e.v == 1};
      uint32_t size[6], total = 0;
#pragma unroll
      for (int i = 0; i < 6; ++i) {
        if (i < 2 && bf[i]) {
          size[i] = Sm::kTileBytes;
        } else if (rg[i].len == 0) {
          size[i] = 0;
        } else {
          size[i] = ((rg[i].off + rg[i].len + 15) & ~15u) - (rg[i].off & ~15u);
        }
        total += size[i];
      }
      if (issued == consumed) head = tail = 0;
      uint32_t pos = head % Sm::kRing;
      uint32_t need = total;
      if (pos + total > Sm::kRing) need += Sm::kRing - pos;
      if (head - tail + need > Sm::kRing) break;  // ring full
      if (pos + total > Sm::kRing) pos = 0;
      head += need;
      TileDesc d;
      d.format = pfmt;
      d.nt = nt;
      d.end = head;
#pragma unroll
      for (int i = 0; i < 6; ++i) {
        d.pos[i] = static_cast<uint16_t>(pos + (rg[i].off & 15u));
        if (i < 2 && bf[i]) {
          d.pos[i] = static_cast<uint16_t>(pos);
          constexpr int kCh = kD / 8;
          const uint8_t* src = pdata + rg[i].off;
          for (int j = lane; j < 16 * kCh; j += 32) {
            const int r = j / kCh, ch = j % kCh;
            const bool in = r < nt;
            CpAsync16(ring_addr + pos + TileOff<kD>(r, ch),
                      in ? src + r * (kD * 2) + ch * 16 : pdata, in ? 16 : 0);
          }
        } else if (size[i] > 0) {
          const uint8_t* src = pdata + (rg[i].off & ~15u);
          for (uint32_t j = lane * 16; j < size[i]; j += 32 * 16)
            CpAsync16(ring_addr + pos + j, src + j, 16);
        }
        pos += size[i];
      }
      d.pad[0] = d.pad[1] = d.pad[2] = d.pad[3] = 0;
      if (lane == 0) descs[issued % kMaxInFlight] = d;
      CpCommit();
      ++issued;
      t0 += 16;
      if (t0 >= valid) {
        page_ready = false;
        ++pi;
      }
    }
  };

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[kNt][4];
#pragma unroll
  for (int j = 0; j < kNt; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  const uint32_t q_addr = SmemAddr(sm + Sm::kQ),
                 qr_addr = SmemAddr(sm + Sm::kQr);
  for (;;) {
    fill();
    if (issued == consumed) break;
    CpWaitAtMost(issued - consumed - 1);
    __syncwarp();
    const TileDesc d = descs[consumed % kMaxInFlight];
    const DevEnc e = Unpack(d.format);
    const int nt = d.nt;
    const int lg_gv = 31 - __clz(min(e.group, kD));  // group: power of 2
    uint32_t k_addr;
    if (e.k == 1) {
      k_addr = ring_addr + d.pos[0];
    } else {
      DecodeStagedAny<true, kD>(e.k, ring + d.pos[0], ring + d.pos[2],
                                ring + d.pos[3], e.sdt, lg_gv, nt, sK, s_cb,
                                s_sign, lane);
      k_addr = SmemAddr(sK);
      __syncwarp();
    }
    // S = Q K^T: rows = query heads, cols = tokens (two n-tiles of 8).
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const uint32_t qa = IsTq(e.k) ? qr_addr : q_addr;
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
    uint32_t v_addr;
    if (e.v == 1) {
      v_addr = ring_addr + d.pos[1];
    } else {
      DecodeStagedAny<false, kD>(e.v, ring + d.pos[1], ring + d.pos[4],
                                 ring + d.pos[5], e.sdt, lg_gv, nt, sV, s_cb,
                                 s_sign, lane);
      v_addr = SmemAddr(sV);
      __syncwarp();
    }
    // Online softmax; lane holds rows lane/4 (i=0) and lane/4+8 (i=1).
    float corr[2], p[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
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
      corr[i] = exp2f(m[i] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          p[j][2 * i + c] = exp2f(sc[j][2 * i + c] - m_new);
          sum += p[j][2 * i + c];
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l[i] = l[i] * corr[i] + sum;
      m[i] = m_new;
    }
    uint32_t pa[4] = {PackBf16(p[0][0], p[0][1]), PackBf16(p[0][2], p[0][3]),
                      PackBf16(p[1][0], p[1][1]), PackBf16(p[1][2], p[1][3])};
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      o[j][0] *= corr[0];
      o[j][1] *= corr[0];
      o[j][2] *= corr[1];
      o[j][3] *= corr[1];
    }
#pragma unroll
    for (int j = 0; j < kNt; j += 2) {
      uint32_t bfr[4];
      Ldm4T(v_addr +
                TileOff<kD>((lane % 8) + ((lane / 8) % 2) * 8, j + lane / 16),
            bfr);
      Mma(o[j], pa, bfr[0], bfr[1]);
      Mma(o[j + 1], pa, bfr[2], bfr[3]);
    }
    __syncwarp();  // tile reads done before its ring bytes are reused
    tail = d.end;
    ++consumed;
  }
  CpWait<0>();
  const float nan = __uint_as_float(0x7fc00000u);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane / 4 + 8 * i;
    if (r >= nrows) continue;
    const size_t qh =
        static_cast<size_t>(b) * a.n_q_heads + h * a.group + row0 + r;
    const size_t slot = qh * S + v;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    if (lane % 4 == 0) {
      a.ws_lse[slot] =
          poisoned ? nan : (l[i] > 0.f ? m[i] + __log2f(l[i]) : -INFINITY);
    }
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

// One CTA per (sequence, query head): merges the S partial results.
__global__ void ReduceKernel(int S, int D, const float* __restrict__ ws_o,
                             const float* __restrict__ ws_lse,
                             float* __restrict__ out) {
  const size_t qh = blockIdx.x;
  const float* lse = ws_lse + qh * S;
  float mx = -INFINITY;
  bool nan = false;
  for (int s = 0; s < S; ++s) {
    nan = nan || isnan(lse[s]);
    mx = fmaxf(mx, lse[s]);
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f, wsum = 0.f;
    if (mx > -INFINITY) {
      for (int s = 0; s < S; ++s) {
        const float w = exp2f(lse[s] - mx);
        wsum += w;
        acc += w * ws_o[(qh * S + s) * D + d];
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

struct MmaPlan {
  int group, row_blocks, splits;
  size_t ws_bytes;
};

MmaPlan PlanMma(const AttentionParams& p) {
  MmaPlan m;
  m.group = p.n_q_heads / p.shape.heads;
  m.row_blocks = (m.group + 15) / 16;
  const long long ctas =
      static_cast<long long>(p.batch) * p.shape.heads * m.row_blocks;
  int splits = p.num_splits;
  if (splits <= 0) {
    // About four resident CTAs per SM, two waves.
    const long long want = 8LL * SmCount();
    splits = static_cast<int>((want + ctas - 1) / std::max(1LL, ctas));
  }
  m.splits = std::min(std::max(splits, 1), kMaxSplits);
  const size_t slots =
      static_cast<size_t>(p.batch) * p.n_q_heads * m.splits * kMmaWarps;
  m.ws_bytes = slots * (p.shape.head_dim + 1) * sizeof(float) + 16;
  return m;
}

template <int kD>
absl::Status LaunchMma(const AttentionParams& p, const MmaPlan& plan,
                       float* ws) {
  using Sm = MmaSmem<kD>;
  auto* kernel = &MmaAttentionKernel<kD>;
  if (Sm::kTotal > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sm::kTotal);
    if (e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("attention needs ", Sm::kTotal,
                       " bytes of shared memory: ", cudaGetErrorString(e)));
    }
  }
  MmaArgs a;
  a.shape = p.shape;
  a.n_q_heads = p.n_q_heads;
  a.group = plan.group;
  a.row_blocks = plan.row_blocks;
  a.splits = plan.splits;
  a.scale_log2 = p.scale * kLog2e;
  a.q = p.q;
  a.pages = p.pages;
  a.indptr = p.page_indptr;
  a.attend = p.attend_tokens;
  const int S = plan.splits * kMmaWarps;
  const size_t slots = static_cast<size_t>(p.batch) * p.n_q_heads * S;
  a.ws_lse = ws;
  a.ws_o = ws + ((slots + 3) / 4) * 4;  // 16-byte aligned partial outputs
  const long long grid = static_cast<long long>(p.batch) * p.shape.heads *
                         plan.row_blocks * plan.splits;
  kernel<<<static_cast<unsigned>(grid), kMmaWarps * 32, Sm::kTotal, p.stream>>>(
      a);
  KV_RETURN_IF_ERROR(LaunchStatus("DecodeAttentionCuda"));
  ReduceKernel<<<static_cast<unsigned>(static_cast<size_t>(p.batch) *
                                       p.n_q_heads),
                 std::min(kD, 128), 0, p.stream>>>(S, kD, a.ws_o, a.ws_lse,
                                                   p.out);
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
  return LayoutOf(Unpack(PackEncoding(e)), shape);
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
  if (static_cast<long long>(p.batch) * p.shape.heads * plan.row_blocks *
          plan.splits >
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
