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
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {
namespace {

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
__host__ __device__ __forceinline__ bool CudaFormat(int f) {
  return f >= 1 && f <= 5;
}

__host__ __device__ __forceinline__ bool Supported(const DevEnc& e,
                                                   const PageShape& s) {
  if (!CudaFormat(e.k) || !CudaFormat(e.v)) return false;
  if (e.group != 32 && e.group != 64 && e.group != 128) return false;
  if (e.sdt != 1 && e.sdt != 2) return false;
  const int gk = min(e.group, s.tokens), gv = min(e.group, s.head_dim);
  if (IsInt(e.k) && s.tokens % gk != 0) return false;
  if (IsInt(e.v) && s.head_dim % gv != 0) return false;
  return true;
}

__host__ __device__ __forceinline__ size_t Align16(size_t n) {
  return (n + 15) & ~size_t{15};
}

// Same arithmetic as LayoutTensor in kernels/layout.cc (BF16/FP8/INT).
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

// ---- Encode
// ------------------------------------------------------------------

// Encodes one tensor of one page (the whole CTA cooperates).
__device__ void EncodeTensor(int f, bool key, const DevEnc& e,
                             const PageShape& shape, const TensorLayout& L,
                             int n, const uint16_t* src, uint8_t* page,
                             float* s_ks, float* s_kz, unsigned* s_amax) {
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
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

// One CTA per page: zero the page, then encode K and V.
__global__ void EncodeKernel(PageShape shape, const DevicePage* pages,
                             const uint16_t* k_in, const uint16_t* v_in) {
  __shared__ float s_ks[kMaxHeadDim];
  __shared__ float s_kz[kMaxHeadDim];
  __shared__ unsigned s_amax;
  const DevicePage pg = pages[blockIdx.x];
  const DevEnc e = Unpack(pg.format);
  if (!Supported(e, shape)) return;
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int n = min(max(pg.num_tokens, 0), T);
  const PageLayout L = LayoutOf(e, shape);
  uint8_t* page = pg.data;
  const size_t in_base = static_cast<size_t>(blockIdx.x) * T * H * D;
  uint4* page16 = reinterpret_cast<uint4*>(page);
  for (size_t i = threadIdx.x; i < L.total / 16; i += blockDim.x)
    page16[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  EncodeTensor(e.k, true, e, shape, L.k, n, k_in + in_base, page, s_ks, s_kz,
               &s_amax);
  __syncthreads();
  EncodeTensor(e.v, false, e, shape, L.v, n, v_in + in_base, page, s_ks, s_kz,
               &s_amax);
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

// One CTA per (page, head); one thread per (token, 8-dim chunk).
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
  const int chunks = D / 8;
  for (int i = threadIdx.x; i < n * chunks; i += blockDim.x) {
    const int t = i / chunks, d0 = (i % chunks) * 8;
    const size_t dst = ((static_cast<size_t>(pi) * T + t) * H + h) * D + d0;
    float x[8];
    if (k_out != nullptr) {
      if (ok) {
        LoadRow8(e.k, true, e, L.k, pg.data, shape, h, t, d0, x);
      } else {
        for (int j = 0; j < 8; ++j) x[j] = __uint_as_float(0x7fc00000u);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) k_out[dst + j] = x[j];
    }
    if (v_out != nullptr) {
      if (ok) {
        LoadRow8(e.v, false, e, L.v, pg.data, shape, h, t, d0, x);
      } else {
        for (int j = 0; j < 8; ++j) x[j] = __uint_as_float(0x7fc00000u);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) v_out[dst + j] = x[j];
    }
  }
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

}  // namespace

absl::Status CheckEncodingCuda(const Encoding& e, const PageShape& shape) {
  if (absl::Status s = ValidateShape(shape); !s.ok()) return s;
  if (const char* why = ValidateEncoding(e, shape); why != nullptr) {
    char name[64];
    return absl::InvalidArgumentError(absl::StrCat(
        "encoding ", EncodingName(e, name, sizeof(name)), ": ", why));
  }
  for (Format f : {e.k, e.v}) {
    if (!CudaFormat(static_cast<int>(f))) {
      return absl::InvalidArgumentError(absl::StrCat(
          FormatName(f), " is not supported by the CUDA kernels yet"));
    }
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
  // Compile-time head_dim for the common sizes; the generic kernel covers
  // every other multiple of 8.
  switch (p.shape.head_dim) {
    case 64:
      return LaunchAttention<64>(p, group);
    case 128:
      return LaunchAttention<128>(p, group);
    case 256:
      return LaunchAttention<256>(p, group);
    default:
      return LaunchAttention<0>(p, group);
  }
}

}  // namespace triax::kernels::cuda
