// The seam between decode attention's host code (attention_dispatch.cc:
// validation, the one head_dim dispatch, plan, workspace) and the .cu files
// with its kernels, which nvcc builds in parallel:
//   attention_hd<D>.cu     explicit instantiation of MmaAttention<D> (the
//                          tensor-core kernels), one per MmaHeadDims entry;
//   attention_split_k.cu   PartitionKernel before them, ReduceKernel after;
//   attention_fallback.cu  the CUDA-core kernel for the other head_dims.
// No absl here (see launch_result.h): launchers report a LaunchResult.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/device_page.h"
#include "kernels/cuda/launch_result.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {

template <int... kDs>
struct HeadDimList {
  static constexpr bool Contains(int d) { return ((d == kDs) || ...); }
};
// The head_dims with tensor-core kernels: the one list that the dispatch
// table, MmaAttention's static_assert and the attention_hd<D>.cu files
// follow (a listed head_dim without its file fails to link).
using MmaHeadDims = HeadDimList<16, 32, 64, 128, 256>;

// What the kernels' launchers take of AttentionParams (validated; same
// meaning).
struct AttentionArgs {
  PageShape shape;
  int batch = 0;
  int n_q_heads = 0;
  float scale = 0.f;
  const float* q = nullptr;
  float* out = nullptr;
  const DevicePage* pages = nullptr;
  const int32_t* page_indptr = nullptr;
  const int32_t* attend_tokens = nullptr;
  uint32_t formats_present = 0;
  int pages_per_share = 0;
  cudaStream_t stream = nullptr;
};

// The tensor-core kernels of head_dim kD (attention_launch.cuh), explicitly
// instantiated in attention_hd<kD>.cu. Each of those files holds its own
// copy of the TQ tables (tq.cuh).
template <int kD>
struct MmaAttention {
  static_assert(MmaHeadDims::Contains(kD), "kD is not in MmaHeadDims");
  // Uploads this file's TQ tables to the current device (once per device).
  static LaunchResult EnsureTqTables();
  // CTAs per SM of each launch configuration (occupancy calculator).
  static Residency QueryResidency();
  // Launches the configurations of a.formats_present (all when 0) on ws,
  // after LaunchPartition; *launched gets the classes they cover.
  static LaunchResult Launch(const AttentionArgs& a, const MmaPlan& plan,
                             const MmaWorkspace& ws, uint32_t* launched);
};

// attention_split_k.cu: PartitionKernel (one CTA per sequence: the shares
// of each class's pages, ws.part_plan and ws.cls_mask) and ReduceKernel
// (one CTA per query head: merges the partials of the `launched` classes
// into a.out).
LaunchResult LaunchPartition(const AttentionArgs& a, const MmaPlan& plan,
                             const MmaWorkspace& ws);
LaunchResult LaunchReduce(const AttentionArgs& a, const MmaPlan& plan,
                          const MmaWorkspace& ws, uint32_t launched);

// attention_fallback.cu: the CUDA-core kernel for head_dims without
// tensor-core kernels (multiples of 8 in [8, 256]): one CTA per (sequence,
// KV head), no workspace; group = n_q_heads / heads.
LaunchResult LaunchCudaCoreAttention(const AttentionArgs& a, int group);

}  // namespace triax::kernels::cuda
