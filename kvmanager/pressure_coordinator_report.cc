// PressureCoordinator's reports (pressure_coordinator.h): the bytes held
// for resumption, what a shortfall is still short by and why
// (ShortBytes, ExplainShortfall), and the GetPressure view. Split from
// pressure_coordinator.cc, which plans and commits.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "kvmanager/pressure_coordinator.h"

namespace triax::manager {

// --- Shortfalls --------------------------------------------------------------

uint64_t PressureCoordinator::HeldForResume(const WorkerRecord& w) {
  return w.tier_used[static_cast<int>(Tier::kHost)] +
         w.tier_used[static_cast<int>(Tier::kDisk)];
}

uint64_t PressureCoordinator::HeldForResume(const TenantRecord& t) {
  return t.used[static_cast<int>(Tier::kHost)] +
         t.used[static_cast<int>(Tier::kDisk)];
}

uint64_t PressureCoordinator::ShortBytes(const AdmissionShortfall& sf) const {
  uint64_t short_by = 0;
  const int dev = static_cast<int>(Tier::kDevice);
  if (const TenantRecord* t = tenants_->FindOrNull(sf.tenant_id);
      t != nullptr && t->budgets[dev]) {
    const uint64_t want =
        t->used[dev] + sf.tenant_held_bytes + sf.request_bytes;
    const uint64_t ceiling = t->budgets[dev]->ceiling_bytes;
    if (want > ceiling) short_by = want - ceiling;
  }
  if (const WorkerRecord* w = workers_->Find(sf.worker_id); w != nullptr) {
    const uint64_t want =
        w->reserved + sf.worker_held_bytes + sf.WorkerRequestBytes();
    const uint64_t cap = w->info.capacity_bytes;
    if (want > cap) short_by = std::max(short_by, want - cap);
  }
  return short_by;
}

std::string PressureCoordinator::ExplainShortfall(
    const AdmissionShortfall& sf) const {
  const WorkerRecord* w = workers_->Find(sf.worker_id);
  if (w == nullptr) {
    return absl::StrCat("worker ", Quote(sf.worker_id), " is not known");
  }
  // The tenant's own blocks when its ceiling is what is short.
  const TenantRecord* only = nullptr;
  const int dev = static_cast<int>(Tier::kDevice);
  if (const TenantRecord* t = tenants_->FindOrNull(sf.tenant_id);
      t != nullptr && t->budgets[dev] &&
      t->used[dev] + sf.tenant_held_bytes + sf.request_bytes >
          t->budgets[dev]->ceiling_bytes) {
    only = t;
  }
  // What the ranking still offers per block of this worker's device pool.
  absl::flat_hash_map<uint64_t, PressureAction> offered;
  if (snapshot_ != nullptr) {
    const PressureSnapshot& snap = *snapshot_;
    for (uint32_t wi = 0; wi < snap.worker_ids.size(); ++wi) {
      if (snap.worker_ids[wi] != sf.worker_id ||
          wi >= snap.ranking.pools.size() ||
          snap.ranking.pools[wi].size() <= static_cast<size_t>(dev)) {
        continue;
      }
      for (const RankedAction& a : snap.ranking.pools[wi][dev]) {
        offered.emplace(a.lineage_id, a.action);
      }
    }
  }
  enum Reason : int {
    kBusy = 0,
    kShared,
    kWindow,
    kExcluded,
    kNothingLeft,
    kOnlySpill,
    kActive,
    kOther,
    kReasons
  };
  static constexpr const char* kNames[kReasons] = {
      "in a tier plan",
      "shared with a fork",
      "in the window guard",
      "of the sequence being resumed",
      "with nothing left to take (protected, smallest encoding, no spill)",
      "spillable only (a spill makes no room for a new sequence)",
      "spillable only, of a sequence in use (the active guard)",
      "not taken (changed since the ranking, or the spill tier is full)"};
  std::array<uint64_t, kReasons> blocks{};
  std::array<uint64_t, kReasons> bytes{};
  uint64_t total = 0;
  const int64_t now = clock_->NowMs();
  for (const SequenceRecord* s : w->open) {
    if (only != nullptr && s->tenant != only) continue;
    for (const BlockRecord* b : s->blocks) {
      if (b->tier != Tier::kDevice || b->evicted || b->bytes == 0) continue;
      Reason r = kOther;
      if (b->busy != 0) {
        r = kBusy;
      } else if (b->refcount != 1) {
        r = kShared;
      } else if (s->id == sf.exclude_sequence_id) {
        r = kExcluded;
      } else if (!SealedOutsideWindow(*s, *b, options_.window_guard_tokens)) {
        r = kWindow;
      } else if (auto it = offered.find(b->lineage_id); it == offered.end()) {
        r = kNothingLeft;
      } else if (sf.resume_reserve && IsSpill(it->second)) {
        r = kOnlySpill;
      } else if (IsSpill(it->second) && Active(*s, now)) {
        r = kActive;
      }
      ++blocks[r];
      bytes[r] += b->bytes;
      ++total;
    }
  }
  std::vector<std::string> parts;
  for (int r = 0; r < kReasons; ++r) {
    if (blocks[r] == 0) continue;
    parts.push_back(
        absl::StrCat(blocks[r], " (", bytes[r], " bytes) ", kNames[r]));
  }
  std::string out = absl::StrCat(
      "device blocks left on worker ", Quote(sf.worker_id),
      only != nullptr ? absl::StrCat(" of tenant ", Quote(only->id)) : "", ": ",
      total == 0 ? "none" : absl::StrJoin(parts, ", "));
  if (sf.resume_reserve &&
      (sf.worker_held_bytes > 0 || sf.tenant_held_bytes > 0)) {
    absl::StrAppend(&out, "; ", sf.worker_held_bytes,
                    " bytes on the worker and ", sf.tenant_held_bytes,
                    " of the tenant held for spilled open sequences to resume");
  }
  return out;
}

// --- Inspection --------------------------------------------------------------

PressureState PressureCoordinator::GetPressure(uint32_t top) const {
  PressureState out;
  out.mode = PressureModeName(options_.ranker.mode);
  std::vector<std::string> ids;
  for (const auto& [id, w] : workers_->all()) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (const std::string& id : ids) {
    const WorkerRecord& w = *workers_->Find(id);
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
  out.tenants = tenants_->List();
  out.demotions = demotions_;
  out.spills = spills_;
  out.restores = restores_;
  out.evictions = evictions_;
  if (snapshot_ != nullptr) {
    const PressureSnapshot& snap = *snapshot_;
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
      if (const BlockRecord* b = sequences_->FindBlock(a->lineage_id)) {
        if (const SequenceRecord* s = SequenceTable::Owner(*b)) {
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
