#include "kvmanager/allocator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace triax::manager {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A non-dominated option of a free group, in weighted units.
struct Item {
  int option = 0;  // index into AllocGroup::options
  double c = 0;    // N_k * bits
  double d = 0;    // N_k * distortion
};

// One step along a group's lower convex hull, items[from] -> items[to].
struct Segment {
  int g = 0;  // index into Prepared::free
  int from = 0, to = 0;
  double dc = 0, dd = 0;  // cost increase > 0, distortion drop > 0
  double slope = 0;       // dd / dc
};

// The problem reduced to its free groups (not pinned, N_k > 0).
struct Prepared {
  double weight = 0;  // sum N_k over all groups
  // Internal capacity: half the public tolerance, so that sums accumulated
  // in a different order still pass IsWithinBudget.
  double cap = 0;
  double fixed_cost = 0, fixed_dist = 0;  // pinned and zero-weight groups
  std::vector<int> fixed_choice;          // per group; -1 for free groups
  std::vector<int> free;                  // group index of each free group
  // Per free group: cost strictly increasing, distortion strictly decreasing.
  std::vector<std::vector<Item>> items;
  std::vector<Segment> segments;       // all hull segments, best slope first
  std::vector<std::vector<int>> hull;  // per free group: item indices
  double min_free_cost = 0;            // sum of items[g][0].c
};

std::string Num(double v) { return absl::StrFormat("%.6g", v); }

// Points sorted by cost: keep those that lower the running minimum
// distortion (ties on cost keep the least distortion, then the first index).
std::vector<Item> NonDominated(const AllocGroup& g) {
  const double n = static_cast<double>(g.tokens);
  std::vector<Item> all;
  all.reserve(g.options.size());
  for (size_t i = 0; i < g.options.size(); ++i) {
    all.push_back({static_cast<int>(i), n * g.options[i].bits,
                   n * g.options[i].distortion});
  }
  std::stable_sort(all.begin(), all.end(), [](const Item& a, const Item& b) {
    if (a.c != b.c) return a.c < b.c;
    return a.d < b.d;
  });
  std::vector<Item> out;
  for (const Item& it : all) {
    // Equal cost with equal or higher distortion never passes this test.
    if (out.empty() || it.d < out.back().d) out.push_back(it);
  }
  return out;
}

// Lower convex hull of items (cost increasing, distortion decreasing):
// drop b when it lies on or above the segment a-c.
std::vector<int> LowerHull(const std::vector<Item>& items) {
  std::vector<int> h;
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    while (h.size() >= 2) {
      const Item& a = items[h[h.size() - 2]];
      const Item& b = items[h.back()];
      const Item& c = items[i];
      // b on or above line a-c  <=>  (b.d - a.d)(c.c - a.c) >= (c.d - a.d)(b.c
      // - a.c)
      if ((b.d - a.d) * (c.c - a.c) >= (c.d - a.d) * (b.c - a.c)) {
        h.pop_back();
      } else {
        break;
      }
    }
    h.push_back(i);
  }
  return h;
}

absl::StatusOr<Prepared> Prepare(const AllocProblem& p) {
  TRIAX_RETURN_IF_ERROR(ValidateAllocProblem(p));
  Prepared q;
  const size_t n = p.groups.size();
  q.fixed_choice.assign(n, -1);
  for (size_t k = 0; k < n; ++k) {
    const AllocGroup& g = p.groups[k];
    q.weight += static_cast<double>(g.tokens);
    if (g.pinned || g.tokens == 0) {
      int pick = 0;
      if (!g.pinned) {  // zero weight: the cheapest, then least distortion
        for (int i = 1; i < static_cast<int>(g.options.size()); ++i) {
          const AllocOption& a = g.options[i];
          const AllocOption& b = g.options[pick];
          if (a.bits < b.bits ||
              (a.bits == b.bits && a.distortion < b.distortion)) {
            pick = i;
          }
        }
      }
      q.fixed_choice[k] = pick;
      const double w = static_cast<double>(g.tokens);
      q.fixed_cost += w * g.options[pick].bits;
      q.fixed_dist += w * g.options[pick].distortion;
      continue;
    }
    q.free.push_back(static_cast<int>(k));
    q.items.push_back(NonDominated(g));
  }
  q.cap = p.budget_bits * q.weight * (1.0 + kBudgetRelTol / 2);
  for (size_t i = 0; i < q.items.size(); ++i) {
    q.min_free_cost += q.items[i][0].c;
    q.hull.push_back(LowerHull(q.items[i]));
    const std::vector<int>& h = q.hull.back();
    for (size_t j = 0; j + 1 < h.size(); ++j) {
      Segment s;
      s.g = static_cast<int>(i);
      s.from = h[j];
      s.to = h[j + 1];
      s.dc = q.items[i][s.to].c - q.items[i][s.from].c;
      s.dd = q.items[i][s.from].d - q.items[i][s.to].d;
      s.slope = s.dd / s.dc;
      q.segments.push_back(s);
    }
  }
  std::stable_sort(
      q.segments.begin(), q.segments.end(),
      [](const Segment& a, const Segment& b) { return a.slope > b.slope; });
  const double need = q.fixed_cost + q.min_free_cost;
  if (need > q.cap) {
    const double w = q.weight;
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocation infeasible: the cheapest options need ", Num(need / w),
        " effective bits per value (pinned groups ", Num(q.fixed_cost / w),
        "), budget_bits is ", Num(p.budget_bits), "; over by ",
        Num(need / w - p.budget_bits), " bits per value (",
        Num(need - p.budget_bits * w), " bit-tokens)"));
  }
  return q;
}

// Lower bound on the distortion of the free groups whose rank is >= depth,
// given `room` cost for them: the LP relaxation (each group at its cheapest
// item, hull segments in slope order, the last fractionally). +inf when the
// cheapest items do not fit. `suffix_cost` / `suffix_dist` hold the sums of
// the cheapest items of ranks >= depth.
double LpBound(const Prepared& q, const std::vector<int>& rank, int depth,
               double room, double suffix_cost, double suffix_dist) {
  double left = room - suffix_cost;
  if (left < 0) return kInf;
  double dist = suffix_dist;
  for (const Segment& s : q.segments) {
    if (rank[s.g] < depth) continue;
    if (s.dc <= left) {
      left -= s.dc;
      dist -= s.dd;
    } else {
      dist -= s.dd * (left / s.dc);
      break;
    }
  }
  return std::max(dist, 0.0);
}

// Item index per free group from the greedy (see header).
std::vector<int> GreedyItems(const Prepared& q) {
  const int m = static_cast<int>(q.items.size());
  std::vector<int> cur(m, 0);
  std::vector<size_t> hull_pos(m, 0);
  double slack = q.cap - q.fixed_cost - q.min_free_cost;
  // Phase 1: hull upgrades by best slope; a group whose next upgrade does
  // not fit leaves the queue (its later segments start from that point).
  using Entry = std::pair<double, int>;  // slope, group
  auto cmp = [](const Entry& a, const Entry& b) {
    if (a.first != b.first) return a.first < b.first;
    return a.second > b.second;  // equal slopes: lower group index first
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> pq(cmp);
  auto next_slope = [&](int g) {
    const std::vector<int>& h = q.hull[g];
    const size_t j = hull_pos[g];
    const Item& a = q.items[g][h[j]];
    const Item& b = q.items[g][h[j + 1]];
    return (a.d - b.d) / (b.c - a.c);
  };
  for (int g = 0; g < m; ++g) {
    if (q.hull[g].size() >= 2) pq.push({next_slope(g), g});
  }
  while (!pq.empty()) {
    const int g = pq.top().second;
    pq.pop();
    const std::vector<int>& h = q.hull[g];
    const double dc = q.items[g][h[hull_pos[g] + 1]].c - q.items[g][cur[g]].c;
    if (dc > slack) continue;
    slack -= dc;
    ++hull_pos[g];
    cur[g] = h[hull_pos[g]];
    if (hull_pos[g] + 1 < h.size()) pq.push({next_slope(g), g});
  }
  // Phase 2: best single-group change that fits, until none helps. Items
  // are non-dominated, so every improvement costs more and slack only
  // shrinks; each round moves one group to a later item (<= S rounds).
  while (true) {
    int best_g = -1, best_j = -1;
    double best_gain = 0;
    for (int g = 0; g < m; ++g) {
      const std::vector<Item>& it = q.items[g];
      const double limit = it[cur[g]].c + slack;
      int j = cur[g];
      while (j + 1 < static_cast<int>(it.size()) && it[j + 1].c <= limit) ++j;
      if (j == cur[g]) continue;
      const double gain = it[cur[g]].d - it[j].d;
      if (gain > best_gain) {
        best_gain = gain;
        best_g = g;
        best_j = j;
      }
    }
    if (best_g < 0) break;
    slack -= q.items[best_g][best_j].c - q.items[best_g][cur[best_g]].c;
    cur[best_g] = best_j;
  }
  return cur;
}

// Depth-first branch and bound over the free groups.
class BranchAndBound {
 public:
  BranchAndBound(const Prepared& q, uint64_t max_nodes)
      : q_(q), max_nodes_(max_nodes) {
    const int m = static_cast<int>(q.items.size());
    // Groups with the widest distortion range first: their choice moves the
    // bound most.
    order_.resize(m);
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int a, int b) { return Span(a) > Span(b); });
    rank_.assign(m, 0);
    for (int r = 0; r < m; ++r) rank_[order_[r]] = r;
    suffix_cost_.assign(m + 1, 0);
    suffix_dist_.assign(m + 1, 0);
    for (int r = m - 1; r >= 0; --r) {
      suffix_cost_[r] = suffix_cost_[r + 1] + q.items[order_[r]][0].c;
      suffix_dist_[r] = suffix_dist_[r + 1] + q.items[order_[r]][0].d;
    }
    path_.assign(m, 0);
  }

  // Best (item per free group, distortion of the free groups) found, seeded
  // with `seed` (a feasible item vector).
  void Run(const std::vector<int>& seed, double seed_dist) {
    best_ = seed;
    best_dist_ = seed_dist;
    Dfs(0, q_.fixed_cost, 0.0);
  }

  double RootBound() const {
    return LpBound(q_, rank_, 0, q_.cap - q_.fixed_cost, suffix_cost_[0],
                   suffix_dist_[0]);
  }
  const std::vector<int>& best() const { return best_; }
  bool aborted() const { return aborted_; }
  uint64_t nodes() const { return nodes_; }

 private:
  double Span(int g) const {
    return q_.items[g].front().d - q_.items[g].back().d;
  }

  void Dfs(int depth, double cost, double dist) {
    if (aborted_) return;
    if (++nodes_ > max_nodes_) {
      aborted_ = true;
      return;
    }
    const int m = static_cast<int>(order_.size());
    if (depth == m) {
      if (dist < best_dist_) {
        best_dist_ = dist;
        for (int r = 0; r < m; ++r) best_[order_[r]] = path_[r];
      }
      return;
    }
    const double lb = dist + LpBound(q_, rank_, depth, q_.cap - cost,
                                     suffix_cost_[depth], suffix_dist_[depth]);
    if (lb >= best_dist_) return;
    const int g = order_[depth];
    const std::vector<Item>& it = q_.items[g];
    // Least distortion first: good incumbents early.
    for (int j = static_cast<int>(it.size()) - 1; j >= 0; --j) {
      if (cost + it[j].c + suffix_cost_[depth + 1] > q_.cap) continue;
      path_[depth] = j;
      Dfs(depth + 1, cost + it[j].c, dist + it[j].d);
      if (aborted_) return;
    }
  }

  const Prepared& q_;
  const uint64_t max_nodes_;
  std::vector<int> order_, rank_, path_, best_;
  std::vector<double> suffix_cost_, suffix_dist_;
  double best_dist_ = kInf;
  bool aborted_ = false;
  uint64_t nodes_ = 0;
};

double FreeDist(const Prepared& q, const std::vector<int>& items) {
  double d = 0;
  for (size_t g = 0; g < items.size(); ++g) d += q.items[g][items[g]].d;
  return d;
}

// Full result from item indices of the free groups.
absl::StatusOr<AllocResult> Finish(const AllocProblem& p, const Prepared& q,
                                   const std::vector<int>& items) {
  AllocResult r;
  r.choice = q.fixed_choice;
  for (size_t g = 0; g < q.free.size(); ++g) {
    r.choice[q.free[g]] = q.items[g][items[g]].option;
  }
  TRIAX_ASSIGN_OR_RETURN(AllocTotals t, EvaluateChoice(p, r.choice));
  if (!IsWithinBudget(p, t.cost)) {
    return absl::InternalError(absl::StrCat("allocator chose cost ",
                                            Num(t.cost), " over the budget ",
                                            Num(p.budget_bits * q.weight)));
  }
  r.total_cost = t.cost;
  r.total_distortion = t.distortion;
  r.average_bits = q.weight > 0 ? t.cost / q.weight : 0;
  return r;
}

// Maps a caller's choice vector to items: the cheapest non-dominated item
// at least as good (same or lower cost, same or lower distortion), so the
// seed never gets worse. Returns false if the vector is unusable.
bool IncumbentItems(const AllocProblem& p, const Prepared& q,
                    const std::vector<int>& choice, std::vector<int>* items) {
  if (choice.size() != p.groups.size()) return false;
  auto totals = EvaluateChoice(p, choice);
  if (!totals.ok() || !IsWithinBudget(p, totals->cost)) return false;
  items->assign(q.free.size(), 0);
  double cost = q.fixed_cost;
  for (size_t g = 0; g < q.free.size(); ++g) {
    const AllocGroup& grp = p.groups[q.free[g]];
    const double w = static_cast<double>(grp.tokens);
    const double c = w * grp.options[choice[q.free[g]]].bits;
    const double d = w * grp.options[choice[q.free[g]]].distortion;
    const std::vector<Item>& it = q.items[g];
    int pick = 0;  // item 0 is the cheapest; find the best one with cost <= c
    for (int j = 0; j < static_cast<int>(it.size()); ++j) {
      if (it[j].c <= c) pick = j;
    }
    if (it[pick].d > d) return false;  // cannot happen for valid items
    (*items)[g] = pick;
    cost += it[pick].c;
  }
  return cost <= q.cap;
}

}  // namespace

absl::Status ValidateAllocProblem(const AllocProblem& p) {
  if (!std::isfinite(p.budget_bits) || p.budget_bits <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget_bits must be finite and > 0, got ", Num(p.budget_bits)));
  }
  for (size_t k = 0; k < p.groups.size(); ++k) {
    const AllocGroup& g = p.groups[k];
    if (g.tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("groups[", k, "].tokens must be >= 0, got ", g.tokens));
    }
    if (g.options.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("groups[", k, "].options is empty"));
    }
    for (size_t i = 0; i < g.options.size(); ++i) {
      const AllocOption& o = g.options[i];
      if (!std::isfinite(o.bits) || o.bits < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("groups[", k, "].options[", i,
                         "].bits must be finite and >= 0, got ", Num(o.bits)));
      }
      if (!std::isfinite(o.distortion) || o.distortion < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "groups[", k, "].options[", i,
            "].distortion must be finite and >= 0, got ", Num(o.distortion)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<AllocTotals> EvaluateChoice(const AllocProblem& p,
                                           const std::vector<int>& choice) {
  if (choice.size() != p.groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat("choice has ", choice.size(),
                                                   " entries, problem has ",
                                                   p.groups.size(), " groups"));
  }
  AllocTotals t;
  for (size_t k = 0; k < choice.size(); ++k) {
    const AllocGroup& g = p.groups[k];
    if (choice[k] < 0 || choice[k] >= static_cast<int>(g.options.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "choice[", k, "] = ", choice[k], " is not an index of ", "groups[", k,
          "].options (size ", g.options.size(), ")"));
    }
    const double w = static_cast<double>(g.tokens);
    t.cost += w * g.options[choice[k]].bits;
    t.distortion += w * g.options[choice[k]].distortion;
  }
  return t;
}

bool IsWithinBudget(const AllocProblem& p, double cost) {
  double weight = 0;
  for (const AllocGroup& g : p.groups) weight += static_cast<double>(g.tokens);
  return cost <= p.budget_bits * weight * (1.0 + kBudgetRelTol);
}

absl::StatusOr<AllocResult> SolveGreedy(const AllocProblem& p) {
  TRIAX_ASSIGN_OR_RETURN(Prepared q, Prepare(p));
  const std::vector<int> items = GreedyItems(q);
  TRIAX_ASSIGN_OR_RETURN(AllocResult r, Finish(p, q, items));
  BranchAndBound bb(q, 0);  // only for the root bound
  r.lower_bound = q.fixed_dist + bb.RootBound();
  r.method = AllocMethod::kGreedy;
  // Proven optimal when every free group is at its least distortion, or the
  // LP bound is met.
  bool all_best = true;
  for (size_t g = 0; g < items.size(); ++g) {
    all_best = all_best && items[g] + 1 == static_cast<int>(q.items[g].size());
  }
  r.optimal = all_best || r.total_distortion <= r.lower_bound;
  return r;
}

absl::StatusOr<AllocResult> SolveExact(const AllocProblem& p,
                                       const ExactOptions& opts) {
  TRIAX_ASSIGN_OR_RETURN(Prepared q, Prepare(p));
  std::vector<int> seed = GreedyItems(q);
  double seed_dist = FreeDist(q, seed);
  std::vector<int> given;
  if (opts.incumbent != nullptr &&
      IncumbentItems(p, q, *opts.incumbent, &given)) {
    const double d = FreeDist(q, given);
    if (d < seed_dist) {
      seed = std::move(given);
      seed_dist = d;
    }
  }
  BranchAndBound bb(q, opts.max_nodes);
  bb.Run(seed, seed_dist);
  TRIAX_ASSIGN_OR_RETURN(AllocResult r, Finish(p, q, bb.best()));
  r.method = AllocMethod::kExact;
  r.nodes = bb.nodes();
  r.optimal = !bb.aborted();
  r.lower_bound =
      r.optimal ? r.total_distortion : q.fixed_dist + bb.RootBound();
  return r;
}

absl::StatusOr<AllocResult> Solve(const AllocProblem& p,
                                  const SolveOptions& opts) {
  TRIAX_RETURN_IF_ERROR(ValidateAllocProblem(p));
  int free_groups = 0;
  for (const AllocGroup& g : p.groups) {
    free_groups += (!g.pinned && g.tokens > 0) ? 1 : 0;
  }
  if (free_groups <= opts.exact_max_groups) {
    ExactOptions eo;
    eo.max_nodes = opts.max_nodes;
    return SolveExact(p, eo);
  }
  return SolveGreedy(p);
}

absl::StatusOr<AllocOption> MakeAllocOption(const Encoding& encoding,
                                            const kernels::PageShape& shape,
                                            double distortion, int64_t tokens) {
  if (const char* why = kernels::ValidateEncoding(encoding, shape)) {
    char buf[64];
    return absl::InvalidArgumentError(absl::StrCat(
        "encoding ", kernels::EncodingName(encoding, buf, sizeof(buf)),
        " is not valid for page shape T=", shape.tokens, " H=", shape.heads,
        " D=", shape.head_dim, ": ", why));
  }
  if (!std::isfinite(distortion) || distortion < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "distortion must be finite and >= 0, got ", Num(distortion)));
  }
  if (tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens must be >= 0, got ", tokens));
  }
  AllocOption o;
  o.encoding = encoding;
  o.distortion = distortion;
  if (tokens == 0) {
    o.bits = kernels::EffectiveBits(encoding, shape);
  } else {
    const int64_t pages = (tokens + shape.tokens - 1) / shape.tokens;
    const double values =
        2.0 * static_cast<double>(tokens) * shape.heads * shape.head_dim;
    o.bits = static_cast<double>(pages) *
             static_cast<double>(kernels::PageBytes(encoding, shape)) * 8.0 /
             values;
  }
  return o;
}

absl::StatusOr<std::vector<int>> PreferDominatingUniform(
    const AllocProblem& problem,
    const std::array<std::vector<std::vector<double>>, 2>& metrics,
    std::vector<int> choice) {
  const size_t n = problem.groups.size();
  if (choice.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "choice has ", choice.size(), " entries for ", n, " groups"));
  }
  for (int m = 0; m < 2; ++m) {
    if (metrics[m].size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metrics[", m, "] has ", metrics[m].size(), " groups, want ", n));
    }
    for (size_t k = 0; k < n; ++k) {
      if (metrics[m][k].size() != problem.groups[k].options.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("metrics[", m, "][", k, "] has ", metrics[m][k].size(),
                         " options, want ", problem.groups[k].options.size()));
      }
    }
  }
  for (size_t k = 0; k < n; ++k) {
    if (choice[k] < 0 ||
        static_cast<size_t>(choice[k]) >= problem.groups[k].options.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("choice[", k, "] is ", choice[k], "; group ", k, " has ",
                       problem.groups[k].options.size(), " options"));
    }
  }
  auto totals = [&](const std::vector<int>& c) {
    std::array<double, 3> t{};  // cost, metric 0, metric 1
    for (size_t k = 0; k < n; ++k) {
      const double tokens = static_cast<double>(problem.groups[k].tokens);
      t[0] += tokens * problem.groups[k].options[c[k]].bits;
      t[1] += tokens * metrics[0][k][c[k]];
      t[2] += tokens * metrics[1][k][c[k]];
    }
    return t;
  };
  auto free_group = [&](size_t k) {
    return !problem.groups[k].pinned && problem.groups[k].tokens > 0;
  };
  size_t first = n;
  for (size_t k = 0; k < n && first == n; ++k) {
    if (free_group(k)) first = k;
  }
  if (first == n) return choice;
  const std::array<double, 3> have = totals(choice);
  constexpr double kRel = 1e-9;
  auto le = [&](double a, double b) { return a <= b + kRel * std::abs(b); };
  auto lt = [&](double a, double b) { return a < b - kRel * std::abs(b); };
  std::vector<int> best;
  double best_metric = 0;
  for (const AllocOption& candidate : problem.groups[first].options) {
    std::vector<int> u = choice;
    bool complete = true;
    for (size_t k = 0; k < n && complete; ++k) {
      if (problem.groups[k].pinned) {
        u[k] = 0;
        continue;
      }
      if (!free_group(k)) continue;
      complete = false;
      const auto& opts = problem.groups[k].options;
      for (size_t i = 0; i < opts.size(); ++i) {
        if (opts[i].encoding == candidate.encoding) {
          u[k] = static_cast<int>(i);
          complete = true;
          break;
        }
      }
    }
    if (!complete) continue;
    const std::array<double, 3> t = totals(u);
    if (t[0] > have[0] * (1 + kBudgetRelTol)) continue;
    if (!le(t[1], have[1]) || !le(t[2], have[2])) continue;
    if (!lt(t[1], have[1]) && !lt(t[2], have[2])) continue;
    if (best.empty() || t[1] < best_metric) {
      best = std::move(u);
      best_metric = t[1];
    }
  }
  return best.empty() ? choice : best;
}

}  // namespace triax::manager
