#include "tests/integration/reference.h"

#include <algorithm>
#include <cmath>

#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"

namespace triax::testing {

triax::v1::ModelShape SmallModel() {
  triax::v1::ModelShape m;
  m.set_name("it-small");
  m.set_n_layers(2);
  m.set_n_kv_heads(2);
  m.set_n_q_heads(4);
  m.set_head_dim(32);
  return m;
}

triax::v1::Span MakeSpan(triax::v1::Role role, uint32_t num_tokens) {
  triax::v1::Span s;
  s.set_role(role);
  s.set_modality(triax::v1::MODALITY_TEXT);
  s.set_num_tokens(num_tokens);
  return s;
}

std::vector<float> RandomVector(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(*rng);
  return x;
}

std::vector<float> RoundToBf16(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    y[i] = triax::kernels::Bf16ToFloat(triax::kernels::FloatToBf16(x[i]));
  }
  return y;
}

std::vector<double> ReferenceAttention(const triax::v1::ModelShape& model,
                                       const std::vector<float>& q,
                                       const std::vector<uint64_t>& positions,
                                       const std::vector<float>& k,
                                       const std::vector<float>& v) {
  const size_t hq = model.n_q_heads(), hk = model.n_kv_heads(),
               d = model.head_dim();
  const size_t group = hq / hk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(positions.size() * hq * d, 0.0);
  for (size_t i = 0; i < positions.size(); ++i) {
    const size_t n = positions[i] + 1;
    for (size_t h = 0; h < hq; ++h) {
      const size_t kh = h / group;
      const float* qv = &q[(i * hq + h) * d];
      std::vector<double> s(n);
      double mx = -INFINITY;
      for (size_t t = 0; t < n; ++t) {
        const float* kv = &k[(t * hk + kh) * d];
        double dot = 0;
        for (size_t j = 0; j < d; ++j) dot += double(qv[j]) * double(kv[j]);
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      double sum = 0;
      for (auto& x : s) {
        x = std::exp(x - mx);
        sum += x;
      }
      double* o = &out[(i * hq + h) * d];
      for (size_t t = 0; t < n; ++t) {
        const float* vv = &v[(t * hk + kh) * d];
        for (size_t j = 0; j < d; ++j) o[j] += s[t] / sum * double(vv[j]);
      }
    }
  }
  return out;
}

AttendTolerance ToleranceFor(const std::string& backend) {
  if (backend == "cpu") return AttendTolerance{1e-4, 1e-3, 2e-3};
  return AttendTolerance{3e-2, 3e-2, 1e-2};
}

double RelativeError(const std::vector<float>& a,
                     const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double diff = (i < a.size() ? double(a[i]) : 0.0) - b[i];
    if (std::isnan(diff)) return INFINITY;
    num += diff * diff;
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

double WorstToleranceRatio(const std::vector<float>& a,
                           const std::vector<double>& b, double atol,
                           double rtol) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double r =
        std::abs(double(a[i]) - b[i]) / (atol + rtol * std::abs(b[i]));
    if (std::isnan(r)) return INFINITY;
    worst = std::max(worst, r);
  }
  return worst;
}

absl::Status RoundTripPage(const kernels::Encoding& e,
                           const kernels::PageShape& shape, const float* k,
                           const float* v, int n, float* k_out, float* v_out) {
  if (const char* why = kernels::ValidateEncoding(e, shape)) {
    return absl::InvalidArgumentError(why);
  }
  const size_t elems = static_cast<size_t>(n) * shape.heads * shape.head_dim;
  std::vector<uint16_t> kb(elems), vb(elems);
  for (size_t i = 0; i < elems; ++i) {
    kb[i] = kernels::FloatToBf16(k[i]);
    vb[i] = kernels::FloatToBf16(v[i]);
  }
  std::vector<uint8_t> page(kernels::PageBytes(e, shape));
  kernels::EncodePage(e, shape, kb.data(), vb.data(), n, page.data());
  kernels::DecodePage(e, shape, page.data(), n, k_out, v_out);
  return absl::OkStatus();
}

}  // namespace triax::testing
