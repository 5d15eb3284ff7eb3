// ManagerCore's TransferSequence phases (manager_core.h "TransferSequence";
// the pending state and its reservation are in pending_transfers.h).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

namespace {

// The destination encoding of a block of tag `tag` under `policy` (and its
// allocation when it is an allocation policy; BF16 for a tag it lacks, as
// SequencePlanner::EncodingOf).
Encoding DestinationEncoding(const Policy& policy,
                             const TagAllocation& allocation, const Tag& tag) {
  if (!policy.IsAllocation()) return policy.EncodingFor(tag);
  for (const auto& [t, e] : allocation) {
    if (t == tag) return e;
  }
  return Encoding(Format::kBF16);
}

// A transfer event: worker_id the destination, source_worker_id the source.
Event TransferEvent(const Clock& clock, EventKind kind, const SequenceRecord* s,
                    const BlockRecord* b, const std::string& source,
                    const std::string& destination) {
  Event e = MakeEvent(clock, kind, s, b);
  e.worker_id = destination;
  e.source_worker_id = source;
  return e;
}

}  // namespace

absl::StatusOr<WorkerRecord*> ManagerCore::TransferDestinationLocked(
    const SequenceRecord& s, const std::string& named, uint64_t bytes,
    const Demand& demand) const {
  const std::string& source = s.worker->info.worker_id;
  if (!named.empty()) {
    if (named == source) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination_worker_id ", Quote(named), " is the worker sequence ",
          Quote(s.id), " is on already; name another worker"));
    }
    WorkerRecord* w = workers_.Find(named);
    if (w == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "destination_worker_id ", Quote(named), " is not a known worker"));
    }
    if (w->info.state != WorkerState::kUp) {
      return absl::UnavailableError(absl::StrCat(
          "destination worker ", Quote(named), " is ",
          w->info.state == WorkerState::kSuspect ? "suspect" : "down",
          "; transfers go to UP workers"));
    }
    if (!w->info.inventory.device_error.empty()) {
      return absl::UnavailableError(absl::StrCat(
          "destination worker ", Quote(named),
          " reports a device error: ", w->info.inventory.device_error));
    }
    TRIAX_RETURN_IF_ERROR(TransferAdmitsLocked(s, *w, bytes, demand));
    return w;
  }
  // Placement among the others, as WorkerRegistry::Place: most room, ties
  // to the smaller id.
  WorkerRecord* best = nullptr;
  uint64_t best_room = 0;
  size_t candidates = 0;
  std::string refused;
  for (const auto& [id, rec] : workers_.all()) {
    WorkerRecord* w = rec.get();
    if (id == source || w->info.state != WorkerState::kUp ||
        !w->info.inventory.device_error.empty()) {
      continue;
    }
    ++candidates;
    absl::Status fits = TransferAdmitsLocked(s, *w, bytes, demand);
    if (!fits.ok()) {
      if (refused.empty()) refused = std::string(fits.message());
      continue;
    }
    const uint64_t room = WorkerRegistry::RoomBytes(*w);
    if (best == nullptr || room > best_room ||
        (room == best_room && id < best->info.worker_id)) {
      best = w;
      best_room = room;
    }
  }
  if (best != nullptr) return best;
  if (candidates == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no UP worker with a healthy device besides the source ", Quote(source),
        " to transfer sequence ", Quote(s.id), " to"));
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("no worker besides the source ", Quote(source),
                   " has room for the ", bytes, " bytes of sequence ",
                   Quote(s.id), " (", candidates, " UP; e.g. ", refused, ")"));
}

absl::Status ManagerCore::TransferAdmitsLocked(const SequenceRecord& s,
                                               const WorkerRecord& w,
                                               uint64_t bytes,
                                               const Demand& demand) const {
  const std::string prefix =
      absl::StrCat("destination worker ", Quote(w.info.worker_id), ": ");
  absl::Status fits = WorkerRegistry::Fits(w, bytes, demand);
  if (!fits.ok()) {
    return absl::Status(fits.code(), absl::StrCat(prefix, fits.message()));
  }
  if (!options_.resume_reserve) return absl::OkStatus();
  // The sequence's own spilled blocks are restored onto the destination by
  // the transfer (their bytes are in `bytes`): not held a second time.
  uint64_t returning = 0;
  for (const BlockRecord* b : s.blocks) {
    if (!b->evicted && b->tier != Tier::kDevice) returning += b->bytes;
  }
  absl::Status reserve =
      CheckResumeReserveLocked(*s.tenant, w, bytes, nullptr, returning);
  if (!reserve.ok()) {
    return absl::Status(
        reserve.code(),
        absl::StrCat(prefix, "transfer of sequence ", Quote(s.id),
                     " refused by the resume reserve (as an Open there): ",
                     reserve.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<const SequenceRecord*> ManagerCore::TransferPrefixLocked(
    const TransferSequenceRequest& req, const SequenceRecord& s) const {
  const uint32_t k = req.first_block;
  if (k > s.blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_block ", k, " is past the ", s.blocks.size(),
                     " blocks of sequence ", Quote(s.id)));
  }
  if (k == 0) return nullptr;
  // Open, the tenant's, not being transferred itself.
  TRIAX_ASSIGN_OR_RETURN(
      const SequenceRecord* prefix,
      FindOpenSequenceLocked(req.tenant_id, "destination_prefix_sequence_id",
                             req.destination_prefix_sequence_id));
  const std::string& there = prefix->worker->info.worker_id;
  if (prefix->worker == s.worker) {
    return absl::FailedPreconditionError(absl::StrCat(
        "destination_prefix_sequence_id ", Quote(prefix->id), " is on worker ",
        Quote(there), ", the source of sequence ", Quote(s.id),
        "; a prefix hit shares blocks on the destination"));
  }
  if (!req.destination_worker_id.empty() &&
      req.destination_worker_id != there) {
    return absl::FailedPreconditionError(absl::StrCat(
        "destination_worker_id ", Quote(req.destination_worker_id),
        " is not worker ", Quote(there), " of destination_prefix_sequence_id ",
        Quote(prefix->id), "; a prefix hit goes to the prefix's worker"));
  }
  if (prefix->blocks.size() < k) {
    return absl::FailedPreconditionError(absl::StrCat(
        "destination_prefix_sequence_id ", Quote(prefix->id), " has ",
        prefix->blocks.size(), " blocks, fewer than first_block ", k));
  }
  for (uint32_t i = 0; i < k; ++i) {
    const BlockRecord* b = s.blocks[i];
    const BlockRecord* pb = prefix->blocks[i];
    if (b != pb) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", i, ": lineage ", b->lineage_id, " of sequence ",
          Quote(s.id), " differs from lineage ", pb->lineage_id,
          " of destination_prefix_sequence_id ", Quote(prefix->id),
          "; blocks [0, first_block ", k, ") must be the same blocks"));
    }
    if (b->num_tokens != s.block_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", i, " (lineage ", b->lineage_id, ") holds ", b->num_tokens,
          " of ", s.block_tokens, " tokens; only full blocks are shared"));
    }
    if (b->evicted || b->tier != Tier::kDevice) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", i, " (lineage ", b->lineage_id, ") is ",
                       b->evicted ? "evicted" : "spilled",
                       "; only blocks on the device are shared"));
    }
  }
  return prefix;
}

absl::StatusOr<TransferPrepared> ManagerCore::PrepareTransfer(
    const TransferSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(PendingTransfers::ValidateRequest(req));
  JournaledLock lock(this);
  const std::string cache_key =
      absl::StrCat("TransferSequence/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, transfer_cache_.Lookup(cache_key, req.request_id,
                                       req.fingerprint, "TransferSequence"));
  if (hit) {
    if (!hit->status.ok()) return hit->status;  // it aborted
    TransferPrepared done;
    done.done = hit->reply;
    return done;
  }
  TRIAX_RETURN_IF_ERROR(
      transfers_.CheckNotInProgress(req.tenant_id, req.request_id));
  // Already transferring: FindOpenSequenceLocked refuses (mutates).
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  for (const BlockRecord* b : s->blocks) {
    if (b->busy != 0) {
      return absl::AbortedError(absl::StrCat(
          "lineage ", b->lineage_id, " (block ", b->index, ") of sequence ",
          Quote(s->id), " is being moved by the pressure manager; retry"));
    }
  }

  TRIAX_ASSIGN_OR_RETURN(const SequenceRecord* prefix,
                         TransferPrefixLocked(req, *s));
  const uint32_t first_block = req.first_block;

  auto p = std::make_unique<PendingTransfers::Pending>();
  if (!req.destination_policy.empty()) {
    absl::StatusOr<std::shared_ptr<const Policy>> policy =
        policies_.Find("destination_policy", req.destination_policy);
    if (!policy.ok()) {
      // Unknown name (the store answers INVALID_ARGUMENT for a field).
      return absl::NotFoundError(policy.status().message());
    }
    TRIAX_RETURN_IF_ERROR(
        CheckPolicyForShape(**policy, s->model, s->block_tokens));
    if ((*policy)->IsAllocation()) {
      TRIAX_ASSIGN_OR_RETURN(p->calibration,
                             calibrations_.ForPolicy(**policy, s->model));
      BlockTags tags;
      tags.reserve(s->blocks.size());
      for (const BlockRecord* b : s->blocks) {
        tags.emplace_back(b->tag, b->num_tokens);
      }
      TRIAX_ASSIGN_OR_RETURN(
          p->allocation, SequencePlanner::Allocate(
                             **policy, *p->calibration, s->model,
                             s->block_tokens, SequencePlanner::GroupTags(tags),
                             /*allow_infeasible=*/false, nullptr));
    }
    p->policy = *std::move(policy);
  }

  const kernels::PageShape shape = PageShapeOf(s->model, s->block_tokens);
  Demand demand;
  TransferPrepared prepared;
  prepared.blocks.reserve(s->blocks.size());
  for (const BlockRecord* b : s->blocks) {
    BlockPlan plan = PlanOf(*b);
    plan.tier = Tier::kDevice;
    if (b->evicted || b->index < first_block) {
      // Evicted: nothing moves. A prefix hit's block: shared there as is.
      prepared.blocks.push_back(plan);
      continue;
    }
    // A block shared with other sequences moves as a copy in its encoding
    // (the others keep it as it is).
    const bool shared = b->refcount > 1;
    if (shared && b->tier != Tier::kDevice) {
      return absl::FailedPreconditionError(absl::StrCat(
          "lineage ", b->lineage_id, " (block ", b->index, ") of sequence ",
          Quote(s->id), " is shared (", b->refcount,
          " sequences) and not on the device; restore it first"));
    }
    const Encoding e =
        p->policy != nullptr && !shared
            ? DestinationEncoding(*p->policy, p->allocation, b->tag)
            : b->encoding;
    if (const char* why = kernels::ValidateEncoding(e, shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination_policy ", Quote(req.destination_policy),
          " gives lineage ", b->lineage_id, " encoding ", EncodingString(e),
          ", invalid for block_tokens ", s->block_tokens, ", n_kv_heads ",
          s->model.n_kv_heads, ", head_dim ", s->model.head_dim, ": ", why));
    }
    const uint64_t bytes = BlockBytes(s->model, s->block_tokens, e);
    p->encodings.emplace_back(b->lineage_id, e);
    p->new_bytes.push_back(bytes);
    p->reserved += bytes;
    p->source_bytes += b->bytes;
    WorkerRegistry::AddBlocks(s->model, s->block_tokens, e, 1, &demand);
    plan.encoding = e;
    prepared.blocks.push_back(plan);
  }
  // The tenant's ceiling first (both copies are charged until the commit),
  // then the destination's room.
  if (absl::Status admit = TenantLedger::Admit(*s->tenant, p->reserved);
      !admit.ok()) {
    return absl::Status(
        admit.code(),
        absl::StrCat("transfer of sequence ", Quote(s->id), " from worker ",
                     Quote(s->worker->info.worker_id),
                     " refused by the tenant's ceiling (both copies are "
                     "charged until the commit): ",
                     admit.message()));
  }
  // A prefix hit goes to the prefix's worker (TransferPrefixLocked refused
  // another named destination).
  TRIAX_ASSIGN_OR_RETURN(WorkerRecord * dest,
                         TransferDestinationLocked(
                             *s,
                             prefix != nullptr ? prefix->worker->info.worker_id
                                               : req.destination_worker_id,
                             p->reserved, demand));
  // A moving block the destination holds already (for another of its
  // sequences) would be there twice: it is a prefix hit's block.
  for (const BlockRecord* b : s->blocks) {
    if (b->index < first_block || b->evicted) continue;
    if (SequenceTable::HoldersOn(*b, dest) > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "lineage ", b->lineage_id, " (block ", b->index, ") of sequence ",
          Quote(s->id), " is on destination worker ",
          Quote(dest->info.worker_id),
          " already (another sequence there holds it); transfer with "
          "first_block > ",
          b->index, " and that sequence as destination_prefix_sequence_id"));
    }
  }

  // Reserve and mark.
  s->tenant->used[static_cast<int>(Tier::kDevice)] += p->reserved;
  dest->Reserve(p->reserved);
  p->tenant_id = req.tenant_id;
  p->request_id = req.request_id;
  p->fingerprint = req.fingerprint;
  p->sequence_id = s->id;
  p->source_id = s->worker->info.worker_id;
  p->destination_id = dest->info.worker_id;
  p->shared_blocks = first_block;
  if (prefix != nullptr) p->prefix_sequence_id = prefix->id;
  p->started_ms = clock_->NowMs();
  PendingTransfers::Pending* pending = transfers_.Add(std::move(p));
  s->transfer_id = pending->transfer_id;
  s->transfer_destination = dest;
  for (BlockRecord* b : s->blocks) b->busy = pending->token;
  Touch(s);

  std::vector<Event> ev(1);
  ev[0] = TransferEvent(*clock_, EventKind::kTransferStarted, s, nullptr,
                        pending->source_id, pending->destination_id);
  ev[0].detail = absl::StrCat(
      "transfer=", pending->transfer_id, " blocks=", pending->encodings.size(),
      " reserved_bytes=", pending->reserved,
      " source_bytes=", pending->source_bytes,
      " policy=", pending->policy != nullptr ? pending->policy->name : "-",
      " placed=", req.destination_worker_id.empty() ? "true" : "false",
      " first_block=", first_block,
      " prefix=", prefix != nullptr ? prefix->id : "-");
  events_.Append(&ev);

  prepared.token = pending->token;
  prepared.transfer_id = pending->transfer_id;
  prepared.source_worker_id = pending->source_id;
  prepared.source_address = s->worker->info.address;
  prepared.destination_worker_id = pending->destination_id;
  prepared.destination_address = dest->info.address;
  prepared.worker_request_id = pending->transfer_id;
  prepared.tenant_id = req.tenant_id;
  prepared.sequence_id = s->id;
  prepared.model = s->model;
  prepared.block_tokens = s->block_tokens;
  prepared.window_tokens = s->window_tokens;
  prepared.timeout_ms =
      req.timeout_ms != 0 ? req.timeout_ms : options_.transfer_timeout_ms;
  prepared.follow_writes = req.follow_writes;
  prepared.reserved_bytes = pending->reserved;
  prepared.prefix_sequence_id = pending->prefix_sequence_id;
  prepared.prefix_blocks = first_block;
  return prepared;
}

absl::StatusOr<TransferCommitted> ManagerCore::CommitTransfer(
    uint64_t token, const TransferImportFigures& figures) {
  JournaledLock lock(this);
  PendingTransfers::Pending* p = transfers_.Find(token);
  if (p == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("transfer token ", token, " is not pending"));
  }
  SequenceRecord* s = sequences_.Find(p->sequence_id);
  WorkerRecord* dest = workers_.Find(p->destination_id);
  std::string refused = p->doomed;
  if (refused.empty()) {
    if (s == nullptr || s->state != SequenceState::kOpen ||
        s->transfer_id != p->transfer_id) {
      refused = absl::StrCat("sequence ", Quote(p->sequence_id), " is ",
                             s == nullptr || s->state == SequenceState::kClosed
                                 ? "closed"
                                 : "lost");
    } else if (dest == nullptr || dest->info.state == WorkerState::kDown) {
      refused = absl::StrCat("destination worker ", Quote(p->destination_id),
                             " went down");
    }
  }
  if (!refused.empty()) {
    const absl::Status aborted = absl::AbortedError(absl::StrCat(
        "transfer ", p->transfer_id, " of ", Quote(p->sequence_id), " from ",
        Quote(p->source_id), " to ", Quote(p->destination_id),
        ": aborted at the commit: ", refused,
        "; the source copy stays authoritative"));
    AbortTransferLocked(token, aborted);
    return aborted;
  }

  WorkerRecord* source = s->worker;
  TenantRecord* tenant = s->tenant;
  std::vector<Event> ev;
  ev.reserve(p->encodings.size() + 1);
  size_t next = 0;  // p->encodings follow the sequence's moved blocks
  uint64_t device_bytes = 0;
  for (BlockRecord* b : s->blocks) {
    b->busy = 0;
    if (b->index < p->shared_blocks) {
      // A prefix hit's block: s now holds the destination's copy (charged
      // there now if the prefix sequence let go of it meanwhile; the
      // destination's import holds its pages) and lets go of the source's.
      if (SequenceTable::MoveHolder(b, source, dest)) {
        SequenceTable::ChargeCopy(*b, dest);
      }
      device_bytes += b->bytes;
      Event e = TransferEvent(*clock_, EventKind::kBlockTransferred, s, b,
                              p->source_id, p->destination_id);
      e.detail = absl::StrCat("transfer=", p->transfer_id, " index=", b->index,
                              " shared=true prefix=", p->prefix_sequence_id,
                              " encoding=", EncodingString(b->encoding),
                              " bytes=", b->bytes);
      ev.push_back(std::move(e));
      continue;
    }
    if (b->evicted) {
      if (b->refcount == 1) {
        b->worker = dest;
        b->holders = {{dest, 1}};
      } else {
        SequenceTable::MoveHolder(b, source, dest);
      }
      continue;
    }
    if (next >= p->encodings.size() ||
        p->encodings[next].first != b->lineage_id) {
      // Blocks busy with the transfer cannot be evicted or added; a
      // mismatch is a bug: keep the accounting of what is known.
      Log(LogLevel::kError, "manager", "transfer plan out of step",
          absl::StrCat(Kv("transfer", p->transfer_id), " ",
                       Kv("lineage_id", b->lineage_id)));
      continue;
    }
    if (b->refcount > 1) {
      // Shared with other sequences: s takes a copy to the destination (in
      // its encoding; the reservation is that copy's charge) and the source
      // keeps its copy while others hold it there.
      if (!SequenceTable::MoveHolder(b, source, dest)) {
        tenant->used[static_cast<int>(Tier::kDevice)] -= p->new_bytes[next];
        dest->reserved -= p->new_bytes[next];
      }
      ++next;
      device_bytes += b->bytes;
      Event e = TransferEvent(*clock_, EventKind::kBlockTransferred, s, b,
                              p->source_id, p->destination_id);
      e.detail = absl::StrCat("transfer=", p->transfer_id, " index=", b->index,
                              " from=", EncodingString(b->encoding),
                              " to=", EncodingString(b->encoding),
                              " bytes_from=", b->bytes, " bytes_to=", b->bytes,
                              " copy=true refcount=", b->refcount);
      ev.push_back(std::move(e));
      continue;
    }
    b->worker = dest;
    b->holders = {{dest, 1}};
    // The source's charge of this block, in the tier it is in now (the
    // worker may have restored it on its own meanwhile).
    const int tier = static_cast<int>(b->tier);
    tenant->used[tier] -= b->bytes;
    if (b->tier == Tier::kDevice) {
      source->reserved -= b->bytes;
    } else {
      source->tier_used[tier] -= b->bytes;
    }
    const Encoding from = b->encoding;
    const uint64_t from_bytes = b->bytes;
    b->encoding = p->encodings[next].second;
    b->bytes = p->new_bytes[next];
    b->tier = Tier::kDevice;
    ++next;
    device_bytes += b->bytes;
    Event e = TransferEvent(*clock_, EventKind::kBlockTransferred, s, b,
                            p->source_id, p->destination_id);
    e.detail = absl::StrCat("transfer=", p->transfer_id, " index=", b->index,
                            " from=", EncodingString(from),
                            " to=", EncodingString(b->encoding),
                            " bytes_from=", from_bytes, " bytes_to=", b->bytes);
    ev.push_back(std::move(e));
  }
  source->open.erase(s);
  dest->open.insert(s);
  s->worker = dest;
  s->bytes = device_bytes;
  s->spilled = 0;
  if (p->policy != nullptr) {
    s->policy = p->policy;
    s->calibration = p->calibration;
    s->allocation = p->allocation;
  }
  s->transfer_id.clear();
  s->transfer_destination = nullptr;
  Touch(s);

  TransferCommitted out;
  TransferSequenceResult& r = out.result;
  r.transfer_id = p->transfer_id;
  r.source_worker_id = p->source_id;
  r.destination_worker_id = p->destination_id;
  r.sequence = SequenceTable::Info(*s, /*with_blocks=*/true);
  r.blocks = p->encodings.size();
  r.shared_blocks = p->shared_blocks;
  r.pages = figures.pages;
  r.wire_bytes = figures.wire_bytes;
  r.bf16_bytes = figures.bf16_bytes;
  r.source_bytes = p->source_bytes;
  r.seconds = static_cast<double>(clock_->NowMs() - p->started_ms) / 1000.0;
  r.pull_seconds = figures.seconds;
  r.data_path = figures.data_path;
  Event e = TransferEvent(*clock_, EventKind::kSequenceTransferred, s, nullptr,
                          p->source_id, p->destination_id);
  e.detail = absl::StrCat(
      "transfer=", p->transfer_id, " blocks=", r.blocks, " pages=", r.pages,
      " wire_bytes=", r.wire_bytes, " bf16_bytes=", r.bf16_bytes,
      " source_bytes=", r.source_bytes, " bytes=", s->bytes,
      " policy=", s->policy->name, " shared_blocks=", r.shared_blocks,
      " prefix=", p->prefix_sequence_id.empty() ? "-" : p->prefix_sequence_id);
  ev.push_back(std::move(e));
  events_.Append(&ev);
  out.source_address = source->info.address;
  out.tenant_id = p->tenant_id;
  out.sequence_id = s->id;
  transfer_cache_.Put(absl::StrCat("TransferSequence/", p->tenant_id),
                      p->request_id, p->fingerprint, absl::OkStatus(), r);
  transfers_.Take(token);
  return out;
}

void ManagerCore::AbortTransfer(uint64_t token, const absl::Status& error) {
  JournaledLock lock(this);
  AbortTransferLocked(token, error);
}

void ManagerCore::AbortTransferLocked(uint64_t token,
                                      const absl::Status& error) {
  std::optional<PendingTransfers::Pending> p = transfers_.Release(token);
  if (!p) return;
  // The final reply of its request id (a transfer that started and failed).
  transfer_cache_.Put(absl::StrCat("TransferSequence/", p->tenant_id),
                      p->request_id, p->fingerprint, error,
                      TransferSequenceResult{});
  SequenceRecord* s = sequences_.Find(p->sequence_id);
  if (s == nullptr) return;  // left closed retention meanwhile
  if (s->transfer_id == p->transfer_id) {
    s->transfer_id.clear();
    s->transfer_destination = nullptr;
    for (BlockRecord* b : s->blocks) {
      if (b->busy == token) b->busy = 0;
    }
  }
  std::vector<Event> ev(1);
  ev[0] = TransferEvent(*clock_, EventKind::kTransferFailed, s, nullptr,
                        p->source_id, p->destination_id);
  ev[0].detail =
      absl::StrCat("transfer=", p->transfer_id, " released_bytes=", p->reserved,
                   " code=", absl::StatusCodeToString(error.code()),
                   " error=", error.message());
  events_.Append(&ev);
}

}  // namespace triax::manager
