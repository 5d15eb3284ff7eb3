#include "kvmanager/reclaim_round.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace triax::manager {

std::string ReclaimReport::Summary() const {
  return absl::StrCat("freed ", bytes_freed, " bytes in ", stages,
                      stages == 1 ? " stage" : " stages", " (", demotions,
                      demotions == 1 ? " demotion, " : " demotions, ", spills,
                      spills == 1 ? " spill, " : " spills, ", evictions,
                      evictions == 1 ? " eviction)" : " evictions)");
}

void ReclaimReport::Add(const TierPlanOutcome& o) {
  ++stages;
  bytes_freed += o.device_bytes_freed;
  demotions += o.demotions;
  spills += o.spills;
  evictions += o.evictions;
  if (o.failed_commands > 0 && failed_commands == 0) {
    first_error = o.first_error.ToString();
  }
  failed_commands += o.failed_commands;
}

absl::Status ReclaimRound(ManagerCore* core, const absl::Status& refused,
                          AdmissionShortfall* shortfall, absl::Time deadline,
                          const TierPlanRunner& run, const ReclaimRetry& retry,
                          ReclaimReport* report) {
  *report = ReclaimReport{};
  absl::Status last = refused;
  // Blocks whose worker command failed: later stages plan around them.
  std::vector<uint64_t> failed;
  constexpr int kMaxRefusedStages = 3;
  int refused_stages = 0;
  while (true) {
    if (absl::Now() >= deadline) {
      report->stopped = "the reclaim deadline passed";
      break;
    }
    // An Open under the resume reserve is ranked without spills, so that
    // each block offers its cheapest demotion or eviction instead.
    core->RefreshRanking(/*spill_tiers=*/!shortfall->resume_reserve);
    shortfall->skip_lineage_ids = failed;
    const TierPlan plan = core->PlanAdmission(*shortfall);
    if (plan.token == 0) {
      // Room may have come meanwhile (the background loop, a close).
      last = retry(shortfall);
      if (last.ok() || !absl::IsResourceExhausted(last)) return last;
      report->stopped = absl::StrCat("nothing left to take; ",
                                     core->ExplainShortfall(*shortfall));
      if (!failed.empty()) {
        absl::StrAppend(&report->stopped, "; ", failed.size(),
                        " blocks left out after failed worker calls (first: ",
                        report->first_error, ")");
      }
      break;
    }
    const TierPlanOutcome outcome = run(plan);
    report->Add(outcome);
    last = retry(shortfall);
    if (last.ok() || !absl::IsResourceExhausted(last)) return last;
    failed.insert(failed.end(), outcome.failed_lineage_ids.begin(),
                  outcome.failed_lineage_ids.end());
    // A stage the worker refused for room (e.g. a full spill tier) is
    // planned again without its blocks, up to kMaxRefusedStages in a row;
    // any other stage that applied nothing ends the round.
    refused_stages = outcome.applied() == 0 ? refused_stages + 1 : 0;
    if (outcome.applied() == 0 &&
        (!absl::IsResourceExhausted(outcome.first_error) ||
         refused_stages >= kMaxRefusedStages)) {
      report->stopped =
          outcome.failed_commands > 0
              ? absl::StrCat("no action of the last stage was applied (",
                             outcome.failed_commands,
                             " worker calls failed, first: ",
                             outcome.first_error.ToString(), ")")
              : "no action of the last stage was applied (its blocks "
                "changed meanwhile)";
      break;
    }
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      last.message(), "; reclaim ", report->Summary(), "; still short by ",
      core->ShortBytes(*shortfall), " bytes: ", report->stopped));
}

absl::Status RestoreRound(ManagerCore* core, const std::string& sequence_id,
                          absl::Time deadline, const TierPlanRunner& run,
                          uint32_t* blocks, ReclaimReport* report) {
  *report = ReclaimReport{};
  // Restores what fits; what does not is the shortfall to reclaim for.
  auto restore = [&](AdmissionShortfall* sf) -> absl::Status {
    // A worker that refuses for room (RESOURCE_EXHAUSTED: the room the plan
    // counted on was stale) is planned for once more, in the room the runner
    // refreshed: what does not fit then is the shortfall to reclaim for.
    for (int attempt = 0;; ++attempt) {
      const TierPlan plan = core->PlanPrefetch(sequence_id, sf);
      for (const TierCommand& c : plan.commands) *blocks += c.blocks.size();
      const TierPlanOutcome out = run(plan);
      if (out.failed_commands == 0) break;
      if (attempt == 0 && absl::IsResourceExhausted(out.first_error)) continue;
      return absl::Status(
          out.first_error.code(),
          absl::StrCat("restore of sequence_id ", Quote(sequence_id),
                       " failed: ", out.first_error.message()));
    }
    if (sf->request_bytes == 0) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence_id ", Quote(sequence_id), ": ", sf->request_bytes,
        " bytes of spilled blocks do not fit on worker ",
        Quote(sf->worker_id)));
  };
  AdmissionShortfall shortfall;
  absl::Status first = restore(&shortfall);
  // A worker's refusal with no shortfall the manager can see has nothing to
  // reclaim for: it is the answer.
  if (!absl::IsResourceExhausted(first) || shortfall.request_bytes == 0) {
    return first;
  }
  return ReclaimRound(core, first, &shortfall, deadline, run, restore, report);
}

}  // namespace triax::manager
