#include "kvmanager/types.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace triax::manager {
namespace {

template <size_t N>
std::string NameOf(const char* prefix, int v, const char* const (&names)[N]) {
  if (v >= 0 && static_cast<size_t>(v) < N) return names[v];
  return absl::StrCat(prefix, "(", v, ")");
}

}  // namespace

std::string WorkerStateName(WorkerState s) {
  switch (s) {
    case WorkerState::kUp:
      return "up";
    case WorkerState::kSuspect:
      return "suspect";
    case WorkerState::kDown:
      return "down";
    default:
      return "unspecified";
  }
}

std::string EventKindName(EventKind k) {
  static const char* const kNames[] = {"EVENT_KIND_UNSPECIFIED",
                                       "EVENT_BLOCK_CREATED",
                                       "EVENT_BLOCK_RETAGGED",
                                       "EVENT_BLOCK_SHARED",
                                       "EVENT_BLOCK_RELEASED",
                                       "EVENT_BLOCK_FREED",
                                       "EVENT_BLOCK_LOST",
                                       "EVENT_SEQUENCE_OPENED",
                                       "EVENT_SEQUENCE_EXTENDED",
                                       "EVENT_SEQUENCE_FORKED",
                                       "EVENT_SEQUENCE_CLOSED",
                                       "EVENT_SEQUENCE_LOST",
                                       "EVENT_WORKER_UP",
                                       "EVENT_WORKER_DOWN",
                                       "EVENT_TENANT_CHANGED",
                                       "EVENT_BLOCK_DEMOTED",
                                       "EVENT_BLOCK_SPILLED",
                                       "EVENT_BLOCK_RESTORED",
                                       "EVENT_BLOCK_EVICTED",
                                       "EVENT_WORKER_SUSPECT",
                                       "EVENT_WORKER_RECOVERED",
                                       "EVENT_SEQUENCE_RECOVERED",
                                       "EVENT_SEQUENCE_TRUNCATED",
                                       "EVENT_TRANSFER_STARTED",
                                       "EVENT_BLOCK_TRANSFERRED",
                                       "EVENT_TRANSFER_FAILED",
                                       "EVENT_SEQUENCE_TRANSFERRED",
                                       "EVENT_BLOCK_SEALED"};
  return NameOf("EVENT_KIND", static_cast<int>(k), kNames);
}

bool EventFilter::Matches(const Event& e) const {
  if (kind != EventKind::kUnspecified && e.kind != kind) return false;
  if (!tenant_id.empty() && e.tenant_id != tenant_id) return false;
  if (!sequence_id.empty() && e.sequence_id != sequence_id) return false;
  if (lineage_id != 0 && e.lineage_id != lineage_id &&
      std::find(e.lineage_ids.begin(), e.lineage_ids.end(), lineage_id) ==
          e.lineage_ids.end()) {
    return false;
  }
  return true;
}

}  // namespace triax::manager
