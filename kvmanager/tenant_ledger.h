// TenantLedger: the tenants, their budgets per tier (floor <= ceiling) and
// their usage per tier, and the admission check against the device ceiling.
// Usage itself is moved by whoever moves bytes (manager_state.h, "Byte
// accounting"); the ledger reads it.
//
// Admission: a request of `bytes` device bytes fits when used + bytes <=
// ceiling of TIER_DEVICE (no device budget: no limit); otherwise
// RESOURCE_EXHAUSTED, e.g. `tenant "acme" tier TIER_DEVICE: request needs
// 12288 bytes, 40960 of ceiling 49152 in use; over by 4096 bytes`.
//
// Error codes: INVALID_ARGUMENT (a bad id or budget, named), NOT_FOUND
// (unknown tenant), ALREADY_EXISTS (tenant id taken), RESOURCE_EXHAUSTED
// (admission).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held. The
// static Validate* functions are pure (run before the lock).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/paging.h"
#include "kvmanager/types.h"

namespace triax::manager {

class TenantLedger {
 public:
  using Budgets = std::array<std::optional<Budget>, kNumTiers>;
  using Map = absl::flat_hash_map<std::string, std::unique_ptr<TenantRecord>>;

  // tier valid, ceiling_bytes > 0, floor_bytes <= ceiling_bytes;
  // INVALID_ARGUMENT naming `field`.tier etc.
  static absl::Status ValidateBudget(const std::string& field, const Budget& b);
  // Every budget valid (named budgets[i]) and at most one per tier; returns
  // them by tier.
  static absl::StatusOr<Budgets> ValidateBudgets(
      const std::vector<Budget>& budgets);

  // ALREADY_EXISTS when the id is taken.
  absl::StatusOr<TenantRecord*> Create(const std::string& tenant_id,
                                       const Budgets& budgets,
                                       const std::string& default_policy);
  // INVALID_ARGUMENT for a malformed id, NOT_FOUND for an unknown one.
  absl::StatusOr<TenantRecord*> Find(const std::string& tenant_id) const;
  // nullptr when unknown.
  TenantRecord* FindOrNull(const std::string& tenant_id) const;
  // Replaces the budget of b.tier (b validated).
  static void SetBudget(TenantRecord* t, const Budget& b);

  // See "Admission" above.
  static absl::Status Admit(const TenantRecord& t, uint64_t bytes);
  // RESOURCE_EXHAUSTED naming the limit and the tenant when one more open
  // sequence would pass `max_open` (ManagerOptions::
  // max_sequences_per_tenant; 0: no limit).
  static absl::Status AdmitSequence(const TenantRecord& t, uint32_t max_open);
  // Above the device ceiling (after a lowered budget): by how many bytes;
  // 0 when within it or without a device budget.
  static uint64_t DeviceOverage(const TenantRecord& t);

  // Budgets of the tiers that have one, usage of every tier (DEVICE..DISK).
  static TenantInfo Info(const TenantRecord& t);
  // Ordered by id.
  std::vector<TenantInfo> List() const;
  // One page of List (paging.h; the cursor's key: the previous page's last
  // id). O(log tenants + page).
  Page<TenantInfo> ListPage(const PageCursor& cursor) const;
  // Every tenant, unordered (snapshots and inspection).
  const Map& all() const { return tenants_; }

 private:
  Map tenants_;
  absl::btree_set<std::string> ids_;  // the tenants' ids, for paging
};

}  // namespace triax::manager
