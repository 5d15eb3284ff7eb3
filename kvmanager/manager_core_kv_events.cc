// What the KV event publisher (kv_events.h) reads from the core: blocks with
// their content hashes, parents and tiers, as they are at the call.
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

namespace {

// The sequence holding `b` at its index: its creator while open and holding
// it, else the open sequence owning it (as FindPrefixLocked reads it).
const SequenceRecord* Holder(const SequenceTable& sequences,
                             const BlockRecord& b) {
  const SequenceRecord* c = sequences.Find(b.creator);
  if (c != nullptr && c->state == SequenceState::kOpen &&
      b.index < c->blocks.size() && c->blocks[b.index] == &b) {
    return c;
  }
  return SequenceTable::Owner(b);
}

ManagerCore::HashedBlock View(const SequenceRecord* holder,
                              const BlockRecord& b) {
  ManagerCore::HashedBlock v;
  v.lineage_id = b.lineage_id;
  v.index = b.index;
  v.hash = b.prefix_hash;
  // Blocks are hashed in index order, so a hashed block's parent is hashed
  // too; the parent is read through the holder because forks share blocks,
  // and every holder has the same chain before a shared block.
  if (holder != nullptr && b.index > 0 && b.index <= holder->blocks.size()) {
    v.parent_hash = holder->blocks[b.index - 1]->prefix_hash;
  }
  v.token_ids = b.token_ids;
  v.num_tokens = b.num_tokens;
  v.tier = b.tier;
  v.evicted = b.evicted;
  return v;
}

}  // namespace

std::vector<ManagerCore::HashedBlock> ManagerCore::HashedBlocks(
    const std::vector<std::string>& sequence_ids,
    const std::vector<uint64_t>& lineage_ids, bool all) const {
  absl::MutexLock lock(&mu_);
  std::vector<HashedBlock> out;
  if (all) {
    for (const auto& [id, s] : sequences_.all()) {
      if (s->state != SequenceState::kOpen) continue;
      for (const BlockRecord* b : s->blocks) {
        // A shared block is listed once, through its holder.
        if (b->prefix_hash.empty() || Holder(sequences_, *b) != s.get()) {
          continue;
        }
        out.push_back(View(s.get(), *b));
      }
    }
    return out;
  }
  absl::flat_hash_set<uint64_t> listed;
  for (const std::string& id : sequence_ids) {
    const SequenceRecord* s = sequences_.Find(id);
    if (s == nullptr || s->state != SequenceState::kOpen) continue;
    for (const BlockRecord* b : s->blocks) {
      if (listed.insert(b->lineage_id).second) out.push_back(View(s, *b));
    }
  }
  for (uint64_t lineage : lineage_ids) {
    const BlockRecord* b = sequences_.FindBlock(lineage);
    if (b == nullptr || !listed.insert(lineage).second) continue;
    out.push_back(View(Holder(sequences_, *b), *b));
  }
  return out;
}

void ManagerCore::KeepBlockTokenIds(bool keep) {
  absl::MutexLock lock(&mu_);
  keep_token_ids_ = keep;
}

}  // namespace triax::manager
