#include "kvmanager/pending_transfers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::manager {

PendingTransfers::PendingTransfers(TenantLedger* tenants,
                                   WorkerRegistry* workers,
                                   uint64_t* next_token)
    : tenants_(tenants), workers_(workers), next_token_(next_token) {}

PendingTransfers::~PendingTransfers() = default;

absl::Status PendingTransfers::ValidateRequest(
    const TransferSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", req.sequence_id));
  if (!req.destination_worker_id.empty()) {
    TRIAX_RETURN_IF_ERROR(
        ValidateId("destination_worker_id", req.destination_worker_id));
  }
  if (!req.destination_policy.empty()) {
    TRIAX_RETURN_IF_ERROR(
        ValidateId("destination_policy", req.destination_policy));
  }
  if (req.first_block > 0 || !req.destination_prefix_sequence_id.empty()) {
    if (req.first_block == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination_prefix_sequence_id ",
          Quote(req.destination_prefix_sequence_id),
          " is named with first_block 0; a prefix hit names first_block > 0"));
    }
    if (req.destination_prefix_sequence_id.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "first_block ", req.first_block,
          " needs destination_prefix_sequence_id: the sequence on the "
          "destination that holds blocks [0, ",
          req.first_block, ")"));
    }
    TRIAX_RETURN_IF_ERROR(ValidateId("destination_prefix_sequence_id",
                                     req.destination_prefix_sequence_id));
    if (req.destination_prefix_sequence_id == req.sequence_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination_prefix_sequence_id ",
          Quote(req.destination_prefix_sequence_id),
          " is the sequence being transferred; name another sequence"));
    }
  }
  if (req.timeout_ms > kMaxTransferTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms ", req.timeout_ms, " is above the limit of ",
                     kMaxTransferTimeoutMs, " ms (0: the manager's default)"));
  }
  return absl::OkStatus();
}

absl::Status PendingTransfers::CheckNotInProgress(
    const std::string& tenant_id, const std::string& request_id) const {
  if (request_id.empty()) return absl::OkStatus();
  for (const auto& [token, p] : pending_) {
    if (p->tenant_id == tenant_id && p->request_id == request_id) {
      return absl::AbortedError(absl::StrCat(
          "TransferSequence request_id ", Quote(request_id), " (transfer ",
          p->transfer_id, ") is already in progress; retry later"));
    }
  }
  return absl::OkStatus();
}

PendingTransfers::Pending* PendingTransfers::Add(std::unique_ptr<Pending> p) {
  p->token = (*next_token_)++;
  p->transfer_id = absl::StrCat("xfer-", next_transfer_++);
  Pending* out = p.get();
  pending_.emplace(out->token, std::move(p));
  return out;
}

PendingTransfers::Pending* PendingTransfers::Find(uint64_t token) const {
  auto it = pending_.find(token);
  return it == pending_.end() ? nullptr : it->second.get();
}

std::optional<PendingTransfers::Pending> PendingTransfers::Release(
    uint64_t token) {
  auto it = pending_.find(token);
  if (it == pending_.end()) return std::nullopt;
  Pending p = std::move(*it->second);
  pending_.erase(it);
  if (p.reserved > 0) {
    if (TenantRecord* t = tenants_->FindOrNull(p.tenant_id)) {
      t->used[static_cast<int>(Tier::kDevice)] -= p.reserved;
    }
    if (WorkerRecord* w = workers_->Find(p.destination_id)) {
      w->reserved -= p.reserved;
    }
  }
  return p;
}

std::optional<PendingTransfers::Pending> PendingTransfers::Take(
    uint64_t token) {
  auto it = pending_.find(token);
  if (it == pending_.end()) return std::nullopt;
  Pending p = std::move(*it->second);
  pending_.erase(it);
  return p;
}

void PendingTransfers::WorkerLost(const std::string& worker_id,
                                  const std::string& reason) {
  for (auto& [token, p] : pending_) {
    if (!p->doomed.empty()) continue;
    if (p->source_id == worker_id) {
      p->doomed = absl::StrCat("source worker ", Quote(worker_id), " ", reason);
    } else if (p->destination_id == worker_id) {
      p->doomed =
          absl::StrCat("destination worker ", Quote(worker_id), " ", reason);
    }
  }
}

bool PendingTransfers::Importing(const std::string& worker_id,
                                 const std::string& sequence_id) const {
  for (const auto& [token, p] : pending_) {
    if (p->destination_id == worker_id && p->sequence_id == sequence_id) {
      return true;
    }
  }
  return false;
}

absl::Status CheckNotTransferring(const SequenceRecord& s) {
  if (s.transfer_id.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("sequence ", Quote(s.id), " is being transferred (transfer ",
                   s.transfer_id, " to worker ",
                   Quote(s.transfer_destination != nullptr
                             ? s.transfer_destination->info.worker_id
                             : ""),
                   "); retry after it ends"));
}

}  // namespace triax::manager
