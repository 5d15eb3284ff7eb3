#include "kvmanager/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

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
  return absl::OkStatus();
}

absl::StatusOr<WorkerRecord*> WorkerRegistry::FindForRegistration(
    const RegisterWorkerRequest& req) const {
  auto it = workers_.find(req.worker_id);
  if (it == workers_.end()) return nullptr;
  WorkerRecord* w = it->second.get();
  if (w->info.state != WorkerState::kDown && w->info.address != req.address) {
    return absl::AlreadyExistsError(
        absl::StrCat("worker_id ", Quote(req.worker_id), " is ",
                     w->info.state == WorkerState::kUp ? "up" : "suspect",
                     " at address ",
                     Quote(w->info.address), "; a worker at address ",
                     Quote(req.address), " cannot take it"));
  }
  return w;
}

WorkerRecord* WorkerRegistry::Register(const RegisterWorkerRequest& req,
                                       int64_t now_ms) {
  std::unique_ptr<WorkerRecord>& slot = workers_[req.worker_id];
  if (slot == nullptr) slot = std::make_unique<WorkerRecord>();
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
  w->info.incarnation = req.incarnation;
  w->incarnation = req.incarnation;
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

uint64_t WorkerRegistry::FreeBytes(const WorkerRecord& w) {
  return w.info.capacity_bytes - std::min(w.reserved, w.info.capacity_bytes);
}

absl::Status WorkerRegistry::Fits(const WorkerRecord& w, uint64_t bytes) {
  const uint64_t free = FreeBytes(w);
  if (bytes <= free) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("worker ", Quote(w.info.worker_id), " has ", free,
                   " free bytes; the request needs ", bytes, " bytes; over by ",
                   bytes - free, " bytes"));
}

absl::StatusOr<WorkerRecord*> WorkerRegistry::Place(uint64_t bytes) const {
  WorkerRecord* best = nullptr;
  uint64_t best_free = 0;
  for (const auto& [id, w] : workers_) {
    // SUSPECT and DOWN workers take nothing new.
    if (w->info.state != WorkerState::kUp) continue;
    // A worker whose device failed (sticky CUDA error) takes nothing new.
    if (!w->info.inventory.device_error.empty()) continue;
    const uint64_t free = FreeBytes(*w);
    if (best == nullptr || free > best_free ||
        (free == best_free && id < best->info.worker_id)) {
      best = w.get();
      best_free = free;
    }
  }
  if (best == nullptr) {
    return absl::UnavailableError("no worker is up with a healthy device");
  }
  if (best_free < bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no worker has room: the request needs ", bytes,
                     " bytes; the largest free space is ", best_free,
                     " bytes (worker ", Quote(best->info.worker_id),
                     "); over by ", bytes - best_free, " bytes"));
  }
  return best;
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
  out.reserve(workers_.size());
  for (const auto& [id, w] : workers_) out.push_back(Info(*w));
  std::sort(out.begin(), out.end(),
            [](const WorkerInfo& a, const WorkerInfo& b) {
              return a.worker_id < b.worker_id;
            });
  return out;
}

}  // namespace triax::manager
