// The split-K bookkeeping kernels of the tensor-core decode attention
// around the per-head_dim launches (attention_hd<D>.cu): PartitionKernel
// (before them: each sequence's pages of each encoding class cut into equal
// shares, one per warp) and ReduceKernel (after them: the partial results
// of each query head merged by log-sum-exp), with their launchers
// (attention_dispatch.h). Workspace layout: attention_plan.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/attention_dispatch.h"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/device_page.h"
#include "kernels/cuda/launch_result.h"

namespace triax::kernels::cuda {
namespace {

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

// Shares per class: the splits of the class's launch configuration x the
// warps of a CTA.
ClassShares SharesOf(const MmaPlan& plan, int head_dim) {
  ClassShares shares;
  for (int c = 0; c < kClasses; ++c)
    shares.s[c] = plan.splits[ConfigOf(c, SmallOk(head_dim))] * kMmaWarps;
  return shares;
}

}  // namespace

LaunchResult LaunchPartition(const AttentionArgs& a, const MmaPlan& plan,
                             const MmaWorkspace& ws) {
  const int D = a.shape.head_dim;
  PartitionKernel<<<a.batch, kPartThreads, 0, a.stream>>>(
      a.pages, a.page_indptr, a.attend_tokens, a.shape.tokens, plan.s_max,
      SharesOf(plan, D), a.pages_per_share, SmallOk(D), ws.part_plan,
      ws.cls_mask);
  return LastLaunch("DecodeAttentionCuda partition");
}

LaunchResult LaunchReduce(const AttentionArgs& a, const MmaPlan& plan,
                          const MmaWorkspace& ws, uint32_t launched) {
  const int D = a.shape.head_dim;
  ReduceKernel<<<static_cast<unsigned>(static_cast<size_t>(a.batch) *
                                       a.n_q_heads),
                 std::min(D, 128), 0, a.stream>>>(
      plan.s_max, SharesOf(plan, D), launched, D, a.n_q_heads, ws.cls_mask,
      ws.ws_o, ws.ws_lse, a.out);
  return LastLaunch("DecodeAttentionCuda reduce");
}

}  // namespace triax::kernels::cuda
