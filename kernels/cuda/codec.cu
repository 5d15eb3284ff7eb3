// Encode (quantize-on-write), decode and demote of whole pages: the kernels
// and their launchers (codec.h; codec_api.cc has the kv_cuda.cuh entry
// points). One CTA (kCodecThreads) per page, or per (page, head) for
// decode; a page whose encoding SupportedEncoding rejects is left untouched
// (encode, demote) or decoded as NaN. Output bytes equal kernels/ref's
// EncodePage / DecodePage, TQ included.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/codec.cuh"
#include "kernels/cuda/codec.h"
#include "kernels/cuda/device_page.h"
#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/launch_result.h"
#include "kernels/cuda/packed_encoding.h"
#include "kernels/cuda/tq.cuh"
#include "kernels/layout.h"
#include "kernels/numeric.h"

namespace triax::kernels::cuda {
namespace {

constexpr int kCodecThreads = 256;

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

// ---- Encode -----------------------------------------------------------------

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
  const UnpackedEncoding e = UnpackEncoding(pg.format);
  if (!SupportedEncoding(e, shape)) return;
  const int T = shape.tokens, H = shape.heads, D = shape.head_dim;
  const int n = min(max(pg.num_tokens, 0), T);
  const size_t in_base = static_cast<size_t>(blockIdx.x) * T * H * D;
  EncodePageBody(shape, e, pg.data, n, k_in + in_base, v_in + in_base, s_ks,
                 s_kz, &s_amax, s_row);
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
  const UnpackedEncoding e = UnpackEncoding(pg.format);
  const bool ok = SupportedEncoding(e, shape);
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
  const UnpackedEncoding es = UnpackEncoding(ps.format),
                         ed = UnpackEncoding(pd.format);
  if (!SupportedEncoding(es, shape) || !SupportedEncoding(ed, shape)) return;
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

}  // namespace

LaunchResult LaunchEncodePages(const PageShape& shape, const DevicePage* pages,
                               int num_pages, const uint16_t* k_bf16,
                               const uint16_t* v_bf16, cudaStream_t stream) {
  if (LaunchResult r = EnsureTqTables(); !r.ok()) return r;
  EncodeKernel<<<num_pages, kCodecThreads, 0, stream>>>(shape, pages, k_bf16,
                                                        v_bf16);
  return LastLaunch("EncodePagesCuda");
}

LaunchResult LaunchDecodePages(const PageShape& shape, const DevicePage* pages,
                               unsigned blocks, float* k_out, float* v_out,
                               cudaStream_t stream) {
  if (LaunchResult r = EnsureTqTables(); !r.ok()) return r;
  DecodeKernel<<<blocks, kCodecThreads, 0, stream>>>(shape, pages, k_out,
                                                     v_out);
  return LastLaunch("DecodePagesCuda");
}

LaunchResult LaunchDemotePages(const PageShape& shape, const DevicePage* src,
                               const DevicePage* dst, int num_pages,
                               uint16_t* scratch, cudaStream_t stream) {
  if (LaunchResult r = EnsureTqTables(); !r.ok()) return r;
  DemoteKernel<<<num_pages, kCodecThreads, 0, stream>>>(shape, src, dst,
                                                        scratch);
  return LastLaunch("DemotePagesCuda");
}

}  // namespace triax::kernels::cuda
