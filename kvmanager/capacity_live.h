// The capacity planner's inputs read from a live manager (docs/capacity.md
// "The live plan on the dashboard"): the tag mix of the open sequences' blocks,
// the tenants with their device budgets, and, for the dashboard's live
// plan (GET /api/plan; docs/dashboard.md), a whole CapacityRequest for the
// fleet as it stands.
//
// Cost: LiveTagMix and LivePlanRequest visit every block of every open
// sequence (one GetSequence each, the core's mutex taken per sequence);
// LiveTenants is O(tenants).
//
// Thread contract: thread-safe (the core's public calls only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvmanager/capacity.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

// Tokens per tag of the blocks of every open sequence (evicted blocks hold
// nothing; UNSPECIFIED modality is TEXT), tags in the order of their values.
std::vector<TagTokens> LiveTagMix(const ManagerCore& core);

// Every tenant with its device floor and ceiling (0 / 0 without a budget).
std::vector<CapacityTenant> LiveTenants(const ManagerCore& core);

// The fleet as it stands, planned: the model shape and block size of the
// open sequences that hold the most tokens; memory per GPU the UP workers'
// mean device pool (their capacity is the KV pool, so no reserve and a
// ceiling of 1), one GPU per UP worker, their mean host and disk tiers;
// rows bf16, fp8, int4 and every policy those sequences use (policy=NAME;
// an allocation policy with its stored calibration table, only the first
// table when they differ); the live tenants and tag mix; one context
// length, the sequences' mean tokens (rounded up).
struct LivePlanInput {
  CapacityRequest request;
  uint32_t open_sequences = 0;  // of the planned model and block size
  uint64_t open_tokens = 0;
  std::vector<std::string> notes;  // what was left out, and why
};
// FAILED_PRECONDITION when no worker is UP or no sequence is open
// (nothing to plan from).
absl::StatusOr<LivePlanInput> LivePlanRequest(const ManagerCore& core);

}  // namespace triax::manager
