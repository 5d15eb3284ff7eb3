// Precision policy tables: which page format a block gets from its tag.
//
// The tables are static data in policy.cc (calibrated tables replace them in
// a later step). Lookup precedence, highest first:
//   1. temporal SINK            -> the table's `sink` format
//   2. a role override          -> e.g. system / tool_schema in
//                                   "triaxial-static"
//   3. the temporal class       -> current / recent / older
// ROLE_DELIMITER has no override, so a delimiter gets its temporal class's
// format. Modality does not change the format in the static tables.
//
// Named tables:
//   name               sink  current recent older  role overrides
//   "triaxial-static"  BF16  BF16    INT4   INT2   system, tool_schema -> INT4
//   "bf16"             BF16  BF16    BF16   BF16   -
//   "int4"             INT4  INT4    INT4   INT4   -
//   "int2"             INT2  INT2    INT2   INT2   -
#pragma once

#include <array>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmanager/types.h"

namespace triax::manager {

struct PolicyTable {
  const char* name;
  Format sink;
  Format current_turn;
  Format recent_turns;
  Format older;
  // Indexed by Role; kUnspecified (0) means "no override".
  std::array<int, kNumRoles> role_override;

  Format FormatFor(const Tag& tag) const;
};

inline constexpr const char* kDefaultPolicy = "triaxial-static";

// The table named `name`; INVALID_ARGUMENT naming `field` and the value, and
// listing the known names, for anything else. The pointer is to static data.
absl::StatusOr<const PolicyTable*> FindPolicy(absl::string_view field,
                                              absl::string_view name);

// Names of all tables, in table order.
std::vector<std::string> PolicyNames();

}  // namespace triax::manager
