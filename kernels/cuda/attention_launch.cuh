// Host launchers of the tensor-core kernels of one head_dim: the
// definitions of MmaAttention<kD> (attention_dispatch.h), included only by
// attention_hd<kD>.cu, which instantiates them. Occupancy queries and
// cudaFuncSetAttribute act on this file's instantiations, and Launch
// uploads this file's TQ tables before any launch.
//
// Launches (kernel configurations, class lists, CTAs per SM): with
// head_dim >= 64 the full kernel for classes 0 and 6 (2 CTAs per SM), the
// transposed kernel for 1-2 (INT4/INT2 keys) and 3-4 (FP8/INT8 keys), and
// its TQ variant for 5 and 7; below 64 the full kernel for 0 and 5-7.
// Grid: classes x sequences x row blocks x KV heads x splits.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/attention_dispatch.h"
#include "kernels/cuda/attention_kernel.cuh"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/launch_result.h"
#include "kernels/cuda/tq.cuh"

namespace triax::kernels::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

int SmCount() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  }
  return sms;
}

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

// Launches the classes of one configuration (n_classes x the CTAs of one
// class).
template <int kD, bool kSmall, int kCtas, bool kTq = false>
LaunchResult LaunchMmaConfig(const MmaArgs& a, long long class_ctas,
                             int n_classes, cudaStream_t stream) {
  using Sm = MmaSmem<kD, kSmall>;
  auto* kernel = &MmaAttentionKernel<kD, kSmall, kCtas, kTq>;
  if (Sm::kTotal > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sm::kTotal);
    if (e != cudaSuccess) {
      LaunchResult r;
      r.kind = LaunchResult::Kind::kSharedMemory;
      r.error = e;
      r.smem_bytes = Sm::kTotal;
      return r;
    }
  }
  kernel<<<static_cast<unsigned>(n_classes * class_ctas), kMmaWarps * 32,
           Sm::kTotal, stream>>>(a);
  return LastLaunch("DecodeAttentionCuda");
}

// MmaAttention<kD>::Launch's work: the configurations' launches between
// the partition and the reduce kernels (attention_dispatch.cu).
template <int kD>
LaunchResult LaunchMmaConfigs(const AttentionArgs& p, const MmaPlan& plan,
                              const MmaWorkspace& ws, uint32_t* launched_out) {
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
  a.cls_mask = ws.cls_mask;
  a.part_plan = ws.part_plan;
  a.ws_lse = ws.ws_lse;
  a.ws_o = ws.ws_o;
  const long long class_ctas = static_cast<long long>(p.batch) * p.shape.heads *
                               plan.row_blocks * plan.splits[0];
  // Launches whose classes the caller's formats_present leaves out are
  // skipped; `launched` tells the reduce which classes ran.
  const uint32_t want = p.formats_present != 0 ? p.formats_present : 0xffu;
  uint32_t& launched = *launched_out;
  launched = 0;
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
      if (LaunchResult r =
              LaunchMmaConfig<kD, false, 1>(a, class_ctas, 2, p.stream);
          !r.ok()) {
        return r;
      }
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
      if (LaunchResult r = LaunchMmaConfig<kD, true, kSmallCtas(kD, true)>(
              as, small_ctas * as.splits, 2, p.stream);
          !r.ok()) {
        return r;
      }
    }
    as.classes = ClassList(3, 4);
    as.splits = plan.splits[2];
    if (wanted(as.classes, 2)) {
      if (LaunchResult r = LaunchMmaConfig<kD, true, kSmallCtas(kD, false)>(
              as, small_ctas * as.splits, 2, p.stream);
          !r.ok()) {
        return r;
      }
    }
    as.classes = ClassList(5, 7);
    as.splits = plan.splits[3];
    if (wanted(as.classes, 2)) {
      if (LaunchResult r =
              LaunchMmaConfig<kD, true, kSmallCtas(kD, true), true>(
                  as, small_ctas * as.splits, 2, p.stream);
          !r.ok()) {
        return r;
      }
    }
  } else {
    a.classes = ClassList(0, 5, 6, 7);
    if (wanted(a.classes, 4)) {
      if (LaunchResult r =
              LaunchMmaConfig<kD, false, 1>(a, class_ctas, 4, p.stream);
          !r.ok()) {
        return r;
      }
    }
  }
  return LaunchResult{};
}

}  // namespace

template <int kD>
LaunchResult MmaAttention<kD>::EnsureTqTables() {
  return cuda::EnsureTqTables();
}

template <int kD>
Residency MmaAttention<kD>::QueryResidency() {
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

template <int kD>
LaunchResult MmaAttention<kD>::Launch(const AttentionArgs& p,
                                      const MmaPlan& plan,
                                      const MmaWorkspace& ws,
                                      uint32_t* launched) {
  // The dispatch uploaded the tables already (to keep their errors ahead of
  // the workspace's); this call, a no-op then, keeps any other path from
  // launching on this file's tables before their upload.
  if (LaunchResult r = cuda::EnsureTqTables(); !r.ok()) return r;
  return LaunchMmaConfigs<kD>(p, plan, ws, launched);
}

}  // namespace triax::kernels::cuda
