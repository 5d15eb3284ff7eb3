// The CUDA-core decode attention kernel (float32, one CTA of kAttnThreads
// per (sequence, KV head), no split-K, no workspace) for the head_dims
// without tensor-core kernels: multiples of 8 in [8, 256] outside
// MmaHeadDims. AttentionKernel<0> is the instantiation that serves them
// (kD = 0: head_dim read at run time). TQ pages never reach it (TQ needs a
// power-of-two head_dim, all of which have tensor-core kernels): their
// SupportedEncoding check fails and the sequence's output is NaN.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/attention_dispatch.h"
#include "kernels/cuda/codec.cuh"
#include "kernels/cuda/device_page.h"
#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/launch_result.h"
#include "kernels/cuda/packed_encoding.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {
namespace {

constexpr int kTile = 32;  // tokens per attention tile (= warp size)
constexpr int kAttnThreads = 128;

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
    const UnpackedEncoding e = UnpackEncoding(pg.format);
    if (!SupportedEncoding(e, shape)) {  // never silently wrong: NaN output
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

template <int kD>
LaunchResult LaunchAttention(const AttentionArgs& p, int group) {
  const AttnSmem plan(group, p.shape.head_dim);
  const size_t bytes = static_cast<size_t>(plan.total) * sizeof(float);
  auto* kernel = &AttentionKernel<kD>;
  if (bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(bytes));
    if (e != cudaSuccess) {
      LaunchResult r;
      r.kind = LaunchResult::Kind::kSharedMemory;
      r.error = e;
      r.smem_bytes = bytes;
      return r;
    }
  }
  const dim3 grid(static_cast<unsigned>(p.batch) * p.shape.heads);
  kernel<<<grid, kAttnThreads, bytes, p.stream>>>(
      p.shape, p.n_q_heads, p.scale, p.q, p.out, p.pages, p.page_indptr,
      p.attend_tokens);
  return LastLaunch("DecodeAttentionCuda");
}

}  // namespace

LaunchResult LaunchCudaCoreAttention(const AttentionArgs& p, int group) {
  return LaunchAttention<0>(p, group);
}

}  // namespace triax::kernels::cuda
