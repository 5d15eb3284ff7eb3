// Test helpers shared by the CPU reference tests and the CUDA tests: random
// BF16 data, float64 attention oracles and error metrics. Header-only; not for
// production code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/layout.h"
#include "kernels/numeric.h"

namespace triax::kernels::testing {

// True when a[0..n) and b[0..n) hold the same bit patterns (NaNs and signed
// zeros included): the bit-identity tests assert.
inline bool SameBits(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    if (x != y) return false;
  }
  return true;
}

// Gaussian N(0, sigma) values rounded to BF16.
inline std::vector<uint16_t> RandomBf16(std::mt19937& rng, size_t n,
                                        float sigma = 1.f) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = FloatToBf16(dist(rng));
  return out;
}

inline std::vector<float> RandomFloat(std::mt19937& rng, size_t n,
                                      float sigma = 1.f) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

inline std::vector<float> Bf16VecToFloat(const std::vector<uint16_t>& in) {
  std::vector<float> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = Bf16ToFloat(in[i]);
  return out;
}

// Float64 decode attention over contiguous token-major K/V
// ([tokens][H][D]), first `attend` tokens. q/out: [n_q_heads][D].
inline std::vector<double> AttentionF64(const std::vector<float>& q,
                                        const std::vector<float>& k,
                                        const std::vector<float>& v,
                                        int n_q_heads, int H, int D,
                                        long attend, double scale) {
  const int group = n_q_heads / H;
  std::vector<double> out(static_cast<size_t>(n_q_heads) * D, 0.0);
  std::vector<double> s(attend);
  for (int qh = 0; qh < n_q_heads; ++qh) {
    const int h = qh / group;
    double mx = -INFINITY;
    for (long t = 0; t < attend; ++t) {
      double dot = 0;
      for (int d = 0; d < D; ++d) {
        dot += static_cast<double>(q[static_cast<size_t>(qh) * D + d]) *
               k[(static_cast<size_t>(t) * H + h) * D + d];
      }
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double l = 0;
    for (long t = 0; t < attend; ++t) {
      s[t] = std::exp(s[t] - mx);
      l += s[t];
    }
    for (long t = 0; t < attend; ++t) {
      for (int d = 0; d < D; ++d) {
        out[static_cast<size_t>(qh) * D + d] +=
            s[t] / l * v[(static_cast<size_t>(t) * H + h) * D + d];
      }
    }
  }
  return out;
}

struct ErrorStats {
  double max_abs = 0;  // max |got - want|
  double rel_l2 = 0;   // ||got - want|| / ||want||
  double norm = 0;     // ||got||
  bool all_finite = true;
};

inline ErrorStats Compare(const float* got, const std::vector<double>& want) {
  ErrorStats e;
  double diff2 = 0, want2 = 0, got2 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) e.all_finite = false;
    const double d = got[i] - want[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
    diff2 += d * d;
    want2 += want[i] * want[i];
    got2 += static_cast<double>(got[i]) * got[i];
  }
  e.rel_l2 = std::sqrt(diff2 / std::max(want2, 1e-300));
  e.norm = std::sqrt(got2);
  if (!e.all_finite) e.max_abs = e.rel_l2 = INFINITY;
  return e;
}

}  // namespace triax::kernels::testing
