#include "kvmanager/manager_core.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvmanager/allocator.h"
#include "kvmanager/manager_core_internal.h"
#include "kvmanager/tagger.h"

namespace triax::manager {

namespace {

// Validates spans and returns their total token count.
absl::StatusOr<uint64_t> ValidateSpans(const std::vector<Span>& spans) {
  if (spans.empty()) return absl::InvalidArgumentError("spans is empty");
  uint64_t total = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (!IsValid(s.role)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "].role is ", RoleName(s.role), "; a role is required"));
    }
    if (!IsValid(s.modality)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "].modality is ", ModalityName(s.modality)));
    }
    if (s.num_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("spans[", i, "].num_tokens is 0; it must be >= 1"));
    }
    if (i > 0 && s.turn_offset < spans[i - 1].turn_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "].turn_offset ", s.turn_offset, " is below spans[",
          i - 1, "].turn_offset ", spans[i - 1].turn_offset));
    }
    total += s.num_tokens;
  }
  // At most one turn per token (the tagger never makes more).
  if (spans.back().turn_offset > total) {
    return absl::InvalidArgumentError(
        absl::StrCat("spans end in turn_offset ", spans.back().turn_offset,
                     ", more than their ", total, " tokens"));
  }
  return total;
}

// The spans of a request: its explicit spans, or the tagger's spans of its
// rendered text (into *storage). Exactly one of them must be given.
absl::StatusOr<const std::vector<Span>*> RequestSpans(
    const std::vector<Span>& spans, const std::optional<RenderedText>& rendered,
    TurnNumbering numbering, std::vector<Span>* storage) {
  if (!rendered.has_value() && spans.empty()) {
    return absl::InvalidArgumentError(
        "spans is empty and rendered is not set; exactly one of spans and "
        "rendered must be given");
  }
  if (rendered.has_value() && !spans.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spans has ", spans.size(),
        " entries and rendered is set; exactly one of spans and rendered "
        "must be given"));
  }
  if (!rendered.has_value()) return &spans;
  TRIAX_ASSIGN_OR_RETURN(std::vector<TaggedSpan> tagged,
                         TagRendered(*rendered, numbering));
  *storage = ToSpans(tagged);
  return storage;
}

Modality Normalize(Modality m) {
  return m == Modality::kUnspecified ? Modality::kText : m;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

kernels::PageShape ShapeOf(const ModelShape& m, uint32_t block_tokens) {
  return kernels::PageShape{static_cast<int>(block_tokens),
                            static_cast<int>(m.n_kv_heads),
                            static_cast<int>(m.head_dim)};
}

// n_layers pages of one block in encoding `e`.
uint64_t BlockBytes(const ModelShape& m, uint32_t block_tokens,
                    const Encoding& e) {
  return uint64_t{m.n_layers} * kernels::PageBytes(e, ShapeOf(m, block_tokens));
}

// Every rule's encoding must be valid for the shape.
absl::Status CheckPolicyForShape(const Policy& p, const ModelShape& m,
                                 uint32_t block_tokens) {
  const kernels::PageShape shape = ShapeOf(m, block_tokens);
  for (size_t i = 0; i < p.candidates.size(); ++i) {
    const char* why = kernels::ValidateEncoding(p.candidates[i], shape);
    if (why == nullptr) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "policy ", Quote(p.name), " candidates[", i, "] encoding ",
        EncodingString(p.candidates[i]), " is invalid for block_tokens ",
        block_tokens, ", n_kv_heads ", m.n_kv_heads, ", head_dim ", m.head_dim,
        ": ", why));
  }
  for (size_t i = 0; i < p.rules.size(); ++i) {
    const char* why = kernels::ValidateEncoding(p.rules[i].encoding, shape);
    if (why == nullptr) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "policy ", Quote(p.name), " rules[", i, "] encoding ",
        EncodingString(p.rules[i].encoding), " is invalid for block_tokens ",
        block_tokens, ", n_kv_heads ", m.n_kv_heads, ", head_dim ", m.head_dim,
        ": ", why));
  }
  return absl::OkStatus();
}

// Tag key with a total order, for grouping blocks by tag deterministically.
int TagKey(const Tag& t) {
  return static_cast<int>(t.temporal) * 64 +
         static_cast<int>(Normalize(t.modality)) * 16 +
         static_cast<int>(t.role);
}

// Distinct tags of `tags` with their token counts, ordered by TagKey.
std::vector<std::pair<Tag, int64_t>> GroupTags(
    const std::vector<std::pair<Tag, uint32_t>>& tags) {
  std::map<int, std::pair<Tag, int64_t>> by_key;
  for (const auto& [tag, n] : tags) {
    auto& g = by_key.try_emplace(TagKey(tag), tag, 0).first->second;
    g.second += n;
  }
  std::vector<std::pair<Tag, int64_t>> out;
  out.reserve(by_key.size());
  for (auto& [k, g] : by_key) out.push_back(g);
  return out;
}

// Fallback order of calibration tags for a block tag of role r: same role
// only; nearest temporal first (ties to the older), then the same modality,
// then TEXT, then the smaller modality.
std::tuple<int, int, int, int, int> SourceRank(const Tag& want,
                                               const Tag& have) {
  const int tw = static_cast<int>(want.temporal);
  const int th = static_cast<int>(have.temporal);
  const Modality mw = Normalize(want.modality);
  const Modality mh = Normalize(have.modality);
  return {std::abs(tw - th), -th, mh == mw ? 0 : 1,
          mh == Modality::kText ? 0 : 1, static_cast<int>(mh)};
}

}  // namespace

ManagerCore::ManagerCore(const ManagerOptions& options, const Clock* clock)
    : options_(options),
      clock_(clock),
      events_(EventLog::Options{options.event_retention,
                                options.watcher_queue_limit}),
      register_cache_(options.idempotency_capacity),
      tenant_cache_(options.idempotency_capacity),
      open_cache_(options.idempotency_capacity),
      extend_cache_(options.idempotency_capacity),
      close_cache_(options.idempotency_capacity),
      policy_cache_(options.idempotency_capacity),
      demote_cache_(options.idempotency_capacity),
      calibration_cache_(options.idempotency_capacity) {}

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
  if (options.event_retention == 0 || options.watcher_queue_limit == 0) {
    return absl::InvalidArgumentError(
        "event_retention and watcher_queue_limit must be > 0");
  }
  const Watermarks& wm = options.watermarks;
  if (!(wm.low > 0 && wm.low <= wm.high && wm.high <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("watermarks low ", wm.low, " and high ", wm.high,
                     " must satisfy 0 < low <= high <= 1"));
  }
  const RankerOptions& r = options.ranker;
  for (const auto& [name, v] :
       {std::pair<const char*, double>{"evict_factor", r.evict_factor},
        {"spill_host_penalty", r.spill_host_penalty},
        {"spill_disk_penalty", r.spill_disk_penalty},
        {"reuse_half_life_ms", r.reuse_half_life_ms},
        {"default_evict_distortion", r.default_evict_distortion},
        {"importance_weight", r.importance_weight}}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " ", v, " must be finite and >= 0"));
    }
  }
  if (!(r.reuse_half_life_ms > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reuse_half_life_ms ", r.reuse_half_life_ms, " must be > 0"));
  }
  for (Role role : r.protected_roles) {
    if (!IsValid(role)) {
      return absl::InvalidArgumentError(
          absl::StrCat("protected_roles has ", RoleName(role), ", not a role"));
    }
  }
  return std::unique_ptr<ManagerCore>(new ManagerCore(options, clock));
}

// --- Helpers
// -------------------------------------------------------------------

Temporal ManagerCore::TemporalFor(uint32_t index, uint32_t turn,
                                  uint32_t current) const {
  return triax::TemporalFor(index, turn, current, options_.recent_turns);
}

Encoding ManagerCore::EncodingOfLocked(const Sequence& s,
                                       const Tag& tag) const {
  if (!s.policy->IsAllocation()) return s.policy->EncodingFor(tag);
  for (const auto& [t, e] : s.allocation) {
    if (t == tag) return e;
  }
  // Not reached: every tag of the sequence is allocated before its blocks
  // are created. BF16 is the safe side (it never loses precision).
  return Encoding(Format::kBF16);
}

absl::StatusOr<ManagerCore::Allocation> ManagerCore::AllocateLocked(
    const Policy& policy, const Calibration& table, const ModelShape& model,
    uint32_t block_tokens, const std::vector<TagTokens>& groups,
    bool allow_infeasible, bool* infeasible) const {
  const kernels::PageShape shape = ShapeOf(model, block_tokens);
  // Usable entries: candidates valid for the sequence's shape.
  std::vector<size_t> usable;
  for (size_t i = 0; i < table.encodings.size(); ++i) {
    const Encoding& e = table.encodings[i];
    if (!policy.IsCandidate(e)) continue;
    if (kernels::ValidateEncoding(e, shape) != nullptr) continue;
    usable.push_back(i);
  }
  TRIAX_ASSIGN_OR_RETURN(
      const AllocOption bf16,
      MakeAllocOption(Encoding(Format::kBF16), shape, /*distortion=*/0));
  AllocProblem problem;
  problem.budget_bits = policy.budget_bits;
  problem.groups.reserve(groups.size());
  for (const TagTokens& g : groups) {
    AllocGroup group;
    group.tag = g.tag;
    group.tokens = g.tokens;
    if (!policy.IsPinned(g.tag)) {
      // The calibration tag to take options from (see the header).
      const Tag* source = nullptr;
      std::tuple<int, int, int, int, int> best;
      for (size_t i : usable) {
        const Tag& have = table.info.entries[i].tag;
        if (have.role != g.tag.role) continue;
        const auto rank = SourceRank(g.tag, have);
        if (source == nullptr || rank < best) {
          source = &have;
          best = rank;
        }
      }
      if (source != nullptr) {
        for (size_t i : usable) {
          const CalibrationEntryInfo& entry = table.info.entries[i];
          if (!(entry.tag == *source)) continue;
          TRIAX_ASSIGN_OR_RETURN(
              AllocOption o,
              MakeAllocOption(table.encodings[i], shape, entry.distortion));
          group.options.push_back(o);
        }
      }
    }
    if (group.options.empty()) {
      group.options.push_back(bf16);
      group.pinned = true;
    }
    problem.groups.push_back(std::move(group));
  }
  std::vector<int> choice;
  auto solved = Solve(problem);
  if (solved.ok()) {
    choice = std::move(solved->choice);
  } else if (solved.status().code() == absl::StatusCode::kResourceExhausted &&
             allow_infeasible) {
    *infeasible = true;
    choice.reserve(problem.groups.size());
    for (const AllocGroup& g : problem.groups) {
      int cheapest = 0;
      for (size_t i = 1; i < g.options.size(); ++i) {
        const AllocOption& o = g.options[i];
        const AllocOption& c = g.options[cheapest];
        if (o.bits < c.bits ||
            (o.bits == c.bits && o.distortion < c.distortion))
          cheapest = static_cast<int>(i);
      }
      choice.push_back(g.pinned ? 0 : cheapest);
    }
  } else {
    return absl::Status(
        solved.status().code(),
        absl::StrCat("policy ", Quote(policy.name), " (calibration ",
                     Quote(table.info.model), ", budget_bits ",
                     policy.budget_bits, "): ", solved.status().message()));
  }
  Allocation out;
  out.reserve(problem.groups.size());
  for (size_t k = 0; k < problem.groups.size(); ++k) {
    out.emplace_back(problem.groups[k].tag,
                     problem.groups[k].options[choice[k]].encoding);
  }
  return out;
}

Event ManagerCore::MakeEvent(EventKind kind, const Sequence* s,
                             const Block* b) const {
  Event e;
  e.unix_ms = clock_->NowMs();
  e.kind = kind;
  if (s != nullptr) {
    e.sequence_id = s->id;
    e.tenant_id = s->tenant->id;
    e.worker_id = s->worker->info.worker_id;
  }
  if (b != nullptr) {
    e.lineage_id = b->lineage_id;
    e.tag = b->tag;
    e.format = b->encoding.k;
  }
  return e;
}

BlockPlan ManagerCore::PlanOf(const Block& b) const {
  BlockPlan p;
  p.index = b.index;
  p.lineage_id = b.lineage_id;
  p.first_token = b.first_token;
  p.num_tokens = b.num_tokens;
  p.capacity = b.capacity;
  p.tag = b.tag;
  p.encoding = b.encoding;
  p.refcount = b.refcount;
  p.tier = b.tier;
  p.evicted = b.evicted;
  return p;
}

SequenceInfo ManagerCore::InfoLocked(const Sequence& s,
                                     bool with_blocks) const {
  SequenceInfo info;
  info.sequence_id = s.id;
  info.tenant_id = s.tenant->id;
  info.model = s.model;
  info.worker_id = s.worker->info.worker_id;
  info.worker_address = s.worker->info.address;
  info.state = s.state;
  info.block_tokens = s.block_tokens;
  info.num_tokens = s.num_tokens;
  info.turns = s.current_turn + 1;
  info.policy = s.policy->name;
  info.parent_sequence_id = s.parent;
  info.bytes = s.bytes;
  info.lost_lineage_ids = s.lost_lineage_ids;
  if (with_blocks) {
    info.blocks.reserve(s.blocks.size());
    for (const Block* b : s.blocks) info.blocks.push_back(PlanOf(*b));
  }
  return info;
}

TenantInfo ManagerCore::TenantInfoLocked(const Tenant& t) const {
  TenantInfo info;
  info.tenant_id = t.id;
  for (int tier = 1; tier < kNumTiers; ++tier) {
    if (t.budgets[tier]) info.budgets.push_back(*t.budgets[tier]);
    info.usage.push_back(TierUsage{static_cast<Tier>(tier), t.used[tier]});
  }
  info.open_sequences = t.open_sequences;
  info.default_policy = t.default_policy;
  return info;
}

WorkerInfo ManagerCore::WorkerInfoLocked(const Worker& w) const {
  WorkerInfo info = w.info;
  info.reserved_bytes = w.reserved;
  info.sequences = static_cast<uint32_t>(w.open.size());
  return info;
}

absl::StatusOr<ManagerCore::Tenant*> ManagerCore::FindTenantLocked(
    const std::string& tenant_id) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  auto it = tenants_.find(tenant_id);
  if (it == tenants_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tenant_id ", Quote(tenant_id), " is not a known tenant"));
  }
  return it->second.get();
}

absl::StatusOr<ManagerCore::Sequence*> ManagerCore::FindOpenSequenceLocked(
    const std::string& tenant_id, const std::string& field,
    const std::string& sequence_id) const {
  TRIAX_ASSIGN_OR_RETURN(Tenant * tenant, FindTenantLocked(tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId(field, sequence_id));
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat(field, " ", Quote(sequence_id),
                                            " is not a known sequence"));
  }
  Sequence* s = it->second.get();
  if (s->tenant != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, " ", Quote(sequence_id),
                     " belongs to another tenant, not ", Quote(tenant_id)));
  }
  if (s->state != SequenceState::kOpen) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " ", Quote(sequence_id), " is ",
        s->state == SequenceState::kClosed ? "closed"
                                           : "lost (its worker went down)"));
  }
  return s;
}

absl::Status ManagerCore::AdmitLocked(const Tenant& t, uint64_t bytes) const {
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

absl::Status ManagerCore::FitsWorkerLocked(const Worker& w,
                                           uint64_t bytes) const {
  const uint64_t free =
      w.info.capacity_bytes - std::min(w.reserved, w.info.capacity_bytes);
  if (bytes <= free) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("worker ", Quote(w.info.worker_id), " has ", free,
                   " free bytes; the request needs ", bytes, " bytes; over by ",
                   bytes - free, " bytes"));
}

absl::StatusOr<ManagerCore::Worker*> ManagerCore::PlaceLocked(
    uint64_t bytes) const {
  Worker* best = nullptr;
  uint64_t best_free = 0;
  for (const auto& [id, w] : workers_) {
    if (w->info.state != WorkerState::kUp) continue;
    // A worker whose device failed (sticky CUDA error) takes nothing new.
    if (!w->info.inventory.device_error.empty()) continue;
    const uint64_t free =
        w->info.capacity_bytes - std::min(w->reserved, w->info.capacity_bytes);
    // Ties go to the smaller id so placement is deterministic.
    if (best == nullptr || free > best_free ||
        (free == best_free && id < best->info.worker_id)) {
      best = w.get();
      best_free = free;
    }
  }
  if (best == nullptr) {
    return absl::UnavailableError("no worker is up with a healthy device");
  }
  if (best_free < bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no worker has room: the request needs ", bytes,
                     " bytes; the largest free space is ", best_free,
                     " bytes (worker ", Quote(best->info.worker_id),
                     "); over by ", bytes - best_free, " bytes"));
  }
  return best;
}

ManagerCore::Block* ManagerCore::NewBlockLocked(Sequence* s,
                                                const PlannedBlock& pb,
                                                uint32_t turn,
                                                std::vector<Event>* ev) {
  auto block = std::make_unique<Block>();
  Block* b = block.get();
  b->index = static_cast<uint32_t>(s->blocks.size());
  b->lineage_id = next_lineage_++;
  b->first_token = pb.first_token;
  b->num_tokens = pb.num_tokens;
  b->capacity = s->block_tokens;
  b->tag =
      Tag{TemporalFor(b->index, turn, s->current_turn), pb.modality, pb.role};
  b->encoding = EncodingOfLocked(*s, b->tag);
  b->refcount = 1;
  b->turn = turn;
  b->bytes = BlockBytes(s->model, s->block_tokens, b->encoding);
  b->charged = s->tenant;
  b->worker = s->worker;
  b->creator = s->id;
  b->owner = s;
  graph_.AddBlock(b->lineage_id, clock_->NowMs());
  // Tool call -> tool result: a result's blocks link to the newest call.
  if (b->tag.role == Role::kToolCall) {
    s->last_tool_call = b->lineage_id;
  } else if (b->tag.role == Role::kToolResult && s->last_tool_call != 0) {
    graph_.Link(s->last_tool_call, b->lineage_id, EdgeKind::kToolCallResult);
  }
  s->blocks.push_back(b);
  s->bytes += b->bytes;
  s->tenant->used[static_cast<int>(Tier::kDevice)] += b->bytes;
  s->worker->reserved += b->bytes;
  Event e = MakeEvent(EventKind::kBlockCreated, s, b);
  e.detail = absl::StrCat("index=", b->index, " first_token=", b->first_token,
                          " num_tokens=", b->num_tokens, " bytes=", b->bytes,
                          " encoding=", EncodingString(b->encoding));
  ev->push_back(std::move(e));
  blocks_.emplace(b->lineage_id, std::move(block));
  return b;
}

void ManagerCore::ReleaseBlockLocked(
    Sequence* s, Block* b, bool lost, std::vector<uint64_t>* freed,
    std::vector<Event>* ev, std::vector<EventLog::LastPlan>* forgotten) {
  --b->refcount;
  ev->push_back(MakeEvent(
      lost ? EventKind::kBlockLost : EventKind::kBlockReleased, s, b));
  if (b->refcount > 0) {
    if (b->owner == s) {
      // Another holder keeps it: a fork on the same worker.
      b->owner = nullptr;
      for (Sequence* o : s->worker->open) {
        if (o != s && b->index < o->blocks.size() && o->blocks[b->index] == b) {
          b->owner = o;
          break;
        }
      }
    }
    return;
  }
  // Bytes are charged to the block's tier; an evicted block holds none.
  if (!b->evicted) {
    const int tier = static_cast<int>(b->tier);
    b->charged->used[tier] -= b->bytes;
    if (b->tier == Tier::kDevice) {
      b->worker->reserved -= b->bytes;
    } else {
      b->worker->tier_used[tier] -= b->bytes;
    }
  }
  graph_.RemoveBlock(b->lineage_id);
  if (!lost) {
    Event e = MakeEvent(EventKind::kBlockFreed, s, b);
    e.detail = absl::StrCat("bytes=", b->bytes);
    ev->push_back(std::move(e));
  }
  if (freed != nullptr) freed->push_back(b->lineage_id);
  forgotten->push_back(EventLog::LastPlan{PlanOf(*b), b->creator});
  blocks_.erase(b->lineage_id);
}

void ManagerCore::RetireLocked(Sequence* s) {
  s->tenant->open_sequences--;
  s->worker->open.erase(s);
  s->blocks.clear();
  s->blocks.shrink_to_fit();
  s->turn_start.clear();
  s->turn_start.shrink_to_fit();
  s->bytes = 0;
  retired_.push_back(s->id);
  while (retired_.size() > options_.closed_retention) {
    sequences_.erase(retired_.front());
    retired_.pop_front();
  }
}

void ManagerCore::MarkLostLocked(Sequence* s, const std::string& reason,
                                 std::vector<Event>* ev,
                                 std::vector<EventLog::LastPlan>* forgotten) {
  s->lost_lineage_ids.reserve(s->blocks.size());
  for (Block* b : s->blocks) {
    s->lost_lineage_ids.push_back(b->lineage_id);
    ReleaseBlockLocked(s, b, /*lost=*/true, nullptr, ev, forgotten);
  }
  s->state = SequenceState::kLost;
  ++s->version;
  Event e = MakeEvent(EventKind::kSequenceLost, s, nullptr);
  e.lineage_ids = s->lost_lineage_ids;
  e.detail =
      absl::StrCat("reason=", reason, " blocks=", s->lost_lineage_ids.size());
  ev->push_back(std::move(e));
  RetireLocked(s);
}

// --- Workers
// -------------------------------------------------------------------

absl::StatusOr<RegisterWorkerResult> ManagerCore::RegisterWorker(
    const RegisterWorkerRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("worker_id", req.worker_id));
  if (req.address.empty() || req.address.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("address ", Quote(req.address),
                     " must be a host:port of 1..256 bytes"));
  }
  if (req.backend.empty())
    return absl::InvalidArgumentError("backend is empty");
  if (req.capacity_bytes == 0) {
    return absl::InvalidArgumentError("capacity_bytes is 0; it must be > 0");
  }
  absl::MutexLock lock(&mu_);
  if (auto hit = register_cache_.Find(req.worker_id, req.request_id)) {
    return hit->reply;
  }
  std::vector<Event> ev;
  std::vector<EventLog::LastPlan> forgotten;
  RegisterWorkerResult result;
  result.heartbeat_interval_ms = options_.heartbeat_interval_ms;
  auto it = workers_.find(req.worker_id);
  Worker* w;
  if (it != workers_.end()) {
    w = it->second.get();
    if (w->info.state == WorkerState::kUp && w->info.address != req.address) {
      return absl::AlreadyExistsError(
          absl::StrCat("worker_id ", Quote(req.worker_id), " is up at address ",
                       Quote(w->info.address), "; a worker at address ",
                       Quote(req.address), " cannot take it"));
    }
    // It restarted: whatever it held is gone.
    std::vector<Sequence*> lost(w->open.begin(), w->open.end());
    std::sort(
        lost.begin(), lost.end(),
        [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
    for (Sequence* s : lost) {
      result.lost_sequence_ids.push_back(s->id);
      MarkLostLocked(s, "worker_restarted", &ev, &forgotten);
    }
  } else {
    auto fresh = std::make_unique<Worker>();
    w = fresh.get();
    workers_.emplace(req.worker_id, std::move(fresh));
  }
  w->info.worker_id = req.worker_id;
  w->info.address = req.address;
  w->info.backend = req.backend;
  w->info.capacity_bytes = req.capacity_bytes;
  w->info.host_capacity_bytes = req.host_capacity_bytes;
  w->info.disk_capacity_bytes = req.disk_capacity_bytes;
  w->info.state = WorkerState::kUp;
  w->info.last_heartbeat_unix_ms = clock_->NowMs();
  w->info.inventory = Inventory{};
  Event e;
  e.unix_ms = clock_->NowMs();
  e.kind = EventKind::kWorkerUp;
  e.worker_id = req.worker_id;
  e.detail = absl::StrCat("address=", req.address, " backend=", req.backend,
                          " capacity_bytes=", req.capacity_bytes,
                          " lost_sequences=", result.lost_sequence_ids.size());
  ev.push_back(std::move(e));
  events_.Append(&ev, &forgotten);
  register_cache_.Put(req.worker_id, req.request_id, absl::OkStatus(), result);
  return result;
}

absl::Status ManagerCore::Heartbeat(const std::string& worker_id,
                                    const Inventory& inventory) {
  TRIAX_RETURN_IF_ERROR(ValidateId("worker_id", worker_id));
  for (size_t i = 0; i < inventory.formats.size(); ++i) {
    if (!IsValidFormat(inventory.formats[i].format)) {
      return absl::InvalidArgumentError(
          absl::StrCat("inventory.formats[", i, "].format is ",
                       FormatProtoName(inventory.formats[i].format)));
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker_id ", Quote(worker_id),
                                            " is not registered; re-register"));
  }
  Worker* w = it->second.get();
  if (w->info.state != WorkerState::kUp) {
    return absl::NotFoundError(
        absl::StrCat("worker_id ", Quote(worker_id),
                     " was marked down (missed heartbeats); re-register"));
  }
  w->info.last_heartbeat_unix_ms = clock_->NowMs();
  w->info.inventory = inventory;
  if (!inventory.restored_lineage_ids.empty()) {
    std::vector<Event> ev;
    ApplyWorkerRestoresLocked(w, inventory.restored_lineage_ids, &ev);
    w->info.inventory.restored_lineage_ids.clear();
    events_.Append(&ev);
  }
  return absl::OkStatus();
}

std::vector<WorkerInfo> ManagerCore::ListWorkers() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerInfo> out;
  out.reserve(workers_.size());
  for (const auto& [id, w] : workers_) out.push_back(WorkerInfoLocked(*w));
  std::sort(out.begin(), out.end(),
            [](const WorkerInfo& a, const WorkerInfo& b) {
              return a.worker_id < b.worker_id;
            });
  return out;
}

std::vector<std::string> ManagerCore::CheckWorkers() {
  absl::MutexLock lock(&mu_);
  const int64_t now = clock_->NowMs();
  std::vector<Worker*> down;
  for (const auto& [id, w] : workers_) {
    if (w->info.state == WorkerState::kUp &&
        now - w->info.last_heartbeat_unix_ms > options_.worker_timeout_ms) {
      down.push_back(w.get());
    }
  }
  std::sort(down.begin(), down.end(), [](const Worker* a, const Worker* b) {
    return a->info.worker_id < b->info.worker_id;
  });
  std::vector<std::string> ids;
  std::vector<Event> ev;
  std::vector<EventLog::LastPlan> forgotten;
  for (Worker* w : down) {
    ids.push_back(w->info.worker_id);
    std::vector<Sequence*> lost(w->open.begin(), w->open.end());
    std::sort(
        lost.begin(), lost.end(),
        [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
    for (Sequence* s : lost) MarkLostLocked(s, "worker_down", &ev, &forgotten);
    w->info.state = WorkerState::kDown;
    Event e;
    e.unix_ms = now;
    e.kind = EventKind::kWorkerDown;
    e.worker_id = w->info.worker_id;
    e.detail = absl::StrCat("silent_ms=", now - w->info.last_heartbeat_unix_ms,
                            " lost_sequences=", lost.size());
    ev.push_back(std::move(e));
  }
  if (!ev.empty()) events_.Append(&ev, &forgotten);
  return ids;
}

// --- Tenants
// -------------------------------------------------------------------

namespace {

absl::Status ValidateBudget(const std::string& field, const Budget& b) {
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

}  // namespace

absl::StatusOr<TenantInfo> ManagerCore::CreateTenant(
    const CreateTenantRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  std::array<std::optional<Budget>, kNumTiers> budgets;
  for (size_t i = 0; i < req.budgets.size(); ++i) {
    const std::string field = absl::StrCat("budgets[", i, "]");
    TRIAX_RETURN_IF_ERROR(ValidateBudget(field, req.budgets[i]));
    const int tier = static_cast<int>(req.budgets[i].tier);
    if (budgets[tier]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".tier ", TierName(req.budgets[i].tier), " appears twice"));
    }
    budgets[tier] = req.budgets[i];
  }
  const std::string policy =
      req.default_policy.empty() ? options_.default_policy : req.default_policy;
  absl::MutexLock lock(&mu_);
  if (auto hit = tenant_cache_.Find("CreateTenant", req.request_id)) {
    return hit->reply;
  }
  TRIAX_RETURN_IF_ERROR(FindPolicyLocked("default_policy", policy).status());
  if (tenants_.contains(req.tenant_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("tenant_id ", Quote(req.tenant_id), " already exists"));
  }
  auto t = std::make_unique<Tenant>();
  t->id = req.tenant_id;
  t->budgets = budgets;
  t->default_policy = policy;
  TenantInfo info = TenantInfoLocked(*t);
  tenants_.emplace(req.tenant_id, std::move(t));
  std::vector<Event> ev(1);
  ev[0].unix_ms = clock_->NowMs();
  ev[0].kind = EventKind::kTenantChanged;
  ev[0].tenant_id = req.tenant_id;
  ev[0].detail = absl::StrCat("created=true default_policy=", policy);
  events_.Append(&ev);
  tenant_cache_.Put("CreateTenant", req.request_id, absl::OkStatus(), info);
  return info;
}

absl::StatusOr<TenantInfo> ManagerCore::SetBudget(const SetBudgetRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateBudget("budget", req.budget));
  absl::MutexLock lock(&mu_);
  const std::string key = absl::StrCat("SetBudget/", req.tenant_id);
  if (auto hit = tenant_cache_.Find(key, req.request_id)) return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(Tenant * t, FindTenantLocked(req.tenant_id));
  t->budgets[static_cast<int>(req.budget.tier)] = req.budget;
  TenantInfo info = TenantInfoLocked(*t);
  std::vector<Event> ev(1);
  ev[0].unix_ms = clock_->NowMs();
  ev[0].kind = EventKind::kTenantChanged;
  ev[0].tenant_id = req.tenant_id;
  ev[0].detail = absl::StrCat("tier=", TierName(req.budget.tier),
                              " floor_bytes=", req.budget.floor_bytes,
                              " ceiling_bytes=", req.budget.ceiling_bytes);
  events_.Append(&ev);
  tenant_cache_.Put(key, req.request_id, absl::OkStatus(), info);
  return info;
}

absl::StatusOr<TenantInfo> ManagerCore::GetTenant(
    const std::string& tenant_id) const {
  absl::MutexLock lock(&mu_);
  TRIAX_ASSIGN_OR_RETURN(Tenant * t, FindTenantLocked(tenant_id));
  return TenantInfoLocked(*t);
}

std::vector<TenantInfo> ManagerCore::ListTenants() const {
  absl::MutexLock lock(&mu_);
  std::vector<TenantInfo> out;
  out.reserve(tenants_.size());
  for (const auto& [id, t] : tenants_) out.push_back(TenantInfoLocked(*t));
  std::sort(out.begin(), out.end(),
            [](const TenantInfo& a, const TenantInfo& b) {
              return a.tenant_id < b.tenant_id;
            });
  return out;
}

// --- Sequences
// -----------------------------------------------------------------

absl::StatusOr<SequenceInfo> ManagerCore::OpenSequence(
    const OpenSequenceRequest& req, AdmissionShortfall* shortfall) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateModelShape(req.model));
  std::vector<Span> tagged;
  TRIAX_ASSIGN_OR_RETURN(
      const std::vector<Span>* spans,
      RequestSpans(req.spans, req.rendered, TurnNumbering::kOpen, &tagged));
  TRIAX_ASSIGN_OR_RETURN(const uint64_t total, ValidateSpans(*spans));
  const uint32_t T =
      req.block_tokens == 0 ? options_.default_block_tokens : req.block_tokens;
  if (T > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tokens ", req.block_tokens, " is outside 1..", kMaxBlockTokens));
  }
  if (total > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spans hold ", total, " tokens; the limit is ", kMaxSequenceTokens));
  }
  uint64_t num_blocks = 0;
  for (const Span& s : *spans) num_blocks += CeilDiv(s.num_tokens, T);
  // Spans of several turns (rendered text): the last one is current.
  const uint32_t last_turn = spans->back().turn_offset;
  if (num_blocks > kMaxSequenceBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("spans need ", num_blocks, " blocks of ", T,
                     " tokens; the limit is ", kMaxSequenceBlocks));
  }

  absl::MutexLock lock(&mu_);
  const std::string cache_key = absl::StrCat("OpenSequence/", req.tenant_id);
  if (auto hit = open_cache_.Find(cache_key, req.request_id)) return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(Tenant * tenant, FindTenantLocked(req.tenant_id));
  const std::string& policy_name =
      req.policy.empty() ? tenant->default_policy : req.policy;
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const Policy> policy,
                         FindPolicyLocked("policy", policy_name));
  TRIAX_RETURN_IF_ERROR(CheckPolicyForShape(*policy, req.model, T));

  auto seq = std::make_unique<Sequence>();
  Sequence* s = seq.get();
  s->tenant = tenant;
  s->model = req.model;
  s->block_tokens = T;
  s->policy = policy;
  // Plan first (no state touched), then admit and place, then commit.
  std::vector<PlannedBlock> planned;
  planned.reserve(num_blocks);
  std::vector<std::pair<Tag, uint32_t>> tags;
  tags.reserve(num_blocks);
  uint64_t pos = 0;
  for (const Span& sp : *spans) {
    for (uint32_t done = 0; done < sp.num_tokens;) {
      const uint32_t n = std::min(T, sp.num_tokens - done);
      planned.push_back(PlannedBlock{pos, n, sp.role, Normalize(sp.modality),
                                     sp.turn_offset});
      tags.emplace_back(
          Tag{TemporalFor(static_cast<uint32_t>(planned.size() - 1),
                          sp.turn_offset, last_turn),
              Normalize(sp.modality), sp.role},
          n);
      pos += n;
      done += n;
    }
  }
  if (policy->IsAllocation()) {
    auto it = calibrations_.find(policy->calibration_model);
    if (it == calibrations_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "policy ", Quote(policy->name), " needs the calibration table of ",
          "model ", Quote(policy->calibration_model),
          ", which is not stored; PutCalibration it first"));
    }
    const ModelShape& cm = it->second->info.shape;
    if (cm.n_layers != req.model.n_layers ||
        cm.n_kv_heads != req.model.n_kv_heads ||
        cm.n_q_heads != req.model.n_q_heads ||
        cm.head_dim != req.model.head_dim) {
      return absl::FailedPreconditionError(absl::StrCat(
          "policy ", Quote(policy->name), ": calibration ",
          Quote(policy->calibration_model), " was measured on n_layers ",
          cm.n_layers, ", n_kv_heads ", cm.n_kv_heads, ", n_q_heads ",
          cm.n_q_heads, ", head_dim ", cm.head_dim, "; the model has n_layers ",
          req.model.n_layers, ", n_kv_heads ", req.model.n_kv_heads,
          ", n_q_heads ", req.model.n_q_heads, ", head_dim ",
          req.model.head_dim));
    }
    std::vector<TagTokens> groups;
    for (const auto& [tag, n] : GroupTags(tags))
      groups.push_back(TagTokens{tag, n});
    TRIAX_ASSIGN_OR_RETURN(
        s->allocation,
        AllocateLocked(*policy, *it->second, req.model, T, groups,
                       /*allow_infeasible=*/false, nullptr));
    s->calibration = it->second;
  }
  uint64_t bytes = 0;
  for (const auto& [tag, n] : tags) {
    bytes += BlockBytes(req.model, T, EncodingOfLocked(*s, tag));
  }
  if (absl::Status st = AdmitLocked(*tenant, bytes); !st.ok()) {
    if (shortfall != nullptr) {
      absl::StatusOr<Worker*> w = PlaceLocked(0);
      *shortfall = AdmissionShortfall{
          tenant->id, w.ok() ? (*w)->info.worker_id : "", bytes};
    }
    return st;
  }
  absl::StatusOr<Worker*> placed = PlaceLocked(bytes);
  if (!placed.ok()) {
    if (shortfall != nullptr && absl::IsResourceExhausted(placed.status())) {
      absl::StatusOr<Worker*> w = PlaceLocked(0);
      if (w.ok()) {
        *shortfall =
            AdmissionShortfall{tenant->id, (*w)->info.worker_id, bytes};
      }
    }
    return placed.status();
  }
  Worker* worker = *placed;

  s->id = absl::StrCat("seq-", next_sequence_++);
  s->worker = worker;
  s->last_access_ms = clock_->NowMs();
  s->current_turn = last_turn;
  s->turn_start.push_back(0);
  s->blocks.reserve(planned.size());
  std::vector<Event> ev;
  ev.reserve(planned.size() + 1);
  for (const PlannedBlock& pb : planned) {
    while (s->turn_start.size() <= pb.turn) {
      s->turn_start.push_back(static_cast<uint32_t>(s->blocks.size()));
    }
    NewBlockLocked(s, pb, pb.turn, &ev);
  }
  s->num_tokens = total;
  tenant->open_sequences++;
  worker->open.insert(s);
  Event e = MakeEvent(EventKind::kSequenceOpened, s, nullptr);
  e.detail = absl::StrCat("blocks=", s->blocks.size(), " tokens=", total,
                          " bytes=", s->bytes, " policy=", policy->name,
                          " block_tokens=", T);
  ev.push_back(std::move(e));
  SequenceInfo info = InfoLocked(*s, /*with_blocks=*/true);
  sequences_.emplace(s->id, std::move(seq));
  events_.Append(&ev);
  open_cache_.Put(cache_key, req.request_id, absl::OkStatus(), info);
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
      RequestSpans(req.spans, req.rendered, TurnNumbering::kContinue, &tagged));
  TRIAX_ASSIGN_OR_RETURN(const uint64_t total, ValidateSpans(*spans));
  absl::MutexLock lock(&mu_);
  const std::string cache_key = absl::StrCat("ExtendSequence/", req.tenant_id);
  if (auto hit = extend_cache_.Find(cache_key, req.request_id))
    return hit->reply;
  if (!req.request_id.empty()) {
    for (const auto& [token, p] : pending_) {
      if (p->from_extend && p->tenant_id == req.tenant_id &&
          p->extend_request_id == req.request_id) {
        return absl::AbortedError(absl::StrCat(
            "ExtendSequence request_id ", Quote(req.request_id),
            " is already in progress (demoting blocks); retry later"));
      }
    }
  }
  TRIAX_ASSIGN_OR_RETURN(
      Sequence * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  const uint32_t T = s->block_tokens;
  // The turn of the first span; spans of rendered text may start later ones.
  const uint32_t prev = s->current_turn;
  const uint32_t base = req.new_turn ? prev + 1 : prev;
  const uint32_t first_turn = base + spans->front().turn_offset;
  const uint32_t turn = base + spans->back().turn_offset;  // the new current

  // How many of the first span's tokens fill the last block's free slots.
  Block* last = s->blocks.back();
  uint32_t fill = 0;
  if (req.continue_last_span && last->refcount == 1 &&
      last->tier == Tier::kDevice && !last->evicted && last->busy == 0 &&
      last->tag.role == (*spans)[0].role &&
      last->tag.modality == Normalize((*spans)[0].modality)) {
    fill = std::min(last->capacity - last->num_tokens, (*spans)[0].num_tokens);
  }
  if (s->num_tokens + total > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spans bring sequence_id ", Quote(s->id), " to ", s->num_tokens + total,
        " tokens; the limit is ", kMaxSequenceTokens));
  }
  // Plan the new blocks (never the sink: the sequence already has its first
  // block); the temporal class is taken against the new current turn.
  std::vector<PlannedBlock> planned;
  std::vector<std::pair<Tag, uint32_t>> new_tags;
  uint64_t pos = s->num_tokens;
  pos += fill;
  for (size_t i = 0; i < spans->size(); ++i) {
    const Span& sp = (*spans)[i];
    const uint32_t sp_turn = base + sp.turn_offset;
    uint32_t done = i == 0 ? fill : 0;
    while (done < sp.num_tokens) {
      const uint32_t n = std::min(T, sp.num_tokens - done);
      planned.push_back(
          PlannedBlock{pos, n, sp.role, Normalize(sp.modality), sp_turn});
      new_tags.emplace_back(
          Tag{TemporalFor(
                  static_cast<uint32_t>(s->blocks.size() + planned.size() - 1),
                  sp_turn, turn),
              Normalize(sp.modality), sp.role},
          n);
      pos += n;
      done += n;
    }
    if (s->blocks.size() + planned.size() > kMaxSequenceBlocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("spans bring sequence_id ", Quote(s->id), " past ",
                       kMaxSequenceBlocks, " blocks"));
    }
  }
  // Allocation policies: re-solve over every block's tag after this call.
  const bool allocating = s->policy->IsAllocation();
  Allocation allocation;
  bool infeasible = false;
  if (allocating) {
    std::vector<std::pair<Tag, uint32_t>> all;
    all.reserve(s->blocks.size() + new_tags.size());
    for (const Block* b : s->blocks) {
      const bool grown = fill > 0 && b == last;
      all.emplace_back(
          Tag{TemporalFor(b->index, grown ? first_turn : b->turn, turn),
              b->tag.modality, b->tag.role},
          b->num_tokens + (grown ? fill : 0));
    }
    all.insert(all.end(), new_tags.begin(), new_tags.end());
    std::vector<TagTokens> groups;
    for (const auto& [tag, n] : GroupTags(all))
      groups.push_back(TagTokens{tag, n});
    TRIAX_ASSIGN_OR_RETURN(
        allocation,
        AllocateLocked(*s->policy, *s->calibration, s->model, T, groups,
                       /*allow_infeasible=*/true, &infeasible));
  }
  uint64_t bytes = 0;
  for (const auto& [tag, n] : new_tags) {
    Encoding e = s->policy->EncodingFor(tag);
    if (allocating) {
      for (const auto& [t, chosen] : allocation) {
        if (t == tag) e = chosen;
      }
    }
    bytes += BlockBytes(s->model, T, e);
  }
  {
    absl::Status st = AdmitLocked(*s->tenant, bytes);
    if (st.ok()) st = FitsWorkerLocked(*s->worker, bytes);
    if (!st.ok()) {
      if (shortfall != nullptr) {
        *shortfall =
            AdmissionShortfall{s->tenant->id, s->worker->info.worker_id, bytes};
      }
      return st;
    }
  }
  s->last_access_ms = clock_->NowMs();

  // Commit.
  ++s->version;
  const size_t old_blocks = s->blocks.size();
  if (allocating) s->allocation = std::move(allocation);
  ExtendSequenceResult result;
  std::vector<Event> ev;
  ev.reserve(planned.size() + 8);
  if (turn > prev) {
    s->current_turn = turn;
    // Turn t starts at the first new block of a turn >= t.
    size_t k = 0;
    for (uint32_t t = prev + 1; t <= turn; ++t) {
      while (k < planned.size() && planned[k].turn < t) ++k;
      s->turn_start.push_back(static_cast<uint32_t>(s->blocks.size() + k));
    }
  }
  if (fill > 0) {
    last->num_tokens += fill;
    last->turn = first_turn;
  }
  if (turn > prev) {
    // Only turns whose class changes are visited: the previous current turn
    // (now recent or older) and the turns that fall out of the recent window
    // (prev-R .. turn-R-1), so the cost is O(changed).
    const uint32_t R = options_.recent_turns;
    std::vector<uint32_t> aged = {prev};
    if (prev > 0 && turn >= R + 1) {
      const uint32_t lo = prev >= R ? prev - R : 0;
      const uint32_t hi = std::min(prev - 1, turn - R - 1);
      for (uint32_t t = lo; t <= hi; ++t) aged.push_back(t);
    }
    for (uint32_t t : aged) {
      uint32_t begin = s->turn_start[t];
      if (begin > 0) --begin;  // a block grown into turn t sits just before it
      // Existing blocks only: the new ones are created with their final tag.
      const uint32_t end = std::min<uint32_t>(
          s->turn_start[t + 1], static_cast<uint32_t>(s->blocks.size()));
      for (uint32_t i = begin; i < end; ++i) {
        Block* b = s->blocks[i];
        if (b->turn != t) continue;
        const Temporal next = TemporalFor(b->index, b->turn, turn);
        if (next == b->tag.temporal) continue;
        Event e = MakeEvent(EventKind::kBlockRetagged, s, b);
        e.detail = absl::StrCat("from=", TemporalName(b->tag.temporal),
                                " to=", TemporalName(next), " turn=", turn);
        b->tag.temporal = next;
        e.tag = b->tag;
        ev.push_back(std::move(e));
        result.retagged_blocks.push_back(PlanOf(*b));
      }
    }
  }
  if (fill > 0) {
    const Temporal next = TemporalFor(last->index, last->turn, turn);
    if (next != last->tag.temporal) {
      Event e = MakeEvent(EventKind::kBlockRetagged, s, last);
      e.detail = absl::StrCat("from=", TemporalName(last->tag.temporal),
                              " to=", TemporalName(next), " turn=", turn,
                              " grown=true");
      last->tag.temporal = next;
      e.tag = last->tag;
      ev.push_back(std::move(e));
      result.retagged_blocks.push_back(PlanOf(*last));
    }
    result.grown_blocks.push_back(PlanOf(*last));
  }
  for (const PlannedBlock& pb : planned) {
    result.new_blocks.push_back(PlanOf(*NewBlockLocked(s, pb, pb.turn, &ev)));
  }
  s->num_tokens += total;
  Event e = MakeEvent(EventKind::kSequenceExtended, s, nullptr);
  e.detail = absl::StrCat(
      "new_blocks=", planned.size(), " filled_tokens=", fill, " tokens=", total,
      " new_turn=", turn > prev ? "true" : "false", " turn=", s->current_turn);
  ev.push_back(std::move(e));
  result.sequence = InfoLocked(*s, /*with_blocks=*/true);
  events_.Append(&ev);
  if (infeasible) {
    Log(LogLevel::kWarn, "manager",
        "allocation over budget: cheapest encodings taken",
        absl::StrCat(Kv("sequence_id", s->id), " ",
                     Kv("policy", s->policy->name), " ",
                     Kv("budget_bits", s->policy->budget_bits)));
  }
  // Existing blocks whose tag's choice is now smaller are demoted (never
  // promoted); blocks shared with a fork are immutable and keep theirs.
  if (allocating) {
    auto pending = std::make_unique<PendingDemote>();
    DemotePrepared prepared;
    for (size_t i = 0; i < old_blocks; ++i) {
      Block* b = s->blocks[i];
      // Shared blocks are immutable; spilled, evicted or busy ones are left
      // to the pressure path.
      if (b->refcount > 1 || b->tier != Tier::kDevice || b->evicted ||
          b->busy != 0) {
        continue;
      }
      const Encoding e = EncodingOfLocked(*s, b->tag);
      if (e == b->encoding) continue;
      const uint64_t nb = BlockBytes(s->model, T, e);
      if (nb >= b->bytes) continue;
      pending->changes.emplace_back(b->lineage_id, e);
      pending->new_bytes.push_back(nb);
      pending->bytes_delta +=
          static_cast<int64_t>(nb) - static_cast<int64_t>(b->bytes);
      BlockPlan plan = PlanOf(*b);
      plan.encoding = e;
      prepared.blocks.push_back(plan);
    }
    if (!pending->changes.empty()) {
      const uint64_t token = next_token_++;
      pending->tenant_id = req.tenant_id;
      pending->sequence_id = s->id;
      pending->version = s->version;
      pending->worker_id = s->worker->info.worker_id;
      pending->from_extend = true;
      pending->extend_request_id = req.request_id;
      pending->extend_result = result;
      prepared.token = token;
      prepared.worker_id = s->worker->info.worker_id;
      prepared.worker_address = s->worker->info.address;
      prepared.worker_request_id =
          absl::StrCat(s->id, "-v", s->version, "-extend-demote-", token);
      prepared.tenant_id = req.tenant_id;
      prepared.sequence_id = s->id;
      prepared.bytes_delta = pending->bytes_delta;
      pending_.emplace(token, std::move(pending));
      result.demotion = std::move(prepared);
      return result;  // remembered by FinishExtendDemotion
    }
  }
  extend_cache_.Put(cache_key, req.request_id, absl::OkStatus(), result);
  return result;
}

absl::StatusOr<SequenceInfo> ManagerCore::ForkSequence(
    const ForkSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  absl::MutexLock lock(&mu_);
  const std::string cache_key = absl::StrCat("ForkSequence/", req.tenant_id);
  if (auto hit = open_cache_.Find(cache_key, req.request_id)) return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(
      Sequence * parent,
      FindOpenSequenceLocked(req.tenant_id, "parent_sequence_id",
                             req.parent_sequence_id));
  const uint64_t n = req.num_tokens == 0 ? parent->num_tokens : req.num_tokens;
  if (n > parent->num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_tokens ", req.num_tokens, " exceeds the ", parent->num_tokens,
        " tokens of parent_sequence_id ", Quote(parent->id)));
  }
  // Whole blocks below n are shared; the block holding token n-1 is copied
  // when n cuts it.
  size_t shared = 0;
  while (shared < parent->blocks.size() &&
         parent->blocks[shared]->first_token +
                 parent->blocks[shared]->num_tokens <=
             n) {
    ++shared;
  }
  Block* cut = nullptr;
  if (shared < parent->blocks.size() &&
      parent->blocks[shared]->first_token < n) {
    cut = parent->blocks[shared];
  }
  for (size_t i = 0; i < shared + (cut != nullptr ? 1 : 0); ++i) {
    const Block* b = parent->blocks[i];
    if (b->evicted || b->tier != Tier::kDevice || b->busy != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parent_sequence_id ", Quote(parent->id), " block ", i, " (lineage ",
          b->lineage_id, ") is ",
          b->evicted
              ? "evicted"
              : (b->busy != 0 ? "being moved by the pressure manager"
                              : absl::StrCat("spilled to ", TierName(b->tier))),
          "; forks share device blocks only (ReportAccess with active=true "
          "restores spilled blocks)"));
    }
  }
  const uint64_t bytes = cut != nullptr ? cut->bytes : 0;
  TRIAX_RETURN_IF_ERROR(AdmitLocked(*parent->tenant, bytes));
  TRIAX_RETURN_IF_ERROR(FitsWorkerLocked(*parent->worker, bytes));

  ++parent->version;  // its blocks' refcounts change
  auto seq = std::make_unique<Sequence>();
  Sequence* s = seq.get();
  s->id = absl::StrCat("seq-", next_sequence_++);
  s->tenant = parent->tenant;
  s->worker = parent->worker;
  s->model = parent->model;
  s->block_tokens = parent->block_tokens;
  s->current_turn = parent->current_turn;
  s->policy = parent->policy;
  s->calibration = parent->calibration;
  s->allocation = parent->allocation;
  s->parent = parent->id;
  const uint32_t kept =
      static_cast<uint32_t>(shared + (cut != nullptr ? 1 : 0));
  for (uint32_t start : parent->turn_start)
    s->turn_start.push_back(std::min(start, kept));
  std::vector<Event> ev;
  ev.reserve(kept + 2);
  s->blocks.reserve(kept);
  for (size_t i = 0; i < shared; ++i) {
    Block* b = parent->blocks[i];
    ++b->refcount;
    s->blocks.push_back(b);
    s->bytes += b->bytes;
    Event e = MakeEvent(EventKind::kBlockShared, s, b);
    e.detail = absl::StrCat("parent=", parent->id, " refcount=", b->refcount);
    ev.push_back(std::move(e));
  }
  if (cut != nullptr) {
    // The copy has the cut block's turn, role and modality, hence its tag and
    // format; the worker copies the bytes.
    NewBlockLocked(s,
                   PlannedBlock{cut->first_token,
                                static_cast<uint32_t>(n - cut->first_token),
                                cut->tag.role, cut->tag.modality},
                   cut->turn, &ev);
    ev.back().detail += absl::StrCat(" copied_from=", cut->lineage_id);
  }
  s->num_tokens = n;
  s->tenant->open_sequences++;
  s->worker->open.insert(s);
  Event e = MakeEvent(EventKind::kSequenceForked, s, nullptr);
  e.detail = absl::StrCat("parent=", parent->id, " tokens=", n,
                          " shared_blocks=", shared,
                          " copied_blocks=", cut != nullptr ? 1 : 0);
  ev.push_back(std::move(e));
  SequenceInfo info = InfoLocked(*s, /*with_blocks=*/true);
  sequences_.emplace(s->id, std::move(seq));
  events_.Append(&ev);
  open_cache_.Put(cache_key, req.request_id, absl::OkStatus(), info);
  return info;
}

absl::StatusOr<CloseSequenceResult> ManagerCore::CloseSequence(
    const CloseSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  absl::MutexLock lock(&mu_);
  const std::string cache_key = absl::StrCat("CloseSequence/", req.tenant_id);
  if (auto hit = close_cache_.Find(cache_key, req.request_id))
    return hit->reply;
  TRIAX_ASSIGN_OR_RETURN(
      Sequence * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  CloseSequenceResult result;
  std::vector<Event> ev;
  ev.reserve(2 * s->blocks.size() + 1);
  std::vector<EventLog::LastPlan> forgotten;
  forgotten.reserve(s->blocks.size());
  for (Block* b : s->blocks) {
    ReleaseBlockLocked(s, b, /*lost=*/false, &result.freed_lineage_ids, &ev,
                       &forgotten);
  }
  s->state = SequenceState::kClosed;
  ++s->version;
  Event e = MakeEvent(EventKind::kSequenceClosed, s, nullptr);
  e.detail = absl::StrCat("blocks=", s->blocks.size(),
                          " freed=", result.freed_lineage_ids.size());
  ev.push_back(std::move(e));
  RetireLocked(s);
  events_.Append(&ev, &forgotten);
  close_cache_.Put(cache_key, req.request_id, absl::OkStatus(), result);
  return result;
}

absl::StatusOr<SequenceInfo> ManagerCore::GetSequence(
    const std::string& tenant_id, const std::string& sequence_id) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", sequence_id));
  absl::MutexLock lock(&mu_);
  const Tenant* tenant = nullptr;
  if (!tenant_id.empty()) {
    TRIAX_ASSIGN_OR_RETURN(tenant, FindTenantLocked(tenant_id));
  }
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id ", Quote(sequence_id),
                                            " is not a known sequence"));
  }
  if (tenant != nullptr && it->second->tenant != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("sequence_id ", Quote(sequence_id),
                     " belongs to another tenant, not ", Quote(tenant_id)));
  }
  return InfoLocked(*it->second, /*with_blocks=*/true);
}

absl::StatusOr<std::vector<SequenceInfo>> ManagerCore::ListSequences(
    const std::string& tenant_id, bool include_closed) const {
  absl::MutexLock lock(&mu_);
  const Tenant* tenant = nullptr;
  if (!tenant_id.empty()) {
    TRIAX_ASSIGN_OR_RETURN(tenant, FindTenantLocked(tenant_id));
  }
  std::vector<SequenceInfo> out;
  for (const auto& [id, s] : sequences_) {
    if (tenant != nullptr && s->tenant != tenant) continue;
    if (!include_closed && s->state != SequenceState::kOpen) continue;
    out.push_back(InfoLocked(*s, /*with_blocks=*/false));
  }
  // Ids are "seq-<n>": order by n, the creation order.
  std::sort(out.begin(), out.end(),
            [](const SequenceInfo& a, const SequenceInfo& b) {
              if (a.sequence_id.size() != b.sequence_id.size()) {
                return a.sequence_id.size() < b.sequence_id.size();
              }
              return a.sequence_id < b.sequence_id;
            });
  return out;
}

absl::StatusOr<TraceResult> ManagerCore::QueryTrace(uint64_t lineage_id) const {
  if (lineage_id == 0) {
    return absl::InvalidArgumentError(
        "lineage_id is 0; lineage ids start at 1");
  }
  TraceResult result;
  {
    absl::MutexLock lock(&mu_);
    auto it = blocks_.find(lineage_id);
    if (it != blocks_.end()) {
      result.block = PlanOf(*it->second);
      result.sequence_id = it->second->creator;
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

// --- Policies
// ------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<const Policy>> ManagerCore::FindPolicyLocked(
    absl::string_view field, absl::string_view name) const {
  if (auto p = FindBuiltinPolicy(name)) return p;
  auto it = policies_.find(name);
  if (it != policies_.end()) return it->second;
  std::vector<std::string> known;
  for (const auto& p : BuiltinPolicies()) known.push_back(p->name);
  std::vector<std::string> ops;
  for (const auto& [n, p] : policies_) ops.push_back(n);
  std::sort(ops.begin(), ops.end());
  known.insert(known.end(), ops.begin(), ops.end());
  return absl::InvalidArgumentError(absl::StrCat(
      field, " ", Quote(name),
      " is not a known policy; known: ", absl::StrJoin(known, ", ")));
}

absl::StatusOr<PolicyInfo> ManagerCore::PutPolicy(const PutPolicyRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<const Policy> policy,
                         BuildPolicy(req.policy));
  absl::MutexLock lock(&mu_);
  if (auto hit = policy_cache_.Find("PutPolicy", req.request_id)) {
    return hit->reply;
  }
  if (FindBuiltinPolicy(policy->name) != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy.name ", Quote(policy->name),
                     " is a built-in policy; built-in policies cannot be "
                     "replaced"));
  }
  if (!policies_.contains(policy->name) &&
      policies_.size() >= kMaxOperatorPolicies) {
    return absl::ResourceExhaustedError(
        absl::StrCat("policy.name ", Quote(policy->name),
                     " would be operator policy number ", policies_.size() + 1,
                     "; the limit is ", kMaxOperatorPolicies, "; over by 1"));
  }
  policies_[policy->name] = policy;
  PolicyInfo info = policy->Info();
  policy_cache_.Put("PutPolicy", req.request_id, absl::OkStatus(), info);
  return info;
}

std::vector<PolicyInfo> ManagerCore::ListPolicies() const {
  std::vector<PolicyInfo> out;
  for (const auto& p : BuiltinPolicies()) out.push_back(p->Info());
  absl::MutexLock lock(&mu_);
  std::vector<PolicyInfo> ops;
  ops.reserve(policies_.size());
  for (const auto& [name, p] : policies_) ops.push_back(p->Info());
  std::sort(
      ops.begin(), ops.end(),
      [](const PolicyInfo& a, const PolicyInfo& b) { return a.name < b.name; });
  out.insert(out.end(), ops.begin(), ops.end());
  return out;
}

// --- DemoteBlocks
// --------------------------------------------------------------

absl::StatusOr<DemotePrepared> ManagerCore::PrepareDemote(
    const DemoteBlocksRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
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

  absl::MutexLock lock(&mu_);
  const std::string cache_key = absl::StrCat("DemoteBlocks/", req.tenant_id);
  if (auto hit = demote_cache_.Find(cache_key, req.request_id)) {
    DemotePrepared done;
    done.done = hit->reply;
    return done;
  }
  if (!req.request_id.empty()) {
    for (const auto& [token, p] : pending_) {
      if (p->tenant_id == req.tenant_id && p->request_id == req.request_id) {
        return absl::AbortedError(
            absl::StrCat("DemoteBlocks request_id ", Quote(req.request_id),
                         " is already in progress; retry later"));
      }
    }
  }
  TRIAX_ASSIGN_OR_RETURN(
      Sequence * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  const kernels::PageShape shape = ShapeOf(s->model, s->block_tokens);
  auto pending = std::make_unique<PendingDemote>();
  DemotePrepared prepared;
  int64_t delta = 0;
  for (size_t i = 0; i < req.blocks.size(); ++i) {
    const uint64_t lineage = req.blocks[i].lineage_id;
    auto it = blocks_.find(lineage);
    Block* b = it == blocks_.end() ? nullptr : it->second.get();
    if (b == nullptr || b->index >= s->blocks.size() ||
        s->blocks[b->index] != b) {
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
        AdmitLocked(*s->tenant, static_cast<uint64_t>(delta)));
    TRIAX_RETURN_IF_ERROR(
        FitsWorkerLocked(*s->worker, static_cast<uint64_t>(delta)));
    s->tenant->used[static_cast<int>(Tier::kDevice)] += delta;
    s->worker->reserved += delta;
    pending->reserved = static_cast<uint64_t>(delta);
  }
  const uint64_t token = next_token_++;
  pending->tenant_id = req.tenant_id;
  pending->request_id = req.request_id;
  pending->sequence_id = s->id;
  pending->version = s->version;
  pending->worker_id = s->worker->info.worker_id;
  pending->bytes_delta = delta;
  pending_.emplace(token, std::move(pending));

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

void ManagerCore::ReleasePendingLocked(uint64_t token) {
  auto it = pending_.find(token);
  if (it == pending_.end()) return;
  const PendingDemote& p = *it->second;
  if (p.reserved > 0) {
    auto t = tenants_.find(p.tenant_id);
    if (t != tenants_.end()) {
      t->second->used[static_cast<int>(Tier::kDevice)] -= p.reserved;
    }
    auto w = workers_.find(p.worker_id);
    if (w != workers_.end()) w->second->reserved -= p.reserved;
  }
  pending_.erase(it);
}

void ManagerCore::AbortDemote(uint64_t token) {
  absl::MutexLock lock(&mu_);
  ReleasePendingLocked(token);
}

absl::StatusOr<DemoteBlocksResult> ManagerCore::CommitDemote(uint64_t token) {
  absl::MutexLock lock(&mu_);
  return CommitPendingLocked(token);
}

absl::StatusOr<ExtendSequenceResult> ManagerCore::FinishExtendDemotion(
    uint64_t token, const absl::Status& worker_status) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(token);
  if (it == pending_.end() || !it->second->from_extend) {
    return absl::NotFoundError(
        absl::StrCat("extend demotion token ", token, " is not pending"));
  }
  ExtendSequenceResult result = std::move(it->second->extend_result);
  const std::string tenant_id = it->second->tenant_id;
  const std::string request_id = it->second->extend_request_id;
  const std::string sequence_id = it->second->sequence_id;
  std::vector<uint64_t> lineages;
  for (const auto& [lineage, e] : it->second->changes) {
    lineages.push_back(lineage);
  }
  absl::Status outcome = worker_status;
  if (outcome.ok()) {
    auto committed = CommitPendingLocked(token);
    if (committed.ok()) {
      result.sequence = std::move(committed->sequence);
      for (uint64_t lineage : lineages) {
        result.demoted_blocks.push_back(PlanOf(*blocks_.at(lineage)));
      }
      Log(LogLevel::kInfo, "manager", "blocks demoted by the allocation",
          absl::StrCat(Kv("sequence_id", sequence_id), " ",
                       Kv("blocks", lineages.size()), " ",
                       Kv("bytes_delta", committed->bytes_delta)));
    } else {
      outcome = committed.status();
    }
  } else {
    ReleasePendingLocked(token);
  }
  if (!outcome.ok()) {
    // The extension stands; the blocks keep their encoding (the next Extend
    // tries again).
    Log(LogLevel::kWarn, "manager",
        "allocation demotion not applied; blocks keep their encoding",
        absl::StrCat(Kv("sequence_id", sequence_id), " ",
                     Kv("blocks", lineages.size()), " ",
                     Kv("error", outcome.ToString())));
    auto sit = sequences_.find(sequence_id);
    if (sit != sequences_.end() && sit->second->state == SequenceState::kOpen) {
      result.sequence = InfoLocked(*sit->second, /*with_blocks=*/true);
    }
  }
  extend_cache_.Put(absl::StrCat("ExtendSequence/", tenant_id), request_id,
                    absl::OkStatus(), result);
  return result;
}

// --- Calibration
// ---------------------------------------------------------------

absl::StatusOr<uint32_t> ManagerCore::PutCalibration(
    const PutCalibrationRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  const CalibrationTableInfo& t = req.table;
  TRIAX_RETURN_IF_ERROR(ValidateId("table.model", t.model));
  TRIAX_RETURN_IF_ERROR(ValidateModelShape(t.shape, "table.shape"));
  if (t.block_tokens < 1 || t.block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.block_tokens ", t.block_tokens, " is outside 1..",
                     kMaxBlockTokens));
  }
  if (t.entries.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.entries is empty (model ", Quote(t.model),
                     "); a calibration table needs at least one entry"));
  }
  if (t.entries.size() > kMaxCalibrationEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.entries has ", t.entries.size(),
                     " entries; the limit is ", kMaxCalibrationEntries));
  }
  auto table = std::make_shared<Calibration>();
  table->info.model = t.model;
  table->info.shape = t.shape;
  table->info.block_tokens = t.block_tokens;
  table->info.source = t.source;
  table->info.entries.reserve(t.entries.size());
  table->encodings.reserve(t.entries.size());
  const kernels::PageShape shape = ShapeOf(t.shape, t.block_tokens);
  std::map<std::pair<int, std::string>, size_t> seen;
  for (size_t i = 0; i < t.entries.size(); ++i) {
    const CalibrationEntryInfo& in = t.entries[i];
    const std::string field = absl::StrCat("table.entries[", i, "]");
    const int temporal = static_cast<int>(in.tag.temporal);
    if (temporal < 1 || temporal > static_cast<int>(Temporal::kOlder)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".tag.temporal is ", TemporalName(in.tag.temporal),
          "; a temporal class SINK..OLDER is required"));
    }
    if (!IsValid(in.tag.role)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".tag.role is ",
                                                     RoleName(in.tag.role),
                                                     "; a role is required"));
    }
    if (!IsValid(in.tag.modality)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".tag.modality is ",
                       ModalityName(in.tag.modality), "; out of range"));
    }
    TRIAX_ASSIGN_OR_RETURN(const Encoding e,
                           ResolveEncoding(field, in.encoding));
    if (const char* why = kernels::ValidateEncoding(e, shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " encoding ", EncodingString(e), " is invalid for ",
          "table.block_tokens ", t.block_tokens, ", n_kv_heads ",
          t.shape.n_kv_heads, ", head_dim ", t.shape.head_dim, ": ", why));
    }
    if (!std::isfinite(in.distortion) || in.distortion < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".distortion is ", in.distortion,
                       "; it must be finite and >= 0"));
    }
    CalibrationEntryInfo entry = in;
    entry.tag.modality = Normalize(in.tag.modality);
    entry.encoding = SpecOf(e);
    const auto key = std::make_pair(TagKey(entry.tag), EncodingString(e));
    auto [dup, fresh] = seen.emplace(key, i);
    if (!fresh) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " repeats table.entries[", dup->second, "]: tag ",
          TemporalName(entry.tag.temporal), "/",
          ModalityName(entry.tag.modality), "/", RoleName(entry.tag.role),
          " encoding ", EncodingString(e)));
    }
    table->info.entries.push_back(std::move(entry));
    table->encodings.push_back(e);
  }
  absl::MutexLock lock(&mu_);
  if (auto hit = calibration_cache_.Find("PutCalibration", req.request_id)) {
    return hit->reply;
  }
  if (!calibrations_.contains(t.model) &&
      calibrations_.size() >= kMaxCalibrationModels) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "table.model ", Quote(t.model), " would be calibrated model number ",
        calibrations_.size() + 1, "; the limit is ", kMaxCalibrationModels,
        "; over by 1"));
  }
  const uint32_t n = static_cast<uint32_t>(table->info.entries.size());
  calibrations_[t.model] = std::move(table);
  calibration_cache_.Put("PutCalibration", req.request_id, absl::OkStatus(), n);
  return n;
}

absl::StatusOr<CalibrationTableInfo> ManagerCore::GetCalibration(
    const std::string& model) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("model", model));
  absl::MutexLock lock(&mu_);
  auto it = calibrations_.find(model);
  if (it == calibrations_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model ", Quote(model),
                     " has no calibration table; PutCalibration it"));
  }
  return it->second->info;
}

absl::StatusOr<DemoteBlocksResult> ManagerCore::CommitPendingLocked(
    uint64_t token) {
  auto it = pending_.find(token);
  if (it == pending_.end()) {
    return absl::NotFoundError(
        absl::StrCat("demote token ", token, " is not pending"));
  }
  const PendingDemote& p = *it->second;
  auto sit = sequences_.find(p.sequence_id);
  Sequence* s = sit == sequences_.end() ? nullptr : sit->second.get();
  if (s == nullptr || s->state != SequenceState::kOpen ||
      s->version != p.version) {
    const std::string id = p.sequence_id;
    ReleasePendingLocked(token);
    return absl::AbortedError(absl::StrCat(
        "sequence_id ", Quote(id),
        " changed while its blocks were re-encoded; the plan is unchanged "
        "(the worker may already hold the new encodings): call DemoteBlocks "
        "again with a new request_id"));
  }
  std::vector<Event> ev;
  ev.reserve(p.changes.size());
  for (size_t i = 0; i < p.changes.size(); ++i) {
    Block* b = blocks_.at(p.changes[i].first).get();
    const Encoding from = b->encoding;
    const uint64_t from_bytes = b->bytes;
    b->encoding = p.changes[i].second;
    b->bytes = p.new_bytes[i];
    s->bytes = s->bytes - from_bytes + b->bytes;
    Event e = MakeEvent(EventKind::kBlockDemoted, s, b);
    e.detail = absl::StrCat("index=", b->index, " from=", EncodingString(from),
                            " to=", EncodingString(b->encoding),
                            " bytes_from=", from_bytes, " bytes_to=", b->bytes);
    ev.push_back(std::move(e));
  }
  // Growth was charged at prepare; shrinkage is released now.
  if (p.bytes_delta < 0) {
    const uint64_t freed = static_cast<uint64_t>(-p.bytes_delta);
    s->tenant->used[static_cast<int>(Tier::kDevice)] -= freed;
    s->worker->reserved -= freed;
  }
  ++s->version;
  DemoteBlocksResult result;
  result.sequence = InfoLocked(*s, /*with_blocks=*/true);
  result.bytes_delta = p.bytes_delta;
  const std::string cache_key = absl::StrCat("DemoteBlocks/", p.tenant_id);
  const std::string request_id = p.request_id;
  pending_.erase(it);
  events_.Append(&ev);
  demote_cache_.Put(cache_key, request_id, absl::OkStatus(), result);
  return result;
}

}  // namespace triax::manager
