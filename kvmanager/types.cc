#include "kvmanager/types.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace triax::manager {
namespace {

template <size_t N>
std::string NameOf(const char* prefix, int v, const char* const (&names)[N]) {
  if (v >= 0 && static_cast<size_t>(v) < N) return names[v];
  return absl::StrCat(prefix, "(", v, ")");
}

}  // namespace

std::string RoleName(Role r) {
  static const char* const kNames[] = {
      "ROLE_UNSPECIFIED", "ROLE_SYSTEM",      "ROLE_TOOL_SCHEMA",
      "ROLE_USER",        "ROLE_ASSISTANT",   "ROLE_REASONING",
      "ROLE_TOOL_CALL",   "ROLE_TOOL_RESULT", "ROLE_DELIMITER"};
  return NameOf("ROLE", static_cast<int>(r), kNames);
}

std::string ModalityName(Modality m) {
  static const char* const kNames[] = {"MODALITY_UNSPECIFIED", "MODALITY_TEXT",
                                       "MODALITY_IMAGE", "MODALITY_AUDIO"};
  return NameOf("MODALITY", static_cast<int>(m), kNames);
}

std::string TemporalName(Temporal t) {
  static const char* const kNames[] = {
      "TEMPORAL_UNSPECIFIED", "TEMPORAL_SINK", "TEMPORAL_CURRENT_TURN",
      "TEMPORAL_RECENT_TURNS", "TEMPORAL_OLDER"};
  return NameOf("TEMPORAL", static_cast<int>(t), kNames);
}

std::string TierName(Tier t) {
  static const char* const kNames[] = {"TIER_UNSPECIFIED", "TIER_DEVICE",
                                       "TIER_HOST", "TIER_DISK"};
  return NameOf("TIER", static_cast<int>(t), kNames);
}

std::string FormatProtoName(Format f) {
  static const char* const kNames[] = {
      "FORMAT_UNSPECIFIED", "FORMAT_BF16",     "FORMAT_INT4",
      "FORMAT_INT2",        "FORMAT_FP8_E4M3", "FORMAT_INT8",
      "FORMAT_TQ4",         "FORMAT_TQ3",      "FORMAT_TQ2"};
  return NameOf("FORMAT", static_cast<int>(f), kNames);
}

std::string EventKindName(EventKind k) {
  static const char* const kNames[] = {
      "EVENT_KIND_UNSPECIFIED",  "EVENT_BLOCK_CREATED",
      "EVENT_BLOCK_RETAGGED",    "EVENT_BLOCK_SHARED",
      "EVENT_BLOCK_RELEASED",    "EVENT_BLOCK_FREED",
      "EVENT_BLOCK_LOST",        "EVENT_SEQUENCE_OPENED",
      "EVENT_SEQUENCE_EXTENDED", "EVENT_SEQUENCE_FORKED",
      "EVENT_SEQUENCE_CLOSED",   "EVENT_SEQUENCE_LOST",
      "EVENT_WORKER_UP",         "EVENT_WORKER_DOWN",
      "EVENT_TENANT_CHANGED",    "EVENT_BLOCK_DEMOTED",
      "EVENT_BLOCK_SPILLED",     "EVENT_BLOCK_RESTORED",
      "EVENT_BLOCK_EVICTED"};
  return NameOf("EVENT_KIND", static_cast<int>(k), kNames);
}

absl::StatusOr<std::vector<Role>> ParseRoleList(absl::string_view list) {
  static const char* const kNames[] = {
      "",          "system",    "tool_schema", "user",     "assistant",
      "reasoning", "tool_call", "tool_result", "delimiter"};
  std::vector<Role> out;
  for (absl::string_view name : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    name = absl::StripAsciiWhitespace(name);
    bool found = false;
    for (int i = 1; i < kNumRoles; ++i) {
      if (name == kNames[i]) {
        out.push_back(static_cast<Role>(i));
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "role \"", name,
          "\" is not one of system, tool_schema, user, assistant, reasoning, "
          "tool_call, tool_result, delimiter"));
    }
  }
  return out;
}

bool IsValid(Role r) {
  const int v = static_cast<int>(r);
  return v >= 1 && v < kNumRoles;
}
bool IsValid(Modality m) {
  const int v = static_cast<int>(m);
  return v >= 0 && v <= 3;
}
bool IsValid(Tier t) {
  const int v = static_cast<int>(t);
  return v >= 1 && v < kNumTiers;
}
bool IsValidFormat(Format f) {
  const int v = static_cast<int>(f);
  return v >= 1 && v <= 8;
}

bool EventFilter::Matches(const Event& e) const {
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
