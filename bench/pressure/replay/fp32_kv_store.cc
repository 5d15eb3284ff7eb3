#include "bench/pressure/replay/fp32_kv_store.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"

namespace triax::bench::replay {
namespace {

// Dot product with eight partial sums, so the compiler vectorizes it
// without reassociating a single sum.
float Dot(const float* a, const float* b, int n) {
  float acc[8] = {};
  const int n8 = n & ~7;
  for (int i = 0; i < n8; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  for (int i = n8; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

Fp32KvStore::Fp32KvStore(const frontend::ModelConfig& c, int threads)
    : n_layers_(c.n_layers),
      n_heads_(c.n_heads),
      n_kv_heads_(c.n_kv_heads),
      head_dim_(c.head_dim()),
      threads_(std::clamp(threads, 1, 16)),
      k_(c.n_layers, std::vector<std::vector<float>>(c.n_kv_heads)),
      v_(c.n_layers, std::vector<std::vector<float>>(c.n_kv_heads)),
      written_(c.n_layers, 0) {}

absl::Status Fp32KvStore::Write(int layer, int64_t first_pos, int n,
                                const float* k, const float* v) {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer=", layer, "; the model has ", n_layers_));
  }
  if (n < 1 || first_pos != written_[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("write of n=", n, " tokens at first_pos=", first_pos,
                     " on layer ", layer, " with ", written_[layer],
                     " written; writes continue at the "
                     "written length"));
  }
  for (int h = 0; h < n_kv_heads_; ++h) {
    auto& kh = k_[layer][h];
    auto& vh = v_[layer][h];
    for (int t = 0; t < n; ++t) {
      const size_t off = (static_cast<size_t>(t) * n_kv_heads_ + h) * head_dim_;
      kh.insert(kh.end(), k + off, k + off + head_dim_);
      vh.insert(vh.end(), v + off, v + off + head_dim_);
    }
  }
  written_[layer] += n;
  return absl::OkStatus();
}

std::vector<double> Fp32KvStore::TakeMass() {
  int64_t longest = 0;
  for (int64_t w : written_) longest = std::max(longest, w);
  mass_.resize(static_cast<size_t>(longest), 0.0);
  std::vector<double> out(static_cast<size_t>(longest), 0.0);
  out.swap(mass_);
  return out;
}

void Fp32KvStore::AttendRange(int layer, int i0, int i1,
                              const int64_t* positions, const float* q,
                              float* out, double* mass) const {
  const int group = n_heads_ / n_kv_heads_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  std::vector<float> att;
  for (int i = i0; i < i1; ++i) {
    const int64_t pos = positions[i];
    att.resize(pos + 1);
    for (int h = 0; h < n_heads_; ++h) {
      const float* qh = q + (static_cast<size_t>(i) * n_heads_ + h) * head_dim_;
      const float* kh = k_[layer][h / group].data();
      const float* vh = v_[layer][h / group].data();
      float max_score = -INFINITY;
      for (int64_t t = 0; t <= pos; ++t) {
        att[t] = Dot(qh, kh + t * head_dim_, head_dim_) * scale;
        max_score = std::max(max_score, att[t]);
      }
      float sum = 0.0f;
      for (int64_t t = 0; t <= pos; ++t) {
        att[t] = std::exp(att[t] - max_score);
        sum += att[t];
      }
      float* oh = out + (static_cast<size_t>(i) * n_heads_ + h) * head_dim_;
      std::fill(oh, oh + head_dim_, 0.0f);
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t <= pos; ++t) {
        const float a = att[t] * inv;
        if (mass != nullptr) mass[t] += a;
        const float* vt = vh + t * head_dim_;
        for (int d = 0; d < head_dim_; ++d) oh[d] += a * vt[d];
      }
    }
  }
}

absl::Status Fp32KvStore::Attend(int layer, int n_queries,
                                 const int64_t* positions, const float* q,
                                 float* out) {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer=", layer, "; the model has ", n_layers_));
  }
  for (int i = 0; i < n_queries; ++i) {
    if (positions[i] < 0 || positions[i] >= written_[layer]) {
      return absl::OutOfRangeError(
          absl::StrCat("query position ", positions[i], " on layer ", layer,
                       " but ", written_[layer], " tokens written"));
    }
  }
  const int threads = std::max(1, std::min(threads_, n_queries));
  // One mass buffer per thread (positions up to the written length), summed
  // into mass_ after the join.
  std::vector<std::vector<double>> mass(track_mass_ ? threads : 0);
  for (auto& m : mass) m.assign(static_cast<size_t>(written_[layer]), 0.0);
  auto mass_of = [&](int k) { return track_mass_ ? mass[k].data() : nullptr; };
  std::vector<std::thread> pool;
  const int per = (n_queries + threads - 1) / threads;
  for (int k = 1; k < threads; ++k) {
    const int i0 = k * per, i1 = std::min(n_queries, i0 + per);
    if (i0 >= i1) break;
    double* m = mass_of(k);
    pool.emplace_back(
        [=] { AttendRange(layer, i0, i1, positions, q, out, m); });
  }
  AttendRange(layer, 0, std::min(n_queries, per), positions, q, out,
              mass_of(0));
  for (auto& t : pool) t.join();
  if (track_mass_) {
    if (mass_.size() < static_cast<size_t>(written_[layer])) {
      mass_.resize(static_cast<size_t>(written_[layer]), 0.0);
    }
    for (const auto& m : mass) {
      for (size_t t = 0; t < m.size(); ++t) mass_[t] += m[t];
    }
  }
  return absl::OkStatus();
}

}  // namespace triax::bench::replay
