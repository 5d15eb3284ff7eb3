// PolicyStore: operator policies (PutPolicy) by name, beside the built-in
// ones (policy.h BuiltinPolicies), and the check of a policy against the
// page shape of a sequence.
//
// A stored policy is immutable (shared_ptr<const Policy>); replacing one
// stores a new version, and sequences keep the version they were opened
// with.
//
// Error codes: INVALID_ARGUMENT (unknown policy name: the message lists the
// known ones; an encoding invalid for the shape), FAILED_PRECONDITION (a
// built-in name cannot be replaced), RESOURCE_EXHAUSTED (past
// kMaxOperatorPolicies).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held.
// CheckPolicyForShape is pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmanager/policy.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr size_t kMaxOperatorPolicies = 1024;

class PolicyStore {
 public:
  // Built-in first, then operator policies. INVALID_ARGUMENT naming `field`
  // and `name`, listing the known names (built-ins in their order, then
  // operator policies by name).
  absl::StatusOr<std::shared_ptr<const Policy>> Find(
      absl::string_view field, absl::string_view name) const;
  // Adds or replaces an operator policy (built by BuildPolicy).
  absl::Status Put(std::shared_ptr<const Policy> policy);
  // Operator policies, ordered by name.
  std::vector<PolicyInfo> ListOperator() const;
  // At most `max` operator policies named after `after` (nullptr: from the
  // first), ordered by name; *more: whether others follow.
  // O(log policies + max).
  std::vector<PolicyInfo> ListOperator(const std::string* after, size_t max,
                                       bool* more) const;
  size_t size() const { return policies_.size(); }
  // Operator policies by name (snapshots).
  const absl::btree_map<std::string, std::shared_ptr<const Policy>>& all()
      const {
    return policies_;
  }

 private:
  // Ordered by name: ListOperator pages through it.
  absl::btree_map<std::string, std::shared_ptr<const Policy>> policies_;
};

// Every candidate's and every rule's encoding must be valid for the page
// shape {block_tokens, n_kv_heads, head_dim} (kernels::ValidateEncoding);
// INVALID_ARGUMENT naming the policy, the rule or candidate and the reason.
absl::Status CheckPolicyForShape(const Policy& p, const ModelShape& m,
                                 uint32_t block_tokens);

}  // namespace triax::manager
