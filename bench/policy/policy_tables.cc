#include "bench/policy/policy_tables.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace triax::bench {
namespace {

// (encoding, tag with `axis` cleared): the merge key.
using Key = std::tuple<int, int, uint32_t, int, int, int, int>;

Key MergeKey(const v1::CalibrationEntry& e, TagAxis axis) {
  int temporal = e.tag().temporal(), modality = e.tag().modality(),
      role = e.tag().role();
  switch (axis) {
    case TagAxis::kTemporal:
      temporal = -1;
      break;
    case TagAxis::kModality:
      modality = -1;
      break;
    case TagAxis::kRole:
      role = -1;
      break;
  }
  return {e.format(), e.format_v(), e.group_size(), e.scale_dtype(), temporal,
          modality,   role};
}

}  // namespace

const char* TagAxisName(TagAxis a) {
  switch (a) {
    case TagAxis::kTemporal:
      return "temporal";
    case TagAxis::kModality:
      return "modality";
    case TagAxis::kRole:
      return "role";
  }
  return "?";
}

absl::StatusOr<v1::CalibrationTable> CollapseAxis(
    const v1::CalibrationTable& table, TagAxis axis, const std::string& model,
    int* groups_merged) {
  if (model.empty()) {
    return absl::InvalidArgumentError("CollapseAxis: model is empty");
  }
  if (table.entries_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CollapseAxis: table of model \"", table.model(), "\" has no entries"));
  }
  // Every measure of the entry (KL or attention error, and for output
  // tables the answer-position KL and the NLL increases) is averaged alike.
  struct Acc {
    double distortion = 0, answer = 0, dnll = 0, dnll_answer = 0, weight = 0;
    std::set<std::tuple<int, int, int>> tags;
  };
  std::map<Key, Acc> acc;
  for (const auto& e : table.entries()) {
    Acc& a = acc[MergeKey(e, axis)];
    const double w = e.tokens() > 0 ? static_cast<double>(e.tokens()) : 1.0;
    a.distortion += w * e.distortion();
    a.answer += w * e.distortion_answer();
    a.dnll += w * e.dnll();
    a.dnll_answer += w * e.dnll_answer();
    a.weight += w;
    a.tags.insert({e.tag().temporal(), e.tag().modality(), e.tag().role()});
  }
  v1::CalibrationTable out = table;
  out.set_model(model);
  for (auto& e : *out.mutable_entries()) {
    const Acc& a = acc[MergeKey(e, axis)];
    e.set_distortion(a.distortion / a.weight);
    e.set_distortion_answer(a.answer / a.weight);
    e.set_dnll(a.dnll / a.weight);
    e.set_dnll_answer(a.dnll_answer / a.weight);
  }
  if (groups_merged != nullptr) {
    // Count merge groups per tag set (not per encoding).
    std::set<std::set<std::tuple<int, int, int>>> merged;
    for (const auto& [key, a] : acc) {
      if (a.tags.size() > 1) merged.insert(a.tags);
    }
    *groups_merged = static_cast<int>(merged.size());
  }
  return out;
}

// ---------------------------------------------------------------------------
// Raw rows and shards.

namespace {

constexpr const char* kFields[] = {"conversation",
                                   "config",
                                   "kind",
                                   "budget",
                                   "window",
                                   "count",
                                   "nll_sum",
                                   "answer_count",
                                   "answer_nll_sum",
                                   "kl_sum",
                                   "top1_agree",
                                   "plan_bytes",
                                   "worker_bytes",
                                   "seq_tokens",
                                   "values_per_token",
                                   "tokens_by_encoding",
                                   "attn",
                                   "seconds",
                                   "note"};
constexpr size_t kNumFields = sizeof(kFields) / sizeof(kFields[0]);

std::string D(double v) { return absl::StrFormat("%.17g", v); }

bool IsName(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') return false;
  }
  return true;
}

bool IsKind(absl::string_view k) {
  return k == "uniform" || k == "triaxial" || k == "ablation";
}

// Equality of every field but seconds.
bool SameResult(const RawRow& a, const RawRow& b) {
  if (a.attn.size() != b.attn.size()) return false;
  for (size_t i = 0; i < a.attn.size(); ++i) {
    if (a.attn[i].sum_sq_diff != b.attn[i].sum_sq_diff ||
        a.attn[i].sum_sq_ref != b.attn[i].sum_sq_ref ||
        a.attn[i].queries != b.attn[i].queries) {
      return false;
    }
  }
  return a.conversation == b.conversation && a.config == b.config &&
         a.kind == b.kind && a.budget == b.budget && a.window == b.window &&
         a.count == b.count && a.nll_sum == b.nll_sum &&
         a.answer_count == b.answer_count &&
         a.answer_nll_sum == b.answer_nll_sum && a.kl_sum == b.kl_sum &&
         a.top1_agree == b.top1_agree && a.plan_bytes == b.plan_bytes &&
         a.worker_bytes == b.worker_bytes && a.seq_tokens == b.seq_tokens &&
         a.values_per_token == b.values_per_token &&
         a.tokens_by_encoding == b.tokens_by_encoding && a.note == b.note;
}

}  // namespace

std::string RawHeader() {
  return absl::StrJoin(kFields, kFields + kNumFields, "\t");
}

std::string FormatRaw(const RawShard& shard) {
  std::string out =
      "# policy_bench raw results (bench/policy/policy_tables.h)\n";
  for (const auto& [id, note] : shard.sessions) {
    absl::StrAppend(&out, "#session\t", id, "\t", note, "\n");
  }
  for (const auto& [id, why] : shard.skipped) {
    absl::StrAppend(&out, "#skipped\t", id, "\t", why, "\n");
  }
  for (const auto& [key, text] : shard.notes) {
    absl::StrAppend(&out, "#note\t", key, "\t", text, "\n");
  }
  absl::StrAppend(&out, RawHeader(), "\n");
  for (const RawRow& r : shard.rows) {
    std::vector<std::string> enc, attn;
    for (const auto& [label, n] : r.tokens_by_encoding) {
      enc.push_back(absl::StrCat(label, ":", n));
    }
    for (const auto& e : r.attn) {
      attn.push_back(
          absl::StrCat(D(e.sum_sq_diff), "/", D(e.sum_sq_ref), "/", e.queries));
    }
    std::vector<std::string> f = {r.conversation,
                                  r.config,
                                  r.kind,
                                  D(r.budget),
                                  absl::StrCat(r.window),
                                  absl::StrCat(r.count),
                                  D(r.nll_sum),
                                  absl::StrCat(r.answer_count),
                                  D(r.answer_nll_sum),
                                  D(r.kl_sum),
                                  absl::StrCat(r.top1_agree),
                                  absl::StrCat(r.plan_bytes),
                                  absl::StrCat(r.worker_bytes),
                                  absl::StrCat(r.seq_tokens),
                                  absl::StrCat(r.values_per_token),
                                  enc.empty() ? "-" : absl::StrJoin(enc, ";"),
                                  attn.empty() ? "-" : absl::StrJoin(attn, ";"),
                                  D(r.seconds),
                                  r.note.empty() ? "-" : r.note};
    absl::StrAppend(&out, absl::StrJoin(f, "\t"), "\n");
  }
  return out;
}

absl::StatusOr<RawShard> ParseRaw(const std::string& text,
                                  const std::string& file) {
  RawShard shard;
  bool header = false;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ":", line_no, ": ", what));
    };
    if (line.empty()) continue;
    if (line[0] == '#') {
      const bool session = absl::StartsWith(line, "#session\t");
      const bool skipped = absl::StartsWith(line, "#skipped\t");
      const bool note = absl::StartsWith(line, "#note\t");
      if (!session && !skipped && !note) continue;
      std::vector<std::string> f =
          absl::StrSplit(line, absl::MaxSplits('\t', 2));
      // Session and skipped ids are names; a note's key is free text
      // without tabs (e.g. "Run settings").
      if (f.size() != 3 || (note ? f[1].empty() : !IsName(f[1]))) {
        return bad(absl::StrCat("\"", f[0], "\" line needs ",
                                note ? "a key" : "<id> (no whitespace)",
                                " and a text"));
      }
      (session   ? shard.sessions
       : skipped ? shard.skipped
                 : shard.notes)
          .emplace_back(f[1], f[2]);
      continue;
    }
    if (!header) {
      if (line != RawHeader()) {
        return bad(absl::StrCat("expected the header line \"", RawHeader(),
                                "\", got \"", line, "\""));
      }
      header = true;
      continue;
    }
    std::vector<absl::string_view> f = absl::StrSplit(line, '\t');
    if (f.size() != kNumFields) {
      return bad(
          absl::StrCat("has ", f.size(), " fields; ", kNumFields, " expected"));
    }
    RawRow r;
    auto field_err = [&](size_t i) {
      return bad(
          absl::StrCat("field ", kFields[i], " = \"", f[i], "\" is not valid"));
    };
    r.conversation = std::string(f[0]);
    r.config = std::string(f[1]);
    r.kind = std::string(f[2]);
    if (!IsName(r.conversation)) return field_err(0);
    if (!IsName(r.config)) return field_err(1);
    if (!IsKind(r.kind)) return field_err(2);
    auto dbl = [&](size_t i, double* v) {
      return absl::SimpleAtod(f[i], v) && std::isfinite(*v) && *v >= 0;
    };
    if (!dbl(3, &r.budget)) return field_err(3);
    if (!absl::SimpleAtoi(f[4], &r.window)) return field_err(4);
    if (!absl::SimpleAtoi(f[5], &r.count) || r.count < 0) return field_err(5);
    if (!absl::SimpleAtod(f[6], &r.nll_sum) || !std::isfinite(r.nll_sum)) {
      return field_err(6);
    }
    if (!absl::SimpleAtoi(f[7], &r.answer_count) || r.answer_count < 0 ||
        r.answer_count > r.count) {
      return field_err(7);
    }
    if (!absl::SimpleAtod(f[8], &r.answer_nll_sum) ||
        !std::isfinite(r.answer_nll_sum)) {
      return field_err(8);
    }
    if (!dbl(9, &r.kl_sum)) return field_err(9);
    if (!absl::SimpleAtoi(f[10], &r.top1_agree) || r.top1_agree < 0 ||
        r.top1_agree > r.count) {
      return field_err(10);
    }
    if (!absl::SimpleAtoi(f[11], &r.plan_bytes)) return field_err(11);
    if (!absl::SimpleAtoi(f[12], &r.worker_bytes)) return field_err(12);
    if (!absl::SimpleAtoi(f[13], &r.seq_tokens)) return field_err(13);
    if (!absl::SimpleAtoi(f[14], &r.values_per_token)) return field_err(14);
    if (f[15] != "-") {
      for (absl::string_view part : absl::StrSplit(f[15], ';')) {
        const size_t colon = part.rfind(':');
        uint64_t n;
        if (colon == absl::string_view::npos || colon == 0 ||
            !absl::SimpleAtoi(part.substr(colon + 1), &n)) {
          return field_err(15);
        }
        r.tokens_by_encoding[std::string(part.substr(0, colon))] += n;
      }
    }
    if (f[16] != "-") {
      for (absl::string_view part : absl::StrSplit(f[16], ';')) {
        std::vector<absl::string_view> v = absl::StrSplit(part, '/');
        LayerErrSums e;
        if (v.size() != 3 || !absl::SimpleAtod(v[0], &e.sum_sq_diff) ||
            !absl::SimpleAtod(v[1], &e.sum_sq_ref) ||
            !absl::SimpleAtoi(v[2], &e.queries) ||
            !std::isfinite(e.sum_sq_diff) || !std::isfinite(e.sum_sq_ref) ||
            e.sum_sq_diff < 0 || e.sum_sq_ref < 0 || e.queries < 0) {
          return field_err(16);
        }
        r.attn.push_back(e);
      }
    }
    if (!dbl(17, &r.seconds)) return field_err(17);
    r.note = f[18] == "-" ? "" : std::string(f[18]);
    shard.rows.push_back(std::move(r));
  }
  if (!header) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no header line \"",
                                                   RawHeader(), "\" (", line_no,
                                                   " lines read)"));
  }
  return shard;
}

absl::StatusOr<RawShard> MergeRaw(const std::vector<RawShard>& shards) {
  RawShard out;
  std::map<std::string, std::string> sessions;
  std::set<std::string> skipped;
  std::set<std::pair<std::string, std::string>> notes;
  std::map<std::pair<std::string, std::string>, size_t> rows;
  std::map<std::string, const RawRow*> configs;
  for (const RawShard& s : shards) {
    for (const auto& n : s.notes) {
      if (notes.insert(n).second) out.notes.push_back(n);
    }
    for (const auto& [id, note] : s.sessions) {
      auto [it, fresh] = sessions.emplace(id, note);
      if (fresh) {
        out.sessions.emplace_back(id, note);
      } else if (it->second != note) {
        return absl::InvalidArgumentError(
            absl::StrCat("session ", id, " is described twice, differently: \"",
                         it->second, "\" and \"", note, "\""));
      }
    }
    for (const RawRow& r : s.rows) {
      auto c = configs.emplace(r.config, &r);
      const RawRow& first = *c.first->second;
      if (first.kind != r.kind || first.budget != r.budget ||
          first.window != r.window) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "config %s is %s budget %g window %d in one row and %s budget %g "
            "window %d in another",
            r.config, first.kind, first.budget, first.window, r.kind, r.budget,
            r.window));
      }
      auto [it, fresh] = rows.emplace(std::make_pair(r.conversation, r.config),
                                      out.rows.size());
      if (fresh) {
        out.rows.push_back(r);
      } else if (!SameResult(out.rows[it->second], r)) {
        return absl::InvalidArgumentError(
            absl::StrCat("conversation ", r.conversation, " config ", r.config,
                         " appears twice with different results"));
      }
    }
  }
  for (const RawShard& s : shards) {
    for (const auto& [id, why] : s.skipped) {
      if (sessions.count(id) || !skipped.insert(id).second) continue;
      out.skipped.emplace_back(id, why);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Statistics.

absl::StatusOr<Interval> BootstrapRatio(const std::vector<RatioItem>& items,
                                        int resamples, uint64_t seed) {
  if (items.empty()) {
    return absl::InvalidArgumentError("BootstrapRatio: no items");
  }
  if (resamples < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BootstrapRatio: resamples = ", resamples, "; must be >= 1"));
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const RatioItem& it = items[i];
    if (!std::isfinite(it.num) || !std::isfinite(it.den) || it.den < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "BootstrapRatio: item %d is (%g, %g); num must be finite and den "
          "finite and >= 0",
          i, it.num, it.den));
    }
    num += it.num;
    den += it.den;
  }
  if (den == 0) {
    return absl::InvalidArgumentError("BootstrapRatio: the dens sum to 0");
  }
  Interval out;
  out.point = num / den;
  std::mt19937_64 rng(seed);
  const uint64_t n = items.size();
  std::vector<double> stats;
  stats.reserve(resamples);
  for (int b = 0; b < resamples; ++b) {
    double rn = 0, rd = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const RatioItem& it = items[rng() % n];
      rn += it.num;
      rd += it.den;
    }
    if (rd > 0) stats.push_back(rn / rd);
  }
  if (stats.empty()) {
    out.lo = out.hi = out.point;
    return out;
  }
  std::sort(stats.begin(), stats.end());
  auto pct = [&](double q) {
    const double x = q * (stats.size() - 1);
    const size_t i = static_cast<size_t>(std::floor(x));
    const size_t j = std::min(i + 1, stats.size() - 1);
    return stats[i] + (x - i) * (stats[j] - stats[i]);
  };
  out.lo = pct(0.025);
  out.hi = pct(0.975);
  return out;
}

absl::StatusOr<std::vector<RatioItem>> DnllItems(const RawShard& merged,
                                                 const std::string& config,
                                                 const std::string& minus,
                                                 Metric metric) {
  std::map<std::pair<std::string, std::string>, const RawRow*> by;
  std::vector<std::string> order;
  for (const RawRow& r : merged.rows) {
    if (by.emplace(std::make_pair(r.conversation, r.config), &r).second &&
        r.config == "bf16") {
      order.push_back(r.conversation);
    }
  }
  auto sums = [&](const RawRow& r) {
    return metric == Metric::kAll
               ? std::make_pair(r.nll_sum, r.count)
               : std::make_pair(r.answer_nll_sum, r.answer_count);
  };
  std::vector<RatioItem> items;
  for (const std::string& conv : order) {
    const RawRow* bf = by[{conv, "bf16"}];
    auto a = by.find({conv, config});
    if (a == by.end()) continue;
    const RawRow* b = nullptr;
    if (!minus.empty()) {
      auto m = by.find({conv, minus});
      if (m == by.end()) continue;
      b = m->second;
    }
    for (const RawRow* r : {a->second, b}) {
      if (r != nullptr &&
          (r->count != bf->count || r->answer_count != bf->answer_count)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "conversation %s: config %s counts %d tokens (%d answer), bf16 "
            "%d (%d): the runs did not see the same tokens",
            conv, r->config, r->count, r->answer_count, bf->count,
            bf->answer_count));
      }
    }
    RatioItem it;
    it.num = sums(*a->second).first - sums(*bf).first;
    if (b != nullptr) it.num -= sums(*b).first - sums(*bf).first;
    it.den = static_cast<double>(sums(*bf).second);
    items.push_back(it);
  }
  return items;
}

std::string FrontierVerdict::Text() const {
  if (dominated_all.empty() && dominated_answer.empty()) {
    if (comparisons.empty()) {
      return "on or below the frontier (no uniform format of equal or fewer "
             "bytes)";
    }
    std::vector<std::string> single;
    for (const FrontierComparison& c : comparisons) {
      if (c.conversations < 2) single.push_back(c.uniform);
    }
    return single.empty()
               ? "on or below the frontier"
               : absl::StrCat("on or below the frontier (undecided against ",
                              absl::StrJoin(single, ", "),
                              ": fewer than two shared conversations)");
  }
  std::vector<std::string> parts;
  if (!dominated_all.empty()) {
    parts.push_back(absl::StrCat("uniform ", absl::StrJoin(dominated_all, ", "),
                                 " better on all tokens beyond the interval"));
  }
  if (!dominated_answer.empty()) {
    parts.push_back(absl::StrCat(
        "uniform ", absl::StrJoin(dominated_answer, ", "),
        " better on assistant + tool-call tokens beyond the interval"));
  }
  return absl::StrCat("dominated (", absl::StrJoin(parts, "; "), ")");
}

absl::StatusOr<FrontierVerdict> CheckFrontier(const RawShard& merged,
                                              const std::string& triaxial,
                                              int resamples, uint64_t seed) {
  std::map<std::pair<std::string, std::string>, const RawRow*> by;
  std::vector<std::string> uniforms;
  std::set<std::string> seen;
  for (const RawRow& r : merged.rows) {
    by.emplace(std::make_pair(r.conversation, r.config), &r);
    if (r.kind == "uniform" && r.config != "bf16" &&
        seen.insert(r.config).second) {
      uniforms.push_back(r.config);
    }
  }
  // Plan bytes of `a`, `b` and bf16 over the conversations all three ran.
  struct Bytes {
    double a = 0, b = 0, bf = 0;
  };
  auto bytes = [&](const std::string& a, const std::string& b) {
    Bytes out;
    for (const RawRow& r : merged.rows) {
      if (r.config != "bf16") continue;
      auto ra = by.find({r.conversation, a});
      auto rb = by.find({r.conversation, b});
      if (ra == by.end() || rb == by.end()) continue;
      out.a += ra->second->plan_bytes;
      out.b += rb->second->plan_bytes;
      out.bf += r.plan_bytes;
    }
    return out;
  };
  FrontierVerdict v;
  v.triaxial = triaxial;
  const Bytes self = bytes(triaxial, triaxial);
  if (self.bf == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CheckFrontier: config ", triaxial,
                     " has no row in a conversation that has a bf16 row"));
  }
  v.bytes_ratio = self.a / self.bf;
  for (const std::string& u : uniforms) {
    const Bytes b = bytes(triaxial, u);
    if (b.bf == 0 || b.b > b.a) continue;
    FrontierComparison c;
    c.uniform = u;
    c.uniform_bytes_ratio = b.b / b.bf;
    for (Metric m : {Metric::kAll, Metric::kAnswer}) {
      TRIAX_ASSIGN_OR_RETURN(auto items, DnllItems(merged, triaxial, u, m));
      TRIAX_ASSIGN_OR_RETURN(Interval iv,
                             BootstrapRatio(items, resamples, seed));
      (m == Metric::kAll ? c.diff_all : c.diff_answer) = iv;
      c.conversations = static_cast<int>(items.size());
      if (iv.lo > 0 && items.size() >= 2) {
        (m == Metric::kAll ? v.dominated_all : v.dominated_answer).push_back(u);
      }
    }
    v.comparisons.push_back(std::move(c));
  }
  return v;
}

}  // namespace triax::bench
