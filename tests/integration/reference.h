// Test-side math for integration tests: random K/V, BF16 rounding and a
// float64 decode-attention oracle. Layouts as in worker.proto:
//   K, V: float32 [num_tokens][n_kv_heads][head_dim]
//   q, out: float32 [num_queries][n_q_heads][head_dim]
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/layout.h"
#include "triax/v1/types.pb.h"

namespace triax::testing {

// The model every integration test uses: 2 layers, GQA group 2, odd-free
// but small sizes so a test runs in milliseconds of compute.
triax::v1::ModelShape SmallModel();

triax::v1::Span MakeSpan(triax::v1::Role role, uint32_t num_tokens);

// Values ~ N(0, 1) from `rng`.
std::vector<float> RandomVector(size_t n, std::mt19937* rng);

// Each value rounded to the nearest BF16 (what the worker stores).
std::vector<float> RoundToBf16(const std::vector<float>& x);

// Decode attention in float64 for queries at `positions` (query i attends to
// tokens [0, positions[i]]), scale 1/sqrt(head_dim). Returns out as float64.
std::vector<double> ReferenceAttention(const triax::v1::ModelShape& model,
                                       const std::vector<float>& q,
                                       const std::vector<uint64_t>& positions,
                                       const std::vector<float>& k,
                                       const std::vector<float>& v);

// Written tolerances of a worker's Attend against the float64 reference over
// the values its pages decode to, per backend: "cpu" computes in float32
// (kernels/ref); "cuda" on tensor cores with BF16/FP16 operands and FP32
// accumulation (kernels_cuda_test's bound: max_abs <= 3e-2). Unknown
// backends get the CUDA (looser) bounds.
struct AttendTolerance {
  double atol;      // for WorstToleranceRatio
  double rtol;      //   "
  double relative;  // bound on RelativeError
};
AttendTolerance ToleranceFor(const std::string& backend);

// ||a - b||_2 / ||b||_2 (a float32 output against a float64 reference).
double RelativeError(const std::vector<float>& a, const std::vector<double>& b);
// max_i |a_i - b_i| / (atol + rtol * |b_i|); <= 1 means within tolerance.
double WorstToleranceRatio(const std::vector<float>& a,
                           const std::vector<double>& b, double atol,
                           double rtol);

// Encodes `n` tokens (float32 [n][H][D], rounded to BF16 first) into one page
// of `e` with the CPU reference and decodes them back into k_out / v_out:
// the exact values a worker serves for a sealed page. INVALID_ARGUMENT when
// the encoding is invalid for the shape.
absl::Status RoundTripPage(const kernels::Encoding& e,
                           const kernels::PageShape& shape, const float* k,
                           const float* v, int n, float* k_out, float* v_out);

}  // namespace triax::testing
