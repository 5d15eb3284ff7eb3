#include "kvmanager/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kernels/layout.h"

namespace triax::manager {

absl::Status WorkerRegistry::ValidateRegistration(
    const RegisterWorkerRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateId("worker_id", req.worker_id));
  if (req.address.empty() || req.address.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("address ", Quote(req.address),
                     " must be a host:port of 1..256 bytes"));
  }
  if (req.backend.empty())
    return absl::InvalidArgumentError("backend is empty");
  if (req.capacity_bytes == 0) {
    return absl::InvalidArgumentError("capacity_bytes is 0; it must be > 0");
  }
  return ValidateHeartbeat(req.worker_id, req.inventory, req.incarnation);
}

absl::Status WorkerRegistry::ValidateHeartbeat(const std::string& worker_id,
                                               const Inventory& inventory,
                                               const std::string& incarnation) {
  TRIAX_RETURN_IF_ERROR(ValidateId("worker_id", worker_id));
  if (!incarnation.empty()) {
    TRIAX_RETURN_IF_ERROR(ValidateId("incarnation", incarnation));
  }
  for (size_t i = 0; i < inventory.formats.size(); ++i) {
    if (!IsValidFormat(inventory.formats[i].format)) {
      return absl::InvalidArgumentError(
          absl::StrCat("inventory.formats[", i, "].format is ",
                       FormatProtoName(inventory.formats[i].format)));
    }
  }
  for (size_t i = 0; i < inventory.pools.size(); ++i) {
    const PoolInventory& p = inventory.pools[i];
    if (!IsValidFormat(p.encoding.k) || !IsValidFormat(p.encoding.v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inventory.pools[", i, "] has format ", FormatProtoName(p.encoding.k),
          " / format_v ", FormatProtoName(p.encoding.v)));
    }
    if (p.page_bytes == 0 || p.page_bytes > inventory.frame_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("inventory.pools[", i, "].page_bytes=", p.page_bytes,
                       " must be in 1..frame_bytes=", inventory.frame_bytes));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<WorkerRecord*> WorkerRegistry::FindForRegistration(
    const RegisterWorkerRequest& req, int64_t now_ms, int64_t live_ms) const {
  auto it = workers_.find(req.worker_id);
  if (it == workers_.end()) return nullptr;
  WorkerRecord* w = it->second.get();
  if (w->info.state != WorkerState::kDown && w->info.address != req.address) {
    return absl::AlreadyExistsError(absl::StrCat(
        "worker_id ", Quote(req.worker_id), " is ",
        w->info.state == WorkerState::kUp ? "up" : "suspect", " at address ",
        Quote(w->info.address), "; a worker at address ", Quote(req.address),
        " cannot take it"));
  }
  const int64_t silent_ms = now_ms - w->info.last_heartbeat_unix_ms;
  if (live_ms > 0 && w->info.state == WorkerState::kUp &&
      !w->incarnation.empty() && !req.incarnation.empty() &&
      w->incarnation != req.incarnation && silent_ms < live_ms) {
    return absl::AlreadyExistsError(absl::StrCat(
        "worker_id ", Quote(req.worker_id), " is up at address ",
        Quote(w->info.address), " with incarnation ", Quote(w->incarnation),
        " (last heartbeat ", silent_ms, " ms ago); incarnation ",
        Quote(req.incarnation),
        " cannot take it until that one misses its heartbeats for ", live_ms,
        " ms"));
  }
  return w;
}

WorkerRecord* WorkerRegistry::Register(const RegisterWorkerRequest& req,
                                       int64_t now_ms) {
  std::unique_ptr<WorkerRecord>& slot = workers_[req.worker_id];
  if (slot == nullptr) {
    slot = std::make_unique<WorkerRecord>();
    ids_.insert(req.worker_id);
  }
  WorkerRecord* w = slot.get();
  w->info.worker_id = req.worker_id;
  w->info.address = req.address;
  w->info.backend = req.backend;
  w->info.capacity_bytes = req.capacity_bytes;
  w->info.host_capacity_bytes = req.host_capacity_bytes;
  w->info.disk_capacity_bytes = req.disk_capacity_bytes;
  w->info.state = WorkerState::kUp;
  w->info.last_heartbeat_unix_ms = now_ms;
  w->info.inventory = req.inventory;
  w->info.inventory.restored_lineage_ids.clear();
  w->info.inventory.sealed_blocks.clear();
  w->info.incarnation = req.incarnation;
  w->incarnation = req.incarnation;
  w->planned_at_report = w->planned_total;
  return w;
}

absl::StatusOr<WorkerRecord*> WorkerRegistry::Heartbeat(
    const std::string& worker_id, const Inventory& inventory, int64_t now_ms,
    const std::string& incarnation) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker_id ", Quote(worker_id),
                                            " is not registered; re-register"));
  }
  WorkerRecord* w = it->second.get();
  if (w->info.state == WorkerState::kDown) {
    return absl::NotFoundError(
        absl::StrCat("worker_id ", Quote(worker_id),
                     " was marked down (missed heartbeats); re-register"));
  }
  if (!w->incarnation.empty() && incarnation.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("incarnation is empty; worker_id ", Quote(worker_id),
                     " registered with incarnation ", Quote(w->incarnation)));
  }
  if (incarnation != w->incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation ", Quote(incarnation), " is stale: worker_id ",
        Quote(worker_id), " is registered with incarnation ",
        Quote(w->incarnation)));
  }
  w->info.state = WorkerState::kUp;
  w->info.last_heartbeat_unix_ms = now_ms;
  w->info.inventory = inventory;
  w->planned_at_report = w->planned_total;
  return w;
}

std::vector<WorkerRecord*> WorkerRegistry::Silent(int64_t now_ms,
                                                  int64_t timeout_ms,
                                                  WorkerState state) const {
  std::vector<WorkerRecord*> out;
  for (const auto& [id, w] : workers_) {
    if (w->info.state == state &&
        now_ms - w->info.last_heartbeat_unix_ms > timeout_ms) {
      out.push_back(w.get());
    }
  }
  std::sort(out.begin(), out.end(),
            [](const WorkerRecord* a, const WorkerRecord* b) {
              return a->info.worker_id < b->info.worker_id;
            });
  return out;
}

void WorkerRegistry::AddBlocks(const ModelShape& model, uint32_t block_tokens,
                               const Encoding& e, uint64_t blocks,
                               Demand* demand) {
  if (blocks == 0) return;
  const uint64_t page_bytes =
      kernels::PageBytes(e, PageShapeOf(model, block_tokens));
  const uint64_t pages = blocks * model.n_layers;
  for (PageDemand& d : *demand) {
    if (d.encoding == e && d.page_bytes == page_bytes) {
      d.pages += pages;
      return;
    }
  }
  demand->push_back(PageDemand{e, page_bytes, pages});
}

uint64_t WorkerRegistry::FreeBytes(const WorkerRecord& w) {
  const uint64_t held = w.reserved + w.transient;
  return w.info.capacity_bytes - std::min(held, w.info.capacity_bytes);
}

int64_t WorkerRegistry::FrameRoomBytes(const WorkerRecord& w) {
  const Inventory& inv = w.info.inventory;
  if (inv.frame_bytes == 0) return -1;
  const uint64_t frames = inv.free_frames_compacted * inv.frame_bytes;
  const uint64_t since = PlannedSinceHeartbeat(w) + w.transient;
  return frames > since ? static_cast<int64_t>(frames - since) : 0;
}

uint64_t WorkerRegistry::PlannedSinceHeartbeat(const WorkerRecord& w) {
  return w.planned_total - std::min(w.planned_total, w.planned_at_report);
}

uint64_t WorkerRegistry::RoomBytes(const WorkerRecord& w) {
  const uint64_t free = FreeBytes(w);
  const int64_t frames = FrameRoomBytes(w);
  if (frames < 0) return free;
  uint64_t room = static_cast<uint64_t>(frames);
  for (const PoolInventory& p : w.info.inventory.pools) {
    room += p.free_slots_compacted * p.page_bytes;
  }
  return std::min(free, room);
}

absl::StatusOr<uint64_t> WorkerRegistry::FramesNeeded(const WorkerRecord& w,
                                                      const Demand& demand,
                                                      std::string* what) {
  const Inventory& inv = w.info.inventory;
  uint64_t frames = 0;
  for (const PageDemand& d : demand) {
    char buf[96];
    const char* name = kernels::EncodingName(d.encoding, buf, sizeof(buf));
    if (d.page_bytes > inv.frame_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " pages of ", d.page_bytes, " bytes exceed worker ",
          Quote(w.info.worker_id), "'s frame_bytes ", inv.frame_bytes,
          "; use smaller blocks"));
    }
    uint64_t slots = 0;
    for (const PoolInventory& p : inv.pools) {
      if (p.encoding == d.encoding && p.page_bytes == d.page_bytes) {
        slots = p.free_slots_compacted;
      }
    }
    const uint64_t per_frame = inv.frame_bytes / d.page_bytes;
    const uint64_t rest = d.pages > slots ? d.pages - slots : 0;
    const uint64_t need = (rest + per_frame - 1) / per_frame;
    frames += need;
    if (what != nullptr) {
      absl::StrAppend(what, what->empty() ? "" : ", ", d.pages, " ", name,
                      " pages of ", d.page_bytes, " bytes (", slots,
                      " free slots, ", need, " frames)");
    }
  }
  return frames;
}

absl::Status WorkerRegistry::Fits(const WorkerRecord& w, uint64_t bytes,
                                  const Demand& demand) {
  const uint64_t free = FreeBytes(w);
  if (bytes > free) {
    return absl::ResourceExhaustedError(
        absl::StrCat("worker ", Quote(w.info.worker_id), " has ", free,
                     " free bytes; the request needs ", bytes,
                     " bytes; over by ", bytes - free, " bytes"));
  }
  const int64_t room = FrameRoomBytes(w);
  if (room < 0 || demand.empty()) return absl::OkStatus();
  const Inventory& inv = w.info.inventory;
  std::string what;
  absl::StatusOr<uint64_t> frames = FramesNeeded(w, demand, &what);
  if (!frames.ok()) return frames.status();
  if (*frames * inv.frame_bytes <= static_cast<uint64_t>(room)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "worker ", Quote(w.info.worker_id), " has room for ",
      static_cast<uint64_t>(room) / inv.frame_bytes, " more frames of ",
      inv.frame_bytes, " bytes (", inv.free_frames_compacted,
      " free after compaction at its last heartbeat, less ",
      PlannedSinceHeartbeat(w), " bytes planned since); the request needs ",
      *frames, " frames for ", what));
}

uint64_t WorkerRegistry::AdmissionBytes(const WorkerRecord& w, uint64_t bytes,
                                        const Demand& demand) {
  const int64_t room = FrameRoomBytes(w);
  if (room < 0 || demand.empty()) return bytes;
  absl::StatusOr<uint64_t> frames = FramesNeeded(w, demand, nullptr);
  if (!frames.ok()) return bytes;
  const uint64_t need = *frames * w.info.inventory.frame_bytes;
  if (need <= static_cast<uint64_t>(room)) return bytes;
  return std::max(bytes, FreeBytes(w) + (need - static_cast<uint64_t>(room)));
}

absl::StatusOr<WorkerRecord*> WorkerRegistry::PlaceOn(
    const std::string& field, const std::string& worker_id, uint64_t bytes,
    const Demand& demand) const {
  WorkerRecord* w = Find(worker_id);
  if (w == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(field, " ", Quote(worker_id), " is not a known worker"));
  }
  if (w->info.state != WorkerState::kUp) {
    return absl::UnavailableError(absl::StrCat(
        field, " ", Quote(worker_id), " is ",
        w->info.state == WorkerState::kSuspect ? "suspect" : "down",
        "; only UP workers take new sequences"));
  }
  if (!w->info.inventory.device_error.empty()) {
    return absl::UnavailableError(absl::StrCat(
        field, " ", Quote(worker_id),
        " reports a device error: ", w->info.inventory.device_error));
  }
  if (bytes == 0) return w;
  TRIAX_RETURN_IF_ERROR(Fits(*w, bytes, demand));
  return w;
}

absl::StatusOr<WorkerRecord*> WorkerRegistry::Place(
    uint64_t bytes, const Demand& demand) const {
  WorkerRecord* best = nullptr;  // the fitting worker with the most room
  uint64_t best_room = 0;
  WorkerRecord* roomiest = nullptr;  // any candidate, for the refusal
  uint64_t roomiest_room = 0;
  absl::Status roomiest_why;
  bool any = false;
  for (const auto& [id, w] : workers_) {
    // SUSPECT and DOWN workers take nothing new.
    if (w->info.state != WorkerState::kUp) continue;
    // A worker whose device failed (sticky CUDA error) takes nothing new.
    if (!w->info.inventory.device_error.empty()) continue;
    any = true;
    const uint64_t room = RoomBytes(*w);
    absl::Status fits = Fits(*w, bytes, demand);
    if (roomiest == nullptr || room > roomiest_room ||
        (room == roomiest_room && id < roomiest->info.worker_id)) {
      roomiest = w.get();
      roomiest_room = room;
      roomiest_why = fits;
    }
    if (!fits.ok()) continue;
    if (best == nullptr || room > best_room ||
        (room == best_room && id < best->info.worker_id)) {
      best = w.get();
      best_room = room;
    }
  }
  if (!any) {
    return absl::UnavailableError("no worker is up with a healthy device");
  }
  if (best != nullptr) return best;
  if (const uint64_t free = FreeBytes(*roomiest); bytes > free) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no worker has room: the request needs ", bytes,
                     " bytes; the largest free space is ", free,
                     " bytes (worker ", Quote(roomiest->info.worker_id),
                     "); over by ", bytes - free, " bytes"));
  }
  return absl::Status(
      roomiest_why.code(),
      absl::StrCat("no worker has room: ", roomiest_why.message()));
}

WorkerRecord* WorkerRegistry::Find(const std::string& worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : it->second.get();
}

WorkerInfo WorkerRegistry::Info(const WorkerRecord& w) {
  WorkerInfo info = w.info;
  info.reserved_bytes = w.reserved;
  info.sequences = static_cast<uint32_t>(w.open.size());
  return info;
}

std::vector<WorkerInfo> WorkerRegistry::List() const {
  std::vector<WorkerInfo> out;
  out.reserve(ids_.size());
  for (const std::string& id : ids_) out.push_back(Info(*workers_.at(id)));
  return out;
}

Page<WorkerInfo> WorkerRegistry::ListPage(const PageCursor& cursor) const {
  Page<WorkerInfo> page;
  auto it = cursor.after() ? ids_.upper_bound(*cursor.after()) : ids_.begin();
  for (; it != ids_.end() && page.items.size() < cursor.size(); ++it) {
    page.items.push_back(Info(*workers_.at(*it)));
  }
  if (it != ids_.end()) {
    page.next_page_token = cursor.NextToken(page.items.back().worker_id);
  }
  return page;
}

}  // namespace triax::manager
