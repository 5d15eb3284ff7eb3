#include "kvmanager/sequence_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::manager {

// --- Sequences ---------------------------------------------------------------

void SequenceTable::RestoreCounters(uint64_t next_sequence,
                                    uint64_t next_lineage) {
  next_sequence_ = sequence_limit_ = std::max<uint64_t>(next_sequence, 1);
  next_lineage_ = lineage_limit_ = std::max<uint64_t>(next_lineage, 1);
}

std::string SequenceTable::NewId() {
  if (next_sequence_ >= sequence_limit_) {
    sequence_limit_ = next_sequence_ + kIdLease;
    if (changes_ != nullptr && changes_->enabled) changes_->counters = true;
  }
  return absl::StrCat("seq-", next_sequence_++);
}

SequenceRecord* SequenceTable::Insert(std::unique_ptr<SequenceRecord> s) {
  SequenceRecord* out = s.get();
  out->changes = changes_;
  const std::string id = out->id;
  sequences_.emplace(id, std::move(s));
  if (changes_ != nullptr && changes_->enabled) changes_->sequences.insert(id);
  ids_.insert(out->id);
  tenant_ids_.insert({out->tenant, out->id});
  if (out->state == SequenceState::kOpen) IndexOpen(*out);
  return out;
}

void SequenceTable::IndexOpen(const SequenceRecord& s) {
  open_ids_.insert(s.id);
  tenant_open_ids_.insert({s.tenant, s.id});
}

void SequenceTable::UnindexOpen(const SequenceRecord& s) {
  open_ids_.erase(s.id);
  tenant_open_ids_.erase({s.tenant, s.id});
}

absl::StatusOr<SequenceRecord*> SequenceTable::FindOpen(
    const TenantRecord& tenant, const std::string& field,
    const std::string& sequence_id) const {
  TRIAX_RETURN_IF_ERROR(ValidateId(field, sequence_id));
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat(field, " ", Quote(sequence_id),
                                            " is not a known sequence"));
  }
  SequenceRecord* s = it->second.get();
  if (s->tenant != &tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, " ", Quote(sequence_id),
                     " belongs to another tenant, not ", Quote(tenant.id)));
  }
  if (s->state != SequenceState::kOpen) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " ", Quote(sequence_id), " is ",
        s->state == SequenceState::kClosed ? "closed"
                                           : "lost (its worker went down)"));
  }
  return s;
}

absl::StatusOr<const SequenceRecord*> SequenceTable::FindVisible(
    const TenantRecord* tenant, const std::string& sequence_id) const {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id ", Quote(sequence_id),
                                            " is not a known sequence"));
  }
  if (tenant != nullptr && it->second->tenant != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("sequence_id ", Quote(sequence_id),
                     " belongs to another tenant, not ", Quote(tenant->id)));
  }
  return it->second.get();
}

void SequenceTable::Retire(SequenceRecord* s) {
  s->tenant->open_sequences--;
  s->worker->open.erase(s);
  s->blocks.clear();
  s->blocks.shrink_to_fit();
  s->turn_start.clear();
  s->turn_start.shrink_to_fit();
  s->bytes = 0;
  UnindexOpen(*s);
  retired_.push_back(s->id);
  const bool journal = changes_ != nullptr && changes_->enabled;
  if (journal) changes_->sequences.insert(s->id);
  while (retired_.size() > closed_retention_) {
    auto it = sequences_.find(retired_.front());
    if (it != sequences_.end()) {
      if (journal) {
        changes_->sequences.erase(retired_.front());
        changes_->dropped_sequences.push_back(retired_.front());
      }
      // The index entries are views of the record's id: they go first.
      ids_.erase(it->second->id);
      tenant_ids_.erase({it->second->tenant, it->second->id});
      sequences_.erase(it);
    }
    retired_.pop_front();
  }
}

void SequenceTable::Reopen(SequenceRecord* s) {
  if (changes_ != nullptr && changes_->enabled) {
    changes_->sequences.insert(s->id);
  }
  s->tenant->open_sequences++;
  s->worker->open.insert(s);
  IndexOpen(*s);
  auto it = std::find(retired_.begin(), retired_.end(), s->id);
  if (it != retired_.end()) retired_.erase(it);
}

std::vector<SequenceInfo> SequenceTable::List(const TenantRecord* tenant,
                                              bool include_closed) const {
  std::vector<SequenceInfo> out;
  if (tenant == nullptr) {
    const IdIndex& index = include_closed ? ids_ : open_ids_;
    out.reserve(index.size());
    for (absl::string_view id : index)
      out.push_back(Info(*sequences_.find(id)->second, /*with_blocks=*/false));
    return out;
  }
  const TenantIndex& index = include_closed ? tenant_ids_ : tenant_open_ids_;
  for (auto it = index.lower_bound({tenant, absl::string_view()});
       it != index.end() && it->first == tenant; ++it) {
    out.push_back(
        Info(*sequences_.find(it->second)->second, /*with_blocks=*/false));
  }
  return out;
}

Page<SequenceInfo> SequenceTable::ListPage(const TenantRecord* tenant,
                                           bool include_closed,
                                           const PageCursor& cursor) const {
  Page<SequenceInfo> page;
  const absl::string_view after =
      cursor.after() ? absl::string_view(*cursor.after()) : "";
  if (tenant == nullptr) {
    const IdIndex& index = include_closed ? ids_ : open_ids_;
    auto it = cursor.after() ? index.upper_bound(after) : index.begin();
    for (; it != index.end() && page.items.size() < cursor.size(); ++it) {
      page.items.push_back(
          Info(*sequences_.find(*it)->second, /*with_blocks=*/false));
    }
    if (it != index.end()) {
      page.next_page_token = cursor.NextToken(page.items.back().sequence_id);
    }
    return page;
  }
  const TenantIndex& index = include_closed ? tenant_ids_ : tenant_open_ids_;
  // The empty view sorts first among the tenant's entries.
  auto it = cursor.after() ? index.upper_bound({tenant, after})
                           : index.lower_bound({tenant, absl::string_view()});
  for (; it != index.end() && it->first == tenant &&
         page.items.size() < cursor.size();
       ++it) {
    page.items.push_back(
        Info(*sequences_.find(it->second)->second, /*with_blocks=*/false));
  }
  if (it != index.end() && it->first == tenant) {
    page.next_page_token = cursor.NextToken(page.items.back().sequence_id);
  }
  return page;
}

SequenceInfo SequenceTable::Info(const SequenceRecord& s, bool with_blocks) {
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
  info.transfer_id = s.transfer_id;
  if (s.transfer_destination != nullptr) {
    info.transfer_destination_worker_id =
        s.transfer_destination->info.worker_id;
  }
  info.prefix_sequence_id = s.prefix_sequence_id;
  info.prefix_tenant_id = s.prefix_tenant_id;
  info.prefix_blocks = s.prefix_blocks;
  info.prefix_tokens = s.prefix_tokens;
  info.hashed_blocks = s.chain_blocks;
  if (with_blocks) {
    info.blocks.reserve(s.blocks.size());
    for (const BlockRecord* b : s.blocks) info.blocks.push_back(PlanOf(*b));
  }
  return info;
}

// --- Blocks ------------------------------------------------------------------

BlockRecord* SequenceTable::NewBlock(SequenceRecord* s, uint64_t first_token,
                                     uint32_t num_tokens, const Tag& tag,
                                     const Encoding& encoding, uint32_t turn,
                                     uint64_t bytes) {
  auto block = std::make_unique<BlockRecord>();
  BlockRecord* b = block.get();
  b->index = static_cast<uint32_t>(s->blocks.size());
  if (next_lineage_ >= lineage_limit_) {
    lineage_limit_ = next_lineage_ + kIdLease * 16;
    if (changes_ != nullptr && changes_->enabled) changes_->counters = true;
  }
  b->lineage_id = next_lineage_++;
  b->first_token = first_token;
  b->num_tokens = num_tokens;
  b->capacity = s->block_tokens;
  b->tag = tag;
  b->encoding = encoding;
  b->refcount = 1;
  b->turn = turn;
  b->bytes = bytes;
  b->charged = s->tenant;
  b->worker = s->worker;
  b->creator = s->id;
  b->owner = s;
  b->holders = {{s->worker, 1}};
  b->prefix_indexed = false;  // a recovered block is not re-indexed
  s->blocks.push_back(b);
  s->bytes += bytes;
  s->tenant->used[static_cast<int>(Tier::kDevice)] += bytes;
  s->worker->Reserve(bytes);
  blocks_.emplace(b->lineage_id, std::move(block));
  return b;
}

BlockRecord* SequenceTable::RestoreBlock(SequenceRecord* s,
                                         const BlockRecord& parked,
                                         TenantRecord* charged) {
  auto block = std::make_unique<BlockRecord>(parked);
  BlockRecord* b = block.get();
  b->refcount = 1;
  b->busy = 0;
  b->charged = charged != nullptr ? charged : s->tenant;
  b->worker = s->worker;
  b->owner = s;
  b->holders = {{s->worker, 1}};
  s->blocks.push_back(b);
  if (!b->evicted) {
    const int tier = static_cast<int>(b->tier);
    b->charged->used[tier] += b->bytes;
    if (b->tier == Tier::kDevice) {
      s->worker->Reserve(b->bytes);
    } else {
      s->worker->tier_used[tier] += b->bytes;
    }
  }
  blocks_.emplace(b->lineage_id, std::move(block));
  return b;
}

namespace {

// Returns the device bytes of the copy of `b` on `w` to b's tenant and `w`.
void ReleaseCopy(const BlockRecord& b, WorkerRecord* w) {
  b.charged->used[static_cast<int>(Tier::kDevice)] -= b.bytes;
  w->reserved -= b.bytes;
}

// One holder fewer on `w`; true when `w` has none left (its entry erased,
// `worker` the first remaining one).
bool DropHolder(BlockRecord* b, WorkerRecord* w) {
  for (auto it = b->holders.begin(); it != b->holders.end(); ++it) {
    if (it->first != w) continue;
    if (--it->second > 0) return false;
    b->holders.erase(it);
    if (!b->holders.empty()) b->worker = b->holders.front().first;
    return true;
  }
  return false;
}

// One holder more on `w`; true when `w` had none.
bool AddHolder(BlockRecord* b, WorkerRecord* w) {
  for (auto& [worker, n] : b->holders) {
    if (worker == w) {
      ++n;
      return false;
    }
  }
  b->holders.emplace_back(w, 1);
  if (b->holders.size() == 1) b->worker = w;
  return true;
}

}  // namespace

void SequenceTable::ChargeCopy(const BlockRecord& b, WorkerRecord* w) {
  b.charged->used[static_cast<int>(Tier::kDevice)] += b.bytes;
  w->Reserve(b.bytes);
}

uint32_t SequenceTable::HoldersOn(const BlockRecord& b, const WorkerRecord* w) {
  for (const auto& [worker, n] : b.holders) {
    if (worker == w) return n;
  }
  return 0;
}

bool SequenceTable::MoveHolder(BlockRecord* b, WorkerRecord* from,
                               WorkerRecord* to) {
  const bool added = AddHolder(b, to);
  if (DropHolder(b, from) && !b->evicted) ReleaseCopy(*b, from);
  return added;
}

void SequenceTable::Share(SequenceRecord* s, BlockRecord* b) {
  ++b->refcount;
  s->blocks.push_back(b);
  s->bytes += b->bytes;
  if (AddHolder(b, s->worker) && b->refcount > 1 && !b->evicted) {
    ChargeCopy(*b, s->worker);
  }
}

bool SequenceTable::Unref(SequenceRecord* s, BlockRecord* b) {
  --b->refcount;
  if (b->refcount > 0) {
    if (DropHolder(b, s->worker) && !b->evicted) ReleaseCopy(*b, s->worker);
    if (b->owner == s) {
      // Another holder keeps it: a fork on its worker, or a sequence on
      // another worker holding a copy.
      b->owner = nullptr;
      for (const auto& [w, n] : b->holders) {
        for (SequenceRecord* o : w->open) {
          if (o != s && b->index < o->blocks.size() &&
              o->blocks[b->index] == b) {
            b->owner = o;
            break;
          }
        }
        if (b->owner != nullptr) break;
      }
    }
    return false;
  }
  b->holders.clear();
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
  return true;
}

}  // namespace triax::manager
