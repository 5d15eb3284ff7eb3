// PressureCoordinator: the manager core's memory pressure. It owns the block
// graph, the published ranking snapshot (pressure_snapshot.h, ranked by
// block_ranker.h), the tier plans in flight and the counters of applied
// actions, and it plans and finishes tier moves on the registry's records.
// The worker calls themselves are the service's.
//
// Tiers: every block is in its worker's device pool, host tier or disk tier,
// or evicted (its pages dropped; it stays in the plan with evicted = true).
// Planners (PlanPressure, PlanAdmission, PlanPrefetch, ReportAccess) turn
// ranked actions into a TierPlan of worker commands, re-checking every
// block against the live registry (unchanged tier, idle, exclusively held,
// open, room in the destination tier of the worker and under the tenant's
// ceiling there). Planned blocks are busy (BlockRecord::busy = the plan's
// token) until FinishTierPlan: spills and restores reserve their
// destination at planning; the source is released when the worker call
// succeeded, the reservation returned when it failed. Each applied action
// bumps the sequence's version and emits BLOCK_DEMOTED (detail by=pressure),
// BLOCK_SPILLED, BLOCK_RESTORED or BLOCK_EVICTED. Restores never take a
// pool past its capacity (the active sequence's own blocks) or its high
// watermark (graph neighbours), nor a tenant past its device ceiling.
//
// Graph: a node per live block (BlockCreated / BlockFreed), tool call ->
// tool result edges (a tool-result block links to its sequence's newest
// tool-call block), co-attention edges and hits from ReportAccess, spill
// links between blocks spilled by one command.
//
// Error codes: INVALID_ARGUMENT (options; an access report with more than
// 4096 ids, weights of another length, a weight outside 0..1), NOT_FOUND (a
// reported lineage that is not a block of the sequence; an unknown plan
// token).
//
// Thread contract: not thread-safe; ManagerCore calls every method with mu_
// held. A snapshot is built by a SnapshotBuilder (NewSnapshot) in steps
// between which mu_ is released, ranked with no lock, and Published under
// mu_. Tokens come from ManagerCore's counter of two-phase operations
// (shared with pending demotes).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "kvmanager/block_graph.h"
#include "kvmanager/block_ranker.h"
#include "kvmanager/calibration_store.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/pressure_snapshot.h"
#include "kvmanager/sequence_table.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/types.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

// One worker call of a tier plan; the service runs it and reports the
// outcome with FinishTierPlan. A plan has one command per (sequence, kind,
// destination tier), except demotions: at most 8 blocks per command (the
// worker needs the new pages free before it frees the old).
struct TierCommand {
  enum class Kind : int { kDemote = 0, kSpill = 1, kRestore = 2, kEvict = 3 };
  Kind kind = Kind::kDemote;
  std::string worker_id;
  std::string worker_address;
  std::string tenant_id;
  std::string sequence_id;
  std::string request_id;          // for the worker's idempotency
  Tier tier = Tier::kUnspecified;  // kSpill: destination tier
  // index and lineage_id of each block; kDemote: the new encoding.
  std::vector<BlockPlan> blocks;
};

// Worker calls planned together; token 0 means nothing to do.
struct TierPlan {
  uint64_t token = 0;
  std::vector<TierCommand> commands;
  uint64_t bytes = 0;  // bytes the plan frees (or, for restores, brings back)
  std::string reason;  // "watermark worker w0", "admission tenant t", ...
};

// Why an Open / Extend was refused RESOURCE_EXHAUSTED: what reclaiming
// must make room for.
// `fraction` of `capacity` bytes (a watermark).
inline uint64_t Watermark(uint64_t capacity, double fraction) {
  return static_cast<uint64_t>(static_cast<double>(capacity) * fraction);
}

struct AdmissionShortfall {
  std::string tenant_id;
  std::string worker_id;       // the worker the request would go to
  uint64_t request_bytes = 0;  // device bytes the request needs
  // A sequence whose blocks must not be taken (the one being restored).
  std::string exclude_sequence_id;
  // A sequence whose blocks may be demoted or evicted but not spilled (the
  // one being extended: its next Attend needs its blocks on the device).
  std::string resident_sequence_id;
  // Blocks not to plan (their worker command failed earlier in the round).
  std::vector<uint64_t> skip_lineage_ids;
  // An Open that keeps room for the resumption of spilled open sequences:
  // the request must fit beside worker_held_bytes on the worker and
  // tenant_held_bytes under the tenant's ceiling (their spilled blocks'
  // bytes), so spills make no room for it (they only move bytes into that
  // reserve) and reclaim takes demotions and evictions only.
  bool resume_reserve = false;
  uint64_t worker_held_bytes = 0;
  uint64_t tenant_held_bytes = 0;
  // What the request takes of the worker's room when more than its bytes:
  // the frames it lacks count whole (WorkerRegistry::AdmissionBytes); 0:
  // request_bytes. The tenant's ceiling is checked on request_bytes.
  uint64_t worker_request_bytes = 0;
  uint64_t WorkerRequestBytes() const {
    return worker_request_bytes > request_bytes ? worker_request_bytes
                                                : request_bytes;
  }
};

// What the worker calls of one tier plan did (FinishTierPlan): actions
// applied by kind, device-pool bytes freed by demotions, spills and
// evictions of device blocks, commands that failed and their first error.
struct TierPlanOutcome {
  uint64_t device_bytes_freed = 0;
  uint32_t demotions = 0;
  uint32_t spills = 0;
  uint32_t restores = 0;
  uint32_t evictions = 0;
  uint32_t failed_commands = 0;
  absl::Status first_error;                  // of the first failed command
  std::vector<uint64_t> failed_lineage_ids;  // blocks of failed commands
  uint32_t applied() const { return demotions + spills + restores + evictions; }
};

struct RankedActionInfo {
  uint64_t lineage_id = 0;
  std::string sequence_id;
  std::string tenant_id;
  PressureAction action = PressureAction::kUnspecified;
  Encoding encoding;  // kDemote target
  uint64_t bytes_freed = 0;
  double cost = 0;
};

struct PoolState {
  std::string worker_id;
  Tier tier = Tier::kDevice;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t high_watermark_bytes = 0;
  uint64_t low_watermark_bytes = 0;
};

struct PressureState {
  std::vector<PoolState> pools;
  std::vector<TenantInfo> tenants;
  std::vector<RankedActionInfo> ranked;  // cheapest first
  std::string mode;
  uint64_t snapshot_blocks = 0;
  double snapshot_age_ms = 0;
  double ranking_ms = 0;
  double snapshot_ms = 0;       // the last snapshot's copy (in chunks)
  double snapshot_lock_ms = 0;  // its longest hold of the core mutex
  uint64_t demotions = 0;
  uint64_t spills = 0;
  uint64_t restores = 0;
  uint64_t evictions = 0;
  // Prefix reuse (filled by ManagerCore): indexed blocks, Opens that reused
  // a prefix and the blocks they shared.
  uint64_t prefix_index_blocks = 0;
  uint64_t prefix_hits = 0;
  uint64_t prefix_reused_blocks = 0;
};

struct PressureOptions {
  RankerOptions ranker;
  Watermarks watermarks;
  // Blocks ending within this many tokens of a sequence's end are taken to
  // be still in the worker's BF16 window (not spilled or evicted).
  uint32_t window_guard_tokens = 64;
  // A sequence used (Open, Extend, ReportAccess) within this many ms is
  // active: nothing of it is spilled, so a session that was just restored
  // for its turn is not spilled again before its Attend. 0: off.
  int64_t active_guard_ms = 5000;
  size_t max_plan_blocks = 4096;  // blocks one tier plan may act on
};

class PressureCoordinator {
 public:
  // Watermarks 0 < low <= high <= 1; ranker factors, penalties and weights
  // finite and >= 0, reuse_half_life_ms > 0; protected roles valid.
  // INVALID_ARGUMENT naming the option and the value.
  static absl::Status ValidateOptions(const PressureOptions& options);

  // The parts must outlive the coordinator; `next_token` is the shared
  // counter of two-phase operation tokens.
  PressureCoordinator(const PressureOptions& options, const Clock* clock,
                      WorkerRegistry* workers, TenantLedger* tenants,
                      SequenceTable* sequences,
                      const CalibrationStore* calibrations,
                      uint64_t* next_token);
  ~PressureCoordinator();

  // --- Block lifecycle (graph nodes and tool call -> result edges) ---------
  // `b` was just appended to `s`.
  void BlockCreated(SequenceRecord* s, const BlockRecord& b);
  void BlockFreed(uint64_t lineage_id) { graph_.RemoveBlock(lineage_id); }

  // --- Snapshot
  // --------------------------------------------------------------- A builder
  // over the registry and the graph (see pressure_snapshot.h).
  // spill_tiers false: ranked without spill candidates (an Open under the
  // resume reserve, where a spill makes no room).
  SnapshotBuilder NewSnapshot(bool spill_tiers = true) const;
  // Makes `snapshot` the one the planners read.
  void Publish(std::shared_ptr<const PressureSnapshot> snapshot) {
    snapshot_ = std::move(snapshot);
  }

  // --- Plans
  // ------------------------------------------------------------------ True
  // when PlanPressure has something to do: an UP worker's device pool or host
  // tier above its high watermark, or a tenant above its device ceiling.
  // O(workers + tenants).
  bool NeedsReclaim() const;
  // Every UP worker whose device pool (or host tier) is above its high
  // watermark down to the low watermark, and every tenant above its device
  // ceiling down to it. Token 0: nothing to do (or no snapshot yet).
  TierPlan PlanPressure();
  // Room for s.request_bytes more device bytes of s.tenant_id on
  // s.worker_id: the tenant's own blocks for its ceiling, any tenant's
  // (above-floor first) for the worker's room, never blocks of
  // s.exclude_sequence_id. May free less than needed.
  TierPlan PlanAdmission(const AdmissionShortfall& s);
  // Restores of every spilled block of an open sequence as far as the pool
  // (its capacity) and the tenant's ceiling allow; what does not fit goes
  // into *shortfall (when given; request_bytes 0 when everything fits).
  TierPlan PlanPrefetch(const std::string& sequence_id,
                        AdmissionShortfall* shortfall);
  // Access report checks that need no state (see "Error codes").
  static absl::Status ValidateAccessReport(const ReportAccessRequest& req);
  // Records the report on open sequence `s` (hits, attention mass,
  // co-attention edges, its last access) and plans restores of spilled
  // graph neighbours of the reported blocks (any open sequence) below the
  // pool's high watermark. NOT_FOUND for a lineage not a block of `s`.
  absl::StatusOr<TierPlan> ReportAccess(SequenceRecord* s,
                                        const ReportAccessRequest& req);
  // Applies the outcome of a plan's commands (results[i] for commands[i];
  // missing results count as failed), events into *ev. Blocks freed
  // meanwhile are skipped. NOT_FOUND for an unknown token.
  // *outcome (when given) says what was applied.
  absl::Status FinishTierPlan(uint64_t token,
                              const std::vector<absl::Status>& results,
                              std::vector<Event>* ev,
                              TierPlanOutcome* outcome = nullptr);
  // Why PlanAdmission(s) found nothing (more) to take: the device blocks
  // left on s.worker_id (of s.tenant_id when the tenant's ceiling is what
  // is short), counted with their bytes by the reason they cannot be taken
  // (in a plan, shared, in the window guard, of the excluded sequence,
  // nothing left in the ranking for them: protected from eviction and at
  // their smallest encoding with no spill room, only a spill while
  // s.resume_reserve). O(blocks of the worker's open sequences).
  std::string ExplainShortfall(const AdmissionShortfall& s) const;
  // Bytes s.request_bytes is still over by: the larger of the tenant's
  // (device ceiling) and the worker's (capacity), each counting the held
  // bytes of s; 0 when it fits.
  uint64_t ShortBytes(const AdmissionShortfall& s) const;
  // Device bytes held for the resumption of spilled blocks: the worker's
  // host- and disk-tier bytes (every such block belongs to one of its
  // sequences), and the tenant's.
  static uint64_t HeldForResume(const WorkerRecord& w);
  static uint64_t HeldForResume(const TenantRecord& t);
  // Blocks worker `w` restored on its own (restore on Attend, reported by a
  // heartbeat) move back to the device in the accounting; blocks a plan is
  // acting on are left to it.
  void ApplyWorkerRestores(WorkerRecord* w, const std::vector<uint64_t>& ids,
                           std::vector<Event>* ev);

  // --- Inspection
  // --------------------------------------------------------------- Pools (UP
  // workers, by id), tenants (by id), the top ranked actions of the snapshot's
  // device pools, counters.
  PressureState GetPressure(uint32_t top) const;
  const BlockGraph& graph() const { return graph_; }
  size_t plans_in_flight() const { return pending_.size(); }

 private:
  struct PendingPlan;
  // Each command's sequence is in doubt while the plan is pending
  // (SequenceRecord::in_doubt).
  void MarkInDoubt(const PendingPlan& p, int delta);
  using Picks = std::vector<std::pair<BlockRecord*, RankedAction>>;

  // Whether `b` may take `a` now (see the top); worker_add / tenant_add:
  // spill destination bytes already picked in this plan.
  bool ActionValid(const RankedAction& a, const BlockRecord& b,
                   const SequenceRecord& s,
                   std::array<uint64_t, kNumTiers>* worker_add,
                   uint64_t* tenant_add) const;
  // Takes candidates from pool (worker index wi, tier) of the snapshot
  // until `need` bytes are freed; `tenant` (when set) restricts to its
  // blocks, `exclude` is never taken, `resident`'s blocks and those of
  // active sequences (Active) are not spilled.
  void Pick(const PressureSnapshot& snap, uint32_t wi, Tier tier, uint64_t need,
            const TenantRecord* tenant, const SequenceRecord* exclude,
            const SequenceRecord* resident, bool no_spills, Picks* picks,
            absl::flat_hash_set<uint64_t>* taken, uint64_t* freed);
  TierPlan PlanFromPicks(const Picks& picks, const std::string& reason);
  // Used within options_.active_guard_ms of `now_ms` (none is spilled).
  bool Active(const SequenceRecord& s, int64_t now_ms) const {
    return options_.active_guard_ms > 0 &&
           now_ms - s.last_access_ms < options_.active_guard_ms;
  }
  // `limit_to_high`: restore only below the pool's high watermark (graph
  // neighbours); else up to its capacity (the active sequence's own blocks).
  TierPlan PlanRestore(const std::vector<BlockRecord*>& want,
                       const std::string& reason, bool limit_to_high,
                       uint64_t* unfit_bytes);

  const PressureOptions options_;
  const Clock* const clock_;
  WorkerRegistry* const workers_;
  TenantLedger* const tenants_;
  SequenceTable* const sequences_;
  const CalibrationStore* const calibrations_;
  uint64_t* const next_token_;

  BlockGraph graph_;
  std::shared_ptr<const PressureSnapshot> snapshot_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<PendingPlan>> pending_;
  uint64_t demotions_ = 0;
  uint64_t spills_ = 0;
  uint64_t restores_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace triax::manager
