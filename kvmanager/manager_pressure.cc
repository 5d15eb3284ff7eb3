// ManagerCore's memory-pressure half: snapshots for the ranker, tier plans
// (demote / spill / restore / evict through the workers), access reports and
// prefetch. See manager_core.h "Memory pressure".
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/manager_core_internal.h"

namespace triax::manager {

// The published snapshot: the ranking plus what maps its indices back to
// the registry.
struct ManagerCore::Snapshot {
  Ranking ranking;
  int64_t built_ms = 0;
  double snapshot_ms = 0;      // the whole copy (in chunks)
  double longest_hold_ms = 0;  // the longest hold of the core mutex in it
  std::vector<std::string> worker_ids;    // PressureInput::workers order
  std::vector<std::string> sequence_ids;  // PressureInput::sequences order
  std::vector<std::string> tenant_ids;    // PressureInput::tenants order
};

namespace {

constexpr size_t kMaxReportIds = 4096;
// Temporal adjacency in the block graph: a block gains this share of the
// importance of its more important neighbour in the sequence (index +-1),
// so the blocks around an attended one are kept too.
constexpr double kAdjacencyShare = 0.5;

// Applies kAdjacencyShare to views[first..] (one sequence's blocks, in
// index order; neighbours absent from the views do not count).
void AddTemporalAdjacency(std::vector<BlockView>* views, size_t first) {
  const size_t n = views->size() - first;
  if (n < 2) return;
  std::vector<double> own(n);
  for (size_t j = 0; j < n; ++j) own[j] = (*views)[first + j].importance;
  for (size_t j = 0; j < n; ++j) {
    BlockView& v = (*views)[first + j];
    double nb = 0;
    if (j > 0 && (*views)[first + j - 1].index + 1 == v.index) {
      nb = std::max(nb, own[j - 1]);
    }
    if (j + 1 < n && (*views)[first + j + 1].index == v.index + 1) {
      nb = std::max(nb, own[j + 1]);
    }
    v.importance += kAdjacencyShare * nb;
  }
}

// Blocks copied per hold of the core mutex by RefreshRanking.
constexpr size_t kSnapshotChunkBlocks = 4096;

uint64_t PageBytesOf(const ModelShape& m, uint32_t block_tokens,
                     const Encoding& e) {
  const kernels::PageShape shape{static_cast<int>(block_tokens),
                                 static_cast<int>(m.n_kv_heads),
                                 static_cast<int>(m.head_dim)};
  return uint64_t{m.n_layers} * kernels::PageBytes(e, shape);
}

// Distortion model for tags without a calibration table: the noise of a
// uniform quantizer, 2^(-2 (b - 2)) at b effective bits (BF16: 0).
double FallbackDistortion(const Encoding& e, const kernels::PageShape& shape) {
  if (e.k == Format::kBF16 && e.v == Format::kBF16) return 0.0;
  const double bits = kernels::EffectiveBits(e, shape);
  return std::pow(2.0, -2.0 * (bits - 2.0));
}

uint64_t Watermark(uint64_t capacity, double fraction) {
  return static_cast<uint64_t>(static_cast<double>(capacity) * fraction);
}

}  // namespace

// --- Snapshot and ranking ----------------------------------------------------

double ManagerCore::RefreshRanking() {
  PressureInput input;
  auto snap = std::make_shared<Snapshot>();
  const auto copy_start = std::chrono::steady_clock::now();
  {
    absl::ReleasableMutexLock lock(&mu_);
    input.blocks.reserve(blocks_.size());
    const int64_t now = clock_->NowMs();
    input.now_ms = now;
    snap->built_ms = now;
    absl::flat_hash_map<const Worker*, uint32_t> worker_index;
    for (const auto& [id, w] : workers_) {
      if (w->info.state != WorkerState::kUp) continue;
      worker_index[w.get()] = static_cast<uint32_t>(input.workers.size());
      WorkerView v;
      v.worker_id = id;
      v.capacity[static_cast<int>(Tier::kDevice)] = w->info.capacity_bytes;
      v.capacity[static_cast<int>(Tier::kHost)] = w->info.host_capacity_bytes;
      v.capacity[static_cast<int>(Tier::kDisk)] = w->info.disk_capacity_bytes;
      v.used[static_cast<int>(Tier::kDevice)] = w->reserved;
      v.used[static_cast<int>(Tier::kHost)] =
          w->tier_used[static_cast<int>(Tier::kHost)];
      v.used[static_cast<int>(Tier::kDisk)] =
          w->tier_used[static_cast<int>(Tier::kDisk)];
      input.workers.push_back(std::move(v));
      snap->worker_ids.push_back(id);
    }
    absl::flat_hash_map<const Tenant*, uint32_t> tenant_index;
    for (const auto& [id, t] : tenants_) {
      tenant_index[t.get()] = static_cast<uint32_t>(input.tenants.size());
      TenantView v;
      v.tenant_id = id;
      for (int tier = 1; tier < kNumTiers; ++tier) {
        v.used[tier] = t->used[tier];
        if (t->budgets[tier]) {
          v.floor[tier] = t->budgets[tier]->floor_bytes;
          v.ceiling[tier] = t->budgets[tier]->ceiling_bytes;
        }
      }
      input.tenants.push_back(std::move(v));
      snap->tenant_ids.push_back(id);
    }
    // Option sets per (table, shape) group and tag: the group is looked up
    // once per sequence, the tag by a dense index (kTagCodes) per block.
    constexpr int kTagCodes = 5 * 4 * kNumRoles;
    std::map<std::tuple<const void*, uint32_t, uint32_t, uint32_t, uint32_t>,
             std::vector<int32_t>>
        groups;
    auto option_set_of = [&](const Sequence& s, const Tag& tag,
                             const Calibration* table,
                             std::vector<int32_t>* group) -> int32_t {
      const Modality modality = tag.modality == Modality::kUnspecified
                                    ? Modality::kText
                                    : tag.modality;
      const int t = static_cast<int>(tag.temporal);
      const int m = static_cast<int>(modality);
      const int r = static_cast<int>(tag.role);
      const bool dense =
          t >= 0 && t < 5 && m >= 0 && m < 4 && r >= 0 && r < kNumRoles;
      const int code = dense ? (t * 4 + m) * kNumRoles + r : -1;
      if (code >= 0 && (*group)[code] >= 0) return (*group)[code];
      const kernels::PageShape shape{static_cast<int>(s.block_tokens),
                                     static_cast<int>(s.model.n_kv_heads),
                                     static_cast<int>(s.model.head_dim)};
      OptionSet set;
      bool have_bf16 = false;
      if (table != nullptr) {
        for (size_t i = 0; i < table->info.entries.size(); ++i) {
          const CalibrationEntryInfo& e = table->info.entries[i];
          const Modality em = e.tag.modality == Modality::kUnspecified
                                  ? Modality::kText
                                  : e.tag.modality;
          if (e.tag.temporal != tag.temporal || e.tag.role != tag.role ||
              em != modality) {
            continue;
          }
          const Encoding& enc = table->encodings[i];
          if (kernels::ValidateEncoding(enc, shape) != nullptr) continue;
          set.options.push_back(DemoteOption{
              enc, PageBytesOf(s.model, s.block_tokens, enc), e.distortion});
          have_bf16 |= enc == Encoding(Format::kBF16);
        }
      }
      if (set.options.empty()) {
        // No calibration for this tag: the fallback noise model.
        for (Format f : {Format::kBF16, Format::kFP8, Format::kINT8,
                         Format::kINT4, Format::kINT2}) {
          const Encoding enc(f);
          if (kernels::ValidateEncoding(enc, shape) != nullptr) continue;
          set.options.push_back(
              DemoteOption{enc, PageBytesOf(s.model, s.block_tokens, enc),
                           FallbackDistortion(enc, shape)});
        }
        have_bf16 = true;
      }
      if (!have_bf16) {
        const Encoding bf16(Format::kBF16);
        set.options.push_back(
            DemoteOption{bf16, PageBytesOf(s.model, s.block_tokens, bf16), 0});
      }
      std::sort(set.options.begin(), set.options.end(),
                [](const DemoteOption& a, const DemoteOption& b) {
                  return a.bytes > b.bytes;
                });
      double worst = 0;
      for (const DemoteOption& o : set.options)
        worst = std::max(worst, o.distortion);
      set.evict_distortion = worst > 0
                                 ? options_.ranker.evict_factor * worst
                                 : options_.ranker.default_evict_distortion;
      const int32_t index = static_cast<int32_t>(input.option_sets.size());
      input.option_sets.push_back(std::move(set));
      if (code >= 0) (*group)[code] = index;
      return index;
    };
    std::vector<std::string> ids;
    ids.reserve(sequences_.size());
    for (const auto& [id, sp] : sequences_) {
      if (sp->state == SequenceState::kOpen) ids.push_back(id);
    }
    lock.Release();
    // The blocks are copied in chunks of about kSnapshotChunkBlocks, the
    // mutex released in between, so the hot path never waits for a whole
    // snapshot. The snapshot is then not one instant's view; the planners
    // re-check every action against the live registry anyway.
    std::vector<std::shared_ptr<const Calibration>> tables;  // keep alive
    size_t next = 0;
    while (next < ids.size()) {
      absl::MutexLock chunk_lock(&mu_);
      const auto hold_start = std::chrono::steady_clock::now();
      size_t copied = 0;
      for (; next < ids.size() && copied < kSnapshotChunkBlocks; ++next) {
        auto sit = sequences_.find(ids[next]);
        if (sit == sequences_.end()) continue;
        const Sequence& s = *sit->second;
        if (s.state != SequenceState::kOpen) continue;
        auto wi = worker_index.find(s.worker);
        if (wi == worker_index.end()) continue;
        auto ti = tenant_index.find(s.tenant);
        if (ti == tenant_index.end()) continue;
        copied += s.blocks.size();
        const Calibration* table = s.calibration.get();
        if (table == nullptr) {
          auto ct = calibrations_.find(s.model.name);
          if (ct != calibrations_.end()) {
            const ModelShape& cs = ct->second->info.shape;
            if (cs.n_layers == s.model.n_layers &&
                cs.n_kv_heads == s.model.n_kv_heads &&
                cs.n_q_heads == s.model.n_q_heads &&
                cs.head_dim == s.model.head_dim) {
              table = ct->second.get();
              tables.push_back(ct->second);
            }
          }
        } else {
          tables.push_back(s.calibration);
        }
        std::vector<int32_t>& group =
            groups
                .try_emplace(
                    std::make_tuple(static_cast<const void*>(table),
                                    s.model.n_layers, s.model.n_kv_heads,
                                    s.model.head_dim, s.block_tokens),
                    kTagCodes, -1)
                .first->second;
        const uint32_t seq_index =
            static_cast<uint32_t>(input.sequences.size());
        SequenceView sv;
        sv.sequence_id = s.id;
        sv.tenant = ti->second;
        sv.worker = wi->second;
        sv.last_access_ms = s.last_access_ms;
        input.sequences.push_back(sv);
        snap->sequence_ids.push_back(s.id);
        const size_t first_view = input.blocks.size();
        for (const Block* b : s.blocks) {
          if (b->refcount != 1 || b->evicted || b->busy != 0) continue;
          BlockView v;
          v.lineage_id = b->lineage_id;
          v.sequence = seq_index;
          v.index = b->index;
          v.tag = b->tag;
          v.tier = b->tier;
          v.tokens = b->num_tokens;
          v.refcount = b->refcount;
          v.sealed =
              b->num_tokens == b->capacity &&
              b->first_token + b->num_tokens + options_.window_guard_tokens <=
                  s.num_tokens;
          v.encoding = b->encoding;
          v.bytes = b->bytes;
          v.option_set = option_set_of(s, b->tag, table, &group);
          for (const DemoteOption& o :
               input.option_sets[v.option_set].options) {
            if (o.encoding == b->encoding) v.distortion = o.distortion;
          }
          graph_.Snapshot(b->lineage_id, now, &v);
          input.blocks.push_back(v);
        }
        AddTemporalAdjacency(&input.blocks, first_view);
      }
      snap->longest_hold_ms =
          std::max(snap->longest_hold_ms,
                   std::chrono::duration<double, std::milli>(
                       std::chrono::steady_clock::now() - hold_start)
                       .count());
    }
  }
  const auto start = std::chrono::steady_clock::now();
  snap->snapshot_ms =
      std::chrono::duration<double, std::milli>(start - copy_start).count();
  absl::MutexLock rank_lock(&rank_mu_);
  absl::StatusOr<Ranking> ranking =
      Rank(input, options_.ranker, rank_scratch_.get());
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
  absl::MutexLock lock(&mu_);
  snapshot_ = std::move(snap);
  return ms;
}

// --- Plans
// ---------------------------------------------------------------------

// Whether `b` may take `a` now: unchanged since the snapshot, idle, and (for
// spills) with room in the destination tier of its worker and tenant.
bool ManagerCore::ActionValidLocked(const RankedAction& a, const Block& b,
                                    const Sequence& s,
                                    std::array<uint64_t, kNumTiers>* worker_add,
                                    uint64_t* tenant_add) const {
  if (b.busy != 0 || b.evicted || b.refcount != 1 || b.tier != a.from) {
    return false;
  }
  if (s.state != SequenceState::kOpen) return false;
  if (a.action == PressureAction::kDemote) {
    // The block may have been re-encoded since the snapshot (aging, an
    // earlier plan): only a target smaller than its encoding now is a
    // demotion. (Busy blocks cannot change until FinishTierPlan.)
    return b.tier == Tier::kDevice &&
           PageBytesOf(s.model, s.block_tokens, a.encoding) < b.bytes;
  }
  if (a.action == PressureAction::kSpillHost ||
      a.action == PressureAction::kSpillDisk) {
    const Tier to =
        a.action == PressureAction::kSpillHost ? Tier::kHost : Tier::kDisk;
    const int t = static_cast<int>(to);
    const Worker& w = *s.worker;
    const uint64_t cap = to == Tier::kHost ? w.info.host_capacity_bytes
                                           : w.info.disk_capacity_bytes;
    if (w.tier_used[t] + (*worker_add)[t] + b.bytes > cap) return false;
    const Tenant& tn = *s.tenant;
    if (tn.budgets[t] &&
        tn.used[t] + tenant_add[t] + b.bytes > tn.budgets[t]->ceiling_bytes) {
      return false;
    }
  }
  return true;
}

ManagerCore::Sequence* ManagerCore::OwnerLocked(const Block& b) const {
  Sequence* s = b.owner;
  if (s != nullptr && s->state == SequenceState::kOpen &&
      b.index < s->blocks.size() && s->blocks[b.index] == &b) {
    return s;
  }
  return nullptr;
}

TierPlan ManagerCore::PlanFromPicksLocked(
    const std::vector<std::pair<Block*, RankedAction>>& picks,
    const std::string& reason) {
  TierPlan plan;
  if (picks.empty()) return plan;
  auto pending = std::make_unique<PendingTier>();
  const uint64_t token = next_token_++;
  // One command per (sequence, kind, destination).
  std::map<std::tuple<std::string, int, int>, size_t> command_of;
  for (const auto& [b, a] : picks) {
    Sequence* s = OwnerLocked(*b);
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
      PendingTier::Command pc;
      pc.kind = kind;
      pc.worker_id = s->worker->info.worker_id;
      pc.tenant_id = s->tenant->id;
      pc.sequence_id = s->id;
      pending->commands.push_back(std::move(pc));
    }
    TierCommand& c = plan.commands[ci->second];
    PendingTier::Command& pc = pending->commands[ci->second];
    PendingTier::Item item;
    item.lineage_id = b->lineage_id;
    item.from_bytes = b->bytes;
    item.from = b->tier;
    BlockPlan bp = PlanOf(*b);
    if (kind == TierCommand::Kind::kDemote) {
      item.encoding = a.encoding;
      item.to_bytes = PageBytesOf(s->model, s->block_tokens, a.encoding);
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
    c.blocks.push_back(std::move(bp));
    pc.items.push_back(item);
  }
  if (plan.commands.empty()) return TierPlan{};
  plan.token = token;
  plan.reason = reason;
  pending_tier_.emplace(token, std::move(pending));
  return plan;
}

// Takes candidates from pool (worker index wi, tier) of the snapshot until
// `need` bytes are freed; `tenant` (when set) restricts to its blocks.
void ManagerCore::PickLocked(
    const Snapshot& snap, uint32_t wi, Tier tier, uint64_t need,
    const Tenant* tenant, const Sequence* exclude,
    std::vector<std::pair<Block*, RankedAction>>* picks,
    absl::flat_hash_set<uint64_t>* taken, uint64_t* freed) {
  std::array<uint64_t, kNumTiers> worker_add{};
  absl::flat_hash_map<const Tenant*, std::array<uint64_t, kNumTiers>>
      tenant_add;
  uint64_t got = 0;
  const auto selected =
      SelectReclaim(snap.ranking, wi, tier, need, [&](const RankedAction& a) {
        if (picks->size() >= options_.max_plan_blocks) return true;
        if (taken->contains(a.lineage_id)) return true;
        auto it = blocks_.find(a.lineage_id);
        if (it == blocks_.end()) return true;
        Block* b = it->second.get();
        Sequence* s = OwnerLocked(*b);
        if (s == nullptr) return true;
        if (tenant != nullptr && s->tenant != tenant) return true;
        if (s == exclude) return true;
        if (!ActionValidLocked(a, *b, *s, &worker_add,
                               tenant_add[s->tenant].data())) {
          return true;
        }
        if (a.action == PressureAction::kSpillHost ||
            a.action == PressureAction::kSpillDisk) {
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

bool ManagerCore::NeedsReclaim() const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, w] : workers_) {
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
  for (const auto& [id, t] : tenants_) {
    if (t->budgets[dev] && t->used[dev] > t->budgets[dev]->ceiling_bytes) {
      return true;
    }
  }
  return false;
}

TierPlan ManagerCore::PlanPressure() {
  absl::MutexLock lock(&mu_);
  if (snapshot_ == nullptr) return TierPlan{};
  const Snapshot& snap = *snapshot_;
  std::vector<std::pair<Block*, RankedAction>> picks;
  absl::flat_hash_set<uint64_t> taken;
  std::vector<std::string> reasons;
  for (uint32_t wi = 0; wi < snap.worker_ids.size(); ++wi) {
    auto it = workers_.find(snap.worker_ids[wi]);
    if (it == workers_.end()) continue;
    const Worker& w = *it->second;
    if (w.info.state != WorkerState::kUp) continue;
    // Device pool, then the host tier.
    const uint64_t cap = w.info.capacity_bytes;
    if (w.reserved > Watermark(cap, options_.watermarks.high)) {
      const uint64_t need =
          w.reserved - Watermark(cap, options_.watermarks.low);
      uint64_t freed = 0;
      PickLocked(snap, wi, Tier::kDevice, need, nullptr, nullptr, &picks,
                 &taken, &freed);
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
      PickLocked(snap, wi, Tier::kHost, need, nullptr, nullptr, &picks, &taken,
                 &freed);
      reasons.push_back(absl::StrCat("worker ", w.info.worker_id, " host ",
                                     host_used, "/", host_cap, " need ", need,
                                     " planned ", freed));
    }
  }
  // Tenants above their device ceiling (a lowered budget).
  const int dev = static_cast<int>(Tier::kDevice);
  for (const auto& [id, t] : tenants_) {
    if (!t->budgets[dev] || t->used[dev] <= t->budgets[dev]->ceiling_bytes) {
      continue;
    }
    uint64_t need = t->used[dev] - t->budgets[dev]->ceiling_bytes;
    uint64_t freed = 0;
    for (uint32_t wi = 0; wi < snap.worker_ids.size() && freed < need; ++wi) {
      PickLocked(snap, wi, Tier::kDevice, need - freed, t.get(), nullptr,
                 &picks, &taken, &freed);
    }
    reasons.push_back(absl::StrCat("tenant ", id, " over ceiling by ", need,
                                   " planned ", freed));
  }
  return PlanFromPicksLocked(picks, absl::StrJoin(reasons, "; "));
}

TierPlan ManagerCore::PlanAdmission(const AdmissionShortfall& sf) {
  absl::MutexLock lock(&mu_);
  if (snapshot_ == nullptr) return TierPlan{};
  const Snapshot& snap = *snapshot_;
  auto ti = tenants_.find(sf.tenant_id);
  if (ti == tenants_.end()) return TierPlan{};
  const Tenant* tenant = ti->second.get();
  const Sequence* exclude = nullptr;
  if (!sf.exclude_sequence_id.empty()) {
    auto si = sequences_.find(sf.exclude_sequence_id);
    if (si != sequences_.end()) exclude = si->second.get();
  }
  std::vector<std::pair<Block*, RankedAction>> picks;
  absl::flat_hash_set<uint64_t> taken;
  std::vector<std::string> reasons;
  const int dev = static_cast<int>(Tier::kDevice);
  uint64_t tenant_freed = 0;
  if (tenant->budgets[dev]) {
    const uint64_t ceiling = tenant->budgets[dev]->ceiling_bytes;
    if (tenant->used[dev] + sf.request_bytes > ceiling) {
      const uint64_t need = tenant->used[dev] + sf.request_bytes - ceiling;
      for (uint32_t wi = 0; wi < snap.worker_ids.size() && tenant_freed < need;
           ++wi) {
        PickLocked(snap, wi, Tier::kDevice, need - tenant_freed, tenant,
                   exclude, &picks, &taken, &tenant_freed);
      }
      reasons.push_back(absl::StrCat("tenant ", sf.tenant_id, " ceiling need ",
                                     need, " planned ", tenant_freed));
    }
  }
  for (uint32_t wi = 0; wi < snap.worker_ids.size(); ++wi) {
    if (snap.worker_ids[wi] != sf.worker_id) continue;
    auto wit = workers_.find(sf.worker_id);
    if (wit == workers_.end()) break;
    const Worker& w = *wit->second;
    const uint64_t cap = w.info.capacity_bytes;
    // Room for the request, then down to the low watermark if that is more
    // (so the next admissions do not each trigger a reclaim).
    uint64_t need = 0;
    if (w.reserved + sf.request_bytes > cap) {
      need = w.reserved + sf.request_bytes - cap;
    }
    if (need == 0) break;
    const uint64_t low = Watermark(cap, options_.watermarks.low);
    if (w.reserved + sf.request_bytes > low) {
      need = std::max(need, w.reserved + sf.request_bytes - low);
    }
    // Blocks already picked for the tenant's ceiling on this worker count.
    uint64_t freed = 0;
    for (const auto& [b, a] : picks) {
      if (b->worker == &w && a.from == Tier::kDevice) freed += a.bytes_freed;
    }
    if (freed < need) {
      PickLocked(snap, wi, Tier::kDevice, need - freed, nullptr, exclude,
                 &picks, &taken, &freed);
    }
    reasons.push_back(absl::StrCat("worker ", sf.worker_id, " room need ", need,
                                   " planned ", freed));
  }
  return PlanFromPicksLocked(picks, absl::StrJoin(reasons, "; "));
}

// --- Access reports and prefetch
// ----------------------------------------------

absl::StatusOr<TierPlan> ManagerCore::ReportAccess(
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
  absl::MutexLock lock(&mu_);
  TRIAX_ASSIGN_OR_RETURN(
      Sequence * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id));
  std::vector<Block*> reported;
  reported.reserve(req.lineage_ids.size());
  for (size_t i = 0; i < req.lineage_ids.size(); ++i) {
    auto it = blocks_.find(req.lineage_ids[i]);
    Block* b = it == blocks_.end() ? nullptr : it->second.get();
    if (b == nullptr || b->index >= s->blocks.size() ||
        s->blocks[b->index] != b) {
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
  std::vector<Block*> want;
  absl::flat_hash_set<uint64_t> seen;
  for (Block* r : reported) {
    for (uint64_t n : graph_.Neighbours(r->lineage_id)) {
      auto it = blocks_.find(n);
      if (it == blocks_.end()) continue;
      Block* b = it->second.get();
      if (b->tier != Tier::kDevice && !b->evicted && b->busy == 0 &&
          b->refcount == 1 && OwnerLocked(*b) != nullptr &&
          seen.insert(n).second) {
        want.push_back(b);
      }
    }
  }
  return PlanRestoreLocked(want, absl::StrCat("neighbours of ", s->id),
                           /*limit_to_high=*/true, nullptr);
}

TierPlan ManagerCore::PlanPrefetch(const std::string& sequence_id,
                                   AdmissionShortfall* shortfall) {
  absl::MutexLock lock(&mu_);
  if (shortfall != nullptr) *shortfall = AdmissionShortfall{};
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return TierPlan{};
  Sequence* s = it->second.get();
  if (s->state != SequenceState::kOpen || s->spilled == 0) return TierPlan{};
  std::vector<Block*> want;
  for (Block* b : s->blocks) {
    if (b->tier != Tier::kDevice && !b->evicted && b->busy == 0) {
      want.push_back(b);
    }
  }
  uint64_t unfit = 0;
  TierPlan plan = PlanRestoreLocked(want, absl::StrCat("restore ", s->id),
                                    /*limit_to_high=*/false, &unfit);
  if (shortfall != nullptr && unfit > 0) {
    *shortfall = AdmissionShortfall{s->tenant->id, s->worker->info.worker_id,
                                    unfit, s->id};
  }
  return plan;
}

TierPlan ManagerCore::PlanRestoreLocked(const std::vector<Block*>& want,
                                        const std::string& reason,
                                        bool limit_to_high,
                                        uint64_t* unfit_bytes) {
  TierPlan plan;
  if (want.empty()) return plan;
  auto pending = std::make_unique<PendingTier>();
  const uint64_t token = next_token_++;
  std::map<std::string, size_t> command_of;
  const int dev = static_cast<int>(Tier::kDevice);
  for (Block* b : want) {
    Sequence* s = OwnerLocked(*b);
    if (s == nullptr || s->state != SequenceState::kOpen) continue;
    Worker* w = s->worker;
    Tenant* t = s->tenant;
    // Only what fits: below the high watermark for neighbours, the
    // capacity for an active sequence; never past the tenant's ceiling.
    const uint64_t limit = limit_to_high ? Watermark(w->info.capacity_bytes,
                                                     options_.watermarks.high)
                                         : w->info.capacity_bytes;
    if (w->reserved + b->bytes > limit ||
        (t->budgets[dev] &&
         t->used[dev] + b->bytes > t->budgets[dev]->ceiling_bytes)) {
      if (unfit_bytes != nullptr) *unfit_bytes += b->bytes;
      continue;
    }
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
      PendingTier::Command pc;
      pc.kind = TierCommand::Kind::kRestore;
      pc.worker_id = w->info.worker_id;
      pc.tenant_id = t->id;
      pc.sequence_id = s->id;
      pending->commands.push_back(std::move(pc));
    }
    PendingTier::Item item;
    item.lineage_id = b->lineage_id;
    item.from_bytes = b->bytes;
    item.from = b->tier;
    item.to = Tier::kDevice;
    item.reserved = b->bytes;
    w->reserved += b->bytes;
    t->used[dev] += b->bytes;
    b->busy = token;
    plan.bytes += b->bytes;
    plan.commands[ci->second].blocks.push_back(PlanOf(*b));
    pending->commands[ci->second].items.push_back(item);
  }
  if (plan.commands.empty()) return TierPlan{};
  plan.token = token;
  plan.reason = reason;
  pending_tier_.emplace(token, std::move(pending));
  return plan;
}

// --- Commit
// ----------------------------------------------------------------------

absl::Status ManagerCore::FinishTierPlan(
    uint64_t token, const std::vector<absl::Status>& results) {
  std::vector<Event> ev;
  {
    absl::MutexLock lock(&mu_);
    auto pit = pending_tier_.find(token);
    if (pit == pending_tier_.end()) {
      return absl::NotFoundError(
          absl::StrCat("tier plan token ", token, " is not pending"));
    }
    std::unique_ptr<PendingTier> p = std::move(pit->second);
    pending_tier_.erase(pit);
    for (size_t ci = 0; ci < p->commands.size(); ++ci) {
      const PendingTier::Command& c = p->commands[ci];
      const absl::Status st =
          ci < results.size()
              ? results[ci]
              : absl::InternalError("no result for the command");
      auto tit = tenants_.find(c.tenant_id);
      auto wit = workers_.find(c.worker_id);
      Tenant* t = tit == tenants_.end() ? nullptr : tit->second.get();
      Worker* w = wit == workers_.end() ? nullptr : wit->second.get();
      uint64_t spilled_prev = 0;
      for (const PendingTier::Item& item : c.items) {
        auto bit = blocks_.find(item.lineage_id);
        Block* b = bit == blocks_.end() ? nullptr : bit->second.get();
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
        Sequence* s = OwnerLocked(*b);
        Event e = MakeEvent(EventKind::kBlockDemoted, s, b);
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
            if (s != nullptr) s->bytes -= freed;
            e = MakeEvent(EventKind::kBlockDemoted, s, b);
            e.detail = absl::StrCat("from=", EncodingString(old),
                                    " to=", EncodingString(b->encoding),
                                    " bytes_freed=", freed, " by=pressure");
            ++demotions_;
            break;
          }
          case TierCommand::Kind::kSpill: {
            // Release the source; the destination was reserved at planning.
            b->charged->used[from] -= b->bytes;
            if (b->tier == Tier::kDevice) {
              b->worker->reserved -= b->bytes;
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
            e = MakeEvent(EventKind::kBlockSpilled, s, b);
            e.detail =
                absl::StrCat("tier=", TierName(item.to), " bytes=", b->bytes);
            ++spills_;
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
            e = MakeEvent(EventKind::kBlockRestored, s, b);
            e.detail = absl::StrCat("from=", TierName(item.from),
                                    " bytes=", b->bytes, " by=manager");
            ++restores_;
            break;
          }
          case TierCommand::Kind::kEvict: {
            b->charged->used[from] -= b->bytes;
            if (b->tier == Tier::kDevice) {
              b->worker->reserved -= b->bytes;
              if (s != nullptr) s->bytes -= b->bytes;
            } else {
              b->worker->tier_used[from] -= b->bytes;
              if (s != nullptr && s->spilled > 0) --s->spilled;
            }
            b->evicted = true;
            e = MakeEvent(EventKind::kBlockEvicted, s, b);
            e.detail =
                absl::StrCat("tier=", TierName(b->tier), " bytes=", b->bytes);
            ++evictions_;
            break;
          }
        }
        if (s != nullptr) ++s->version;
        ev.push_back(std::move(e));
      }
    }
    events_.Append(&ev);
  }
  return absl::OkStatus();
}

// Called by Heartbeat: blocks the worker restored on its own (restore on
// Attend) move back to the device in the accounting.
void ManagerCore::ApplyWorkerRestoresLocked(Worker* w,
                                            const std::vector<uint64_t>& ids,
                                            std::vector<Event>* ev) {
  for (uint64_t id : ids) {
    auto it = blocks_.find(id);
    if (it == blocks_.end()) continue;
    Block* b = it->second.get();
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
    w->reserved += b->bytes;
    Sequence* s = OwnerLocked(*b);
    if (s != nullptr) {
      s->bytes += b->bytes;
      if (s->spilled > 0) --s->spilled;
      ++s->version;
    }
    Event e = MakeEvent(EventKind::kBlockRestored, s, b);
    e.detail =
        absl::StrCat("from=", TierName(old), " bytes=", b->bytes, " by=worker");
    ev->push_back(std::move(e));
    ++restores_;
  }
}

// --- Inspection
// -------------------------------------------------------------------

PressureState ManagerCore::GetPressure(uint32_t top) const {
  absl::MutexLock lock(&mu_);
  PressureState out;
  out.mode = PressureModeName(options_.ranker.mode);
  std::vector<std::string> ids;
  for (const auto& [id, w] : workers_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (const std::string& id : ids) {
    const Worker& w = *workers_.at(id);
    if (w.info.state != WorkerState::kUp) continue;
    PoolState dev;
    dev.worker_id = id;
    dev.tier = Tier::kDevice;
    dev.capacity_bytes = w.info.capacity_bytes;
    dev.used_bytes = w.reserved;
    dev.high_watermark_bytes =
        Watermark(dev.capacity_bytes, options_.watermarks.high);
    dev.low_watermark_bytes =
        Watermark(dev.capacity_bytes, options_.watermarks.low);
    out.pools.push_back(dev);
    for (Tier tier : {Tier::kHost, Tier::kDisk}) {
      const uint64_t cap = tier == Tier::kHost ? w.info.host_capacity_bytes
                                               : w.info.disk_capacity_bytes;
      if (cap == 0) continue;
      PoolState p;
      p.worker_id = id;
      p.tier = tier;
      p.capacity_bytes = cap;
      p.used_bytes = w.tier_used[static_cast<int>(tier)];
      p.high_watermark_bytes = Watermark(cap, options_.watermarks.high);
      p.low_watermark_bytes = Watermark(cap, options_.watermarks.low);
      out.pools.push_back(p);
    }
  }
  std::vector<std::string> tids;
  for (const auto& [id, t] : tenants_) tids.push_back(id);
  std::sort(tids.begin(), tids.end());
  for (const std::string& id : tids) {
    out.tenants.push_back(TenantInfoLocked(*tenants_.at(id)));
  }
  out.demotions = demotions_;
  out.spills = spills_;
  out.restores = restores_;
  out.evictions = evictions_;
  if (snapshot_ != nullptr) {
    const Snapshot& snap = *snapshot_;
    out.snapshot_blocks = snap.ranking.blocks;
    out.snapshot_age_ms = static_cast<double>(clock_->NowMs() - snap.built_ms);
    out.ranking_ms = snap.ranking.ranking_ms;
    out.snapshot_ms = snap.snapshot_ms;
    out.snapshot_lock_ms = snap.longest_hold_ms;
    // The device pools' heads, merged by (floor class, cost).
    std::vector<const RankedAction*> all;
    for (const auto& by_tier : snap.ranking.pools) {
      const int dev = static_cast<int>(Tier::kDevice);
      if (static_cast<size_t>(dev) >= by_tier.size()) continue;
      const auto& pool = by_tier[dev];
      for (size_t i = 0; i < pool.size() && i < top; ++i) {
        all.push_back(&pool[i]);
      }
    }
    std::stable_sort(all.begin(), all.end(),
                     [](const RankedAction* a, const RankedAction* b) {
                       if (a->above_floor != b->above_floor)
                         return a->above_floor;
                       return a->cost < b->cost;
                     });
    if (all.size() > top) all.resize(top);
    for (const RankedAction* a : all) {
      RankedActionInfo info;
      info.lineage_id = a->lineage_id;
      auto it = blocks_.find(a->lineage_id);
      if (it != blocks_.end()) {
        if (const Sequence* s = OwnerLocked(*it->second)) {
          info.sequence_id = s->id;
          info.tenant_id = s->tenant->id;
        }
      }
      info.action = a->action;
      info.encoding = a->encoding;
      info.bytes_freed = a->bytes_freed;
      info.cost = a->cost;
      out.ranked.push_back(std::move(info));
    }
  }
  return out;
}

}  // namespace triax::manager
