// A KvStore that drives a forward pass with one store (the primary) and
// mirrors every write into other stores (the secondaries), so attention over
// differently encoded copies of the SAME K/V can be compared with the SAME
// queries, layer by layer, without errors compounding through the network.
//
// Write(layer, ...) goes to the primary, then to each secondary in order.
// Attend(layer, ...) returns the primary's output. Each secondary then runs
// Attend for a sample of the chunk's queries: query i is sampled when
// positions[i] % query_stride == 0 or i is the chunk's last query (always at
// least one, so a secondary that sends its staged writes with the next
// Attend, like ServiceKvStore, is always flushed). For each secondary and
// layer it accumulates, over the sampled queries and every query head,
//   sum_sq_diff = sum ||out_secondary - out_primary||^2
//   sum_sq_ref  = sum ||out_primary||^2
// and RelativeError(s, layer) = sqrt(sum_sq_diff / sum_sq_ref) (0 when no
// query was sampled or the reference is all zeros).
//
// Shapes as KvStore: out/q [n_queries][q_dim]; q_dim = n_q_heads * head_dim.
// Errors: a failing store's status is returned, with "tee secondary <i>: "
// prefixed for a secondary; INVALID_ARGUMENT for a layer outside
// [0, n_layers) (checked before any store is touched).
// Thread contract: thread-compatible (one forward pass at a time); the
// stores are not owned and must outlive this object.
#pragma once

#include <cstdint>
#include <vector>

#include "client/frontend/forward.h"

namespace triax::frontend {

class TeeKvStore : public KvStore {
 public:
  struct LayerError {
    double sum_sq_diff = 0;
    double sum_sq_ref = 0;
    int64_t queries = 0;  // sampled queries compared
  };

  // query_stride >= 1 (values below 1 are taken as 1).
  TeeKvStore(KvStore* primary, std::vector<KvStore*> secondaries, int n_layers,
             int q_dim, int query_stride = 1);

  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override;
  absl::Status Attend(int layer, int n_queries, const int64_t* positions,
                      const float* q, float* out) override;

  int num_secondaries() const { return static_cast<int>(secondaries_.size()); }
  const LayerError& error(int secondary, int layer) const {
    return errors_[secondary][layer];
  }
  double RelativeError(int secondary, int layer) const;

 private:
  KvStore* primary_;
  std::vector<KvStore*> secondaries_;
  int n_layers_;
  int q_dim_;
  int query_stride_;
  std::vector<std::vector<LayerError>> errors_;  // [secondary][layer]
  std::vector<int64_t> sel_positions_;
  std::vector<int> sel_index_;
  std::vector<float> sel_q_, sel_out_;
};

}  // namespace triax::frontend
