// SequenceTable: the sequences by id and the live blocks by lineage id.
//
// Sequences: open ones, and the newest `closed_retention` closed or lost
// ones (still queryable, without blocks); ids are "seq-<n>", n dense from 1.
// Blocks: every block some open sequence holds; lineage ids are dense from
// 1 and never reused. A block is charged (manager_state.h "Byte
// accounting") from NewBlock until the Unref that drops its last reference;
// the caller then erases it (EraseBlock) once it has recorded its events.
//
// Paging (paging.h): ordered indexes of the retained sequences by id
// (shortlex: creation order), overall and per tenant, each of all retained
// sequences and of the open ones, so that a page of List costs
// O(log n + page) whatever the filter. They hold views of the records' ids
// (an id never changes while its record is retained).
//
// Error codes (lookups for a tenant's request, the field named): NOT_FOUND
// (unknown sequence), PERMISSION_DENIED (another tenant's),
// FAILED_PRECONDITION (closed or lost, for mutations).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/paging.h"
#include "kvmanager/types.h"

namespace triax::manager {

class SequenceTable {
 public:
  using Map = absl::flat_hash_map<std::string, std::unique_ptr<SequenceRecord>>;

  explicit SequenceTable(size_t closed_retention)
      : closed_retention_(closed_retention) {}

  // --- Durable metadata (metadata_journal.h)
  // ---------------------------------- Where inserted sequences record their
  // changes (Touch) and where Insert, Retire, Reopen and the counters record
  // theirs.
  void set_changes(ChangeSet* changes) { changes_ = changes; }
  // Ids below these limits may have been handed out: a journal stores them
  // before any is; NewId and NewBlock raise a limit (by kIdLease, marking
  // the counters changed) when they reach it.
  static constexpr uint64_t kIdLease = 4096;
  uint64_t sequence_limit() const { return sequence_limit_; }
  uint64_t lineage_limit() const { return lineage_limit_; }
  // A restarted manager continues at the limits its previous run stored.
  void RestoreCounters(uint64_t next_sequence, uint64_t next_lineage);
  // A recovered closed or lost sequence (already inserted, no blocks) joins
  // closed retention.
  void RetireRecovered(SequenceRecord* s) { retired_.push_back(s->id); }

  // --- Sequences -------------------------------------------------------------
  // The id the next inserted sequence takes ("seq-<n>"); consumes it.
  std::string NewId();
  SequenceRecord* Insert(std::unique_ptr<SequenceRecord> s);
  // nullptr when unknown (or dropped from closed retention).
  SequenceRecord* Find(const std::string& sequence_id) const {
    auto it = sequences_.find(sequence_id);
    return it == sequences_.end() ? nullptr : it->second.get();
  }
  // A sequence `tenant` may mutate: `field` ("sequence_id",
  // "parent_sequence_id") an id, known, the tenant's, open.
  absl::StatusOr<SequenceRecord*> FindOpen(
      const TenantRecord& tenant, const std::string& field,
      const std::string& sequence_id) const;
  // A sequence `tenant` may read (any state); tenant nullptr: any tenant's.
  absl::StatusOr<const SequenceRecord*> FindVisible(
      const TenantRecord* tenant, const std::string& sequence_id) const;
  // Closes the books of a sequence that just closed or was lost (its blocks
  // already released): off its tenant's and worker's open counts, blocks
  // dropped, kept queryable until closed_retention newer ones retired.
  void Retire(SequenceRecord* s);
  // Undoes Retire for a lost sequence that is open again (its blocks
  // already restored): back on its tenant's and worker's open counts and
  // out of closed retention. O(retained closed sequences).
  void Reopen(SequenceRecord* s);
  // Without blocks, ordered by creation; tenant nullptr: every tenant's.
  std::vector<SequenceInfo> List(const TenantRecord* tenant,
                                 bool include_closed) const;
  // One page of List (the cursor's key: the previous page's last id).
  Page<SequenceInfo> ListPage(const TenantRecord* tenant, bool include_closed,
                              const PageCursor& cursor) const;
  static SequenceInfo Info(const SequenceRecord& s, bool with_blocks);
  // Every retained sequence, unordered (snapshots).
  const Map& all() const { return sequences_; }

  // --- Blocks ----------------------------------------------------------------
  // Appends a new block to `s` with a fresh lineage id (refcount 1, owner
  // and creator s, on the device) and charges its bytes to s's tenant and
  // worker.
  BlockRecord* NewBlock(SequenceRecord* s, uint64_t first_token,
                        uint32_t num_tokens, const Tag& tag,
                        const Encoding& encoding, uint32_t turn,
                        uint64_t bytes);
  // Appends a copy of `parked` (a block `s` held when it was lost) to `s`
  // under its old lineage id, with refcount 1, owner s, not busy, and
  // charges its bytes to its tier of s's tenant and worker (nothing when
  // evicted). The lineage id must not be live. `charged`: the tenant the
  // block is charged to (nullptr: s's).
  BlockRecord* RestoreBlock(SequenceRecord* s, const BlockRecord& parked,
                            TenantRecord* charged = nullptr);
  // Appends `b` (a parent's block, or a block live elsewhere) to `s`
  // (refcount + 1); charged again only when s's worker held no copy of it.
  static void Share(SequenceRecord* s, BlockRecord* b);
  // Drops the reference of `s` to `b`. Returns true when it was the last:
  // the block's bytes are then returned to its tenant and worker (the
  // caller erases it). Otherwise ownership passes to another holder, and
  // the copy on s's worker is returned when s was its last holder there.
  static bool Unref(SequenceRecord* s, BlockRecord* b);
  // How many sequences on `w` hold `b` (BlockRecord::holders).
  static uint32_t HoldersOn(const BlockRecord& b, const WorkerRecord* w);
  // One holder of `b` moves from worker `from` to worker `to` (refcount
  // unchanged): the copy on `from` is returned when it was its last holder
  // there. Returns true when `to` had no copy (the caller charges it: a
  // transfer's reservation, or ChargeCopy).
  static bool MoveHolder(BlockRecord* b, WorkerRecord* from, WorkerRecord* to);
  // Charges a new copy of device block `b` on `w` to b's tenant and `w`.
  static void ChargeCopy(const BlockRecord& b, WorkerRecord* w);
  void EraseBlock(uint64_t lineage_id) { blocks_.erase(lineage_id); }
  // nullptr when not live.
  BlockRecord* FindBlock(uint64_t lineage_id) const {
    auto it = blocks_.find(lineage_id);
    return it == blocks_.end() ? nullptr : it->second.get();
  }
  // The live block `lineage_id` when it is a block of `s`, else nullptr.
  BlockRecord* BlockOf(const SequenceRecord& s, uint64_t lineage_id) const {
    BlockRecord* b = FindBlock(lineage_id);
    if (b == nullptr || b->index >= s.blocks.size() ||
        s.blocks[b->index] != b) {
      return nullptr;
    }
    return b;
  }
  // The open sequence that owns `b` (its creator, or the fork that kept it
  // when the others released it) while it still holds it; else nullptr.
  static SequenceRecord* Owner(const BlockRecord& b) {
    SequenceRecord* s = b.owner;
    if (s != nullptr && s->state == SequenceState::kOpen &&
        b.index < s->blocks.size() && s->blocks[b.index] == &b) {
      return s;
    }
    return nullptr;
  }
  size_t num_blocks() const { return blocks_.size(); }

 private:
  const size_t closed_retention_;
  Map sequences_;
  std::deque<std::string> retired_;  // closed/lost, oldest first
  // Paging indexes (see "Paging" above).
  struct TenantIdLess {
    bool operator()(
        const std::pair<const TenantRecord*, absl::string_view>& a,
        const std::pair<const TenantRecord*, absl::string_view>& b) const {
      if (a.first != b.first) {
        return std::less<const TenantRecord*>()(a.first, b.first);
      }
      return ShortlexLess()(a.second, b.second);
    }
  };
  using IdIndex = absl::btree_set<absl::string_view, ShortlexLess>;
  using TenantIndex =
      absl::btree_set<std::pair<const TenantRecord*, absl::string_view>,
                      TenantIdLess>;
  void IndexOpen(const SequenceRecord& s);
  void UnindexOpen(const SequenceRecord& s);
  IdIndex ids_;
  IdIndex open_ids_;
  TenantIndex tenant_ids_;
  TenantIndex tenant_open_ids_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<BlockRecord>> blocks_;
  uint64_t next_lineage_ = 1;
  uint64_t next_sequence_ = 1;
  uint64_t lineage_limit_ = 1;
  uint64_t sequence_limit_ = 1;
  ChangeSet* changes_ = nullptr;
};

}  // namespace triax::manager
