// PendingTransfers: worker-to-worker transfers of sequences between their
// two phases (ManagerCore::PrepareTransfer / CommitTransfer /
// AbortTransfer, manager_core_transfer.cc), so that the core does no I/O.
//
// A pending transfer holds the destination's reservation: the bytes of every
// block that moves (not evicted, not a prefix hit's shared block: those are
// on the destination already) in its destination encoding, charged to the
// tenant's TIER_DEVICE usage and reserved on the destination worker (the
// source's charges stay until the commit: both copies exist meanwhile). The
// sequence carries the transfer's id and destination
// (SequenceRecord::transfer_id / transfer_destination) and its blocks are
// busy with the transfer's token, so that no other operation changes it.
// Release returns the reservation; the core's commit turns it into the
// charge. A worker of the transfer that goes DOWN or restarts dooms it
// (WorkerLost): its commit refuses, only the abort remains.
//
// Tokens come from ManagerCore's counter of two-phase operations (shared
// with demotes and tier plans, so a token names one operation); transfer
// ids are "xfer-<n>", dense per manager.
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
#include "kvmanager/manager_state.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/types.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

// Bound on a transfer's timeout_ms (INVALID_ARGUMENT past it): one hour.
inline constexpr uint32_t kMaxTransferTimeoutMs = 3'600'000;

// triax.v1.TransferSequenceRequest.
struct TransferSequenceRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::string destination_worker_id;  // empty: placement chooses
  std::string destination_policy;     // empty: every block keeps its encoding
  uint32_t timeout_ms = 0;            // 0: ManagerOptions::transfer_timeout_ms
  bool follow_writes = false;
  // A prefix hit: blocks [0, first_block) are already on the destination,
  // held by destination_prefix_sequence_id there; only the others move.
  // 0: every block moves (the prefix must then be empty).
  uint32_t first_block = 0;
  std::string destination_prefix_sequence_id;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

// triax.v1.TransferSequenceResponse.
struct TransferSequenceResult {
  std::string transfer_id;
  std::string source_worker_id;
  std::string destination_worker_id;
  SequenceInfo sequence;       // after the commit
  uint64_t blocks = 0;         // blocks moved (evicted ones do not move)
  uint64_t shared_blocks = 0;  // blocks [0, first_block): shared there
  uint64_t pages = 0;
  uint64_t wire_bytes = 0;
  uint64_t bf16_bytes = 0;
  uint64_t source_bytes = 0;  // the moved blocks' bytes on the source
  double seconds = 0;         // prepare to commit
  double pull_seconds = 0;    // the destination's ImportSequence
  std::string data_path;      // the destination's: "stream" or "ipc"
};

// What PrepareTransfer hands the service: a remembered reply (`done`, an
// idempotent repeat of a committed transfer) or the destination's
// ImportSequenceRequest content, where to send it, and the token.
struct TransferPrepared {
  std::optional<TransferSequenceResult> done;
  uint64_t token = 0;
  std::string transfer_id;
  std::string source_worker_id;
  std::string source_address;
  std::string destination_worker_id;
  std::string destination_address;
  // The worker's ImportSequenceRequest.
  std::string worker_request_id;
  std::string tenant_id;
  std::string sequence_id;
  ModelShape model;
  uint32_t block_tokens = 0;
  // The sequence's window (SequenceRecord::window_tokens); nullopt: the
  // destination's --window_tokens.
  std::optional<uint32_t> window_tokens;
  // Every block of the sequence with the encoding it takes on the
  // destination and tier TIER_DEVICE; evicted blocks keep evicted = true.
  std::vector<BlockPlan> blocks;
  uint32_t timeout_ms = 0;  // the effective bound (never 0)
  bool follow_writes = false;
  uint64_t reserved_bytes = 0;  // the destination's reservation
  // A prefix hit: the destination shares blocks [0, prefix_blocks) with
  // this sequence of its own and pulls only the others.
  std::string prefix_sequence_id;
  uint32_t prefix_blocks = 0;
};

// The destination's ImportSequence answer, as the commit records it.
struct TransferImportFigures {
  uint64_t pages = 0;
  uint64_t wire_bytes = 0;
  uint64_t bf16_bytes = 0;
  uint64_t page_bytes = 0;
  double seconds = 0;
  std::string data_path;
};

// What CommitTransfer hands back: the reply, and where the source copy is
// to be freed (the source worker's FreePages).
struct TransferCommitted {
  TransferSequenceResult result;
  std::string source_address;
  std::string tenant_id;
  std::string sequence_id;
};

class PendingTransfers {
 public:
  struct Pending {
    uint64_t token = 0;
    std::string transfer_id;
    std::string tenant_id;
    std::string request_id;
    uint64_t fingerprint = 0;  // of the request (IdempotencyCache::Lookup)
    std::string sequence_id;
    std::string source_id;
    std::string destination_id;
    // A prefix hit: the first_block and the destination's prefix sequence.
    uint32_t shared_blocks = 0;
    std::string prefix_sequence_id;
    // Destination encoding and bytes of every block that moves, by lineage.
    std::vector<std::pair<uint64_t, Encoding>> encodings;
    std::vector<uint64_t> new_bytes;
    uint64_t reserved = 0;      // sum of new_bytes, charged at prepare
    uint64_t source_bytes = 0;  // the moved blocks' bytes at prepare
    // Set when a destination_policy was given: the policy the sequence
    // takes at the commit (with its calibration table and allocation).
    std::shared_ptr<const Policy> policy;
    std::shared_ptr<const CalibrationTable> calibration;
    TagAllocation allocation;
    int64_t started_ms = 0;
    // Set by WorkerLost: the commit refuses with this reason.
    std::string doomed;
  };

  // The parts must outlive this object; `next_token` is the shared counter
  // of two-phase operation tokens.
  PendingTransfers(TenantLedger* tenants, WorkerRegistry* workers,
                   uint64_t* next_token);
  ~PendingTransfers();

  // Request checks that need no state: request_id, tenant_id, sequence_id
  // (ids), destination_worker_id, destination_policy and
  // destination_prefix_sequence_id (empty or ids; the prefix named iff
  // first_block > 0, and not the sequence itself), timeout_ms (<=
  // kMaxTransferTimeoutMs). INVALID_ARGUMENT naming the field and value.
  static absl::Status ValidateRequest(const TransferSequenceRequest& req);
  // ABORTED when a transfer of the tenant with this request id is in flight
  // (request id empty: OK).
  absl::Status CheckNotInProgress(const std::string& tenant_id,
                                  const std::string& request_id) const;

  // Records `p` (its token and transfer id assigned here) and returns it.
  Pending* Add(std::unique_ptr<Pending> p);
  // nullptr when unknown.
  Pending* Find(uint64_t token) const;
  // Returns the reservation of a pending transfer and forgets it; nullopt
  // when unknown. The caller clears the sequence's mark.
  std::optional<Pending> Release(uint64_t token);
  // Forgets a committed transfer (its reservation became the charge).
  std::optional<Pending> Take(uint64_t token);
  // Dooms every pending transfer from or to `worker_id`.
  void WorkerLost(const std::string& worker_id, const std::string& reason);
  // Whether a pending transfer imports `sequence_id` onto `worker_id` (its
  // inventory may list it before the commit: not to be released).
  bool Importing(const std::string& worker_id,
                 const std::string& sequence_id) const;

  size_t size() const { return pending_.size(); }

 private:
  TenantLedger* const tenants_;
  WorkerRegistry* const workers_;
  uint64_t* const next_token_;
  uint64_t next_transfer_ = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Pending>> pending_;
};

// FAILED_PRECONDITION "sequence S is being transferred (transfer T)" while a
// transfer of `s` is in flight; OK otherwise.
absl::Status CheckNotTransferring(const SequenceRecord& s);

}  // namespace triax::manager
