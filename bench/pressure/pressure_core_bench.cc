// pressure_core_bench: the manager core's whole background pressure round at
// 10^4..10^6 blocks: RefreshRanking (the snapshot copy under the core mutex
// plus Rank outside it) and PlanPressure (SelectReclaim against the live
// registry), on a ManagerCore filled through OpenSequence with agentic span
// layouts. Prints a markdown table; not a test.
//
//   pressure_core_bench [--blocks=10000,100000,1000000] [--runs=5]
//                       [--mode=demote-first]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/clock.h"
#include "kvmanager/manager_core.h"

ABSL_FLAG(std::string, blocks, "10000,100000,1000000",
          "comma-separated block counts");
ABSL_FLAG(int, runs, 5, "timed rounds per size (median and max printed)");
ABSL_FLAG(std::string, mode, "demote-first",
          "pressure mode: demote-first, graph-evict, lru");

namespace {

using namespace triax::manager;  // NOLINT
using triax::Format;
using triax::Modality;
using triax::ModelShape;
using triax::Role;
using triax::Tier;

double Ms(std::chrono::steady_clock::time_point a,
          std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto mode = ParsePressureMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) {
    std::fprintf(stderr, "%s\n", mode.status().ToString().c_str());
    return 2;
  }
  std::vector<size_t> sizes;
  for (absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_blocks), ',', absl::SkipEmpty())) {
    size_t n = 0;
    if (!absl::SimpleAtoi(s, &n) || n == 0) {
      std::fprintf(stderr, "bad --blocks entry \"%s\"\n",
                   std::string(s).c_str());
      return 2;
    }
    sizes.push_back(n);
  }
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  std::printf(
      "| blocks | sequences | fill s | RefreshRanking ms p50 | max | "
      "of which snapshot ms p50 | longest lock hold ms | Rank ms p50 | "
      "PlanPressure ms p50 | planned blocks |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t target : sizes) {
    triax::FakeClock clock;
    ManagerOptions options;
    options.ranker.mode = *mode;
    options.event_retention = 1000;  // the bench measures pressure, not events
    options.closed_retention = 16;
    auto core = ManagerCore::Create(options, &clock);
    if (!core.ok()) {
      std::fprintf(stderr, "%s\n", core.status().ToString().c_str());
      return 1;
    }
    // 8 workers sized so the pool ends ~95% full (above the high watermark).
    // Model: 32 layers, 8 KV heads, head_dim 128, T = 16 (BF16 block 2 MiB).
    const ModelShape model{"bench-8b", 32, 8, 32, 128};
    const uint64_t block_bytes =
        32 * triax::kernels::PageBytes(Format::kBF16,
                                       triax::kernels::PageShape{16, 8, 128});
    const int workers = 8;
    for (int w = 0; w < workers; ++w) {
      RegisterWorkerRequest reg;
      reg.worker_id = "w" + std::to_string(w);
      reg.address = "127.0.0.1:" + std::to_string(9000 + w);
      reg.backend = "cpu";
      reg.capacity_bytes =
          static_cast<uint64_t>(static_cast<double>(target) / workers / 0.95 +
                                64) *
          block_bytes;
      reg.host_capacity_bytes = reg.capacity_bytes / 4;
      if (!(*core)->RegisterWorker(reg).ok()) return 1;
    }
    for (int t = 0; t < 16; ++t) {
      CreateTenantRequest ct;
      ct.tenant_id = "t" + std::to_string(t);
      ct.default_policy = "bf16";
      if (!(*core)->CreateTenant(ct).ok()) return 1;
    }
    // Agentic layouts: system 32, tool schema 64, then turns of user /
    // reasoning / tool call / tool result / assistant; ~64 blocks each.
    std::mt19937 rng(1);
    size_t blocks = 0, sequences = 0;
    const auto fill_start = std::chrono::steady_clock::now();
    while (blocks < target) {
      OpenSequenceRequest req;
      req.tenant_id = "t" + std::to_string(sequences % 16);
      req.model = model;
      req.spans = {{Role::kSystem, Modality::kText, 32},
                   {Role::kToolSchema, Modality::kText, 64}};
      const int turns = 2 + static_cast<int>(rng() % 4);
      for (int i = 0; i < turns; ++i) {
        req.spans.push_back({Role::kUser, Modality::kText,
                             16 + static_cast<uint32_t>(rng() % 64)});
        req.spans.push_back({Role::kReasoning, Modality::kText,
                             32 + static_cast<uint32_t>(rng() % 96)});
        req.spans.push_back({Role::kToolCall, Modality::kText, 32});
        req.spans.push_back({Role::kToolResult, Modality::kText,
                             64 + static_cast<uint32_t>(rng() % 128)});
        req.spans.push_back({Role::kAssistant, Modality::kText,
                             16 + static_cast<uint32_t>(rng() % 64)});
      }
      auto s = (*core)->OpenSequence(req);
      if (!s.ok()) {
        std::fprintf(stderr, "fill stopped at %zu blocks: %s\n", blocks,
                     s.status().ToString().c_str());
        break;
      }
      blocks += s->blocks.size();
      ++sequences;
      clock.AdvanceMs(1);
    }
    const double fill_s =
        Ms(fill_start, std::chrono::steady_clock::now()) / 1000.0;
    std::vector<double> refresh, plan, copy, rank, hold;
    size_t planned = 0;
    for (int r = 0; r < runs; ++r) {
      const auto a = std::chrono::steady_clock::now();
      (*core)->RefreshRanking();
      const auto b = std::chrono::steady_clock::now();
      TierPlan p = (*core)->PlanPressure();
      const auto c = std::chrono::steady_clock::now();
      refresh.push_back(Ms(a, b));
      plan.push_back(Ms(b, c));
      const PressureState st = (*core)->GetPressure(1);
      copy.push_back(st.snapshot_ms);
      hold.push_back(st.snapshot_lock_ms);
      rank.push_back(st.ranking_ms);
      planned = 0;
      for (const TierCommand& cmd : p.commands) planned += cmd.blocks.size();
      // Give the plan back unapplied (a worker failure) so every round
      // plans the same state.
      if (p.token != 0) {
        std::vector<absl::Status> fail(p.commands.size(),
                                       absl::UnavailableError("bench"));
        (void)(*core)->FinishTierPlan(p.token, fail);
      }
    }
    std::printf(
        "| %zu | %zu | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f | %.2f | %zu "
        "|\n",
        blocks, sequences, fill_s, Median(refresh),
        *std::max_element(refresh.begin(), refresh.end()), Median(copy),
        *std::max_element(hold.begin(), hold.end()), Median(rank), Median(plan),
        planned);
    std::fflush(stdout);
  }
  return 0;
}
