// Precision policies: which page encoding (K format, V format, INT group
// size, scale dtype; kernels/layout.h) a block gets from its tag.
//
// A policy is an ordered list of rules; the first rule whose set fields all
// match the block's tag wins (an unspecified temporal, role or modality
// matches anything). The last rule must match everything. A block's tag
// modality is TEXT when its span said UNSPECIFIED.
//
// Built-in policies (ListPolicies shows them with builtin = true; they cannot
// be replaced):
//   "triaxial-static"  temporal=sink:bf16  role=system:int4
//                      role=tool_schema:int4  temporal=recent_turns:int4
//                      temporal=older:int2  *:bf16
//   "bf16" "fp8" "int8" "int4" "int2" "tq4" "tq3" "tq2"   *:<format>
// Operator policies come from PutPolicy (ManagerCore) and use the same rule
// structure.
//
// Allocation policies (budget_bits > 0): encodings are not read from the
// rules but chosen per tag by the bit allocator (allocator.h) from the
// calibration table named by calibration_model, recomputed at every Open and
// Extend of a sequence (ManagerCore). Rules then only pin: the first rule
// matching a tag decides; if its encoding is BF16 the tag is pinned to BF16,
// otherwise the tag is left to the allocator (so `temporal=sink:<non-bf16>`
// un-pins sinks). A tag no rule matches is pinned to BF16 when it is a sink
// and left to the allocator otherwise. Rules may be empty and need no
// catch-all. `candidates` (encodings only) restricts the allocator's choice;
// empty: every encoding the calibration table has for the tag.
// Validation: budget_bits finite and in (0, 64]; calibration_model an id;
// at most kMaxPolicyRules candidates, each a valid encoding, no duplicates.
// A rule policy (budget_bits 0) must leave calibration_model and candidates
// empty.
//
// Encodings are canonical (CanonicalEncoding): group and scale dtype are only
// kept when K or V is an INT format, and group 0 is stored as 32. Equal
// canonical encodings are byte-identical pages.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr const char* kDefaultPolicy = "triaxial-static";
inline constexpr size_t kMaxPolicyRules = 64;
inline constexpr double kMaxBudgetBits = 64;

// One resolved rule: tag pattern + canonical encoding.
struct Rule {
  Temporal temporal = Temporal::kUnspecified;
  Role role = Role::kUnspecified;
  Modality modality = Modality::kUnspecified;
  Encoding encoding;

  bool Matches(const Tag& tag) const;
  bool IsCatchAll() const {
    return temporal == Temporal::kUnspecified && role == Role::kUnspecified &&
           modality == Modality::kUnspecified;
  }
};

// A validated policy. Immutable once built; sequences hold a shared_ptr to
// the version they were opened with.
struct Policy {
  std::string name;
  std::vector<Rule> rules;  // non-empty; the last is a catch-all
  bool builtin = false;
  // Allocation policies only (see above).
  double budget_bits = 0;
  std::string calibration_model;
  std::vector<Encoding> candidates;  // canonical, distinct
  double answer_weight = 0;          // finite, >= 0
  // What the allocator minimizes (PolicyInfo::objective).
  enum class Objective { kKl = 0, kDnll = 1 };
  Objective objective = Objective::kKl;

  bool IsAllocation() const { return budget_bits > 0; }
  // Rule policies: the encoding of the first matching rule.
  Encoding EncodingFor(const Tag& tag) const;
  // Allocation policies: true when `tag` is pinned to BF16 (see above).
  bool IsPinned(const Tag& tag) const;
  // Allocation policies: whether `e` may be chosen (candidates empty: any).
  bool IsCandidate(const Encoding& e) const;
  PolicyInfo Info() const;
};

// Group 0 -> 32; group and scale dtype reset when neither K nor V is INT.
Encoding CanonicalEncoding(Encoding e);

// Validates a wire encoding: format in FORMAT_BF16..FORMAT_TQ2, format_v
// unspecified (= format) or valid, group_size in {0, 32, 64, 128},
// scale_dtype in 0..2. INVALID_ARGUMENT naming `field` otherwise. Returns the
// canonical encoding.
absl::StatusOr<Encoding> ResolveEncoding(absl::string_view field,
                                         const EncodingSpec& spec);
// The wire form of a canonical encoding (format_v always set; group_size and
// scale_dtype set only when an INT format is involved).
EncodingSpec SpecOf(const Encoding& e);

// Validates a PutPolicy body: name is an id, 1..kMaxPolicyRules rules, tag
// fields in range, encodings valid (ResolveEncoding), the last rule a
// catch-all (allocation policies: 0..kMaxPolicyRules rules, no catch-all,
// plus the checks above). INVALID_ARGUMENT naming the field
// ("policy.rules[2].group_size") and the value. Does not check built-in names
// (the core does).
absl::StatusOr<std::shared_ptr<const Policy>> BuildPolicy(
    const PolicyInfo& info);

// "bf16", or e.g. "k=int4,v=int2,g=64,scale=fp8" (kernels::EncodingName).
std::string EncodingString(const Encoding& e);

// The built-in policies, in the order above. Built once; thread-safe.
const std::vector<std::shared_ptr<const Policy>>& BuiltinPolicies();
// A built-in policy by name, or null.
std::shared_ptr<const Policy> FindBuiltinPolicy(absl::string_view name);

}  // namespace triax::manager
