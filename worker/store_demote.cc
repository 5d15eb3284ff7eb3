// SequenceStore::Demote: re-encodes installed blocks in place (see
// "Demotion" in sequence_store.h). Four steps, all or nothing: check every
// entry, reserve every new page, fill the new pages (sealed pages in one
// Device::DemotePages call), then swap them in and free the old ones. Any
// error before the swap releases what was reserved and leaves the sequence
// as it was.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "worker/sequence_store.h"
#include "worker/sequence_store_internal.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using store_internal::Block;
using store_internal::BlockEncoding;
using store_internal::IsBf16;
using store_internal::NamedBlock;
using store_internal::Sequence;

namespace {

// A block whose encoding changes.
struct Recode {
  size_t block;
  Encoding enc;
};

// The new pages of one Recode on one layer.
struct Step {
  Page* target = nullptr;  // new target page
  Page* window = nullptr;  // new window page (BF16 block leaving BF16)
  bool sealed = false;
  uint32_t tokens = 0;  // tokens of the block written on this layer
};
using Steps = std::vector<std::vector<Step>>;  // [recode][layer]

// An unsealed BF16 block holding tokens in its target page needs a window
// page for them when it leaves BF16.
bool NeedsWindow(const Block& b, const Recode& r, const Step& st) {
  return !st.sealed && IsBf16(b.spec.encoding) && !IsBf16(r.enc) &&
         st.tokens > 0;
}

// Checks every entry before anything is touched; returns the blocks whose
// encoding changes (those already in the named one are skipped).
absl::StatusOr<std::vector<Recode>> PlanDemote(
    const Device& device, const PageAllocator& allocator, const Sequence& seq,
    absl::Span<const BlockSpec> blocks) ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  std::vector<Recode> jobs;
  std::vector<bool> named(seq.blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockSpec& want = blocks[i];
    TRIAX_ASSIGN_OR_RETURN(
        const Block* named_block,
        NamedBlock(seq, i, want.index, want.lineage_id, &named));
    const Block& b = *named_block;
    TRIAX_ASSIGN_OR_RETURN(
        Encoding enc,
        BlockEncoding(device, want, absl::StrCat("blocks[", i, "]"),
                      seq.shape));
    if (b.spec.evicted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (index=", want.index, " lineage_id=",
          want.lineage_id, ") is evicted; evicted blocks cannot be demoted"));
    }
    if (!b.resident()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (index=", want.index,
          " lineage_id=", want.lineage_id, ") is spilled to the ",
          TierLabel(b.spec.tier), " tier; Restore it before demoting"));
    }
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      const int refs = allocator.RefCount(b.target[l]);
      if (refs > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "blocks[", i, "] (index=", want.index,
            " lineage_id=", want.lineage_id, ") is shared by ", refs,
            " sequences (a fork); shared blocks cannot be demoted"));
      }
    }
    if (enc == b.spec.encoding) continue;  // already there: nothing to do
    jobs.push_back({want.index, enc});
  }
  return jobs;
}

// Reserves every page the new state needs, all or nothing; the pages are
// also listed in `reserved`, for releasing them should a later step fail.
absl::StatusOr<Steps> ReservePages(PageAllocator& allocator,
                                   const Sequence& seq,
                                   const std::vector<Recode>& jobs,
                                   std::vector<Page*>* reserved)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  const uint32_t layers = seq.model.n_layers;
  Steps steps(jobs.size(), std::vector<Step>(layers));
  uint64_t need_pages = 0, need_bytes = 0;
  const size_t window_bytes = kernels::PageBytes(Format::kBF16, seq.shape);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Block& b = seq.blocks[jobs[j].block];
    for (uint32_t l = 0; l < layers; ++l) {
      Step& st = steps[j][l];
      st.sealed = jobs[j].block < seq.sealed[l];
      st.tokens = static_cast<uint32_t>(
          seq.written[l] <= b.spec.first_token
              ? 0
              : std::min<uint64_t>(b.spec.num_tokens,
                                   seq.written[l] - b.spec.first_token));
      need_pages += 1;
      need_bytes += kernels::PageBytes(jobs[j].enc, seq.shape);
      if (NeedsWindow(b, jobs[j], st)) {
        need_pages += 1;
        need_bytes += window_bytes;
      }
    }
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Block& b = seq.blocks[jobs[j].block];
    const size_t bytes = kernels::PageBytes(jobs[j].enc, seq.shape);
    for (uint32_t l = 0; l < layers; ++l) {
      Step& st = steps[j][l];
      absl::StatusOr<Page*> t =
          allocator.Allocate(jobs[j].enc, bytes, PageUse::kTarget);
      absl::StatusOr<Page*> w(static_cast<Page*>(nullptr));
      if (t.ok()) {
        reserved->push_back(*t);
        st.target = *t;
        if (NeedsWindow(b, jobs[j], st)) {
          w = allocator.Allocate(Format::kBF16, window_bytes, PageUse::kWindow);
          if (w.ok()) {
            reserved->push_back(*w);
            st.window = *w;
          }
        }
      }
      if (!t.ok() || !w.ok()) {
        for (Page* p : *reserved) allocator.Unref(p);
        reserved->clear();
        const absl::Status& s = t.ok() ? w.status() : t.status();
        return absl::Status(
            s.code(),
            absl::StrCat("Demote sequence_id=", Quote(seq.id), " needs ",
                         need_pages, " new pages (", need_bytes, " bytes) for ",
                         jobs.size(), " blocks x ", layers,
                         " layers before the old ones are freed; ",
                         s.message()));
      }
    }
  }
  return steps;
}

// Fills the new pages; the old ones are untouched. Sealed pages are
// re-encoded in one DemotePages call.
absl::Status FillPages(Device& device, const Sequence& seq,
                       const std::vector<Recode>& jobs, const Steps& steps)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  const uint32_t layers = seq.model.n_layers;
  std::vector<DemoteJob> reencode;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Block& b = seq.blocks[jobs[j].block];
    for (uint32_t l = 0; l < layers; ++l) {
      if (!steps[j][l].sealed) continue;
      DemoteJob job;
      job.from = b.spec.encoding;
      job.src = b.target[l]->data;
      job.num_tokens = static_cast<int>(b.spec.num_tokens);
      job.to = jobs[j].enc;
      job.dst = steps[j][l].target->data;
      reencode.push_back(job);
    }
  }
  if (absl::Status s = device.DemotePages(seq.shape, reencode); !s.ok()) {
    return absl::Status(
        s.code(),
        absl::StrCat("Demote sequence_id=", Quote(seq.id), " re-encoding ",
                     reencode.size(), " sealed pages: ", s.message()));
  }
  const size_t window_bytes = kernels::PageBytes(Format::kBF16, seq.shape);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Block& b = seq.blocks[jobs[j].block];
    const Encoding& enc = jobs[j].enc;
    for (uint32_t l = 0; l < layers; ++l) {
      const Step& st = steps[j][l];
      absl::Status s;
      if (st.sealed) {
        continue;
      } else if (IsBf16(enc)) {
        // The new target page is written straight from now on: move the
        // staged tokens into it (from the window, or the old BF16 target).
        const Page* from = IsBf16(b.spec.encoding) ? b.target[l] : b.window[l];
        if (from != nullptr && st.tokens > 0) {
          s = device.CopyPage(st.target->data, from->data, window_bytes);
        }
      } else if (st.window != nullptr) {
        // Leaving BF16: the old target page's tokens move to a window page.
        s = device.CopyPage(st.window->data, b.target[l]->data, window_bytes);
      }
      if (!s.ok()) {
        return absl::Status(
            s.code(),
            absl::StrCat("Demote sequence_id=", Quote(seq.id), " block ",
                         jobs[j].block, " layer ", l, ": ", s.message()));
      }
    }
  }
  return absl::OkStatus();
}

// Swaps the new pages in and frees the old ones.
DemoteResult SwapIn(PageAllocator& allocator, Sequence& seq,
                    const std::vector<Recode>& jobs, const Steps& steps)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu) {
  const uint32_t layers = seq.model.n_layers;
  DemoteResult result;
  for (size_t j = 0; j < jobs.size(); ++j) {
    Block& b = seq.blocks[jobs[j].block];
    const Encoding& enc = jobs[j].enc;
    for (uint32_t l = 0; l < layers; ++l) {
      const Step& st = steps[j][l];
      result.bytes_delta += static_cast<int64_t>(st.target->bytes);
      if (st.window != nullptr) {
        result.bytes_delta += static_cast<int64_t>(st.window->bytes);
      }
      {
        absl::MutexLock seal_lock(&st.target->seal_mu);
        st.target->encoded = st.sealed;
        st.target->crc_known = false;  // re-encoded: checksummed on export
      }
      Page* old_target = b.target[l];
      b.target[l] = st.target;
      const size_t old_bytes = old_target->bytes;
      if (allocator.Unref(old_target)) {
        result.bytes_delta -= static_cast<int64_t>(old_bytes);
      }
      if (!st.sealed && IsBf16(enc) && b.window[l] != nullptr) {
        const size_t wb = b.window[l]->bytes;
        if (allocator.Unref(b.window[l])) {
          result.bytes_delta -= static_cast<int64_t>(wb);
        }
        b.window[l] = nullptr;
      }
      if (st.window != nullptr) b.window[l] = st.window;
      result.pages_reencoded += 1;
    }
    b.spec.encoding = enc;
  }
  return result;
}

}  // namespace

absl::StatusOr<DemoteResult> SequenceStore::DemoteOnce(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const BlockSpec> blocks) {
  auto check_args = [&] {
    return blocks.empty()
               ? absl::InvalidArgumentError("blocks is empty; name >= 1 block")
               : absl::OkStatus();
  };
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                         LockOwned(tenant_id, sequence_id, check_args));
  Sequence& seq = *locked;
  TRIAX_ASSIGN_OR_RETURN(std::vector<Recode> jobs,
                         PlanDemote(*device_, *allocator_, seq, blocks));
  std::vector<Page*> reserved;
  TRIAX_ASSIGN_OR_RETURN(Steps steps,
                         ReservePages(*allocator_, seq, jobs, &reserved));
  if (absl::Status s = FillPages(*device_, seq, jobs, steps); !s.ok()) {
    for (Page* p : reserved) allocator_->Unref(p);
    return s;
  }
  return SwapIn(*allocator_, seq, jobs, steps);
}

}  // namespace triax::worker
