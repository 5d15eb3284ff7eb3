// One reclaim round of an admission (OpenSequence / ExtendSequence refused
// RESOURCE_EXHAUSTED) or of a restore (ReportAccess active=true), on the
// manager core and with no gRPC: the caller runs each tier plan's worker
// calls.
//
// A round is a series of stages until the request fits or nothing is left
// to take. A stage ranks the blocks as they are now (RefreshRanking), plans
// what the shortfall needs (PlanAdmission: one action per block, the
// cheapest), applies the plan (the runner: worker calls, then
// FinishTierPlan) and retries the request. A block acted on in one stage is
// ranked again in the next with its new encoding or tier, so one round can
// take several actions on a block: demote it twice, then spill it (modes
// that only evict take one action per block, which frees all of it). The
// round stops when the retry succeeds or fails other than
// RESOURCE_EXHAUSTED, when a stage plans nothing (after one more retry:
// room may have come from elsewhere; then nothing is left to take), when no
// action of a stage was applied (its worker calls failed; when they failed
// RESOURCE_EXHAUSTED, e.g. a full spill tier, the next stages plan around
// those blocks, up to 3 such stages in a row), or at the deadline. An Open
// under the resume reserve (AdmissionShortfall::resume_reserve) is ranked
// without spill candidates: a spill makes no room for it, so its blocks offer
// their cheapest demotion or eviction instead.
//
// Thread contract: the functions take the core's mutex through its public
// methods; run them on one thread per core at a time (the service's
// pressure executor), since stages of two rounds would compete for the
// same blocks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

// What one round did.
struct ReclaimReport {
  uint32_t stages = 0;       // plans applied
  uint64_t bytes_freed = 0;  // device-pool bytes freed
  uint32_t demotions = 0;
  uint32_t spills = 0;
  uint32_t evictions = 0;
  uint32_t failed_commands = 0;  // worker calls that failed
  std::string first_error;       // the first of them
  // Why the round stopped without the request fitting (empty when it
  // fits): nothing left to take (with the blocks left by reason), the
  // deadline, or the worker calls failed.
  std::string stopped;
  // "freed B bytes in S stages (D demotions, P spills, E evictions)".
  std::string Summary() const;
  // Adds a stage's outcome.
  void Add(const TierPlanOutcome& o);
};

// Runs one tier plan's worker calls and finishes it
// (ManagerCore::FinishTierPlan); returns what was applied.
using TierPlanRunner = std::function<TierPlanOutcome(const TierPlan&)>;

// Retries the request after a stage: OK when it was admitted (the caller
// keeps its result), RESOURCE_EXHAUSTED with *shortfall refilled when it
// still does not fit, any other error to end the round.
using ReclaimRetry = std::function<absl::Status(AdmissionShortfall*)>;

// One round for `refused` (the request's RESOURCE_EXHAUSTED) and its
// *shortfall, until `deadline`. Returns OK when a retry admitted the
// request, a retry's other error as it is, else RESOURCE_EXHAUSTED with the
// last retry's message followed by "; reclaim <Summary>; still short by N
// bytes: <why it stopped>". *report (required) says what was done either
// way.
absl::Status ReclaimRound(ManagerCore* core, const absl::Status& refused,
                          AdmissionShortfall* shortfall, absl::Time deadline,
                          const TierPlanRunner& run, const ReclaimRetry& retry,
                          ReclaimReport* report);

// Brings back every spilled block of open sequence `sequence_id`
// (PlanPrefetch), and when they do not all fit runs one round that takes
// from other sequences (never this one) and retries the restore after each
// stage. *blocks (required) counts the restores planned. OK when every
// spilled block is back (or none was spilled), RESOURCE_EXHAUSTED as for
// ReclaimRound ("sequence_id "s": N bytes of spilled blocks do not fit on
// worker "w"; reclaim ...; still short by ..."), or the first worker error
// of a restore with its code.
absl::Status RestoreRound(ManagerCore* core, const std::string& sequence_id,
                          absl::Time deadline, const TierPlanRunner& run,
                          uint32_t* blocks, ReclaimReport* report);

}  // namespace triax::manager
