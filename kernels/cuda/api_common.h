// Host helpers that every entry point of kv_cuda.cuh uses: the shape
// requirements of kv_cuda.cuh (INVALID_ARGUMENT naming field and value) and
// the status of the last launch (INTERNAL with the CUDA error string).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {

inline constexpr int kMaxHeadDim = 256;

// 1 <= tokens <= 4096, heads >= 1, head_dim a multiple of 8 in [8, 256].
absl::Status ValidateShape(const PageShape& s);

// OK, or INTERNAL "<what> launch failed: <CUDA error>" for the last launch.
absl::Status LaunchStatus(const char* what);

inline bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace triax::kernels::cuda
