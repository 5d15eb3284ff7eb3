// The manager core's side of durable metadata (docs/manager.md "Durable
// metadata"): what the core hands a journal, and what a journal hands back
// to a restarted core. No files or protobuf here; metadata_store.h is the
// journal that writes them.
//
// Writing. While a journal is set (ManagerCore::SetJournal), every call that
// changes state collects the ids of what it changed (ChangeSet: tenants,
// workers, sequences, operator policies, calibration tables, the id
// counters) and, at its end and still under the core's mutex, hands them to
// MetadataJournal::Write with a view of the records; the journal encodes
// their current content and queues it. The call then releases the mutex and
// waits (MetadataJournal::Wait) until the record is durable before it
// returns, so a reply is only ever sent for a change that is on disk.
// Records are written whole (a sequence with every block it holds), in the
// order the changes were made; a shared block is stored with each sequence
// that holds it, and the newest copy wins at recovery.
//
// Not stored: events, idempotency caches, access statistics (ReportAccess
// and the block graph's hits), tier plans and two-phase operations in flight
// (a restart rolls them back: their reservations are not in the stored
// accounting, and the worker's pages of a transfer's destination are freed
// when it reports — see ManagerCore::Restore).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "kvmanager/calibration_store.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/policy_store.h"
#include "kvmanager/sequence_table.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/token_store.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

// The core's records, read-only, for a journal called with its mutex held.
struct StateView {
  const TenantLedger& tenants;
  const WorkerRegistry& workers;
  const SequenceTable& sequences;
  const PolicyStore& policies;
  const CalibrationStore& calibrations;
  const TokenStore& tokens;
  const std::string& capability_key;
};

class MetadataJournal {
 public:
  virtual ~MetadataJournal() = default;
  // With the core's mutex held: queues the current content of what
  // `changes` names. Returns a ticket for Wait.
  virtual uint64_t Write(const ChangeSet& changes, const StateView& view) = 0;
  // With the core's mutex held: queues a snapshot of everything, which
  // replaces what was stored before it. Returns a ticket for Wait.
  virtual uint64_t Snapshot(const StateView& view) = 0;
  // Without the core's mutex: returns once the ticket's record is durable.
  // A journal that cannot write stops the process (fail-stop: the core's
  // memory is then ahead of its disk, and a restart recovers from the disk).
  virtual void Wait(uint64_t ticket) = 0;
  // Calls fn once the ticket's record is durable (from the journal's
  // writer thread, or now), with Wait's fail-stop.
  virtual void OnDurable(uint64_t ticket, std::function<void()> fn) = 0;
};

// What a journal recovered, for ManagerCore::Restore. Records carry their
// own fields; their pointers (tenant, worker, blocks, owner, charged,
// holders) are null and named by id beside them.
struct RecoveredBlock {
  BlockRecord record;
  std::string charged_tenant;
  std::string owner;  // sequence id
};

struct RecoveredSequence {
  SequenceRecord record;  // policy and calibration resolved
  std::string tenant_id;
  std::string worker_id;
  std::vector<uint64_t> lineage_ids;  // its blocks, in order
};

struct RecoveredState {
  uint64_t next_sequence = 1;  // the stored limits
  uint64_t next_lineage = 1;
  uint64_t epoch = 0;  // starts before this one
  std::vector<TenantRecord> tenants;
  std::vector<RegisterWorkerRequest> workers;
  std::vector<std::shared_ptr<const Policy>> operator_policies;
  std::vector<std::shared_ptr<const CalibrationTable>> calibrations;
  std::vector<TokenRecord> tokens;
  std::string capability_key;
  std::vector<RecoveredSequence> sequences;              // in creation order
  absl::flat_hash_map<uint64_t, RecoveredBlock> blocks;  // newest copies
};

// Creation order of sequence ids "seq-<n>": shorter first, then by text.
inline bool SequenceIdBefore(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return a.size() < b.size();
  return a < b;
}

}  // namespace triax::manager
