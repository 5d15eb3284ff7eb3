#include "kernels/tq_codebook.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

namespace triax::kernels {
namespace {

constexpr int kMinLog = 4;  // d = 16
constexpr int kMaxLog = 8;  // d = 256
constexpr int kNumDims = kMaxLog - kMinLog + 1;

// Index of d in 16..256 (powers of two), or -1.
int DimIndex(int d) {
  for (int i = 0; i < kNumDims; ++i) {
    if (d == (1 << (kMinLog + i))) return i;
  }
  return -1;
}

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct SignTable {
  std::once_flag once;
  int8_t signs[256];
};

SignTable& Signs(int idx) {
  static SignTable tables[kNumDims];
  return tables[idx];
}

// Lloyd-Max quantizer with `levels` levels for the density
// f(x) ~ (1 - x^2)^((d - 3) / 2) on [-1, 1], on a uniform grid of 2^18 + 1
// points (cell masses by the midpoint rule, in double). Prefix sums of mass
// and first moment make each iteration O(levels * log grid).
void LloydMax(int levels, int d, float* out) {
  constexpr int kGrid = 1 << 18;
  const double step = 2.0 / kGrid;
  const double expo = (d - 3) / 2.0;
  std::vector<double> xs(kGrid), cum_w(kGrid + 1, 0.0), cum_wx(kGrid + 1, 0.0);
  for (int i = 0; i < kGrid; ++i) {
    const double x = -1.0 + (i + 0.5) * step;
    const double w = std::exp(expo * std::log1p(-x * x));
    xs[i] = x;
    cum_w[i + 1] = cum_w[i] + w;
    cum_wx[i + 1] = cum_wx[i] + w * x;
  }
  // Start from uniform levels over +-3 standard deviations (sigma^2 = 1/d).
  const double sigma = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> c(levels), next(levels);
  for (int i = 0; i < levels; ++i) {
    c[i] = sigma * (-3.0 + 6.0 * (i + 0.5) / levels);
  }
  // First grid index whose point is >= t.
  auto index_of = [&](double t) {
    return static_cast<int>(std::lower_bound(xs.begin(), xs.end(), t) -
                            xs.begin());
  };
  for (int iter = 0; iter < 20000; ++iter) {
    double change = 0;
    int lo = 0;
    for (int i = 0; i < levels; ++i) {
      const int hi = i + 1 < levels ? index_of(0.5 * (c[i] + c[i + 1])) : kGrid;
      const double w = cum_w[hi] - cum_w[lo];
      next[i] = w > 0 ? (cum_wx[hi] - cum_wx[lo]) / w : c[i];
      lo = hi;
    }
    // Symmetrize: the density is even, so the optimum is too.
    for (int i = 0; i < levels; ++i) {
      const double s = 0.5 * (next[i] - next[levels - 1 - i]);
      change = std::max(change, std::fabs(s - c[i]));
      c[i] = s;
    }
    if (change < 1e-13 * sigma) break;
  }
  for (int i = 0; i < levels; ++i) out[i] = static_cast<float>(c[i]);
}

struct CodebookTable {
  std::once_flag once;
  float levels[16];
};

CodebookTable& Codebook(int bits_idx, int dim_idx) {
  static CodebookTable tables[3][kNumDims];
  return tables[bits_idx][dim_idx];
}

// Unnormalized fast Walsh-Hadamard transform (Sylvester order).
void Fwht(int d, float* x) {
  for (int len = 1; len < d; len <<= 1) {
    for (int i = 0; i < d; i += len << 1) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
}

}  // namespace

const int8_t* TqSigns(int d) {
  const int idx = DimIndex(d);
  if (idx < 0) return nullptr;
  SignTable& t = Signs(idx);
  std::call_once(t.once, [&t, d] {
    uint64_t state = 0x7472696178b1e55eull ^
                     (static_cast<uint64_t>(d) * 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < d; ++i) {
      t.signs[i] = (SplitMix64(&state) >> 63) ? -1 : 1;
    }
  });
  return t.signs;
}

const float* TqCodebook(int bits, int d) {
  const int idx = DimIndex(d);
  if (idx < 0 || bits < 2 || bits > 4) return nullptr;
  CodebookTable& t = Codebook(bits - 2, idx);
  std::call_once(t.once, [&t, bits, d] { LloydMax(1 << bits, d, t.levels); });
  return t.levels;
}

void TqRotate(int d, float* x) {
  const int8_t* s = TqSigns(d);
  for (int i = 0; i < d; ++i) x[i] *= s[i];
  Fwht(d, x);
  const float norm = 1.f / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= norm;
}

void TqRotateInverse(int d, float* x) {
  const int8_t* s = TqSigns(d);
  Fwht(d, x);
  const float norm = 1.f / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= norm * s[i];
}

}  // namespace triax::kernels
