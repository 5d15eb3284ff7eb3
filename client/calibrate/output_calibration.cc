#include "client/calibrate/output_calibration.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"

namespace triax::calibrate {
namespace {

constexpr int kMaxBlockTokens = 4096;

std::string EncName(const kernels::Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

bool IsBf16(const kernels::Encoding& e) {
  return e.k == kernels::Format::kBF16 && e.v == kernels::Format::kBF16;
}

// fp32 dot product with eight partial sums, so the compiler can keep them in
// vector registers without reassociating.
inline float Dot(const float* a, const float* b, int n) {
  float acc[8] = {};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
            ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

}  // namespace

// --- OutputConversation ----------------------------------------------------

Tag OutputConversation::TagOf(int b, uint32_t turn) const {
  return Tag{
      TemporalFor(static_cast<uint32_t>(b), blocks[b].turn, turn, recent_turns),
      blocks[b].modality, blocks[b].role};
}

int64_t OutputConversation::FirstPerturbed(const Allocation& alloc) const {
  for (const Chunk& c : chunks) {
    for (int b = 0; b < c.sealed_blocks; ++b) {
      auto it = alloc.find(TagOf(b, c.turn));
      if (it != alloc.end() && !IsBf16(it->second)) return c.first;
    }
  }
  return static_cast<int64_t>(tokens.size());
}

absl::StatusOr<OutputConversation> PrepareOutputConversation(
    const frontend::RenderedConversation& conv, const std::vector<int>& tokens,
    int bos_tokens, int block_tokens, uint32_t recent_turns, int chunk) {
  if (chunk < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk, " must be >= 1"));
  }
  if (tokens.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("conversation \"", conv.id, "\" has ", tokens.size(),
                     " tokens; at least 2 are needed to predict one"));
  }
  OutputConversation c;
  c.id = conv.id;
  c.tokens = tokens;
  c.recent_turns = recent_turns;
  c.block_tokens = block_tokens;
  TRIAX_ASSIGN_OR_RETURN(c.blocks, PlanBlocks(conv, bos_tokens, block_tokens));
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t planned = c.blocks.back().first + c.blocks.back().tokens;
  if (planned != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("conversation \"", conv.id, "\": blocks cover ", planned,
                     " tokens; the token list holds ", n));
  }
  const int B = static_cast<int>(c.blocks.size());
  // Chunks: per turn, from the turn's first token.
  for (int b = 0; b < B;) {
    const uint32_t turn = c.blocks[b].turn;
    const int64_t first = c.blocks[b].first;
    int e = b;
    while (e < B && c.blocks[e].turn == turn) ++e;
    const int64_t end = c.blocks[e - 1].first + c.blocks[e - 1].tokens;
    for (int64_t p = first; p < end; p += chunk) {
      OutputConversation::Chunk ch;
      ch.first = p;
      ch.tokens = static_cast<int>(std::min<int64_t>(chunk, end - p));
      ch.turn = turn;
      c.chunks.push_back(ch);
    }
    b = e;
  }
  c.chunk_of.assign(n, 0);
  int sealed = 0;
  for (size_t i = 0; i < c.chunks.size(); ++i) {
    OutputConversation::Chunk& ch = c.chunks[i];
    const int64_t end = ch.first + ch.tokens;
    while (sealed < B &&
           c.blocks[sealed].first + c.blocks[sealed].tokens <= end)
      ++sealed;
    ch.sealed_blocks = sealed;
    for (int64_t p = ch.first; p < end; ++p) {
      c.chunk_of[p] = static_cast<int>(i);
    }
  }
  // Tags present, then shares per logit position.
  const int64_t P = n - 1;
  std::map<Tag, int> index;
  for (int64_t p = 0; p < P; ++p) {
    const OutputConversation::Chunk& ch = c.chunks[c.chunk_of[p]];
    for (int b = 0; b < ch.sealed_blocks && c.blocks[b].first <= p; ++b) {
      index.emplace(c.TagOf(b, ch.turn), 0);
    }
  }
  for (auto& [tag, i] : index) {
    i = static_cast<int>(c.tags.size());
    c.tags.push_back(tag);
  }
  const size_t T = c.tags.size();
  c.share.assign(static_cast<size_t>(P) * T, 0.0);
  for (int64_t p = 0; p < P; ++p) {
    const OutputConversation::Chunk& ch = c.chunks[c.chunk_of[p]];
    double* row = &c.share[static_cast<size_t>(p) * T];
    for (int b = 0; b < ch.sealed_blocks && c.blocks[b].first <= p; ++b) {
      const int64_t seen =
          std::min<int64_t>(c.blocks[b].first + c.blocks[b].tokens, p + 1) -
          c.blocks[b].first;
      row[index[c.TagOf(b, ch.turn)]] += static_cast<double>(seen);
    }
    for (size_t i = 0; i < T; ++i) row[i] /= static_cast<double>(p + 1);
  }
  c.answer.assign(P, 0);
  for (int b = 0; b < B; ++b) {
    const Role r = c.blocks[b].role;
    if (r != Role::kAssistant && r != Role::kToolCall) continue;
    for (int64_t j = c.blocks[b].first;
         j < c.blocks[b].first + c.blocks[b].tokens; ++j) {
      if (j >= 1) c.answer[j - 1] = 1;
    }
  }
  return c;
}

// --- FakeQuantKvStore ------------------------------------------------------

absl::StatusOr<std::unique_ptr<FakeQuantKvStore>> FakeQuantKvStore::Create(
    const frontend::ModelConfig& config, const OutputConversation* conv,
    const Allocation& alloc) {
  std::unique_ptr<FakeQuantKvStore> s(new FakeQuantKvStore(config, conv));
  const kernels::PageShape shape{conv->block_tokens, config.n_kv_heads,
                                 config.head_dim()};
  for (const auto& [tag, e] : alloc) {
    if (IsBf16(e)) continue;
    if (const char* why = kernels::ValidateEncoding(e, shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allocation ", TagLabel(tag), " -> ", EncName(e),
          " is invalid for block_tokens ", shape.tokens, ", n_kv_heads ",
          shape.heads, ", head_dim ", shape.head_dim, ": ", why));
    }
    if (std::find(s->encodings_.begin(), s->encodings_.end(), e) ==
        s->encodings_.end()) {
      s->encodings_.push_back(e);
    }
  }
  const int B = static_cast<int>(conv->blocks.size());
  const uint32_t turns = conv->blocks.back().turn + 1;
  s->enc_.assign(static_cast<size_t>(turns) * B, -1);
  s->block_encs_.resize(B);
  for (uint32_t t = 0; t < turns; ++t) {
    for (int b = 0; b < B; ++b) {
      auto it = alloc.find(conv->TagOf(b, t));
      if (it == alloc.end() || IsBf16(it->second)) continue;
      const int e = static_cast<int>(
          std::find(s->encodings_.begin(), s->encodings_.end(), it->second) -
          s->encodings_.begin());
      s->enc_[static_cast<size_t>(t) * B + b] = e;
      if (t >= conv->blocks[b].turn) {
        std::vector<int>& need = s->block_encs_[b];
        if (std::find(need.begin(), need.end(), e) == need.end()) {
          need.push_back(e);
        }
      }
    }
  }
  const int L = config.n_layers;
  const size_t size =
      conv->tokens.size() * static_cast<size_t>(config.kv_dim());
  s->k_.assign(L, std::vector<float>(size));
  s->v_.assign(L, std::vector<float>(size));
  s->dk_.assign(s->encodings_.size(),
                std::vector<std::vector<float>>(L, std::vector<float>(size)));
  s->dv_ = s->dk_;
  s->written_.assign(L, 0);
  s->sealed_.assign(L, 0);
  size_t page = 0;
  for (const kernels::Encoding& e : s->encodings_) {
    page = std::max(page, kernels::PageBytes(e, shape));
  }
  s->page_.resize(page);
  const size_t block_values =
      static_cast<size_t>(conv->block_tokens) * config.kv_dim();
  s->kb_.resize(block_values);
  s->vb_.resize(block_values);
  return s;
}

void FakeQuantKvStore::Seal(int layer) {
  const int B = static_cast<int>(conv_->blocks.size());
  const int kv_dim = config_.kv_dim();
  const kernels::PageShape shape{conv_->block_tokens, config_.n_kv_heads,
                                 config_.head_dim()};
  int& s = sealed_[layer];
  while (s < B &&
         conv_->blocks[s].first + conv_->blocks[s].tokens <= written_[layer]) {
    const CalBlock& b = conv_->blocks[s];
    const size_t off = static_cast<size_t>(b.first) * kv_dim;
    const size_t count = static_cast<size_t>(b.tokens) * kv_dim;
    for (int e : block_encs_[s]) {
      for (size_t i = 0; i < count; ++i) {
        kb_[i] = kernels::FloatToBf16(k_[layer][off + i]);
        vb_[i] = kernels::FloatToBf16(v_[layer][off + i]);
      }
      kernels::EncodePage(encodings_[e], shape, kb_.data(), vb_.data(),
                          b.tokens, page_.data());
      kernels::DecodePage(encodings_[e], shape, page_.data(), b.tokens,
                          &dk_[e][layer][off], &dv_[e][layer][off]);
    }
    ++s;
  }
}

absl::Status FakeQuantKvStore::CopyPrefix(const FakeQuantKvStore& other,
                                          int64_t n) {
  const int L = config_.n_layers;
  const size_t kv_dim = config_.kv_dim();
  if (other.conv_ != conv_ || other.config_.n_layers != L ||
      other.config_.kv_dim() != config_.kv_dim()) {
    return absl::InvalidArgumentError(
        "CopyPrefix: the other store holds another conversation or shape");
  }
  for (int l = 0; l < L; ++l) {
    if (n < 0 || n > other.written_[l] || written_[l] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CopyPrefix of ", n, " tokens on layer ", l, ": the source holds ",
          other.written_[l], " and this store ", written_[l]));
    }
  }
  for (int l = 0; l < L; ++l) {
    std::copy_n(other.k_[l].begin(), n * kv_dim, k_[l].begin());
    std::copy_n(other.v_[l].begin(), n * kv_dim, v_[l].begin());
    written_[l] = n;
    Seal(l);
  }
  return absl::OkStatus();
}

absl::Status FakeQuantKvStore::Write(int layer, int64_t first_pos, int n,
                                     const float* k, const float* v) {
  if (layer < 0 || layer >= config_.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer = ", layer, ", model has ", config_.n_layers));
  }
  const int64_t capacity = static_cast<int64_t>(conv_->tokens.size());
  if (n < 1 || first_pos < 0 || first_pos > written_[layer] ||
      first_pos + n > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "write of n = ", n, " tokens at first_pos = ", first_pos, " on layer ",
        layer, " with ", written_[layer], " written of ", capacity));
  }
  const size_t kv_dim = config_.kv_dim();
  const size_t off = static_cast<size_t>(first_pos) * kv_dim;
  for (size_t i = 0; i < static_cast<size_t>(n) * kv_dim; ++i) {
    k_[layer][off + i] = kernels::Bf16ToFloat(kernels::FloatToBf16(k[i]));
    v_[layer][off + i] = kernels::Bf16ToFloat(kernels::FloatToBf16(v[i]));
  }
  written_[layer] = std::max<int64_t>(written_[layer], first_pos + n);
  Seal(layer);
  return absl::OkStatus();
}

absl::Status FakeQuantKvStore::Attend(int layer, int n_queries,
                                      const int64_t* positions, const float* q,
                                      float* out) {
  if (layer < 0 || layer >= config_.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer = ", layer, ", model has ", config_.n_layers));
  }
  const int D = config_.head_dim();
  const int H = config_.n_heads;
  const int kv_dim = config_.kv_dim();
  const int group = H / config_.n_kv_heads;
  const int B = static_cast<int>(conv_->blocks.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Per query: runs of consecutive blocks that read the same source.
  struct Run {
    int64_t first, end;
    const float* k;
    const float* v;
    bool quantized;
  };
  std::vector<Run> runs;
  for (int i = 0; i < n_queries; ++i) {
    const int64_t p = positions[i];
    if (p < 0 || p >= written_[layer]) {
      return absl::OutOfRangeError(
          absl::StrCat("query position ", p, " on layer ", layer, " but ",
                       written_[layer], " tokens written"));
    }
    const uint32_t turn = conv_->chunks[conv_->chunk_of[p]].turn;
    runs.clear();
    for (int b = 0; b < B && conv_->blocks[b].first <= p; ++b) {
      const int e =
          b < sealed_[layer] ? enc_[static_cast<size_t>(turn) * B + b] : -1;
      const float* ks = e < 0 ? k_[layer].data() : dk_[e][layer].data();
      const float* vs = e < 0 ? v_[layer].data() : dv_[e][layer].data();
      const int64_t end = std::min<int64_t>(
          conv_->blocks[b].first + conv_->blocks[b].tokens, p + 1);
      if (!runs.empty() && runs.back().k == ks) {
        runs.back().end = end;
      } else {
        runs.push_back(Run{conv_->blocks[b].first, end, ks, vs, e >= 0});
      }
      if (e >= 0) quantized_reads_ += H;
    }
    scores_.resize(p + 1);
    for (int h = 0; h < H; ++h) {
      const float* qh = q + (static_cast<size_t>(i) * H + h) * D;
      const size_t koff = static_cast<size_t>(h / group) * D;
      float m = -INFINITY;
      for (const Run& r : runs) {
        for (int64_t j = r.first; j < r.end; ++j) {
          const float s =
              scale * Dot(qh, r.k + static_cast<size_t>(j) * kv_dim + koff, D);
          scores_[j] = s;
          m = std::max(m, s);
        }
      }
      float sum = 0;
      for (int64_t j = 0; j <= p; ++j) {
        scores_[j] = std::exp(scores_[j] - m);
        sum += scores_[j];
      }
      const float inv = 1.0f / sum;
      float* oh = out + (static_cast<size_t>(i) * H + h) * D;
      std::fill(oh, oh + D, 0.0f);
      for (const Run& r : runs) {
        for (int64_t j = r.first; j < r.end; ++j) {
          const float a = scores_[j] * inv;
          const float* vt = r.v + static_cast<size_t>(j) * kv_dim + koff;
          for (int d = 0; d < D; ++d) oh[d] += a * vt[d];
        }
      }
    }
  }
  return absl::OkStatus();
}

// --- Passes ----------------------------------------------------------------

absl::StatusOr<PassResult> RunPass(frontend::Transformer* tf,
                                   const OutputConversation& conv,
                                   const Allocation& alloc,
                                   const FakeQuantKvStore* reference_store,
                                   const std::vector<float>* reference_logits,
                                   std::unique_ptr<FakeQuantKvStore>* store) {
  const auto t0 = std::chrono::steady_clock::now();
  const frontend::ModelConfig& cfg = tf->model().config;
  TRIAX_ASSIGN_OR_RETURN(*store, FakeQuantKvStore::Create(cfg, &conv, alloc));
  PassResult r;
  const size_t vocab = cfg.vocab_size;
  r.logits.reserve(conv.tokens.size() * vocab);
  if (reference_store != nullptr && reference_logits != nullptr) {
    r.first_computed = conv.FirstPerturbed(alloc);
    if (reference_logits->size() != conv.tokens.size() * vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference logits hold ", reference_logits->size(),
                       " values; expected ", conv.tokens.size() * vocab));
    }
    TRIAX_RETURN_IF_ERROR(
        (*store)->CopyPrefix(*reference_store, r.first_computed));
    r.logits.assign(reference_logits->begin(),
                    reference_logits->begin() + r.first_computed * vocab);
  }
  std::vector<float> part;
  for (const OutputConversation::Chunk& c : conv.chunks) {
    if (c.first < r.first_computed) continue;
    TRIAX_RETURN_IF_ERROR(
        tf->Forward(absl::MakeConstSpan(conv.tokens).subspan(c.first, c.tokens),
                    c.first, store->get(), &part));
    r.logits.insert(r.logits.end(), part.begin(), part.end());
  }
  r.seconds = Seconds(t0);
  return r;
}

PositionEffects CompareLogits(const OutputConversation& conv, int vocab,
                              const std::vector<float>& ref_logits,
                              const std::vector<float>& logits) {
  const int64_t P = conv.positions();
  PositionEffects out;
  out.kl.assign(P, 0.0);
  out.dnll.assign(P, 0.0);
  std::vector<double> lr(vocab), lt(vocab);
  auto log_softmax = [vocab](const float* x, std::vector<double>* y) {
    double m = x[0];
    for (int i = 1; i < vocab; ++i) m = std::max<double>(m, x[i]);
    double s = 0;
    for (int i = 0; i < vocab; ++i) s += std::exp(x[i] - m);
    const double lse = m + std::log(s);
    for (int i = 0; i < vocab; ++i) (*y)[i] = x[i] - lse;
  };
  for (int64_t p = 0; p < P; ++p) {
    const float* a = &ref_logits[static_cast<size_t>(p) * vocab];
    const float* b = &logits[static_cast<size_t>(p) * vocab];
    if (std::equal(a, a + vocab, b)) continue;
    log_softmax(a, &lr);
    log_softmax(b, &lt);
    double kl = 0;
    for (int i = 0; i < vocab; ++i) kl += std::exp(lr[i]) * (lr[i] - lt[i]);
    out.kl[p] = std::max(0.0, kl);
    const int target = conv.tokens[p + 1];
    out.dnll[p] = lr[target] - lt[target];
  }
  return out;
}

EffectMeans MeanEffects(const OutputConversation& conv,
                        const PositionEffects& effects) {
  EffectMeans m;
  for (int64_t p = 0; p < conv.positions(); ++p) {
    m.kl += effects.kl[p];
    m.dnll += effects.dnll[p];
    ++m.positions;
    if (conv.answer[p]) {
      m.kl_answer += effects.kl[p];
      m.dnll_answer += effects.dnll[p];
      ++m.answer_positions;
    }
  }
  if (m.positions) {
    m.kl /= m.positions;
    m.dnll /= m.positions;
  }
  if (m.answer_positions) {
    m.kl_answer /= m.answer_positions;
    m.dnll_answer /= m.answer_positions;
  }
  return m;
}

// --- OutputCalibrator ------------------------------------------------------

absl::StatusOr<OutputCalibrator> OutputCalibrator::Create(
    const frontend::ModelConfig& config, OutputCalibratorOptions options) {
  if (options.chunk < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", options.chunk, " must be >= 1"));
  }
  TRIAX_RETURN_IF_ERROR(ValidateCalibrationOptions(
      config, options.block_tokens, options.threads, options.encodings));
  return OutputCalibrator(config, std::move(options));
}

absl::Status OutputCalibrator::AddConversation(const frontend::Model& model,
                                               const OutputConversation& conv,
                                               const PassProgress& progress) {
  if (std::find(ids_.begin(), ids_.end(), conv.id) != ids_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("conversation \"", conv.id, "\" is measured already"));
  }
  if (conv.block_tokens != options_.block_tokens ||
      conv.recent_turns != options_.recent_turns) {
    return absl::InvalidArgumentError(absl::StrCat(
        "conversation \"", conv.id, "\" is planned with block_tokens ",
        conv.block_tokens, ", recent_turns ", conv.recent_turns,
        "; the calibrator uses ", options_.block_tokens, ", ",
        options_.recent_turns));
  }
  for (const OutputConversation::Chunk& c : conv.chunks) {
    if (c.tokens > options_.chunk) {
      return absl::InvalidArgumentError(absl::StrCat(
          "conversation \"", conv.id, "\" has a chunk of ", c.tokens,
          " tokens; the calibrator's chunk is ", options_.chunk));
    }
  }
  const int vocab = model.config.vocab_size;
  frontend::Transformer ref_tf(&model, 1);
  std::unique_ptr<FakeQuantKvStore> ref_store;
  TRIAX_ASSIGN_OR_RETURN(
      PassResult ref, RunPass(&ref_tf, conv, {}, nullptr, nullptr, &ref_store));
  const int passes =
      static_cast<int>(conv.tags.size()) *
      static_cast<int>(
          std::count_if(options_.encodings.begin(), options_.encodings.end(),
                        [](const kernels::Encoding& e) { return !IsBf16(e); }));
  if (progress) {
    progress(conv.id, Tag{}, kernels::Format::kBF16, ref.seconds, 0, passes);
  }

  struct Job {
    int tag;
    int enc;
    double kl = 0, kl_answer = 0, dnll = 0, dnll_answer = 0;
  };
  std::vector<Job> jobs;
  for (size_t t = 0; t < conv.tags.size(); ++t) {
    for (size_t e = 0; e < options_.encodings.size(); ++e) {
      if (IsBf16(options_.encodings[e])) continue;
      jobs.push_back(Job{static_cast<int>(t), static_cast<int>(e)});
    }
  }
  std::atomic<size_t> next{0};
  std::mutex mu;
  absl::Status failure;
  int done = 0;
  auto work = [&] {
    frontend::Transformer tf(&model, 1);
    std::unique_ptr<FakeQuantKvStore> store;
    for (size_t j = next++; j < jobs.size(); j = next++) {
      Job& job = jobs[j];
      const Allocation alloc{{conv.tags[job.tag], options_.encodings[job.enc]}};
      absl::StatusOr<PassResult> r =
          RunPass(&tf, conv, alloc, ref_store.get(), &ref.logits, &store);
      if (!r.ok()) {
        std::lock_guard<std::mutex> l(mu);
        if (failure.ok()) failure = r.status();
        return;
      }
      const PositionEffects fx =
          CompareLogits(conv, vocab, ref.logits, r->logits);
      for (int64_t p = 0; p < conv.positions(); ++p) {
        job.kl += fx.kl[p];
        job.dnll += fx.dnll[p];
        if (conv.answer[p]) {
          job.kl_answer += fx.kl[p];
          job.dnll_answer += fx.dnll[p];
        }
      }
      std::lock_guard<std::mutex> l(mu);
      ++done;
      if (progress) {
        progress(conv.id, conv.tags[job.tag], options_.encodings[job.enc],
                 r->seconds, done, static_cast<int>(jobs.size()));
      }
    }
  };
  const int T = std::max(
      1, std::min<int>(options_.threads, static_cast<int>(jobs.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < T; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (!failure.ok()) {
    return absl::Status(failure.code(),
                        absl::StrCat(conv.id, ": ", failure.message()));
  }

  // Reduce in job order so the sums do not depend on the thread count.
  const size_t E = options_.encodings.size();
  const size_t NT = conv.tags.size();
  std::vector<TagAcc*> accs(NT);
  for (size_t t = 0; t < NT; ++t) {
    TagAcc& acc = acc_[conv.tags[t]];
    if (acc.kl.empty()) {
      acc.kl.assign(E, 0.0);
      acc.kl_answer.assign(E, 0.0);
      acc.dnll.assign(E, 0.0);
      acc.dnll_answer.assign(E, 0.0);
    }
    accs[t] = &acc;
  }
  for (int64_t p = 0; p < conv.positions(); ++p) {
    for (size_t t = 0; t < NT; ++t) {
      const double s = conv.share[static_cast<size_t>(p) * NT + t];
      if (s <= 0) continue;
      accs[t]->share += s;
      accs[t]->queries++;
      if (conv.answer[p]) accs[t]->share_answer += s;
    }
  }
  // Tag tokens: per (tag, block), the most tokens any position saw.
  std::map<std::pair<int, int>, int64_t> seen;
  std::map<Tag, int> index;
  for (size_t t = 0; t < NT; ++t) index[conv.tags[t]] = static_cast<int>(t);
  for (int64_t p = 0; p < conv.positions(); ++p) {
    const OutputConversation::Chunk& ch = conv.chunks[conv.chunk_of[p]];
    for (int b = 0; b < ch.sealed_blocks && conv.blocks[b].first <= p; ++b) {
      const int64_t n =
          std::min<int64_t>(conv.blocks[b].first + conv.blocks[b].tokens,
                            p + 1) -
          conv.blocks[b].first;
      int64_t& m = seen[{index[conv.TagOf(b, ch.turn)], b}];
      m = std::max(m, n);
    }
  }
  for (const auto& [key, n] : seen) {
    accs[key.first]->tokens += static_cast<uint64_t>(n);
  }
  for (const Job& job : jobs) {
    TagAcc& acc = *accs[job.tag];
    acc.kl[job.enc] += job.kl;
    acc.kl_answer[job.enc] += job.kl_answer;
    acc.dnll[job.enc] += job.dnll;
    acc.dnll_answer[job.enc] += job.dnll_answer;
  }
  positions_ += conv.positions();
  ids_.push_back(conv.id);
  conv_tokens_.push_back(static_cast<int64_t>(conv.tokens.size()));
  tokens_ += conv_tokens_.back();
  return absl::OkStatus();
}

std::string OutputCalibrator::SaveSums() const {
  std::string out = "kvcalibrate-output-sums 1\n";
  absl::StrAppend(&out, "options ", options_.block_tokens, " ",
                  options_.recent_turns, " ", options_.chunk, "\nencodings");
  for (const kernels::Encoding& e : options_.encodings) {
    absl::StrAppend(&out, " ", EncName(e));
  }
  absl::StrAppend(&out, "\npositions ", positions_, "\n");
  for (size_t i = 0; i < ids_.size(); ++i) {
    absl::StrAppend(&out, "conversation ", ids_[i], " ", conv_tokens_[i], "\n");
  }
  for (const auto& [tag, acc] : acc_) {
    absl::StrAppend(&out, "tag ", static_cast<int>(tag.temporal), " ",
                    static_cast<int>(tag.modality), " ",
                    static_cast<int>(tag.role), " ",
                    absl::StrFormat("%.17g %.17g", acc.share, acc.share_answer),
                    " ", acc.tokens, " ", acc.queries);
    for (const std::vector<double>* v :
         {&acc.kl, &acc.kl_answer, &acc.dnll, &acc.dnll_answer}) {
      for (size_t e = 0; e < options_.encodings.size(); ++e) {
        absl::StrAppend(&out,
                        absl::StrFormat(" %.17g", v->empty() ? 0.0 : (*v)[e]));
      }
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

absl::Status OutputCalibrator::AddSums(absl::string_view text,
                                       absl::string_view name) {
  const size_t E = options_.encodings.size();
  std::map<Tag, TagAcc> add;
  std::vector<std::string> ids;
  std::vector<int64_t> conv_tokens;
  int64_t positions = -1;
  bool header = false, have_options = false, have_encodings = false;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (line.empty()) continue;
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ":", line_no, ": ", what));
    };
    const std::vector<absl::string_view> f =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (!header) {
      if (line != "kvcalibrate-output-sums 1") {
        return bad("not a kvcalibrate-output-sums 1 file");
      }
      header = true;
      continue;
    }
    if (f[0] == "options") {
      int bt = 0, chunk = 0;
      uint32_t recent = 0;
      if (f.size() != 4 || !absl::SimpleAtoi(f[1], &bt) ||
          !absl::SimpleAtoi(f[2], &recent) || !absl::SimpleAtoi(f[3], &chunk)) {
        return bad("options needs block_tokens, recent_turns and chunk");
      }
      if (bt != options_.block_tokens || recent != options_.recent_turns ||
          chunk != options_.chunk) {
        return bad(absl::StrCat("options ", bt, " ", recent, " ", chunk,
                                " differ from this run's ",
                                options_.block_tokens, " ",
                                options_.recent_turns, " ", options_.chunk));
      }
      have_options = true;
    } else if (f[0] == "encodings") {
      bool same = f.size() == E + 1;
      for (size_t e = 0; same && e < E; ++e) {
        same = f[e + 1] == EncName(options_.encodings[e]);
      }
      if (!same) return bad("encodings differ from this run's");
      have_encodings = true;
    } else if (f[0] == "positions") {
      if (f.size() != 2 || !absl::SimpleAtoi(f[1], &positions) ||
          positions < 0) {
        return bad("positions needs a count >= 0");
      }
    } else if (f[0] == "conversation") {
      int64_t n = 0;
      if (f.size() != 3 || !absl::SimpleAtoi(f[2], &n) || n < 0) {
        return bad("conversation needs an id and its tokens");
      }
      const std::string id(f[1]);
      if (std::find(ids_.begin(), ids_.end(), id) != ids_.end() ||
          std::find(ids.begin(), ids.end(), id) != ids.end()) {
        return bad(
            absl::StrCat("conversation \"", id, "\" is measured already"));
      }
      ids.push_back(id);
      conv_tokens.push_back(n);
    } else if (f[0] == "tag") {
      int temporal = 0, modality = 0, role = 0;
      TagAcc acc;
      if (f.size() != 8 + 4 * E || !absl::SimpleAtoi(f[1], &temporal) ||
          !absl::SimpleAtoi(f[2], &modality) ||
          !absl::SimpleAtoi(f[3], &role) ||
          !absl::SimpleAtod(f[4], &acc.share) ||
          !absl::SimpleAtod(f[5], &acc.share_answer) ||
          !absl::SimpleAtoi(f[6], &acc.tokens) ||
          !absl::SimpleAtoi(f[7], &acc.queries)) {
        return bad(
            absl::StrCat("tag needs temporal, modality, role, share, "
                         "share_answer, tokens, queries and ",
                         4 * E, " sums"));
      }
      const Tag tag{static_cast<Temporal>(temporal),
                    static_cast<Modality>(modality), static_cast<Role>(role)};
      if (!IsValid(tag.temporal) || !IsValid(tag.modality) ||
          !IsValid(tag.role) || add.count(tag)) {
        return bad("tag is invalid or repeated");
      }
      size_t k = 8;
      for (std::vector<double>* v :
           {&acc.kl, &acc.kl_answer, &acc.dnll, &acc.dnll_answer}) {
        v->assign(E, 0.0);
        for (size_t e = 0; e < E; ++e, ++k) {
          if (!absl::SimpleAtod(f[k], &(*v)[e]) || !std::isfinite((*v)[e])) {
            return bad(absl::StrCat("field ", k + 1, " is not a number"));
          }
        }
      }
      add.emplace(tag, std::move(acc));
    } else {
      return bad(absl::StrCat("unknown line \"", f[0], "\""));
    }
  }
  if (!header || !have_options || !have_encodings || positions < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name,
                     ": incomplete (needs the header, options, encodings and "
                     "positions lines)"));
  }
  for (auto& [tag, a] : add) {
    TagAcc& acc = acc_[tag];
    if (acc.kl.empty()) {
      acc.kl.assign(E, 0.0);
      acc.kl_answer.assign(E, 0.0);
      acc.dnll.assign(E, 0.0);
      acc.dnll_answer.assign(E, 0.0);
    }
    acc.share += a.share;
    acc.share_answer += a.share_answer;
    acc.tokens += a.tokens;
    acc.queries += a.queries;
    for (size_t e = 0; e < E; ++e) {
      acc.kl[e] += a.kl[e];
      acc.kl_answer[e] += a.kl_answer[e];
      acc.dnll[e] += a.dnll[e];
      acc.dnll_answer[e] += a.dnll_answer[e];
    }
  }
  positions_ += positions;
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  for (int64_t n : conv_tokens) tokens_ += n;
  conv_tokens_.insert(conv_tokens_.end(), conv_tokens.begin(),
                      conv_tokens.end());
  return absl::OkStatus();
}

std::vector<CalibrationResultEntry> OutputCalibrator::Entries() const {
  std::vector<CalibrationResultEntry> out;
  for (const auto& [tag, acc] : acc_) {
    if (acc.share <= 0 || acc.tokens == 0) continue;
    for (size_t e = 0; e < options_.encodings.size(); ++e) {
      CalibrationResultEntry r;
      r.tag = tag;
      r.encoding = options_.encodings[e];
      r.distortion = acc.kl[e] / acc.share;
      r.dnll = acc.dnll[e] / acc.share;
      if (acc.share_answer > 0) {
        r.distortion_answer = acc.kl_answer[e] / acc.share_answer;
        r.dnll_answer = acc.dnll_answer[e] / acc.share_answer;
      }
      r.mean_error = positions_ ? acc.kl[e] / positions_ : 0.0;
      r.mean_share = positions_ ? acc.share / positions_ : 0.0;
      r.tokens = acc.tokens;
      r.queries = acc.queries;
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace triax::calibrate
