// SequenceStore's private records (Sequence, Block) and the helpers its
// implementation files share. Not part of the worker's interface: only the
// store's own .cc files include it.
//
// Where the store's code lives:
//   sequence_store.cc  lookup and the per-sequence preamble (LockOwned),
//                      plan validation, AllocatePages/Extend, Free/Drop,
//                      Inventory, Describe, TargetPage
//   store_window.cc    writes into the BF16 window and sealing
//   store_demote.cc    Demote
//   store_fork.cc      Fork
//   store_spill.cc     Spill/Restore/Evict, residency for Attend/Read,
//                      background restores (through worker/prefetch_queue.h),
//                      TakeSelfRestored, SpilledPages
//   store_attend.cc    Attend, AttendBatch and Read
//   store_compact.cc   the public operations on page data: the data lock,
//                      compaction and one more run after a shortfall
//   store_transfer.cc  Export and ImportSession (worker/store_transfer.h)
//
// Locking: every Sequence field but `id` is guarded by its `mu`. Functions
// here and SequenceStore's private methods that take a Sequence run with its
// mutex held; the lock order is written on SequenceStore.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/ids.h"
#include "common/model.h"
#include "kernels/layout.h"
#include "worker/device.h"
#include "worker/page_allocator.h"
#include "worker/tier_store.h"

namespace triax::worker::store_internal {

// An append that WriteLocked checked and gave its pages without writing
// them (AttendBatch: a step's appends go to the device in one
// Device::WriteBf16TokensBatch): the tokens in BF16 and, per block the
// write spans, where they go. FinishWriteLocked runs once the device wrote
// them: the layer's written count moves to `end` and full blocks seal.
struct DeferredWrite {
  struct Segment {
    size_t offset = 0;  // first value of the segment in k and v
    int first_slot = 0;
    int num_tokens = 0;
    uint8_t* page = nullptr;
  };
  uint32_t layer = 0;
  uint64_t end = 0;
  kernels::PageShape shape;
  std::vector<uint16_t> k, v;  // [tokens][H][D]
  std::vector<Segment> segments;

  // The device writes, pointing into k's and v's buffers (a move of this
  // keeps them).
  void AddWrites(std::vector<TokenWrite>* out) const {
    for (const Segment& s : segments) {
      out->push_back(TokenWrite{k.data() + s.offset, v.data() + s.offset,
                                s.first_slot, s.num_tokens, s.page});
    }
  }
};

struct Block {
  // The block's plan and its current state: spec.encoding (Demote changes
  // it), spec.tier (kDevice, kHost or kDisk; kUnspecified once evicted) and
  // spec.evicted (Spill, Restore and Evict change them).
  BlockSpec spec;
  // Per layer. Resident (kDevice): target pages hold the block, window pages
  // the BF16 staging of an unsealed one (null when none). Spilled: `spilled`
  // holds it and target pages are null. Evicted: no pages at all. A target
  // page is null also while the block is being built.
  std::vector<Page*> target;
  std::vector<Page*> window;
  SpilledBlock spilled;
  bool prefetch_queued = false;  // a background restore is queued
  absl::Status restore_error;    // why the last background restore failed
  uint64_t end() const { return spec.first_token + spec.num_tokens; }
  bool resident() const { return spec.tier == Tier::kDevice; }
};

struct Sequence {
  absl::Mutex mu;
  std::string id;
  std::string tenant ABSL_GUARDED_BY(mu);
  ModelShape model ABSL_GUARDED_BY(mu);
  uint32_t block_tokens ABSL_GUARDED_BY(mu) = 0;
  uint32_t window_tokens ABSL_GUARDED_BY(mu) = 0;
  kernels::PageShape shape ABSL_GUARDED_BY(mu);
  std::vector<Block> blocks ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> written ABSL_GUARDED_BY(mu);  // per layer
  std::vector<uint32_t> sealed ABSL_GUARDED_BY(mu);   // per layer
  uint64_t planned ABSL_GUARDED_BY(mu) = 0;
  bool freed ABSL_GUARDED_BY(mu) = false;
  // Signalled when `written` grows or the sequence is freed (an export
  // following the writes waits on it).
  absl::CondVar written_cv;
};

// A sequence whose mutex the holder has taken (SequenceStore::LockOwned);
// the destructor releases it. Movable, so that it can travel in a StatusOr;
// a moved-from one holds nothing.
class LockedSequence {
 public:
  explicit LockedSequence(std::shared_ptr<Sequence> seq)
      ABSL_NO_THREAD_SAFETY_ANALYSIS : seq_(std::move(seq)) {
    seq_->mu.Lock();
  }
  LockedSequence(LockedSequence&& other) noexcept = default;
  LockedSequence& operator=(LockedSequence&&) = delete;
  LockedSequence(const LockedSequence&) = delete;
  LockedSequence& operator=(const LockedSequence&) = delete;
  ~LockedSequence() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (seq_ != nullptr) seq_->mu.Unlock();
  }

  Sequence& operator*() const { return *seq_; }
  Sequence* operator->() const { return seq_.get(); }
  // For work that outlives the lock (a queued background restore).
  const std::shared_ptr<Sequence>& shared() const { return seq_; }

 private:
  std::shared_ptr<Sequence> seq_;
};

// Checks that the sequence is still live (NOT_FOUND once freed) and the
// caller's (PERMISSION_DENIED).
inline absl::Status CheckOwner(const Sequence& seq, absl::string_view tenant_id)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  if (seq.freed) {
    return absl::NotFoundError(
        absl::StrCat("sequence_id=", Quote(seq.id), " is not on this worker"));
  }
  if (seq.tenant != tenant_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "sequence_id=", Quote(seq.id),
        " belongs to another tenant than tenant_id=", Quote(tenant_id)));
  }
  return absl::OkStatus();
}

inline bool IsBf16(const kernels::Encoding& e) {
  return e.k == kernels::Format::kBF16 && e.v == kernels::Format::kBF16;
}

std::string EncName(const kernels::Encoding& e);

// The validated encoding of `b` for pages of `shape`, refused also when the
// backend cannot run it (Device::SupportsEncoding); `field` names the block
// in messages (e.g. "blocks[3]").
absl::StatusOr<kernels::Encoding> BlockEncoding(
    const Device& device, const BlockSpec& b, absl::string_view field,
    const kernels::PageShape& shape);

// A whole plan: indices 0.., contiguous tokens, 1..block_tokens tokens per
// block, encodings valid and supported, tiers in range.
absl::Status ValidatePlan(const Device& device,
                          absl::Span<const BlockSpec> blocks,
                          uint32_t block_tokens,
                          const kernels::PageShape& shape);

// Index of the block holding token `t` (blocks are contiguous and sorted);
// blocks.size() when past the last.
inline size_t BlockOf(const std::vector<Block>& blocks, uint64_t t) {
  auto it = std::partition_point(blocks.begin(), blocks.end(),
                                 [t](const Block& b) { return b.end() <= t; });
  return static_cast<size_t>(it - blocks.begin());
}

// "block 3 (lineage_id=103)".
inline std::string BlockName(const BlockSpec& spec) {
  return absl::StrCat("block ", spec.index, " (lineage_id=", spec.lineage_id,
                      ")");
}

// Entry `i` of a request naming blocks of `seq` by index and lineage id
// (Demote, ExportPages): the block, after checking that the index exists
// (NOT_FOUND), was not named before in this request (`named`, one flag per
// block of seq; INVALID_ARGUMENT) and carries `lineage_id`
// (FAILED_PRECONDITION). Messages name "blocks[i]" and the values.
inline absl::StatusOr<const Block*> NamedBlock(const Sequence& seq, size_t i,
                                               uint64_t index,
                                               uint64_t lineage_id,
                                               std::vector<bool>* named)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  if (index >= seq.blocks.size()) {
    return absl::NotFoundError(absl::StrCat(
        "blocks[", i, "].index=", index, " (lineage_id=", lineage_id,
        ") is not a block of sequence_id=", Quote(seq.id), ", which has ",
        seq.blocks.size(), " blocks"));
  }
  if ((*named)[index]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks[", i, "].index=", index, " is named more than once"));
  }
  (*named)[index] = true;
  const Block& b = seq.blocks[index];
  if (lineage_id != b.spec.lineage_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "blocks[", i, "] (index=", index, ") lineage_id=", lineage_id,
        " mismatches sequence_id=", Quote(seq.id),
        "'s block lineage_id=", b.spec.lineage_id));
  }
  return &b;
}

}  // namespace triax::worker::store_internal
