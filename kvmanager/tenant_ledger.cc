#include "kvmanager/tenant_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::manager {

absl::Status TenantLedger::ValidateBudget(const std::string& field,
                                          const Budget& b) {
  if (!IsValid(b.tier)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".tier is ", TierName(b.tier)));
  }
  if (b.ceiling_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".ceiling_bytes is 0; it must be > 0"));
  }
  if (b.floor_bytes > b.ceiling_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".floor_bytes ", b.floor_bytes,
                     " exceeds ceiling_bytes ", b.ceiling_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<TenantLedger::Budgets> TenantLedger::ValidateBudgets(
    const std::vector<Budget>& in) {
  Budgets budgets;
  for (size_t i = 0; i < in.size(); ++i) {
    const std::string field = absl::StrCat("budgets[", i, "]");
    TRIAX_RETURN_IF_ERROR(ValidateBudget(field, in[i]));
    const int tier = static_cast<int>(in[i].tier);
    if (budgets[tier]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".tier ", TierName(in[i].tier), " appears twice"));
    }
    budgets[tier] = in[i];
  }
  return budgets;
}

absl::StatusOr<TenantRecord*> TenantLedger::Create(
    const std::string& tenant_id, const Budgets& budgets,
    const std::string& default_policy) {
  if (tenants_.contains(tenant_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("tenant_id ", Quote(tenant_id), " already exists"));
  }
  auto t = std::make_unique<TenantRecord>();
  t->id = tenant_id;
  t->budgets = budgets;
  t->default_policy = default_policy;
  TenantRecord* out = t.get();
  tenants_.emplace(tenant_id, std::move(t));
  ids_.insert(tenant_id);
  return out;
}

absl::StatusOr<TenantRecord*> TenantLedger::Find(
    const std::string& tenant_id) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  auto it = tenants_.find(tenant_id);
  if (it == tenants_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tenant_id ", Quote(tenant_id), " is not a known tenant"));
  }
  return it->second.get();
}

TenantRecord* TenantLedger::FindOrNull(const std::string& tenant_id) const {
  auto it = tenants_.find(tenant_id);
  return it == tenants_.end() ? nullptr : it->second.get();
}

void TenantLedger::SetBudget(TenantRecord* t, const Budget& b) {
  t->budgets[static_cast<int>(b.tier)] = b;
}

absl::Status TenantLedger::Admit(const TenantRecord& t, uint64_t bytes) {
  const int tier = static_cast<int>(Tier::kDevice);
  if (!t.budgets[tier]) return absl::OkStatus();
  const uint64_t ceiling = t.budgets[tier]->ceiling_bytes;
  const uint64_t used = t.used[tier];
  if (used + bytes <= ceiling) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("tenant ", Quote(t.id), " tier TIER_DEVICE: request needs ",
                   bytes, " bytes, ", used, " of ceiling ", ceiling,
                   " in use; over by ", used + bytes - ceiling, " bytes"));
}

uint64_t TenantLedger::DeviceOverage(const TenantRecord& t) {
  const int dev = static_cast<int>(Tier::kDevice);
  if (!t.budgets[dev] || t.used[dev] <= t.budgets[dev]->ceiling_bytes) {
    return 0;
  }
  return t.used[dev] - t.budgets[dev]->ceiling_bytes;
}

TenantInfo TenantLedger::Info(const TenantRecord& t) {
  TenantInfo info;
  info.tenant_id = t.id;
  for (int tier = 1; tier < kNumTiers; ++tier) {
    if (t.budgets[tier]) info.budgets.push_back(*t.budgets[tier]);
    info.usage.push_back(TierUsage{static_cast<Tier>(tier), t.used[tier]});
  }
  info.open_sequences = t.open_sequences;
  info.default_policy = t.default_policy;
  info.prefix_salt = t.prefix_salt;
  return info;
}

std::vector<TenantInfo> TenantLedger::List() const {
  std::vector<TenantInfo> out;
  out.reserve(ids_.size());
  for (const std::string& id : ids_) out.push_back(Info(*tenants_.at(id)));
  return out;
}

Page<TenantInfo> TenantLedger::ListPage(const PageCursor& cursor) const {
  Page<TenantInfo> page;
  auto it = cursor.after() ? ids_.upper_bound(*cursor.after()) : ids_.begin();
  for (; it != ids_.end() && page.items.size() < cursor.size(); ++it) {
    page.items.push_back(Info(*tenants_.at(*it)));
  }
  if (it != ids_.end()) {
    page.next_page_token = cursor.NextToken(page.items.back().tenant_id);
  }
  return page;
}

absl::Status TenantLedger::AdmitSequence(const TenantRecord& t,
                                         uint32_t max_open) {
  if (max_open == 0 || t.open_sequences < max_open) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", t.id, " has ", t.open_sequences,
      " open sequences, the limit max_sequences_per_tenant = ", max_open,
      " (close some first)"));
}

}  // namespace triax::manager
