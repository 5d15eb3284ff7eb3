// The seam between decode attention's one dispatch (attention_dispatch.cu:
// validation, plan, workspace, partition and reduce kernels) and the
// kernels compiled per head_dim in their own .cu files, so that nvcc builds
// them in parallel:
//   attention_hd<D>.cu  explicit instantiation of MmaAttention<D> (the
//                       tensor-core kernels), one per MmaHeadDims entry;
//   attention_fallback.cu  the CUDA-core kernel for the other head_dims.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {

template <int... kDs>
struct HeadDimList {
  static constexpr bool Contains(int d) { return ((d == kDs) || ...); }
};
// The head_dims with tensor-core kernels: the one list that the dispatch
// table, MmaAttention's static_assert and the attention_hd<D>.cu files
// follow (a listed head_dim without its file fails to link).
using MmaHeadDims = HeadDimList<16, 32, 64, 128, 256>;

// The tensor-core kernels of head_dim kD (attention_launch.cuh), explicitly
// instantiated in attention_hd<kD>.cu. Each of those files holds its own
// copy of the TQ tables (tq.cuh).
template <int kD>
struct MmaAttention {
  static_assert(MmaHeadDims::Contains(kD), "kD is not in MmaHeadDims");
  // Uploads this file's TQ tables to the current device (once per device).
  static absl::Status EnsureTqTables();
  // CTAs per SM of each launch configuration (occupancy calculator).
  static Residency QueryResidency();
  // Launches the configurations of p.formats_present (all when 0) on ws,
  // after PartitionKernel; *launched gets the classes they cover.
  static absl::Status Launch(const AttentionParams& p, const MmaPlan& plan,
                             const MmaWorkspace& ws, uint32_t* launched);
};

// The CUDA-core kernel for head_dims without tensor-core kernels
// (multiples of 8 in [8, 256]): one CTA per (sequence, KV head), no
// workspace; p validated, group = n_q_heads / heads.
absl::Status LaunchCudaCoreAttention(const AttentionParams& p, int group);

}  // namespace triax::kernels::cuda
