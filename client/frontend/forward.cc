#include "client/frontend/forward.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"

namespace triax::frontend {

// ---------------------------------------------------------------------------
// LocalKvStore

LocalKvStore::LocalKvStore(const ModelConfig& c)
    : n_layers_(c.n_layers),
      n_heads_(c.n_heads),
      n_kv_heads_(c.n_kv_heads),
      head_dim_(c.head_dim()),
      k_(c.n_layers),
      v_(c.n_layers),
      written_(c.n_layers, 0) {}

absl::Status LocalKvStore::Write(int layer, int64_t first_pos, int n,
                                 const float* k, const float* v) {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer = ", layer, ", model has ", n_layers_));
  }
  if (n < 1 || first_pos < 0 || first_pos > written_[layer]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "write of n = ", n, " tokens at first_pos = ", first_pos, " on layer ",
        layer, " with ", written_[layer], " written"));
  }
  const size_t kv_dim = static_cast<size_t>(n_kv_heads_) * head_dim_;
  const size_t end = static_cast<size_t>(first_pos + n) * kv_dim;
  if (k_[layer].size() < end) {
    k_[layer].resize(end);
    v_[layer].resize(end);
  }
  std::copy(k, k + n * kv_dim, k_[layer].begin() + first_pos * kv_dim);
  std::copy(v, v + n * kv_dim, v_[layer].begin() + first_pos * kv_dim);
  written_[layer] = std::max<int64_t>(written_[layer], first_pos + n);
  return absl::OkStatus();
}

absl::Status LocalKvStore::Attend(int layer, int n_queries,
                                  const int64_t* positions, const float* q,
                                  float* out) {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer = ", layer, ", model has ", n_layers_));
  }
  const int kv_dim = n_kv_heads_ * head_dim_;
  const int group = n_heads_ / n_kv_heads_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  std::vector<float> att;
  for (int i = 0; i < n_queries; ++i) {
    const int64_t pos = positions[i];
    if (pos < 0 || pos >= written_[layer]) {
      return absl::OutOfRangeError(
          absl::StrCat("query position ", pos, " on layer ", layer, " but ",
                       written_[layer], " tokens written"));
    }
    att.resize(pos + 1);
    for (int h = 0; h < n_heads_; ++h) {
      const float* qh = q + (static_cast<size_t>(i) * n_heads_ + h) * head_dim_;
      const int kvh = h / group;
      float max_score = -INFINITY;
      for (int64_t t = 0; t <= pos; ++t) {
        const float* kt = k_[layer].data() + t * kv_dim +
                          static_cast<int64_t>(kvh) * head_dim_;
        float s = 0.0f;
        for (int d = 0; d < head_dim_; ++d) s += qh[d] * kt[d];
        s *= scale;
        att[t] = s;
        max_score = std::max(max_score, s);
      }
      float sum = 0.0f;
      for (int64_t t = 0; t <= pos; ++t) {
        att[t] = std::exp(att[t] - max_score);
        sum += att[t];
      }
      float* oh = out + (static_cast<size_t>(i) * n_heads_ + h) * head_dim_;
      std::fill(oh, oh + head_dim_, 0.0f);
      for (int64_t t = 0; t <= pos; ++t) {
        const float a = att[t] / sum;
        const float* vt = v_[layer].data() + t * kv_dim +
                          static_cast<int64_t>(kvh) * head_dim_;
        for (int d = 0; d < head_dim_; ++d) oh[d] += a * vt[d];
      }
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Transformer

namespace {

void RmsNorm(float* o, const float* x, const float* w, int size) {
  float ss = 0.0f;
  for (int j = 0; j < size; ++j) ss += x[j] * x[j];
  ss /= size;
  ss += 1e-5f;
  ss = 1.0f / std::sqrt(ss);
  for (int j = 0; j < size; ++j) o[j] = w[j] * (ss * x[j]);
}

// Every y[t][o] = sum_i w[o][i] x[t][i] is summed in one fixed order: eight
// lane sums over i = j (mod 8) for the multiple-of-8 part, the lanes added
// 0..7, then the tail in order. The tiling below only changes which sums
// run side by side, never that order, so results are byte-identical however
// rows and tokens are grouped (and across -march levels, as the build turns
// off FMA contraction).

// The lanes of one sum, finished: lanes 0..7 added, then the tail.
inline float FinishDot(const float* lanes, const float* w, const float* x,
                       int in8, int in_dim) {
  float s = 0;
  for (int j = 0; j < 8; ++j) s += lanes[j];
  for (int i = in8; i < in_dim; ++i) s += w[i] * x[i];
  return s;
}

// One row against one token.
inline float Dot(const float* w, const float* x, int in8, int in_dim) {
  float a[8] = {};
  for (int i = 0; i < in8; i += 8) {
    for (int j = 0; j < 8; ++j) a[j] += w[i + j] * x[i + j];
  }
  return FinishDot(a, w, x, in8, in_dim);
}

// Rows [o0, o1) in tiles of two rows by four tokens: each weight value
// loaded serves four tokens and each token value two rows (eight
// accumulators of eight lanes: the tile fills the vector registers without
// spilling); see bench/results/calibration.md for what it did to a pass.
void MatMulRows(const float* w, int in_dim, const float* x, int n, float* y,
                int out_dim, int o0, int o1) {
  const int in8 = in_dim & ~7;
  auto out = [&](int t, int o) -> float& {
    return y[static_cast<size_t>(t) * out_dim + o];
  };
  auto xrow = [&](int t) { return x + static_cast<size_t>(t) * in_dim; };
  int o = o0;
  for (; o + 2 <= o1; o += 2) {
    const float* wa = w + static_cast<size_t>(o) * in_dim;
    const float* wb = wa + in_dim;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      const float* x0 = xrow(t);
      const float* x1 = x0 + in_dim;
      const float* x2 = x1 + in_dim;
      const float* x3 = x2 + in_dim;
      float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
      float b0[8] = {}, b1[8] = {}, b2[8] = {}, b3[8] = {};
      for (int i = 0; i < in8; i += 8) {
        for (int j = 0; j < 8; ++j) {
          const float va = wa[i + j], vb = wb[i + j];
          const float u0 = x0[i + j], u1 = x1[i + j];
          const float u2 = x2[i + j], u3 = x3[i + j];
          a0[j] += va * u0;
          a1[j] += va * u1;
          a2[j] += va * u2;
          a3[j] += va * u3;
          b0[j] += vb * u0;
          b1[j] += vb * u1;
          b2[j] += vb * u2;
          b3[j] += vb * u3;
        }
      }
      out(t, o) = FinishDot(a0, wa, x0, in8, in_dim);
      out(t + 1, o) = FinishDot(a1, wa, x1, in8, in_dim);
      out(t + 2, o) = FinishDot(a2, wa, x2, in8, in_dim);
      out(t + 3, o) = FinishDot(a3, wa, x3, in8, in_dim);
      out(t, o + 1) = FinishDot(b0, wb, x0, in8, in_dim);
      out(t + 1, o + 1) = FinishDot(b1, wb, x1, in8, in_dim);
      out(t + 2, o + 1) = FinishDot(b2, wb, x2, in8, in_dim);
      out(t + 3, o + 1) = FinishDot(b3, wb, x3, in8, in_dim);
    }
    for (; t < n; ++t) {
      out(t, o) = Dot(wa, xrow(t), in8, in_dim);
      out(t, o + 1) = Dot(wb, xrow(t), in8, in_dim);
    }
  }
  for (; o < o1; ++o) {
    const float* wr = w + static_cast<size_t>(o) * in_dim;
    for (int t = 0; t < n; ++t) out(t, o) = Dot(wr, xrow(t), in8, in_dim);
  }
}

}  // namespace

Transformer::Transformer(const Model* model, int num_threads)
    : model_(model), num_threads_(std::clamp(num_threads, 1, 16)) {}

void Transformer::MatMul(const float* w, int out_dim, int in_dim,
                         const float* x, int n, float* y) {
  // Threads pay off from about a million multiply-adds per call.
  const int64_t work = static_cast<int64_t>(out_dim) * in_dim * n;
  const int threads = work >= (1 << 20) ? num_threads_ : 1;
  if (threads == 1) {
    MatMulRows(w, in_dim, x, n, y, out_dim, 0, out_dim);
    return;
  }
  std::vector<std::thread> pool;
  const int per = (out_dim + threads - 1) / threads;
  for (int k = 1; k < threads; ++k) {
    const int o0 = k * per, o1 = std::min(out_dim, o0 + per);
    if (o0 >= o1) break;
    pool.emplace_back(MatMulRows, w, in_dim, x, n, y, out_dim, o0, o1);
  }
  MatMulRows(w, in_dim, x, n, y, out_dim, 0, std::min(out_dim, per));
  for (auto& th : pool) th.join();
}

absl::Status Transformer::Forward(absl::Span<const int> tokens, int64_t pos0,
                                  KvStore* kv, std::vector<float>* logits) {
  const ModelConfig& c = model_->config;
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("forward: empty chunk");
  if (pos0 < 0 || pos0 + n > c.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward: positions [", pos0, ", ", pos0 + n,
                     ") exceed max_seq_len ", c.max_seq_len));
  }
  for (int t = 0; t < n; ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward: token id ", tokens[t], " at chunk index ", t,
                       " outside vocab_size ", c.vocab_size));
    }
  }
  const int dim = c.dim, hidden = c.hidden_dim, kv_dim = c.kv_dim();
  const int head_dim = c.head_dim();
  x_.resize(static_cast<size_t>(n) * dim);
  xb_.resize(static_cast<size_t>(n) * dim);
  q_.resize(static_cast<size_t>(n) * dim);
  k_.resize(static_cast<size_t>(n) * kv_dim);
  v_.resize(static_cast<size_t>(n) * kv_dim);
  att_.resize(static_cast<size_t>(n) * dim);
  hb_.resize(static_cast<size_t>(n) * hidden);
  hb2_.resize(static_cast<size_t>(n) * hidden);
  std::vector<int64_t> positions(n);
  for (int t = 0; t < n; ++t) {
    positions[t] = pos0 + t;
    std::copy_n(model_->tok_embeddings + static_cast<size_t>(tokens[t]) * dim,
                dim, x_.data() + static_cast<size_t>(t) * dim);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    for (int t = 0; t < n; ++t) {
      RmsNorm(&xb_[static_cast<size_t>(t) * dim],
              &x_[static_cast<size_t>(t) * dim],
              model_->attention_norm + static_cast<size_t>(l) * dim, dim);
    }
    const size_t dd = static_cast<size_t>(dim) * dim;
    const size_t kd = static_cast<size_t>(kv_dim) * dim;
    MatMul(model_->wq + l * dd, dim, dim, xb_.data(), n, q_.data());
    MatMul(model_->wk + l * kd, kv_dim, dim, xb_.data(), n, k_.data());
    MatMul(model_->wv + l * kd, kv_dim, dim, xb_.data(), n, v_.data());
    // RoPE exactly as run.c: the frequency uses the index within the head.
    for (int t = 0; t < n; ++t) {
      const int pos = static_cast<int>(pos0 + t);
      float* qt = &q_[static_cast<size_t>(t) * dim];
      float* kt = &k_[static_cast<size_t>(t) * kv_dim];
      for (int i = 0; i < dim; i += 2) {
        const int hd = i % head_dim;
        const float freq =
            1.0f / std::pow(10000.0f, hd / static_cast<float>(head_dim));
        const float val = pos * freq;
        const float fcr = std::cos(val), fci = std::sin(val);
        const int rotn = i < kv_dim ? 2 : 1;
        for (int r = 0; r < rotn; ++r) {
          float* vec = r == 0 ? qt : kt;
          const float v0 = vec[i], v1 = vec[i + 1];
          vec[i] = v0 * fcr - v1 * fci;
          vec[i + 1] = v0 * fci + v1 * fcr;
        }
      }
    }
    if (absl::Status s = kv->Write(l, pos0, n, k_.data(), v_.data()); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("KV write, layer ", l, ": ", s.message()));
    }
    if (absl::Status s =
            kv->Attend(l, n, positions.data(), q_.data(), att_.data());
        !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("attention, layer ", l, ": ", s.message()));
    }
    MatMul(model_->wo + l * dd, dim, dim, att_.data(), n, xb_.data());
    for (size_t j = 0; j < static_cast<size_t>(n) * dim; ++j) x_[j] += xb_[j];
    for (int t = 0; t < n; ++t) {
      RmsNorm(&xb_[static_cast<size_t>(t) * dim],
              &x_[static_cast<size_t>(t) * dim],
              model_->ffn_norm + static_cast<size_t>(l) * dim, dim);
    }
    const size_t hd = static_cast<size_t>(hidden) * dim;
    MatMul(model_->w1 + l * hd, hidden, dim, xb_.data(), n, hb_.data());
    MatMul(model_->w3 + l * hd, hidden, dim, xb_.data(), n, hb2_.data());
    for (size_t j = 0; j < static_cast<size_t>(n) * hidden; ++j) {
      float val = hb_[j];
      val *= 1.0f / (1.0f + std::exp(-val));
      hb_[j] = val * hb2_[j];
    }
    MatMul(model_->w2 + l * hd, dim, hidden, hb_.data(), n, xb_.data());
    for (size_t j = 0; j < static_cast<size_t>(n) * dim; ++j) x_[j] += xb_[j];
  }
  for (int t = 0; t < n; ++t) {
    RmsNorm(&x_[static_cast<size_t>(t) * dim],
            &x_[static_cast<size_t>(t) * dim], model_->final_norm, dim);
  }
  logits->resize(static_cast<size_t>(n) * c.vocab_size);
  MatMul(model_->classifier, c.vocab_size, dim, x_.data(), n, logits->data());
  return absl::OkStatus();
}

absl::Status Transformer::Prefill(absl::Span<const int> tokens, int64_t pos0,
                                  int chunk, KvStore* kv,
                                  std::vector<float>* logits) {
  if (chunk < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prefill chunk = ", chunk));
  }
  const int vocab = model_->config.vocab_size;
  logits->clear();
  logits->reserve(tokens.size() * vocab);
  std::vector<float> part;
  for (size_t off = 0; off < tokens.size(); off += chunk) {
    const size_t len = std::min<size_t>(chunk, tokens.size() - off);
    absl::Status s = Forward(tokens.subspan(off, len), pos0 + off, kv, &part);
    if (!s.ok()) return s;
    logits->insert(logits->end(), part.begin(), part.end());
  }
  return absl::OkStatus();
}

double TokenNll(const float* logits, int vocab, int target) {
  double mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max<double>(mx, logits[i]);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(logits[i] - mx);
  return std::log(sum) + mx - logits[target];
}

int Argmax(const float* logits, int vocab) {
  int best = 0;
  for (int i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

}  // namespace triax::frontend
