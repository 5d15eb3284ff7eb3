#include "kvmanager/pressure_coordinator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::manager {

namespace {

constexpr size_t kMaxReportIds = 4096;
// A worker writes a demotion's new pages before it frees the old ones, so a
// Demote command needs that much free room on the worker while it runs:
// small commands need little, and the room each frees serves the next one;
// a command the worker refuses leaves the others of the plan.
constexpr size_t kMaxDemoteCommandBlocks = 8;

}  // namespace

// A tier plan in flight (PlanPressure / PlanAdmission / PlanPrefetch /
// ReportAccess), by token.
struct PressureCoordinator::PendingPlan {
  struct Item {
    uint64_t lineage_id = 0;
    uint64_t from_bytes = 0;  // the block's bytes at planning time
    Tier from = Tier::kDevice;
    Tier to = Tier::kDevice;  // kSpill / kRestore destination
    Encoding encoding;        // kDemote: the new encoding
    uint64_t to_bytes = 0;    // kDemote: new bytes
    uint64_t reserved = 0;    // destination bytes reserved at planning
  };
  struct Command {
    TierCommand::Kind kind;
    std::string worker_id;
    std::string tenant_id;
    std::string sequence_id;
    std::vector<Item> items;
  };
  std::vector<Command> commands;
};

void PressureCoordinator::MarkInDoubt(const PendingPlan& p, int delta) {
  for (const PendingPlan::Command& c : p.commands) {
    if (SequenceRecord* s = sequences_->Find(c.sequence_id)) {
      AddInDoubt(s, delta);
    }
  }
}

absl::Status PressureCoordinator::ValidateOptions(
    const PressureOptions& options) {
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
  if (options.active_guard_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "active_guard_ms ", options.active_guard_ms, " must be >= 0"));
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
  return absl::OkStatus();
}

PressureCoordinator::PressureCoordinator(
    const PressureOptions& options, const Clock* clock, WorkerRegistry* workers,
    TenantLedger* tenants, SequenceTable* sequences,
    const CalibrationStore* calibrations, uint64_t* next_token)
    : options_(options),
      clock_(clock),
      workers_(workers),
      tenants_(tenants),
      sequences_(sequences),
      calibrations_(calibrations),
      next_token_(next_token) {}

PressureCoordinator::~PressureCoordinator() = default;

// --- Block lifecycle ---------------------------------------------------------

void PressureCoordinator::BlockCreated(SequenceRecord* s,
                                       const BlockRecord& b) {
  graph_.AddBlock(b.lineage_id, clock_->NowMs());
  // Tool call -> tool result: a result's blocks link to the newest call.
  if (b.tag.role == Role::kToolCall) {
    s->last_tool_call = b.lineage_id;
  } else if (b.tag.role == Role::kToolResult && s->last_tool_call != 0) {
    graph_.Link(s->last_tool_call, b.lineage_id, EdgeKind::kToolCallResult);
  }
}

// --- Snapshot ----------------------------------------------------------------

SnapshotBuilder PressureCoordinator::NewSnapshot(bool spill_tiers) const {
  SnapshotBuilder::Options o;
  o.spill_tiers = spill_tiers;
  o.evict_factor = options_.ranker.evict_factor;
  o.default_evict_distortion = options_.ranker.default_evict_distortion;
  o.window_guard_tokens = options_.window_guard_tokens;
  return SnapshotBuilder(o, *workers_, *tenants_, *sequences_, *calibrations_,
                         graph_);
}

// --- Plans -------------------------------------------------------------------

// Whether `b` may take `a` now: unchanged since the snapshot, idle, its
// worker UP, and (for spills) with room in the destination tier of its
// worker and tenant.
bool PressureCoordinator::ActionValid(
    const RankedAction& a, const BlockRecord& b, const SequenceRecord& s,
    std::array<uint64_t, kNumTiers>* worker_add, uint64_t* tenant_add) const {
  if (b.busy != 0 || b.evicted || b.refcount != 1 || b.tier != a.from) {
    return false;
  }
  if (s.state != SequenceState::kOpen) return false;
  // A worker that went SUSPECT since the snapshot cannot run the command.
  if (s.worker->info.state != WorkerState::kUp) return false;
  if (a.action == PressureAction::kDemote) {
    // The block may have been re-encoded since the snapshot (aging, an
    // earlier plan): only a target smaller than its encoding now is a
    // demotion. (Busy blocks cannot change until FinishTierPlan.)
    return b.tier == Tier::kDevice &&
           BlockBytes(s.model, s.block_tokens, a.encoding) < b.bytes;
  }
  if (IsSpill(a.action)) {
    const Tier to =
        a.action == PressureAction::kSpillHost ? Tier::kHost : Tier::kDisk;
    const int t = static_cast<int>(to);
    const WorkerRecord& w = *s.worker;
    const uint64_t cap = to == Tier::kHost ? w.info.host_capacity_bytes
                                           : w.info.disk_capacity_bytes;
    if (w.tier_used[t] + (*worker_add)[t] + b.bytes > cap) return false;
    const TenantRecord& tn = *s.tenant;
    if (tn.budgets[t] &&
        tn.used[t] + tenant_add[t] + b.bytes > tn.budgets[t]->ceiling_bytes) {
      return false;
    }
  }
  return true;
}

TierPlan PressureCoordinator::PlanFromPicks(const Picks& picks,
                                            const std::string& reason) {
  TierPlan plan;
  if (picks.empty()) return plan;
  auto pending = std::make_unique<PendingPlan>();
  const uint64_t token = (*next_token_)++;
  // One command per (sequence, kind, destination), demotions in commands of
  // at most kMaxDemoteCommandBlocks blocks.
  std::map<std::tuple<std::string, int, int>, size_t> command_of;
  for (const auto& [b, a] : picks) {
    SequenceRecord* s = SequenceTable::Owner(*b);
    if (s == nullptr) continue;
    TierCommand::Kind kind = TierCommand::Kind::kEvict;
    Tier to = Tier::kUnspecified;
    switch (a.action) {
      case PressureAction::kDemote:
        kind = TierCommand::Kind::kDemote;
        break;
      case PressureAction::kSpillHost:
        kind = TierCommand::Kind::kSpill;
        to = Tier::kHost;
        break;
      case PressureAction::kSpillDisk:
        kind = TierCommand::Kind::kSpill;
        to = Tier::kDisk;
        break;
      case PressureAction::kEvict:
        kind = TierCommand::Kind::kEvict;
        break;
      case PressureAction::kUnspecified:
        continue;
    }
    const auto key =
        std::make_tuple(s->id, static_cast<int>(kind), static_cast<int>(to));
    auto [ci, fresh] = command_of.emplace(key, plan.commands.size());
    if (!fresh && kind == TierCommand::Kind::kDemote &&
        plan.commands[ci->second].blocks.size() >= kMaxDemoteCommandBlocks) {
      ci->second = plan.commands.size();
      fresh = true;
    }
    if (fresh) {
      TierCommand c;
      c.kind = kind;
      c.worker_id = s->worker->info.worker_id;
      c.worker_address = s->worker->info.address;
      c.tenant_id = s->tenant->id;
      c.sequence_id = s->id;
      c.request_id =
          absl::StrCat("pressure-", token, "-", plan.commands.size());
      c.tier = to;
      plan.commands.push_back(std::move(c));
      PendingPlan::Command pc;
      pc.kind = kind;
      pc.worker_id = s->worker->info.worker_id;
      pc.tenant_id = s->tenant->id;
      pc.sequence_id = s->id;
      pending->commands.push_back(std::move(pc));
    }
    TierCommand& c = plan.commands[ci->second];
    PendingPlan::Command& pc = pending->commands[ci->second];
    PendingPlan::Item item;
    item.lineage_id = b->lineage_id;
    item.from_bytes = b->bytes;
    item.from = b->tier;
    BlockPlan bp = PlanOf(*b);
    if (kind == TierCommand::Kind::kDemote) {
      item.encoding = a.encoding;
      item.to_bytes = BlockBytes(s->model, s->block_tokens, a.encoding);
      // The worker allocates the new pages before it frees the old ones.
      s->worker->transient += item.to_bytes;
      bp.encoding = a.encoding;
      plan.bytes += b->bytes - std::min(b->bytes, item.to_bytes);
    } else if (kind == TierCommand::Kind::kSpill) {
      // Reserve the destination now; the source is released on success.
      item.to = to;
      item.reserved = b->bytes;
      const int t = static_cast<int>(to);
      s->worker->tier_used[t] += b->bytes;
      s->tenant->used[t] += b->bytes;
      plan.bytes += b->tier == Tier::kDevice ? b->bytes : 0;
    } else {
      plan.bytes += b->bytes;
    }
    b->busy = token;
    c.blocks.push_back(bp);
    pc.items.push_back(item);
  }
  if (plan.commands.empty()) return TierPlan{};
  plan.token = token;
  plan.reason = reason;
  MarkInDoubt(*pending, +1);
  pending_.emplace(token, std::move(pending));
  return plan;
}

void PressureCoordinator::Pick(
    const PressureSnapshot& snap, uint32_t wi, Tier tier, uint64_t need,
    const TenantRecord* tenant, const SequenceRecord* exclude,
    const SequenceRecord* resident, bool no_spills, Picks* picks,
    absl::flat_hash_set<uint64_t>* taken, uint64_t* freed) {
  std::array<uint64_t, kNumTiers> worker_add{};
  absl::flat_hash_map<const TenantRecord*, std::array<uint64_t, kNumTiers>>
      tenant_add;
  uint64_t got = 0;
  const int64_t now = clock_->NowMs();
  const auto selected =
      SelectReclaim(snap.ranking, wi, tier, need, [&](const RankedAction& a) {
        if (picks->size() >= options_.max_plan_blocks) return true;
        if (taken->contains(a.lineage_id)) return true;
        BlockRecord* b = sequences_->FindBlock(a.lineage_id);
        if (b == nullptr) return true;
        SequenceRecord* s = SequenceTable::Owner(*b);
        if (s == nullptr) return true;
        if (tenant != nullptr && s->tenant != tenant) return true;
        if (s == exclude) return true;
        // Used since the ranking was built (e.g. restored for its
        // resumption): the ranking's recency for it is stale.
        if (s->last_access_ms > snap.built_ms) return true;
        if ((no_spills || s == resident || Active(*s, now)) &&
            IsSpill(a.action)) {
          return true;
        }
        if (!ActionValid(a, *b, *s, &worker_add,
                         tenant_add[s->tenant].data())) {
          return true;
        }
        if (IsSpill(a.action)) {
          const int t = static_cast<int>(a.action == PressureAction::kSpillHost
                                             ? Tier::kHost
                                             : Tier::kDisk);
          worker_add[t] += b->bytes;
          tenant_add[s->tenant][t] += b->bytes;
        }
        taken->insert(a.lineage_id);
        picks->emplace_back(b, a);
        got += a.bytes_freed;
        return false;
      });
  (void)selected;
  *freed += got;
}

bool PressureCoordinator::NeedsReclaim() const {
  for (const auto& [id, w] : workers_->all()) {
    if (w->info.state != WorkerState::kUp) continue;
    if (w->reserved >
        Watermark(w->info.capacity_bytes, options_.watermarks.high)) {
      return true;
    }
    const uint64_t host_cap = w->info.host_capacity_bytes;
    if (host_cap > 0 && w->tier_used[static_cast<int>(Tier::kHost)] >
                            Watermark(host_cap, options_.watermarks.high)) {
      return true;
    }
  }
  const int dev = static_cast<int>(Tier::kDevice);
  for (const auto& [id, t] : tenants_->all()) {
    if (t->budgets[dev] && t->used[dev] > t->budgets[dev]->ceiling_bytes) {
      return true;
    }
  }
  return false;
}

TierPlan PressureCoordinator::PlanPressure() {
  if (snapshot_ == nullptr) return TierPlan{};
  const PressureSnapshot& snap = *snapshot_;
  Picks picks;
  absl::flat_hash_set<uint64_t> taken;
  std::vector<std::string> reasons;
  for (uint32_t wi = 0; wi < snap.worker_ids.size(); ++wi) {
    const WorkerRecord* wp = workers_->Find(snap.worker_ids[wi]);
    if (wp == nullptr) continue;
    const WorkerRecord& w = *wp;
    if (w.info.state != WorkerState::kUp) continue;
    // Device pool, then the host tier.
    const uint64_t cap = w.info.capacity_bytes;
    if (w.reserved > Watermark(cap, options_.watermarks.high)) {
      const uint64_t need =
          w.reserved - Watermark(cap, options_.watermarks.low);
      uint64_t freed = 0;
      Pick(snap, wi, Tier::kDevice, need, nullptr, nullptr, nullptr, false,
           &picks, &taken, &freed);
      reasons.push_back(absl::StrCat("worker ", w.info.worker_id, " device ",
                                     w.reserved, "/", cap, " need ", need,
                                     " planned ", freed));
    }
    const uint64_t host_cap = w.info.host_capacity_bytes;
    const uint64_t host_used = w.tier_used[static_cast<int>(Tier::kHost)];
    if (host_cap > 0 &&
        host_used > Watermark(host_cap, options_.watermarks.high)) {
      const uint64_t need =
          host_used - Watermark(host_cap, options_.watermarks.low);
      uint64_t freed = 0;
      Pick(snap, wi, Tier::kHost, need, nullptr, nullptr, nullptr, false,
           &picks, &taken, &freed);
      reasons.push_back(absl::StrCat("worker ", w.info.worker_id, " host ",
                                     host_used, "/", host_cap, " need ", need,
                                     " planned ", freed));
    }
  }
  // Tenants above their device ceiling (a lowered budget).
  const int dev = static_cast<int>(Tier::kDevice);
  for (const auto& [id, t] : tenants_->all()) {
    if (!t->budgets[dev] || t->used[dev] <= t->budgets[dev]->ceiling_bytes) {
      continue;
    }
    uint64_t need = t->used[dev] - t->budgets[dev]->ceiling_bytes;
    uint64_t freed = 0;
    for (uint32_t wi = 0; wi < snap.worker_ids.size() && freed < need; ++wi) {
      Pick(snap, wi, Tier::kDevice, need - freed, t.get(), nullptr, nullptr,
           false, &picks, &taken, &freed);
    }
    reasons.push_back(absl::StrCat("tenant ", id, " over ceiling by ", need,
                                   " planned ", freed));
  }
  return PlanFromPicks(picks, absl::StrJoin(reasons, "; "));
}

TierPlan PressureCoordinator::PlanAdmission(const AdmissionShortfall& sf) {
  if (snapshot_ == nullptr) return TierPlan{};
  const PressureSnapshot& snap = *snapshot_;
  const TenantRecord* tenant = tenants_->FindOrNull(sf.tenant_id);
  if (tenant == nullptr) return TierPlan{};
  const SequenceRecord* exclude = nullptr;
  if (!sf.exclude_sequence_id.empty()) {
    exclude = sequences_->Find(sf.exclude_sequence_id);
  }
  const SequenceRecord* resident = nullptr;
  if (!sf.resident_sequence_id.empty()) {
    resident = sequences_->Find(sf.resident_sequence_id);
  }
  Picks picks;
  // Blocks whose worker command failed earlier in the round count as taken.
  absl::flat_hash_set<uint64_t> taken(sf.skip_lineage_ids.begin(),
                                      sf.skip_lineage_ids.end());
  std::vector<std::string> reasons;
  const int dev = static_cast<int>(Tier::kDevice);
  uint64_t tenant_freed = 0;
  if (tenant->budgets[dev]) {
    const uint64_t ceiling = tenant->budgets[dev]->ceiling_bytes;
    const uint64_t want =
        tenant->used[dev] + sf.tenant_held_bytes + sf.request_bytes;
    if (want > ceiling) {
      const uint64_t need = want - ceiling;
      for (uint32_t wi = 0; wi < snap.worker_ids.size() && tenant_freed < need;
           ++wi) {
        Pick(snap, wi, Tier::kDevice, need - tenant_freed, tenant, exclude,
             resident, sf.resume_reserve, &picks, &taken, &tenant_freed);
      }
      reasons.push_back(absl::StrCat("tenant ", sf.tenant_id, " ceiling need ",
                                     need, " planned ", tenant_freed));
    }
  }
  for (uint32_t wi = 0; wi < snap.worker_ids.size(); ++wi) {
    if (snap.worker_ids[wi] != sf.worker_id) continue;
    const WorkerRecord* wp = workers_->Find(sf.worker_id);
    if (wp == nullptr) break;
    const WorkerRecord& w = *wp;
    const uint64_t cap = w.info.capacity_bytes;
    // Room for the request, then down to the low watermark if that is more
    // (so the next admissions do not each trigger a reclaim).
    const uint64_t want =
        w.reserved + sf.worker_held_bytes + sf.WorkerRequestBytes();
    uint64_t need = 0;
    if (want > cap) need = want - cap;
    if (need == 0) break;
    const uint64_t low = Watermark(cap, options_.watermarks.low);
    if (want > low) need = std::max(need, want - low);
    // Blocks already picked for the tenant's ceiling on this worker count.
    uint64_t freed = 0;
    for (const auto& [b, a] : picks) {
      if (b->worker == &w && a.from == Tier::kDevice) freed += a.bytes_freed;
    }
    if (freed < need) {
      Pick(snap, wi, Tier::kDevice, need - freed, nullptr, exclude, resident,
           sf.resume_reserve, &picks, &taken, &freed);
    }
    reasons.push_back(absl::StrCat("worker ", sf.worker_id, " room need ", need,
                                   " planned ", freed));
  }
  return PlanFromPicks(picks, absl::StrJoin(reasons, "; "));
}

// --- Access reports and prefetch ---------------------------------------------

absl::Status PressureCoordinator::ValidateAccessReport(
    const ReportAccessRequest& req) {
  if (req.lineage_ids.size() > kMaxReportIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("lineage_ids has ", req.lineage_ids.size(),
                     " entries; at most ", kMaxReportIds));
  }
  if (!req.weights.empty() && req.weights.size() != req.lineage_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights has ", req.weights.size(), " entries; lineage_ids has ",
        req.lineage_ids.size(), " (give one weight per id, or none)"));
  }
  for (size_t i = 0; i < req.weights.size(); ++i) {
    const float w = req.weights[i];
    if (!(w >= 0.f && w <= 1.f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights[", i, "] is ", w, "; must be in 0..1"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TierPlan> PressureCoordinator::ReportAccess(
    SequenceRecord* s, const ReportAccessRequest& req) {
  std::vector<BlockRecord*> reported;
  reported.reserve(req.lineage_ids.size());
  for (size_t i = 0; i < req.lineage_ids.size(); ++i) {
    BlockRecord* b = sequences_->BlockOf(*s, req.lineage_ids[i]);
    if (b == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("lineage_ids[", i, "] ", req.lineage_ids[i],
                       " is not a block of sequence_id ", Quote(s->id)));
    }
    reported.push_back(b);
  }
  const int64_t now = clock_->NowMs();
  s->last_access_ms = now;
  graph_.RecordAccess(req.lineage_ids, req.weights, now);
  // Spilled graph neighbours of the reported (active) blocks, in any open
  // sequence, below the high watermark; the sequence's own spilled blocks
  // when it is active are the service's PlanPrefetch (with reclaim).
  std::vector<BlockRecord*> want;
  absl::flat_hash_set<uint64_t> seen;
  for (BlockRecord* r : reported) {
    for (uint64_t n : graph_.Neighbours(r->lineage_id)) {
      BlockRecord* b = sequences_->FindBlock(n);
      if (b == nullptr) continue;
      if (b->tier != Tier::kDevice && !b->evicted && b->busy == 0 &&
          b->refcount == 1 && SequenceTable::Owner(*b) != nullptr &&
          seen.insert(n).second) {
        want.push_back(b);
      }
    }
  }
  return PlanRestore(want, absl::StrCat("neighbours of ", s->id),
                     /*limit_to_high=*/true, nullptr);
}

TierPlan PressureCoordinator::PlanPrefetch(const std::string& sequence_id,
                                           AdmissionShortfall* shortfall) {
  if (shortfall != nullptr) *shortfall = AdmissionShortfall{};
  SequenceRecord* s = sequences_->Find(sequence_id);
  if (s == nullptr) return TierPlan{};
  if (s->state != SequenceState::kOpen || s->spilled == 0) return TierPlan{};
  std::vector<BlockRecord*> want;
  for (BlockRecord* b : s->blocks) {
    if (b->tier != Tier::kDevice && !b->evicted && b->busy == 0) {
      want.push_back(b);
    }
  }
  uint64_t unfit = 0;
  TierPlan plan = PlanRestore(want, absl::StrCat("restore ", s->id),
                              /*limit_to_high=*/false, &unfit);
  if (shortfall != nullptr && unfit > 0) {
    *shortfall = AdmissionShortfall{s->tenant->id, s->worker->info.worker_id,
                                    unfit, s->id};
    // The blocks left out may lack frames rather than bytes: the worker's
    // side of the shortfall counts the frames they need.
    Demand demand;
    for (const BlockRecord* b : want) {
      if (plan.token != 0 && b->busy == plan.token) continue;
      WorkerRegistry::AddBlocks(s->model, s->block_tokens, b->encoding, 1,
                                &demand);
    }
    shortfall->worker_request_bytes =
        WorkerRegistry::AdmissionBytes(*s->worker, unfit, demand);
  }
  return plan;
}

TierPlan PressureCoordinator::PlanRestore(const std::vector<BlockRecord*>& want,
                                          const std::string& reason,
                                          bool limit_to_high,
                                          uint64_t* unfit_bytes) {
  TierPlan plan;
  if (want.empty()) return plan;
  auto pending = std::make_unique<PendingPlan>();
  const uint64_t token = (*next_token_)++;
  std::map<std::string, size_t> command_of;
  // Per worker: the bytes and pages this plan restores onto it, so that
  // the frames the worker reported are checked for the plan as a whole.
  struct Onto {
    uint64_t bytes = 0;
    Demand demand;
  };
  absl::flat_hash_map<WorkerRecord*, Onto> onto;
  const int dev = static_cast<int>(Tier::kDevice);
  for (BlockRecord* b : want) {
    SequenceRecord* s = SequenceTable::Owner(*b);
    if (s == nullptr || s->state != SequenceState::kOpen) continue;
    WorkerRecord* w = s->worker;
    if (w->info.state != WorkerState::kUp) continue;  // it cannot restore
    TenantRecord* t = s->tenant;
    // Only what fits: below the high watermark for neighbours, the
    // capacity for an active sequence; never past the tenant's ceiling;
    // in the frames and pool slots the worker reported.
    const uint64_t limit = limit_to_high ? Watermark(w->info.capacity_bytes,
                                                     options_.watermarks.high)
                                         : w->info.capacity_bytes;
    Onto& o = onto[w];
    Demand demand = o.demand;
    WorkerRegistry::AddBlocks(s->model, s->block_tokens, b->encoding, 1,
                              &demand);
    // Fits counts what was planned since the heartbeat as taken; this
    // plan's own blocks are in `demand` instead.
    w->reserved -= o.bytes;
    w->planned_total -= o.bytes;
    const bool frames_fit =
        WorkerRegistry::Fits(*w, o.bytes + b->bytes, demand).ok();
    w->reserved += o.bytes;
    w->planned_total += o.bytes;
    if (w->reserved + b->bytes > limit || !frames_fit ||
        (t->budgets[dev] &&
         t->used[dev] + b->bytes > t->budgets[dev]->ceiling_bytes)) {
      if (unfit_bytes != nullptr) *unfit_bytes += b->bytes;
      continue;
    }
    o.bytes += b->bytes;
    o.demand = std::move(demand);
    auto [ci, fresh] = command_of.emplace(s->id, plan.commands.size());
    if (fresh) {
      TierCommand c;
      c.kind = TierCommand::Kind::kRestore;
      c.worker_id = w->info.worker_id;
      c.worker_address = w->info.address;
      c.tenant_id = t->id;
      c.sequence_id = s->id;
      c.request_id = absl::StrCat("restore-", token, "-", plan.commands.size());
      c.tier = Tier::kDevice;
      plan.commands.push_back(std::move(c));
      PendingPlan::Command pc;
      pc.kind = TierCommand::Kind::kRestore;
      pc.worker_id = w->info.worker_id;
      pc.tenant_id = t->id;
      pc.sequence_id = s->id;
      pending->commands.push_back(std::move(pc));
    }
    PendingPlan::Item item;
    item.lineage_id = b->lineage_id;
    item.from_bytes = b->bytes;
    item.from = b->tier;
    item.to = Tier::kDevice;
    item.reserved = b->bytes;
    w->Reserve(b->bytes);
    t->used[dev] += b->bytes;
    b->busy = token;
    plan.bytes += b->bytes;
    plan.commands[ci->second].blocks.push_back(PlanOf(*b));
    pending->commands[ci->second].items.push_back(item);
  }
  if (plan.commands.empty()) return TierPlan{};
  plan.token = token;
  plan.reason = reason;
  MarkInDoubt(*pending, +1);
  pending_.emplace(token, std::move(pending));
  return plan;
}

// --- Commit ------------------------------------------------------------------

absl::Status PressureCoordinator::FinishTierPlan(
    uint64_t token, const std::vector<absl::Status>& results,
    std::vector<Event>* ev, TierPlanOutcome* outcome) {
  TierPlanOutcome out;
  auto pit = pending_.find(token);
  if (pit == pending_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tier plan token ", token, " is not pending"));
  }
  std::unique_ptr<PendingPlan> p = std::move(pit->second);
  pending_.erase(pit);
  MarkInDoubt(*p, -1);
  for (size_t ci = 0; ci < p->commands.size(); ++ci) {
    const PendingPlan::Command& c = p->commands[ci];
    const absl::Status st =
        ci < results.size() ? results[ci]
                            : absl::InternalError("no result for the command");
    if (!st.ok() && out.failed_commands++ == 0) out.first_error = st;
    TenantRecord* t = tenants_->FindOrNull(c.tenant_id);
    WorkerRecord* w = workers_->Find(c.worker_id);
    uint64_t spilled_prev = 0;
    for (const PendingPlan::Item& item : c.items) {
      if (c.kind == TierCommand::Kind::kDemote && w != nullptr) {
        w->transient -= std::min(w->transient, item.to_bytes);
      }
      if (!st.ok()) out.failed_lineage_ids.push_back(item.lineage_id);
      BlockRecord* b = sequences_->FindBlock(item.lineage_id);
      const bool live = b != nullptr && b->busy == token;
      if (b != nullptr && b->busy == token) b->busy = 0;
      // Return destination reservations of failed or orphaned items.
      auto unreserve = [&]() {
        if (item.reserved == 0) return;
        const int to = static_cast<int>(item.to);
        if (t != nullptr) t->used[to] -= item.reserved;
        if (w != nullptr) {
          if (item.to == Tier::kDevice) {
            w->reserved -= item.reserved;
          } else {
            w->tier_used[to] -= item.reserved;
          }
        }
      };
      if (!st.ok() || !live) {
        unreserve();
        continue;
      }
      SequenceRecord* s = SequenceTable::Owner(*b);
      Event e = MakeEvent(*clock_, EventKind::kBlockDemoted, s, b);
      const int from = static_cast<int>(b->tier);
      switch (c.kind) {
        case TierCommand::Kind::kDemote: {
          const uint64_t old_bytes = b->bytes;
          const Encoding old = b->encoding;
          b->encoding = item.encoding;
          b->bytes = item.to_bytes;
          const uint64_t freed = old_bytes - std::min(old_bytes, b->bytes);
          b->charged->used[from] -= freed;
          b->worker->reserved -= freed;
          // The new pages left `transient` above; they are in the worker's
          // frames now but not in a report yet.
          if (b->tier == Tier::kDevice) b->worker->planned_total += b->bytes;
          if (s != nullptr) s->bytes -= freed;
          e = MakeEvent(*clock_, EventKind::kBlockDemoted, s, b);
          e.detail = absl::StrCat("from=", EncodingString(old),
                                  " to=", EncodingString(b->encoding),
                                  " bytes_freed=", freed, " by=pressure");
          ++demotions_;
          ++out.demotions;
          if (from == static_cast<int>(Tier::kDevice)) {
            out.device_bytes_freed += freed;
          }
          break;
        }
        case TierCommand::Kind::kSpill: {
          // Release the source; the destination was reserved at planning.
          b->charged->used[from] -= b->bytes;
          if (b->tier == Tier::kDevice) {
            b->worker->reserved -= b->bytes;
            out.device_bytes_freed += b->bytes;
            if (s != nullptr) {
              s->bytes -= b->bytes;
              ++s->spilled;
            }
          } else {
            b->worker->tier_used[from] -= b->bytes;
          }
          b->tier = item.to;
          // Spill link: blocks spilled together come back together.
          if (spilled_prev != 0) {
            graph_.Link(spilled_prev, b->lineage_id, EdgeKind::kSpill);
          }
          spilled_prev = b->lineage_id;
          e = MakeEvent(*clock_, EventKind::kBlockSpilled, s, b);
          e.detail =
              absl::StrCat("tier=", TierName(item.to), " bytes=", b->bytes);
          ++spills_;
          ++out.spills;
          break;
        }
        case TierCommand::Kind::kRestore: {
          b->charged->used[from] -= b->bytes;
          b->worker->tier_used[from] -= b->bytes;
          b->tier = Tier::kDevice;
          if (s != nullptr) {
            s->bytes += b->bytes;
            if (s->spilled > 0) --s->spilled;
          }
          e = MakeEvent(*clock_, EventKind::kBlockRestored, s, b);
          e.detail = absl::StrCat("from=", TierName(item.from),
                                  " bytes=", b->bytes, " by=manager");
          ++restores_;
          ++out.restores;
          break;
        }
        case TierCommand::Kind::kEvict: {
          b->charged->used[from] -= b->bytes;
          if (b->tier == Tier::kDevice) {
            b->worker->reserved -= b->bytes;
            out.device_bytes_freed += b->bytes;
            if (s != nullptr) s->bytes -= b->bytes;
          } else {
            b->worker->tier_used[from] -= b->bytes;
            if (s != nullptr && s->spilled > 0) --s->spilled;
          }
          b->evicted = true;
          e = MakeEvent(*clock_, EventKind::kBlockEvicted, s, b);
          e.detail =
              absl::StrCat("tier=", TierName(b->tier), " bytes=", b->bytes);
          ++evictions_;
          ++out.evictions;
          break;
        }
      }
      if (s != nullptr) Touch(s);
      ev->push_back(std::move(e));
    }
  }
  if (outcome != nullptr) *outcome = std::move(out);
  return absl::OkStatus();
}

void PressureCoordinator::ApplyWorkerRestores(WorkerRecord* w,
                                              const std::vector<uint64_t>& ids,
                                              std::vector<Event>* ev) {
  for (uint64_t id : ids) {
    BlockRecord* b = sequences_->FindBlock(id);
    if (b == nullptr) continue;
    // A block a manager restore is acting on is committed by that restore.
    if (b->worker != w || b->tier == Tier::kDevice || b->evicted ||
        b->busy != 0) {
      continue;
    }
    const int from = static_cast<int>(b->tier);
    const Tier old = b->tier;
    b->charged->used[from] -= b->bytes;
    w->tier_used[from] -= b->bytes;
    b->tier = Tier::kDevice;
    b->charged->used[static_cast<int>(Tier::kDevice)] += b->bytes;
    w->Reserve(b->bytes);
    SequenceRecord* s = SequenceTable::Owner(*b);
    if (s != nullptr) {
      s->bytes += b->bytes;
      if (s->spilled > 0) --s->spilled;
      Touch(s);
    }
    Event e = MakeEvent(*clock_, EventKind::kBlockRestored, s, b);
    e.detail =
        absl::StrCat("from=", TierName(old), " bytes=", b->bytes, " by=worker");
    ev->push_back(std::move(e));
    ++restores_;
  }
}

}  // namespace triax::manager
