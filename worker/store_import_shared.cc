// ImportSession's batches on the shared-arena (ipc) path: runs of pages
// checked against the plan and copied with their CRC32Cs by the device in a
// pipeline (StartSharedRuns, FinishShared; InstallShared and
// InstallSharedRuns drain it); see worker/store_transfer.h.
#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "worker/sequence_store_internal.h"
#include "worker/store_import_state.h"
#include "worker/store_transfer.h"

namespace triax::worker {

using kernels::Encoding;
using store_internal::Block;
using store_internal::IsBf16;
using store_internal::Sequence;

absl::Status ImportSession::InstallShared(absl::Span<const TransferPage> pages,
                                          const uint8_t* peer_base,
                                          uint64_t peer_bytes) {
  // Each page a run of one, reading its lineage id and CRC32C in place.
  std::vector<SharedRun> runs(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    const TransferPage& page = pages[i];
    if (!page.shared) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(page.block_index, page.layer),
                       "a page with bytes on the ipc path"));
    }
    SharedRun& r = runs[i];
    r.layer = page.layer;
    r.first_block = page.block_index;
    r.count = 1;
    r.encoding = page.encoding;
    r.num_tokens = page.num_tokens;
    r.sealed = page.sealed;
    r.offset = page.arena_offset;
    r.bytes = page.shared_bytes;
    r.lineage_ids = &page.lineage_id;
    r.crc32cs = &page.crc32c;
  }
  return InstallSharedRuns(runs, peer_base, peer_bytes);
}

absl::Status ImportSession::InstallSharedRuns(absl::Span<const SharedRun> runs,
                                              const uint8_t* peer_base,
                                              uint64_t peer_bytes) {
  // The pipeline, drained: in order after the batches already started.
  TRIAX_RETURN_IF_ERROR(StartSharedRuns(runs, peer_base, peer_bytes));
  return FinishShared();
}

absl::Status ImportSession::CheckShared(absl::Span<const SharedRun> runs,
                                        const uint8_t* peer_base,
                                        uint64_t peer_bytes) {
  Sequence& seq = *state_->seq;
  State& st = *state_;
  const uint32_t layers = seq.model.n_layers;
  const size_t n_blocks = seq.blocks.size();
  size_t total = 0;
  for (const SharedRun& run : runs) total += run.count;
  std::vector<PageCopy>& jobs = st.jobs;
  jobs.clear();
  jobs.reserve(total);
  st.dst.clear();
  st.dst.reserve(total);
  st.marked.reserve(total);
  // Pages of this batch checked so far are marked kPending in `have`, so a
  // page twice in one batch is a duplicate; the marks are undone unless
  // the whole batch installs.
  st.marked.clear();
  auto unmark = absl::MakeCleanup([&] {
    for (uint8_t* m : st.marked) *m = 0;
  });
  for (const SharedRun& run : runs) {
    // What the run's pages share, checked once: the layer, the blocks in
    // the plan, the bytes inside the peer's arena.
    if (run.count == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(run.first_block, run.layer),
                       "a run of 0 pages on the ipc path"));
    }
    if (run.layer >= layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(run.first_block, run.layer), "layer=", run.layer,
                       " is >= model.n_layers=", layers));
    }
    if (run.first_block >= n_blocks || run.count > n_blocks - run.first_block) {
      const uint64_t block = std::max<uint64_t>(run.first_block, n_blocks);
      return absl::InvalidArgumentError(absl::StrCat(
          Where(static_cast<uint32_t>(block), run.layer), "block_index=", block,
          " is not in the plan of ", n_blocks, " blocks"));
    }
    using U128 = unsigned __int128;
    const U128 last_end =
        U128{run.offset} + U128{run.stride} * (run.count - 1) + U128{run.bytes};
    if (last_end > U128{peer_bytes}) {
      // The first page outside (offsets grow with k).
      uint32_t k = 0;
      while (U128{run.offset} + U128{run.stride} * k + U128{run.bytes} <=
             U128{peer_bytes}) {
        ++k;
      }
      return absl::InvalidArgumentError(absl::StrCat(
          Where(run.first_block + k, run.layer),
          "arena_offset=", static_cast<uint64_t>(run.offset + run.stride * k),
          " shared_bytes=", run.bytes, " lie outside the source's arena of ",
          peer_bytes, " bytes"));
    }
    PageRef ref;
    ref.layer = run.layer;
    ref.encoding = run.encoding;
    ref.num_tokens = run.num_tokens;
    ref.sealed = run.sealed;
    // A page passes the checks as a run's other pages do when its block
    // holds the run's encoding (sealed pages) and the run's length is that
    // encoding's (BF16 for window pages): then only its own fields are
    // compared here, and Destination, which names what fails, sees the
    // pages that do not pass (and window pages of non-BF16 blocks, whose
    // window page it allocates).
    const bool window_bf16 = !run.sealed && IsBf16(run.encoding);
    // The length of the run's pages in the encoding of the first block
    // that holds it (a block's encoding is valid; the run's may not be).
    size_t want_bytes = window_bf16 ? st.bf16_bytes : 0;
    for (uint32_t k = 0; k < run.count; ++k) {
      const uint32_t bi = run.first_block + k;
      Block& b = seq.blocks[bi];
      uint8_t* mark = &st.Have(bi, run.layer);
      Page* dst = nullptr;
      const bool fast = *mark == 0 && run.lineage_ids[k] == b.spec.lineage_id &&
                        !b.spec.evicted && bi >= st.prefix_blocks &&
                        b.spec.num_tokens == run.num_tokens &&
                        (run.sealed ? b.spec.encoding == run.encoding
                                    : window_bf16 && IsBf16(b.spec.encoding));
      if (fast && want_bytes == 0) {
        want_bytes = kernels::PageBytes(b.spec.encoding, seq.shape);
      }
      if (fast && run.bytes == want_bytes) {
        dst = b.target[run.layer];
      } else {
        ref.block_index = bi;
        ref.lineage_id = run.lineage_ids[k];
        auto where = [&] { return Where(ref.block_index, ref.layer); };
        TRIAX_ASSIGN_OR_RETURN(dst, Destination(ref, run.bytes, where));
      }
      *mark = State::kPending;
      st.marked.push_back(mark);
      st.dst.push_back(dst);
      jobs.push_back(PageCopy{dst->data,
                              peer_base + run.offset + run.stride * k,
                              static_cast<size_t>(run.bytes)});
    }
  }
  std::move(unmark).Cancel();
  return absl::OkStatus();
}

void ImportSession::InstallRuns(absl::Span<const SharedRun> runs) {
  Sequence& seq = *state_->seq;
  State& st = *state_;
  for (const SharedRun& run : runs) {
    for (uint32_t k = 0; k < run.count; ++k) {
      const uint32_t bi = run.first_block + k;
      if (run.sealed) {
        MarkSealed(seq.blocks[bi].target[run.layer], run.crc32cs[k]);
      }
      st.Have(bi, run.layer) = run.sealed ? 1 : 2;
    }
    Counted(run.layer, run.encoding, run.count);
  }
}

absl::Status ImportSession::CompareCrcs(absl::Span<const SharedRun> runs,
                                        absl::Span<const uint32_t> crcs) const {
  size_t j = 0;
  for (const SharedRun& run : runs) {
    for (uint32_t k = 0; k < run.count; ++k, ++j) {
      if (crcs[j] != run.crc32cs[k]) {
        return absl::DataLossError(absl::StrCat(
            Where(run.first_block + k, run.layer),
            absl::StrFormat("CRC32C of the copied page is 0x%08x, the source "
                            "sent 0x%08x; the page is not installed",
                            crcs[j], run.crc32cs[k])));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ImportSession::StartSharedRuns(absl::Span<const SharedRun> runs,
                                            const uint8_t* peer_base,
                                            uint64_t peer_bytes) {
  State& st = *state_;
  if (st.committed) {
    return absl::FailedPreconditionError(
        absl::StrCat("import of sequence_id=", Quote(plan_.sequence_id),
                     " from ", plan_.source, ": already committed"));
  }
  if (st.copier == nullptr) {
    TRIAX_ASSIGN_OR_RETURN(st.copier, store_->device_->NewCheckedCopies());
  }
  if (st.in_flight.size() == CheckedCopies::kMaxInFlight) {
    TRIAX_RETURN_IF_ERROR(FinishOldest());
  }
  TRIAX_RETURN_IF_ERROR(store_
                            ->WithRoom<bool>([&]() -> absl::StatusOr<bool> {
                              TRIAX_RETURN_IF_ERROR(
                                  StartSharedOnce(runs, peer_base, peer_bytes));
                              return true;
                            })
                            .status());
  // The device copies this batch while the one before is checked.
  if (st.in_flight.size() > 1) TRIAX_RETURN_IF_ERROR(FinishOldest());
  return absl::OkStatus();
}

absl::Status ImportSession::StartSharedOnce(absl::Span<const SharedRun> runs,
                                            const uint8_t* peer_base,
                                            uint64_t peer_bytes) {
  Sequence& seq = *state_->seq;
  absl::MutexLock lock(&seq.mu);
  State& st = *state_;
  TRIAX_RETURN_IF_ERROR(CheckShared(runs, peer_base, peer_bytes));
  auto unmark = absl::MakeCleanup([&] {
    for (uint8_t* m : st.marked) *m = 0;
  });
  // What installing the batch needs once its copies are done, the
  // caller's arrays copied (the caller reuses them).
  State::Batch b;
  b.runs.assign(runs.begin(), runs.end());
  b.want.reserve(st.jobs.size());
  for (const SharedRun& run : runs) {
    b.want.insert(b.want.end(), run.crc32cs, run.crc32cs + run.count);
  }
  size_t at = 0;
  for (SharedRun& run : b.runs) {
    run.lineage_ids = nullptr;  // checked
    run.crc32cs = b.want.data() + at;
    at += run.count;
  }
  b.marked = st.marked;
  // Compaction leaves pinned pages where they are while the device writes
  // them.
  b.pinned = st.dst;
  store_->allocator_->PinAll(b.pinned);
  const absl::Time copy_start = absl::Now();
  if (absl::Status s = st.copier->Start(st.jobs); !s.ok()) {
    store_->allocator_->UnpinAll(b.pinned);
    return s;
  }
  st.result.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);
  std::move(unmark).Cancel();
  st.in_flight.push_back(std::move(b));
  return absl::OkStatus();
}

absl::Status ImportSession::FinishOldest() {
  State& st = *state_;
  State::Batch& b = st.in_flight.front();
  st.crcs.resize(b.want.size());
  const absl::Time copy_start = absl::Now();
  absl::Status s = st.copier->Finish(absl::MakeSpan(st.crcs));
  st.result.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);
  // A failed wait leaves the batch pinned: the destructor waits for the
  // device before it unpins and frees.
  if (!s.ok()) return s;
  Sequence& seq = *st.seq;
  absl::MutexLock lock(&seq.mu);
  s = CompareCrcs(b.runs, st.crcs);
  if (s.ok()) {
    InstallRuns(b.runs);
  } else {
    for (uint8_t* m : b.marked) *m = 0;
  }
  // Nothing writes these pages any more.
  store_->allocator_->UnpinAll(b.pinned);
  st.in_flight.pop_front();
  return s;
}

absl::Status ImportSession::FinishShared() {
  while (!state_->in_flight.empty()) TRIAX_RETURN_IF_ERROR(FinishOldest());
  return absl::OkStatus();
}

size_t ImportSession::SharedInFlight() const {
  return state_->in_flight.size();
}

}  // namespace triax::worker
