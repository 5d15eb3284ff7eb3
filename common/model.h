// The domain vocabulary that kvmanager, kvworker and the clients share: the
// model shape, the storage tier, the three tag axes (temporal recency,
// modality, semantic role), a block's encoding and the block spec a worker
// installs. Defined once here; the wire forms convert through
// common/model_proto.h and nothing here depends on protobuf.
//
// Enum values equal the triax.v1 proto enums (proto/triax/v1/types.proto), so
// converting is a cast. A value outside an enum's range survives conversion
// (the converters keep it) so that the validators below can refuse it with
// the field's name and the value, instead of it turning silently into
// something valid.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/layout.h"

namespace triax {

// Page encodings: one definition in kernels/layout.h, shared with the CPU
// reference and the CUDA kernels.
using kernels::Encoding;
using kernels::Format;
using kernels::ScaleDtype;

// Where a block's bytes are. The CPU backend's pool counts as kDevice.
enum class Tier : int { kUnspecified = 0, kDevice = 1, kHost = 2, kDisk = 3 };
inline constexpr int kNumTiers = 4;

// Semantic role of a span of tokens.
enum class Role : int {
  kUnspecified = 0,
  kSystem = 1,
  kToolSchema = 2,
  kUser = 3,
  kAssistant = 4,
  kReasoning = 5,
  kToolCall = 6,
  kToolResult = 7,
  kDelimiter = 8,
};
inline constexpr int kNumRoles = 9;

enum class Modality : int {
  kUnspecified = 0,  // means text where a modality is required
  kText = 1,
  kImage = 2,
  kAudio = 3
};

// Temporal axis, assigned by the manager (TemporalFor), never by clients.
enum class Temporal : int {
  kUnspecified = 0,
  kSink = 1,
  kCurrentTurn = 2,
  kRecentTurns = 3,
  kOlder = 4,
};

// The triaxial tag of a block.
struct Tag {
  Temporal temporal = Temporal::kUnspecified;
  Modality modality = Modality::kText;
  Role role = Role::kUnspecified;
  bool operator==(const Tag& o) const {
    return temporal == o.temporal && modality == o.modality && role == o.role;
  }
  bool operator!=(const Tag& o) const { return !(*this == o); }
  bool operator<(const Tag& o) const;  // temporal, then modality, then role
};

// Proto enum names ("ROLE_SYSTEM", "TIER_DEVICE", "FORMAT_FP8_E4M3", ...) for
// error messages and event details; "<AXIS>(<int>)" for out-of-range values.
std::string RoleName(Role r);
std::string ModalityName(Modality m);
std::string TemporalName(Temporal t);
std::string TierName(Tier t);
std::string FormatProtoName(Format f);

// Lower-case labels for human text and tables: "system", "tool_schema",
// "text", "current_turn", "host", ...; "role(12)" style when out of range.
std::string RoleLabel(Role r);
std::string ModalityLabel(Modality m);
std::string TemporalLabel(Temporal t);
std::string TierLabel(Tier t);
// "older/text/tool_schema": temporal/modality/role labels (modality
// unspecified prints as "text").
std::string TagLabel(const Tag& t);

bool IsValid(Role r);          // kSystem..kDelimiter
bool IsValid(Modality m);      // kUnspecified (= text) .. kAudio
bool IsValid(Temporal t);      // kSink..kOlder
bool IsValid(Tier t);          // kDevice..kDisk
bool IsValidFormat(Format f);  // kBF16..kTQ2 (1..8)

// "system,tool_schema" -> roles, by RoleLabel; empty -> none.
// INVALID_ARGUMENT naming an unknown name.
absl::StatusOr<std::vector<Role>> ParseRoleList(absl::string_view list);

// The temporal class of block `block_index` written in turn `turn` when the
// newest turn is `current_turn`: the sequence's first block is the sink;
// blocks of the newest turn are current; blocks of the `recent_turns` turns
// before it are recent; the rest are older.
Temporal TemporalFor(uint32_t block_index, uint32_t turn, uint32_t current_turn,
                     uint32_t recent_turns);

// The attention shape of a model, as every RPC that installs KV names it.
struct ModelShape {
  std::string name;         // at most 256 bytes; informational
  uint32_t n_layers = 0;    // 1..1024
  uint32_t n_kv_heads = 0;  // 1..1024
  uint32_t n_q_heads = 0;   // a positive multiple (<= 1024x) of n_kv_heads
  uint32_t head_dim = 0;    // even, 2..512
};

// OK when every field is in the range above; else INVALID_ARGUMENT naming
// `<field>.<member>=<value>` (field is e.g. "model" or "table.shape").
absl::Status ValidateModelShape(const ModelShape& m,
                                absl::string_view field = "model");

// The page shape of one block of `block_tokens` tokens of this model:
// {block_tokens, n_kv_heads, head_dim}. The bytes of a block on one layer
// are kernels::PageBytes(encoding, PageShapeOf(...)).
inline kernels::PageShape PageShapeOf(const ModelShape& m,
                                      uint32_t block_tokens) {
  return kernels::PageShape{static_cast<int>(block_tokens),
                            static_cast<int>(m.n_kv_heads),
                            static_cast<int>(m.head_dim)};
}

// One block of a sequence's plan as a worker installs it: which tokens, which
// lineage, which encoding, and where its pages are.
struct BlockSpec {
  uint32_t index = 0;        // position in the sequence
  uint64_t lineage_id = 0;   // stable identity across demotion, spill, fork
  uint64_t first_token = 0;  // absolute token position of the block's start
  uint32_t num_tokens = 0;   // 1..block_tokens
  // K format, V format, INT group size (0 = 32), scale dtype. From the wire
  // the formats may be out of range (see ValidateEncodingFields).
  Encoding encoding;
  // kUnspecified on input means kDevice. A worker describing an evicted
  // block reports kUnspecified.
  Tier tier = Tier::kDevice;
  bool evicted = false;  // dropped under pressure; not attended
};

// Range check of an encoding's fields as they come off the wire: K format
// 1..8, V format 1..8, group 0 (= 32), 32, 64 or 128, scale dtype FP16 or
// FP8 E4M3. INVALID_ARGUMENT naming "<field>.format" (K), "<field>.format_v",
// "<field>.group_size" or "<field>.scale_dtype" and the value. Does not
// check the encoding against a page shape (kernels::ValidateEncoding does).
absl::Status ValidateEncodingFields(const Encoding& e, absl::string_view field);

}  // namespace triax
