// Host helpers that every entry point of kv_cuda.cuh uses (.cc files):
// the shape requirements of kv_cuda.cuh (INVALID_ARGUMENT naming field and
// value) and the status of a launcher's LaunchResult (INTERNAL with the
// CUDA error string).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/launch_result.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {

// 1 <= tokens <= 4096, heads >= 1, head_dim a multiple of 8 in
// [8, kMaxHeadDim].
absl::Status ValidateShape(const PageShape& s);

// OK, or the INTERNAL error launch_result.h lists for r.
absl::Status ToStatus(const LaunchResult& r);

inline bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace triax::kernels::cuda
