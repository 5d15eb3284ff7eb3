// ManagerCore's policies (PutPolicy, ListPolicies), DemoteBlocks (two-phase)
// and calibration tables (manager_core.h).
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

// --- Policies ----------------------------------------------------------------

absl::StatusOr<PolicyInfo> ManagerCore::PutPolicy(const PutPolicyRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const Policy> policy,
                         BuildPolicy(req.policy));
  JournaledLock lock(this);
  TRIAX_ASSIGN_OR_RETURN(auto hit,
                         policy_cache_.Lookup("PutPolicy", req.request_id,
                                              req.fingerprint, "PutPolicy"));
  if (hit) {
    return hit->reply;
  }
  PolicyInfo info = policy->Info();
  TRIAX_RETURN_IF_ERROR(policies_.Put(std::move(policy)));
  if (changes_.enabled) changes_.operator_policies.insert(info.name);
  policy_cache_.Put("PutPolicy", req.request_id, req.fingerprint,
                    absl::OkStatus(), info);
  return info;
}

std::vector<PolicyInfo> ManagerCore::ListPolicies() const {
  std::vector<PolicyInfo> out;
  for (const auto& p : BuiltinPolicies()) out.push_back(p->Info());
  absl::MutexLock lock(&mu_);
  std::vector<PolicyInfo> ops = policies_.ListOperator();
  out.insert(out.end(), ops.begin(), ops.end());
  return out;
}

// --- DemoteBlocks ------------------------------------------------------------

absl::StatusOr<DemotePrepared> ManagerCore::PrepareDemote(
    const DemoteBlocksRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_ASSIGN_OR_RETURN(const std::vector<Encoding> encodings,
                         PendingDemotes::ValidateRequest(req));
  JournaledLock lock(this);
  const std::string cache_key = absl::StrCat("DemoteBlocks/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, demote_cache_.Lookup(cache_key, req.request_id, req.fingerprint,
                                     "DemoteBlocks"));
  if (hit) {
    DemotePrepared done;
    done.done = hit->reply;
    return done;
  }
  TRIAX_RETURN_IF_ERROR(
      demotes_.CheckDemoteNotInProgress(req.tenant_id, req.request_id));
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  return demotes_.Prepare(req, encodings, s);
}

absl::StatusOr<DemoteBlocksResult> ManagerCore::CommitDemoteLocked(
    uint64_t token) {
  std::vector<Event> ev;
  TRIAX_ASSIGN_OR_RETURN(PendingDemotes::Committed c,
                         demotes_.Commit(token, &ev));
  events_.Append(&ev);
  demote_cache_.Put(absl::StrCat("DemoteBlocks/", c.tenant_id), c.request_id,
                    c.fingerprint, absl::OkStatus(), c.result);
  return std::move(c.result);
}

void ManagerCore::AbortDemote(uint64_t token) {
  JournaledLock lock(this);
  demotes_.Release(token);
}

absl::StatusOr<DemoteBlocksResult> ManagerCore::CommitDemote(uint64_t token) {
  JournaledLock lock(this);
  return CommitDemoteLocked(token);
}

absl::StatusOr<ExtendSequenceResult> ManagerCore::FinishExtendDemotion(
    uint64_t token, const absl::Status& worker_status) {
  JournaledLock lock(this);
  TRIAX_ASSIGN_OR_RETURN(PendingDemotes::ExtendDemotion d,
                         demotes_.TakeExtend(token));
  ExtendSequenceResult result = std::move(d.result);
  absl::Status outcome = worker_status;
  if (outcome.ok()) {
    auto committed = CommitDemoteLocked(token);
    if (committed.ok()) {
      result.sequence = std::move(committed->sequence);
      for (uint64_t lineage : d.lineages) {
        result.demoted_blocks.push_back(PlanOf(*sequences_.FindBlock(lineage)));
      }
      Log(LogLevel::kInfo, "manager", "blocks demoted by the allocation",
          absl::StrCat(Kv("sequence_id", d.sequence_id), " ",
                       Kv("blocks", d.lineages.size()), " ",
                       Kv("bytes_delta", committed->bytes_delta)));
    } else {
      outcome = committed.status();
    }
  } else {
    demotes_.Release(token);
  }
  if (!outcome.ok()) {
    // The extension stands; the blocks keep their encoding (the next Extend
    // tries again).
    Log(LogLevel::kWarn, "manager",
        "allocation demotion not applied; blocks keep their encoding",
        absl::StrCat(Kv("sequence_id", d.sequence_id), " ",
                     Kv("blocks", d.lineages.size()), " ",
                     Kv("error", outcome.ToString())));
    const SequenceRecord* s = sequences_.Find(d.sequence_id);
    if (s != nullptr && s->state == SequenceState::kOpen) {
      result.sequence = SequenceTable::Info(*s, /*with_blocks=*/true);
    }
  }
  extend_cache_.Put(absl::StrCat("ExtendSequence/", d.tenant_id), d.request_id,
                    d.fingerprint, absl::OkStatus(), result);
  return result;
}

// --- Calibration -------------------------------------------------------------

absl::StatusOr<uint32_t> ManagerCore::PutCalibration(
    const PutCalibrationRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const CalibrationTable> table,
                         CalibrationStore::Build(req.table));
  JournaledLock lock(this);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, calibration_cache_.Lookup("PutCalibration", req.request_id,
                                          req.fingerprint, "PutCalibration"));
  if (hit) {
    return hit->reply;
  }
  const std::string model = table->info.model;
  TRIAX_ASSIGN_OR_RETURN(const uint32_t n, calibrations_.Put(std::move(table)));
  if (changes_.enabled) changes_.calibrations.insert(model);
  calibration_cache_.Put("PutCalibration", req.request_id, req.fingerprint,
                         absl::OkStatus(), n);
  return n;
}

absl::StatusOr<CalibrationTableInfo> ManagerCore::GetCalibration(
    const std::string& model) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("model", model));
  absl::MutexLock lock(&mu_);
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const CalibrationTable> table,
                         calibrations_.Get(model));
  return table->info;
}

}  // namespace triax::manager
