#include "common/model.h"

#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace triax {
namespace {

template <size_t N>
std::string NameOf(const char* axis, int v, const char* const (&names)[N]) {
  if (v >= 0 && static_cast<size_t>(v) < N) return names[v];
  return absl::StrCat(axis, "(", v, ")");
}

constexpr const char* kRoleLabels[] = {
    "unspecified", "system",    "tool_schema", "user",     "assistant",
    "reasoning",   "tool_call", "tool_result", "delimiter"};
static_assert(sizeof(kRoleLabels) / sizeof(kRoleLabels[0]) == kNumRoles);

}  // namespace

bool Tag::operator<(const Tag& o) const {
  return std::tie(temporal, modality, role) <
         std::tie(o.temporal, o.modality, o.role);
}

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

std::string RoleLabel(Role r) {
  return NameOf("role", static_cast<int>(r), kRoleLabels);
}

std::string ModalityLabel(Modality m) {
  static const char* const kNames[] = {"unspecified", "text", "image", "audio"};
  return NameOf("modality", static_cast<int>(m), kNames);
}

std::string TemporalLabel(Temporal t) {
  static const char* const kNames[] = {"unspecified", "sink", "current_turn",
                                       "recent_turns", "older"};
  return NameOf("temporal", static_cast<int>(t), kNames);
}

std::string TierLabel(Tier t) {
  static const char* const kNames[] = {"unspecified", "device", "host", "disk"};
  return NameOf("tier", static_cast<int>(t), kNames);
}

std::string TagLabel(const Tag& t) {
  const Modality m =
      t.modality == Modality::kUnspecified ? Modality::kText : t.modality;
  return absl::StrCat(TemporalLabel(t.temporal), "/", ModalityLabel(m), "/",
                      RoleLabel(t.role));
}

bool IsValid(Role r) { return r >= Role::kSystem && r <= Role::kDelimiter; }

bool IsValid(Modality m) {
  return m >= Modality::kUnspecified && m <= Modality::kAudio;
}

bool IsValid(Temporal t) {
  return t >= Temporal::kSink && t <= Temporal::kOlder;
}

bool IsValid(Tier t) { return t >= Tier::kDevice && t <= Tier::kDisk; }

bool IsValidFormat(Format f) { return f >= Format::kBF16 && f <= Format::kTQ2; }

absl::StatusOr<std::vector<Role>> ParseRoleList(absl::string_view list) {
  std::vector<Role> out;
  for (absl::string_view name : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    name = absl::StripAsciiWhitespace(name);
    bool found = false;
    for (int i = 1; i < kNumRoles; ++i) {
      if (name == kRoleLabels[i]) {
        out.push_back(static_cast<Role>(i));
        found = true;
        break;
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

Temporal TemporalFor(uint32_t block_index, uint32_t turn, uint32_t current_turn,
                     uint32_t recent_turns) {
  if (block_index == 0) return Temporal::kSink;
  if (turn >= current_turn) return Temporal::kCurrentTurn;
  if (current_turn - turn <= recent_turns) return Temporal::kRecentTurns;
  return Temporal::kOlder;
}

absl::Status ValidateModelShape(const ModelShape& m, absl::string_view field) {
  if (m.n_layers < 1 || m.n_layers > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".n_layers=", m.n_layers, " is outside 1..1024"));
  }
  if (m.n_kv_heads < 1 || m.n_kv_heads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".n_kv_heads=", m.n_kv_heads, " is outside 1..1024"));
  }
  if (m.n_q_heads == 0 || m.n_q_heads % m.n_kv_heads != 0 ||
      m.n_q_heads / m.n_kv_heads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".n_q_heads=", m.n_q_heads,
                     " is not a positive multiple (at most 1024x) of ", field,
                     ".n_kv_heads=", m.n_kv_heads));
  }
  if (m.head_dim < 2 || m.head_dim > 512 || m.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".head_dim=", m.head_dim, " is not an even number in 2..512"));
  }
  if (m.name.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".name is ", m.name.size(), " bytes long; the limit is 256"));
  }
  return absl::OkStatus();
}

absl::Status ValidateEncodingFields(const Encoding& e,
                                    absl::string_view field) {
  if (!IsValidFormat(e.k)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".format=", static_cast<int>(e.k),
        " is not a format (1 bf16, 2 int4, 3 int2, 4 fp8_e4m3, 5 int8, 6 tq4, "
        "7 tq3, 8 tq2)"));
  }
  if (!IsValidFormat(e.v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".format_v=", static_cast<int>(e.v),
                     " is not a format (1..8, or 0 for the same as format)"));
  }
  if (e.group != 0 && e.group != 32 && e.group != 64 && e.group != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".group_size=", e.group, " is not 0 (32), 32, 64 or 128"));
  }
  if (e.scale_dtype != ScaleDtype::kFP16 && e.scale_dtype != ScaleDtype::kFP8) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".scale_dtype=", static_cast<int>(e.scale_dtype),
                     " is not 0 or 1 (fp16) or 2 (fp8_e4m3)"));
  }
  return absl::OkStatus();
}

}  // namespace triax
