#include "kvmanager/pressure_snapshot.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

namespace triax::manager {

namespace {

// Dense tag codes: temporal 0..4, modality 0..3, role 0..kNumRoles-1.
constexpr int kTagCodes = 5 * 4 * kNumRoles;

// The dense code of a tag (modality normalized), -1 when out of range.
inline int TagCode(const Tag& tag) {
  const int t = static_cast<int>(tag.temporal);
  const int m = static_cast<int>(NormalizeModality(tag.modality));
  const int r = static_cast<int>(tag.role);
  const bool dense =
      t >= 0 && t < 5 && m >= 0 && m < 4 && r >= 0 && r < kNumRoles;
  return dense ? (t * 4 + m) * kNumRoles + r : -1;
}

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

// Distortion model for tags without a calibration table: the noise of a
// uniform quantizer, 2^(-2 (b - 2)) at b effective bits (BF16: 0).
double FallbackDistortion(const Encoding& e, const kernels::PageShape& shape) {
  if (e.k == Format::kBF16 && e.v == Format::kBF16) return 0.0;
  const double bits = kernels::EffectiveBits(e, shape);
  return std::pow(2.0, -2.0 * (bits - 2.0));
}

}  // namespace

SnapshotBuilder::SnapshotBuilder(const Options& options,
                                 const WorkerRegistry& workers,
                                 const TenantLedger& tenants,
                                 const SequenceTable& sequences,
                                 const CalibrationStore& calibrations,
                                 const BlockGraph& graph)
    : options_(options),
      workers_(workers),
      tenants_(tenants),
      sequences_(sequences),
      calibrations_(calibrations),
      graph_(graph),
      snap_(std::make_shared<PressureSnapshot>()) {}

void SnapshotBuilder::Begin(int64_t now_ms) {
  input_.blocks.reserve(sequences_.num_blocks());
  now_ms_ = now_ms;
  input_.now_ms = now_ms;
  snap_->built_ms = now_ms;
  for (const auto& [id, w] : workers_.all()) {
    if (w->info.state != WorkerState::kUp) continue;
    worker_index_[w.get()] = static_cast<uint32_t>(input_.workers.size());
    WorkerView v;
    v.worker_id = id;
    v.capacity[static_cast<int>(Tier::kDevice)] = w->info.capacity_bytes;
    if (options_.spill_tiers) {
      v.capacity[static_cast<int>(Tier::kHost)] = w->info.host_capacity_bytes;
      v.capacity[static_cast<int>(Tier::kDisk)] = w->info.disk_capacity_bytes;
    }
    v.used[static_cast<int>(Tier::kDevice)] = w->reserved;
    v.used[static_cast<int>(Tier::kHost)] =
        w->tier_used[static_cast<int>(Tier::kHost)];
    v.used[static_cast<int>(Tier::kDisk)] =
        w->tier_used[static_cast<int>(Tier::kDisk)];
    input_.workers.push_back(std::move(v));
    snap_->worker_ids.push_back(id);
  }
  for (const auto& [id, t] : tenants_.all()) {
    tenant_index_[t.get()] = static_cast<uint32_t>(input_.tenants.size());
    TenantView v;
    v.tenant_id = id;
    for (int tier = 1; tier < kNumTiers; ++tier) {
      v.used[tier] = t->used[tier];
      if (t->budgets[tier]) {
        v.floor[tier] = t->budgets[tier]->floor_bytes;
        v.ceiling[tier] = t->budgets[tier]->ceiling_bytes;
      }
    }
    input_.tenants.push_back(std::move(v));
    snap_->tenant_ids.push_back(id);
  }
  ids_.reserve(sequences_.all().size());
  for (const auto& [id, sp] : sequences_.all()) {
    if (sp->state == SequenceState::kOpen) ids_.push_back(id);
  }
}

int32_t SnapshotBuilder::BuildOptionSet(const SequenceRecord& s, const Tag& tag,
                                        const CalibrationTable* table, int code,
                                        std::vector<int32_t>* group) {
  const Modality modality = NormalizeModality(tag.modality);
  const kernels::PageShape shape = PageShapeOf(s.model, s.block_tokens);
  OptionSet set;
  bool have_bf16 = false;
  if (table != nullptr) {
    for (size_t i = 0; i < table->info.entries.size(); ++i) {
      const CalibrationEntryInfo& e = table->info.entries[i];
      if (e.tag.temporal != tag.temporal || e.tag.role != tag.role ||
          NormalizeModality(e.tag.modality) != modality) {
        continue;
      }
      const Encoding& enc = table->encodings[i];
      if (kernels::ValidateEncoding(enc, shape) != nullptr) continue;
      set.options.push_back(DemoteOption{
          enc, BlockBytes(s.model, s.block_tokens, enc), e.distortion});
      have_bf16 |= enc == Encoding(Format::kBF16);
    }
  }
  if (set.options.empty()) {
    // No calibration for this tag: the fallback noise model.
    for (Format f : {Format::kBF16, Format::kFP8, Format::kINT8, Format::kINT4,
                     Format::kINT2}) {
      const Encoding enc(f);
      if (kernels::ValidateEncoding(enc, shape) != nullptr) continue;
      set.options.push_back(
          DemoteOption{enc, BlockBytes(s.model, s.block_tokens, enc),
                       FallbackDistortion(enc, shape)});
    }
    have_bf16 = true;
  }
  if (!have_bf16) {
    const Encoding bf16(Format::kBF16);
    set.options.push_back(
        DemoteOption{bf16, BlockBytes(s.model, s.block_tokens, bf16), 0});
  }
  std::sort(set.options.begin(), set.options.end(),
            [](const DemoteOption& a, const DemoteOption& b) {
              return a.bytes > b.bytes;
            });
  double worst = 0;
  for (const DemoteOption& o : set.options)
    worst = std::max(worst, o.distortion);
  set.evict_distortion = worst > 0 ? options_.evict_factor * worst
                                   : options_.default_evict_distortion;
  const int32_t index = static_cast<int32_t>(input_.option_sets.size());
  input_.option_sets.push_back(std::move(set));
  if (code >= 0) (*group)[code] = index;
  return index;
}

void SnapshotBuilder::CopyChunk() {
  const auto hold_start = std::chrono::steady_clock::now();
  size_t copied = 0;
  for (; next_ < ids_.size() && copied < options_.chunk_blocks; ++next_) {
    const SequenceRecord* sp = sequences_.Find(ids_[next_]);
    if (sp == nullptr) continue;
    const SequenceRecord& s = *sp;
    if (s.state != SequenceState::kOpen) continue;
    auto wi = worker_index_.find(s.worker);
    if (wi == worker_index_.end()) continue;
    auto ti = tenant_index_.find(s.tenant);
    if (ti == tenant_index_.end()) continue;
    copied += s.blocks.size();
    const CalibrationTable* table = s.calibration.get();
    if (table == nullptr) {
      if (const auto* ct = calibrations_.ForModel(s.model)) {
        table = ct->get();
        tables_.push_back(*ct);
      }
    } else {
      tables_.push_back(s.calibration);
    }
    std::vector<int32_t>& group =
        groups_
            .try_emplace(std::make_tuple(static_cast<const void*>(table),
                                         s.model.n_layers, s.model.n_kv_heads,
                                         s.model.head_dim, s.block_tokens),
                         kTagCodes, -1)
            .first->second;
    const uint32_t seq_index = static_cast<uint32_t>(input_.sequences.size());
    SequenceView sv;
    sv.sequence_id = s.id;
    sv.tenant = ti->second;
    sv.worker = wi->second;
    sv.last_access_ms = s.last_access_ms;
    input_.sequences.push_back(sv);
    snap_->sequence_ids.push_back(s.id);
    const size_t first_view = input_.blocks.size();
    for (const BlockRecord* b : s.blocks) {
      if (b->refcount != 1 || b->evicted || b->busy != 0) continue;
      BlockView v;
      v.lineage_id = b->lineage_id;
      v.sequence = seq_index;
      v.index = b->index;
      v.tag = b->tag;
      v.tier = b->tier;
      v.tokens = b->num_tokens;
      v.refcount = b->refcount;
      v.sealed = SealedOutsideWindow(s, *b, options_.window_guard_tokens);
      v.encoding = b->encoding;
      v.bytes = b->bytes;
      const int code = TagCode(b->tag);
      v.option_set = code >= 0 ? group[code] : -1;
      if (v.option_set < 0) {
        v.option_set = BuildOptionSet(s, b->tag, table, code, &group);
      }
      for (const DemoteOption& o : input_.option_sets[v.option_set].options) {
        if (o.encoding == b->encoding) v.distortion = o.distortion;
      }
      graph_.Snapshot(b->lineage_id, now_ms_, &v);
      input_.blocks.push_back(v);
    }
    AddTemporalAdjacency(&input_.blocks, first_view);
  }
  snap_->longest_hold_ms = std::max(
      snap_->longest_hold_ms, std::chrono::duration<double, std::milli>(
                                  std::chrono::steady_clock::now() - hold_start)
                                  .count());
}

}  // namespace triax::manager
