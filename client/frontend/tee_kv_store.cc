#include "client/frontend/tee_kv_store.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace triax::frontend {

TeeKvStore::TeeKvStore(KvStore* primary, std::vector<KvStore*> secondaries,
                       int n_layers, int q_dim, int query_stride)
    : primary_(primary),
      secondaries_(std::move(secondaries)),
      n_layers_(n_layers),
      q_dim_(q_dim),
      query_stride_(std::max(1, query_stride)),
      errors_(secondaries_.size(),
              std::vector<LayerError>(std::max(0, n_layers))) {}

namespace {
absl::Status Prefixed(const absl::Status& s, size_t i) {
  return absl::Status(s.code(),
                      absl::StrCat("tee secondary ", i, ": ", s.message()));
}
}  // namespace

absl::Status TeeKvStore::Write(int layer, int64_t first_pos, int n,
                               const float* k, const float* v) {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("tee: layer = ", layer, ", model has ", n_layers_));
  }
  if (absl::Status s = primary_->Write(layer, first_pos, n, k, v); !s.ok()) {
    return s;
  }
  for (size_t i = 0; i < secondaries_.size(); ++i) {
    absl::Status s = secondaries_[i]->Write(layer, first_pos, n, k, v);
    if (!s.ok()) return Prefixed(s, i);
  }
  return absl::OkStatus();
}

absl::Status TeeKvStore::Attend(int layer, int n_queries,
                                const int64_t* positions, const float* q,
                                float* out) {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("tee: layer = ", layer, ", model has ", n_layers_));
  }
  if (absl::Status s = primary_->Attend(layer, n_queries, positions, q, out);
      !s.ok()) {
    return s;
  }
  if (secondaries_.empty() || n_queries < 1) return absl::OkStatus();
  sel_index_.clear();
  sel_positions_.clear();
  for (int i = 0; i < n_queries; ++i) {
    if (positions[i] % query_stride_ == 0 || i == n_queries - 1) {
      sel_index_.push_back(i);
      sel_positions_.push_back(positions[i]);
    }
  }
  const int m = static_cast<int>(sel_index_.size());
  const size_t qd = static_cast<size_t>(q_dim_);
  sel_q_.resize(m * qd);
  sel_out_.resize(m * qd);
  for (int j = 0; j < m; ++j) {
    std::copy_n(q + sel_index_[j] * qd, qd, sel_q_.data() + j * qd);
  }
  for (size_t i = 0; i < secondaries_.size(); ++i) {
    absl::Status s = secondaries_[i]->Attend(layer, m, sel_positions_.data(),
                                             sel_q_.data(), sel_out_.data());
    if (!s.ok()) return Prefixed(s, i);
    LayerError& e = errors_[i][layer];
    for (int j = 0; j < m; ++j) {
      const float* ref = out + sel_index_[j] * qd;
      const float* got = sel_out_.data() + j * qd;
      for (size_t d = 0; d < qd; ++d) {
        const double diff = static_cast<double>(got[d]) - ref[d];
        e.sum_sq_diff += diff * diff;
        e.sum_sq_ref += static_cast<double>(ref[d]) * ref[d];
      }
    }
    e.queries += m;
  }
  return absl::OkStatus();
}

double TeeKvStore::RelativeError(int secondary, int layer) const {
  const LayerError& e = errors_[secondary][layer];
  if (e.queries == 0 || e.sum_sq_ref <= 0) return 0.0;
  return std::sqrt(e.sum_sq_diff / e.sum_sq_ref);
}

}  // namespace triax::frontend
