#include "kvmanager/pending_demotes.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/policy.h"
#include "kvmanager/sequence_planner.h"

namespace triax::manager {

struct PendingDemotes::Pending {
  std::string tenant_id;
  std::string request_id;
  uint64_t fingerprint = 0;  // of the request (DemoteBlocks or Extend)
  std::string sequence_id;
  uint64_t version = 0;  // the sequence's version at prepare
  std::string worker_id;
  // lineage id -> new canonical encoding and its bytes (changing blocks only)
  std::vector<std::pair<uint64_t, Encoding>> changes;
  std::vector<uint64_t> new_bytes;
  int64_t bytes_delta = 0;
  uint64_t reserved = 0;  // max(bytes_delta, 0), charged at prepare
  // Set when the demote was started by an Extend (FinishExtendDemotion).
  bool from_extend = false;
  std::string extend_request_id;
  ExtendSequenceResult extend_result;  // the reply without demoted blocks
};

PendingDemotes::PendingDemotes(const Clock* clock, WorkerRegistry* workers,
                               TenantLedger* tenants, SequenceTable* sequences,
                               uint64_t* next_token)
    : clock_(clock),
      workers_(workers),
      tenants_(tenants),
      sequences_(sequences),
      next_token_(next_token) {}

PendingDemotes::~PendingDemotes() = default;

absl::StatusOr<std::vector<Encoding>> PendingDemotes::ValidateRequest(
    const DemoteBlocksRequest& req) {
  if (req.blocks.empty()) {
    return absl::InvalidArgumentError(
        "blocks is empty; name at least one block to re-encode");
  }
  if (req.blocks.size() > kMaxSequenceBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks has ", req.blocks.size(),
                     " entries; the limit is ", kMaxSequenceBlocks));
  }
  std::vector<Encoding> encodings;
  encodings.reserve(req.blocks.size());
  absl::flat_hash_set<uint64_t> seen;
  for (size_t i = 0; i < req.blocks.size(); ++i) {
    const std::string field = absl::StrCat("blocks[", i, "]");
    const uint64_t lineage = req.blocks[i].lineage_id;
    if (lineage == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".lineage_id is 0; lineage ids start at 1"));
    }
    if (!seen.insert(lineage).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".lineage_id ", lineage, " appears more than once"));
    }
    TRIAX_ASSIGN_OR_RETURN(Encoding e,
                           ResolveEncoding(field, req.blocks[i].encoding));
    encodings.push_back(e);
  }
  return encodings;
}

absl::Status PendingDemotes::CheckDemoteNotInProgress(
    const std::string& tenant_id, const std::string& request_id) const {
  if (request_id.empty()) return absl::OkStatus();
  for (const auto& [token, p] : pending_) {
    if (p->tenant_id == tenant_id && p->request_id == request_id) {
      return absl::AbortedError(
          absl::StrCat("DemoteBlocks request_id ", Quote(request_id),
                       " is already in progress; retry later"));
    }
  }
  return absl::OkStatus();
}

absl::Status PendingDemotes::CheckExtendNotInProgress(
    const std::string& tenant_id, const std::string& request_id) const {
  if (request_id.empty()) return absl::OkStatus();
  for (const auto& [token, p] : pending_) {
    if (p->from_extend && p->tenant_id == tenant_id &&
        p->extend_request_id == request_id) {
      return absl::AbortedError(absl::StrCat(
          "ExtendSequence request_id ", Quote(request_id),
          " is already in progress (demoting blocks); retry later"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DemotePrepared> PendingDemotes::Prepare(
    const DemoteBlocksRequest& req, const std::vector<Encoding>& encodings,
    SequenceRecord* s) {
  const kernels::PageShape shape = PageShapeOf(s->model, s->block_tokens);
  auto pending = std::make_unique<Pending>();
  DemotePrepared prepared;
  int64_t delta = 0;
  for (size_t i = 0; i < req.blocks.size(); ++i) {
    const uint64_t lineage = req.blocks[i].lineage_id;
    BlockRecord* b = sequences_->BlockOf(*s, lineage);
    if (b == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("blocks[", i, "].lineage_id ", lineage,
                       " is not a block of sequence_id ", Quote(s->id)));
    }
    if (b->refcount > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "].lineage_id ", lineage, " is shared with a fork (",
          b->refcount, " sequences); shared blocks are immutable"));
    }
    if (b->evicted || b->tier != Tier::kDevice) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "].lineage_id ", lineage, " is ",
          b->evicted ? "evicted"
                     : absl::StrCat("spilled to ", TierName(b->tier)),
          "; only blocks in the device pool can be demoted"));
    }
    if (b->busy != 0) {
      return absl::AbortedError(
          absl::StrCat("blocks[", i, "].lineage_id ", lineage,
                       " is being moved by the pressure manager; retry"));
    }
    const Encoding& e = encodings[i];
    if (const char* why = kernels::ValidateEncoding(e, shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks[", i, "] encoding ", EncodingString(e),
          " is invalid for block_tokens ", s->block_tokens, ", n_kv_heads ",
          s->model.n_kv_heads, ", head_dim ", s->model.head_dim, ": ", why));
    }
    if (e == b->encoding) continue;  // already there: nothing to do
    const uint64_t bytes = BlockBytes(s->model, s->block_tokens, e);
    delta += static_cast<int64_t>(bytes) - static_cast<int64_t>(b->bytes);
    pending->changes.emplace_back(lineage, e);
    pending->new_bytes.push_back(bytes);
    BlockPlan plan = PlanOf(*b);
    plan.encoding = e;
    prepared.blocks.push_back(plan);
  }
  if (delta > 0) {
    TRIAX_RETURN_IF_ERROR(
        TenantLedger::Admit(*s->tenant, static_cast<uint64_t>(delta)));
    TRIAX_RETURN_IF_ERROR(
        WorkerRegistry::Fits(*s->worker, static_cast<uint64_t>(delta)));
    s->tenant->used[static_cast<int>(Tier::kDevice)] += delta;
    s->worker->Reserve(static_cast<uint64_t>(delta));
    pending->reserved = static_cast<uint64_t>(delta);
  }
  const uint64_t token = (*next_token_)++;
  pending->tenant_id = req.tenant_id;
  pending->request_id = req.request_id;
  pending->fingerprint = req.fingerprint;
  pending->sequence_id = s->id;
  pending->version = s->version;
  pending->worker_id = s->worker->info.worker_id;
  pending->bytes_delta = delta;
  pending_.emplace(token, std::move(pending));
  AddInDoubt(s, +1);

  prepared.token = token;
  prepared.worker_id = s->worker->info.worker_id;
  prepared.worker_address = s->worker->info.address;
  prepared.worker_request_id =
      req.request_id.empty() ? absl::StrCat("demote-", token) : req.request_id;
  prepared.tenant_id = req.tenant_id;
  prepared.sequence_id = s->id;
  prepared.bytes_delta = delta;
  return prepared;
}

std::optional<DemotePrepared> PendingDemotes::PrepareAging(
    SequenceRecord* s, size_t old_blocks, const std::string& tenant_id,
    const std::string& extend_request_id, uint64_t extend_fingerprint,
    const ExtendSequenceResult& result) {
  auto pending = std::make_unique<Pending>();
  DemotePrepared prepared;
  for (size_t i = 0; i < old_blocks; ++i) {
    BlockRecord* b = s->blocks[i];
    // Shared blocks are immutable; spilled, evicted or busy ones are left
    // to the pressure path.
    if (b->refcount > 1 || b->tier != Tier::kDevice || b->evicted ||
        b->busy != 0) {
      continue;
    }
    const Encoding e = SequencePlanner::EncodingOf(*s, b->tag);
    if (e == b->encoding) continue;
    const uint64_t nb = BlockBytes(s->model, s->block_tokens, e);
    if (nb >= b->bytes) continue;  // never promoted
    pending->changes.emplace_back(b->lineage_id, e);
    pending->new_bytes.push_back(nb);
    pending->bytes_delta +=
        static_cast<int64_t>(nb) - static_cast<int64_t>(b->bytes);
    BlockPlan plan = PlanOf(*b);
    plan.encoding = e;
    prepared.blocks.push_back(plan);
  }
  if (pending->changes.empty()) return std::nullopt;
  const uint64_t token = (*next_token_)++;
  pending->tenant_id = tenant_id;
  pending->sequence_id = s->id;
  pending->version = s->version;
  pending->worker_id = s->worker->info.worker_id;
  pending->from_extend = true;
  pending->extend_request_id = extend_request_id;
  pending->fingerprint = extend_fingerprint;
  pending->extend_result = result;
  prepared.token = token;
  prepared.worker_id = s->worker->info.worker_id;
  prepared.worker_address = s->worker->info.address;
  prepared.worker_request_id =
      absl::StrCat(s->id, "-v", s->version, "-extend-demote-", token);
  prepared.tenant_id = tenant_id;
  prepared.sequence_id = s->id;
  prepared.bytes_delta = pending->bytes_delta;
  pending_.emplace(token, std::move(pending));
  AddInDoubt(s, +1);
  return prepared;
}

absl::StatusOr<PendingDemotes::Committed> PendingDemotes::Commit(
    uint64_t token, std::vector<Event>* ev) {
  auto it = pending_.find(token);
  if (it == pending_.end()) {
    return absl::NotFoundError(
        absl::StrCat("demote token ", token, " is not pending"));
  }
  const Pending& p = *it->second;
  SequenceRecord* s = sequences_->Find(p.sequence_id);
  if (s == nullptr || s->state != SequenceState::kOpen ||
      s->version != p.version) {
    const std::string id = p.sequence_id;
    Release(token);
    return absl::AbortedError(absl::StrCat(
        "sequence_id ", Quote(id),
        " changed while its blocks were re-encoded; the plan is unchanged "
        "(the worker may already hold the new encodings): call DemoteBlocks "
        "again with a new request_id"));
  }
  ev->reserve(ev->size() + p.changes.size());
  for (size_t i = 0; i < p.changes.size(); ++i) {
    BlockRecord* b = sequences_->FindBlock(p.changes[i].first);
    const Encoding from = b->encoding;
    const uint64_t from_bytes = b->bytes;
    b->encoding = p.changes[i].second;
    b->bytes = p.new_bytes[i];
    s->bytes = s->bytes - from_bytes + b->bytes;
    Event e = MakeEvent(*clock_, EventKind::kBlockDemoted, s, b);
    e.detail = absl::StrCat("index=", b->index, " from=", EncodingString(from),
                            " to=", EncodingString(b->encoding),
                            " bytes_from=", from_bytes, " bytes_to=", b->bytes);
    ev->push_back(std::move(e));
  }
  // Growth was charged at prepare; shrinkage is released now.
  if (p.bytes_delta < 0) {
    const uint64_t freed = static_cast<uint64_t>(-p.bytes_delta);
    s->tenant->used[static_cast<int>(Tier::kDevice)] -= freed;
    s->worker->reserved -= freed;
  }
  Touch(s);
  AddInDoubt(s, -1);
  Committed out;
  out.result.sequence = SequenceTable::Info(*s, /*with_blocks=*/true);
  out.result.bytes_delta = p.bytes_delta;
  out.tenant_id = p.tenant_id;
  out.request_id = p.request_id;
  out.fingerprint = p.fingerprint;
  pending_.erase(it);
  return out;
}

void PendingDemotes::Release(uint64_t token) {
  auto it = pending_.find(token);
  if (it == pending_.end()) return;
  const Pending& p = *it->second;
  if (SequenceRecord* s = sequences_->Find(p.sequence_id)) AddInDoubt(s, -1);
  if (p.reserved > 0) {
    if (TenantRecord* t = tenants_->FindOrNull(p.tenant_id)) {
      t->used[static_cast<int>(Tier::kDevice)] -= p.reserved;
    }
    if (WorkerRecord* w = workers_->Find(p.worker_id)) {
      w->reserved -= p.reserved;
    }
  }
  pending_.erase(it);
}

absl::StatusOr<PendingDemotes::ExtendDemotion> PendingDemotes::TakeExtend(
    uint64_t token) {
  auto it = pending_.find(token);
  if (it == pending_.end() || !it->second->from_extend) {
    return absl::NotFoundError(
        absl::StrCat("extend demotion token ", token, " is not pending"));
  }
  Pending& p = *it->second;
  ExtendDemotion d;
  d.result = std::move(p.extend_result);
  d.tenant_id = p.tenant_id;
  d.request_id = p.extend_request_id;
  d.fingerprint = p.fingerprint;
  d.sequence_id = p.sequence_id;
  d.lineages.reserve(p.changes.size());
  for (const auto& [lineage, e] : p.changes) d.lineages.push_back(lineage);
  return d;
}

}  // namespace triax::manager
