#include "kvmanager/allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Effective bits of realistic encodings at T=16, H=8, D=128 (values from
// kernels::EffectiveBits, computed in the test below) and a few odd ones.
const double kBitsPool[] = {16.0, 8.0, 8.5, 4.5, 4.25, 2.5, 3.25, 2.125, 1.0};

AllocOption Opt(double bits, double distortion) {
  AllocOption o;
  o.bits = bits;
  o.distortion = distortion;
  return o;
}

AllocGroup Group(int64_t tokens, std::vector<AllocOption> options,
                 bool pinned = false) {
  AllocGroup g;
  g.tokens = tokens;
  g.options = std::move(options);
  g.pinned = pinned;
  return g;
}

// A random instance: distortion roughly falls with bits (with noise, so some
// options are dominated), tokens include zeros, some groups pinned. The
// budget lies between the cheapest and the dearest average bits, sometimes
// below (infeasible) when `allow_infeasible`.
AllocProblem RandomProblem(std::mt19937_64& rng, int groups, int max_options,
                           bool allow_infeasible) {
  std::uniform_int_distribution<int> nopt(1, max_options);
  std::uniform_int_distribution<int> pool(0, std::size(kBitsPool) - 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  AllocProblem p;
  double w = 0, lo = 0, hi = 0;
  for (int k = 0; k < groups; ++k) {
    AllocGroup g;
    g.tokens = u(rng) < 0.1 ? 0 : 1 + static_cast<int64_t>(u(rng) * 3000);
    const int n = nopt(rng);
    const double sens = 0.1 + 10 * u(rng);  // how much this tag cares
    for (int i = 0; i < n; ++i) {
      double bits = kBitsPool[pool(rng)];
      if (u(rng) < 0.3) bits += u(rng);  // partial pages, odd groups
      const double d = sens * std::exp2(-bits) * (0.5 + u(rng));
      g.options.push_back(Opt(bits, u(rng) < 0.05 ? 0.0 : d));
    }
    g.pinned = u(rng) < 0.1;
    double omin = kInf, omax = 0;
    for (size_t i = 0; i < g.options.size(); ++i) {
      if (g.pinned && i > 0) break;
      omin = std::min(omin, g.options[i].bits);
      omax = std::max(omax, g.options[i].bits);
    }
    w += g.tokens;
    lo += g.tokens * omin;
    hi += g.tokens * omax;
    p.groups.push_back(std::move(g));
  }
  if (w == 0) {
    p.budget_bits = 4;
    return p;
  }
  const double t = allow_infeasible ? -0.2 + 1.3 * u(rng) : u(rng);
  p.budget_bits = std::max(0.05, (lo + t * (hi - lo)) / w);
  return p;
}

// Independent oracle: every combination (pinned groups at options[0]).
// nullopt when none fits.
std::optional<double> BruteForce(const AllocProblem& p) {
  const size_t n = p.groups.size();
  std::vector<int> c(n, 0);
  std::optional<double> best;
  while (true) {
    auto t = EvaluateChoice(p, c);
    EXPECT_THAT(t, IsOk());
    if (IsWithinBudget(p, t->cost) && (!best || t->distortion < *best)) {
      best = t->distortion;
    }
    size_t k = 0;
    for (; k < n; ++k) {
      const int limit =
          p.groups[k].pinned ? 1 : static_cast<int>(p.groups[k].options.size());
      if (++c[k] < limit) break;
      c[k] = 0;
    }
    if (k == n) break;
  }
  return best;
}

bool Near(double a, double b) {
  return std::abs(a - b) <= 1e-9 * std::max({1.0, std::abs(a), std::abs(b)});
}

// Checks that a result is self-consistent and within budget.
void CheckResult(const AllocProblem& p, const AllocResult& r) {
  ASSERT_EQ(r.choice.size(), p.groups.size());
  auto t = EvaluateChoice(p, r.choice);
  ASSERT_THAT(t, IsOk());
  EXPECT_TRUE(IsWithinBudget(p, t->cost))
      << "cost " << t->cost << " budget " << p.budget_bits;
  EXPECT_TRUE(Near(t->cost, r.total_cost));
  EXPECT_TRUE(Near(t->distortion, r.total_distortion));
  EXPECT_LE(r.lower_bound, r.total_distortion * (1 + 1e-9) + 1e-12);
  for (size_t k = 0; k < p.groups.size(); ++k) {
    if (p.groups[k].pinned) {
      EXPECT_EQ(r.choice[k], 0) << "group " << k;
    }
  }
}

TEST(AllocatorTest, ExactMatchesBruteForce) {
  std::mt19937_64 rng(20261122);
  int feasible = 0, infeasible = 0;
  for (int iter = 0; iter < 400; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed 20261122 instance " << iter);
    const int groups = 1 + iter % 6;
    AllocProblem p = RandomProblem(rng, groups, 6, /*allow_infeasible=*/true);
    const std::optional<double> want = BruteForce(p);
    auto got = SolveExact(p);
    if (!want) {
      ++infeasible;
      EXPECT_THAT(got, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstr("infeasible")));
      continue;
    }
    ++feasible;
    ASSERT_THAT(got, IsOk());
    CheckResult(p, *got);
    EXPECT_TRUE(got->optimal);
    EXPECT_EQ(got->method, AllocMethod::kExact);
    EXPECT_TRUE(Near(got->total_distortion, *want))
        << got->total_distortion << " vs brute force " << *want;
  }
  std::printf("brute force: %d feasible, %d infeasible instances\n", feasible,
              infeasible);
  EXPECT_GT(feasible, 200);
  EXPECT_GT(infeasible, 10);
}

TEST(AllocatorTest, GreedyNeverBeatsExactAndGapIsSmall) {
  std::mt19937_64 rng(7);
  double sum_gap = 0, max_gap = 0;
  int n = 0, greedy_optimal = 0, claimed_optimal = 0;
  for (int iter = 0; iter < 500; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed 7 instance " << iter);
    AllocProblem p = RandomProblem(rng, 2 + iter % 11, 8, false);
    auto exact = SolveExact(p);
    auto greedy = SolveGreedy(p);
    ASSERT_THAT(exact, IsOk());
    ASSERT_THAT(greedy, IsOk());
    ASSERT_TRUE(exact->optimal);
    CheckResult(p, *exact);
    CheckResult(p, *greedy);
    EXPECT_EQ(greedy->method, AllocMethod::kGreedy);
    EXPECT_GE(greedy->total_distortion * (1 + 1e-9) + 1e-12,
              exact->total_distortion);
    // The LP bound is a lower bound on the optimum.
    EXPECT_LE(greedy->lower_bound,
              exact->total_distortion * (1 + 1e-9) + 1e-12);
    if (greedy->optimal) {
      ++claimed_optimal;
      EXPECT_TRUE(Near(greedy->total_distortion, exact->total_distortion));
    }
    const double gap =
        exact->total_distortion > 0
            ? (greedy->total_distortion - exact->total_distortion) /
                  exact->total_distortion
            : 0.0;
    greedy_optimal += gap <= 1e-9 ? 1 : 0;
    sum_gap += gap;
    max_gap = std::max(max_gap, gap);
    ++n;
  }
  std::printf(
      "greedy vs exact over %d instances (2..12 groups, <= 8 options): "
      "optimal %d, proven optimal by greedy %d, mean gap %.4f%%, max gap "
      "%.4f%%\n",
      n, greedy_optimal, claimed_optimal, 100 * sum_gap / n, 100 * max_gap);
  // Calibrated on these seeds (mean 2.5%, max 167%, optimal 416 / 500: few
  // groups give coarse steps, which is why Solve() runs the exact search on
  // small instances); a regression of the greedy (e.g. dropping the final
  // pass) moves these.
  EXPECT_LT(sum_gap / n, 0.05);
  EXPECT_GT(greedy_optimal, n * 3 / 4);
}

TEST(AllocatorTest, MoreBudgetNeverIncreasesExactDistortion) {
  std::mt19937_64 rng(99);
  for (int iter = 0; iter < 40; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed 99 instance " << iter);
    AllocProblem p = RandomProblem(rng, 6, 6, false);
    double prev = kInf;
    bool any = false;
    for (double b = 0.5; b <= 17.0; b += 0.25) {
      p.budget_bits = b;
      auto r = SolveExact(p);
      if (!r.ok()) {
        EXPECT_THAT(r, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstr("budget_bits is")));
        EXPECT_FALSE(any) << "infeasible at " << b << " after feasible";
        continue;
      }
      any = true;
      CheckResult(p, *r);
      EXPECT_LE(r->total_distortion, prev * (1 + 1e-12)) << "budget " << b;
      prev = r->total_distortion;
    }
    EXPECT_TRUE(any);
  }
}

TEST(AllocatorTest, PinnedGroupKeepsOptionZero) {
  AllocProblem p;
  // Sink: pinned BF16 although INT4 is cheaper and (artificially) better.
  p.groups.push_back(Group(4, {Opt(16, 1.0), Opt(4.5, 0.0)}, true));
  p.groups.push_back(Group(100, {Opt(16, 0.0), Opt(4.5, 1.0), Opt(2.5, 5.0)}));
  p.budget_bits = 5.0;
  auto g = SolveGreedy(p);
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->choice[0], 0);
  auto r = SolveExact(p);
  ASSERT_THAT(r, IsOk());
  CheckResult(p, *r);
  EXPECT_EQ(r->choice[0], 0);
  // 4*16 + 100*4.5 = 514 <= 5 * 104 = 520; BF16 would need 1664.
  EXPECT_EQ(r->choice[1], 1);
  EXPECT_DOUBLE_EQ(r->total_distortion, 4 * 1.0 + 100 * 1.0);

  // Pinned alone over the budget: infeasible, message names the pinned part.
  AllocProblem q;
  q.groups.push_back(Group(10, {Opt(16, 0)}, true));
  q.groups.push_back(Group(10, {Opt(4, 1), Opt(2, 2)}));
  q.budget_bits = 8.5;  // needs (160 + 20) / 20 = 9
  EXPECT_THAT(SolveExact(q), StatusIs(absl::StatusCode::kResourceExhausted,
                                      AllOf(HasSubstr("need 9 effective bits"),
                                            HasSubstr("pinned groups 8"),
                                            HasSubstr("budget_bits is 8.5"),
                                            HasSubstr("over by 0.5"))));
  EXPECT_THAT(SolveGreedy(q),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("9")));
  q.budget_bits = 9.0;  // exactly at the minimum: feasible
  auto ok = Solve(q);
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ(ok->choice, (std::vector<int>{0, 1}));
}

TEST(AllocatorTest, BadInputsNameTheField) {
  auto base = [] {
    AllocProblem p;
    p.groups.push_back(Group(10, {Opt(16, 0), Opt(4, 1)}));
    p.groups.push_back(Group(10, {Opt(16, 0), Opt(4, 1)}));
    p.budget_bits = 8;
    return p;
  };
  ASSERT_THAT(Solve(base()), IsOk());
  struct Case {
    const char* what;
    void (*mutate)(AllocProblem&);
    const char* needle;
  };
  const Case cases[] = {
      {"zero budget", [](AllocProblem& p) { p.budget_bits = 0; },
       "budget_bits must be finite and > 0, got 0"},
      {"negative budget", [](AllocProblem& p) { p.budget_bits = -1; },
       "got -1"},
      {"nan budget", [](AllocProblem& p) { p.budget_bits = std::nan(""); },
       "budget_bits"},
      {"inf budget", [](AllocProblem& p) { p.budget_bits = kInf; },
       "budget_bits"},
      {"negative tokens", [](AllocProblem& p) { p.groups[1].tokens = -5; },
       "groups[1].tokens must be >= 0, got -5"},
      {"no options", [](AllocProblem& p) { p.groups[0].options.clear(); },
       "groups[0].options is empty"},
      {"nan distortion",
       [](AllocProblem& p) {
         p.groups[1].options[1].distortion = std::nan("");
       },
       "groups[1].options[1].distortion must be finite"},
      {"negative distortion",
       [](AllocProblem& p) { p.groups[0].options[1].distortion = -0.5; },
       "groups[0].options[1].distortion must be finite and >= 0, got -0.5"},
      {"inf bits", [](AllocProblem& p) { p.groups[1].options[0].bits = kInf; },
       "groups[1].options[0].bits"},
      {"negative bits",
       [](AllocProblem& p) { p.groups[0].options[0].bits = -4; },
       "groups[0].options[0].bits must be finite and >= 0, got -4"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    AllocProblem p = base();
    c.mutate(p);
    EXPECT_THAT(
        ValidateAllocProblem(p),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.needle)));
    EXPECT_THAT(Solve(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr(c.needle)));
    EXPECT_THAT(SolveGreedy(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr(c.needle)));
    EXPECT_THAT(SolveExact(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr(c.needle)));
  }
  EXPECT_THAT(EvaluateChoice(base(), {0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("choice has 1 entries")));
  EXPECT_THAT(
      EvaluateChoice(base(), {0, 2}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("choice[1] = 2")));
}

TEST(AllocatorTest, DegenerateCases) {
  {  // No groups: nothing to choose, trivially optimal.
    AllocProblem p;
    p.budget_bits = 4;
    auto r = Solve(p);
    ASSERT_THAT(r, IsOk());
    EXPECT_TRUE(r->choice.empty());
    EXPECT_TRUE(r->optimal);
    EXPECT_EQ(r->total_cost, 0);
    EXPECT_EQ(r->average_bits, 0);
  }
  {  // One tag: the least-distortion option that fits.
    AllocProblem p;
    p.groups.push_back(
        Group(50, {Opt(16, 0), Opt(8.5, 0.1), Opt(4.5, 1), Opt(2.5, 4)}));
    p.budget_bits = 8;
    auto g = SolveGreedy(p);
    ASSERT_THAT(g, IsOk());
    EXPECT_EQ(g->choice[0], 2);
    auto r = SolveExact(p);
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(r->choice[0], 2);
    EXPECT_DOUBLE_EQ(r->average_bits, 4.5);
    EXPECT_DOUBLE_EQ(r->total_distortion, 50.0);
  }
  {  // All options the same bits: the least distortion, also for greedy.
    AllocProblem p;
    p.groups.push_back(Group(10, {Opt(4.5, 3), Opt(4.5, 1), Opt(4.5, 2)}));
    p.groups.push_back(Group(20, {Opt(4.5, 0.5), Opt(4.5, 0.25)}));
    p.budget_bits = 4.5;
    auto g = SolveGreedy(p);
    auto e = SolveExact(p);
    ASSERT_THAT(g, IsOk());
    ASSERT_THAT(e, IsOk());
    EXPECT_EQ(g->choice, (std::vector<int>{1, 1}));
    EXPECT_EQ(e->choice, (std::vector<int>{1, 1}));
    EXPECT_TRUE(g->optimal);  // every group at its least distortion
    p.budget_bits = 4.4;
    EXPECT_THAT(Solve(p), StatusIs(absl::StatusCode::kResourceExhausted,
                                   HasSubstr("over by 0.1")));
  }
  {  // Zero distortion everywhere: optimum 0, any feasible choice.
    AllocProblem p;
    p.groups.push_back(Group(10, {Opt(16, 0), Opt(4, 0)}));
    p.groups.push_back(Group(10, {Opt(8, 0), Opt(2, 0)}));
    p.budget_bits = 3;
    auto g = SolveGreedy(p);
    ASSERT_THAT(g, IsOk());
    CheckResult(p, *g);
    EXPECT_EQ(g->total_distortion, 0);
    auto r = SolveExact(p);
    ASSERT_THAT(r, IsOk());
    CheckResult(p, *r);
    EXPECT_EQ(r->total_distortion, 0);
    EXPECT_EQ(r->choice, (std::vector<int>{1, 1}));  // only (4, 2) fits
  }
  {  // Zero-token groups cost nothing and take their cheapest option.
    AllocProblem p;
    p.groups.push_back(Group(0, {Opt(16, 0), Opt(2, 9)}));
    p.groups.push_back(Group(0, {Opt(4, 1)}));
    p.budget_bits = 1;
    auto r = Solve(p);
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(r->choice, (std::vector<int>{1, 0}));
    EXPECT_EQ(r->average_bits, 0);
  }
  {  // A zero-bit option (evict) is allowed.
    AllocProblem p;
    p.groups.push_back(Group(100, {Opt(16, 0), Opt(0, 50)}));
    p.groups.push_back(Group(100, {Opt(16, 0), Opt(0, 1)}));
    p.budget_bits = 8;
    auto r = SolveExact(p);
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(r->choice, (std::vector<int>{0, 1}));
  }
}

// Plain LP rounding stops at the first upgrade that does not fit; the
// greedy skips that group and goes on with the next one.
TEST(AllocatorTest, GreedySkipsBlockedUpgrade) {
  AllocProblem p;
  // Group 0: best ratio, but its upgrade needs 12 bits x 100 tokens.
  p.groups.push_back(Group(100, {Opt(4, 10), Opt(16, 0)}));
  // Group 1: worse ratio, small upgrade 4 -> 8 bits.
  p.groups.push_back(Group(100, {Opt(4, 2), Opt(8, 1)}));
  p.budget_bits = 7;  // room 600 bit-tokens: only group 1's 400 fits
  auto g = SolveGreedy(p);
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->choice, (std::vector<int>{0, 1}));
  auto e = SolveExact(p);
  ASSERT_THAT(e, IsOk());
  EXPECT_EQ(e->choice, g->choice);
  // LP bound: group 0 half upgraded: 1000 - 500 + 200 = 700 < 1100.
  // (The bound uses the budget plus its 1e-9 relative tolerance.)
  EXPECT_NEAR(g->lower_bound, 700, 1e-6);
  EXPECT_FALSE(g->optimal);  // greedy cannot prove it; exact can
  EXPECT_TRUE(e->optimal);
}

// The hull upgrade of group 0 does not fit, but an option above its hull
// does: only the final pass can take it.
TEST(AllocatorTest, GreedyFinalPassReachesOptionOffTheHull) {
  AllocProblem p;
  p.groups.push_back(Group(100, {Opt(4, 10), Opt(10, 6), Opt(16, 0)}));
  p.groups.push_back(Group(100, {Opt(4, 2), Opt(5, 1.9)}));
  p.budget_bits = 7.5;  // room 700: hull step of group 0 needs 1200
  auto g = SolveGreedy(p);
  ASSERT_THAT(g, IsOk());
  CheckResult(p, *g);
  EXPECT_EQ(g->choice, (std::vector<int>{1, 1}));
  EXPECT_DOUBLE_EQ(g->total_distortion, 790);  // not 1190 without the pass
  auto e = SolveExact(p);
  ASSERT_THAT(e, IsOk());
  EXPECT_EQ(e->choice, g->choice);
  EXPECT_TRUE(e->optimal);
}

TEST(AllocatorTest, LargeInstanceGreedyRespectsBudget) {
  std::mt19937_64 rng(4242);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  AllocProblem p;
  for (int k = 0; k < 1000; ++k) {
    AllocGroup g;
    g.tokens = 1 + static_cast<int64_t>(u(rng) * 1000);
    for (int i = 0; i < 8; ++i) {
      const double bits = kBitsPool[i] + 0.01 * (k % 50);
      g.options.push_back(Opt(bits, (0.5 + u(rng)) * std::exp2(-bits)));
    }
    g.pinned = k % 97 == 0;
    p.groups.push_back(std::move(g));
  }
  p.budget_bits = 3.7;
  auto r = Solve(p);  // 1000 free groups: greedy
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->method, AllocMethod::kGreedy);
  CheckResult(p, *r);
  EXPECT_LE(r->average_bits, 3.7 * (1 + kBudgetRelTol));
  EXPECT_GT(r->average_bits, 3.6);  // the budget is used
  const double gap = (r->total_distortion - r->lower_bound) / r->lower_bound;
  std::printf("1000 tags x 8 options: greedy within %.5f%% of the LP bound\n",
              100 * gap);
  EXPECT_LT(gap, 0.01);

  // Exact with a tiny node limit: stops, not optimal, never worse than greedy.
  ExactOptions eo;
  eo.max_nodes = 1000;
  auto e = SolveExact(p, eo);
  ASSERT_THAT(e, IsOk());
  CheckResult(p, *e);
  EXPECT_FALSE(e->optimal);
  EXPECT_LE(e->total_distortion, r->total_distortion * (1 + 1e-12));
}

TEST(AllocatorTest, SolveDispatchAndIncumbent) {
  std::mt19937_64 rng(5);
  AllocProblem p = RandomProblem(rng, 10, 8, false);
  auto r = Solve(p);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->method, AllocMethod::kExact);
  EXPECT_TRUE(r->optimal);
  SolveOptions so;
  so.exact_max_groups = 0;
  auto g = Solve(p, so);
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->method, AllocMethod::kGreedy);

  // Seeding with the optimum: the search only has to prove it.
  ExactOptions eo;
  eo.incumbent = &r->choice;
  auto seeded = SolveExact(p, eo);
  ASSERT_THAT(seeded, IsOk());
  EXPECT_TRUE(Near(seeded->total_distortion, r->total_distortion));
  EXPECT_LE(seeded->nodes, r->nodes);
  // A wrong-size or over-budget incumbent is ignored.
  std::vector<int> bad(p.groups.size() + 1, 0);
  eo.incumbent = &bad;
  auto ignored = SolveExact(p, eo);
  ASSERT_THAT(ignored, IsOk());
  EXPECT_TRUE(Near(ignored->total_distortion, r->total_distortion));
}

TEST(AllocatorTest, OptionsUseEffectiveBits) {
  const kernels::PageShape shape{16, 8, 128};
  auto int4 = MakeAllocOption(Encoding(Format::kINT4), shape, 0.3);
  ASSERT_THAT(int4, IsOk());
  EXPECT_DOUBLE_EQ(int4->bits, kernels::EffectiveBits(Format::kINT4, shape));
  EXPECT_GT(int4->bits, 4.0);  // scales and zeros count
  EXPECT_EQ(int4->encoding, Encoding(Format::kINT4));
  auto bf16 = MakeAllocOption(Encoding(Format::kBF16), shape, 0);
  ASSERT_THAT(bf16, IsOk());
  EXPECT_DOUBLE_EQ(bf16->bits, 16.0);
  // 20 tokens fill two pages of 16: 32/20 of the full-page bits.
  auto partial = MakeAllocOption(Encoding(Format::kBF16), shape, 0, 20);
  ASSERT_THAT(partial, IsOk());
  EXPECT_DOUBLE_EQ(partial->bits, 16.0 * 32 / 20);
  auto full = MakeAllocOption(Encoding(Format::kINT4), shape, 0, 32);
  ASSERT_THAT(full, IsOk());
  EXPECT_DOUBLE_EQ(full->bits, int4->bits);

  EXPECT_THAT(MakeAllocOption(Encoding(Format::kTQ4), {16, 8, 96}, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tq4"), HasSubstr("D=96"),
                             HasSubstr("power-of-two"))));
  EXPECT_THAT(
      MakeAllocOption(Encoding(Format::kINT4), shape, std::nan("")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("distortion")));
  EXPECT_THAT(MakeAllocOption(Encoding(Format::kINT4), shape, 0, -1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tokens must be >= 0, got -1")));

  // A session: sink pinned BF16, system prompt, older turns, current turn.
  auto opt = [&](Format f, double d) {
    auto o = MakeAllocOption(Encoding(f), shape, d);
    EXPECT_THAT(o, IsOk());
    return *o;
  };
  AllocProblem p;
  p.groups.push_back(Group(16, {opt(Format::kBF16, 0)}, /*pinned=*/true));
  for (double sens : {4.0, 1.0, 8.0}) {
    p.groups.push_back(Group(
        512,
        {opt(Format::kBF16, 0), opt(Format::kINT8, 0.001 * sens),
         opt(Format::kINT4, 0.02 * sens), opt(Format::kINT2, 0.3 * sens)}));
  }
  p.budget_bits = 5.0;
  auto r = Solve(p);
  ASSERT_THAT(r, IsOk());
  CheckResult(p, *r);
  EXPECT_TRUE(r->optimal);
  EXPECT_LE(r->average_bits, 5.0);
  // The least sensitive group (sens 1) gets the fewest bits, the most
  // sensitive (sens 8) the most.
  auto bits = [&](int k) { return p.groups[k].options[r->choice[k]].bits; };
  EXPECT_LE(bits(2), bits(1));
  EXPECT_LE(bits(1), bits(3));
  EXPECT_LT(bits(2), bits(3));
}

TEST(AllocatorTest, AUniformAllocationThatBeatsTheChoiceOnBothMetricsWins) {
  // Two free groups with INT4 and INT2 options and a pinned BF16 sink. The
  // per-option metrics: all-token m0 and answer-position m1.
  auto opt = [](Format f, double bits) {
    AllocOption o;
    o.encoding = Encoding(f);
    o.bits = bits;
    return o;
  };
  AllocProblem p;
  p.budget_bits = 8;
  p.groups = {Group(16, {opt(Format::kBF16, 16)}, /*pinned=*/true),
              Group(100, {opt(Format::kINT4, 4.5), opt(Format::kINT2, 2.5)}),
              Group(50, {opt(Format::kINT2, 2.5), opt(Format::kINT4, 4.5)})};
  std::array<std::vector<std::vector<double>>, 2> m;
  m[0] = {{0}, {1, 6}, {6, 1}};  // INT4 better everywhere on all tokens
  m[1] = {{0}, {2, 3}, {3, 2}};  // and on the answer positions
  // A mixed choice (group 1 INT2, group 2 INT4): cost 100x2.5 + 50x4.5 =
  // 475 plus the sink. Uniform INT4 costs 675 (more): kept.
  auto kept = PreferDominatingUniform(p, m, {0, 1, 1});
  ASSERT_THAT(kept, IsOk());
  EXPECT_EQ(*kept, (std::vector<int>{0, 1, 1}));
  // Uniform INT2 (cost 375) is worse on all tokens (100x6 + 50x6 = 900
  // against 100x6 + 50x1 = 650): kept too.
  // A choice of group 1 INT4, group 2 INT2 (cost 450 + 125 = 575; all-token
  // 100 + 300 = 400, answer 200 + 150 = 350) against uniform INT4 (675):
  // more bytes, so kept; with group 2 made cheaper at INT4 than at INT2,
  // uniform INT4 costs no more and beats it on both metrics.
  auto mixed = PreferDominatingUniform(p, m, {0, 0, 0});
  ASSERT_THAT(mixed, IsOk());
  EXPECT_EQ(*mixed, (std::vector<int>{0, 0, 0}));
  p.groups[2].options[1].bits = 2.0;  // INT4 option of group 2: 2 bits
  auto won = PreferDominatingUniform(p, m, {0, 0, 0});
  ASSERT_THAT(won, IsOk());
  EXPECT_EQ(*won, (std::vector<int>{0, 0, 1}));
  // Equal on both metrics is not better.
  m[0][2] = {1, 1};
  m[1][2] = {2, 2};
  auto tie = PreferDominatingUniform(p, m, {0, 0, 0});
  ASSERT_THAT(tie, IsOk());
  EXPECT_EQ(*tie, (std::vector<int>{0, 0, 0}));
  // Bad shapes are INVALID_ARGUMENT naming what is wrong.
  EXPECT_THAT(PreferDominatingUniform(p, m, {0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("choice has 2 entries for 3 groups")));
  EXPECT_THAT(PreferDominatingUniform(p, m, {0, 0, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("choice[2] is 2")));
  m[1][1].pop_back();
  EXPECT_THAT(PreferDominatingUniform(p, m, {0, 0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("metrics[1][1] has 1 options, want 2")));
}

}  // namespace
}  // namespace triax::manager
