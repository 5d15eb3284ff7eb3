// allocator_bench: solve times of the format allocator (kvmanager/allocator.h)
// and the greedy's gap to the exact optimum on random instances.
//
// For each tag count in --tags, builds --instances random problems with
// --options options per tag (effective bits drawn from realistic encodings at
// T=16, H=8, D=128, some with partial-page overhead; distortion ~ s_k *
// 2^-bits * noise, per-tag sensitivity s_k in [0.1, 10.1]; token counts
// 1..3000; 1 tag in 10 pinned) and a budget uniform between the cheapest and
// the dearest average bits. Runs SolveGreedy and SolveExact (node limit
// --max_nodes) on each and prints a markdown table: median/max time of each,
// how many exact searches finished (proven optimal), the median node count,
// the greedy's mean/max gap to the exact optimum (instances where it
// finished) and the mean gap to the LP lower bound (all instances).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/layout.h"
#include "kvmanager/allocator.h"

ABSL_FLAG(std::string, tags, "8,32,256,4096", "comma-separated tag counts");
ABSL_FLAG(int, options, 8, "options per tag");
ABSL_FLAG(int, instances, 20, "random instances per tag count");
ABSL_FLAG(uint64_t, max_nodes, uint64_t{1} << 22,
          "branch-and-bound node limit");
ABSL_FLAG(int, exact_max_tags, 1024,
          "run the exact search only up to this many tags (a node costs "
          "O(tags x options), so 4096 tags x 2^22 nodes would take minutes)");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace {

using triax::manager::AllocGroup;
using triax::manager::AllocOption;
using triax::manager::AllocProblem;
using Clock = std::chrono::steady_clock;
namespace kernels = triax::kernels;

std::vector<double> PoolBits() {
  const kernels::PageShape shape{16, 8, 128};
  std::vector<double> bits;
  for (kernels::Format f : kernels::kAllFormats) {
    bits.push_back(kernels::EffectiveBits(f, shape));
  }
  // Mixed K/V encodings.
  bits.push_back(kernels::EffectiveBits(
      kernels::Encoding(kernels::Format::kINT4, kernels::Format::kINT2),
      shape));
  bits.push_back(kernels::EffectiveBits(
      kernels::Encoding(kernels::Format::kINT8, kernels::Format::kINT4),
      shape));
  return bits;
}

AllocProblem Random(std::mt19937_64& rng, int tags, int options,
                    const std::vector<double>& pool) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  AllocProblem p;
  double w = 0, lo = 0, hi = 0;
  for (int k = 0; k < tags; ++k) {
    AllocGroup g;
    g.tokens = 1 + static_cast<int64_t>(u(rng) * 3000);
    const double sens = 0.1 + 10 * u(rng);
    for (int i = 0; i < options; ++i) {
      double bits = pool[pick(rng)];
      if (u(rng) < 0.3) bits += u(rng);
      AllocOption o;
      o.bits = bits;
      o.distortion = sens * std::exp2(-bits) * (0.5 + u(rng));
      g.options.push_back(o);
    }
    g.pinned = u(rng) < 0.1;
    double omin = 1e9, omax = 0;
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
  p.budget_bits = (lo + u(rng) * (hi - lo)) / w;
  return p;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> tag_counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_tags), ',')) {
    int t = 0;
    if (!absl::SimpleAtoi(s, &t) || t < 1) {
      std::fprintf(stderr, "--tags: bad count \"%s\"\n",
                   std::string(s).c_str());
      return 2;
    }
    tag_counts.push_back(t);
  }
  const int options = absl::GetFlag(FLAGS_options);
  const int instances = absl::GetFlag(FLAGS_instances);
  if (options < 1 || instances < 1) {
    std::fprintf(stderr, "--options and --instances must be >= 1\n");
    return 2;
  }
  const std::vector<double> pool = PoolBits();
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  triax::manager::ExactOptions eo;
  eo.max_nodes = absl::GetFlag(FLAGS_max_nodes);

  std::printf(
      "| tags | greedy ms p50 / max | exact ms p50 / max | exact finished | "
      "exact nodes p50 | greedy gap to optimum mean / max | greedy gap to LP "
      "bound mean |\n|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int tags : tag_counts) {
    std::vector<double> tg, te, nodes;
    int finished = 0, compared = 0;
    double gap_sum = 0, gap_max = 0, lp_gap_sum = 0;
    for (int i = 0; i < instances; ++i) {
      const AllocProblem p = Random(rng, tags, options, pool);
      auto t0 = Clock::now();
      auto g = triax::manager::SolveGreedy(p);
      auto t1 = Clock::now();
      const bool run_exact = tags <= absl::GetFlag(FLAGS_exact_max_tags);
      absl::StatusOr<triax::manager::AllocResult> e = *g;
      if (run_exact) e = triax::manager::SolveExact(p, eo);
      auto t2 = Clock::now();
      if (!g.ok() || !e.ok()) {
        std::fprintf(stderr, "solve failed: %s / %s\n",
                     g.status().ToString().c_str(),
                     e.status().ToString().c_str());
        return 1;
      }
      tg.push_back(Ms(t1 - t0));
      if (g->lower_bound > 0) {
        lp_gap_sum += (g->total_distortion - g->lower_bound) / g->lower_bound;
      }
      if (!run_exact) continue;
      te.push_back(Ms(t2 - t1));
      nodes.push_back(static_cast<double>(e->nodes));
      if (e->optimal) {
        ++finished;
        ++compared;
        const double gap = e->total_distortion > 0
                               ? (g->total_distortion - e->total_distortion) /
                                     e->total_distortion
                               : 0;
        gap_sum += gap;
        gap_max = std::max(gap_max, gap);
      }
    }
    char gap[64] = "n/a";
    if (compared > 0) {
      std::snprintf(gap, sizeof(gap), "%.3f%% / %.3f%%",
                    100 * gap_sum / compared, 100 * gap_max);
    }
    if (te.empty()) {
      std::printf("| %d | %.3f / %.3f | not run | | | | %.4f%% |\n", tags,
                  Median(tg), *std::max_element(tg.begin(), tg.end()),
                  100 * lp_gap_sum / instances);
    } else {
      std::printf(
          "| %d | %.3f / %.3f | %.3f / %.3f | %d / %d | %.0f | %s | %.4f%% |\n",
          tags, Median(tg), *std::max_element(tg.begin(), tg.end()), Median(te),
          *std::max_element(te.begin(), te.end()), finished, instances,
          Median(nodes), gap, 100 * lp_gap_sum / instances);
    }
    std::fflush(stdout);
  }
  return 0;
}
