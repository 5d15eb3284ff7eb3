// The records of the manager core's state, and the small helpers every part
// of the core uses. Not part of the API (manager_core.h is).
//
// The records are plain structs. ManagerCore owns them through its parts:
// workers in WorkerRegistry, tenants in TenantLedger, sequences and live
// blocks in SequenceTable, calibration tables in CalibrationStore. Parts
// read and update one another's records directly (a block points at its
// tenant and worker, a worker lists its open sequences), always with
// ManagerCore::mu_ held; a record lives as long as its owner keeps it
// (workers and tenants for the core's lifetime, a block until its last
// reference goes, a sequence until it leaves closed retention).
//
// Byte accounting, kept in step by whoever moves bytes: a live block that
// is not evicted charges `bytes` to its tenant's `used[tier]` and to its
// worker (`reserved` for the device pool, `tier_used[tier]` for host and
// disk), once however many sequences share it. Reservations of plans in
// flight (a growing demote, a spill's or restore's destination) are charged
// the same way until the plan finishes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/clock.h"
#include "kvmanager/policy.h"
#include "kvmanager/types.h"

namespace triax::manager {

// Limits on one sequence (INVALID_ARGUMENT past them).
inline constexpr uint64_t kMaxSequenceTokens = uint64_t{1} << 24;
inline constexpr uint64_t kMaxSequenceBlocks = 65536;
inline constexpr uint32_t kMaxBlockTokens = 4096;

struct SequenceRecord;

// What the core's calls changed, by id, for the metadata journal
// (metadata_journal.h); collected (with ManagerCore::mu_ held) only while
// `enabled`, written and cleared at the end of each call.
struct ChangeSet {
  bool enabled = false;
  absl::flat_hash_set<std::string> tenants;
  absl::flat_hash_set<std::string> workers;
  absl::flat_hash_set<std::string> sequences;
  absl::flat_hash_set<std::string> operator_policies;
  absl::flat_hash_set<std::string> calibrations;  // by model
  std::vector<std::string> dropped_sequences;     // out of closed retention
  absl::flat_hash_set<std::string> tokens;        // issued (token ids)
  std::vector<std::string> revoked_tokens;
  bool capability_key = false;
  bool counters = false;

  bool empty() const {
    return tenants.empty() && workers.empty() && sequences.empty() &&
           operator_policies.empty() && calibrations.empty() &&
           dropped_sequences.empty() && tokens.empty() &&
           revoked_tokens.empty() && !capability_key && !counters;
  }
  void Clear() {
    tenants.clear();
    workers.clear();
    sequences.clear();
    operator_policies.clear();
    calibrations.clear();
    dropped_sequences.clear();
    tokens.clear();
    revoked_tokens.clear();
    capability_key = false;
    counters = false;
  }
};

struct TenantRecord {
  std::string id;
  std::array<std::optional<Budget>, kNumTiers> budgets;  // by Tier value
  std::array<uint64_t, kNumTiers> used{};                // bytes, by Tier
  uint32_t open_sequences = 0;
  std::string default_policy;
  // Prefix reuse: the shared salt the tenant opted into (empty: private);
  // salt = PrefixSalt(id, prefix_salt) (prefix_index.h).
  std::string prefix_salt;
};

struct WorkerRecord {
  WorkerInfo info;        // reserved_bytes and sequences are kept below
  uint64_t reserved = 0;  // device pool bytes planned onto it
  // Every device byte ever planned onto the worker: new blocks, restores,
  // growth and the new pages of finished demotions. Frees never lower it:
  // freed pages become room only when the worker reports its frames (its
  // pools may not be able to give them back as whole frames).
  uint64_t planned_total = 0;
  // planned_total when the last heartbeat, registration or inventory answer
  // came: what was planned since is not in that report's free frames yet.
  uint64_t planned_at_report = 0;
  // Puts `bytes` of new pages onto the device pool (reserved and planned).
  void Reserve(uint64_t bytes) {
    reserved += bytes;
    planned_total += bytes;
  }
  // Device bytes of the new pages of pressure demotions in flight: the
  // worker holds them beside the old pages until the demotion finishes, so
  // they are not in its free frames meanwhile.
  uint64_t transient = 0;
  // Spill-tier bytes held (index: Tier value; kDevice unused, see reserved).
  std::array<uint64_t, kNumTiers> tier_used{};
  absl::flat_hash_set<SequenceRecord*> open;  // its open sequences
  // The incarnation it registered with (empty: none given).
  std::string incarnation;
  // Ids of the sequences lost when it went DOWN, recoverable when it comes
  // back with the same incarnation (SequenceRecord::parked).
  std::vector<std::string> parked;
  // Restored from the metadata store by a restarted manager and not heard
  // from since: its first report (heartbeat or registration with the same
  // incarnation) reconciles (ManagerCore::ReconcileRecoveredLocked).
  bool recovered = false;
  // Its open sequences that were in doubt when the manager stopped: asked
  // for at its first report (RegisterWorkerResult::describe_sequence_ids).
  std::vector<std::string> verify;
};

// A calibration table as stored: immutable once built; sequences under an
// allocation policy keep the version they were opened with.
struct CalibrationTable {
  CalibrationTableInfo info;        // entries canonical, source as given
  std::vector<Encoding> encodings;  // entries' resolved encodings
};

// The allocation of a sequence under an allocation policy: the chosen
// encoding per tag (every tag of the sequence's blocks), distinct tags.
using TagAllocation = std::vector<std::pair<Tag, Encoding>>;

struct BlockRecord {
  uint32_t index = 0;  // position in the sequences holding it
  uint64_t lineage_id = 0;
  uint64_t first_token = 0;
  uint32_t num_tokens = 0;
  uint32_t capacity = 0;
  Tag tag;
  Encoding encoding;
  uint32_t refcount = 0;  // sequences holding it (forks share)
  uint32_t turn = 0;      // absolute turn
  uint64_t bytes = 0;     // n_layers * PageBytes(encoding)
  TenantRecord* charged = nullptr;
  WorkerRecord* worker = nullptr;
  std::string creator;  // id of the sequence that created it
  // Memory pressure: where the pages are (bytes are charged to this tier of
  // the tenant and the worker), whether the block was evicted (then nothing
  // is charged), and the tier plan (TierPlan token) acting on it, if any.
  Tier tier = Tier::kDevice;
  bool evicted = false;
  uint64_t busy = 0;
  // The sequence holding it while refcount == 1 (the creator, or the fork
  // that kept it after the others released it).
  SequenceRecord* owner = nullptr;
  // The workers whose sequences hold it, with how many each (the counts sum
  // to refcount; the first is `worker`). Forks share a block on one worker;
  // a transfer of a shared block, or one that finds it on the destination
  // already (a prefix hit), leaves it on several: each worker's copy is
  // charged (its device bytes to `charged` and to that worker) until its
  // last holder there lets go. Only device-resident blocks have copies.
  std::vector<std::pair<WorkerRecord*, uint32_t>> holders;
  // Prefix reuse (prefix_index.h): the block's chained content hash (empty:
  // none) and whether PrefixIndex lists it.
  std::string prefix_hash;
  bool prefix_indexed = false;
  // Its token ids once hashed, when ManagerCore::KeepBlockTokenIds (KV
  // events); else empty.
  std::vector<uint32_t> token_ids;
};

struct SequenceRecord {
  std::string id;
  TenantRecord* tenant = nullptr;
  WorkerRecord* worker = nullptr;
  ModelShape model;
  SequenceState state = SequenceState::kOpen;
  uint32_t block_tokens = 0;
  // The worker-side BF16 window named at Open (forks inherit it); nullopt:
  // the worker's --window_tokens, which the manager does not know. A
  // transfer hands it to the destination.
  std::optional<uint32_t> window_tokens;
  uint64_t num_tokens = 0;
  uint32_t current_turn = 0;
  std::shared_ptr<const Policy> policy;
  std::string parent;
  std::vector<BlockRecord*> blocks;
  std::vector<uint32_t> turn_start;  // first block index of each turn
  uint64_t bytes = 0;                // sum of its blocks' bytes
  uint64_t version = 0;              // bumped by every mutation (Touch)
  // Where Touch records the change (SequenceTable::Insert sets it).
  ChangeSet* changes = nullptr;
  // Two-phase worker changes prepared and not finished (demotes, tier
  // plans): stored, so that a restarted manager asks the worker what it
  // holds for this sequence (ManagerCore::AdoptWorkerBlocks).
  uint32_t in_doubt = 0;
  std::vector<uint64_t> lost_lineage_ids;
  // Allocation policies: the calibration table version of Open and the
  // current choice per tag.
  std::shared_ptr<const CalibrationTable> calibration;
  TagAllocation allocation;
  // Memory pressure: last use (Open, Extend, ReportAccess), blocks not on the
  // device, and the newest tool-call block (tool call -> result edges).
  int64_t last_access_ms = 0;
  uint32_t spilled = 0;
  uint64_t last_tool_call = 0;
  // Prefix reuse (prefix_index.h). Open took blocks [0, prefix_blocks)
  // (prefix_tokens tokens) from prefix_sequence_id. The hash chain: blocks
  // [0, chain_blocks) are sealed and carry hashes; while chain_open the
  // token ids of every later token are known: the last block (when partial,
  // the only block past chain_blocks) holds chain_tail's ids, and the chain
  // grows as blocks seal.
  std::string prefix_sequence_id;
  std::string prefix_tenant_id;
  uint32_t prefix_blocks = 0;
  uint64_t prefix_tokens = 0;
  uint32_t chain_blocks = 0;
  bool chain_open = false;
  std::vector<uint32_t> chain_tail;
  // Lost because its worker went DOWN: copies of its blocks and turn starts
  // as they were, to take back if the worker returns with the same
  // incarnation still holding it (ManagerCore::RegisterWorker).
  bool parked = false;
  // A transfer in flight (ManagerCore::PrepareTransfer): its id and
  // destination; empty / null otherwise. While set, the sequence is not
  // mutated (Extend, Fork, Truncate, Demote, Close refused) and its blocks
  // are busy (pressure plans skip them).
  std::string transfer_id;
  WorkerRecord* transfer_destination = nullptr;
  std::vector<BlockRecord> parked_blocks;
  std::vector<uint32_t> parked_turn_start;
};

// --- Helpers -----------------------------------------------------------------

// Every mutation of a sequence (its record or its blocks') goes through
// here: its version moves (pending demotes then abort) and the metadata
// journal learns that it changed.
inline void Touch(SequenceRecord* s) {
  ++s->version;
  if (s->changes != nullptr && s->changes->enabled) {
    s->changes->sequences.insert(s->id);
  }
}

// A change to journal that pending operations must not see as a mutation
// (the version stays): SequenceRecord::in_doubt.
inline void MarkChanged(SequenceRecord* s) {
  if (s->changes != nullptr && s->changes->enabled) {
    s->changes->sequences.insert(s->id);
  }
}
inline void AddInDoubt(SequenceRecord* s, int delta) {
  if (delta < 0 && s->in_doubt == 0) return;
  s->in_doubt += delta;
  MarkChanged(s);
}

// Model shapes are checked by ValidateModelShape and blocks tagged by
// TemporalFor, both in common/model.h.

// MODALITY_UNSPECIFIED means text.
inline Modality NormalizeModality(Modality m) {
  return m == Modality::kUnspecified ? Modality::kText : m;
}

// A total order of tags, for grouping blocks by tag deterministically.
inline int TagKey(const Tag& t) {
  return static_cast<int>(t.temporal) * 64 +
         static_cast<int>(NormalizeModality(t.modality)) * 16 +
         static_cast<int>(t.role);
}

// Whether two models have the same shape (name aside).
inline bool SameShape(const ModelShape& a, const ModelShape& b) {
  return a.n_layers == b.n_layers && a.n_kv_heads == b.n_kv_heads &&
         a.n_q_heads == b.n_q_heads && a.head_dim == b.head_dim;
}

// n_layers pages of one block in encoding `e`.
inline uint64_t BlockBytes(const ModelShape& m, uint32_t block_tokens,
                           const Encoding& e) {
  return uint64_t{m.n_layers} *
         kernels::PageBytes(e, PageShapeOf(m, block_tokens));
}

inline BlockPlan PlanOf(const BlockRecord& b) {
  BlockPlan p;
  p.index = b.index;
  p.lineage_id = b.lineage_id;
  p.first_token = b.first_token;
  p.num_tokens = b.num_tokens;
  p.capacity = b.capacity;
  p.tag = b.tag;
  p.encoding = b.encoding;
  p.refcount = b.refcount;
  p.tier = b.tier;
  p.evicted = b.evicted;
  return p;
}

// Sets `e` to an event of `kind` at `unix_ms`, naming the sequence (its
// tenant and worker) and the block when given.
inline void SetEvent(Event* e, int64_t unix_ms, EventKind kind,
                     const SequenceRecord* s, const BlockRecord* b) {
  e->unix_ms = unix_ms;
  e->kind = kind;
  if (s != nullptr) {
    e->sequence_id = s->id;
    e->tenant_id = s->tenant->id;
    e->worker_id = s->worker->info.worker_id;
  }
  if (b != nullptr) {
    e->lineage_id = b->lineage_id;
    e->tag = b->tag;
    e->format = b->encoding.k;
  }
}

// An event stamped now (SetEvent).
inline Event MakeEvent(const Clock& clock, EventKind kind,
                       const SequenceRecord* s, const BlockRecord* b) {
  Event e;
  SetEvent(&e, clock.NowMs(), kind, s, b);
  return e;
}

// SetEvent on a new event at the end of `ev`, built in place: the hot
// paths' block events, which share one clock read per call.
inline Event& AddEvent(std::vector<Event>* ev, int64_t unix_ms, EventKind kind,
                       const SequenceRecord* s, const BlockRecord* b) {
  Event& e = ev->emplace_back();
  SetEvent(&e, unix_ms, kind, s, b);
  return e;
}

}  // namespace triax::manager
