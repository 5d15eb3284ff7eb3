// The capacity replay's driver (docs/capacity.md "Replay"): an arrival
// trace (replay_trace.h) played through the manager core itself —
// ManagerCore's OpenSequence / ExtendSequence / CloseSequence with their
// SequencePlanner, TenantLedger and WorkerRegistry admission, and, with
// `reclaim`, admission after reclaiming (ReclaimRound, RestoreRound) and the
// background pressure round (RefreshRanking, PlanPressure: the
// PressureCoordinator and BlockRanker) as the service runs them — on a
// FakeClock that jumps from one event to the next, so a replay runs as fast
// as the core does.
//
// The workers are registry entries only (as in pressure_test_fixture.h):
// every tier command succeeds and is reported to FinishTierPlan at once;
// they report no page frames, so their room is capacity minus reserved
// bytes, and no heartbeats (CheckWorkers is never called, so none goes
// SUSPECT). Sessions send no access reports other than active=true when a
// turn starts (no hits or co-attention: the block graph has the tool call ->
// result edges only) and no token ids (no prefix reuse).
//
// Sessions. A session arrives, waits for its Open (turn 0's prompt), and
// then per turn: the prompt's Extend (new_turn; turn 0: the Open), the
// response's Extend decode_ms later, think_ms of idleness before the next
// turn, and a Close after the last response. A turn that starts after
// idleness first reports the session active and, with spill tiers, brings
// its spilled blocks back (RestoreRound). A call refused RESOURCE_EXHAUSTED
// (after reclaiming, with `reclaim`) waits in its tenant's queue of
// in-flight steps or of Opens, each FIFO. Waiting calls are retried after
// any release of device bytes (a Close, a session given up, a background
// round that freed bytes) and otherwise every retry_ms. A tenant's head is
// its oldest waiting in-flight step, else its oldest waiting Open; the
// oldest head across tenants goes first (by the time it started waiting,
// a step before an Open of the same time), whatever its kind, so that a
// tenant whose sessions are all waiting for their Open is not held behind
// another's in-flight steps; until each tenant's head was refused once. A
// newly arrived session queues behind its tenant's waiting Opens. A wait
// longer than patience_ms gives up: a waiting Open is refused; a waiting
// turn drops the session (it is closed, incomplete). Other errors end the
// replay with that error and the session named.
//
// Background round (every tick_ms, as the service's pressure loop): when
// the core NeedsReclaim and something changed since the last round that
// applied nothing, RefreshRanking then PlanPressure, applied, repeated
// while it applies something and the core still needs reclaim (at most
// max_background_stages plans a tick).
//
// Counting. Pressure actions (demotions, spills, restores, evictions) are
// counted from each applied plan's commands, on the tenant whose blocks
// they touched, and checked against FinishTierPlan's outcome (`unapplied`:
// blocks a plan named that were not applied; 0 in a replay, where nothing
// changes between a plan and its finish); the core's own counters
// (GetPressure) are kept beside them. Demotions an allocation policy makes
// at Extend (re-allocation as turns age) are policy_demotions, not pressure
// demotions. Concurrency is the number of open sessions (admitted, not yet
// closed); its mean is over the replay's span (first arrival to the last
// event) and over the arrivals' span (first to last arrival).
//
// Errors: INVALID_ARGUMENT naming the config field (workers, device_bytes,
// tick_ms, patience_ms, retry_ms, sample_ms, max_background_stages not
// positive; a tenant id twice); the core's errors setting up (a tenant, the
// policy, the calibration table) and replaying (naming the session).
//
// Thread contract: RunReplay is thread-safe (each call has its own core
// and clock).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/capacity/replay_trace.h"
#include "kvmanager/manager_core.h"

namespace triax::bench::capacity {

struct ReplayTenant {
  std::string tenant;
  uint64_t floor_bytes = 0;    // device
  uint64_t ceiling_bytes = 0;  // device; 0: no budget
};

struct ReplayConfig {
  ModelShape model;
  uint32_t block_tokens = 16;
  int workers = 1;
  uint64_t device_bytes = 0;  // per worker
  uint64_t host_bytes = 0;    // per worker spill tier; 0: none
  uint64_t disk_bytes = 0;
  // Device budgets; a tenant of the trace not listed has none.
  std::vector<ReplayTenant> tenants;
  // The policy every session opens with: a built-in or one of put_policies.
  std::string policy;
  std::vector<manager::PolicyInfo> put_policies;
  std::optional<manager::CalibrationTableInfo> calibration;
  // Admission after reclaim and the background round; off: a refused call
  // only waits.
  bool reclaim = true;
  // The core's options (ranker, watermarks, guards, resume reserve). The
  // driver sets default_block_tokens, and bounds what the core retains
  // that no replay reads (event_retention 4,096 events, closed_retention
  // 1,024 sequences).
  manager::ManagerOptions manager;
  int64_t tick_ms = 200;  // background round interval
  int max_background_stages = 16;
  int64_t patience_ms = 60'000;
  int64_t retry_ms = 1000;
  int64_t sample_ms = 1000;  // share samples
};

// What happened to one tenant's sessions (or all of them).
struct ReplayCounts {
  uint64_t sessions = 0;
  uint64_t admitted = 0;             // Open succeeded
  uint64_t admitted_after_wait = 0;  // ... after waiting
  uint64_t completed = 0;            // every turn played, then closed
  uint64_t refused = 0;              // gave up waiting for the Open
  uint64_t dropped = 0;              // admitted, gave up waiting mid-way
  uint64_t turns = 0;                // turns played to their response
  uint64_t tokens = 0;               // tokens admitted
  int64_t open_wait_ms = 0;          // arrival to Open (or giving up)
  int64_t open_wait_max_ms = 0;
  uint64_t turn_waits = 0;  // Extend / restore steps that had to wait
  int64_t turn_wait_ms = 0;
  // Pressure actions on this tenant's blocks.
  uint64_t demotions = 0, spills = 0, restores = 0, evictions = 0;
  uint64_t policy_demotions = 0;  // re-allocation at Extend
  uint32_t peak_open = 0;         // open sessions at once
  double open_ms = 0;             // integral of open sessions over time
  double open_ms_arriving = 0;    // ... until the last arrival
  uint64_t peak_device_bytes = 0;
};

// The tenants' device bytes, open sessions and their tokens at one time.
struct ReplaySample {
  int64_t t_ms = 0;                    // since the first arrival
  std::vector<uint64_t> device_bytes;  // by tenant (ReplayResult::tenants)
  std::vector<uint32_t> open;
  // Tokens admitted to the open sessions (spilled or evicted ones too).
  std::vector<uint64_t> tokens;
};

struct ReplayResult {
  std::vector<std::string> tenants;  // trace order
  ReplayCounts total;
  std::vector<ReplayCounts> by_tenant;
  std::vector<ReplaySample> samples;  // every sample_ms from 0
  uint64_t device_capacity = 0;       // every worker
  // K and V values of one token: 2 x layers x KV heads x head_dim.
  uint64_t values_per_token = 0;
  int64_t span_ms = 0;             // first arrival to the last event
  int64_t arrival_span_ms = 0;     // first arrival to the last
  uint64_t reclaim_rounds = 0;     // admission / restore rounds run
  uint64_t background_rounds = 0;  // ticks that ranked
  uint64_t plans = 0;              // tier plans applied
  uint64_t unapplied = 0;          // planned blocks not applied
  // GetPressure's counters at the end.
  uint64_t core_demotions = 0, core_spills = 0, core_restores = 0,
           core_evictions = 0;
  double wall_s = 0;
  // Mean open sessions over the span.
  double MeanOpen() const {
    return span_ms > 0 ? total.open_ms / static_cast<double>(span_ms) : 0;
  }
  // Mean open sessions while sessions arrive (the load is steady there,
  // not draining): the concurrency a saturated pool sustains.
  double MeanOpenArriving() const {
    return arrival_span_ms > 0
               ? total.open_ms_arriving / static_cast<double>(arrival_span_ms)
               : 0;
  }
  // Device bits per K/V value of the open sessions' tokens, over the
  // samples while sessions arrive (t_ms <= arrival_span_ms): the device
  // bytes summed over those samples x 8 / (their tokens summed x
  // values_per_token). Every byte the pool holds counts (scales, zeros,
  // padding, the free slots of each span's last block: a block never mixes
  // spans); tokens spilled or evicted count without their bytes. 0 without
  // tokens.
  double HeldBitsPerValue() const;
};

absl::StatusOr<ReplayResult> RunReplay(const Trace& trace,
                                       const ReplayConfig& config);

}  // namespace triax::bench::capacity
