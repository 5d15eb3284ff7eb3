// Format allocation across tag groups under a bit budget.
//
// Problem (a multiple-choice knapsack, MCKP). Group k (one tag of a session)
// holds N_k tokens and has candidate options f, each an encoding with
//   b_k(f): EFFECTIVE bits per K/V value (codes + scales/zeros/norms +
//           padding, kernels::EffectiveBits for the model's page shape; never
//           the nominal 16/8/4/2), and
//   D_k(f): distortion per token (>= 0; e.g. attention-output MSE measured by
//           bench/quality), in any unit as long as all groups share it.
// Choose one option f_k per group to
//   minimize   sum_k N_k * D_k(f_k)
//   subject to sum_k N_k * b_k(f_k) <= B * sum_k N_k   (B: budget_bits).
// Every token of a session has the same number of values (2 * layers * heads
// * head_dim), so the constraint is the session's average effective bits per
// value. "Cost" below is N_k * b_k(f) (bits per value x tokens).
//
// Pinned groups (e.g. attention sinks kept in BF16) always take options[0];
// their cost still counts against the budget. Groups with N_k = 0 cost
// nothing and take their cheapest option.
//
// Solvers:
//   SolveExact: depth-first branch and bound. The bound at a node is the LP
//     relaxation of the remaining groups (each group's lower convex hull of
//     (cost, distortion), segments taken by best distortion drop per bit,
//     the last one fractionally), which is a valid lower bound, so a
//     completed search is optimal (up to double rounding, relative ~1e-12).
//     No limit on the number of groups is imposed; the search stops after
//     `max_nodes` nodes (each O(S) for S options in all) and then returns
//     the best solution found, never worse than the greedy's, with
//     optimal = false. Measured (bench/results/allocator.md): random
//     instances of 8 options per group finished for every instance up to
//     256 groups (p50 ~15k nodes, 12 ms); at 4096 groups 10^5 nodes do not
//     suffice. Worst case exponential, hence the node limit.
//   SolveGreedy: the classic MCKP greedy (LP rounding): start every group at
//     its cheapest non-dominated option, take hull upgrades in order of
//     distortion drop per extra bit (a group whose next upgrade does not fit
//     drops out; the others go on), then repeatedly apply the
//     single-group change (to any non-dominated option) that lowers
//     distortion the most and still fits. O(S log S + R * S) for S options
//     in all and R final-pass rounds (R <= S). Not optimal in general; its
//     result carries the LP lower bound, so the gap is bounded by
//     total_distortion - lower_bound.
//   Solve: exact (seeded with the greedy solution, node limit
//     SolveOptions::max_nodes) when there are at most `exact_max_groups` free
//     groups (not pinned, N_k > 0), else greedy.
//
// Feasibility uses one rule everywhere: total cost <= B * sum N_k * (1 +
// kBudgetRelTol), the tolerance absorbing double rounding of sums taken in
// different orders.
//
// Errors (all solvers, nothing is partially computed):
//   INVALID_ARGUMENT: budget_bits not finite or <= 0; a group with no
//     options, tokens < 0, or an option with bits or distortion not finite or
//     < 0. The message names the field ("groups[3].options[1].distortion")
//     and the value.
//   RESOURCE_EXHAUSTED: even the cheapest options (pinned groups at their
//     option) exceed the budget; the message gives the minimum achievable
//     average bits, the budget and the excess.
//
// Thread contract: free functions on caller-owned data, no shared state;
// safe to call concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/layout.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr double kBudgetRelTol = 1e-9;

struct AllocOption {
  Encoding encoding;
  double bits = 0;        // effective bits per value, finite, >= 0
  double distortion = 0;  // per token, finite, >= 0
};

struct AllocGroup {
  Tag tag;             // carried through; not used by the solvers
  int64_t tokens = 0;  // N_k >= 0 (tokens, or any count shared by all groups)
  std::vector<AllocOption> options;  // >= 1
  bool pinned = false;               // take options[0], whatever the budget
};

struct AllocProblem {
  std::vector<AllocGroup> groups;  // may be empty
  double budget_bits = 0;          // B: average effective bits per value, > 0
};

enum class AllocMethod { kGreedy = 1, kExact = 2 };

struct AllocResult {
  std::vector<int> choice;      // per group: index into groups[k].options
  double total_cost = 0;        // sum_k N_k * b_k(f_k)
  double average_bits = 0;      // total_cost / sum_k N_k (0 when sum N_k = 0)
  double total_distortion = 0;  // sum_k N_k * D_k(f_k)
  // LP-relaxation lower bound on the optimal total distortion.
  double lower_bound = 0;
  bool optimal = false;  // proven optimal
  AllocMethod method = AllocMethod::kGreedy;
  uint64_t nodes = 0;  // branch-and-bound nodes visited (0 for greedy)
};

struct ExactOptions {
  uint64_t max_nodes = uint64_t{1} << 22;
  // Optional starting incumbent (e.g. a greedy result): a choice vector of
  // the problem's size; ignored if infeasible or of the wrong size.
  const std::vector<int>* incumbent = nullptr;
};

// Defaults sized for a per-turn call: at 64 free groups x 8 options a node
// costs ~450 segment steps, so 65,536 nodes bound the search to tens of
// milliseconds; random instances of that size finish in ~10^4 nodes
// (bench/results/allocator.md). A stopped search still returns a solution
// at least as good as the greedy's, with optimal = false.
struct SolveOptions {
  int exact_max_groups = 64;  // free groups at most this many -> exact
  uint64_t max_nodes = uint64_t{1} << 16;
};

// INVALID_ARGUMENT as described above, else OK.
absl::Status ValidateAllocProblem(const AllocProblem& p);

absl::StatusOr<AllocResult> SolveExact(const AllocProblem& p,
                                       const ExactOptions& opts = {});
absl::StatusOr<AllocResult> SolveGreedy(const AllocProblem& p);
absl::StatusOr<AllocResult> Solve(const AllocProblem& p,
                                  const SolveOptions& opts = {});

// Cost (sum N_k b_k) and distortion (sum N_k D_k) of a choice vector, summed
// in group order; INVALID_ARGUMENT if the vector's size or an index is out of
// range. Does not check the budget (see IsWithinBudget).
struct AllocTotals {
  double cost = 0;
  double distortion = 0;
};
absl::StatusOr<AllocTotals> EvaluateChoice(const AllocProblem& p,
                                           const std::vector<int>& choice);
// cost <= budget_bits * sum N_k * (1 + kBudgetRelTol).
bool IsWithinBudget(const AllocProblem& p, double cost);

// An option for `encoding` on pages of `shape`, with effective bits from
// kernels/layout.h. tokens == 0: kernels::EffectiveBits (full pages).
// tokens > 0: the group's tokens fill ceil(tokens / T) pages, so bits =
// pages * PageBytes * 8 / (tokens * 2 * H * D) (partial last page counted).
// INVALID_ARGUMENT when the encoding is not valid for the shape
// (kernels::ValidateEncoding) or distortion is not finite and >= 0.
absl::StatusOr<AllocOption> MakeAllocOption(const Encoding& encoding,
                                            const kernels::PageShape& shape,
                                            double distortion,
                                            int64_t tokens = 0);

// The uniform check: an allocation that a uniform one beats on both
// metrics is never kept. `metrics` holds two per-option metrics (e.g. the
// calibration's all-token and answer-position distortion), each shaped like
// the options: metrics[m][k][i] for option i of group k. A uniform
// allocation puts every free group (not pinned, tokens > 0) at its option of
// one encoding e (every free group must have one), pinned groups at
// options[0], groups without tokens as in `choice`. Returns the uniform
// allocation of cost <= choice's cost (within kBudgetRelTol) that is <=
// choice on both metrics and < on at least one (relative 1e-9), the one
// with the lowest first metric if several; else `choice` unchanged.
// INVALID_ARGUMENT when the shapes of `metrics` or `choice` do not match
// the problem.
absl::StatusOr<std::vector<int>> PreferDominatingUniform(
    const AllocProblem& problem,
    const std::array<std::vector<std::vector<double>>, 2>& metrics,
    std::vector<int> choice);

}  // namespace triax::manager
