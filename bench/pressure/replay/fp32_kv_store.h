// The replay's reference KV: an in-process fp32 cache with exact causal
// attention, the same math as frontend::LocalKvStore (scores scaled by
// 1/sqrt(head_dim), softmax in fp32, query head h reads KV head
// h / (n_heads / n_kv_heads)) with a layout and loops that vectorize, and
// the queries of a chunk split across threads. Sums are taken in another
// order than LocalKvStore, so results agree to fp32 rounding (~1e-6
// relative), not bit for bit.
//
// Layout: per layer and KV head, keys and values [pos][head_dim], contiguous.
// Errors: INVALID_ARGUMENT (layer out of range, n < 1, a write that is not
// at the written length: no holes, no rewrites), OUT_OF_RANGE (a query
// position not written yet).
// Attention mass: with TrackMass(true), every Attend adds each attention
// row's softmax weights (one row per query, head and layer; each row sums
// to 1) to a per-position total that TakeMass returns and clears: the mass
// that the queries since the last TakeMass put on each earlier token.
//
// Thread contract: thread-compatible (one forward pass at a time); Attend
// runs its own worker threads and joins them before returning.
#pragma once

#include <cstdint>
#include <vector>

#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"

namespace triax::bench::replay {

class Fp32KvStore : public frontend::KvStore {
 public:
  // `threads` in 1..16 (clamped).
  Fp32KvStore(const frontend::ModelConfig& config, int threads);

  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override;
  absl::Status Attend(int layer, int n_queries, const int64_t* positions,
                      const float* q, float* out) override;
  int64_t written(int layer) const { return written_[layer]; }

  void TrackMass(bool on) { track_mass_ = on; }
  // The mass per token position [0, longest written layer) since the last
  // call (zeros where nothing attended), and clears it.
  std::vector<double> TakeMass();

 private:
  // Queries [i0, i1) of one Attend; adds the softmax weights to `mass`
  // (indexed by position) when it is not null.
  void AttendRange(int layer, int i0, int i1, const int64_t* positions,
                   const float* q, float* out, double* mass) const;

  int n_layers_, n_heads_, n_kv_heads_, head_dim_, threads_;
  // [layer][kv_head] -> [pos][head_dim]
  std::vector<std::vector<std::vector<float>>> k_, v_;
  std::vector<int64_t> written_;
  bool track_mass_ = false;
  std::vector<double> mass_;
};

}  // namespace triax::bench::replay
