#include "bench/policy/policy_report.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace triax::bench {
namespace {

// A point of the main triaxial sweep: "tri-<budget>" or "tri-<budget>-w<N>"
// (no answer weight or second objective: policy_bench names those
// tri-<budget>-a<w> and tri-<budget>-<objective>).
bool IsMainSweep(const std::string& name) {
  std::vector<absl::string_view> parts = absl::StrSplit(name, '-');
  if (parts.size() < 2 || parts.size() > 3 || parts[0] != "tri") return false;
  double b;
  if (!absl::SimpleAtod(parts[1], &b)) return false;
  return parts.size() == 2 || (parts[2].size() > 1 && parts[2][0] == 'w' &&
                               parts[2].find_first_not_of("0123456789", 1) ==
                                   absl::string_view::npos);
}

// The full policy an ablation is compared with: its name less "-no-<axis>"
// ("tri-3.5-no-role-w32" -> "tri-3.5-w32").
std::string AblationBase(const std::string& name) {
  const size_t at = name.find("-no-");
  if (at == std::string::npos) return "";
  const size_t end = name.find('-', at + 4);
  return name.substr(0, at) +
         (end == std::string::npos ? "" : name.substr(end));
}

using RowKey = std::pair<std::string, std::string>;  // (conversation, config)

std::map<RowKey, const RawRow*> Index(const RawShard& merged) {
  std::map<RowKey, const RawRow*> by;
  for (const RawRow& r : merged.rows)
    by.emplace(RowKey(r.conversation, r.config), &r);
  return by;
}

// Conversations with a bf16 row, in row order.
std::vector<std::string> Conversations(const RawShard& merged) {
  std::vector<std::string> out;
  for (const RawRow& r : merged.rows) {
    if (r.config == "bf16") out.push_back(r.conversation);
  }
  return out;
}

std::string Ci(const Interval& iv) {
  return absl::StrFormat("%+.4f [%+.4f, %+.4f]", iv.point, iv.lo, iv.hi);
}

// "multi_turn_base_42" -> "42".
std::string ShortId(const std::string& id) {
  constexpr absl::string_view kPrefix = "multi_turn_base_";
  return absl::StartsWith(id, kPrefix) ? id.substr(kPrefix.size()) : id;
}

std::string SummaryHeader() {
  return "| config | kind | budget | window | convs | bits/value (plan) | "
         "plan bytes vs bf16 | worker bytes vs bf16 | ΔNLL all [95% CI] | "
         "ΔNLL assistant+tool-call [95% CI] | KL(bf16‖cfg) | top-1 agree | "
         "attn err | final plan mix (tokens) |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
}

std::string SummaryRow(const ConfigSummary& c) {
  return absl::StrFormat(
      "| %s | %s | %s | %d | %d | %.3f | %.3f | %.3f | %s | %s | %.5f | "
      "%.4f | %s | %s |\n",
      c.name, c.kind, c.budget > 0 ? absl::StrFormat("%g", c.budget) : "-",
      c.window, c.conversations, c.bits, c.bytes_ratio, c.worker_ratio,
      Ci(c.dnll_all), Ci(c.dnll_answer), c.kl, c.top1,
      c.attn_err < 0 ? "-" : absl::StrFormat("%.4f", c.attn_err), c.mix);
}

}  // namespace

absl::StatusOr<std::vector<ConfigSummary>> Summarize(const RawShard& merged,
                                                     const ReportOptions& o) {
  const auto by = Index(merged);
  const std::vector<std::string> convs = Conversations(merged);
  if (convs.empty()) {
    return absl::InvalidArgumentError(
        "no bf16 row: every statistic is relative to the bf16 run");
  }
  std::vector<std::string> names;
  std::set<std::string> seen;
  names.push_back("bf16");
  seen.insert("bf16");
  for (const RawRow& r : merged.rows) {
    if (seen.insert(r.config).second) names.push_back(r.config);
  }
  // Uniform, then triaxial, then ablations; first-seen order within each.
  auto rank = [&](const std::string& name) {
    for (const RawRow& r : merged.rows) {
      if (r.config == name) {
        return r.kind == "uniform" ? 0 : r.kind == "triaxial" ? 1 : 2;
      }
    }
    return 0;
  };
  std::stable_sort(names.begin() + 1, names.end(),
                   [&](const std::string& a, const std::string& b) {
                     return rank(a) < rank(b);
                   });
  std::vector<ConfigSummary> out;
  for (const std::string& name : names) {
    ConfigSummary s;
    s.name = name;
    double plan = 0, worker = 0, bf_plan = 0, bf_worker = 0, kl = 0;
    double bits_den = 0;
    int64_t count = 0, top1 = 0;
    std::map<std::string, uint64_t> mix;
    std::vector<LayerErrSums> attn;
    bool have_attn = false;
    for (const std::string& conv : convs) {
      auto it = by.find({conv, name});
      if (it == by.end()) continue;
      const RawRow& r = *it->second;
      const RawRow& bf = *by.at({conv, "bf16"});
      s.kind = r.kind;
      s.budget = r.budget;
      s.window = r.window;
      s.note = r.note;
      ++s.conversations;
      plan += r.plan_bytes;
      worker += r.worker_bytes;
      bf_plan += bf.plan_bytes;
      bf_worker += bf.worker_bytes;
      bits_den += static_cast<double>(r.seq_tokens) * r.values_per_token;
      kl += r.kl_sum;
      count += r.count;
      top1 += r.top1_agree;
      for (const auto& [k, v] : r.tokens_by_encoding) mix[k] += v;
      if (!r.attn.empty()) {
        have_attn = true;
        attn.resize(std::max(attn.size(), r.attn.size()));
        for (size_t l = 0; l < r.attn.size(); ++l) {
          attn[l].sum_sq_diff += r.attn[l].sum_sq_diff;
          attn[l].sum_sq_ref += r.attn[l].sum_sq_ref;
          attn[l].queries += r.attn[l].queries;
        }
      }
    }
    if (s.conversations == 0) continue;
    s.bits = bits_den > 0 ? plan * 8 / bits_den : 0;
    s.bytes_ratio = bf_plan > 0 ? plan / bf_plan : 0;
    s.worker_ratio = bf_worker > 0 ? worker / bf_worker : 0;
    s.kl = count ? kl / count : 0;
    s.top1 = count ? static_cast<double>(top1) / count : 0;
    if (have_attn) {
      double sum = 0;
      for (const auto& e : attn) {
        sum += e.queries && e.sum_sq_ref > 0
                   ? std::sqrt(e.sum_sq_diff / e.sum_sq_ref)
                   : 0.0;
      }
      s.attn_err = sum / attn.size();
    }
    uint64_t total = 0;
    for (const auto& [k, v] : mix) total += v;
    std::vector<std::string> parts;
    for (const auto& [k, v] : mix) {
      parts.push_back(absl::StrFormat("%s %.0f%%", k, 100.0 * v / total));
    }
    s.mix = absl::StrJoin(parts, ", ");
    for (Metric m : {Metric::kAll, Metric::kAnswer}) {
      TRIAX_ASSIGN_OR_RETURN(auto items, DnllItems(merged, name, "", m));
      TRIAX_ASSIGN_OR_RETURN(Interval iv,
                             BootstrapRatio(items, o.resamples, o.seed));
      (m == Metric::kAll ? s.dnll_all : s.dnll_answer) = iv;
    }
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<std::string> BuildReport(const RawShard& merged,
                                        const ReportOptions& o) {
  TRIAX_ASSIGN_OR_RETURN(std::vector<ConfigSummary> sums, Summarize(merged, o));
  const auto by = Index(merged);
  const std::vector<std::string> convs = Conversations(merged);
  std::string md;

  // Conversations.
  int64_t tokens = 0, answer = 0;
  for (const std::string& c : convs) {
    tokens += by.at({c, "bf16"})->count;
    answer += by.at({c, "bf16"})->answer_count;
  }
  absl::StrAppend(&md,
                  absl::StrFormat("Conversations: %d (%d predicted tokens, %d "
                                  "assistant/tool-call tokens).\n\n",
                                  convs.size(), tokens, answer));
  for (const auto& [id, note] : merged.sessions) {
    absl::StrAppend(&md, "- ", note, "\n");
  }
  for (const auto& [id, why] : merged.skipped) {
    absl::StrAppend(&md, "- skipped ", id, ": ", why, "\n");
  }
  for (const auto& [key, text] : merged.notes) {
    absl::StrAppend(&md, "\n", key, ": ", text, "\n");
  }
  absl::StrAppend(
      &md, absl::StrFormat(
               "\nIntervals: 95%% session bootstrap (conversations resampled "
               "with replacement, %d resamples, seed %d; token-weighted "
               "means). ΔNLL in nats per token against the bf16 run of the "
               "same conversation.\n\n",
               o.resamples, o.seed));

  // Frontier table.
  absl::StrAppend(&md, "## Frontier table\n\n", SummaryHeader());
  for (const ConfigSummary& s : sums) {
    if (s.kind != "ablation") absl::StrAppend(&md, SummaryRow(s));
  }

  // Per conversation.
  std::vector<std::string> head = {"config"};
  for (const std::string& c : convs) head.push_back(ShortId(c));
  std::string sep = "|";
  for (size_t i = 0; i < head.size(); ++i) sep += "---|";
  for (Metric m : {Metric::kAll, Metric::kAnswer}) {
    absl::StrAppend(
        &md,
        m == Metric::kAll
            ? "\n## Per conversation: ΔNLL all tokens\n\n"
            : "\n## Per conversation: ΔNLL assistant + tool-call tokens\n\n",
        "Columns: multi_turn_base_<id>.\n\n| ", absl::StrJoin(head, " | "),
        " |\n", sep, "\n");
    for (const ConfigSummary& s : sums) {
      if (s.name == "bf16") continue;
      std::vector<std::string> cells = {s.name};
      for (const std::string& c : convs) {
        auto it = by.find({c, s.name});
        if (it == by.end()) {
          cells.push_back("-");
          continue;
        }
        const RawRow& r = *it->second;
        const RawRow& bf = *by.at({c, "bf16"});
        const double d =
            m == Metric::kAll
                ? (r.count ? (r.nll_sum - bf.nll_sum) / r.count : 0)
                : (r.answer_count
                       ? (r.answer_nll_sum - bf.answer_nll_sum) / r.answer_count
                       : 0);
        cells.push_back(absl::StrFormat("%+.4f", d));
      }
      absl::StrAppend(&md, "| ", absl::StrJoin(cells, " | "), " |\n");
    }
  }

  // Frontier check.
  absl::StrAppend(
      &md,
      "\n## Frontier check\n\n"
      "For each triaxial point, every uniform configuration whose plan bytes "
      "(over the same conversations) are <= its own: the paired difference "
      "triaxial − uniform of ΔNLL on the same resamples (negative: the "
      "triaxial point is better). Dominated when an interval lies wholly "
      "above 0 over at least two shared conversations (one conversation "
      "gives a point, not an interval, and decides nothing). Plan bytes leave "
      "out BF16 window pages (the worker "
      "bytes column of the frontier table has them).\n\n"
      "| triaxial | its bytes vs bf16 | uniform | its bytes vs bf16 | convs | "
      "tri − uni, all [95% CI] | tri − uni, assistant+tool-call [95% CI] |\n"
      "|---|---|---|---|---|---|---|\n");
  std::string verdicts =
      "\n| triaxial | bytes vs bf16 | ΔNLL all | ΔNLL assistant+tool-call | "
      "verdict |\n|---|---|---|---|---|\n";
  int dominated = 0, points = 0;
  for (const ConfigSummary& s : sums) {
    if (s.kind != "triaxial") continue;
    ++points;
    TRIAX_ASSIGN_OR_RETURN(FrontierVerdict v,
                           CheckFrontier(merged, s.name, o.resamples, o.seed));
    for (const FrontierComparison& c : v.comparisons) {
      absl::StrAppend(
          &md,
          absl::StrFormat("| %s | %.3f | %s | %.3f | %d | %s | %s |\n", s.name,
                          v.bytes_ratio, c.uniform, c.uniform_bytes_ratio,
                          c.conversations, Ci(c.diff_all), Ci(c.diff_answer)));
    }
    if (v.comparisons.empty()) {
      absl::StrAppend(
          &md, absl::StrFormat(
                   "| %s | %.3f | none with <= bytes | - | - | - | - |\n",
                   s.name, v.bytes_ratio));
    }
    if (!v.dominated_all.empty() || !v.dominated_answer.empty()) ++dominated;
    absl::StrAppend(&verdicts,
                    absl::StrFormat("| %s | %.3f | %+.4f | %+.4f | %s |\n",
                                    s.name, v.bytes_ratio, s.dnll_all.point,
                                    s.dnll_answer.point, v.Text()));
  }
  absl::StrAppend(&md, verdicts,
                  absl::StrFormat("\n%d of %d triaxial points dominated; %d on "
                                  "or below the uniform frontier.\n",
                                  dominated, points, points - dominated));

  // Ablations: the triaxial point at the ablation budget with the same
  // window as each ablation, and the paired difference ablation − it.
  std::string abl;
  for (const ConfigSummary& a : sums) {
    if (a.kind != "ablation") continue;
    const ConfigSummary* base = nullptr;
    for (const ConfigSummary& s : sums) {
      if (s.kind == "triaxial" && s.name == AblationBase(a.name)) base = &s;
    }
    absl::StrAppend(&abl, SummaryRow(a));
    if (base == nullptr) continue;
    std::string d[2] = {"-", "-"};
    int shared = 0;
    for (Metric m : {Metric::kAll, Metric::kAnswer}) {
      TRIAX_ASSIGN_OR_RETURN(auto items,
                             DnllItems(merged, a.name, base->name, m));
      shared = static_cast<int>(items.size());
      if (items.empty()) continue;
      TRIAX_ASSIGN_OR_RETURN(Interval iv,
                             BootstrapRatio(items, o.resamples, o.seed));
      d[m == Metric::kAll ? 0 : 1] = Ci(iv);
    }
    absl::StrAppend(
        &abl, absl::StrFormat("| ↳ %s − %s | paired | | | %d | | | | %s | %s "
                              "| | | | |\n",
                              a.name, base->name, shared, d[0], d[1]));
  }
  if (!abl.empty()) {
    std::string base_rows;
    std::set<std::string> done;
    for (const ConfigSummary& a : sums) {
      if (a.kind != "ablation") continue;
      for (const ConfigSummary& s : sums) {
        if (s.kind == "triaxial" && s.name == AblationBase(a.name) &&
            done.insert(s.name).second) {
          base_rows += SummaryRow(s);
        }
      }
    }
    absl::StrAppend(
        &md,
        absl::StrFormat("\n## Ablations at %g bits\n\n", o.ablation_budget),
        "Each ablation's allocator cannot tell tags apart along "
        "one axis; ↳ rows: paired difference ablation − full "
        "policy (positive: the axis helps).\n\n",
        SummaryHeader(), base_rows, abl);
  }

  // The point of the main sweep (IsMainSweep; any triaxial point when the
  // run has none) nearest target_ratio of BF16 bytes against INT4.
  const ConfigSummary* near = nullptr;
  const ConfigSummary* int4 = nullptr;
  bool any_main = false;
  for (const ConfigSummary& s : sums) {
    any_main |= s.kind == "triaxial" && IsMainSweep(s.name);
  }
  for (const ConfigSummary& s : sums) {
    if (s.name == "int4") int4 = &s;
    if (s.kind != "triaxial") continue;
    if (any_main && !IsMainSweep(s.name)) continue;
    if (near == nullptr || std::abs(s.bytes_ratio - o.target_ratio) <
                               std::abs(near->bytes_ratio - o.target_ratio)) {
      near = &s;
    }
  }
  absl::StrAppend(&md, absl::StrFormat("\n## %.1fx less KV than BF16\n\n",
                                       1.0 / o.target_ratio));
  if (near == nullptr || int4 == nullptr) {
    absl::StrAppend(&md, "Not computed: the run has ",
                    near == nullptr ? "no triaxial point" : "no int4 row",
                    ".\n");
  } else {
    TRIAX_ASSIGN_OR_RETURN(auto items,
                           DnllItems(merged, near->name, "int4", Metric::kAll));
    std::string diff = "no conversation in common";
    if (!items.empty()) {
      TRIAX_ASSIGN_OR_RETURN(Interval d,
                             BootstrapRatio(items, o.resamples, o.seed));
      diff = Ci(d);
    }
    absl::StrAppend(
        &md,
        absl::StrFormat(
            "The triaxial point nearest %.3f of the BF16 plan bytes is %s at "
            "%.3f (%.2fx less than BF16): ΔNLL all %s against uniform INT4's "
            "%s at %.3f (%.2fx); paired difference %s − int4 on all tokens: "
            "%s.\n",
            o.target_ratio, near->name, near->bytes_ratio,
            near->bytes_ratio > 0 ? 1.0 / near->bytes_ratio : 0.0,
            Ci(near->dnll_all), Ci(int4->dnll_all), int4->bytes_ratio,
            int4->bytes_ratio > 0 ? 1.0 / int4->bytes_ratio : 0.0, near->name,
            diff));
  }
  return md;
}

}  // namespace triax::bench
