// TRIAX_HOST_DEVICE marks a function that the CUDA kernels call as well as
// host code: `__host__ __device__` when nvcc compiles the file, nothing for
// a plain C++ compiler. Such functions are defined in headers (inline or
// constexpr), so that one definition serves the CPU reference, host code and
// the device; kernels/ref and every other non-CUDA target build without
// nvcc.
#pragma once

//
// TRIAX_HOST_DEVICE_FORCEINLINE adds __forceinline__ on the device (plain
// inline for the host): for the small predicates and converters the kernels
// call per page, tile or element, which they always inlined; left to nvcc's
// inliner they are inlined later and the kernels' code changes.
#if defined(__CUDACC__)
#define TRIAX_HOST_DEVICE __host__ __device__
#define TRIAX_HOST_DEVICE_FORCEINLINE __host__ __device__ __forceinline__
#else
#define TRIAX_HOST_DEVICE
#define TRIAX_HOST_DEVICE_FORCEINLINE inline
#endif

namespace triax::kernels {

// min(a, b) of two ints: the device's min() builtin (what the kernels have
// always used; a select written out compiles differently), std::min's value
// on the host.
TRIAX_HOST_DEVICE_FORCEINLINE int MinInt(int a, int b) {
#if defined(__CUDA_ARCH__)
  return min(a, b);
#else
  return b < a ? b : a;
#endif
}

}  // namespace triax::kernels
