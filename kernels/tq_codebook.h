// Fixed data of the rotated TQ formats (layout.h), shared by the CPU
// reference and the CUDA kernels (which upload these tables).
#pragma once

#include <cstdint>

namespace triax::kernels {

// The +-1 sign sequence of length d (a power of two, 16..256) applied before
// the Hadamard transform: deterministic (splitmix64 from a fixed seed mixed
// with d), identical on every platform. Thread-safe; the array lives forever.
const int8_t* TqSigns(int d);

// The 2^bits Lloyd-Max reconstruction levels (ascending, float32) for one
// coordinate of a uniformly random unit vector in R^d, whose density is
// proportional to (1 - x^2)^((d - 3) / 2) on [-1, 1]. bits in {2, 3, 4}.
// Computed once per (bits, d) by Lloyd iteration on a fine grid; thread-safe.
const float* TqCodebook(int bits, int d);

// In-place orthonormal rotation y = R x with R = H_d diag(signs) / sqrt(d),
// and its inverse x = R^T y = diag(signs) H_d y / sqrt(d).
void TqRotate(int d, float* x);
void TqRotateInverse(int d, float* x);

}  // namespace triax::kernels
