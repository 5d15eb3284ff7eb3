#include "client/calibrate/calibration.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/ids.h"
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

}  // namespace

absl::StatusOr<std::vector<CalBlock>> PlanBlocks(
    const frontend::RenderedConversation& conv, int bos_tokens,
    int block_tokens) {
  if (block_tokens < 1 || block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tokens ", block_tokens, " is outside 1..", kMaxBlockTokens));
  }
  if (bos_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bos_tokens ", bos_tokens, " is negative"));
  }
  if (conv.turns.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("conversation \"", conv.id, "\" has no turns"));
  }
  std::vector<CalBlock> blocks;
  int64_t pos = 0;
  for (size_t t = 0; t < conv.turns.size(); ++t) {
    for (const frontend::RoleSpan& s : conv.turns[t].spans) {
      // BOS joins the first span (the system header delimiter).
      const int64_t n =
          static_cast<int64_t>(s.length) + (s.begin == 0 ? bos_tokens : 0);
      const int64_t first =
          s.begin == 0 ? 0 : static_cast<int64_t>(s.begin) + bos_tokens;
      if (first != pos) {
        return absl::InvalidArgumentError(absl::StrCat(
            "conversation \"", conv.id, "\" turn ", t, ": span at token ",
            first, " does not follow token ", pos));
      }
      for (int64_t done = 0; done < n;) {
        const int take =
            static_cast<int>(std::min<int64_t>(block_tokens, n - done));
        blocks.push_back(CalBlock{pos, take, s.role, Modality::kText,
                                  static_cast<uint32_t>(t)});
        pos += take;
        done += take;
      }
    }
  }
  return blocks;
}

std::vector<Tag> TagBlocks(const std::vector<CalBlock>& blocks,
                           uint32_t current, uint32_t recent_turns) {
  std::vector<Tag> tags;
  tags.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    tags.push_back(Tag{TemporalFor(static_cast<uint32_t>(i), blocks[i].turn,
                                   current, recent_turns),
                       blocks[i].modality, blocks[i].role});
  }
  return tags;
}

const std::vector<std::string>& HeldOutIds() {
  static const std::vector<std::string>* ids = [] {
    auto* v = new std::vector<std::string>;
    for (int i : {3, 8, 15, 17, 42, 46, 50, 59, 121, 177, 181}) {
      v->push_back(absl::StrCat("multi_turn_base_", i));
      v->push_back(absl::StrCat("multi_turn_long_context_", i));
    }
    for (int i : {25, 98, 143, 154}) v->push_back(absl::StrCat("memory_", i));
    return v;
  }();
  return *ids;
}

absl::StatusOr<std::vector<kernels::Encoding>> ParseEncodings(
    absl::string_view text) {
  if (text.empty()) return DefaultEncodings();
  using kernels::Format;
  using kernels::ScaleDtype;
  std::vector<kernels::Encoding> out;
  for (absl::string_view name : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    bool found = false;
    for (Format k : kernels::kAllFormats) {
      for (Format v : kernels::kAllFormats) {
        for (int g : {0, 64, 128}) {
          for (ScaleDtype s : {ScaleDtype::kFP16, ScaleDtype::kFP8}) {
            const kernels::Encoding e(k, v, g, s);
            char buf[96];
            if (!found && name == kernels::EncodingName(e, buf, sizeof(buf))) {
              for (const kernels::Encoding& have : out) {
                if (have == e) {
                  return absl::InvalidArgumentError(absl::StrCat(
                      "--encodings: \"", name, "\" is listed twice"));
                }
              }
              out.push_back(e);
              found = true;
            }
          }
        }
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("--encodings: \"", name,
                       "\" is not an encoding name (e.g. tq4, k=tq4,v=tq3, "
                       "k=int4,v=int4,g=64; separate them with ';')"));
    }
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--encodings: \"", text, "\" names no encoding"));
  }
  return out;
}

absl::StatusOr<CalibrationModel> LoadCalibrationModel(
    const std::string& data_dir, const std::string& name, int max_tokens) {
  TRIAX_RETURN_IF_ERROR(ValidateId("--model", name));
  CalibrationModel m;
  m.name = name;
  m.path = absl::StrCat(data_dir, "/models/", name, "/model.bin");
  TRIAX_ASSIGN_OR_RETURN(m.model, frontend::LoadModel(m.path));
  const frontend::ModelConfig& c = m.model->config;
  if (c.vocab_size < frontend::ByteTokenizer().vocab_size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--model ", name, ": vocab_size ", c.vocab_size,
        " is below the byte tokenizer's ",
        frontend::ByteTokenizer().vocab_size(),
        "; the BFCL rendering needs a byte-level model like kvproxy-18m"));
  }
  if (c.max_seq_len < max_tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("--model ", name, ": context ", c.max_seq_len,
                     " is below --max_tokens ", max_tokens));
  }
  return m;
}

absl::Status CheckCalibrationIds(const std::vector<std::string>& ids) {
  if (ids.empty()) {
    return absl::InvalidArgumentError("--ids is empty");
  }
  const std::vector<std::string>& held = HeldOutIds();
  std::set<std::string> seen;
  for (const std::string& id : ids) {
    if (std::find(held.begin(), held.end(), id) != held.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ids: \"", id,
          "\" is held out for evaluation (models/kvproxy-18m/README.md); "
          "calibrate on other conversations"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ids: \"", id, "\" is listed twice"));
    }
  }
  return absl::OkStatus();
}

// --- CaptureKvStore ------------------------------------------------------

CaptureKvStore::CaptureKvStore(frontend::KvStore* inner,
                               const frontend::ModelConfig& config,
                               int64_t first_query, int query_stride)
    : inner_(inner),
      kv_dim_(config.kv_dim()),
      q_dim_(config.dim),
      first_query_(std::max<int64_t>(0, first_query)),
      stride_(std::max(1, query_stride)),
      k_(config.n_layers),
      v_(config.n_layers),
      q_(config.n_layers) {}

absl::Status CaptureKvStore::Write(int layer, int64_t first_pos, int n,
                                   const float* k, const float* v) {
  absl::Status s = inner_->Write(layer, first_pos, n, k, v);
  if (!s.ok()) return s;
  if (layer < 0 || layer >= static_cast<int>(k_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer));
  }
  const size_t need = static_cast<size_t>(first_pos + n) * kv_dim_;
  if (k_[layer].size() < need) {
    k_[layer].resize(need);
    v_[layer].resize(need);
  }
  std::copy(k, k + static_cast<size_t>(n) * kv_dim_,
            k_[layer].begin() + first_pos * kv_dim_);
  std::copy(v, v + static_cast<size_t>(n) * kv_dim_,
            v_[layer].begin() + first_pos * kv_dim_);
  if (layer == 0) {
    for (int i = 0; i < n; ++i) {
      if (first_pos + i >= static_cast<int64_t>(positions_.size())) {
        positions_.push_back(first_pos + i);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CaptureKvStore::Attend(int layer, int n_queries,
                                    const int64_t* positions, const float* q,
                                    float* out) {
  absl::Status s = inner_->Attend(layer, n_queries, positions, q, out);
  if (!s.ok()) return s;
  for (int i = 0; i < n_queries; ++i) {
    if (!Sampled(positions[i])) continue;
    if (layer == 0) qpos_.push_back(positions[i]);
    q_[layer].insert(q_[layer].end(), q + static_cast<size_t>(i) * q_dim_,
                     q + static_cast<size_t>(i + 1) * q_dim_);
  }
  return absl::OkStatus();
}

// --- Calibrator ----------------------------------------------------------

std::vector<kernels::Encoding> DefaultEncodings() {
  using kernels::Format;
  std::vector<kernels::Encoding> e;
  for (Format f : kernels::kAllFormats) e.emplace_back(f);
  e.emplace_back(Format::kINT4, Format::kINT2);
  e.emplace_back(Format::kINT8, Format::kINT4);
  // K is the more sensitive half, but which TQ pair wins depends on the tag.
  for (Format k : {Format::kTQ4, Format::kTQ3, Format::kTQ2}) {
    for (Format v : {Format::kTQ4, Format::kTQ3, Format::kTQ2}) {
      if (k != v) e.emplace_back(k, v);
    }
  }
  for (Format f : {Format::kINT4, Format::kINT2}) {
    for (int g : {64, 128}) e.emplace_back(f, f, g);
  }
  return e;
}

absl::Status ValidateCalibrationOptions(
    const frontend::ModelConfig& config, int block_tokens, int threads,
    const std::vector<kernels::Encoding>& encodings) {
  if (block_tokens < 1 || block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tokens ", block_tokens, " is outside 1..", kMaxBlockTokens));
  }
  if (threads < 1 || threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads ", threads, " is outside 1..64"));
  }
  if (encodings.empty()) {
    return absl::InvalidArgumentError("encodings is empty");
  }
  const kernels::PageShape shape{block_tokens, config.n_kv_heads,
                                 config.head_dim()};
  for (size_t i = 0; i < encodings.size(); ++i) {
    const kernels::Encoding& e = encodings[i];
    if (const char* why = kernels::ValidateEncoding(e, shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "encodings[", i, "] ", EncName(e), " is invalid for block_tokens ",
          shape.tokens, ", n_kv_heads ", shape.heads, ", head_dim ",
          shape.head_dim, ": ", why));
    }
    for (size_t j = 0; j < i; ++j) {
      if (encodings[j] == e) {
        return absl::InvalidArgumentError(absl::StrCat(
            "encodings[", i, "] ", EncName(e), " repeats encodings[", j, "]"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Calibrator> Calibrator::Create(
    const frontend::ModelConfig& config, CalibratorOptions options) {
  TRIAX_RETURN_IF_ERROR(ValidateCalibrationOptions(
      config, options.block_tokens, options.threads, options.encodings));
  return Calibrator(config, std::move(options));
}

namespace {

// Per-query work item: the tag (local index) of each attended block.
struct QueryPlan {
  int64_t pos = 0;
  int num_blocks = 0;               // blocks with first <= pos
  std::vector<int> block_tag;       // local tag index per block
  std::vector<Tag> tags;            // local tags
  std::vector<int64_t> tag_tokens;  // attended tokens per local tag
};

// err[tag * E + e] for one query of one layer (see the header comment).
void MeasureQuery(const QueryPlan& qp, const std::vector<CalBlock>& blocks,
                  const float* q, int n_heads, int n_kv_heads, int head_dim,
                  const std::vector<float>& ref_k,
                  const std::vector<float>& ref_v,
                  const std::vector<std::vector<float>>& dec_k,
                  const std::vector<std::vector<float>>& dec_v,
                  std::vector<double>* err) {
  const int E = static_cast<int>(dec_k.size());
  const int ntag = static_cast<int>(qp.tags.size());
  const int D = head_dim;
  const int kv_dim = n_kv_heads * D;
  const int group = n_heads / n_kv_heads;
  const int64_t n = qp.pos + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<double> w(n), a(D), dz(ntag), da(static_cast<size_t>(ntag) * D);
  std::vector<double> diff2(static_cast<size_t>(ntag) * E, 0.0);
  std::vector<float> s(n);
  double ref2 = 0;
  auto dot = [D](const float* x, const float* y) {
    float s = 0;
    for (int d = 0; d < D; ++d) s += x[d] * y[d];
    return s;
  };
  for (int h = 0; h < n_heads; ++h) {
    const int g = h / group;
    const float* qh = q + static_cast<size_t>(h) * D;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = scale * dot(qh, &ref_k[static_cast<size_t>(j) * kv_dim +
                                    static_cast<size_t>(g) * D]);
      m = std::max(m, s[j]);
    }
    double z = 0;
    std::fill(a.begin(), a.end(), 0.0);
    for (int64_t j = 0; j < n; ++j) {
      w[j] = std::exp(static_cast<double>(s[j]) - m);
      z += w[j];
      const float* vj =
          &ref_v[static_cast<size_t>(j) * kv_dim + static_cast<size_t>(g) * D];
      for (int d = 0; d < D; ++d) a[d] += w[j] * vj[d];
    }
    for (int d = 0; d < D; ++d) ref2 += (a[d] / z) * (a[d] / z);
    for (int e = 0; e < E; ++e) {
      std::fill(dz.begin(), dz.end(), 0.0);
      std::fill(da.begin(), da.end(), 0.0);
      const std::vector<float>& kf = dec_k[e];
      const std::vector<float>& vf = dec_v[e];
      for (int b = 0; b < qp.num_blocks; ++b) {
        const int t = qp.block_tag[b];
        double* dat = &da[static_cast<size_t>(t) * D];
        const int64_t end =
            std::min<int64_t>(blocks[b].first + blocks[b].tokens, n);
        for (int64_t j = blocks[b].first; j < end; ++j) {
          const float st = scale * dot(qh, &kf[static_cast<size_t>(j) * kv_dim +
                                               static_cast<size_t>(g) * D]);
          const double wt = std::exp(static_cast<double>(st) - m);
          dz[t] += wt - w[j];
          const float* vt =
              &vf[static_cast<size_t>(j) * kv_dim + static_cast<size_t>(g) * D];
          const float* vr = &ref_v[static_cast<size_t>(j) * kv_dim +
                                   static_cast<size_t>(g) * D];
          for (int d = 0; d < D; ++d) dat[d] += wt * vt[d] - w[j] * vr[d];
        }
      }
      // o_kf - o = (dA z - A dZ) / (z (z + dZ)).
      for (int t = 0; t < ntag; ++t) {
        const double denom = z * (z + dz[t]);
        const double* dat = &da[static_cast<size_t>(t) * D];
        double sq = 0;
        for (int d = 0; d < D; ++d) {
          const double diff = (dat[d] * z - a[d] * dz[t]) / denom;
          sq += diff * diff;
        }
        diff2[static_cast<size_t>(t) * E + e] += sq;
      }
    }
  }
  err->assign(diff2.size(), 0.0);
  if (ref2 > 0) {
    for (size_t i = 0; i < diff2.size(); ++i) (*err)[i] = diff2[i] / ref2;
  }
}

}  // namespace

absl::Status Calibrator::AddConversation(const std::vector<CalBlock>& blocks,
                                         const CaptureKvStore& capture) {
  const int64_t n_tokens = capture.tokens();
  int64_t pos = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].first != pos || blocks[i].tokens < 1 ||
        blocks[i].tokens > options_.block_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks[", i, "] holds tokens [", blocks[i].first, ", ",
          blocks[i].first + blocks[i].tokens, "); expected a block of 1..",
          options_.block_tokens, " tokens starting at ", pos));
    }
    pos += blocks[i].tokens;
  }
  if (pos != n_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks cover ", pos, " tokens; the capture holds ", n_tokens));
  }
  const std::vector<int64_t>& qpos = capture.query_positions();
  if (qpos.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no query position was sampled in ", n_tokens, " tokens"));
  }
  const int L = config_.n_layers;
  const int D = config_.head_dim();
  const int Hkv = config_.n_kv_heads;
  const int kv_dim = config_.kv_dim();
  const int q_dim = config_.dim;
  for (int l = 0; l < L; ++l) {
    if (capture.k(l).size() != static_cast<size_t>(n_tokens) * kv_dim ||
        capture.queries(l).size() != qpos.size() * q_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("capture of layer ", l, " is incomplete"));
    }
  }

  // Plans: tags per query (the query's turn is current).
  std::vector<QueryPlan> plans(qpos.size());
  std::map<Tag, std::vector<int>> seen;  // tag -> attended tokens per block
  size_t bi = 0;
  for (size_t qi = 0; qi < qpos.size(); ++qi) {
    QueryPlan& qp = plans[qi];
    qp.pos = qpos[qi];
    while (bi + 1 < blocks.size() && blocks[bi + 1].first <= qp.pos) ++bi;
    qp.num_blocks = static_cast<int>(bi + 1);
    const std::vector<Tag> tags =
        TagBlocks(blocks, blocks[bi].turn, options_.recent_turns);
    std::map<Tag, int> local;
    for (int b = 0; b < qp.num_blocks; ++b) {
      auto [it, fresh] =
          local.emplace(tags[b], static_cast<int>(qp.tags.size()));
      if (fresh) {
        qp.tags.push_back(tags[b]);
        qp.tag_tokens.push_back(0);
      }
      const int attended = static_cast<int>(
          std::min<int64_t>(blocks[b].tokens, qp.pos - blocks[b].first + 1));
      qp.block_tag.push_back(it->second);
      qp.tag_tokens[it->second] += attended;
      std::vector<int>& s = seen[tags[b]];
      if (s.empty()) s.assign(blocks.size(), 0);
      s[b] = std::max(s[b], attended);
    }
  }

  const int E = static_cast<int>(options_.encodings.size());
  const kernels::PageShape shape{options_.block_tokens, Hkv, D};
  std::vector<std::vector<double>> errs(qpos.size());  // reused per layer
  for (int l = 0; l < L; ++l) {
    // Reference: BF16-rounded K/V.
    std::vector<uint16_t> kb(capture.k(l).size()), vb(capture.v(l).size());
    std::vector<float> ref_k(kb.size()), ref_v(vb.size());
    for (size_t i = 0; i < kb.size(); ++i) {
      kb[i] = kernels::FloatToBf16(capture.k(l)[i]);
      vb[i] = kernels::FloatToBf16(capture.v(l)[i]);
      ref_k[i] = kernels::Bf16ToFloat(kb[i]);
      ref_v[i] = kernels::Bf16ToFloat(vb[i]);
    }
    // Round trip of every block through every encoding.
    std::vector<std::vector<float>> dec_k(E), dec_v(E);
    for (int e = 0; e < E; ++e) {
      const kernels::Encoding& enc = options_.encodings[e];
      std::vector<uint8_t> page(kernels::PageBytes(enc, shape));
      dec_k[e].resize(ref_k.size());
      dec_v[e].resize(ref_v.size());
      for (const CalBlock& b : blocks) {
        const size_t off = static_cast<size_t>(b.first) * kv_dim;
        kernels::EncodePage(enc, shape, &kb[off], &vb[off], b.tokens,
                            page.data());
        kernels::DecodePage(enc, shape, page.data(), b.tokens, &dec_k[e][off],
                            &dec_v[e][off]);
      }
    }
    // Queries, spread over threads; results reduced in query order so the
    // sums do not depend on the thread count.
    const int T =
        std::min<int>(options_.threads, static_cast<int>(qpos.size()));
    auto work = [&](int tid) {
      for (size_t qi = tid; qi < qpos.size(); qi += T) {
        MeasureQuery(plans[qi], blocks,
                     &capture.queries(l)[qi * static_cast<size_t>(q_dim)],
                     config_.n_heads, Hkv, D, ref_k, ref_v, dec_k, dec_v,
                     &errs[qi]);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < T; ++t) pool.emplace_back(work, t);
    work(0);
    for (std::thread& t : pool) t.join();
    for (size_t qi = 0; qi < qpos.size(); ++qi) {
      const QueryPlan& qp = plans[qi];
      for (size_t t = 0; t < qp.tags.size(); ++t) {
        TagAcc& acc = acc_[qp.tags[t]];
        if (acc.sum_err.empty()) acc.sum_err.assign(E, 0.0);
        acc.sum_share += static_cast<double>(qp.tag_tokens[t]) / (qp.pos + 1);
        if (l == 0) acc.queries++;
        for (int e = 0; e < E; ++e) acc.sum_err[e] += errs[qi][t * E + e];
      }
    }
  }
  for (const auto& [tag, per_block] : seen) {
    for (int n : per_block) acc_[tag].tokens += n;
  }
  measured_queries_ += static_cast<int64_t>(qpos.size());
  measured_samples_ += static_cast<int64_t>(qpos.size()) * L;
  return absl::OkStatus();
}

std::vector<CalibrationResultEntry> Calibrator::Entries() const {
  std::vector<CalibrationResultEntry> out;
  for (const auto& [tag, acc] : acc_) {
    if (acc.sum_share <= 0 || acc.tokens == 0) continue;
    for (size_t e = 0; e < options_.encodings.size(); ++e) {
      CalibrationResultEntry r;
      r.tag = tag;
      r.encoding = options_.encodings[e];
      r.distortion = acc.sum_err[e] / acc.sum_share;
      r.mean_error = acc.sum_err[e] / measured_samples_;
      r.mean_share = acc.sum_share / measured_samples_;
      r.tokens = acc.tokens;
      r.queries = acc.queries;
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace triax::calibrate
