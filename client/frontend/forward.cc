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

// y[t][o] = sum_i w[o][i] x[t][i] for rows [o0, o1). Four tokens share each
// pass over a weight row; eight partial sums per token let the compiler use
// vector registers without reassociating.
void MatMulRows(const float* w, int in_dim, const float* x, int n, float* y,
                int out_dim, int o0, int o1) {
  const int in8 = in_dim & ~7;
  for (int o = o0; o < o1; ++o) {
    const float* wr = w + static_cast<size_t>(o) * in_dim;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      const float* x0 = x + static_cast<size_t>(t) * in_dim;
      const float* x1 = x0 + in_dim;
      const float* x2 = x1 + in_dim;
      const float* x3 = x2 + in_dim;
      float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
      for (int i = 0; i < in8; i += 8) {
        for (int j = 0; j < 8; ++j) {
          const float wv = wr[i + j];
          a0[j] += wv * x0[i + j];
          a1[j] += wv * x1[i + j];
          a2[j] += wv * x2[i + j];
          a3[j] += wv * x3[i + j];
        }
      }
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (int j = 0; j < 8; ++j) {
        s0 += a0[j];
        s1 += a1[j];
        s2 += a2[j];
        s3 += a3[j];
      }
      for (int i = in8; i < in_dim; ++i) {
        s0 += wr[i] * x0[i];
        s1 += wr[i] * x1[i];
        s2 += wr[i] * x2[i];
        s3 += wr[i] * x3[i];
      }
      y[static_cast<size_t>(t) * out_dim + o] = s0;
      y[static_cast<size_t>(t + 1) * out_dim + o] = s1;
      y[static_cast<size_t>(t + 2) * out_dim + o] = s2;
      y[static_cast<size_t>(t + 3) * out_dim + o] = s3;
    }
    for (; t < n; ++t) {
      const float* xt = x + static_cast<size_t>(t) * in_dim;
      float a[8] = {};
      for (int i = 0; i < in8; i += 8) {
        for (int j = 0; j < 8; ++j) a[j] += wr[i + j] * xt[i + j];
      }
      float s = 0;
      for (int j = 0; j < 8; ++j) s += a[j];
      for (int i = in8; i < in_dim; ++i) s += wr[i] * xt[i];
      y[static_cast<size_t>(t) * out_dim + o] = s;
    }
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
