#include "kvmanager/manager_core.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvmanager/prefix_index.h"
#include "kvmanager/tagger.h"

namespace triax::manager {

namespace {

PressureOptions PressureOptionsOf(const ManagerOptions& o) {
  PressureOptions p;
  p.ranker = o.ranker;
  p.watermarks = o.watermarks;
  p.window_guard_tokens = o.window_guard_tokens;
  p.active_guard_ms = o.active_guard_ms;
  p.max_plan_blocks = o.max_plan_blocks;
  return p;
}

}  // namespace

ManagerCore::ManagerCore(const ManagerOptions& options, const Clock* clock)
    : options_(options),
      clock_(clock),
      planner_(options.recent_turns),
      events_(EventLog::Options{options.event_retention,
                                options.watcher_queue_limit,
                                options.event_retention_bytes}),
      register_cache_(options.idempotency_capacity),
      tenant_cache_(options.idempotency_capacity),
      open_cache_(options.idempotency_capacity),
      extend_cache_(options.idempotency_capacity),
      close_cache_(options.idempotency_capacity),
      truncate_cache_(options.idempotency_capacity),
      policy_cache_(options.idempotency_capacity),
      demote_cache_(options.idempotency_capacity),
      calibration_cache_(options.idempotency_capacity),
      transfer_cache_(options.idempotency_capacity),
      sequences_(options.closed_retention),
      demotes_(clock, &workers_, &tenants_, &sequences_, &next_token_),
      transfers_(&tenants_, &workers_, &next_token_),
      pressure_(PressureOptionsOf(options), clock, &workers_, &tenants_,
                &sequences_, &calibrations_, &next_token_) {
  absl::MutexLock lock(&mu_);
  sequences_.set_changes(&changes_);
}

ManagerCore::~ManagerCore() = default;

absl::StatusOr<std::unique_ptr<ManagerCore>> ManagerCore::Create(
    const ManagerOptions& options, const Clock* clock) {
  if (clock == nullptr) return absl::InvalidArgumentError("clock is null");
  if (FindBuiltinPolicy(options.default_policy) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_policy ", Quote(options.default_policy),
                     " is not a built-in policy"));
  }
  if (options.default_block_tokens < 1 ||
      options.default_block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_block_tokens ", options.default_block_tokens,
                     " is outside 1..", kMaxBlockTokens));
  }
  if (options.worker_timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_timeout_ms ", options.worker_timeout_ms, " must be > 0"));
  }
  if (options.worker_down_timeout_ms <= options.worker_timeout_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_down_timeout_ms ", options.worker_down_timeout_ms,
        " must be > worker_timeout_ms ", options.worker_timeout_ms));
  }
  if (options.admission_deadline_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("admission_deadline_ms ", options.admission_deadline_ms,
                     " must be > 0"));
  }
  if (options.transfer_timeout_ms < 1 ||
      options.transfer_timeout_ms > kMaxTransferTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer_timeout_ms ", options.transfer_timeout_ms,
                     " is outside 1..", kMaxTransferTimeoutMs));
  }
  if (options.event_retention == 0 || options.watcher_queue_limit == 0) {
    return absl::InvalidArgumentError(
        "event_retention and watcher_queue_limit must be > 0");
  }
  TRIAX_RETURN_IF_ERROR(
      PressureCoordinator::ValidateOptions(PressureOptionsOf(options)));
  return std::unique_ptr<ManagerCore>(new ManagerCore(options, clock));
}

// --- Block lifecycle ---------------------------------------------------------

namespace {

// TemporalName of `t` without building a string for each call (a new turn
// retags every block and names two temporals each): the in-range names are
// made once; an out-of-range one is written to *scratch.
absl::string_view CachedTemporalName(Temporal t, std::string* scratch) {
  static const auto* const kNames = [] {
    auto* names = new std::array<std::string, 5>;
    for (size_t i = 0; i < names->size(); ++i) {
      (*names)[i] = TemporalName(static_cast<Temporal>(i));
    }
    return names;
  }();
  const auto i = static_cast<size_t>(t);
  if (i < kNames->size()) return (*kNames)[i];
  *scratch = TemporalName(t);
  return *scratch;
}

// A block event of `s` with its detail pieces (absl::StrAppend's), into
// an event vector or a batch.
template <typename... Pieces>
void AddBlockEvent(std::vector<Event>* ev, int64_t now, EventKind kind,
                   const SequenceRecord* s, const BlockRecord* b,
                   const Pieces&... detail) {
  Event& e = AddEvent(ev, now, kind, s, b);
  if constexpr (sizeof...(detail) > 0) absl::StrAppend(&e.detail, detail...);
}
template <typename... Pieces>
void AddBlockEvent(EventBatch* ev, int64_t now, EventKind kind,
                   const SequenceRecord* s, const BlockRecord* b,
                   const Pieces&... detail) {
  ev->Begin(now, kind, s->id, s->tenant->id, s->worker->info.worker_id,
            b->lineage_id, b->tag, b->encoding.k);
  if constexpr (sizeof...(detail) > 0) ev->Detail(detail...);
}

// Starts a sequence event of `s` in the batch.
void BeginSequenceEvent(EventBatch* ev, int64_t now, EventKind kind,
                        const SequenceRecord* s) {
  ev->Begin(now, kind, s->id, s->tenant->id, s->worker->info.worker_id);
}

}  // namespace

absl::StatusOr<SequenceRecord*> ManagerCore::FindOpenSequenceLocked(
    const std::string& tenant_id, const std::string& field,
    const std::string& sequence_id, bool needs_worker, bool mutates) const {
  TRIAX_ASSIGN_OR_RETURN(TenantRecord * tenant, tenants_.Find(tenant_id));
  TRIAX_ASSIGN_OR_RETURN(SequenceRecord * s,
                         sequences_.FindOpen(*tenant, field, sequence_id));
  if (mutates) TRIAX_RETURN_IF_ERROR(CheckNotTransferring(*s));
  if (needs_worker && s->worker->info.state == WorkerState::kSuspect) {
    return absl::UnavailableError(
        absl::StrCat("worker ", Quote(s->worker->info.worker_id), " of ", field,
                     " ", Quote(sequence_id), " is suspect (no heartbeat for ",
                     clock_->NowMs() - s->worker->info.last_heartbeat_unix_ms,
                     " ms); retry once it is back"));
  }
  return s;
}

BlockRecord* ManagerCore::NewBlockLocked(SequenceRecord* s,
                                         const PlannedBlock& pb, uint32_t turn,
                                         int64_t now, EventBatch* ev) {
  const Tag tag{TemporalFor(static_cast<uint32_t>(s->blocks.size()), turn,
                            s->current_turn, options_.recent_turns),
                pb.modality, pb.role};
  const Encoding encoding = SequencePlanner::EncodingOf(*s, tag);
  BlockRecord* b =
      sequences_.NewBlock(s, pb.first_token, pb.num_tokens, tag, encoding, turn,
                          BlockBytes(s->model, s->block_tokens, encoding));
  pressure_.BlockCreated(s, *b);
  char encoding_name[96];
  AddBlockEvent(
      ev, now, EventKind::kBlockCreated, s, b, "index=", b->index,
      " first_token=", b->first_token, " num_tokens=", b->num_tokens,
      " bytes=", b->bytes, " encoding=",
      kernels::EncodingName(b->encoding, encoding_name, sizeof(encoding_name)));
  return b;
}

template <typename Events>
void ManagerCore::ReleaseBlockLocked(
    SequenceRecord* s, BlockRecord* b, bool lost, std::vector<uint64_t>* freed,
    int64_t now, Events* ev, std::vector<EventLog::LastPlan>* forgotten) {
  AddBlockEvent(ev, now,
                lost ? EventKind::kBlockLost : EventKind::kBlockReleased, s, b);
  if (!SequenceTable::Unref(s, b)) return;
  pressure_.BlockFreed(b->lineage_id);
  prefix_.Remove(b);
  if (!lost) {
    AddBlockEvent(ev, now, EventKind::kBlockFreed, s, b, "bytes=", b->bytes);
  }
  if (freed != nullptr) freed->push_back(b->lineage_id);
  forgotten->push_back(EventLog::LastPlan{PlanOf(*b), b->creator});
  sequences_.EraseBlock(b->lineage_id);
}

template void ManagerCore::ReleaseBlockLocked(
    SequenceRecord* s, BlockRecord* b, bool lost, std::vector<uint64_t>* freed,
    int64_t now, std::vector<Event>* ev,
    std::vector<EventLog::LastPlan>* forgotten);
template void ManagerCore::ReleaseBlockLocked(
    SequenceRecord* s, BlockRecord* b, bool lost, std::vector<uint64_t>* freed,
    int64_t now, EventBatch* ev, std::vector<EventLog::LastPlan>* forgotten);

void ManagerCore::MarkLostLocked(SequenceRecord* s, const std::string& reason,
                                 std::vector<Event>* ev,
                                 std::vector<EventLog::LastPlan>* forgotten) {
  s->lost_lineage_ids.reserve(s->blocks.size());
  const int64_t now = clock_->NowMs();
  for (BlockRecord* b : s->blocks) {
    s->lost_lineage_ids.push_back(b->lineage_id);
    ReleaseBlockLocked(s, b, /*lost=*/true, nullptr, now, ev, forgotten);
  }
  s->state = SequenceState::kLost;
  Touch(s);
  Event e = MakeEvent(*clock_, EventKind::kSequenceLost, s, nullptr);
  e.lineage_ids = s->lost_lineage_ids;
  e.detail =
      absl::StrCat("reason=", reason, " blocks=", s->lost_lineage_ids.size());
  ev->push_back(std::move(e));
  sequences_.Retire(s);
}

// --- Tenants -----------------------------------------------------------------

absl::StatusOr<TenantInfo> ManagerCore::CreateTenant(
    const CreateTenantRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  if (!req.prefix_salt.empty()) {
    TRIAX_RETURN_IF_ERROR(ValidateId("prefix_salt", req.prefix_salt));
  }
  TRIAX_ASSIGN_OR_RETURN(const TenantLedger::Budgets budgets,
                         TenantLedger::ValidateBudgets(req.budgets));
  const std::string policy =
      req.default_policy.empty() ? options_.default_policy : req.default_policy;
  JournaledLock lock(this);
  TRIAX_ASSIGN_OR_RETURN(auto hit,
                         tenant_cache_.Lookup("CreateTenant", req.request_id,
                                              req.fingerprint, "CreateTenant"));
  if (hit) {
    return hit->reply;
  }
  TRIAX_RETURN_IF_ERROR(policies_.Find("default_policy", policy).status());
  TRIAX_ASSIGN_OR_RETURN(TenantRecord * t,
                         tenants_.Create(req.tenant_id, budgets, policy));
  t->prefix_salt = req.prefix_salt;
  if (changes_.enabled) changes_.tenants.insert(t->id);
  TenantInfo info = TenantLedger::Info(*t);
  std::vector<Event> ev(1);
  ev[0].unix_ms = clock_->NowMs();
  ev[0].kind = EventKind::kTenantChanged;
  ev[0].tenant_id = req.tenant_id;
  ev[0].detail = absl::StrCat("created=true default_policy=", policy);
  events_.Append(&ev);
  tenant_cache_.Put("CreateTenant", req.request_id, req.fingerprint,
                    absl::OkStatus(), info);
  return info;
}

absl::StatusOr<TenantInfo> ManagerCore::SetBudget(const SetBudgetRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  TRIAX_RETURN_IF_ERROR(TenantLedger::ValidateBudget("budget", req.budget));
  JournaledLock lock(this);
  const std::string key = absl::StrCat("SetBudget/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit,
      tenant_cache_.Lookup(key, req.request_id, req.fingerprint, "SetBudget"));
  if (hit) return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(TenantRecord * t, tenants_.Find(req.tenant_id));
  TenantLedger::SetBudget(t, req.budget);
  if (changes_.enabled) changes_.tenants.insert(t->id);
  TenantInfo info = TenantLedger::Info(*t);
  std::vector<Event> ev(1);
  ev[0].unix_ms = clock_->NowMs();
  ev[0].kind = EventKind::kTenantChanged;
  ev[0].tenant_id = req.tenant_id;
  ev[0].detail = absl::StrCat("tier=", TierName(req.budget.tier),
                              " floor_bytes=", req.budget.floor_bytes,
                              " ceiling_bytes=", req.budget.ceiling_bytes);
  events_.Append(&ev);
  tenant_cache_.Put(key, req.request_id, req.fingerprint, absl::OkStatus(),
                    info);
  return info;
}

absl::StatusOr<TenantInfo> ManagerCore::GetTenant(
    const std::string& tenant_id) const {
  absl::MutexLock lock(&mu_);
  TRIAX_ASSIGN_OR_RETURN(TenantRecord * t, tenants_.Find(tenant_id));
  return TenantLedger::Info(*t);
}

std::vector<TenantInfo> ManagerCore::ListTenants() const {
  absl::MutexLock lock(&mu_);
  return tenants_.List();
}

// --- Sequences ---------------------------------------------------------------

absl::StatusOr<SequenceInfo> ManagerCore::OpenSequence(
    const OpenSequenceRequest& req, AdmissionShortfall* shortfall) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateModelShape(req.model));
  if (!req.worker_id.empty()) {
    TRIAX_RETURN_IF_ERROR(ValidateId("worker_id", req.worker_id));
  }
  std::vector<Span> tagged;
  TRIAX_ASSIGN_OR_RETURN(
      const std::vector<Span>* spans,
      SequencePlanner::RequestSpans(req.spans, req.rendered,
                                    TurnNumbering::kOpen, &tagged));
  TRIAX_ASSIGN_OR_RETURN(const uint64_t total,
                         SequencePlanner::ValidateSpans(*spans));
  const uint32_t T =
      req.block_tokens == 0 ? options_.default_block_tokens : req.block_tokens;
  // Plan first (no state touched, so before the lock), then admit and
  // place, then commit.
  TRIAX_ASSIGN_OR_RETURN(const OpenPlan plan,
                         planner_.PlanOpen(*spans, total, T));
  // Prefix reuse: every block of the plan but a partial last one is sealed
  // and can carry a hash.
  const size_t sealed =
      plan.blocks.size() - (plan.blocks.back().num_tokens == T ? 0 : 1);
  if (!req.token_ids.empty() && req.token_ids.size() != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_ids has ", req.token_ids.size(), " ids; the ",
        req.rendered.has_value() ? "rendered text has " : "spans have ", total,
        " tokens (send one id per token, or none)"));
  }
  if (req.block_hashes.size() > sealed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_hashes has ", req.block_hashes.size(), " hashes; the prompt's ",
        plan.blocks.size(), " blocks of up to ", T, " tokens have ", sealed,
        " sealed ones (a partial last block has no hash)"));
  }
  for (size_t i = 0; i < req.block_hashes.size(); ++i) {
    if (req.block_hashes[i].size() != kPrefixHashBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_hashes[", i, "] has ", req.block_hashes[i].size(),
          " bytes; a block hash has ", kPrefixHashBytes, " (SHA-256)"));
    }
  }

  JournaledLock lock(this);
  const std::string cache_key = absl::StrCat("OpenSequence/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, open_cache_.Lookup(cache_key, req.request_id, req.fingerprint,
                                   "OpenSequence"));
  if (hit) return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(TenantRecord * tenant, tenants_.Find(req.tenant_id));
  TRIAX_RETURN_IF_ERROR(
      TenantLedger::AdmitSequence(*tenant, options_.max_sequences_per_tenant));
  const std::string& policy_name =
      req.policy.empty() ? tenant->default_policy : req.policy;
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const Policy> policy,
                         policies_.Find("policy", policy_name));
  TRIAX_RETURN_IF_ERROR(CheckPolicyForShape(*policy, req.model, T));
  TRIAX_ASSIGN_OR_RETURN(
      const std::vector<std::string> hashes,
      OpenPrefixHashesLocked(req, *tenant, plan.blocks, sealed));
  // A reused prefix ends before the prompt's last token, which the client
  // runs to get the first output token's logits.
  PrefixMatch prefix;
  size_t reusable = 0;
  while (reusable < hashes.size() &&
         plan.blocks[reusable].first_token + plan.blocks[reusable].num_tokens <
             total) {
    ++reusable;
  }
  if (!req.no_reuse && reusable > 0) {
    prefix = FindPrefixLocked(
        *tenant, req.model, T, req.window_tokens, req.worker_id,
        std::vector<std::string>(hashes.begin(), hashes.begin() + reusable));
  }

  auto seq = std::make_unique<SequenceRecord>();
  SequenceRecord* s = seq.get();
  s->tenant = tenant;
  s->model = req.model;
  s->block_tokens = T;
  s->window_tokens = req.window_tokens;
  s->policy = policy;
  if (policy->IsAllocation()) {
    TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const CalibrationTable> table,
                           calibrations_.ForPolicy(*policy, req.model));
    TRIAX_ASSIGN_OR_RETURN(
        s->allocation,
        SequencePlanner::Allocate(*policy, *table, req.model, T,
                                  SequencePlanner::GroupTags(plan.tags),
                                  /*allow_infeasible=*/false, nullptr));
    s->calibration = std::move(table);
  }
  // Only the blocks past a reused prefix are new.
  uint64_t bytes = 0;
  Demand demand;
  auto count_new = [&](size_t from) {
    bytes = 0;
    demand = Demand{};
    for (size_t i = from; i < plan.tags.size(); ++i) {
      const Encoding e = SequencePlanner::EncodingOf(*s, plan.tags[i].first);
      bytes += BlockBytes(req.model, T, e);
      WorkerRegistry::AddBlocks(req.model, T, e, 1, &demand);
    }
  };
  count_new(prefix.blocks);
  // The prefix's worker takes a reusing sequence when it has room for the
  // rest; otherwise the Open goes on without reuse.
  if (prefix.donor != nullptr) {
    const std::string& donor_worker = prefix.donor->worker->info.worker_id;
    if (!TenantLedger::Admit(*tenant, bytes).ok() ||
        !workers_.PlaceOn("worker_id", donor_worker, bytes, demand).ok()) {
      prefix = PrefixMatch{};
      count_new(0);
    }
  }
  // The named worker (the prefix's), or placement's choice (bytes 0: no
  // room check, the worker a reclaim would make room on).
  auto place = [&](uint64_t b, const Demand& d) {
    if (prefix.donor != nullptr) {
      return workers_.PlaceOn("worker_id", prefix.donor->worker->info.worker_id,
                              b, d);
    }
    return req.worker_id.empty()
               ? workers_.Place(b, d)
               : workers_.PlaceOn("worker_id", req.worker_id, b, d);
  };
  if (absl::Status st = TenantLedger::Admit(*tenant, bytes); !st.ok()) {
    if (shortfall != nullptr) {
      absl::StatusOr<WorkerRecord*> w = place(0, Demand{});
      *shortfall = AdmissionShortfall{
          tenant->id, w.ok() ? (*w)->info.worker_id : "", bytes};
      if (w.ok()) HoldForResumeLocked(*tenant, **w, shortfall);
    }
    return st;
  }
  absl::StatusOr<WorkerRecord*> placed = place(bytes, demand);
  if (!placed.ok()) {
    if (shortfall != nullptr && absl::IsResourceExhausted(placed.status())) {
      absl::StatusOr<WorkerRecord*> w = place(0, Demand{});
      if (w.ok()) {
        *shortfall =
            AdmissionShortfall{tenant->id, (*w)->info.worker_id, bytes};
        shortfall->worker_request_bytes =
            WorkerRegistry::AdmissionBytes(**w, bytes, demand);
        HoldForResumeLocked(*tenant, **w, shortfall);
      }
    }
    return placed.status();
  }
  WorkerRecord* worker = *placed;
  if (options_.resume_reserve) {
    TRIAX_RETURN_IF_ERROR(
        CheckResumeReserveLocked(*tenant, *worker, bytes, shortfall));
  }

  s->id = sequences_.NewId();
  s->worker = worker;
  s->last_access_ms = clock_->NowMs();
  s->current_turn = plan.last_turn;
  s->turn_start.push_back(0);
  s->blocks.reserve(plan.blocks.size());
  EventBatch& ev = batch_;
  ev.Clear();
  const int64_t now = s->last_access_ms;
  for (const PlannedBlock& pb : plan.blocks) {
    while (s->turn_start.size() <= pb.turn) {
      s->turn_start.push_back(static_cast<uint32_t>(s->blocks.size()));
    }
    if (s->blocks.size() < prefix.blocks) {
      // A reused block keeps its tag and format, like a fork's.
      BlockRecord* b = prefix.donor->blocks[s->blocks.size()];
      SequenceTable::Share(s, b);
      AddBlockEvent(&ev, now, EventKind::kBlockShared, s, b,
                    "prefix_of=", prefix.donor->id, " refcount=", b->refcount);
      continue;
    }
    NewBlockLocked(s, pb, pb.turn, now, &ev);
  }
  s->num_tokens = total;
  if (prefix.donor != nullptr) {
    Touch(prefix.donor);  // its blocks' refcounts change
    s->prefix_sequence_id = prefix.donor->id;
    s->prefix_tenant_id = prefix.donor->tenant->id;
    s->prefix_blocks = prefix.blocks;
    s->prefix_tokens = plan.blocks[prefix.blocks].first_token;
    ++prefix_hits_;
    prefix_reused_blocks_ += prefix.blocks;
  }
  // The hash chain: from the token ids, or the client's hashes alone (the
  // chain then ends with them).
  s->chain_blocks = prefix.blocks;
  if (!req.token_ids.empty()) {
    s->chain_open = true;
    AdvanceChainLocked(
        s, absl::MakeConstSpan(req.token_ids).subspan(s->prefix_tokens));
  } else {
    for (size_t i = prefix.blocks; i < hashes.size(); ++i) {
      s->blocks[i]->prefix_hash = hashes[i];
      prefix_.Add(s->blocks[i]);
    }
    s->chain_blocks = static_cast<uint32_t>(hashes.size());
  }
  tenant->open_sequences++;
  worker->open.insert(s);
  BeginSequenceEvent(&ev, now, EventKind::kSequenceOpened, s);
  ev.Detail("blocks=", s->blocks.size(), " tokens=", total, " bytes=", s->bytes,
            " policy=", policy->name, " block_tokens=", T);
  if (prefix.donor != nullptr) {
    ev.Detail(" prefix_of=", prefix.donor->id,
              " prefix_blocks=", prefix.blocks);
  }
  SequenceInfo info = SequenceTable::Info(*s, /*with_blocks=*/true);
  sequences_.Insert(std::move(seq));
  events_.Append(&ev);
  open_cache_.Put(cache_key, req.request_id, req.fingerprint, absl::OkStatus(),
                  info);
  return info;
}

absl::StatusOr<ExtendSequenceResult> ManagerCore::ExtendSequence(
    const ExtendSequenceRequest& req, AdmissionShortfall* shortfall) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  if (req.rendered.has_value() && req.new_turn) {
    return absl::InvalidArgumentError(
        "new_turn is true with rendered; the user messages of the rendered "
        "text start turns, so new_turn must be false");
  }
  std::vector<Span> tagged;
  TRIAX_ASSIGN_OR_RETURN(
      const std::vector<Span>* spans,
      SequencePlanner::RequestSpans(req.spans, req.rendered,
                                    TurnNumbering::kContinue, &tagged));
  TRIAX_ASSIGN_OR_RETURN(const uint64_t total,
                         SequencePlanner::ValidateSpans(*spans));
  if (!req.token_ids.empty() && req.token_ids.size() != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_ids has ", req.token_ids.size(), " ids; the ",
        req.rendered.has_value() ? "rendered text has " : "spans have ", total,
        " tokens (send one id per token, or none)"));
  }
  JournaledLock lock(this);
  const std::string cache_key = absl::StrCat("ExtendSequence/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, extend_cache_.Lookup(cache_key, req.request_id, req.fingerprint,
                                     "ExtendSequence"));
  if (hit) return hit->reply;
  TRIAX_RETURN_IF_ERROR(
      demotes_.CheckExtendNotInProgress(req.tenant_id, req.request_id));
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  TRIAX_ASSIGN_OR_RETURN(const ExtendPlan plan,
                         planner_.PlanExtend(*s, *spans, total, req.new_turn,
                                             req.continue_last_span));
  const uint32_t T = s->block_tokens;
  // Allocation policies: re-solve over every block's tag after this call.
  const bool allocating = s->policy->IsAllocation();
  TagAllocation allocation;
  bool infeasible = false;
  if (allocating) {
    TRIAX_ASSIGN_OR_RETURN(
        allocation,
        SequencePlanner::Allocate(
            *s->policy, *s->calibration, s->model, T,
            SequencePlanner::GroupTags(planner_.TagsAfterExtend(*s, plan)),
            /*allow_infeasible=*/true, &infeasible));
  }
  uint64_t bytes = 0;
  Demand demand;
  for (const auto& [tag, n] : plan.tags) {
    Encoding e = s->policy->EncodingFor(tag);
    if (allocating) {
      for (const auto& [t, chosen] : allocation) {
        if (t == tag) e = chosen;
      }
    }
    bytes += BlockBytes(s->model, T, e);
    WorkerRegistry::AddBlocks(s->model, T, e, 1, &demand);
  }
  {
    absl::Status st = TenantLedger::Admit(*s->tenant, bytes);
    if (st.ok()) st = WorkerRegistry::Fits(*s->worker, bytes, demand);
    if (!st.ok()) {
      if (shortfall != nullptr) {
        *shortfall =
            AdmissionShortfall{s->tenant->id, s->worker->info.worker_id, bytes};
        shortfall->worker_request_bytes =
            WorkerRegistry::AdmissionBytes(*s->worker, bytes, demand);
        // Its own blocks may be demoted or evicted, not spilled: the next
        // Attend would have to restore them.
        shortfall->resident_sequence_id = s->id;
      }
      return st;
    }
  }
  s->last_access_ms = clock_->NowMs();

  // Commit.
  Touch(s);
  const size_t old_blocks = s->blocks.size();
  if (plan.fill > 0) UnsealLastLocked(s);
  if (allocating) s->allocation = std::move(allocation);
  ExtendSequenceResult result;
  EventBatch& ev = batch_;
  ev.Clear();
  const int64_t now = s->last_access_ms;
  std::string from_name, to_name;  // TemporalNames, reused
  planner_.AdvanceTurns(s, plan);
  planner_.ForEachRetag(
      *s, plan.prev_turn, plan.turn, [&](BlockRecord* b, Temporal next) {
        const Temporal from = b->tag.temporal;
        b->tag.temporal = next;  // the event carries the new tag
        AddBlockEvent(&ev, now, EventKind::kBlockRetagged, s, b,
                      "from=", CachedTemporalName(from, &from_name),
                      " to=", CachedTemporalName(next, &to_name),
                      " turn=", plan.turn);
        result.retagged_blocks.push_back(PlanOf(*b));
      });
  if (plan.fill > 0) {
    BlockRecord* last = s->blocks[old_blocks - 1];
    const Temporal next = planner_.TemporalOf(*last, plan.turn);
    if (next != last->tag.temporal) {
      const Temporal from = last->tag.temporal;
      last->tag.temporal = next;
      AddBlockEvent(&ev, now, EventKind::kBlockRetagged, s, last,
                    "from=", CachedTemporalName(from, &from_name),
                    " to=", CachedTemporalName(next, &to_name),
                    " turn=", plan.turn, " grown=true");
      result.retagged_blocks.push_back(PlanOf(*last));
    }
    result.grown_blocks.push_back(PlanOf(*last));
  }
  result.new_blocks.reserve(plan.blocks.size());
  for (const PlannedBlock& pb : plan.blocks) {
    result.new_blocks.push_back(
        PlanOf(*NewBlockLocked(s, pb, pb.turn, now, &ev)));
  }
  s->num_tokens += total;
  AdvanceChainLocked(s, req.token_ids);
  BeginSequenceEvent(&ev, now, EventKind::kSequenceExtended, s);
  ev.Detail("new_blocks=", plan.blocks.size(), " filled_tokens=", plan.fill,
            " tokens=", total,
            " new_turn=", plan.turn > plan.prev_turn ? "true" : "false",
            " turn=", s->current_turn);
  result.sequence = SequenceTable::Info(*s, /*with_blocks=*/true);
  events_.Append(&ev);
  if (infeasible) {
    Log(LogLevel::kWarn, "manager",
        "allocation over budget: cheapest encodings taken",
        absl::StrCat(Kv("sequence_id", s->id), " ",
                     Kv("policy", s->policy->name), " ",
                     Kv("budget_bits", s->policy->budget_bits)));
  }
  // Existing blocks whose tag's choice is now smaller are demoted (never
  // promoted); the Extend's reply is remembered by FinishExtendDemotion.
  if (allocating) {
    if (std::optional<DemotePrepared> d =
            demotes_.PrepareAging(s, old_blocks, req.tenant_id, req.request_id,
                                  req.fingerprint, result)) {
      result.demotion = std::move(*d);
      return result;
    }
  }
  extend_cache_.Put(cache_key, req.request_id, req.fingerprint,
                    absl::OkStatus(), result);
  return result;
}

absl::StatusOr<SequenceInfo> ManagerCore::ForkSequence(
    const ForkSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  JournaledLock lock(this);
  const std::string cache_key = absl::StrCat("ForkSequence/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, open_cache_.Lookup(cache_key, req.request_id, req.fingerprint,
                                   "ForkSequence"));
  if (hit) return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * parent,
      FindOpenSequenceLocked(req.tenant_id, "parent_sequence_id",
                             req.parent_sequence_id));
  TRIAX_RETURN_IF_ERROR(TenantLedger::AdmitSequence(
      *parent->tenant, options_.max_sequences_per_tenant));
  TRIAX_ASSIGN_OR_RETURN(const ForkPlan plan,
                         SequencePlanner::PlanFork(*parent, req.num_tokens));
  BlockRecord* cut = plan.cut;
  const uint64_t bytes = cut != nullptr ? cut->bytes : 0;
  TRIAX_RETURN_IF_ERROR(TenantLedger::Admit(*parent->tenant, bytes));
  Demand demand;
  if (cut != nullptr) {
    WorkerRegistry::AddBlocks(parent->model, parent->block_tokens,
                              cut->encoding, 1, &demand);
  }
  TRIAX_RETURN_IF_ERROR(WorkerRegistry::Fits(*parent->worker, bytes, demand));

  Touch(parent);  // its blocks' refcounts change
  auto seq = std::make_unique<SequenceRecord>();
  SequenceRecord* s = seq.get();
  s->id = sequences_.NewId();
  s->tenant = parent->tenant;
  s->worker = parent->worker;
  s->model = parent->model;
  s->block_tokens = parent->block_tokens;
  s->window_tokens = parent->window_tokens;
  s->current_turn = parent->current_turn;
  s->policy = parent->policy;
  s->calibration = parent->calibration;
  s->allocation = parent->allocation;
  s->parent = parent->id;
  const uint32_t kept = plan.kept();
  for (uint32_t start : parent->turn_start)
    s->turn_start.push_back(std::min(start, kept));
  EventBatch& ev = batch_;
  ev.Clear();
  const int64_t now = clock_->NowMs();
  s->blocks.reserve(kept);
  for (size_t i = 0; i < plan.shared; ++i) {
    BlockRecord* b = parent->blocks[i];
    SequenceTable::Share(s, b);
    AddBlockEvent(&ev, now, EventKind::kBlockShared, s, b,
                  "parent=", parent->id, " refcount=", b->refcount);
  }
  if (cut != nullptr) {
    // The copy has the cut block's turn, role and modality, hence its tag and
    // format; the worker copies the bytes.
    NewBlockLocked(
        s,
        PlannedBlock{cut->first_token,
                     static_cast<uint32_t>(plan.num_tokens - cut->first_token),
                     cut->tag.role, cut->tag.modality},
        cut->turn, now, &ev);
    ev.Detail(" copied_from=", cut->lineage_id);
  }
  s->num_tokens = plan.num_tokens;
  ForkChainLocked(*parent, plan, s);
  s->tenant->open_sequences++;
  s->worker->open.insert(s);
  BeginSequenceEvent(&ev, now, EventKind::kSequenceForked, s);
  ev.Detail("parent=", parent->id, " tokens=", plan.num_tokens,
            " shared_blocks=", plan.shared,
            " copied_blocks=", cut != nullptr ? 1 : 0);
  SequenceInfo info = SequenceTable::Info(*s, /*with_blocks=*/true);
  sequences_.Insert(std::move(seq));
  events_.Append(&ev);
  open_cache_.Put(cache_key, req.request_id, req.fingerprint, absl::OkStatus(),
                  info);
  return info;
}

absl::StatusOr<CloseSequenceResult> ManagerCore::CloseSequence(
    const CloseSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  JournaledLock lock(this);
  const std::string cache_key = absl::StrCat("CloseSequence/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, close_cache_.Lookup(cache_key, req.request_id, req.fingerprint,
                                    "CloseSequence"));
  if (hit) return hit->reply;
  // A SUSPECT worker frees the pages when it returns (release_sequence_ids).
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id,
                             /*needs_worker=*/false));
  CloseSequenceResult result;
  EventBatch& ev = batch_;
  ev.Clear();
  std::vector<EventLog::LastPlan> forgotten;
  forgotten.reserve(s->blocks.size());
  const int64_t now = clock_->NowMs();
  for (BlockRecord* b : s->blocks) {
    ReleaseBlockLocked(s, b, /*lost=*/false, &result.freed_lineage_ids, now,
                       &ev, &forgotten);
  }
  s->state = SequenceState::kClosed;
  Touch(s);
  BeginSequenceEvent(&ev, now, EventKind::kSequenceClosed, s);
  ev.Detail("blocks=", s->blocks.size(),
            " freed=", result.freed_lineage_ids.size());
  sequences_.Retire(s);
  events_.Append(&ev, &forgotten);
  close_cache_.Put(cache_key, req.request_id, req.fingerprint, absl::OkStatus(),
                   result);
  return result;
}

absl::StatusOr<SequenceInfo> ManagerCore::GetSequence(
    const std::string& tenant_id, const std::string& sequence_id) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", sequence_id));
  absl::MutexLock lock(&mu_);
  const TenantRecord* tenant = nullptr;
  if (!tenant_id.empty()) {
    TRIAX_ASSIGN_OR_RETURN(tenant, tenants_.Find(tenant_id));
  }
  TRIAX_ASSIGN_OR_RETURN(const SequenceRecord* s,
                         sequences_.FindVisible(tenant, sequence_id));
  return SequenceTable::Info(*s, /*with_blocks=*/true);
}

absl::StatusOr<std::vector<SequenceInfo>> ManagerCore::ListSequences(
    const std::string& tenant_id, bool include_closed) const {
  absl::MutexLock lock(&mu_);
  const TenantRecord* tenant = nullptr;
  if (!tenant_id.empty()) {
    TRIAX_ASSIGN_OR_RETURN(tenant, tenants_.Find(tenant_id));
  }
  return sequences_.List(tenant, include_closed);
}

absl::StatusOr<TraceResult> ManagerCore::QueryTrace(uint64_t lineage_id) const {
  if (lineage_id == 0) {
    return absl::InvalidArgumentError(
        "lineage_id is 0; lineage ids start at 1");
  }
  TraceResult result;
  {
    absl::MutexLock lock(&mu_);
    if (const BlockRecord* b = sequences_.FindBlock(lineage_id)) {
      result.block = PlanOf(*b);
      result.sequence_id = b->creator;
      result.events = events_.EventsForLineage(lineage_id);
      return result;
    }
  }
  auto last = events_.FindLastPlan(lineage_id);
  if (!last) {
    return absl::NotFoundError(absl::StrCat(
        "lineage_id ", lineage_id, " is neither live nor in retained events"));
  }
  result.block = last->plan;
  result.sequence_id = last->creator;
  result.events = events_.EventsForLineage(lineage_id);
  return result;
}

// --- Memory pressure ---------------------------------------------------------

double ManagerCore::RefreshRanking(bool spill_tiers) {
  const auto copy_start = std::chrono::steady_clock::now();
  // The blocks are copied in chunks, the mutex released in between, so the
  // hot path never waits for a whole snapshot.
  std::optional<SnapshotBuilder> builder;
  {
    JournaledLock lock(this);
    builder.emplace(pressure_.NewSnapshot(spill_tiers));
    builder->Begin(clock_->NowMs());
  }
  while (!builder->done()) {
    JournaledLock lock(this);
    builder->CopyChunk();
  }
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<PressureSnapshot> snap = builder->TakeSnapshot();
  snap->snapshot_ms =
      std::chrono::duration<double, std::milli>(start - copy_start).count();
  absl::MutexLock rank_lock(&rank_mu_);
  absl::StatusOr<Ranking> ranking =
      Rank(builder->input(), options_.ranker, rank_scratch_.get());
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  if (!ranking.ok()) {
    // The input is built here, so this is a bug; keep the old snapshot.
    Log(LogLevel::kError, "manager", "pressure ranking failed",
        Kv("error", ranking.status().ToString()));
    return ms;
  }
  snap->ranking = std::move(*ranking);
  snap->ranking.ranking_ms = ms;
  JournaledLock lock(this);
  pressure_.Publish(std::move(snap));
  return ms;
}

bool ManagerCore::NeedsReclaim() const {
  absl::MutexLock lock(&mu_);
  return pressure_.NeedsReclaim();
}

TierPlan ManagerCore::PlanPressure() {
  JournaledLock lock(this);
  return pressure_.PlanPressure();
}

TierPlan ManagerCore::PlanAdmission(const AdmissionShortfall& s) {
  JournaledLock lock(this);
  return pressure_.PlanAdmission(s);
}

TierPlan ManagerCore::PlanPrefetch(const std::string& sequence_id,
                                   AdmissionShortfall* shortfall) {
  JournaledLock lock(this);
  return pressure_.PlanPrefetch(sequence_id, shortfall);
}

absl::StatusOr<TierPlan> ManagerCore::ReportAccess(
    const ReportAccessRequest& req) {
  TRIAX_RETURN_IF_ERROR(PressureCoordinator::ValidateAccessReport(req));
  JournaledLock lock(this);
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id,
                             /*needs_worker=*/true, /*mutates=*/false));
  return pressure_.ReportAccess(s, req);
}

absl::Status ManagerCore::FinishTierPlan(
    uint64_t token, const std::vector<absl::Status>& results,
    TierPlanOutcome* outcome) {
  JournaledLock lock(this);
  std::vector<Event> ev;
  TRIAX_RETURN_IF_ERROR(pressure_.FinishTierPlan(token, results, &ev, outcome));
  DropUnusablePrefixesLocked(ev);
  events_.Append(&ev);
  return absl::OkStatus();
}

std::string ManagerCore::ExplainShortfall(const AdmissionShortfall& s) const {
  absl::MutexLock lock(&mu_);
  return pressure_.ExplainShortfall(s);
}

uint64_t ManagerCore::ShortBytes(const AdmissionShortfall& s) const {
  absl::MutexLock lock(&mu_);
  return pressure_.ShortBytes(s);
}

absl::Status ManagerCore::CheckResumeReserveLocked(
    const TenantRecord& tenant, const WorkerRecord& worker, uint64_t bytes,
    AdmissionShortfall* shortfall, uint64_t returning) const {
  const int dev = static_cast<int>(Tier::kDevice);
  const uint64_t all_held = PressureCoordinator::HeldForResume(tenant);
  const uint64_t tenant_held = all_held - std::min(all_held, returning);
  const uint64_t worker_held = PressureCoordinator::HeldForResume(worker);
  std::string refused;
  if (tenant.budgets[dev]) {
    const uint64_t ceiling = tenant.budgets[dev]->ceiling_bytes;
    const uint64_t want = tenant.used[dev] + tenant_held + bytes;
    if (want > ceiling) {
      refused = absl::StrCat(
          "tenant ", Quote(tenant.id), " tier TIER_DEVICE: request needs ",
          bytes, " bytes, ", tenant.used[dev], " of ceiling ", ceiling,
          " in use and ", tenant_held,
          " held for its spilled open sequences to resume; over by ",
          want - ceiling, " bytes");
    }
  }
  const uint64_t cap = worker.info.capacity_bytes;
  const uint64_t in_use = worker.reserved + worker.transient;
  const uint64_t want = in_use + worker_held + bytes;
  if (refused.empty() && want > cap) {
    refused = absl::StrCat(
        "worker ", Quote(worker.info.worker_id), ": request needs ", bytes,
        " bytes, ", in_use, " of capacity ", cap, " in use and ", worker_held,
        " held for spilled open sequences to resume; over by ", want - cap,
        " bytes");
  }
  if (refused.empty()) return absl::OkStatus();
  if (shortfall != nullptr) {
    *shortfall = AdmissionShortfall{tenant.id, worker.info.worker_id, bytes};
    HoldForResumeLocked(tenant, worker, shortfall);
  }
  return absl::ResourceExhaustedError(refused);
}

void ManagerCore::HoldForResumeLocked(const TenantRecord& tenant,
                                      const WorkerRecord& worker,
                                      AdmissionShortfall* shortfall) const {
  if (!options_.resume_reserve) return;
  shortfall->resume_reserve = true;
  shortfall->worker_held_bytes = PressureCoordinator::HeldForResume(worker);
  shortfall->tenant_held_bytes = PressureCoordinator::HeldForResume(tenant);
}

PressureState ManagerCore::GetPressure(uint32_t top) const {
  absl::MutexLock lock(&mu_);
  PressureState state = pressure_.GetPressure(top);
  state.prefix_index_blocks = prefix_.size();
  state.prefix_hits = prefix_hits_;
  state.prefix_reused_blocks = prefix_reused_blocks_;
  return state;
}

}  // namespace triax::manager
