// WorkerRegistry: the workers the manager knows. Registration and heartbeat
// bookkeeping, down detection, placement of new sequences and room checks.
// What happens to a worker's sequences when it restarts or goes down is the
// caller's (ManagerCore marks them LOST).
//
// Placement: the UP worker with a healthy device (no inventory.device_error)
// and the most free device bytes (capacity - reserved) takes a new sequence;
// ties go to the smaller id, so placement is deterministic.
//
// Error codes: INVALID_ARGUMENT (a bad field, named with its value),
// ALREADY_EXISTS (the id is UP at another address), NOT_FOUND (heartbeat of
// an unknown or DOWN worker: "re-register"), UNAVAILABLE (no worker up with
// a healthy device), RESOURCE_EXHAUSTED (no room: the message says how many
// bytes are missing).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held. The
// static Validate* functions are pure (ManagerCore runs them before taking
// the lock).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/types.h"

namespace triax::manager {

class WorkerRegistry {
 public:
  using Map = absl::flat_hash_map<std::string, std::unique_ptr<WorkerRecord>>;

  // worker_id an id; address 1..256 bytes; backend set; capacity_bytes > 0.
  static absl::Status ValidateRegistration(const RegisterWorkerRequest& req);
  // worker_id an id; every inventory format in range.
  static absl::Status ValidateHeartbeat(const std::string& worker_id,
                                        const Inventory& inventory);

  // The record a registration takes over: the known worker of that id, or
  // nullptr for a new id. A known worker re-registering has restarted: the
  // caller marks its open sequences lost before Register. ALREADY_EXISTS
  // when the id is UP at a different address.
  absl::StatusOr<WorkerRecord*> FindForRegistration(
      const RegisterWorkerRequest& req) const;
  // Creates or updates the worker's record: UP, heartbeat at now_ms, the
  // request's address, backend and capacities, an empty inventory.
  WorkerRecord* Register(const RegisterWorkerRequest& req, int64_t now_ms);
  // Records a heartbeat (time and inventory, as given). NOT_FOUND for an
  // unknown or DOWN worker.
  absl::StatusOr<WorkerRecord*> Heartbeat(const std::string& worker_id,
                                          const Inventory& inventory,
                                          int64_t now_ms);
  // UP workers silent for more than timeout_ms at now_ms, ordered by id.
  std::vector<WorkerRecord*> Silent(int64_t now_ms, int64_t timeout_ms) const;

  // See "Placement" above. `bytes` 0 finds the candidate without a room
  // check.
  absl::StatusOr<WorkerRecord*> Place(uint64_t bytes) const;
  // Free device bytes: capacity - reserved, 0 when over-reserved.
  static uint64_t FreeBytes(const WorkerRecord& w);
  // RESOURCE_EXHAUSTED when `bytes` more do not fit the device pool.
  static absl::Status Fits(const WorkerRecord& w, uint64_t bytes);

  // nullptr when unknown.
  WorkerRecord* Find(const std::string& worker_id) const;
  static WorkerInfo Info(const WorkerRecord& w);
  // Every worker (UP and DOWN), ordered by id.
  std::vector<WorkerInfo> List() const;
  // Every worker, unordered (snapshots and inspection).
  const Map& all() const { return workers_; }

 private:
  Map workers_;
};

}  // namespace triax::manager
