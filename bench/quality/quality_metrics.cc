#include "bench/quality/quality_metrics.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace triax::bench {

namespace {

// log-sum-exp of the logits, in double.
double LogSumExp(const float* x, int n) {
  double mx = x[0];
  for (int i = 1; i < n; ++i) mx = std::max<double>(mx, x[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(x[i] - mx);
  return mx + std::log(s);
}

int ArgmaxFirst(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

}  // namespace

double KlDivergence(const float* p_logits, const float* q_logits, int vocab) {
  const double lp = LogSumExp(p_logits, vocab);
  const double lq = LogSumExp(q_logits, vocab);
  double kl = 0;
  for (int i = 0; i < vocab; ++i) {
    const double log_p = p_logits[i] - lp;
    const double log_q = q_logits[i] - lq;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  return std::max(0.0, kl);
}

void NextTokenStats::Add(const float* ref_logits, const float* logits,
                         int vocab, int target, bool focus) {
  const double nll = LogSumExp(logits, vocab) - logits[target];
  nll_sum += nll;
  ++count;
  if (ArgmaxFirst(logits, vocab) == ArgmaxFirst(ref_logits, vocab)) {
    ++top1_agree;
  }
  kl_sum += KlDivergence(ref_logits, logits, vocab);
  if (focus) {
    focus_nll_sum += nll;
    ++focus_count;
  }
}

absl::Status NextTokenStats::AddSequence(const std::vector<float>& ref_logits,
                                         const std::vector<float>& logits,
                                         int vocab,
                                         const std::vector<int>& tokens,
                                         const std::vector<bool>& focus) {
  if (vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab=", vocab, "; must be >= 1"));
  }
  if (focus.size() != tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("focus has ", focus.size(), " entries, tokens ",
                     tokens.size(), "; must be equal"));
  }
  if (tokens.size() < 2) return absl::OkStatus();
  const size_t need = (tokens.size() - 1) * static_cast<size_t>(vocab);
  if (ref_logits.size() < need || logits.size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ref_logits has ", ref_logits.size(), " values, logits ", logits.size(),
        "; ", tokens.size(), " tokens of vocab ", vocab, " need ", need));
  }
  for (size_t t = 1; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens[", t, "]=", tokens[t], "; must be in [0, ", vocab, ")"));
    }
  }
  for (size_t t = 1; t < tokens.size(); ++t) {
    Add(&ref_logits[(t - 1) * vocab], &logits[(t - 1) * vocab], vocab,
        tokens[t], focus[t]);
  }
  return absl::OkStatus();
}

void NextTokenStats::Merge(const NextTokenStats& o) {
  nll_sum += o.nll_sum;
  count += o.count;
  top1_agree += o.top1_agree;
  kl_sum += o.kl_sum;
  focus_nll_sum += o.focus_nll_sum;
  focus_count += o.focus_count;
}

double BitsPerValue(uint64_t bytes, uint64_t tokens, int layers, int heads,
                    int head_dim) {
  const double values =
      2.0 * static_cast<double>(tokens) * layers * heads * head_dim;
  return values > 0 ? bytes * 8.0 / values : 0.0;
}

namespace {

using kernels::Encoding;
using kernels::Format;
using kernels::ScaleDtype;

std::vector<QualityConfig> BuildConfigs() {
  std::vector<QualityConfig> out;
  auto add = [&](std::string name, Encoding e, uint32_t window, bool sink,
                 bool core, const char* note) {
    QualityConfig c;
    c.name = std::move(name);
    c.enc = e;
    c.window = window;
    c.sink = sink;
    c.core = core;
    c.group_note = note;
    out.push_back(std::move(c));
  };
  // 1. Every format, uniform, group 32, FP16 scales, no window, no sink.
  for (Format f : kernels::kAllFormats) {
    add(kernels::FormatName(f), Encoding(f), 0, false, true, "uniform");
  }
  // 2. The core low-bit formats across window {0, 32} x sink {no, yes}.
  for (Format f : {Format::kINT4, Format::kINT2, Format::kTQ3, Format::kTQ2}) {
    const std::string base = kernels::FormatName(f);
    const bool core = f == Format::kINT2 || f == Format::kINT4;
    add(base + ".sink", Encoding(f), 0, true, false, "window x sink");
    add(base + ".w32", Encoding(f), 32, false, core, "window x sink");
    add(base + ".w32.sink", Encoding(f), 32, true, true, "window x sink");
  }
  // 3. Group size and scale storage of the INT formats.
  add("int4.g128", Encoding(Format::kINT4, Format::kINT4, 128), 0, false, true,
      "group / scale");
  add("int2.g128", Encoding(Format::kINT2, Format::kINT2, 128), 0, false, false,
      "group / scale");
  add("int4.fp8scale",
      Encoding(Format::kINT4, Format::kINT4, 32, ScaleDtype::kFP8), 0, false,
      false, "group / scale");
  add("int2.fp8scale",
      Encoding(Format::kINT2, Format::kINT2, 32, ScaleDtype::kFP8), 0, false,
      false, "group / scale");
  // 4. K/V-asymmetric pairs (keys carry the outlier channels), without and
  // with window + sink.
  const std::pair<Format, Format> pairs[] = {{Format::kINT4, Format::kINT2},
                                             {Format::kFP8, Format::kINT4},
                                             {Format::kINT8, Format::kINT4},
                                             {Format::kINT8, Format::kINT2}};
  for (const auto& [k, v] : pairs) {
    const std::string base = absl::StrCat("k-", kernels::FormatName(k), ".v-",
                                          kernels::FormatName(v));
    const bool core = k == Format::kINT4 && v == Format::kINT2;
    add(base, Encoding(k, v), 0, false, core, "K/V asymmetric");
    add(base + ".w32.sink", Encoding(k, v), 32, true, core, "K/V asymmetric");
  }
  return out;
}

}  // namespace

const std::vector<QualityConfig>& AllConfigs() {
  static const std::vector<QualityConfig>* configs =
      new std::vector<QualityConfig>(BuildConfigs());
  return *configs;
}

absl::StatusOr<std::vector<QualityConfig>> SelectConfigs(
    const std::string& flag, const std::string& spec) {
  const auto& all = AllConfigs();
  std::vector<QualityConfig> out;
  if (spec == "all") return all;
  if (spec == "core") {
    for (const auto& c : all) {
      if (c.core) out.push_back(c);
    }
    return out;
  }
  std::set<std::string> want;
  for (absl::string_view name : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    const std::string n(name);
    const bool known = std::any_of(all.begin(), all.end(),
                                   [&](const auto& c) { return c.name == n; });
    if (!known) {
      std::vector<std::string> names;
      names.reserve(all.size());
      for (const auto& c : all) names.push_back(c.name);
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": unknown configuration \"", n,
                       "\"; use all, core or a comma-separated list of: ",
                       absl::StrJoin(names, ", ")));
    }
    want.insert(n);
  }
  want.insert("bf16");
  for (const auto& c : all) {
    if (want.count(c.name)) out.push_back(c);
  }
  return out;
}

}  // namespace triax::bench
