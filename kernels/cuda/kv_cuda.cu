// CUDA kernels for KV pages; see kv_cuda.cuh for the API and layout.h for
// the byte layout. Page section offsets come from ComputeLayout on the host
// and travel to the kernels by value (LayoutTable), so the GPU never
// re-derives the layout and cannot disagree with the CPU reference.
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

// Section offsets per format, indexed by the Format value (index 0 unused).
struct LayoutTable {
  PageLayout l[4];
};

LayoutTable MakeLayoutTable(const PageShape& s) {
  LayoutTable t;
  t.l[1] = ComputeLayout(Format::kBF16, s);
  t.l[2] = ComputeLayout(Format::kINT4, s);
  t.l[3] = ComputeLayout(Format::kINT2, s);
  return t;
}

__device__ __forceinline__ bool ValidFormat(int f) { return f >= 1 && f <= 3; }
__device__ __forceinline__ int BitsOf(int f) {
  return f == 1 ? 16 : (f == 2 ? 4 : 2);
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

// Same arithmetic as MakeQuant/Quantize in kernels/ref/kv_ref.cc.
struct Quant {
  float scale, zero;
  uint16_t scale_bits, zero_bits;
};

__device__ __forceinline__ Quant MakeQuant(float lo, float hi, int qmax) {
  float zero = fminf(fmaxf(lo, -kFp16Max), kFp16Max);
  float scale = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(qmax));
  if (!(scale > 0.f)) scale = 0.f;
  scale = fminf(scale, kFp16Max);
  Quant q;
  q.scale_bits = __half_as_ushort(__float2half_rn(scale));
  q.zero_bits = __half_as_ushort(__float2half_rn(zero));
  q.scale = HalfBits(q.scale_bits);
  q.zero = HalfBits(q.zero_bits);
  return q;
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

// One CTA per page: zero the page, then per head quantize keys (one thread
// per channel for the scale, one per (token, byte) for the codes) and values
// (one thread per (token, group)).
__global__ void EncodeKernel(PageShape shape, LayoutTable lt,
                             const DevicePage* pages, const uint16_t* k_in,
                             const uint16_t* v_in) {
  __shared__ float s_ks[kMaxHeadDim];
  __shared__ float s_kz[kMaxHeadDim];
  const DevicePage pg = pages[blockIdx.x];
  if (!ValidFormat(pg.format)) return;
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int G = shape.value_group > 0 ? shape.value_group : min(32, D);
  const int n = min(max(pg.num_tokens, 0), T);
  const PageLayout& L = lt.l[pg.format];
  uint8_t* page = pg.data;
  const size_t in_base = static_cast<size_t>(blockIdx.x) * T * H * D;
  const uint16_t* k = k_in + in_base;
  const uint16_t* v = v_in + in_base;

  uint4* page16 = reinterpret_cast<uint4*>(page);
  for (size_t i = threadIdx.x; i < L.total / 16; i += blockDim.x)
    page16[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  if (pg.format == static_cast<int>(Format::kBF16)) {
    const int chunks = D / 8;
    const size_t items = static_cast<size_t>(n) * H * chunks;
    for (size_t i = threadIdx.x; i < items; i += blockDim.x) {
      const int c = static_cast<int>(i % chunks);
      const size_t th = i / chunks;  // t * H + h
      const int h = static_cast<int>(th % H);
      const int t = static_cast<int>(th / H);
      const size_t dst = ((static_cast<size_t>(h) * T + t) * D + c * 8) * 2;
      const uint4* ks = reinterpret_cast<const uint4*>(k + th * D + c * 8);
      const uint4* vs = reinterpret_cast<const uint4*>(v + th * D + c * 8);
      *reinterpret_cast<uint4*>(page + L.k_codes + dst) = *ks;
      *reinterpret_cast<uint4*>(page + L.v_codes + dst) = *vs;
    }
    return;
  }

  const int bits = BitsOf(pg.format);
  const int per_byte = 8 / bits;
  const int qmax = (1 << bits) - 1;
  const int row_bytes = D * bits / 8;
  const int groups = D / G;
  for (int h = 0; h < H; ++h) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float lo = INFINITY, hi = -INFINITY;
      for (int t = 0; t < n; ++t) {
        const float x = Bf16Bits(k[(static_cast<size_t>(t) * H + h) * D + d]);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
      }
      const Quant q = MakeQuant(lo, hi, qmax);
      const size_t meta = (static_cast<size_t>(h) * D + d) * 2;
      *reinterpret_cast<uint16_t*>(page + L.k_scale + meta) = q.scale_bits;
      *reinterpret_cast<uint16_t*>(page + L.k_zero + meta) = q.zero_bits;
      s_ks[d] = q.scale;
      s_kz[d] = q.zero;
    }
    __syncthreads();
    // Key codes: one thread per output byte.
    for (int i = threadIdx.x; i < n * row_bytes; i += blockDim.x) {
      const int t = i / row_bytes, j = i % row_bytes;
      const uint16_t* src = k + (static_cast<size_t>(t) * H + h) * D;
      uint32_t byte = 0;
      for (int e = 0; e < per_byte; ++e) {
        const int d = j * per_byte + e;
        Quant q;
        q.scale = s_ks[d];
        q.zero = s_kz[d];
        byte |= Quantize(Bf16Bits(src[d]), q, qmax) << (e * bits);
      }
      page[L.k_codes + (static_cast<size_t>(h) * T + t) * row_bytes + j] =
          static_cast<uint8_t>(byte);
    }
    // Values: one thread per (token, group); G % 8 == 0 keeps groups byte
    // aligned for both bit widths.
    for (int i = threadIdx.x; i < n * groups; i += blockDim.x) {
      const int t = i / groups, g = i % groups;
      const uint16_t* src = v + (static_cast<size_t>(t) * H + h) * D + g * G;
      float lo = INFINITY, hi = -INFINITY;
      for (int d = 0; d < G; ++d) {
        const float x = Bf16Bits(src[d]);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
      }
      const Quant q = MakeQuant(lo, hi, qmax);
      const size_t meta = ((static_cast<size_t>(h) * T + t) * groups + g) * 2;
      *reinterpret_cast<uint16_t*>(page + L.v_scale + meta) = q.scale_bits;
      *reinterpret_cast<uint16_t*>(page + L.v_zero + meta) = q.zero_bits;
      uint8_t* row =
          page + L.v_codes + (static_cast<size_t>(h) * T + t) * row_bytes;
      for (int jb = 0; jb < G / per_byte; ++jb) {
        uint32_t byte = 0;
        for (int e = 0; e < per_byte; ++e) {
          byte |= Quantize(Bf16Bits(src[jb * per_byte + e]), q, qmax)
                  << (e * bits);
        }
        row[(g * G) / per_byte + jb] = static_cast<uint8_t>(byte);
      }
    }
    __syncthreads();  // s_ks/s_kz are rewritten for the next head
  }
}

// ---- Shared decode of 8 consecutive dims
// ---------------------------------------

// Codes of dims [d0, d0 + 8) of row (h, t) in a code section, as floats
// (BF16: the values themselves). Row byte offsets are multiples of the load
// width because D % 8 == 0 and sections are 16-byte aligned.
__device__ __forceinline__ void LoadRow8(int fmt, const uint8_t* section, int T,
                                         int D, int h, int t, int d0,
                                         float* out) {
  const size_t row = static_cast<size_t>(h) * T + t;
  if (fmt == 1) {
    const uint4 w =
        *reinterpret_cast<const uint4*>(section + (row * D + d0) * 2);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = Bf16Bits(u[i] & 0xffffu);
      out[2 * i + 1] = Bf16Bits(u[i] >> 16);
    }
  } else if (fmt == 2) {
    const uint32_t w =
        *reinterpret_cast<const uint32_t*>(section + row * (D / 2) + d0 / 2);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      out[i] = static_cast<float>((w >> (4 * i)) & 0xfu);
  } else {
    const uint32_t w =
        *reinterpret_cast<const uint16_t*>(section + row * (D / 4) + d0 / 4);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      out[i] = static_cast<float>((w >> (2 * i)) & 0x3u);
  }
}

// Value meta (scale, zero) for row (h, t), group of dim d0.
__device__ __forceinline__ void LoadVMeta(const uint8_t* page,
                                          const PageLayout& L, int T, int D,
                                          int G, int h, int t, int d0, float* s,
                                          float* z) {
  const int groups = D / G;
  const size_t off = ((static_cast<size_t>(h) * T + t) * groups + d0 / G) * 2;
  *s = HalfBits(LoadU16(page + L.v_scale + off));
  *z = HalfBits(LoadU16(page + L.v_zero + off));
}

// ---- Decode
// --------------------------------------------------------------------

// One CTA per (page, head); one thread per (token, 8-dim chunk).
__global__ void DecodeKernel(PageShape shape, LayoutTable lt,
                             const DevicePage* pages, float* k_out,
                             float* v_out) {
  __shared__ float s_ks[kMaxHeadDim];
  __shared__ float s_kz[kMaxHeadDim];
  const int H = shape.heads;
  const int pi = blockIdx.x / H, h = blockIdx.x % H;
  const DevicePage pg = pages[pi];
  if (!ValidFormat(pg.format)) return;
  const int T = shape.tokens, D = shape.head_dim;
  const int G = shape.value_group > 0 ? shape.value_group : min(32, D);
  const int n = min(max(pg.num_tokens, 0), T);
  const PageLayout& L = lt.l[pg.format];
  const uint8_t* page = pg.data;
  const bool quant = pg.format != 1;
  if (quant && k_out != nullptr) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      s_ks[d] = HalfBits(
          LoadU16(page + L.k_scale + (static_cast<size_t>(h) * D + d) * 2));
      s_kz[d] = HalfBits(
          LoadU16(page + L.k_zero + (static_cast<size_t>(h) * D + d) * 2));
    }
  }
  __syncthreads();
  const int chunks = D / 8;
  for (int i = threadIdx.x; i < n * chunks; i += blockDim.x) {
    const int t = i / chunks, d0 = (i % chunks) * 8;
    const size_t dst = ((static_cast<size_t>(pi) * T + t) * H + h) * D + d0;
    float x[8];
    if (k_out != nullptr) {
      LoadRow8(pg.format, page + L.k_codes, T, D, h, t, d0, x);
      if (quant) {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          x[e] = __fadd_rn(__fmul_rn(x[e], s_ks[d0 + e]), s_kz[d0 + e]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) k_out[dst + e] = x[e];
    }
    if (v_out != nullptr) {
      LoadRow8(pg.format, page + L.v_codes, T, D, h, t, d0, x);
      if (quant) {
        float s, z;
        LoadVMeta(page, L, T, D, G, h, t, d0, &s, &z);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = __fadd_rn(__fmul_rn(x[e], s), z);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) v_out[dst + e] = x[e];
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
    AttentionKernel(PageShape shape, LayoutTable lt, int n_q_heads, float scale,
                    const float* __restrict__ q, float* __restrict__ out,
                    const DevicePage* __restrict__ pages,
                    const int32_t* __restrict__ indptr,
                    const int32_t* __restrict__ attend_tokens) {
  extern __shared__ float smem[];
  const int H = shape.heads, T = shape.tokens;
  const int D = kD > 0 ? kD : shape.head_dim;
  const int G = shape.value_group > 0 ? shape.value_group : min(32, D);
  const int group = n_q_heads / H;
  const int b = blockIdx.x / H, h = blockIdx.x % H;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = kAttnThreads / 32;
  const AttnSmem plan(group, D);
  float* s_q = smem + plan.q;
  float* s_acc = smem + plan.acc;
  float* s_ks = smem + plan.ks;
  float* s_kz = smem + plan.kz;
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
  for (int pi = first; pi < last && remaining > 0; ++pi) {
    const DevicePage pg = pages[pi];
    if (!ValidFormat(pg.format)) continue;
    const int n = min(min(max(pg.num_tokens, 0), T), remaining);
    remaining -= n;
    const PageLayout& L = lt.l[pg.format];
    const uint8_t* page = pg.data;
    const bool quant = pg.format != 1;
    if (quant) {
      for (int d = tid; d < D; d += kAttnThreads) {
        s_ks[d] = HalfBits(
            LoadU16(page + L.k_scale + (static_cast<size_t>(h) * D + d) * 2));
        s_kz[d] = HalfBits(
            LoadU16(page + L.k_zero + (static_cast<size_t>(h) * D + d) * 2));
      }
      __syncthreads();
    }
    for (int t0 = 0; t0 < n; t0 += kTile) {
      const int nt = min(kTile, n - t0);
      // Decode the tile.
      for (int i = tid; i < nt * chunks; i += kAttnThreads) {
        const int tt = i / chunks, d0 = (i % chunks) * 8;
        float x[8];
        LoadRow8(pg.format, page + L.k_codes, T, D, h, t0 + tt, d0, x);
        if (quant) {
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = x[e] * s_ks[d0 + e] + s_kz[d0 + e];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) s_kt[tt * (D + 1) + d0 + e] = x[e];
        LoadRow8(pg.format, page + L.v_codes, T, D, h, t0 + tt, d0, x);
        if (quant) {
          float s, z;
          LoadVMeta(page, L, T, D, G, h, t0 + tt, d0, &s, &z);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = x[e] * s + z;
        }
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
    o[i] = l > 0.f ? s_acc[i] / l : 0.f;
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
  const int g = s.ValueGroup();
  if (g < 8 || g % 8 != 0 || s.head_dim % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape.value_group must be a multiple of 8 dividing head_dim ",
        s.head_dim, ", got ", g));
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
      p.shape, MakeLayoutTable(p.shape), p.n_q_heads, p.scale, p.q, p.out,
      p.pages, p.page_indptr, p.attend_tokens);
  return LaunchStatus("DecodeAttentionCuda");
}

}  // namespace

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
  EncodeKernel<<<p.num_pages, kCodecThreads, 0, p.stream>>>(
      p.shape, MakeLayoutTable(p.shape), p.pages, p.k_bf16, p.v_bf16);
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
      p.shape, MakeLayoutTable(p.shape), p.pages, p.k_out, p.v_out);
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
