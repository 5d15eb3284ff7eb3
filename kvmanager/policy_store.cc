#include "kvmanager/policy_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "kvmanager/manager_state.h"

namespace triax::manager {

absl::StatusOr<std::shared_ptr<const Policy>> PolicyStore::Find(
    absl::string_view field, absl::string_view name) const {
  if (auto p = FindBuiltinPolicy(name)) return p;
  auto it = policies_.find(name);
  if (it != policies_.end()) return it->second;
  std::vector<std::string> known;
  for (const auto& p : BuiltinPolicies()) known.push_back(p->name);
  std::vector<std::string> ops;
  for (const auto& [n, p] : policies_) ops.push_back(n);
  std::sort(ops.begin(), ops.end());
  known.insert(known.end(), ops.begin(), ops.end());
  return absl::InvalidArgumentError(absl::StrCat(
      field, " ", Quote(name),
      " is not a known policy; known: ", absl::StrJoin(known, ", ")));
}

absl::Status PolicyStore::Put(std::shared_ptr<const Policy> policy) {
  if (FindBuiltinPolicy(policy->name) != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy.name ", Quote(policy->name),
                     " is a built-in policy; built-in policies cannot be "
                     "replaced"));
  }
  if (!policies_.contains(policy->name) &&
      policies_.size() >= kMaxOperatorPolicies) {
    return absl::ResourceExhaustedError(
        absl::StrCat("policy.name ", Quote(policy->name),
                     " would be operator policy number ", policies_.size() + 1,
                     "; the limit is ", kMaxOperatorPolicies, "; over by 1"));
  }
  const std::string name = policy->name;
  policies_[name] = std::move(policy);
  return absl::OkStatus();
}

std::vector<PolicyInfo> PolicyStore::ListOperator() const {
  std::vector<PolicyInfo> ops;
  ops.reserve(policies_.size());
  for (const auto& [name, p] : policies_) ops.push_back(p->Info());
  return ops;
}

std::vector<PolicyInfo> PolicyStore::ListOperator(const std::string* after,
                                                  size_t max,
                                                  bool* more) const {
  std::vector<PolicyInfo> ops;
  auto it =
      after != nullptr ? policies_.upper_bound(*after) : policies_.begin();
  for (; it != policies_.end() && ops.size() < max; ++it) {
    ops.push_back(it->second->Info());
  }
  *more = it != policies_.end();
  return ops;
}

absl::Status CheckPolicyForShape(const Policy& p, const ModelShape& m,
                                 uint32_t block_tokens) {
  const kernels::PageShape shape = PageShapeOf(m, block_tokens);
  for (size_t i = 0; i < p.candidates.size(); ++i) {
    const char* why = kernels::ValidateEncoding(p.candidates[i], shape);
    if (why == nullptr) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "policy ", Quote(p.name), " candidates[", i, "] encoding ",
        EncodingString(p.candidates[i]), " is invalid for block_tokens ",
        block_tokens, ", n_kv_heads ", m.n_kv_heads, ", head_dim ", m.head_dim,
        ": ", why));
  }
  for (size_t i = 0; i < p.rules.size(); ++i) {
    const char* why = kernels::ValidateEncoding(p.rules[i].encoding, shape);
    if (why == nullptr) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "policy ", Quote(p.name), " rules[", i, "] encoding ",
        EncodingString(p.rules[i].encoding), " is invalid for block_tokens ",
        block_tokens, ", n_kv_heads ", m.n_kv_heads, ", head_dim ", m.head_dim,
        ": ", why));
  }
  return absl::OkStatus();
}

}  // namespace triax::manager
