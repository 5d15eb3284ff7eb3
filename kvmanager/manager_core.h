// The manager core: worker registry and placement, tenants and budgets,
// sequences and their block plans, lifecycle events. No gRPC or protobuf:
// domain structs in (kvmanager/types.h), absl::Status / StatusOr out.
//
// Structure. ManagerCore is the thread-safe facade: it validates requests,
// takes its one mutex, answers idempotent repeats, calls its parts in order
// and appends their events. The parts (each a class with its own header,
// thread contract and tests; all but SequencePlanner are called with mu_
// held) over the records of manager_state.h:
//   WorkerRegistry       workers: registration, heartbeats, SUSPECT/DOWN
//                        detection, placement and room checks
//                        (worker_registry.h); the facade's worker calls and
//                        the reconciliation of a returning worker are in
//                        manager_core_workers.cc
//   TenantLedger         tenants: budgets, usage per tier, admission
//                        (tenant_ledger.h)
//   PolicyStore          operator policies beside the built-ins
//                        (policy_store.h)
//   CalibrationStore     calibration tables per model (calibration_store.h)
//   SequencePlanner      spans -> span-aligned blocks, temporal tags and
//                        retagging by turn, partial-block continuation,
//                        encodings and allocations (sequence_planner.h)
//   SequenceTable        sequences by id, live blocks by lineage id, their
//                        charging and release (sequence_table.h)
//   PendingDemotes       two-phase re-encodings (pending_demotes.h)
//   PendingTransfers     two-phase worker-to-worker transfers
//                        (pending_transfers.h; the facade's calls in
//                        manager_core_transfer.cc)
//   PressureCoordinator  block graph, ranking snapshot (pressure_snapshot.h,
//                        block_ranker.h), tier plans (pressure_coordinator.h)
//   PrefixIndex          content hashes of the sequences' leading sealed
//                        blocks, for prefix reuse (prefix_index.h; the
//                        facade's calls in manager_core_prefix.cc)
// PutPolicy, DemoteBlocks and the calibration calls are in
// manager_core_policies.cc.
//
// Prefix reuse (docs/manager.md "Prefix reuse"). An Open with token ids (or
// block hashes) shares the longest chain of hashed blocks that one open
// sequence of the same salt, model, block_tokens and window holds on the
// device, up to the block before the prompt's last token, as a fork shares
// them (on that sequence's worker; refcounts; tags and formats kept); only
// the rest is admitted and charged. Open and Extend with token ids hash the
// blocks that become sealed (full, or followed by another block) while
// every earlier block has a hash. A block leaves the index when freed,
// spilled, evicted, or cut or left partial at the end by a truncation.
//
// Planning. A sequence of block_tokens = T splits each span into ceil(n/T)
// blocks; a span's last block may be partial and a block never mixes spans
// (the free slots are the measured "partial-block waste"), except that
// ExtendSequence with continue_last_span puts the first span's tokens into
// the last block's free slots when role and modality match and the block is
// not shared with a fork (shared blocks are immutable). Every block gets a
// lineage id (dense from 1, unique per manager), a tag and a format:
//   temporal: the sequence's first block is SINK; blocks of the newest turn
//   are CURRENT_TURN; blocks of the previous `recent_turns` turns are
//   RECENT_TURNS; the rest OLDER. Open is turn 0; Extend with new_turn starts
//   the next turn and re-tags the blocks whose class changed (only the turns
//   new-1 and new-1-recent_turns are visited, so the cost is O(changed)). A
//   block grown by continue_last_span joins the turn that grew it.
//   encoding: from the sequence's policy (kvmanager/policy.h) by the tag at
//   creation; retagging changes only tags; DemoteBlocks changes encodings,
//   and so does an Extend under an allocation policy (below).
// Policies: built-in ones plus operator policies from PutPolicy. A sequence
// keeps the policy version it was opened with (PutPolicy replacing a policy
// affects later opens only). OpenSequence checks every rule's encoding
// against the model shape (kernels::ValidateEncoding with {T, n_kv_heads,
// head_dim}) and fails with INVALID_ARGUMENT naming the policy, the rule and
// the reason.
// Bytes: a block costs n_layers * PageBytes(encoding, {T, n_kv_heads,
// head_dim}) (kernels/layout.h), whatever its num_tokens. The tenant's
// TIER_DEVICE usage and the worker's reservation count each block once, when
// it is created; both are released when its last reference goes (Close or
// LOST). Forks share the parent's whole blocks (refcount) on the same worker
// (a transfer may leave a shared block on several: BlockRecord::holders);
// a block cut in the middle is copied into a new lineage; only new blocks are
// charged. A shared block has one tag: the last sequence that re-tagged it
// decides its temporal class.
//
// Error codes: INVALID_ARGUMENT (bad field; the message names it and the
// value), NOT_FOUND (unknown tenant/sequence/worker/lineage), ALREADY_EXISTS
// (tenant id taken; worker id held by a different UP worker),
// PERMISSION_DENIED (another tenant's sequence), FAILED_PRECONDITION (closed
// or lost sequence), RESOURCE_EXHAUSTED (tenant ceiling or worker capacity:
// the message says what is over and by how many bytes), UNAVAILABLE (no
// worker up). A failed call changes no state.
//
// Calibration tables (PutCalibration / GetCalibration): one per model id,
// replaced whole by PutCalibration; validated (see PutCalibration) and kept
// with their source record as given. A sequence keeps the table version it
// was opened with, like its policy.
//
// Allocation policies (policy.h, budget_bits > 0). At OpenSequence and at
// every ExtendSequence the sequence's blocks are grouped by tag (temporal,
// modality, role) after this call's re-tagging, N_k = the tag's tokens, and
// the allocator (allocator.h, Solve) picks one encoding per tag minimizing
// sum_k N_k D_k subject to sum_k N_k b_k <= budget_bits * sum_k N_k, where
// b_k = kernels::EffectiveBits of a full page of the sequence's shape
// {block_tokens, n_kv_heads, head_dim} and D_k the table's distortion.
// Pinned tags (Policy::IsPinned: sinks by default) take BF16 and count in
// the sum. Options of a tag are the table entries of the tag, restricted to
// the policy's candidates and to encodings valid for the sequence's shape; a
// tag without such entries borrows those of the nearest tag with the same
// role (same temporal and another modality first, TEXT preferred; then the
// nearest temporal, ties to the older; then the modality); a role without
// any is pinned BF16. New blocks are created in their tag's choice. Existing
// blocks (not shared with a fork) whose tag's choice now has FEWER bytes
// than their encoding are demoted in place; never promoted. Open fails
// RESOURCE_EXHAUSTED when even the cheapest options exceed the budget
// (message: minimum average bits vs budget); Extend then takes the cheapest
// option of every tag and logs a warning (an Extend never fails for the
// policy). Open also fails FAILED_PRECONDITION when the calibration table is
// missing or its shape (n_layers, n_kv_heads, n_q_heads, head_dim) differs
// from the sequence's, and INVALID_ARGUMENT for a candidate invalid for the
// shape.
// Demotion at Extend is two-phase like DemoteBlocks: ExtendSequence commits
// the extension and the new allocation, and returns `demotion` (the worker's
// DemoteRequest and a token; no bytes reserved, the demotion only frees);
// the caller runs the worker's Demote and then FinishExtendDemotion(token,
// worker status), which commits the new encodings (tenant usage and worker
// reservation drop) or, when the worker failed or the sequence changed
// meanwhile, leaves those blocks in their encoding; the Extend succeeds
// either way. Until it is finished, the same Extend request_id again is
// ABORTED ("in progress"); afterwards it returns the final reply.
// Admission of an Extend counts the new blocks only (not the savings of the
// demotions it triggers, which may fail).
//
// DemoteBlocks is two-phase so that the core does no I/O:
//   PrepareDemote validates (tenant, ownership, open state, every lineage a
//   block of the sequence and not shared with a fork, encodings valid for the
//   shape, budget and worker room when bytes grow), reserves the growth
//   (tenant usage and worker reservation) and returns the worker's
//   DemoteRequest content plus a token;
//   the caller runs the worker's Demote, then either CommitDemote(token)
//   (applies: new encodings, bytes, BLOCK_DEMOTED events; ABORTED when the
//   sequence changed since the prepare, the reservation is returned and the
//   plan is unchanged) or AbortDemote(token) (returns the reservation).
// Every mutation of a sequence (extend, fork from it, demote, close, loss)
// bumps its version; a pending demote commits only on an unchanged version.
//
// Memory pressure (pressure_coordinator.h, block_ranker.h). Every block is in
// one tier: the worker's device pool, its host tier or its disk tier (spilled),
// or evicted (its pages dropped; it stays in the plan with evicted = true and
// its tokens are no longer attended). A block's bytes are charged to the
// tenant's and the worker's usage of its tier (evicted: nothing). The block
// graph (block_graph.h) has a node per live block, tool call ->
// tool result edges (a tool-result block links to the sequence's newest
// tool-call block), co-attention edges and hits from ReportAccess.
// RefreshRanking snapshots every block held by exactly one open sequence
// (shared blocks are never acted on), with its tag's encoding options from
// the sequence's calibration table (the allocation policy's, else the table
// stored under the model's name when its shape matches; without one, a
// fallback noise model 2^(-2 (bits - 2))), and ranks them outside the lock.
// Blocks ending within window_guard_tokens of the sequence's end are taken
// to be in the worker's BF16 window and not ranked. The planners (PlanPressure,
// PlanAdmission, ReportAccess/PlanPrefetch) turn ranked actions into a
// TierPlan of worker commands, re-checking every block against the live
// registry (unchanged tier, not busy, room in the destination tier of the
// worker and the tenant's ceiling there); planned blocks are busy (skipped
// by other plans, refused by DemoteBlocks with ABORTED, and by Fork) until
// FinishTierPlan. Spills and restores reserve their destination at
// planning; the source is released at FinishTierPlan when the worker call
// succeeded, and the reservation returned when it failed. Each applied
// action bumps the sequence's version and emits BLOCK_DEMOTED (detail
// by=pressure), BLOCK_SPILLED, BLOCK_RESTORED or BLOCK_EVICTED. Blocks the
// worker restored on its own (restore on Attend) arrive with the next
// Heartbeat (Inventory.restored_lineage_ids) and move back to the device in
// the accounting. Prefetches never push a pool above its high watermark or
// a tenant above its ceiling. Extend's aging demotions skip spilled,
// evicted and busy blocks; Fork refuses a parent whose kept blocks are not
// all in the device pool (FAILED_PRECONDITION).
//
// Workers (worker_registry.h "States"). A worker silent for
// worker_timeout_ms is SUSPECT (WORKER_SUSPECT): nothing new is placed on
// it, its sequences stay OPEN, and the calls that need it (Extend, Fork,
// DemoteBlocks, ReportAccess of its sequences) fail UNAVAILABLE naming it;
// Close still works (the worker is told to free the pages when it returns).
// A heartbeat of the same incarnation makes it UP again (WORKER_RECOVERED).
// Silent for worker_down_timeout_ms it is DOWN (WORKER_DOWN): its open
// sequences are LOST (BLOCK_LOST, SEQUENCE_LOST), their bytes released, and
// their block plans kept ("parked") for a return. Heartbeats of a DOWN
// worker are refused NOT_FOUND, so it re-registers. A registration with the
// incarnation the worker had (the same process: it was paused) reconciles:
// each parked sequence the inventory still lists is OPEN again with its old
// blocks and lineage ids, charged again to its tenant and worker even above
// the tenant's device ceiling (the pages exist; the pressure loop then
// reclaims down to the ceiling; SEQUENCE_RECOVERED's detail says by how
// much it is over), and WORKER_RECOVERED is emitted. A registration with
// another incarnation (or none) is a restart: open sequences become LOST
// (reason worker_restarted) and parked ones stay LOST. Every registration
// and heartbeat answers release_sequence_ids: the inventory's sequences the
// manager does not hold open on that worker (closed meanwhile, lost for
// good, unknown), which the worker frees.
//
// Idempotency: mutating calls with a non-empty request_id remember their
// successful reply (per method, per tenant or worker, the newest
// `idempotency_capacity`); the same request_id again returns that reply
// without applying anything. Failed calls are not remembered (they changed
// nothing, so a retry is safe).
//
// Thread contract: thread-safe; one mutex guards all state, and no call does
// work proportional to the total number of blocks (List* calls are
// proportional to what they return) except RefreshRanking's snapshot copy
// (O(blocks), in chunks of 4,096 blocks with the mutex released in between;
// the ranking itself runs outside it). Lock order: rank_mu_ (serializes
// RefreshRanking's Rank; never taken with mu_ held) -> ManagerCore::mu_ ->
// EventLog and the idempotency caches (their own mutexes; subscriber notify
// callbacks run under mu_ and must not call back into the core).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/idempotency.h"
#include "kvmanager/block_ranker.h"
#include "kvmanager/calibration_store.h"
#include "kvmanager/event_log.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/metadata_journal.h"
#include "kvmanager/paging.h"
#include "kvmanager/pending_demotes.h"
#include "kvmanager/pending_transfers.h"
#include "kvmanager/policy.h"
#include "kvmanager/policy_store.h"
#include "kvmanager/prefix_index.h"
#include "kvmanager/pressure_coordinator.h"
#include "kvmanager/sequence_planner.h"
#include "kvmanager/sequence_table.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/token_store.h"
#include "kvmanager/types.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

// The limits (kMaxSequenceTokens, kMaxSequenceBlocks, kMaxBlockTokens,
// kMaxOperatorPolicies, kMaxCalibrationEntries, kMaxCalibrationModels) and
// the pressure structs (TierCommand, TierPlan, AdmissionShortfall,
// PressureState, ...) come from the parts' headers included above.

struct ManagerOptions {
  int64_t worker_timeout_ms = 3000;  // no heartbeat this long -> SUSPECT
  // No heartbeat this long -> DOWN (sequences LOST); > worker_timeout_ms.
  int64_t worker_down_timeout_ms = 30000;
  uint32_t heartbeat_interval_ms = 1000;  // told to workers at registration
  uint32_t default_block_tokens = 16;     // 1..4096
  uint32_t recent_turns = 2;  // turns before the newest that are "recent"
  size_t event_retention = 1'000'000;  // events kept for replay and trace
  // And fewer when their estimated bytes pass this (EventLog::EventBytes;
  // 0: no byte bound).
  uint64_t event_retention_bytes = 1ull << 30;
  size_t watcher_queue_limit = 65'536;  // live events a watcher may lag
  std::string default_policy = kDefaultPolicy;
  size_t closed_retention = 100'000;  // closed/lost sequences still queryable
  size_t idempotency_capacity = 16'384;  // remembered replies per method
  // Memory pressure (see "Memory pressure" above).
  RankerOptions ranker;
  Watermarks watermarks;
  // Blocks ending within this many tokens of a sequence's end are taken to
  // be still in the worker's BF16 window (not spilled or evicted).
  uint32_t window_guard_tokens = 64;
  // Sequences used (Open, Extend, ReportAccess) this recently are not
  // spilled (see PressureOptions::active_guard_ms); >= 0, 0: off.
  int64_t active_guard_ms = 5000;
  size_t max_plan_blocks = 4096;  // blocks one tier plan may act on
  // An Open must fit beside the device bytes of the spilled blocks of open
  // sequences (worker's and tenant's), so that they can come back.
  bool resume_reserve = true;
  // How long a reclaim round of an admission or a restore may run (the
  // service also stops at the RPC's deadline); > 0.
  int64_t admission_deadline_ms = 5000;
  // Bound on a TransferSequence whose request has timeout_ms 0;
  // 1..kMaxTransferTimeoutMs.
  uint32_t transfer_timeout_ms = 10000;
  // Open sequences one tenant may hold (Open and Fork past it:
  // RESOURCE_EXHAUSTED naming the limit); 0: no limit. Closed and lost ones
  // do not count.
  uint32_t max_sequences_per_tenant = 1'000'000;
};

class ManagerCore {
 public:
  // INVALID_ARGUMENT for bad options (unknown default_policy, block tokens out
  // of range, zero timeout/retention). `clock` must outlive the core.
  static absl::StatusOr<std::unique_ptr<ManagerCore>> Create(
      const ManagerOptions& options, const Clock* clock);
  ~ManagerCore();

  const ManagerOptions& options() const { return options_; }

  // --- Workers ---------------------------------------------------------------
  // Registers (or re-registers) a worker as UP; see "Workers" above for
  // what a known id re-registering with the same or another incarnation
  // does. ALREADY_EXISTS when a worker at a different address is UP or
  // SUSPECT under the id; INVALID_ARGUMENT for a malformed incarnation.
  absl::StatusOr<RegisterWorkerResult> RegisterWorker(
      const RegisterWorkerRequest& req);
  // Records the inventory; a SUSPECT worker is UP again. NOT_FOUND
  // ("re-register") for an unknown or DOWN worker; INVALID_ARGUMENT
  // (incarnation missing for a worker registered with one, or malformed),
  // FAILED_PRECONDITION (another incarnation: a stale process).
  absl::StatusOr<HeartbeatResult> Heartbeat(
      const std::string& worker_id, const Inventory& inventory,
      const std::string& incarnation = "");
  std::vector<WorkerInfo> ListWorkers() const;
  // Every device byte ever planned onto a worker (WorkerRecord::
  // planned_total; 0 when unknown), read before asking it for its inventory
  // (RefreshWorkerRoom).
  uint64_t PlannedOn(const std::string& worker_id) const;
  // Takes the frame fields of `inventory` (a GetInventory answer, asked for
  // after a reclaim stage changed the worker's pages) as the worker's room,
  // as a heartbeat would, without touching its liveness or anything else
  // the heartbeat carries. `planned_before` is PlannedOn from before the
  // call: what was planned after it counts as not yet in the frames. No-op
  // for an unknown worker or one that is not UP.
  void RefreshWorkerRoom(const std::string& worker_id,
                         const Inventory& inventory, uint64_t planned_before);
  // Marks SUSPECT every UP worker without a heartbeat for more than
  // worker_timeout_ms (WORKER_SUSPECT; ids into *suspect when given), and
  // DOWN every SUSPECT one silent for more than worker_down_timeout_ms:
  // their open sequences become LOST (BLOCK_LOST per block, SEQUENCE_LOST
  // with all lineage ids, WORKER_DOWN) and are parked. Returns the ids
  // marked down.
  std::vector<std::string> CheckWorkers(
      std::vector<std::string>* suspect = nullptr);

  // --- Tenants ---------------------------------------------------------------
  absl::StatusOr<TenantInfo> CreateTenant(const CreateTenantRequest& req);
  absl::StatusOr<TenantInfo> SetBudget(const SetBudgetRequest& req);
  absl::StatusOr<TenantInfo> GetTenant(const std::string& tenant_id) const;
  std::vector<TenantInfo> ListTenants() const;

  // --- Sequences -------------------------------------------------------------
  // A RESOURCE_EXHAUSTED for the tenant's device ceiling or the worker's
  // room fills *shortfall (when given), for PlanAdmission. With
  // options.resume_reserve an Open also counts, on its worker and under its
  // tenant's ceiling, the bytes of spilled blocks (host and disk tiers) as
  // taken: they are held for their open sequences to come back.
  absl::StatusOr<SequenceInfo> OpenSequence(
      const OpenSequenceRequest& req, AdmissionShortfall* shortfall = nullptr);
  absl::StatusOr<ExtendSequenceResult> ExtendSequence(
      const ExtendSequenceRequest& req,
      AdmissionShortfall* shortfall = nullptr);
  absl::StatusOr<SequenceInfo> ForkSequence(const ForkSequenceRequest& req);
  absl::StatusOr<CloseSequenceResult> CloseSequence(
      const CloseSequenceRequest& req);
  // Drops tokens num_tokens.. from the plan (manager_core_truncate.cc; the
  // proto's TruncateSequenceRequest says what changes and the errors).
  absl::StatusOr<TruncateSequenceResult> TruncateSequence(
      const TruncateSequenceRequest& req);
  // tenant_id empty: operator view (any tenant). Closed and lost sequences
  // are returned (without blocks) while retained.
  absl::StatusOr<SequenceInfo> GetSequence(
      const std::string& tenant_id, const std::string& sequence_id) const;
  // Without blocks, ordered by sequence id. tenant_id empty: all tenants.
  absl::StatusOr<std::vector<SequenceInfo>> ListSequences(
      const std::string& tenant_id, bool include_closed) const;

  // Finishes an Extend whose result carried `demotion`: `worker_status` is
  // the worker Demote's outcome. Returns the Extend's final reply
  // (demoted_blocks filled when committed) and remembers it for the request
  // id. NOT_FOUND for an unknown token.
  absl::StatusOr<ExtendSequenceResult> FinishExtendDemotion(
      uint64_t token, const absl::Status& worker_status);

  // --- Calibration -----------------------------------------------------------
  // Stores (replaces) the table of table.model. INVALID_ARGUMENT naming the
  // field: model not an id; shape invalid (as OpenSequence's model);
  // block_tokens outside 1..kMaxBlockTokens; no entries or more than
  // kMaxCalibrationEntries; an entry with temporal or role unspecified or out
  // of range, modality out of range (UNSPECIFIED is stored as TEXT), an
  // invalid encoding or one invalid for {block_tokens, n_kv_heads, head_dim},
  // distortion not finite or < 0; two entries with the same tag and
  // encoding. RESOURCE_EXHAUSTED past kMaxCalibrationModels models.
  // Idempotent by request_id. Returns the number of entries stored.
  absl::StatusOr<uint32_t> PutCalibration(const PutCalibrationRequest& req);
  // NOT_FOUND naming the model. Entries canonical, source as given.
  absl::StatusOr<CalibrationTableInfo> GetCalibration(
      const std::string& model) const;

  // --- Policies --------------------------------------------------------------
  // Adds or replaces an operator policy (validation: policy.h BuildPolicy).
  // FAILED_PRECONDITION for a built-in name. Returns the stored policy.
  absl::StatusOr<PolicyInfo> PutPolicy(const PutPolicyRequest& req);
  // Built-in policies first (in their fixed order), then operator policies
  // by name.
  std::vector<PolicyInfo> ListPolicies() const;

  // --- DemoteBlocks (two-phase, see above) ----------------------------------
  // Errors: INVALID_ARGUMENT (empty or too many blocks, a duplicate lineage,
  // a bad encoding or one invalid for the model shape), NOT_FOUND (tenant,
  // sequence, or a lineage that is not a block of the sequence),
  // PERMISSION_DENIED, FAILED_PRECONDITION (not open; a block shared with a
  // fork), RESOURCE_EXHAUSTED (growth over the tenant ceiling or the
  // worker's room), ABORTED (the same request id is already in flight).
  absl::StatusOr<DemotePrepared> PrepareDemote(const DemoteBlocksRequest& req);
  // NOT_FOUND for an unknown token; ABORTED when the sequence changed since
  // the prepare (nothing applied). The token is consumed either way.
  absl::StatusOr<DemoteBlocksResult> CommitDemote(uint64_t token);
  // Drops a pending demote and returns its reservation; no-op when unknown.
  void AbortDemote(uint64_t token);

  // --- TransferSequence (two-phase, manager_core_transfer.cc) ---------------
  // Moves an open sequence to another worker (docs/manager.md "Transfers").
  // PrepareTransfer validates, picks or checks the destination, chooses the
  // destination encodings (destination_policy: its rule or allocation per
  // tag, as an Open under it would; empty: each block keeps its own),
  // reserves the moving blocks' bytes in those encodings on the tenant
  // (TIER_DEVICE, against its ceiling: both copies exist until the commit)
  // and the destination worker, marks the sequence transferring and emits
  // TRANSFER_STARTED. Blocks shared with other sequences move as copies in
  // their encodings (the source keeps its copy for the others). A prefix
  // hit (first_block K > 0) goes to the worker of
  // destination_prefix_sequence_id, whose blocks [0, K) must be the
  // sequence's (same blocks, full, on the device): only blocks [K, n) are
  // reserved and pulled. While it is marked, Extend, Fork, Truncate,
  // DemoteBlocks and Close fail FAILED_PRECONDITION ("sequence S is being
  // transferred (transfer T ...)") and pressure plans skip its blocks.
  // Errors: INVALID_ARGUMENT (a bad field; destination = the source),
  // NOT_FOUND (tenant, sequence, destination worker, destination_policy),
  // PERMISSION_DENIED (another tenant's sequence), FAILED_PRECONDITION (not
  // open; already transferring; a shared block not on the device; a moving
  // block the destination holds already; a prefix hit's rules; a
  // calibration table the policy needs missing), UNAVAILABLE (the source
  // SUSPECT; the destination not UP or its device failed; no UP worker besides
  // the source), RESOURCE_EXHAUSTED (the tenant's ceiling or the destination's
  // room, nothing reserved), ABORTED (a block busy with a tier plan; the
  // same request id in flight). A repeat of the request id of a transfer
  // that ended returns its final reply: the committed reply in `done`, or
  // the error it aborted with. (Refusals here start nothing and are not
  // remembered.)
  absl::StatusOr<TransferPrepared> PrepareTransfer(
      const TransferSequenceRequest& req);
  // Commits: the sequence is on the destination (placement, encodings,
  // TIER_DEVICE for every moved block), the source's charges are released
  // (of a shared block: the source's copy, when the sequence was its last
  // holder there), the reservation becomes the charge; a prefix hit's
  // blocks join the destination's copies (charged now if the prefix let go
  // of them meanwhile); BLOCK_TRANSFERRED per moved or shared block and
  // SEQUENCE_TRANSFERRED. NOT_FOUND for an unknown token. When the sequence
  // is no longer open or a worker of the transfer went DOWN or restarted
  // meanwhile, aborts instead (as AbortTransfer) and returns ABORTED naming
  // the reason. The token is consumed either way.
  absl::StatusOr<TransferCommitted> CommitTransfer(
      uint64_t token, const TransferImportFigures& figures);
  // Returns every reservation, clears the mark, emits TRANSFER_FAILED with
  // `error` and remembers `error` as the final reply of the request id; the
  // sequence stays on the source, unchanged. No-op for an unknown token.
  void AbortTransfer(uint64_t token, const absl::Status& error);

  // --- Memory pressure (pressure_coordinator.h) -----------------------------
  // Builds a snapshot of every rankable block under the lock, ranks it
  // outside the lock (block_ranker.h Rank) and publishes it; the planners below
  // read the published snapshot. Returns the ranking time in ms.
  // spill_tiers false ranks without spill candidates (each block's cheapest
  // demotion or eviction), for an Open under the resume reserve.
  double RefreshRanking(bool spill_tiers = true);
  // Plans actions for every UP worker whose device pool (or host tier) is
  // above its high watermark, down to the low watermark, and for every
  // tenant above its device ceiling (after SetBudget lowered it), down to
  // the ceiling. token 0: nothing to do.
  TierPlan PlanPressure();
  // True when PlanPressure has something to do: an UP worker's device pool
  // or host tier above its high watermark, or a tenant above its device
  // ceiling. O(workers + tenants), for the background loop to skip idle
  // rounds.
  bool NeedsReclaim() const;
  // Plans actions that make room for `s.request_bytes` more device bytes of
  // `s.tenant_id` on `s.worker_id`: the tenant's own blocks for its ceiling,
  // any tenant's (above-floor first) for the worker's room. The plan may
  // free less than needed (the retried request then fails with the
  // remaining shortfall).
  TierPlan PlanAdmission(const AdmissionShortfall& s);
  // Plans restores of every spilled block of an open sequence, as far as
  // the worker's pool (its capacity) and the tenant's ceiling allow; what
  // does not fit goes into *shortfall (when given; request_bytes 0 when
  // everything fits), for PlanAdmission to make room. Run when a sequence
  // becomes active (ReportAccess active=true, ExtendSequence).
  TierPlan PlanPrefetch(const std::string& sequence_id,
                        AdmissionShortfall* shortfall = nullptr);
  // Records an access report (hits, attention mass, co-attention edges) and
  // plans restores of spilled graph neighbours of the reported blocks (any
  // open sequence) as far as the pool's high watermark and the tenant's
  // ceiling allow. (req.active: the service then restores the sequence's
  // own spilled blocks with PlanPrefetch, reclaiming room if needed.)
  // INVALID_ARGUMENT (more than 4096 ids, weights of another length, a weight
  // outside 0..1), NOT_FOUND (tenant, sequence, a lineage id not in the
  // sequence), PERMISSION_DENIED, FAILED_PRECONDITION (not open).
  absl::StatusOr<TierPlan> ReportAccess(const ReportAccessRequest& req);
  // Applies the outcome of a plan's commands (results[i] for commands[i]):
  // successful ones change tiers, encodings, bytes and emit events; failed
  // ones return their reservations. Blocks freed meanwhile are skipped.
  // NOT_FOUND for an unknown token.
  // *outcome (when given): what was applied, by kind, and the device bytes
  // freed.
  absl::Status FinishTierPlan(uint64_t token,
                              const std::vector<absl::Status>& results,
                              TierPlanOutcome* outcome = nullptr);
  // Why PlanAdmission(s) has nothing (more) to take, block counts and bytes
  // by reason (PressureCoordinator::ExplainShortfall).
  std::string ExplainShortfall(const AdmissionShortfall& s) const;
  // Bytes the request of `s` is still over by (0 when it fits).
  uint64_t ShortBytes(const AdmissionShortfall& s) const;
  // Pools, tenants, the top ranked actions of the snapshot, counters.
  PressureState GetPressure(uint32_t top) const;

  // --- Durable metadata (manager_core_durable.cc; metadata_journal.h) -------
  // Rebuilds what a journal recovered, on a core that holds nothing yet
  // (FAILED_PRECONDITION otherwise): tenants, operator policies and
  // calibration tables, every retained sequence with its blocks (charged
  // again to their tenants and workers by the accounting rules above), the
  // id counters (continuing past every id the previous run may have handed
  // out). The workers are SUSPECT until they report; a worker's first
  // heartbeat or registration with the same incarnation reconciles: its
  // open sequences its inventory does not list are LOST (reason
  // not_on_worker), and what it holds that is not open here it is told to
  // free (release_sequence_ids). A worker that never reports goes DOWN
  // after worker_down_timeout_ms as usual. DATA_LOSS naming the record when
  // the recovered records are inconsistent (a sequence of an unknown
  // tenant or worker, a block missing).
  absl::Status Restore(RecoveredState state);
  // Journals every later change to `journal` (not owned; outlives the
  // core), starting with a snapshot of everything (waited for).
  void SetJournal(MetadataJournal* journal);
  // Replies wait for durability without blocking a thread: with
  // DeferDurableWaits(true) (the service's mode) a call that changed state
  // does not wait for its record; it leaves the record's ticket in the
  // calling thread, and the caller hands TakeDurableTicket() to WhenDurable
  // with its reply, which runs once the record is on disk (now when the
  // ticket is 0 or no journal is set).
  void DeferDurableWaits(bool defer) { defer_waits_ = defer; }
  // Waits until this thread's changes are durable (with DeferDurableWaits):
  // before a worker is told to act on a prepared change, so that a
  // restarted manager knows it was in flight.
  void AwaitDurable();
  // After a restart: the blocks a worker described
  // (Inventory::described, asked for RegisterWorkerResult::
  // describe_sequence_ids) replace what the manager stored where they
  // differ — a demote or tier plan the worker applied but the manager had
  // not committed when it stopped: encodings, bytes, tiers and evictions
  // adopted, charges moved, one event per block (detail by=reconcile).
  // Blocks shared, busy or of sequences no longer open there are left
  // alone. NOT_FOUND for an unknown worker.
  absl::Status AdoptWorkerBlocks(const std::string& worker_id,
                                 const Inventory& described);
  static uint64_t TakeDurableTicket();
  // may_wait false: never in this thread (always the writer thread's).
  void WhenDurable(uint64_t ticket, std::function<void()> fn,
                   bool may_wait = true);
  // Counts of what is held: tenants, workers, retained sequences, live
  // blocks (recovery figures).
  struct Counts {
    size_t tenants = 0, workers = 0, sequences = 0, blocks = 0;
  };
  Counts GetCounts() const;

  // --- Identity (manager_core_tokens.cc; token_store.h) ----------------------
  // Issues a token (stored hashed, journaled like a tenant): role "tenant"
  // names an existing tenant (NOT_FOUND otherwise). INVALID_ARGUMENT naming
  // role, tenant_id, ttl_seconds or description (over 256 bytes).
  absl::StatusOr<IssuedToken> IssueToken(const std::string& role,
                                         const std::string& tenant_id,
                                         uint64_t ttl_seconds,
                                         const std::string& description);
  // NOT_FOUND for an unknown id (or the bootstrap admin token, which is
  // revoked by changing its file).
  absl::Status RevokeToken(const std::string& token_id);
  std::vector<TokenRecord> ListTokens() const;
  // Verifies bearer tokens without the core's mutex.
  const TokenStore& tokens() const { return tokens_; }
  // kvmanager --admin_token_file, before serving.
  absl::Status AddBootstrapToken(const std::string& token) {
    return tokens_.AddBootstrap(token);
  }
  int64_t NowMs() const { return clock_->NowMs(); }
  // The key of the workers' capabilities: the stored one, else a new one
  // (journaled, so a restarted or failed-over manager signs with the same
  // key and the capabilities clients hold stay valid).
  absl::StatusOr<std::string> EnsureCapabilityKey();

  // --- Events ----------------------------------------------------------------
  // NOT_FOUND when the lineage is neither live nor in retained events.
  absl::StatusOr<TraceResult> QueryTrace(uint64_t lineage_id) const;

  // --- Paged lists (manager_core_list.cc; paging.h) --------------------------
  // One page each, in the order of the unpaged calls above (workers,
  // tenants and sequences by id, policies built-in first then by name, a
  // trace's events by id), costing O(log n + page) under mu_.
  // INVALID_ARGUMENT naming page_size (negative) or page_token (malformed,
  // another list's, or issued for other filter fields); ListSequences also
  // as the unpaged call for tenant_id. QueryTrace's page carries
  // `block` and `sequence_id` every time, its events in `events` and the
  // next token in next_page_token.
  absl::StatusOr<Page<WorkerInfo>> ListWorkers(const PageRequest& page) const;
  absl::StatusOr<Page<TenantInfo>> ListTenants(const PageRequest& page) const;
  absl::StatusOr<Page<SequenceInfo>> ListSequences(
      const std::string& tenant_id, bool include_closed,
      const PageRequest& page) const;
  absl::StatusOr<Page<PolicyInfo>> ListPolicies(const PageRequest& page) const;
  absl::StatusOr<TraceResult> QueryTrace(uint64_t lineage_id,
                                         const PageRequest& page) const;
  EventLog& events() { return events_; }

  // --- KV events (kv_events.h) -----------------------------------------------
  // A block as the KV event publisher reads it: its chained content hash
  // (empty: not sealed or no token ids), its parent's (empty: block 0 or
  // unknown) and where its pages are.
  struct HashedBlock {
    uint64_t lineage_id = 0;
    uint32_t index = 0;
    std::string hash;
    std::string parent_hash;
    std::vector<uint32_t> token_ids;  // empty unless KeepBlockTokenIds
    uint32_t num_tokens = 0;
    Tier tier = Tier::kDevice;
    bool evicted = false;
  };
  // The live blocks of the open `sequence_ids` (index order), then the live
  // `lineage_ids` not listed yet; with `all`, the hashed blocks of every open
  // sequence instead. Unknown ids are skipped. Takes mu_.
  std::vector<HashedBlock> HashedBlocks(
      const std::vector<std::string>& sequence_ids,
      const std::vector<uint64_t>& lineage_ids, bool all) const;
  // Blocks sealed from now on keep their token ids (BlockRecord::token_ids),
  // which KV events carry; off by default (4 bytes a token).
  void KeepBlockTokenIds(bool keep);

 private:
  ManagerCore(const ManagerOptions& options, const Clock* clock);

  // Holds mu_ for a call that may change state; on release, hands what the
  // call changed to the journal (still under mu_), then waits without mu_
  // until it is durable.
  class ABSL_SCOPED_LOCKABLE JournaledLock {
   public:
    explicit JournaledLock(ManagerCore* core)
        ABSL_EXCLUSIVE_LOCK_FUNCTION(core->mu_)
        : core_(core) {
      core_->mu_.Lock();
    }
    ~JournaledLock() ABSL_UNLOCK_FUNCTION();
    JournaledLock(const JournaledLock&) = delete;
    JournaledLock& operator=(const JournaledLock&) = delete;

   private:
    ManagerCore* const core_;
  };
  // A recovered worker's first report (manager_core_durable.cc): its open
  // sequences `inventory` does not list are LOST.
  // Returns its open sequences that were in doubt (WorkerRecord::verify).
  // EVENT_BLOCK_SEALED for each block of `sealed` (lineage id, the
  // worker's unix ms) still live on `w`.
  void SealedEventsLocked(
      const WorkerRecord& w,
      const std::vector<std::pair<uint64_t, int64_t>>& sealed,
      std::vector<Event>* ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> ReconcileRecoveredLocked(
      WorkerRecord* w, const Inventory& inventory, std::vector<Event>* ev,
      std::vector<EventLog::LastPlan>* forgotten)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StateView ViewLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // options_.resume_reserve: an Open of `bytes` on `worker` must fit beside
  // the bytes held for spilled open sequences (worker's and tenant's);
  // RESOURCE_EXHAUSTED naming both, with *shortfall filled, when not.
  // `returning` of the tenant's held bytes come back with the request itself
  // (a transfer's spilled blocks) and are not counted as held.
  absl::Status CheckResumeReserveLocked(const TenantRecord& tenant,
                                        const WorkerRecord& worker,
                                        uint64_t bytes,
                                        AdmissionShortfall* shortfall,
                                        uint64_t returning = 0) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks an Open's shortfall with the bytes held for resumption (when
  // options_.resume_reserve), so that its reclaim takes no spills.
  void HoldForResumeLocked(const TenantRecord& tenant,
                           const WorkerRecord& worker,
                           AdmissionShortfall* shortfall) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A sequence the tenant may mutate: INVALID_ARGUMENT / NOT_FOUND for the
  // tenant, then SequenceTable::FindOpen; with `needs_worker`, UNAVAILABLE
  // naming the worker when it is SUSPECT.
  // With `mutates`, FAILED_PRECONDITION while the sequence is being
  // transferred (CheckNotTransferring).
  absl::StatusOr<SequenceRecord*> FindOpenSequenceLocked(
      const std::string& tenant_id, const std::string& field,
      const std::string& sequence_id, bool needs_worker = true,
      bool mutates = true) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // --- Transfers (manager_core_transfer.cc) ---
  // The destination of a transfer of `s`: the named worker (checked) or the
  // UP worker other than the source with a healthy device and the most room
  // that admits `bytes` / `demand` as an Open there would be admitted
  // (TransferAdmitsLocked).
  // A prefix hit's checks (req.first_block > 0; docs/manager.md
  // "Transfers"): returns the destination's prefix sequence, or nullptr for
  // first_block 0.
  absl::StatusOr<const SequenceRecord*> TransferPrefixLocked(
      const TransferSequenceRequest& req, const SequenceRecord& s) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<WorkerRecord*> TransferDestinationLocked(
      const SequenceRecord& s, const std::string& named, uint64_t bytes,
      const Demand& demand) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The admission rules of an Open of `bytes` on `w`, for a transfer of `s`
  // there: the device pool's room (WorkerRegistry::Fits) and, with
  // options_.resume_reserve, the bytes held for spilled open sequences to
  // resume (CheckResumeReserveLocked; s's own spilled blocks move with it
  // and are not held). RESOURCE_EXHAUSTED naming the worker, the bytes and
  // the rule.
  absl::Status TransferAdmitsLocked(const SequenceRecord& s,
                                    const WorkerRecord& w, uint64_t bytes,
                                    const Demand& demand) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases a pending transfer, clears its sequence's mark and appends
  // TRANSFER_FAILED with `error`.
  void AbortTransferLocked(uint64_t token, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // --- Reconciling workers (manager_core_workers.cc) ---
  // Keeps copies of s's blocks and turn starts (before MarkLostLocked) so
  // that a return of `w` with the same incarnation can take s back.
  void ParkLocked(WorkerRecord* w, SequenceRecord* s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets what w's parked sequences kept (they stay LOST).
  void DropParkedLocked(WorkerRecord* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes back every parked sequence of `w` that `inventory` lists (OPEN,
  // blocks restored and charged, SEQUENCE_RECOVERED) and forgets the rest.
  // Returns the recovered ids in creation order.
  std::vector<std::string> RecoverParkedLocked(WorkerRecord* w,
                                               const Inventory& inventory,
                                               std::vector<Event>* ev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The inventory's sequence ids that are not open on `w` here, sorted.
  std::vector<std::string> ReleaseListLocked(const WorkerRecord& w,
                                             const Inventory& inventory) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates block `pb` of `s` (tag by turn, encoding by policy), tells the
  // pressure graph and records BLOCK_CREATED.
  // `now`: the events' time.
  BlockRecord* NewBlockLocked(SequenceRecord* s, const PlannedBlock& pb,
                              uint32_t turn, int64_t now, EventBatch* ev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops one reference of `b` held by `s` (BLOCK_RELEASED or BLOCK_LOST);
  // the last one frees it (BLOCK_FREED unless lost).
  // `Events`: std::vector<Event> or EventBatch.
  template <typename Events>
  void ReleaseBlockLocked(SequenceRecord* s, BlockRecord* b, bool lost,
                          std::vector<uint64_t>* freed, int64_t now, Events* ev,
                          std::vector<EventLog::LastPlan>* forgotten)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkLostLocked(SequenceRecord* s, const std::string& reason,
                      std::vector<Event>* ev,
                      std::vector<EventLog::LastPlan>* forgotten)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // --- Prefix reuse (manager_core_prefix.cc; prefix_index.h) ---
  // The request's prefix hashes: from token_ids (the plan's leading
  // `sealed` blocks: all but a partial last one) and/or block_hashes
  // (checked against each other). INVALID_ARGUMENT naming block_hashes when
  // they disagree.
  absl::StatusOr<std::vector<std::string>> OpenPrefixHashesLocked(
      const OpenSequenceRequest& req, const TenantRecord& tenant,
      const std::vector<PlannedBlock>& blocks, size_t sealed) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct PrefixMatch {
    SequenceRecord* donor = nullptr;
    uint32_t blocks = 0;
  };
  // The longest prefix of `hashes` an open sequence holds (same salt, model,
  // block_tokens and window_tokens, since the worker's fork gives the new
  // sequence its holder's window; not being transferred; its worker UP and,
  // when named, `worker_id`; every block of the prefix indexed, on the
  // device, not busy). blocks 0: none.
  PrefixMatch FindPrefixLocked(const TenantRecord& tenant,
                               const ModelShape& model, uint32_t block_tokens,
                               const std::optional<uint32_t>& window_tokens,
                               const std::string& worker_id,
                               const std::vector<std::string>& hashes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Extends s's hash chain over `ids`, the ids of the tokens s just got
  // (s->blocks already hold them); newly sealed blocks (full, or followed
  // by another) get hashes and are indexed. Empty `ids` ends the chain.
  void AdvanceChainLocked(SequenceRecord* s, absl::Span<const uint32_t> ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A fork's chain from its parent's (plan: the fork's).
  void ForkChainLocked(const SequenceRecord& parent, const ForkPlan& plan,
                       SequenceRecord* child)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // s's last block is about to grow (or may): its hash goes (index
  // included) and the chain ends before it.
  void UnsealLastLocked(SequenceRecord* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After s was truncated to its current tokens (the last block possibly
  // cut): the chain shrinks; a last block that is not full is unsealed.
  void TruncateChainLocked(SequenceRecord* s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Spilled and evicted blocks of a finished tier plan leave the index.
  void DropUnusablePrefixesLocked(const std::vector<Event>& ev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Commits a pending demote, appends its events and remembers its reply.
  absl::StatusOr<DemoteBlocksResult> CommitDemoteLocked(uint64_t token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ManagerOptions options_;
  const Clock* const clock_;
  const SequencePlanner planner_;  // immutable: used with or without mu_
  EventLog events_;
  // The events of Open, Extend, Fork and Close, reused (EventLog::Append
  // clears it).
  EventBatch batch_ ABSL_GUARDED_BY(mu_);

  IdempotencyCache<RegisterWorkerResult> register_cache_;
  IdempotencyCache<TenantInfo> tenant_cache_;  // CreateTenant and SetBudget
  IdempotencyCache<SequenceInfo> open_cache_;  // OpenSequence and ForkSequence
  IdempotencyCache<ExtendSequenceResult> extend_cache_;
  IdempotencyCache<CloseSequenceResult> close_cache_;
  IdempotencyCache<TruncateSequenceResult> truncate_cache_;
  IdempotencyCache<PolicyInfo> policy_cache_;
  IdempotencyCache<DemoteBlocksResult> demote_cache_;
  IdempotencyCache<uint32_t> calibration_cache_;
  IdempotencyCache<TransferSequenceResult> transfer_cache_;

  mutable absl::Mutex mu_;
  // Durable metadata: the journal (null: none) and what the current call
  // changed.
  MetadataJournal* journal_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::atomic<bool> defer_waits_{false};
  // journal_ for WhenDurable, read without mu_ (set by SetJournal).
  std::atomic<MetadataJournal*> reply_journal_{nullptr};
  ChangeSet changes_ ABSL_GUARDED_BY(mu_);
  WorkerRegistry workers_ ABSL_GUARDED_BY(mu_);
  TenantLedger tenants_ ABSL_GUARDED_BY(mu_);
  PolicyStore policies_ ABSL_GUARDED_BY(mu_);
  CalibrationStore calibrations_ ABSL_GUARDED_BY(mu_);
  // Its own lock (Verify on every RPC); changed only under mu_ (journal).
  TokenStore tokens_;
  std::string capability_key_ ABSL_GUARDED_BY(mu_);
  SequenceTable sequences_ ABSL_GUARDED_BY(mu_);
  // Tokens of two-phase operations (demotes and tier plans), one sequence
  // so that a token names one operation.
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  PendingDemotes demotes_ ABSL_GUARDED_BY(mu_);
  PendingTransfers transfers_ ABSL_GUARDED_BY(mu_);
  PressureCoordinator pressure_ ABSL_GUARDED_BY(mu_);
  PrefixIndex prefix_ ABSL_GUARDED_BY(mu_);
  bool keep_token_ids_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t prefix_hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t prefix_reused_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  // Serializes RefreshRanking's Rank (its scratch buffers); never taken
  // with mu_ held.
  absl::Mutex rank_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::unique_ptr<RankScratch> rank_scratch_ ABSL_GUARDED_BY(rank_mu_) =
      std::make_unique<RankScratch>();
};

}  // namespace triax::manager
