// WorkerRegistry: the workers the manager knows. Registration and heartbeat
// bookkeeping, silence detection, placement of new sequences and room checks.
// What happens to a worker's sequences when it restarts, goes down or comes
// back is the caller's (ManagerCore marks them LOST or reconciles them).
//
// States: UP (heartbeats arrive), SUSPECT (silent past the caller's first
// timeout: no placement, sequences untouched), DOWN (silent past the second:
// heartbeats are refused with NOT_FOUND so the worker re-registers). A
// heartbeat of the registered incarnation brings a SUSPECT worker back UP.
//
// Placement: the UP worker with a healthy device (no inventory.device_error)
// and the most room (RoomBytes) that fits the request (Fits) takes a new
// sequence; ties go to the smaller id, so placement is deterministic.
//
// Room. A worker's pool is cut into frames that any encoding can take and
// that a pool carves into pages of one size (worker/page_allocator.h). Its
// heartbeat reports the frames free once its compaction packed every pool
// (free_frames_compacted; the worker compacts when an allocation finds no
// room) and each pool's free slots then (free_slots_compacted). A request
// (PageDemand: pages per encoding and page size) fits when its pages that
// the pools' free slots cannot take need no more frames (ceil(pages /
// pages_per_frame) per encoding, frame tails counted) than are free, less
// the bytes the manager planned onto the worker since that heartbeat
// (WorkerRecord::planned_total - planned_at_report, taken from the free
// frames; bytes freed since do not offset them, as the worker may not be
// able to return them as whole frames until it reports), and its
// bytes fit capacity - reserved. An admission that fails on frames asks the
// pressure coordinator for the missing frame bytes (AdmissionBytes). Before a
// worker reports frames (frame_bytes 0) only the byte count applies.
//
// Error codes: INVALID_ARGUMENT (a bad field, named with its value),
// ALREADY_EXISTS (the id is UP or SUSPECT at another address), NOT_FOUND
// (heartbeat of an unknown or DOWN worker: "re-register"),
// FAILED_PRECONDITION (heartbeat of another incarnation), UNAVAILABLE (no
// worker up with a healthy device), RESOURCE_EXHAUSTED (no room: the message
// says how many bytes are missing).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held. The
// static Validate* functions are pure (ManagerCore runs them before taking
// the lock).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/paging.h"
#include "kvmanager/types.h"

namespace triax::manager {

// Pages a request adds on one worker of one encoding and page size (the key
// of the worker's pools).
struct PageDemand {
  Encoding encoding;
  uint64_t page_bytes = 0;
  uint64_t pages = 0;
};
using Demand = std::vector<PageDemand>;

class WorkerRegistry {
 public:
  // Adds `blocks` blocks of encoding `e` (n_layers pages each) to `demand`.
  static void AddBlocks(const ModelShape& model, uint32_t block_tokens,
                        const Encoding& e, uint64_t blocks, Demand* demand);

  using Map = absl::flat_hash_map<std::string, std::unique_ptr<WorkerRecord>>;

  // worker_id an id; address 1..256 bytes; backend set; capacity_bytes > 0;
  // incarnation empty or an id; every inventory format in range.
  static absl::Status ValidateRegistration(const RegisterWorkerRequest& req);
  // worker_id an id; incarnation empty or an id; every inventory format in
  // range.
  static absl::Status ValidateHeartbeat(const std::string& worker_id,
                                        const Inventory& inventory,
                                        const std::string& incarnation = "");
  // Whether a registration of `req` continues `w` (the same process, paused
  // or retrying) rather than replacing it: both carry the same non-empty
  // incarnation.
  static bool SameIncarnation(const WorkerRecord& w,
                              const RegisterWorkerRequest& req) {
    return !w.incarnation.empty() && w.incarnation == req.incarnation;
  }

  // The record a registration takes over: the known worker of that id, or
  // nullptr for a new id. ALREADY_EXISTS when the id is UP or SUSPECT at a
  // different address, and, with live_ms > 0, when the id is UP under
  // another (non-empty) incarnation that heartbeat within the last live_ms
  // before now_ms: a second process started with a live worker's id, not a
  // restart (a restarted worker is let in once the old incarnation has been
  // silent for live_ms).
  absl::StatusOr<WorkerRecord*> FindForRegistration(
      const RegisterWorkerRequest& req, int64_t now_ms = 0,
      int64_t live_ms = 0) const;
  // Creates or updates the worker's record: UP, heartbeat at now_ms, the
  // request's address, backend, capacities, incarnation and inventory.
  WorkerRecord* Register(const RegisterWorkerRequest& req, int64_t now_ms);
  // Records a heartbeat (time and inventory, as given) of an UP or SUSPECT
  // worker; a SUSPECT one is UP again. NOT_FOUND for an unknown or DOWN
  // worker; for a worker registered with an incarnation, INVALID_ARGUMENT
  // when `incarnation` is empty and FAILED_PRECONDITION when it differs
  // (a stale process); FAILED_PRECONDITION too when the worker registered
  // without one and `incarnation` is set.
  absl::StatusOr<WorkerRecord*> Heartbeat(const std::string& worker_id,
                                          const Inventory& inventory,
                                          int64_t now_ms,
                                          const std::string& incarnation = "");
  // Workers in `state` silent for more than timeout_ms at now_ms, ordered by
  // id.
  std::vector<WorkerRecord*> Silent(int64_t now_ms, int64_t timeout_ms,
                                    WorkerState state = WorkerState::kUp) const;

  // The named worker instead of placement: NOT_FOUND when unknown,
  // UNAVAILABLE when not UP or its device failed, RESOURCE_EXHAUSTED when
  // `bytes` / `demand` do not fit (Fits; without a check when bytes is 0).
  // `field` names the request field in the messages.
  absl::StatusOr<WorkerRecord*> PlaceOn(const std::string& field,
                                        const std::string& worker_id,
                                        uint64_t bytes,
                                        const Demand& demand = {}) const;
  // See "Placement" above. `bytes` 0 (and no demand) finds the candidate
  // without a room check.
  absl::StatusOr<WorkerRecord*> Place(uint64_t bytes,
                                      const Demand& demand = {}) const;
  // Free device bytes: capacity - reserved - transient (the new pages of
  // demotions in flight sit beside the old ones until each finishes), 0
  // when over-reserved.
  static uint64_t FreeBytes(const WorkerRecord& w);
  // Bytes in frames the manager can still plan on (see "Room"): the
  // heartbeat's free_frames_compacted x frame_bytes less what was planned
  // since and the new pages of demotions in flight (WorkerRecord::
  // transient) (0 at least); -1 while the worker reported no frames.
  static int64_t FrameRoomBytes(const WorkerRecord& w);
  // Bytes planned onto `w` since its last report (planned_total -
  // planned_at_report).
  static uint64_t PlannedSinceHeartbeat(const WorkerRecord& w);
  // FreeBytes, capped by FrameRoomBytes plus the pools' compacted free
  // slots when the worker reports frames.
  static uint64_t RoomBytes(const WorkerRecord& w);
  // Whole frames `demand` takes on `w` beyond its pools' compacted free
  // slots; appends a description per encoding to *what when given.
  // INVALID_ARGUMENT when a page is larger than the worker's frame.
  static absl::StatusOr<uint64_t> FramesNeeded(const WorkerRecord& w,
                                               const Demand& demand,
                                               std::string* what);
  // The device bytes an admission shortfall on `w` asks the pressure
  // coordinator to make room for: `bytes`, or, when the frames do not fit
  // though the bytes do, FreeBytes + the missing frame bytes, so that
  // reclaiming down to capacity frees what the frames lack.
  static uint64_t AdmissionBytes(const WorkerRecord& w, uint64_t bytes,
                                 const Demand& demand);
  // RESOURCE_EXHAUSTED when `bytes` more, whose pages are `demand`, do not
  // fit the device pool (see "Room"); the message names the worker, the
  // bytes, the frames needed and free, and the encodings.
  static absl::Status Fits(const WorkerRecord& w, uint64_t bytes,
                           const Demand& demand = {});

  // nullptr when unknown.
  WorkerRecord* Find(const std::string& worker_id) const;
  static WorkerInfo Info(const WorkerRecord& w);
  // Every worker (UP and DOWN), ordered by id.
  std::vector<WorkerInfo> List() const;
  // One page of List (paging.h; the cursor's key: the previous page's last
  // id). O(log workers + page).
  Page<WorkerInfo> ListPage(const PageCursor& cursor) const;
  // Every worker, unordered (snapshots and inspection).
  const Map& all() const { return workers_; }

 private:
  Map workers_;
  absl::btree_set<std::string> ids_;  // the workers' ids, for paging
};

}  // namespace triax::manager
