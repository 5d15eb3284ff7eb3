// fp32 Llama forward pass (llama2.c run.c semantics) over a chunk of tokens,
// with attention delegated to a KvStore, plus next-token NLL helpers.
//
// Per layer and chunk: RMSNorm (eps 1e-5) -> q, k, v -> RoPE (theta 10000,
// interleaved pairs (2i, 2i+1) of each head, as run.c) -> KvStore::Write(k, v)
// -> KvStore::Attend(q) -> wo -> residual -> RMSNorm -> SwiGLU FFN ->
// residual; then the final RMSNorm and the classifier.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/frontend/llama2c.h"

namespace triax::frontend {

// Where a forward pass keeps K/V and runs attention.
// Tensors are float32, token-major:
//   k, v:     [n][n_kv_heads][head_dim]  (keys after RoPE)
//   q, out:   [n_queries][n_q_heads][head_dim]
// Query i attends causally to tokens [0, positions[i]], scaled by
// 1/sqrt(head_dim); query head h reads KV head h / (n_q_heads / n_kv_heads).
// The forward pass calls Write(layer, ...) and then Attend(layer, ...) for
// the same chunk, layer by layer.
class KvStore {
 public:
  virtual ~KvStore() = default;
  virtual absl::Status Write(int layer, int64_t first_pos, int n,
                             const float* k, const float* v) = 0;
  virtual absl::Status Attend(int layer, int n_queries,
                              const int64_t* positions, const float* q,
                              float* out) = 0;
};

// The reference: an in-process fp32 cache with exact causal attention.
// Thread-compatible (one forward pass at a time).
class LocalKvStore : public KvStore {
 public:
  LocalKvStore(const ModelConfig& config);
  // INVALID_ARGUMENT: layer out of range, n < 1, first_pos < 0 or beyond the
  // written length (writes must not leave holes).
  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override;
  // OUT_OF_RANGE: a position not yet written; INVALID_ARGUMENT: bad layer.
  absl::Status Attend(int layer, int n_queries, const int64_t* positions,
                      const float* q, float* out) override;
  int64_t written(int layer) const { return written_[layer]; }

 private:
  int n_layers_, n_heads_, n_kv_heads_, head_dim_;
  std::vector<std::vector<float>> k_, v_;  // [layer][pos][kv_dim]
  std::vector<int64_t> written_;
};

// Runs chunks through a model. Owns scratch buffers; thread-compatible.
// `num_threads` (1..16) splits the matrix products by output rows.
class Transformer {
 public:
  explicit Transformer(const Model* model, int num_threads = 1);

  // Processes tokens[0..n) at positions pos0..pos0+n-1 and writes logits
  // [n][vocab] into *logits (resized). INVALID_ARGUMENT for an empty chunk, a
  // token id outside the vocabulary or a position past max_seq_len; the
  // KvStore's errors pass through with the layer named.
  absl::Status Forward(absl::Span<const int> tokens, int64_t pos0, KvStore* kv,
                       std::vector<float>* logits);

  // Forward over `tokens` in chunks of at most `chunk` tokens from pos0.
  absl::Status Prefill(absl::Span<const int> tokens, int64_t pos0, int chunk,
                       KvStore* kv, std::vector<float>* logits);

  const Model& model() const { return *model_; }

 private:
  void MatMul(const float* w, int out_dim, int in_dim, const float* x, int n,
              float* y);

  const Model* model_;
  int num_threads_;
  std::vector<float> x_, xb_, q_, k_, v_, att_, hb_, hb2_;
};

// -log softmax(logits)[target], computed in double.
double TokenNll(const float* logits, int vocab, int target);

// Index of the largest logit (the first one on ties, as run.c's argmax).
int Argmax(const float* logits, int vocab);

struct NllResult {
  double sum = 0;     // nats
  int64_t count = 0;  // predicted tokens
  double mean() const { return count ? sum / count : 0.0; }
};

}  // namespace triax::frontend
