#include "bench/pressure/replay/replay_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace triax::bench::replay {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string Mib(uint64_t bytes) {
  return absl::StrFormat("%.1f MiB", bytes / kMiB);
}

}  // namespace

const std::vector<std::string>& CalibrationIds() {
  static const auto* ids = new std::vector<std::string>{
      "multi_turn_base_1",   "multi_turn_base_25", "multi_turn_base_33",
      "multi_turn_base_67",  "multi_turn_base_71", "multi_turn_base_102",
      "multi_turn_base_114", "multi_turn_base_142"};
  return *ids;
}

absl::StatusOr<std::vector<std::string>> ParseSessionIds(
    const std::string& flag, const std::string& csv, int max_sessions) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  const std::set<std::string> calibration(CalibrationIds().begin(),
                                          CalibrationIds().end());
  for (absl::string_view part : absl::StrSplit(csv, ',', absl::SkipEmpty())) {
    const std::string id(absl::StripAsciiWhitespace(part));
    uint32_t n;
    constexpr absl::string_view kPrefix = "multi_turn_base_";
    if (!absl::StartsWith(id, kPrefix) ||
        !absl::SimpleAtoi(id.substr(kPrefix.size()), &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": \"", id, "\" is not multi_turn_base_<n>"));
    }
    if (calibration.count(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": \"", id,
                       "\" is a calibration conversation of kvproxy-18m "
                       "(bench/results/calibration.md); pick another"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": \"", id, "\" is listed twice"));
    }
    out.push_back(id);
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", csv, "\" names no conversation"));
  }
  if (max_sessions > 0 && out.size() > static_cast<size_t>(max_sessions)) {
    out.resize(max_sessions);
  }
  return out;
}

uint64_t Bf16PlanBytes(uint64_t tokens, uint32_t block_tokens,
                       uint64_t bf16_block_bytes, int n_layers) {
  if (tokens == 0 || block_tokens == 0 || bf16_block_bytes == 0 ||
      n_layers <= 0) {
    return 0;
  }
  const uint64_t blocks = (tokens + block_tokens - 1) / block_tokens;
  return blocks * bf16_block_bytes * static_cast<uint64_t>(n_layers);
}

absl::StatusOr<PoolSize> SizePool(uint64_t total_bytes, double fraction) {
  if (total_bytes == 0) {
    return absl::InvalidArgumentError("pool size: total_bytes=0");
  }
  if (!(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool size: fraction=", fraction, " is not in (0, 1]"));
  }
  PoolSize p;
  p.total_bytes = total_bytes;
  p.fraction = fraction;
  p.pool_mb = static_cast<int>(std::ceil(total_bytes * fraction / kMiB));
  if (p.pool_mb < 1) p.pool_mb = 1;
  return p;
}

std::string PoolSize::Explain(int sessions, uint64_t tokens) const {
  const double pool = pool_mb * kMiB;
  return absl::StrFormat(
      "%d sessions, %d tokens, BF16 final KV %s x %.3f = %s -> --pool_mb=%d "
      "(holds %.1f%% of it)",
      sessions, tokens, Mib(total_bytes), fraction,
      Mib(static_cast<uint64_t>(total_bytes * fraction)), pool_mb,
      100.0 * pool / total_bytes);
}

std::vector<Step> RoundRobin(const std::vector<int>& turns) {
  std::vector<Step> steps;
  int max_turns = 0;
  for (int t : turns) max_turns = std::max(max_turns, t);
  for (int t = 0; t < max_turns; ++t) {
    for (size_t s = 0; s < turns.size(); ++s) {
      if (t < turns[s]) steps.push_back({static_cast<int>(s), t});
    }
  }
  return steps;
}

absl::StatusOr<std::vector<Step>> IdleRounds(const std::vector<int>& turns,
                                             double active_fraction,
                                             uint32_t seed,
                                             int max_idle_rounds) {
  if (!(active_fraction > 0 && active_fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "active_fraction=", active_fraction, "; must be in (0, 1]"));
  }
  if (max_idle_rounds < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_idle_rounds=", max_idle_rounds, "; must be >= 0"));
  }
  std::vector<Step> steps;
  std::vector<int> next(turns.size(), 0), idle(turns.size(), 0);
  for (size_t s = 0; s < turns.size(); ++s) {
    if (turns[s] > 0) {
      steps.push_back({static_cast<int>(s), 0});
      next[s] = 1;
    }
  }
  // A 32-bit xorshift: the same rounds on every platform for a seed.
  uint32_t x = seed == 0 ? 0x9e3779b9u : seed;
  auto uniform = [&x] {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return static_cast<double>(x) / 4294967296.0;
  };
  for (;;) {
    std::vector<int> active;
    int first_left = -1;
    for (size_t s = 0; s < turns.size(); ++s) {
      if (next[s] >= turns[s]) continue;
      if (first_left < 0) first_left = static_cast<int>(s);
      const bool drawn = uniform() < active_fraction;
      if (drawn || idle[s] >= max_idle_rounds) {
        active.push_back(static_cast<int>(s));
      }
    }
    if (first_left < 0) break;
    if (active.empty()) active.push_back(first_left);
    for (size_t s = 0; s < turns.size(); ++s) {
      if (next[s] < turns[s]) ++idle[s];
    }
    for (int s : active) {
      steps.push_back({s, next[s]++});
      idle[s] = 0;
    }
  }
  return steps;
}

AccessReport BlockWeights(const std::vector<BlockSpan>& blocks,
                          const std::vector<double>& token_mass) {
  AccessReport r;
  std::vector<double> mass;
  double total = 0;
  const int64_t n = static_cast<int64_t>(token_mass.size());
  for (const BlockSpan& b : blocks) {
    if (!b.live) continue;
    double m = 0;
    const int64_t end = std::min(n, b.first_token + b.num_tokens);
    for (int64_t t = std::max<int64_t>(0, b.first_token); t < end; ++t) {
      m += token_mass[static_cast<size_t>(t)];
    }
    r.lineage_ids.push_back(b.lineage_id);
    mass.push_back(m);
    total += m;
  }
  r.weights.reserve(mass.size());
  for (double m : mass) {
    r.weights.push_back(
        total > 0 ? std::clamp(static_cast<float>(m / total), 0.0f, 1.0f)
                  : 0.0f);
  }
  return r;
}

absl::Status WriteReferences(const std::string& path,
                             const std::vector<SessionReference>& refs) {
  std::string text = "triax-replay-reference 1\n";
  for (const SessionReference& r : refs) {
    absl::StrAppend(&text, "session ", r.id, " ", r.nll.size(), " ",
                    r.turn_mass.size(), "\n");
    for (double x : r.nll) absl::StrAppendFormat(&text, "%.17g\n", x);
    for (const auto& m : r.turn_mass) {
      absl::StrAppend(&text, "mass ", m.size(), "\n");
      for (double x : m) absl::StrAppendFormat(&text, "%.17g\n", x);
    }
  }
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) {
    return absl::InternalError(absl::StrCat("writing ", path, " failed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SessionReference>> ReadReferences(
    const std::string& path, const std::vector<std::string>& ids,
    const std::vector<size_t>& tokens) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("no ", path));
  std::string text;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) {
    text.append(buf, n);
  }
  std::fclose(f);
  std::vector<absl::string_view> lines =
      absl::StrSplit(text, '\n', absl::SkipEmpty());
  size_t at = 0;
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(
        absl::StrCat(path, " line ", at + 1, ": ", what));
  };
  // Each reader consumes its line only when it parses, so `bad` names the
  // line that did not.
  auto number = [&](double* x) {
    if (at >= lines.size() || !absl::SimpleAtod(lines[at], x)) return false;
    ++at;
    return true;
  };
  if (lines.empty() || lines[at] != "triax-replay-reference 1") {
    return bad("not a replay reference file (version 1)");
  }
  ++at;
  std::vector<SessionReference> out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (at >= lines.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " holds ", i, " sessions; want ", ids.size()));
    }
    std::vector<absl::string_view> head = absl::StrSplit(lines[at], ' ');
    size_t n = 0, turns = 0;
    if (head.size() != 4 || head[0] != "session" ||
        !absl::SimpleAtoi(head[2], &n) || !absl::SimpleAtoi(head[3], &turns)) {
      return bad("want \"session ID TOKENS TURNS\"");
    }
    ++at;
    if (head[1] != ids[i] || n != tokens[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " session ", i, " is ", head[1], " with ", n,
                       " tokens; want ", ids[i], " with ", tokens[i]));
    }
    SessionReference r;
    r.id = ids[i];
    r.nll.resize(n);
    for (double& x : r.nll) {
      if (!number(&x)) return bad("want a number");
    }
    for (size_t t = 0; t < turns; ++t) {
      size_t m = 0;
      absl::string_view line = at < lines.size() ? lines[at] : "";
      if (!absl::ConsumePrefix(&line, "mass ") || !absl::SimpleAtoi(line, &m)) {
        return bad("want \"mass N\"");
      }
      ++at;
      r.turn_mass.emplace_back(m);
      for (double& x : r.turn_mass.back()) {
        if (!number(&x)) return bad("want a number");
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

void ModeResult::AddScore(int session, int turn, double service_nll,
                          double reference_nll) {
  const double d = service_nll - reference_nll;
  ++scored;
  dnll_sum += d;
  if (turn >= 1) {
    ++scored_late;
    dnll_late_sum += d;
  }
  auto& t = by_turn[{session, turn}];
  t.first += d;
  ++t.second;
}

CommonTurns CommonLaterTurns(const std::vector<ModeResult>& results) {
  CommonTurns c;
  c.mean_dnll.assign(results.size(), std::nan(""));
  if (results.empty()) return c;
  std::vector<std::pair<int, int>> common;
  for (const auto& [key, v] : results[0].by_turn) {
    if (key.second < 1) continue;
    bool everywhere = true;
    for (size_t i = 1; i < results.size() && everywhere; ++i) {
      everywhere = results[i].by_turn.count(key) > 0;
    }
    if (everywhere) common.push_back(key);
  }
  c.turns = static_cast<int>(common.size());
  for (size_t i = 0; i < results.size(); ++i) {
    double sum = 0;
    int64_t n = 0;
    for (const auto& key : common) {
      const auto& v = results[i].by_turn.at(key);
      sum += v.first;
      n += v.second;
    }
    if (i == 0) c.tokens = n;
    if (n > 0) c.mean_dnll[i] = sum / n;
  }
  return c;
}

std::string ResultsTable(const std::vector<ModeResult>& results) {
  std::string md =
      "| mode | policy | sessions | admitted (after wait) | rejected at "
      "Open / Extend / resume | other failures | completed | turns | tokens | "
      "tokens "
      "scored | mean ΔNLL all turns | mean ΔNLL turns ≥ 2 (scored) | mean "
      "ΔNLL on the later turns every row replayed | "
      "demotions | spills | restores | evictions | worker spills / "
      "restores / evictions / checksum failures | peak device (pool) | wall "
      "s |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
      "---:|---:|---:|---:|---:|---:|\n";
  const CommonTurns common = CommonLaterTurns(results);
  for (size_t i = 0; i < results.size(); ++i) {
    const ModeResult& r = results[i];
    const double cd = common.mean_dnll[i];
    const std::string common_cell =
        std::isnan(cd) ? std::string("-")
                       : absl::StrFormat("%+.4f (%d turns, %d tokens)", cd,
                                         common.turns, common.tokens);
    md += absl::StrFormat(
        "| %s | %s | %d | %d (%d) | %d / %d / %d | %d | %d | %d | %d | %d | "
        "%+.4f | %+.4f (%d) | %s | %d | %d | %d | %d | %d / %d / %d / %d | "
        "%s (%s) | %.0f |\n",
        r.mode, r.policy, r.sessions, r.admitted, r.admitted_after_wait,
        r.rejected_open, r.rejected_extend, r.rejected_resume, r.failed,
        r.completed, r.turns, r.tokens, r.scored, r.mean_dnll(),
        r.mean_dnll_late(), r.scored_late, common_cell, r.demotions, r.spills,
        r.restores, r.evictions, r.worker_spills, r.worker_restores,
        r.worker_evictions, r.checksum_failures, Mib(r.peak_device_bytes),
        Mib(r.pool_bytes), r.seconds);
  }
  std::set<std::string> keys;
  for (const ModeResult& r : results) {
    for (const auto& [k, v] : r.final_blocks) keys.insert(k);
  }
  if (keys.empty()) return md;
  md += "\nFinal plans of the sessions still open at the end (blocks):\n\n";
  md += absl::StrCat("| mode | policy | ", absl::StrJoin(keys, " | "),
                     " |\n|---|---|");
  for (size_t i = 0; i < keys.size(); ++i) md += "---:|";
  md += "\n";
  for (const ModeResult& r : results) {
    md += absl::StrCat("| ", r.mode, " | ", r.policy, " |");
    for (const auto& k : keys) {
      auto it = r.final_blocks.find(k);
      md +=
          absl::StrCat(" ", it == r.final_blocks.end() ? 0 : it->second, " |");
    }
    md += "\n";
  }
  return md;
}

}  // namespace triax::bench::replay
