// SequenceStore's spill tiers (see "Spill tiers" in sequence_store.h):
// Spill, Restore and Evict; EnsureResident, which Attend and Read call
// before touching blocks that may be spilled; and background restores,
// queued on the store's PrefetchQueue. Moves are all or nothing per call:
// every copy (or device page) is made before anything is freed or swapped.
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "worker/sequence_store.h"
#include "worker/sequence_store_internal.h"

namespace triax::worker {

using store_internal::Block;
using store_internal::BlockName;
using store_internal::BlockOf;

namespace {

BlockLabel LabelOf(const std::string& seq_id, const BlockSpec& spec) {
  BlockLabel l;
  l.sequence_id = seq_id;
  l.lineage_id = spec.lineage_id;
  l.index = spec.index;
  return l;
}

}  // namespace

absl::StatusOr<std::vector<size_t>> SequenceStore::BlocksOf(
    const Sequence& seq, absl::Span<const uint64_t> lineage_ids) const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<size_t> out;
  out.reserve(lineage_ids.size());
  for (size_t i = 0; i < lineage_ids.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (lineage_ids[j] == lineage_ids[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("lineage_ids[", i, "]=", lineage_ids[i],
                         " is named more than once"));
      }
    }
    size_t found = seq.blocks.size();
    for (size_t b = 0; b < seq.blocks.size(); ++b) {
      if (seq.blocks[b].spec.lineage_id == lineage_ids[i]) found = b;
    }
    if (found == seq.blocks.size()) {
      return absl::NotFoundError(
          absl::StrCat("lineage_ids[", i, "]=", lineage_ids[i],
                       " is not a block of sequence_id=", Quote(seq.id)));
    }
    out.push_back(found);
  }
  return out;
}

absl::Status SequenceStore::CheckMovable(const Sequence& seq, size_t b,
                                         absl::string_view op) const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const Block& blk = seq.blocks[b];
  for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
    if (seq.sealed[l] <= b) {
      return absl::FailedPreconditionError(absl::StrCat(
          op, " sequence_id=", Quote(seq.id), " ", BlockName(blk.spec),
          " is not sealed on layer ", l, " (", seq.written[l],
          " tokens written, window_tokens=", seq.window_tokens,
          "); only blocks out of the BF16 window on every layer move"));
    }
    if (blk.resident()) {
      const int refs = allocator_->RefCount(blk.target[l]);
      if (refs > 1) {
        return absl::FailedPreconditionError(
            absl::StrCat(op, " sequence_id=", Quote(seq.id), " ",
                         BlockName(blk.spec), " is shared by ", refs,
                         " sequences (a fork); shared blocks do not move"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SpillResult> SequenceStore::SpillOnce(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids, Tier tier) {
  auto check_args = [&]() -> absl::Status {
    if (tier != Tier::kHost && tier != Tier::kDisk) {
      return absl::InvalidArgumentError(
          absl::StrCat("tier=", static_cast<int>(tier), " (", TierLabel(tier),
                       ") is not a spill tier (2 host, 3 disk)"));
    }
    if (lineage_ids.empty()) {
      return absl::InvalidArgumentError(
          "lineage_ids is empty; name >= 1 block");
    }
    if (options_.tiers == nullptr) {
      return absl::FailedPreconditionError(
          "this worker has no spill tiers configured");
    }
    return options_.tiers->CheckTier(tier);
  };
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                         LockOwned(tenant_id, sequence_id, check_args));
  Sequence& seq = *locked;
  TRIAX_ASSIGN_OR_RETURN(std::vector<size_t> named, BlocksOf(seq, lineage_ids));
  std::vector<size_t> jobs;
  for (size_t b : named) {
    const Block& blk = seq.blocks[b];
    if (blk.spec.evicted) {
      return absl::FailedPreconditionError(
          absl::StrCat("Spill sequence_id=", Quote(seq.id), " ",
                       BlockName(blk.spec), " is evicted"));
    }
    if (blk.spec.tier == tier) continue;  // already there
    TRIAX_RETURN_IF_ERROR(CheckMovable(seq, b, "Spill"));
    jobs.push_back(b);
  }

  // Copy everything out first; the device pages and old tier copies are
  // untouched until every copy succeeded.
  const uint32_t layers = seq.model.n_layers;
  std::vector<SpilledBlock> copies;
  auto undo = [&] {
    for (SpilledBlock& c : copies) options_.tiers->Release(&c);
  };
  uint64_t need = 0;
  for (size_t b : jobs) {
    const Block& blk = seq.blocks[b];
    need += blk.resident()
                ? layers * kernels::PageBytes(blk.spec.encoding, seq.shape)
                : blk.spilled.bytes();
  }
  for (size_t b : jobs) {
    const Block& blk = seq.blocks[b];
    const BlockLabel label = LabelOf(seq.id, blk.spec);
    absl::StatusOr<SpilledBlock> c;
    if (blk.resident()) {
      std::vector<const uint8_t*> pages;
      std::vector<size_t> bytes;
      for (uint32_t l = 0; l < layers; ++l) {
        pages.push_back(blk.target[l]->data);
        bytes.push_back(blk.target[l]->bytes);
      }
      c = options_.tiers->Spill(tier, pages, bytes, label);
    } else {
      c = options_.tiers->Move(blk.spilled, tier, label);
    }
    if (!c.ok()) {
      undo();
      if (c.status().code() == absl::StatusCode::kDataLoss) {
        checksum_failures_.fetch_add(1);
      }
      return absl::Status(
          c.status().code(),
          absl::StrCat("Spill sequence_id=", Quote(seq.id), " of ", jobs.size(),
                       " blocks (", need, " bytes) to the ", TierLabel(tier),
                       " tier; nothing was spilled: ", c.status().message()));
    }
    copies.push_back(*std::move(c));
  }

  SpillResult result;
  for (size_t j = 0; j < jobs.size(); ++j) {
    Block& blk = seq.blocks[jobs[j]];
    if (blk.resident()) {
      for (uint32_t l = 0; l < layers; ++l) {
        const size_t bytes = blk.target[l]->bytes;
        if (allocator_->Unref(blk.target[l])) {
          result.device_bytes_freed += bytes;
        }
        blk.target[l] = nullptr;
      }
    } else {
      options_.tiers->Release(&blk.spilled);
    }
    result.pages_moved += copies[j].pages.size();
    result.bytes_moved += copies[j].bytes();
    blk.spilled = std::move(copies[j]);
    blk.spec.tier = tier;
    spills_.fetch_add(1);
  }
  return result;
}

std::vector<uint64_t> SequenceStore::TakeSelfRestored() {
  absl::MutexLock lock(&self_restored_mu_);
  std::vector<uint64_t> out;
  out.swap(self_restored_);
  return out;
}

void SequenceStore::ReturnSelfRestored(const std::vector<uint64_t>& ids) {
  absl::MutexLock lock(&self_restored_mu_);
  self_restored_.insert(self_restored_.end(), ids.begin(), ids.end());
}

absl::StatusOr<RestoreResult> SequenceStore::RestoreLocked(
    Sequence& seq, const std::vector<size_t>& blocks,
    bool on_its_own) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  RestoreResult result;
  if (blocks.empty()) return result;
  const uint32_t layers = seq.model.n_layers;
  uint64_t need_pages = 0, need_bytes = 0;
  for (size_t b : blocks) {
    need_pages += layers;
    need_bytes += seq.blocks[b].spilled.bytes();
  }
  std::vector<std::vector<Page*>> fresh;
  auto undo = [&] {
    for (auto& pages : fresh) {
      for (Page* p : pages) allocator_->Unref(p);
    }
  };
  for (size_t b : blocks) {
    const Block& blk = seq.blocks[b];
    const size_t bytes = kernels::PageBytes(blk.spec.encoding, seq.shape);
    fresh.emplace_back();
    for (uint32_t l = 0; l < layers; ++l) {
      absl::StatusOr<Page*> p =
          allocator_->Allocate(blk.spec.encoding, bytes, PageUse::kTarget);
      if (!p.ok()) {
        undo();
        return absl::Status(
            p.status().code(),
            absl::StrCat(
                "Restore sequence_id=", Quote(seq.id), " needs ", need_pages,
                " device pages (", need_bytes, " bytes) for ", blocks.size(),
                " blocks; nothing was restored: ", p.status().message()));
      }
      fresh.back().push_back(*p);
    }
  }
  for (size_t j = 0; j < blocks.size(); ++j) {
    Block& blk = seq.blocks[blocks[j]];
    std::vector<uint8_t*> dst;
    for (Page* p : fresh[j]) dst.push_back(p->data);
    absl::Status s =
        options_.tiers->Restore(blk.spilled, dst, LabelOf(seq.id, blk.spec));
    if (!s.ok()) {
      undo();
      if (s.code() == absl::StatusCode::kDataLoss) {
        checksum_failures_.fetch_add(1);
        blk.restore_error = s;
      }
      return absl::Status(
          s.code(),
          absl::StrCat("Restore (nothing was restored): ", s.message()));
    }
  }
  for (size_t j = 0; j < blocks.size(); ++j) {
    Block& blk = seq.blocks[blocks[j]];
    for (uint32_t l = 0; l < layers; ++l) {
      Page* p = fresh[j][l];
      {
        absl::MutexLock seal_lock(&p->seal_mu);
        p->encoded = true;
        // Restore verified the bytes against the spill's CRC32C.
        p->crc_known = true;
        p->crc32c = blk.spilled.pages[l].crc;
      }
      blk.target[l] = p;
    }
    result.pages_restored += layers;
    result.bytes_restored += blk.spilled.bytes();
    options_.tiers->Release(&blk.spilled);
    blk.spec.tier = Tier::kDevice;
    blk.prefetch_queued = false;
    blk.restore_error = absl::OkStatus();
    restores_.fetch_add(1);
  }
  if (on_its_own) {
    absl::MutexLock lock(&self_restored_mu_);
    for (size_t b : blocks) {
      self_restored_.push_back(seq.blocks[b].spec.lineage_id);
    }
  }
  return result;
}

absl::StatusOr<RestoreResult> SequenceStore::RestoreOnce(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids, bool background) {
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                         LockOwned(tenant_id, sequence_id));
  Sequence& seq = *locked;
  std::vector<size_t> jobs;
  if (lineage_ids.empty()) {
    for (size_t b = 0; b < seq.blocks.size(); ++b) {
      if (!seq.blocks[b].resident() && !seq.blocks[b].spec.evicted)
        jobs.push_back(b);
    }
  } else {
    TRIAX_ASSIGN_OR_RETURN(std::vector<size_t> named,
                           BlocksOf(seq, lineage_ids));
    for (size_t b : named) {
      const Block& blk = seq.blocks[b];
      if (blk.spec.evicted) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Restore sequence_id=", Quote(seq.id), " ", BlockName(blk.spec),
            " is evicted; its pages are gone"));
      }
      if (!blk.resident()) jobs.push_back(b);
    }
  }
  if (background) {
    RestoreResult r;
    r.blocks_queued = jobs.size();
    QueuePrefetch(locked.shared(), jobs);
    return r;
  }
  return RestoreLocked(seq, jobs, /*on_its_own=*/false);
}

absl::StatusOr<EvictResult> SequenceStore::Evict(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids) {
  auto check_args = [&] {
    return lineage_ids.empty() ? absl::InvalidArgumentError(
                                     "lineage_ids is empty; name >= 1 block")
                               : absl::OkStatus();
  };
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                         LockOwned(tenant_id, sequence_id, check_args));
  Sequence& seq = *locked;
  TRIAX_ASSIGN_OR_RETURN(std::vector<size_t> named, BlocksOf(seq, lineage_ids));
  std::vector<size_t> jobs;
  for (size_t b : named) {
    if (seq.blocks[b].spec.evicted) continue;  // already gone
    TRIAX_RETURN_IF_ERROR(CheckMovable(seq, b, "Evict"));
    jobs.push_back(b);
  }
  EvictResult result;
  for (size_t b : jobs) {
    Block& blk = seq.blocks[b];
    if (blk.resident()) {
      for (Page*& p : blk.target) {
        const size_t bytes = p->bytes;
        if (allocator_->Unref(p)) {
          result.pages_freed += 1;
          result.bytes_freed += bytes;
        }
        p = nullptr;
      }
    } else {
      result.pages_freed += blk.spilled.pages.size();
      result.bytes_freed += blk.spilled.bytes();
      options_.tiers->Release(&blk.spilled);
    }
    blk.spec.tier = Tier::kUnspecified;
    blk.spec.evicted = true;
    blk.prefetch_queued = false;
    blk.restore_error = absl::OkStatus();
    evictions_.fetch_add(1);
  }
  return result;
}

absl::Status SequenceStore::EnsureResident(
    const std::shared_ptr<Sequence>& seq_ptr, uint64_t from,
    uint64_t to) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Sequence& seq = *seq_ptr;
  std::vector<size_t> spilled;
  for (size_t b = BlockOf(seq.blocks, from);
       b < seq.blocks.size() && seq.blocks[b].spec.first_token < to; ++b) {
    const Block& blk = seq.blocks[b];
    if (!blk.spec.evicted && !blk.resident()) spilled.push_back(b);
  }
  if (spilled.empty()) return absl::OkStatus();
  if (options_.restore_on_attend) {
    return RestoreLocked(seq, spilled).status();
  }
  // A failed background restore answers its error (once, unless DATA_LOSS,
  // which stays: the bytes will not heal).
  for (size_t b : spilled) {
    Block& blk = seq.blocks[b];
    if (!blk.restore_error.ok()) {
      absl::Status e = blk.restore_error;
      if (e.code() != absl::StatusCode::kDataLoss) {
        blk.restore_error = absl::OkStatus();
      }
      return e;
    }
  }
  std::vector<size_t> unqueued;
  std::vector<std::string> names;
  for (size_t b : spilled) {
    const Block& blk = seq.blocks[b];
    if (!blk.prefetch_queued) unqueued.push_back(b);
    names.push_back(absl::StrCat(BlockName(blk.spec), " in the ",
                                 TierLabel(blk.spec.tier), " tier"));
  }
  if (unqueued.empty()) {
    // Every block is already on its way: wait for it rather than bounce the
    // caller (restoring in line takes what the queued job would).
    return RestoreLocked(seq, spilled).status();
  }
  QueuePrefetch(seq_ptr, unqueued);
  absl::Status s = absl::UnavailableError(absl::StrCat(
      "sequence_id=", Quote(seq.id), ": ", absl::StrJoin(names, ", "),
      spilled.size() == 1 ? " is" : " are",
      " spilled; a background restore is queued, retry after ",
      options_.retry_after_ms, " ms"));
  s.SetPayload(kRetryAfterPayload,
               absl::Cord(absl::StrCat(options_.retry_after_ms)));
  return s;
}

void SequenceStore::QueuePrefetch(const std::shared_ptr<Sequence>& seq,
                                  const std::vector<size_t>& blocks)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<uint64_t> lineage_ids;
  for (size_t b : blocks) {
    Block& blk = seq->blocks[b];
    blk.prefetch_queued = true;
    lineage_ids.push_back(blk.spec.lineage_id);
  }
  if (lineage_ids.empty()) return;
  prefetch_.Push(
      [this, seq, ids = std::move(lineage_ids)] { RunPrefetch(*seq, ids); });
}

void SequenceStore::RunPrefetch(Sequence& seq,
                                const std::vector<uint64_t>& lineage_ids)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // One pass: restores the queued blocks one at a time, so a bad block does
  // not hold back the others. Blocks refused for room are left queued in
  // `short_of_room` when `defer` is set (for a pass after compaction);
  // other failures are recorded on the block.
  auto pass = [&](const std::vector<uint64_t>& ids, bool defer,
                  const absl::StatusOr<CompactionResult>* compaction,
                  std::vector<uint64_t>* short_of_room) {
    absl::ReaderMutexLock data_lock(&data_mu_);
    absl::MutexLock lock(&seq.mu);
    if (seq.freed) return;
    std::vector<size_t> todo;
    for (uint64_t lineage : ids) {
      for (size_t b = 0; b < seq.blocks.size(); ++b) {
        const Block& blk = seq.blocks[b];
        if (blk.spec.lineage_id == lineage && blk.prefetch_queued &&
            !blk.resident() && !blk.spec.evicted) {
          todo.push_back(b);
        }
      }
    }
    for (size_t b : todo) {
      const uint64_t before = allocator_->Shortfalls();
      absl::StatusOr<RestoreResult> r = RestoreLocked(seq, {b});
      if (r.ok()) continue;
      Block& blk = seq.blocks[b];
      if (defer && NeedsCompaction(r.status(), before)) {
        short_of_room->push_back(blk.spec.lineage_id);
        continue;
      }
      absl::Status error = r.status();
      if (compaction != nullptr) error = AfterCompaction(error, *compaction);
      blk.prefetch_queued = false;
      if (blk.restore_error.ok()) blk.restore_error = error;
      Log(LogLevel::kWarn, "worker", "background restore failed",
          absl::StrCat(Kv("sequence_id", seq.id), " ",
                       Kv("lineage_id", blk.spec.lineage_id), " ",
                       Kv("code", static_cast<int>(error.code())), " ",
                       Kv("error", error.message())));
    }
  };
  std::vector<uint64_t> short_of_room;
  pass(lineage_ids, /*defer=*/true, nullptr, &short_of_room);
  if (short_of_room.empty()) return;
  const absl::StatusOr<CompactionResult> c = Compact();
  pass(short_of_room, /*defer=*/false, &c, nullptr);
}

size_t SequenceStore::ServePrefetchQueue() { return prefetch_.ServeAll(); }

void SequenceStore::WaitPrefetchIdle() { prefetch_.WaitIdle(); }

absl::StatusOr<SpilledBlock> SequenceStore::SpilledPages(
    absl::string_view sequence_id, uint32_t block) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Lookup(sequence_id));
  absl::MutexLock lock(&seq->mu);
  if (block >= seq->blocks.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("block=", block, " is outside the sequence"));
  }
  const Block& b = seq->blocks[block];
  if (b.spec.evicted || b.resident()) {
    return absl::FailedPreconditionError(
        absl::StrCat("block=", block, " is not spilled"));
  }
  return b.spilled;
}

}  // namespace triax::worker
