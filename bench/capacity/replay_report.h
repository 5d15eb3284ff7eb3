// The capacity replay's report (bench/results/capacity.md): markdown tables
// of what each policy row did to the trace, in total and per tenant, with
// the concurrency gain against the first row, and the SVG chart of each
// tenant's share of the device pool over time (common/svg.h).
//
// Thread contract: pure functions (thread-safe).
#pragma once

#include <string>
#include <vector>

#include "bench/capacity/replay_driver.h"
#include "bench/capacity/replay_trace.h"

namespace triax::bench::capacity {

// One policy row of a replay.
struct ReplayRow {
  std::string label;   // e.g. "bf16", "kivi-2", "triaxial@3.5b"
  std::string policy;  // what the sessions opened with, in words
  ReplayResult result;
};

// "N sessions (tenants a 7,512, b 2,488), T turns, X tokens (mean Y a
// session, max Z); arrivals over S s".
std::string TraceSummary(const Trace& trace);

// One row per policy: sessions admitted (after waiting), completed,
// refused, dropped, mean and max wait for the Open, turn waits (and their
// mean wait), pressure demotions / spills / evictions, policy demotions,
// the device bits per value held (ReplayResult::HeldBitsPerValue), peak
// open sessions and their mean while sessions arrive, and the gains: those
// two and the sessions admitted, over the first row's.
std::string ResultsTable(const std::vector<ReplayRow>& rows);

// One row per policy and tenant: admitted, completed, refused, dropped,
// mean Open wait, demotions + spills + evictions on its blocks, peak open
// sessions and their mean while sessions arrive, peak device share.
std::string TenantTable(const std::vector<ReplayRow>& rows);

// The checks a reader needs to trust the counts: per row, the tier plans
// applied, admission / background rounds, planned blocks not applied and
// whether the driver's action counts equal the core's (GetPressure), and
// the wall time of the replay.
std::string ChecksTable(const std::vector<ReplayRow>& rows);

// Two panels over the replay's time: each tenant's device bytes as a share
// of the pool (%), and its open sessions; at most `max_points` points a
// line (every k-th sample, and the last).
std::string ShareSvg(const ReplayRow& row, const std::string& title,
                     size_t max_points = 600);

}  // namespace triax::bench::capacity
