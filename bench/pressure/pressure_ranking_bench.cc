// pressure_ranking_bench: wall time of the memory-pressure ranker
// (kvmanager/block_ranker.h) on synthetic agentic snapshots of 10^4..10^6
// blocks. Per size it builds a PressureInput (tenants, sequences, workers,
// an agentic tag mix, calibration-like option sets of 6-8 encodings per
// tag, shared / unsealed / protected / spilled blocks) and a BlockGraph
// with co-attention and tool-call -> tool-result edges, then prints a
// markdown table: graph build time, the time to snapshot the graph
// importances into the blocks, and per mode and thread count the median
// and p90 of Rank() and of SelectReclaim() over all device pools. Not a test;
// see bench/results/pressure.md.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/layout.h"
#include "kvmanager/block_ranker.h"

ABSL_FLAG(std::string, blocks, "10000,100000,1000000",
          "comma-separated snapshot sizes (blocks)");
ABSL_FLAG(int, runs, 9, "Rank() runs per mode and size");
ABSL_FLAG(std::string, threads, "1,2",
          "comma-separated RankerOptions::threads values (a row each)");
ABSL_FLAG(int, workers, 8, "workers (device pools)");
ABSL_FLAG(int, tenants, 16, "tenants");
ABSL_FLAG(int, blocks_per_sequence, 64, "mean blocks per sequence");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace triax::manager {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::ceil(q * v.size())) - 1;
  return v[std::min(i, v.size() - 1)];
}

constexpr int kLayers = 32;
const kernels::PageShape kShape{16, 8, 128};

// Candidate encodings of the calibration tables, most bytes first after
// sorting; option sets take 6-8 of them.
std::vector<Encoding> AllEncodings() {
  return {Encoding(Format::kBF16),
          Encoding(Format::kFP8),
          Encoding(Format::kINT8),
          Encoding(Format::kINT4),
          Encoding(Format::kINT4, Format::kINT4, 128),
          Encoding(Format::kINT4, Format::kINT2),
          Encoding(Format::kTQ3),
          Encoding(Format::kINT2)};
}

struct World {
  PressureInput input;
  BlockGraph graph;
  double graph_build_ms = 0;
  std::vector<uint64_t> device_used;  // per worker
};

// Tag index: (temporal - 1) * 8 + (role - 1), 32 tags; two calibrated
// models of 32 option sets each.
int TagIndex(Temporal t, Role r) {
  return (static_cast<int>(t) - 1) * 8 + (static_cast<int>(r) - 1);
}

void Build(size_t n_blocks, uint64_t seed, World* world) {
  std::mt19937_64 rng(seed);
  auto uni = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  auto pick = [&](uint64_t n) {
    return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng);
  };
  PressureInput& in = world->input;
  in.now_ms = 10'000'000;
  const int64_t now = in.now_ms;

  // Option sets: 2 models x 32 tags, 6-8 encodings each.
  const std::vector<Encoding> encs = AllEncodings();
  for (int model = 0; model < 2; ++model) {
    for (int tag = 0; tag < 32; ++tag) {
      const int role = tag % 8 + 1;
      const double sens = (role == 1 || role == 2 ? 8.0
                           : role == 7            ? 0.5
                                                  : 2.0) *
                          uni(0.5, 1.5);
      const size_t count = 6 + (tag + model) % 3;
      OptionSet set;
      for (size_t k = 0; k < count; ++k) {
        DemoteOption o;
        o.encoding = encs[k];
        o.bytes = kLayers * kernels::PageBytes(encs[k], kShape);
        const double bits = kernels::EffectiveBits(encs[k], kShape);
        o.distortion = k == 0 ? 0 : sens * std::exp2(-bits) * uni(0.7, 1.3);
        set.options.push_back(o);
      }
      std::sort(set.options.begin(), set.options.end(),
                [](const DemoteOption& a, const DemoteOption& b) {
                  return a.bytes > b.bytes;
                });
      in.option_sets.push_back(set);
    }
  }

  const int n_workers = absl::GetFlag(FLAGS_workers);
  const int n_tenants = absl::GetFlag(FLAGS_tenants);
  for (int w = 0; w < n_workers; ++w) {
    WorkerView wv;
    wv.worker_id = "worker-" + std::to_string(w);
    wv.capacity[1] = 80ull << 30;
    wv.capacity[2] = 256ull << 30;
    wv.capacity[3] = w % 2 == 0 ? (2ull << 40) : 0;
    in.workers.push_back(wv);
  }
  for (int t = 0; t < n_tenants; ++t) {
    TenantView tv;
    tv.tenant_id = "tenant-" + std::to_string(t);
    in.tenants.push_back(tv);
  }

  // Sequences with an agentic layout: system, tool schemas, then turns of
  // user, reasoning, tool call, tool result, assistant.
  struct SeqPlan {
    uint32_t len;
  };
  std::vector<SeqPlan> plans;
  const uint32_t mean = absl::GetFlag(FLAGS_blocks_per_sequence);
  size_t total = 0;
  while (total < n_blocks) {
    uint32_t len = static_cast<uint32_t>(mean / 4 + pick(mean * 3 / 2 + 1));
    len = static_cast<uint32_t>(std::min<size_t>(len, n_blocks - total));
    plans.push_back({len});
    total += len;
  }
  const size_t n_seqs = plans.size();
  for (size_t s = 0; s < n_seqs; ++s) {
    SequenceView sv;
    sv.sequence_id = "seq-" + std::to_string(s);
    sv.tenant = static_cast<uint32_t>(pick(n_tenants));
    sv.worker = static_cast<uint32_t>(pick(n_workers));
    // 30% active in the last 5 s, the rest idle up to 30 min.
    sv.last_access_ms =
        now - static_cast<int64_t>(pick(10) < 3 ? pick(5000) : pick(1'800'000));
    in.sequences.push_back(sv);
  }

  // Lineage ids allocated as if the sequences grew concurrently.
  std::vector<std::vector<uint64_t>> lineage(n_seqs);
  {
    uint64_t next = 1;
    size_t left = n_blocks;
    std::vector<uint32_t> pos(n_seqs, 0);
    size_t s = 0;
    while (left > 0) {
      if (pos[s] < plans[s].len) {
        lineage[s].push_back(next++);
        ++pos[s];
        --left;
      }
      s = (s + 1 + pick(3)) % n_seqs;
    }
  }

  const Role turn_roles[] = {Role::kUser, Role::kReasoning, Role::kToolCall,
                             Role::kToolResult, Role::kAssistant};
  const uint32_t turn_lens[] = {2, 4, 1, 6, 3};
  in.blocks.reserve(n_blocks);
  std::vector<std::vector<uint32_t>> seq_blocks(n_seqs);
  for (size_t s = 0; s < n_seqs; ++s) {
    const uint32_t len = plans[s].len;
    const int model = pick(10) == 0 ? -1 : static_cast<int>(pick(2));
    const bool forked = pick(20) == 0;
    uint32_t role_i = 0;
    uint32_t left_in_span = 0;
    for (uint32_t i = 0; i < len; ++i) {
      BlockView b;
      b.lineage_id = lineage[s][i];
      b.sequence = static_cast<uint32_t>(s);
      b.index = i;
      if (i < 2) {
        b.tag.role = Role::kSystem;
      } else if (i < 6) {
        b.tag.role = Role::kToolSchema;
      } else {
        if (left_in_span == 0) {
          role_i = (i == 6) ? 0 : (role_i + 1) % 5;
          left_in_span = 1 + static_cast<uint32_t>(pick(
                                 static_cast<size_t>(turn_lens[role_i]) * 2));
        }
        b.tag.role = turn_roles[role_i];
        --left_in_span;
      }
      b.tag.temporal = i == 0          ? Temporal::kSink
                       : i + 8 >= len  ? Temporal::kCurrentTurn
                       : i + 24 >= len ? Temporal::kRecentTurns
                                       : Temporal::kOlder;
      b.tokens = 16;
      b.refcount = forked && i < 6 ? 2 : 1;
      b.sealed = i + 1 < len;  // the last block is in the BF16 window
      const uint64_t tier = pick(100);
      b.tier = tier < 85   ? Tier::kDevice
               : tier < 95 ? Tier::kHost
                           : Tier::kDisk;
      if (model >= 0) {
        b.option_set = model * 32 + TagIndex(b.tag.temporal, b.tag.role);
        const auto& opts = in.option_sets[b.option_set].options;
        // Current encoding: BF16 for sink/system/current, else one of the
        // middle or low-bit options.
        size_t k = 0;
        if (b.tag.temporal == Temporal::kRecentTurns) k = 1 + pick(3);
        if (b.tag.temporal == Temporal::kOlder && b.tag.role != Role::kSystem &&
            b.tag.role != Role::kToolSchema) {
          k = 3 + pick(opts.size() - 3);
        }
        k = std::min(k, opts.size() - 1);
        b.encoding = opts[k].encoding;
        b.bytes = opts[k].bytes;
        b.distortion = opts[k].distortion;
      } else {
        b.option_set = -1;
        b.encoding = Format::kINT4;
        b.bytes = kLayers * kernels::PageBytes(b.encoding, kShape);
      }
      seq_blocks[s].push_back(static_cast<uint32_t>(in.blocks.size()));
      in.blocks.push_back(b);
    }
  }

  // Tenants: usage from their device blocks; half of them above a floor.
  world->device_used.assign(n_workers, 0);
  for (const BlockView& b : in.blocks) {
    const SequenceView& sv = in.sequences[b.sequence];
    in.tenants[sv.tenant].used[static_cast<int>(b.tier)] += b.bytes;
    in.workers[sv.worker].used[static_cast<int>(b.tier)] += b.bytes;
    if (b.tier == Tier::kDevice) world->device_used[sv.worker] += b.bytes;
  }
  for (int t = 0; t < n_tenants; ++t) {
    TenantView& tv = in.tenants[t];
    for (int tier = 1; tier <= 2; ++tier) {
      tv.floor[tier] = static_cast<uint64_t>(
          static_cast<double>(tv.used[tier]) * (t % 2 ? 0.6 : 1.4));
    }
  }

  // Graph: every block created at its sequence's pace; three attention
  // reports per sequence over up to 32 blocks (sinks and recent blocks
  // favoured), tool call -> tool result links.
  const auto g0 = Clock::now();
  BlockGraph& g = world->graph;
  for (size_t s = 0; s < n_seqs; ++s) {
    const int64_t born = in.sequences[s].last_access_ms - 60'000;
    for (uint32_t bi : seq_blocks[s]) {
      g.AddBlock(in.blocks[bi].lineage_id, born);
    }
  }
  std::vector<uint64_t> ids;
  std::vector<float> weights;
  for (size_t s = 0; s < n_seqs; ++s) {
    const auto& sb = seq_blocks[s];
    const int64_t last = in.sequences[s].last_access_ms;
    for (int rep = 0; rep < 3; ++rep) {
      ids.clear();
      weights.clear();
      const size_t want = std::min<size_t>(sb.size(), 32);
      for (size_t k = 0; k < want; ++k) {
        const size_t at = k < 4 ? k : sb.size() - 1 - pick(sb.size());
        ids.push_back(in.blocks[sb[at]].lineage_id);
        weights.push_back(static_cast<float>(k < 2 ? 0.2 : uni(0, 0.05)));
      }
      g.RecordAccess(ids, weights, last - static_cast<int64_t>(2 - rep) * 1000);
    }
    for (size_t k = 0; k + 1 < sb.size(); ++k) {
      if (in.blocks[sb[k]].tag.role == Role::kToolCall &&
          in.blocks[sb[k + 1]].tag.role == Role::kToolResult) {
        g.Link(in.blocks[sb[k]].lineage_id, in.blocks[sb[k + 1]].lineage_id,
               EdgeKind::kToolCallResult);
      }
    }
  }
  world->graph_build_ms = Ms(g0, Clock::now());
}

}  // namespace
}  // namespace triax::manager

int main(int argc, char** argv) {
  using namespace triax::manager;  // NOLINT(build/namespaces)
  using triax::Tier;
  absl::ParseCommandLine(argc, argv);
  std::vector<size_t> sizes;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_blocks), ',', absl::SkipEmpty())) {
    size_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n == 0) {
      std::fprintf(stderr, "--blocks: bad size \"%.*s\"\n",
                   static_cast<int>(part.size()), part.data());
      return 2;
    }
    sizes.push_back(n);
  }
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  std::vector<int> thread_counts;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_threads), ',', absl::SkipEmpty())) {
    int t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 1) {
      std::fprintf(stderr, "--threads: bad value \"%.*s\"\n",
                   static_cast<int>(part.size()), part.data());
      return 2;
    }
    thread_counts.push_back(t);
  }

  std::printf(
      "| blocks | mode | threads | candidates | graph build ms | importance "
      "snapshot "
      "ms | Rank ms p50 | Rank ms p90 | SelectReclaim ms p50 (all device "
      "pools, 5%% of used) |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t n : sizes) {
    World world;
    Build(n, absl::GetFlag(FLAGS_seed), &world);
    PressureInput& in = world.input;
    // Snapshot the graph into the blocks (the manager does this per
    // ranking, under its mutex).
    std::vector<double> snap;
    for (int r = 0; r < std::max(3, runs / 2); ++r) {
      const auto t0 = Clock::now();
      for (BlockView& b : in.blocks) {
        world.graph.Snapshot(b.lineage_id, in.now_ms, &b);
      }
      snap.push_back(Ms(t0, Clock::now()));
    }
    // Blocks that "changed since the snapshot": 1 in 100.
    absl::flat_hash_set<uint64_t> changed;
    for (size_t i = 0; i < in.blocks.size(); i += 100) {
      changed.insert(in.blocks[i].lineage_id);
    }
    for (PressureMode mode : {PressureMode::kDemoteFirst,
                              PressureMode::kGraphEvict, PressureMode::kLru}) {
      for (int threads : thread_counts) {
        RankerOptions opts;
        opts.mode = mode;
        opts.threads = threads;
        std::vector<double> rank_ms;
        std::vector<double> select_ms;
        size_t candidates = 0;
        RankScratch scratch;
        for (int r = 0; r < runs; ++r) {
          const auto t0 = Clock::now();
          absl::StatusOr<Ranking> ranking = Rank(in, opts, &scratch);
          const auto t1 = Clock::now();
          if (!ranking.ok()) {
            std::fprintf(stderr, "Rank: %s\n",
                         std::string(ranking.status().message()).c_str());
            return 1;
          }
          rank_ms.push_back(Ms(t0, t1));
          candidates = 0;
          for (const auto& by_tier : ranking->pools) {
            for (const auto& pool : by_tier) candidates += pool.size();
          }
          // Reclaim 5% of each worker's used device bytes.
          const auto s0 = Clock::now();
          size_t picked = 0;
          for (uint32_t w = 0; w < in.workers.size(); ++w) {
            const uint64_t need = world.device_used[w] / 20;
            picked += SelectReclaim(*ranking, w, Tier::kDevice, need,
                                    [&](const RankedAction& a) {
                                      return changed.contains(a.lineage_id);
                                    })
                          .size();
          }
          select_ms.push_back(Ms(s0, Clock::now()));
          if (picked == 0) {
            std::fprintf(stderr, "SelectReclaim picked nothing\n");
            return 1;
          }
        }
        std::printf(
            "| %zu | %s | %d | %zu | %.1f | %.2f | %.2f | %.2f | %.3f |\n", n,
            PressureModeName(mode), threads, candidates, world.graph_build_ms,
            Percentile(snap, 0.5), Percentile(rank_ms, 0.5),
            Percentile(rank_ms, 0.9), Percentile(select_ms, 0.5));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
