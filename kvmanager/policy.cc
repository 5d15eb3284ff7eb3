#include "kvmanager/policy.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"

namespace triax::manager {
namespace {

constexpr int kNone = 0;
constexpr int kI4 = static_cast<int>(Format::kINT4);

// Role overrides, indexed by Role value:
//   unspec system tool_schema user assistant reasoning tool_call tool_result
//   delim
constexpr std::array<int, kNumRoles> kNoOverrides = {
    kNone, kNone, kNone, kNone, kNone, kNone, kNone, kNone, kNone};
constexpr std::array<int, kNumRoles> kTriaxialOverrides = {
    kNone, kI4, kI4, kNone, kNone, kNone, kNone, kNone, kNone};

constexpr PolicyTable kTables[] = {
    {"triaxial-static", Format::kBF16, Format::kBF16, Format::kINT4,
     Format::kINT2, kTriaxialOverrides},
    {"bf16", Format::kBF16, Format::kBF16, Format::kBF16, Format::kBF16,
     kNoOverrides},
    {"int4", Format::kINT4, Format::kINT4, Format::kINT4, Format::kINT4,
     kNoOverrides},
    {"int2", Format::kINT2, Format::kINT2, Format::kINT2, Format::kINT2,
     kNoOverrides},
};

}  // namespace

Format PolicyTable::FormatFor(const Tag& tag) const {
  if (tag.temporal == Temporal::kSink) return sink;
  const int role = static_cast<int>(tag.role);
  if (role >= 0 && role < kNumRoles && role_override[role] != kNone) {
    return static_cast<Format>(role_override[role]);
  }
  switch (tag.temporal) {
    case Temporal::kRecentTurns:
      return recent_turns;
    case Temporal::kOlder:
      return older;
    case Temporal::kCurrentTurn:
    default:
      return current_turn;
  }
}

absl::StatusOr<const PolicyTable*> FindPolicy(absl::string_view field,
                                              absl::string_view name) {
  for (const PolicyTable& t : kTables) {
    if (name == t.name) return &t;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " ", Quote(name),
      " is not a known policy; known: ", absl::StrJoin(PolicyNames(), ", ")));
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (const PolicyTable& t : kTables) names.emplace_back(t.name);
  return names;
}

}  // namespace triax::manager
