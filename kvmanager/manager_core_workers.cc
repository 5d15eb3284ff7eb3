// ManagerCore's reconciliation of a returning worker (manager_core.h
// "Workers"): parking the sequences of a worker that goes DOWN, taking them
// back when it returns with the same incarnation, and the list of sequences
// a worker holds that the manager does not (for the worker to free).
#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
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
      // share it (charged once); otherwise restore it under its lineage id.
      BlockRecord* b = sequences_.FindBlock(pb.lineage_id);
      if (b != nullptr) {
        ++b->refcount;
        s->blocks.push_back(b);
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
    ++s->version;
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
    out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace triax::manager
