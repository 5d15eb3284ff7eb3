// DecodeAttentionCuda and its helpers (kv_cuda.cuh): validation, the one
// runtime head_dim -> kernel dispatch, the plan and workspace, and the two
// split-K bookkeeping kernels around the per-head_dim launches:
// PartitionKernel (shares of each sequence's pages per encoding class)
// before them, ReduceKernel (log-sum-exp merge of the partials) after.
//
// head_dim dispatch: MmaHeadDims -> MmaAttention<D> (attention_hd<D>.cu,
// tensor cores), other multiples of 8 up to 256 -> the CUDA-core kernel
// (attention_fallback.cu); anything else is INVALID_ARGUMENT naming it.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/cuda/api_common.h"
#include "kernels/cuda/attention_dispatch.h"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/kv_cuda.cuh"
#include "kernels/cuda/packed_encoding.h"

namespace triax::kernels::cuda {
namespace {

constexpr int kMaxGroupTimesDim = 4096;  // query heads per KV head x D

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

// ---- The one head_dim dispatch ------------------------------------------

// One head_dim's tensor-core kernels (MmaAttention<D>).
struct MmaKernels {
  int head_dim;
  absl::Status (*ensure_tq_tables)();
  Residency (*query_residency)();
  absl::Status (*launch)(const AttentionParams&, const MmaPlan&,
                         const MmaWorkspace&, uint32_t*);
};

template <int... kDs>
constexpr std::array<MmaKernels, sizeof...(kDs)> MmaKernelTable(
    HeadDimList<kDs...>) {
  return {
      {{kDs, &MmaAttention<kDs>::EnsureTqTables,
        &MmaAttention<kDs>::QueryResidency, &MmaAttention<kDs>::Launch}...}};
}
constexpr auto kMmaKernels = MmaKernelTable(MmaHeadDims{});

// The kernels that serve a head_dim, the one runtime head_dim ->
// instantiation step of decode attention: MmaHeadDims -> their tensor-core
// kernels; the other multiples of 8 in [8, kMaxHeadDim] -> the CUDA-core
// kernel (nullptr); anything else (ValidateShape lets none through) ->
// INVALID_ARGUMENT naming the value.
absl::StatusOr<const MmaKernels*> KernelsFor(int head_dim) {
  for (const MmaKernels& k : kMmaKernels) {
    if (k.head_dim == head_dim) return &k;
  }
  if (head_dim >= 8 && head_dim <= kMaxHeadDim && head_dim % 8 == 0) {
    return nullptr;
  }
  std::string dims;
  for (const MmaKernels& k : kMmaKernels) {
    absl::StrAppend(&dims, dims.empty() ? "" : ", ", k.head_dim);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "shape.head_dim=", head_dim,
      " has no attention kernel instantiation (tensor cores: ", dims,
      "; CUDA cores: multiples of 8 in [8, ", kMaxHeadDim, "])"));
}

// Cached per (device, head_dim).
Residency ResidencyFor(const MmaKernels& k) {
  static std::mutex* mu = new std::mutex();
  static std::map<std::pair<int, int>, Residency>* cache =
      new std::map<std::pair<int, int>, Residency>();
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
  std::lock_guard<std::mutex> lock(*mu);
  const auto key = std::make_pair(dev, k.head_dim);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  const Residency r = k.query_residency();
  cache->emplace(key, r);
  return r;
}

MmaPlan PlanFor(const AttentionParams& p, const MmaKernels& k) {
  return PlanMma(p, p.num_splits > 0 ? Residency{} : ResidencyFor(k));
}

// Partition, the head_dim's launches, reduce.
absl::Status RunMma(const AttentionParams& p, const MmaPlan& plan,
                    const MmaKernels& k, void* ws) {
  const int S = plan.s_max;
  const int D = p.shape.head_dim;
  ClassShares shares;
  for (int c = 0; c < kClasses; ++c)
    shares.s[c] = plan.splits[ConfigOf(c, SmallOk(D))] * kMmaWarps;
  const MmaWorkspace w = CarveMmaWorkspace(p, plan, ws);
  PartitionKernel<<<p.batch, kPartThreads, 0, p.stream>>>(
      p.pages, p.page_indptr, p.attend_tokens, p.shape.tokens, S, shares,
      p.pages_per_share, SmallOk(D), w.part_plan, w.cls_mask);
  TRIAX_RETURN_IF_ERROR(LaunchStatus("DecodeAttentionCuda partition"));
  uint32_t launched = 0;
  TRIAX_RETURN_IF_ERROR(k.launch(p, plan, w, &launched));
  ReduceKernel<<<static_cast<unsigned>(static_cast<size_t>(p.batch) *
                                       p.n_q_heads),
                 std::min(D, 128), 0, p.stream>>>(
      S, shares, launched, D, p.n_q_heads, w.cls_mask, w.ws_o, w.ws_lse, p.out);
  return LaunchStatus("DecodeAttentionCuda reduce");
}

}  // namespace

size_t AttentionWorkspaceBytes(const AttentionParams& p) {
  if (!ValidateShape(p.shape).ok() || p.batch <= 0 || p.n_q_heads < 1 ||
      p.n_q_heads % p.shape.heads != 0) {
    return 0;
  }
  const absl::StatusOr<const MmaKernels*> k = KernelsFor(p.shape.head_dim);
  return k.ok() && *k != nullptr ? PlanFor(p, **k).ws_bytes : 0;
}

uint32_t AttentionFormatBit(int32_t packed_format, int head_dim) {
  return 1u << ClassOf(packed_format, SmallOk(head_dim));
}

namespace internal {
absl::Status AttentionKernelFor(int head_dim, bool* tensor_cores) {
  TRIAX_ASSIGN_OR_RETURN(const MmaKernels* k, KernelsFor(head_dim));
  *tensor_cores = k != nullptr;
  return absl::OkStatus();
}
int AttentionClassOf(int32_t packed_format, int head_dim) {
  return ClassOf(packed_format, SmallOk(head_dim));
}
int AttentionSplitsFor(long long ctas, int ctas_per_sm, int sms) {
  return SplitsFor(ctas, ctas_per_sm, sms);
}
}  // namespace internal

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
  const int d = p.shape.head_dim;
  TRIAX_ASSIGN_OR_RETURN(const MmaKernels* kernels, KernelsFor(d));
  if (kernels == nullptr) return LaunchCudaCoreAttention(p, group);
  TRIAX_RETURN_IF_ERROR(kernels->ensure_tq_tables());
  const MmaPlan plan = PlanFor(p, *kernels);
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
    return RunMma(p, plan, *kernels, p.workspace);
  }
  void* ws = nullptr;
  cudaError_t e = cudaMallocAsync(&ws, plan.ws_bytes, p.stream);
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("attention workspace of ", plan.ws_bytes,
                     " bytes: ", cudaGetErrorString(e)));
  }
  const absl::Status s = RunMma(p, plan, *kernels, ws);
  e = cudaFreeAsync(ws, p.stream);
  TRIAX_RETURN_IF_ERROR(s);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("freeing attention workspace: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace triax::kernels::cuda
