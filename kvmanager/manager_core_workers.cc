// ManagerCore's worker calls (manager_core.h "Workers"): registration,
// heartbeats and SUSPECT/DOWN detection, and the reconciliation of a
// returning worker: parking the sequences of a worker that goes DOWN, taking
// them back when it returns with the same incarnation, and the list of
// sequences a worker holds that the manager does not (for it to free).
#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

namespace {

// Sequence ids are "seq-<n>": shorter first, then by text, is creation
// order.
bool CreatedBefore(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return a.size() < b.size();
  return a < b;
}

void Unpark(SequenceRecord* s) {
  s->parked = false;
  std::vector<BlockRecord>().swap(s->parked_blocks);
  std::vector<uint32_t>().swap(s->parked_turn_start);
}

}  // namespace

// --- Workers -----------------------------------------------------------------

absl::StatusOr<RegisterWorkerResult> ManagerCore::RegisterWorker(
    const RegisterWorkerRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(WorkerRegistry::ValidateRegistration(req));
  JournaledLock lock(this);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, register_cache_.Lookup(req.worker_id, req.request_id,
                                       req.fingerprint, "RegisterWorker"));
  if (hit) {
    return hit->reply;
  }
  std::vector<Event> ev;
  std::vector<EventLog::LastPlan> forgotten;
  RegisterWorkerResult result;
  result.heartbeat_interval_ms = options_.heartbeat_interval_ms;
  // Two missed heartbeats tell a restart from a second live process.
  const int64_t live_ms = std::min<int64_t>(
      2 * int64_t{options_.heartbeat_interval_ms}, options_.worker_timeout_ms);
  TRIAX_ASSIGN_OR_RETURN(
      WorkerRecord * known,
      workers_.FindForRegistration(req, clock_->NowMs(), live_ms));
  const bool same =
      known != nullptr && WorkerRegistry::SameIncarnation(*known, req);
  const WorkerState before =
      known != nullptr ? known->info.state : WorkerState::kUnspecified;
  if (known != nullptr && !same) {
    // It restarted: whatever it held is gone.
    DropParkedLocked(known);
    transfers_.WorkerLost(req.worker_id, "restarted");
    std::vector<SequenceRecord*> lost(known->open.begin(), known->open.end());
    std::sort(lost.begin(), lost.end(),
              [](const SequenceRecord* a, const SequenceRecord* b) {
                return a->id < b->id;
              });
    for (SequenceRecord* s : lost) {
      result.lost_sequence_ids.push_back(s->id);
      MarkLostLocked(s, "worker_restarted", &ev, &forgotten);
    }
  }
  WorkerRecord* w = workers_.Register(req, clock_->NowMs());
  if (changes_.enabled) changes_.workers.insert(w->info.worker_id);
  if (same && w->recovered) {
    result.describe_sequence_ids =
        ReconcileRecoveredLocked(w, req.inventory, &ev, &forgotten);
  }
  w->recovered = false;
  if (same) {
    result.recovered_sequence_ids = RecoverParkedLocked(w, req.inventory, &ev);
  }
  result.release_sequence_ids = ReleaseListLocked(*w, req.inventory);
  if (!req.inventory.restored_lineage_ids.empty()) {
    pressure_.ApplyWorkerRestores(w, req.inventory.restored_lineage_ids, &ev);
  }
  SealedEventsLocked(*w, req.inventory.sealed_blocks, &ev);
  Event e;
  e.unix_ms = clock_->NowMs();
  e.kind = EventKind::kWorkerUp;
  e.worker_id = req.worker_id;
  e.detail = absl::StrCat(
      "address=", req.address, " backend=", req.backend,
      " capacity_bytes=", req.capacity_bytes,
      " incarnation=", req.incarnation.empty() ? "-" : req.incarnation,
      " lost_sequences=", result.lost_sequence_ids.size(),
      " release_sequences=", result.release_sequence_ids.size());
  ev.push_back(std::move(e));
  if (same && before != WorkerState::kUp) {
    Event r;
    r.unix_ms = clock_->NowMs();
    r.kind = EventKind::kWorkerRecovered;
    r.worker_id = req.worker_id;
    r.detail = absl::StrCat(
        "from=", before == WorkerState::kDown ? "down" : "suspect",
        " recovered_sequences=", result.recovered_sequence_ids.size());
    ev.push_back(std::move(r));
  }
  events_.Append(&ev, &forgotten);
  register_cache_.Put(req.worker_id, req.request_id, req.fingerprint,
                      absl::OkStatus(), result);
  return result;
}

absl::StatusOr<HeartbeatResult> ManagerCore::Heartbeat(
    const std::string& worker_id, const Inventory& inventory,
    const std::string& incarnation) {
  TRIAX_RETURN_IF_ERROR(
      WorkerRegistry::ValidateHeartbeat(worker_id, inventory, incarnation));
  JournaledLock lock(this);
  const WorkerRecord* known = workers_.Find(worker_id);
  const bool was_suspect =
      known != nullptr && known->info.state == WorkerState::kSuspect;
  const int64_t silent_ms =
      known != nullptr ? clock_->NowMs() - known->info.last_heartbeat_unix_ms
                       : 0;
  TRIAX_ASSIGN_OR_RETURN(
      WorkerRecord * w,
      workers_.Heartbeat(worker_id, inventory, clock_->NowMs(), incarnation));
  std::vector<Event> ev;
  std::vector<EventLog::LastPlan> forgotten;
  std::vector<std::string> describe;
  if (w->recovered) {
    describe = ReconcileRecoveredLocked(w, inventory, &ev, &forgotten);
    w->recovered = false;
  }
  if (was_suspect) {
    Event e;
    e.unix_ms = clock_->NowMs();
    e.kind = EventKind::kWorkerRecovered;
    e.worker_id = worker_id;
    e.detail = absl::StrCat("from=suspect silent_ms=", silent_ms,
                            " sequences=", w->open.size());
    ev.push_back(std::move(e));
  }
  if (!inventory.restored_lineage_ids.empty()) {
    pressure_.ApplyWorkerRestores(w, inventory.restored_lineage_ids, &ev);
    w->info.inventory.restored_lineage_ids.clear();
  }
  SealedEventsLocked(*w, inventory.sealed_blocks, &ev);
  w->info.inventory.sealed_blocks.clear();
  if (!ev.empty()) events_.Append(&ev, &forgotten);
  HeartbeatResult result;
  result.release_sequence_ids = ReleaseListLocked(*w, inventory);
  result.describe_sequence_ids = std::move(describe);
  if (!result.describe_sequence_ids.empty()) {
    result.worker_address = w->info.address;
  }
  return result;
}

std::vector<WorkerInfo> ManagerCore::ListWorkers() const {
  absl::MutexLock lock(&mu_);
  return workers_.List();
}

uint64_t ManagerCore::PlannedOn(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  const WorkerRecord* w = workers_.Find(worker_id);
  return w != nullptr ? w->planned_total : 0;
}

void ManagerCore::RefreshWorkerRoom(const std::string& worker_id,
                                    const Inventory& inventory,
                                    uint64_t planned_before) {
  JournaledLock lock(this);
  WorkerRecord* w = workers_.Find(worker_id);
  if (w == nullptr || w->info.state != WorkerState::kUp) return;
  Inventory& have = w->info.inventory;
  have.frame_bytes = inventory.frame_bytes;
  have.frames = inventory.frames;
  have.free_frames = inventory.free_frames;
  have.free_frames_compacted = inventory.free_frames_compacted;
  have.free_bytes = inventory.free_bytes;
  have.tail_bytes = inventory.tail_bytes;
  have.fragmentation = inventory.fragmentation;
  have.pools = inventory.pools;
  // Planned while the call ran may or may not be in the answer: count it
  // as not (the next admission then under- rather than over-counts room).
  w->planned_at_report = std::min(planned_before, w->planned_total);
}

std::vector<std::string> ManagerCore::CheckWorkers(
    std::vector<std::string>* suspect) {
  JournaledLock lock(this);
  const int64_t now = clock_->NowMs();
  std::vector<std::string> ids;
  std::vector<Event> ev;
  std::vector<EventLog::LastPlan> forgotten;
  for (WorkerRecord* w : workers_.Silent(now, options_.worker_timeout_ms)) {
    w->info.state = WorkerState::kSuspect;
    if (suspect != nullptr) suspect->push_back(w->info.worker_id);
    Event e;
    e.unix_ms = now;
    e.kind = EventKind::kWorkerSuspect;
    e.worker_id = w->info.worker_id;
    e.detail = absl::StrCat("silent_ms=", now - w->info.last_heartbeat_unix_ms,
                            " sequences=", w->open.size());
    ev.push_back(std::move(e));
  }
  for (WorkerRecord* w : workers_.Silent(now, options_.worker_down_timeout_ms,
                                         WorkerState::kSuspect)) {
    ids.push_back(w->info.worker_id);
    transfers_.WorkerLost(w->info.worker_id, "went down");
    std::vector<SequenceRecord*> lost(w->open.begin(), w->open.end());
    std::sort(lost.begin(), lost.end(),
              [](const SequenceRecord* a, const SequenceRecord* b) {
                return a->id < b->id;
              });
    for (SequenceRecord* s : lost) {
      ParkLocked(w, s);
      MarkLostLocked(s, "worker_down", &ev, &forgotten);
    }
    w->info.state = WorkerState::kDown;
    Event e;
    e.unix_ms = now;
    e.kind = EventKind::kWorkerDown;
    e.worker_id = w->info.worker_id;
    e.detail = absl::StrCat("silent_ms=", now - w->info.last_heartbeat_unix_ms,
                            " lost_sequences=", lost.size());
    ev.push_back(std::move(e));
  }
  if (!ev.empty()) events_.Append(&ev, &forgotten);
  return ids;
}

// --- Reconciliation ----------------------------------------------------------

void ManagerCore::ParkLocked(WorkerRecord* w, SequenceRecord* s) {
  s->parked = true;
  s->parked_blocks.clear();
  s->parked_blocks.reserve(s->blocks.size());
  for (const BlockRecord* b : s->blocks) s->parked_blocks.push_back(*b);
  s->parked_turn_start = s->turn_start;
  w->parked.push_back(s->id);
}

void ManagerCore::DropParkedLocked(WorkerRecord* w) {
  for (const std::string& id : w->parked) {
    SequenceRecord* s = sequences_.Find(id);
    if (s != nullptr && s->parked) Unpark(s);
  }
  w->parked.clear();
}

std::vector<std::string> ManagerCore::RecoverParkedLocked(
    WorkerRecord* w, const Inventory& inventory, std::vector<Event>* ev) {
  const absl::flat_hash_set<absl::string_view> held(
      inventory.sequence_ids.begin(), inventory.sequence_ids.end());
  std::vector<std::string> ids = std::move(w->parked);
  w->parked.clear();
  // Creation order, so that a parent takes its blocks back before its
  // forks share them.
  std::sort(ids.begin(), ids.end(), CreatedBefore);
  std::vector<std::string> recovered;
  const int device = static_cast<int>(Tier::kDevice);
  for (const std::string& id : ids) {
    SequenceRecord* s = sequences_.Find(id);
    // Dropped from closed retention meanwhile: its id is released instead.
    if (s == nullptr || !s->parked) continue;
    if (s->state != SequenceState::kLost || s->worker != w ||
        !held.contains(id)) {
      Unpark(s);
      continue;
    }
    uint64_t device_bytes = 0;
    uint32_t spilled = 0;
    std::vector<uint64_t> lineages;
    lineages.reserve(s->parked_blocks.size());
    s->blocks.reserve(s->parked_blocks.size());
    // The graph gets its nodes and tool call -> result links again in block
    // order; co-attention edges and hits reported before the loss are gone.
    s->last_tool_call = 0;
    for (const BlockRecord& pb : s->parked_blocks) {
      // A block shared with a fork that came back first is live again:
      // share it (charged once per worker); otherwise restore it under its
      // lineage id.
      BlockRecord* b = sequences_.FindBlock(pb.lineage_id);
      if (b != nullptr) {
        SequenceTable::Share(s, b);
      } else {
        b = sequences_.RestoreBlock(s, pb);
        pressure_.BlockCreated(s, *b);
      }
      lineages.push_back(b->lineage_id);
      if (b->evicted) continue;
      if (b->tier == Tier::kDevice) {
        device_bytes += b->bytes;
      } else {
        ++spilled;
      }
    }
    s->bytes = device_bytes;
    s->spilled = spilled;
    s->turn_start = s->parked_turn_start;
    s->state = SequenceState::kOpen;
    s->lost_lineage_ids.clear();
    s->last_access_ms = clock_->NowMs();
    Touch(s);
    sequences_.Reopen(s);
    Unpark(s);
    Event e = MakeEvent(*clock_, EventKind::kSequenceRecovered, s, nullptr);
    e.lineage_ids = std::move(lineages);
    e.detail = absl::StrCat("blocks=", s->blocks.size(),
                            " device_bytes=", device_bytes);
    // Charged even above the tenant's device ceiling: the worker holds the
    // pages; the pressure loop reclaims down to the ceiling.
    const std::optional<Budget>& budget = s->tenant->budgets[device];
    if (budget.has_value() && s->tenant->used[device] > budget->ceiling_bytes) {
      absl::StrAppend(&e.detail, " over_ceiling_bytes=",
                      s->tenant->used[device] - budget->ceiling_bytes);
    }
    ev->push_back(std::move(e));
    recovered.push_back(id);
  }
  return recovered;
}

std::vector<std::string> ManagerCore::ReleaseListLocked(
    const WorkerRecord& w, const Inventory& inventory) const {
  std::vector<std::string> out;
  for (const std::string& id : inventory.sequence_ids) {
    const SequenceRecord* s = sequences_.Find(id);
    if (s != nullptr && s->worker == &w &&
        (s->state == SequenceState::kOpen || s->parked)) {
      continue;
    }
    // Imported by a transfer not yet committed: not to be freed.
    if (transfers_.Importing(w.info.worker_id, id)) continue;
    out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void ManagerCore::SealedEventsLocked(
    const WorkerRecord& w,
    const std::vector<std::pair<uint64_t, int64_t>>& sealed,
    std::vector<Event>* ev) {
  const int64_t now = clock_->NowMs();
  for (const auto& [id, unix_ms] : sealed) {
    BlockRecord* b = sequences_.FindBlock(id);
    // A block freed, moved or unknown since: its seal is no news.
    if (b == nullptr || b->worker != &w) continue;
    Event e = MakeEvent(*clock_, EventKind::kBlockSealed,
                        SequenceTable::Owner(*b), b);
    // The worker's clock, never ahead of the manager's (the event log's
    // times stay ordered with its ids).
    e.unix_ms = std::min(unix_ms, now);
    e.detail = absl::StrCat("encoding=", EncodingString(b->encoding),
                            " num_tokens=", b->num_tokens, " by=worker");
    ev->push_back(std::move(e));
  }
}

}  // namespace triax::manager
