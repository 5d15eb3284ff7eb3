// PendingDemotes: re-encodings of blocks in place between their two phases,
// so that the core does no I/O. Two sources:
//   - DemoteBlocks: Prepare validates the request against the sequence and
//     reserves any growth (tenant device usage and worker reservation); the
//     service runs the worker's Demote; then Commit or Release.
//   - the aging demotions of an Extend under an allocation policy
//     (PrepareAging): existing blocks whose tag's choice is now smaller; no
//     reservation (a demotion only frees); finished by
//     ManagerCore::FinishExtendDemotion through TakeExtend, then Commit or
//     Release.
// A pending demote commits only if its sequence is still open at the
// version it was prepared at (every mutation bumps the version); otherwise
// Commit returns ABORTED and changes nothing but returning the reservation.
// Tokens come from ManagerCore's counter of two-phase operations (shared
// with tier plans, so a token names one operation).
//
// Error codes: INVALID_ARGUMENT (empty or too many blocks, lineage 0, a
// duplicate lineage, a bad encoding or one invalid for the model shape),
// NOT_FOUND (a lineage that is not a block of the sequence; an unknown
// token), FAILED_PRECONDITION (a block shared with a fork, spilled or
// evicted), ABORTED (a block being moved by the pressure manager; the same
// request id in flight; the sequence changed before the commit),
// RESOURCE_EXHAUSTED (growth over the tenant ceiling or the worker's room).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held.
// ValidateRequest is pure (run before the lock).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/sequence_table.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/types.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

class PendingDemotes {
 public:
  // The parts must outlive this object; `next_token` is the shared counter
  // of two-phase operation tokens.
  PendingDemotes(const Clock* clock, WorkerRegistry* workers,
                 TenantLedger* tenants, SequenceTable* sequences,
                 uint64_t* next_token);
  ~PendingDemotes();

  // Request checks that need no state; returns each block's canonical
  // encoding.
  static absl::StatusOr<std::vector<Encoding>> ValidateRequest(
      const DemoteBlocksRequest& req);
  // ABORTED when a DemoteBlocks of the tenant with this request id is
  // pending (request id empty: OK).
  absl::Status CheckDemoteNotInProgress(const std::string& tenant_id,
                                        const std::string& request_id) const;
  // ABORTED when the aging demotion of an Extend of the tenant with this
  // request id is pending (request id empty: OK).
  absl::Status CheckExtendNotInProgress(const std::string& tenant_id,
                                        const std::string& request_id) const;

  // Checks every block of `req` against `s` (open, the tenant's), reserves
  // growth and records the demote. `encodings` from ValidateRequest.
  absl::StatusOr<DemotePrepared> Prepare(const DemoteBlocksRequest& req,
                                         const std::vector<Encoding>& encodings,
                                         SequenceRecord* s);
  // After an Extend of `s` under an allocation policy: the blocks among the
  // first `old_blocks` (exclusively held, on the device, idle) whose tag's
  // choice now has fewer bytes than their encoding. Records the demote
  // (with `result`, the Extend's reply without demoted blocks) and returns
  // the worker call; nullopt when no block shrinks.
  std::optional<DemotePrepared> PrepareAging(
      SequenceRecord* s, size_t old_blocks, const std::string& tenant_id,
      const std::string& extend_request_id, uint64_t extend_fingerprint,
      const ExtendSequenceResult& result);

  struct Committed {
    DemoteBlocksResult result;
    std::string tenant_id;
    std::string request_id;    // of the DemoteBlocks (empty for an Extend's)
    uint64_t fingerprint = 0;  // of the DemoteBlocks
  };
  // Applies a pending demote: new encodings and bytes, shrinkage released,
  // one BLOCK_DEMOTED event per block into *ev, the sequence's version
  // bumped. NOT_FOUND for an unknown token; ABORTED (reservation returned)
  // when the sequence changed. The token is consumed either way.
  absl::StatusOr<Committed> Commit(uint64_t token, std::vector<Event>* ev);
  // Returns the reservation of a pending demote and forgets it; no-op when
  // unknown.
  void Release(uint64_t token);

  struct ExtendDemotion {
    ExtendSequenceResult result;  // the Extend's reply, moved out
    std::string tenant_id;
    std::string request_id;    // the Extend's
    uint64_t fingerprint = 0;  // the Extend's
    std::string sequence_id;
    std::vector<uint64_t> lineages;  // the blocks being demoted
  };
  // The Extend behind a pending aging demotion (it stays pending: Commit or
  // Release it next). NOT_FOUND unless `token` is such a demotion.
  absl::StatusOr<ExtendDemotion> TakeExtend(uint64_t token);

  size_t size() const { return pending_.size(); }

 private:
  struct Pending;

  const Clock* const clock_;
  WorkerRegistry* const workers_;
  TenantLedger* const tenants_;
  SequenceTable* const sequences_;
  uint64_t* const next_token_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Pending>> pending_;
};

}  // namespace triax::manager
