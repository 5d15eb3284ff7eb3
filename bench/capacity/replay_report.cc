#include "bench/capacity/replay_report.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/svg.h"

namespace triax::bench::capacity {
namespace {

// 1234567 -> "1,234,567".
std::string Thousands(uint64_t v) {
  const std::string digits = absl::StrCat(v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string Seconds(double ms) { return absl::StrFormat("%.1f", ms / 1000.0); }

std::string Ratio(double num, double den) {
  return den > 0 ? absl::StrFormat("%.2fx", num / den) : "-";
}

double MeanOpenArriving(const ReplayCounts& c, int64_t span_ms) {
  return span_ms > 0 ? c.open_ms_arriving / static_cast<double>(span_ms) : 0;
}

// Over every session (those admitted at once wait 0).
std::string MeanWait(const ReplayCounts& c) {
  return c.sessions > 0 ? Seconds(static_cast<double>(c.open_wait_ms) /
                                  static_cast<double>(c.sessions))
                        : "0.0";
}

}  // namespace

std::string TraceSummary(const Trace& trace) {
  std::map<std::string, uint64_t> by_tenant;
  uint64_t turns = 0, max_tokens = 0;
  for (const TraceSession& s : trace.sessions) {
    ++by_tenant[s.tenant];
    turns += s.turns.size();
    max_tokens = std::max(max_tokens, s.Tokens());
  }
  std::vector<std::string> tenants;
  for (const std::string& t : trace.Tenants()) {
    tenants.push_back(absl::StrCat(t, " ", Thousands(by_tenant[t])));
  }
  const uint64_t tokens = trace.Tokens();
  const size_t n = trace.sessions.size();
  return absl::StrCat(
      Thousands(n), " sessions (tenants ", absl::StrJoin(tenants, ", "), "), ",
      Thousands(turns), " turns, ", Thousands(tokens), " tokens (mean ",
      Thousands(n > 0 ? tokens / n : 0), " a session, max ",
      Thousands(max_tokens), "); arrivals over ",
      Seconds(static_cast<double>(trace.sessions.back().arrive_ms -
                                  trace.sessions.front().arrive_ms)),
      " s");
}

std::string ResultsTable(const std::vector<ReplayRow>& rows) {
  std::string out =
      "| policy | admitted (after wait) | completed | refused | dropped | "
      "mean / max Open wait s | turn waits (mean s) | demotions | spills | "
      "evictions | policy demotions | held bits/value | peak open | mean open "
      "while arriving | peak gain | mean gain | admitted gain |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
      "---:|---:|---:|\n";
  if (rows.empty()) return out;
  const ReplayResult& base = rows.front().result;
  for (const ReplayRow& row : rows) {
    const ReplayResult& r = row.result;
    const ReplayCounts& c = r.total;
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "| %s | %s (%s) | %s | %s | %s | %s / %s | %s (%s) | %s | %s | "
            "%s | %s | %.2f | %d | %.1f | %s | %s | %s |\n",
            row.label, Thousands(c.admitted), Thousands(c.admitted_after_wait),
            Thousands(c.completed), Thousands(c.refused), Thousands(c.dropped),
            MeanWait(c), Seconds(static_cast<double>(c.open_wait_max_ms)),
            Thousands(c.turn_waits),
            c.turn_waits > 0 ? Seconds(static_cast<double>(c.turn_wait_ms) /
                                       static_cast<double>(c.turn_waits))
                             : "0.0",
            Thousands(c.demotions), Thousands(c.spills), Thousands(c.evictions),
            Thousands(c.policy_demotions), r.HeldBitsPerValue(), c.peak_open,
            r.MeanOpenArriving(), Ratio(c.peak_open, base.total.peak_open),
            Ratio(r.MeanOpenArriving(), base.MeanOpenArriving()),
            Ratio(static_cast<double>(c.admitted),
                  static_cast<double>(base.total.admitted))));
  }
  return out;
}

std::string TenantTable(const std::vector<ReplayRow>& rows) {
  std::string out =
      "| policy | tenant | sessions | admitted | completed | refused | "
      "dropped | mean Open wait s | demotions + spills + evictions | peak "
      "open | mean open while arriving | peak device share |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const ReplayRow& row : rows) {
    const ReplayResult& r = row.result;
    for (size_t t = 0; t < r.tenants.size(); ++t) {
      const ReplayCounts& c = r.by_tenant[t];
      absl::StrAppend(
          &out,
          absl::StrFormat(
              "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %d | %.1f | "
              "%.1f%% |\n",
              row.label, r.tenants[t], Thousands(c.sessions),
              Thousands(c.admitted), Thousands(c.completed),
              Thousands(c.refused), Thousands(c.dropped), MeanWait(c),
              Thousands(c.demotions + c.spills + c.evictions), c.peak_open,
              MeanOpenArriving(c, r.arrival_span_ms),
              r.device_capacity > 0
                  ? 100.0 * static_cast<double>(c.peak_device_bytes) /
                        static_cast<double>(r.device_capacity)
                  : 0.0));
    }
  }
  return out;
}

std::string ChecksTable(const std::vector<ReplayRow>& rows) {
  std::string out =
      "| policy | simulated s | tier plans | admission / restore rounds | "
      "background rounds | planned blocks not applied | counts = core's | "
      "restores | wall s |\n"
      "|---|---:|---:|---:|---:|---:|---|---:|---:|\n";
  for (const ReplayRow& row : rows) {
    const ReplayResult& r = row.result;
    const ReplayCounts& c = r.total;
    const bool same =
        c.demotions == r.core_demotions && c.spills == r.core_spills &&
        c.restores == r.core_restores && c.evictions == r.core_evictions;
    absl::StrAppend(
        &out,
        absl::StrFormat("| %s | %s | %s | %s | %s | %s | %s | %s | %.1f |\n",
                        row.label, Seconds(static_cast<double>(r.span_ms)),
                        Thousands(r.plans), Thousands(r.reclaim_rounds),
                        Thousands(r.background_rounds), Thousands(r.unapplied),
                        same ? "yes" : "NO", Thousands(c.restores), r.wall_s));
  }
  return out;
}

std::string ShareSvg(const ReplayRow& row, const std::string& title,
                     size_t max_points) {
  const ReplayResult& r = row.result;
  const size_t n = r.samples.size();
  const size_t step =
      max_points > 0 && n > max_points ? (n + max_points - 1) / max_points : 1;
  std::vector<size_t> picked;
  for (size_t i = 0; i < n; i += step) picked.push_back(i);
  if (n > 0 && picked.back() != n - 1) picked.push_back(n - 1);
  const double end_s =
      n > 0 ? std::max(1.0, static_cast<double>(r.samples.back().t_ms) / 1e3)
            : 1.0;
  std::vector<std::string> ticks;
  for (int t = 0; t <= 4; ++t) {
    ticks.push_back(absl::StrFormat("%.0f s", end_s * t / 4.0));
  }
  const double capacity =
      r.device_capacity > 0 ? static_cast<double>(r.device_capacity) : 1.0;
  std::vector<svg::Series> share, open;
  double max_share = 1, max_open = 1;
  for (size_t t = 0; t < r.tenants.size(); ++t) {
    svg::Series s{r.tenants[t], {}}, o{r.tenants[t], {}};
    for (size_t i : picked) {
      const ReplaySample& x = r.samples[i];
      const double at = static_cast<double>(x.t_ms) / 1e3;
      s.points.emplace_back(
          at, 100.0 * static_cast<double>(x.device_bytes[t]) / capacity);
      o.points.emplace_back(at, x.open[t]);
      max_share = std::max(max_share, s.points.back().second);
      max_open = std::max(max_open, o.points.back().second);
    }
    share.push_back(std::move(s));
    open.push_back(std::move(o));
  }
  svg::LinePanel top;
  top.title =
      absl::StrCat(title, ": each tenant's device bytes, % of the pool");
  top.top = 0;
  top.x_max = end_s;
  top.y_max = std::min(100.0, std::ceil(max_share / 10.0) * 10.0);
  top.y_max = std::max(top.y_max, max_share);
  top.y_max_label = absl::StrFormat("%.0f%%", top.y_max);
  top.x_ticks = ticks;
  top.css_class = "share";
  std::string body;
  const int h1 = svg::AppendLinePanel(top, share, &body);
  svg::LinePanel bottom = top;
  bottom.title = "open sessions per tenant";
  bottom.top = h1;
  bottom.y_max = max_open;
  bottom.y_max_label = absl::StrFormat("%.0f", max_open);
  bottom.css_class = "open";
  const int h2 = svg::AppendLinePanel(bottom, open, &body);
  return absl::StrCat(svg::Open(top.left + top.width + 200, h1 + h2), body,
                      "</svg>\n");
}

}  // namespace triax::bench::capacity
