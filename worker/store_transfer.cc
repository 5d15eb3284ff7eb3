// SequenceStore::Export and ImportSession (see worker/store_transfer.h).
#include "worker/store_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "worker/checksum.h"
#include "worker/sequence_store_internal.h"
#include "worker/store_import_state.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;
using store_internal::Block;
using store_internal::BlockEncoding;
using store_internal::CheckOwner;
using store_internal::EncName;
using store_internal::IsBf16;
using store_internal::NamedBlock;
using store_internal::Sequence;

namespace {

Encoding Bf16() {
  Encoding e;
  e.k = Format::kBF16;
  e.v = Format::kBF16;
  return e;
}

// Scratch pages of the pool, released when it goes.
class Scratch {
 public:
  explicit Scratch(PageAllocator* allocator) : allocator_(allocator) {}
  ~Scratch() {
    for (Page* p : pages_) allocator_->Unref(p);
  }
  absl::StatusOr<Page*> Take(const Encoding& e, size_t bytes) {
    absl::StatusOr<Page*> p = allocator_->Allocate(e, bytes, PageUse::kTarget);
    if (p.ok()) pages_.push_back(*p);
    return p;
  }

 private:
  PageAllocator* const allocator_;
  std::vector<Page*> pages_;
};

// Checks the export list against the sequence; returns the end (token) of
// the last named block.
absl::StatusOr<uint64_t> CheckExportBlocks(const Device& device,
                                           const Sequence& seq,
                                           absl::Span<const ExportBlock> blocks)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  std::vector<bool> named(seq.blocks.size(), false);
  // Each distinct wanted encoding is checked once (named by its first
  // block): a sequence of thousands of blocks holds a few encodings.
  std::vector<Encoding> checked;
  uint64_t end = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ExportBlock& want = blocks[i];
    TRIAX_ASSIGN_OR_RETURN(
        const Block* named_block,
        NamedBlock(seq, i, want.index, want.lineage_id, &named));
    const Block& b = *named_block;
    if (std::find(checked.begin(), checked.end(), want.encoding) ==
        checked.end()) {
      BlockSpec spec = b.spec;
      spec.encoding = want.encoding;
      TRIAX_RETURN_IF_ERROR(BlockEncoding(device, spec,
                                          absl::StrCat("blocks[", i, "]"),
                                          seq.shape)
                                .status());
      checked.push_back(want.encoding);
    }
    if (b.spec.evicted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (index=", want.index,
          " lineage_id=", want.lineage_id, ") of sequence_id=", Quote(seq.id),
          " is evicted; it has no pages to send"));
    }
    end = std::max(end, b.end());
  }
  return end;
}

// Checks blocks [0, plan.prefix_blocks) of the plan against the prefix
// sequence (see "A prefix hit" in store_transfer.h).
absl::Status CheckPrefix(const Sequence& prefix, const ImportPlan& plan)
    ABSL_SHARED_LOCKS_REQUIRED(prefix.mu) {
  const std::string what =
      absl::StrCat("import of sequence_id=", Quote(plan.sequence_id),
                   " with prefix_sequence_id=", Quote(prefix.id), ": ");
  const ModelShape& m = prefix.model;
  if (m.n_layers != plan.model.n_layers ||
      m.n_kv_heads != plan.model.n_kv_heads ||
      m.n_q_heads != plan.model.n_q_heads ||
      m.head_dim != plan.model.head_dim ||
      prefix.block_tokens != plan.block_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, "the prefix sequence has another model shape or block_tokens (",
        prefix.block_tokens, " vs ", plan.block_tokens, ")"));
  }
  if (prefix.blocks.size() < plan.prefix_blocks) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, "prefix_blocks=", plan.prefix_blocks,
        " but the prefix sequence has ", prefix.blocks.size(), " blocks"));
  }
  for (uint32_t i = 0; i < plan.prefix_blocks; ++i) {
    const BlockSpec& have = prefix.blocks[i].spec;
    const BlockSpec& want = plan.blocks[i];
    if (have.lineage_id != want.lineage_id ||
        have.first_token != want.first_token ||
        have.num_tokens != want.num_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, "block ", i,
          " mismatches: the plan's lineage_id=", want.lineage_id,
          " (first_token=", want.first_token, " num_tokens=", want.num_tokens,
          "), the prefix's lineage_id=", have.lineage_id, " (first_token=",
          have.first_token, " num_tokens=", have.num_tokens, ")"));
    }
    if (have.num_tokens != prefix.block_tokens) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, "block ", i, " (lineage_id=", have.lineage_id,
                       ") holds ", have.num_tokens, " of ", prefix.block_tokens,
                       " tokens; only full blocks are shared"));
    }
    if (have.evicted || !prefix.blocks[i].resident()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, "block ", i, " (lineage_id=", have.lineage_id, ") is ",
          have.evicted ? "evicted" : "spilled",
          " in the prefix sequence; only resident blocks are shared"));
    }
    for (uint32_t l = 0; l < prefix.model.n_layers; ++l) {
      if (i >= prefix.sealed[l]) {
        return absl::FailedPreconditionError(absl::StrCat(
            what, "block ", i, " (lineage_id=", have.lineage_id,
            ") is not sealed on layer ", l,
            " in the prefix sequence; only sealed blocks are shared"));
      }
    }
  }
  return absl::OkStatus();
}

// The checks of CheckExportBlocks that can change between an export's
// layers (the blocks still there with their lineage ids, not evicted), in
// one lean pass; false when one fails (CheckExportBlocks then names it).
bool ExportBlocksStillThere(const Sequence& seq,
                            absl::Span<const ExportBlock> blocks)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  const size_t n = seq.blocks.size();
  for (const ExportBlock& want : blocks) {
    if (want.index >= n) return false;
    const BlockSpec& spec = seq.blocks[want.index].spec;
    if (spec.lineage_id != want.lineage_id || spec.evicted) return false;
  }
  return true;
}

// PageBytes of the last encoding asked for (an export's pages come in runs
// of one encoding).
class PageBytesCache {
 public:
  explicit PageBytesCache(const PageShape& shape) : shape_(shape) {}
  size_t operator()(const Encoding& e) {
    if (bytes_ == 0 || !(e == encoding_)) {
      encoding_ = e;
      bytes_ = kernels::PageBytes(e, shape_);
    }
    return bytes_;
  }

 private:
  const PageShape& shape_;
  Encoding encoding_;
  size_t bytes_ = 0;
};

void Checksum(std::vector<TransferPage>* pages) {
  for (TransferPage& p : *pages) {
    if (!p.crc_known) p.crc32c = Crc32c(p.data.data(), p.data.size());
  }
}

// The CRC32C `page` keeps from when it sealed into *out, if it has one.
void StoredCrc(Page* page, TransferPage* out) {
  absl::MutexLock seal_lock(&page->seal_mu);
  if (page->encoded && page->crc_known) {
    out->crc32c = page->crc32c;
    out->crc_known = true;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// PagePins

PagePins::~PagePins() { ReleaseFirst(size()); }

void PagePins::Adopt(std::vector<Page*>* pinned) {
  absl::MutexLock lock(&mu_);
  pages_.insert(pages_.end(), pinned->begin(), pinned->end());
  pinned->clear();
}

size_t PagePins::size() const {
  absl::MutexLock lock(&mu_);
  return pages_.size();
}

size_t PagePins::held() const {
  absl::MutexLock lock(&mu_);
  return pages_.size() - released_;
}

void PagePins::ReleaseFirst(size_t n) {
  std::vector<Page*> release;
  {
    absl::MutexLock lock(&mu_);
    n = std::min(n, pages_.size());
    if (n <= released_) return;
    release.assign(pages_.begin() + released_, pages_.begin() + n);
    released_ = n;
  }
  allocator_->UnpinAll(release);
}

std::unique_ptr<PagePins> SequenceStore::NewPagePins() const {
  return std::make_unique<PagePins>(allocator_);
}

const uint8_t* SequenceStore::ArenaBase() const {
  return allocator_->arena_base();
}

absl::StatusOr<SharedArenaInfo> SequenceStore::SharedArena() const {
  SharedArenaInfo info;
  info.backend = device_->Name();
  info.bytes = allocator_->arena_bytes();
  absl::MutexLock lock(&shared_arena_mu_);
  if (!shared_arena_handle_.has_value()) {
    TRIAX_ASSIGN_OR_RETURN(shared_arena_handle_,
                           device_->ShareArena(allocator_->arena_base(),
                                               allocator_->arena_bytes()));
  }
  info.handle = *shared_arena_handle_;
  return info;
}

// ---------------------------------------------------------------------------
// Export

absl::Status SequenceStore::Export(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const ExportBlock> blocks, const ExportOptions& options,
    absl::FunctionRef<absl::Status(uint32_t, std::vector<TransferPage>*)>
        sink) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq,
                         LookupOwned(tenant_id, sequence_id));
  if (blocks.empty()) {
    return absl::InvalidArgumentError("blocks is empty; name >= 1 block");
  }
  uint32_t layers = 0;
  uint64_t end = 0;
  bool as_stored = true;  // every page goes as it lies: no scratch pages
  {
    TRIAX_ASSIGN_OR_RETURN(LockedSequence locked, LockOwned(seq, tenant_id));
    TRIAX_ASSIGN_OR_RETURN(end, CheckExportBlocks(*device_, *locked, blocks));
    layers = locked->model.n_layers;
    for (const ExportBlock& want : blocks) {
      const Block& b = locked->blocks[want.index];
      as_stored = as_stored && b.resident() && b.spec.encoding == want.encoding;
    }
  }
  // On a device that time-slices processes, a shared export of written
  // layers whose pages all go as stored takes the CRC32Cs its pages do not
  // keep from sealing in passes over groups of layers (1 GiB of pages)
  // before each group goes to the sink, rather than one launch per layer
  // between the peer's copies; layers whose pages all keep theirs go at
  // once.
  // Re-encoded or spilled pages would sit in scratch pages a group at a
  // time that way; those exports go layer by layer.
  if (options.pins != nullptr && options.shared_checksums &&
      !options.follow_writes && as_stored && device_->TimeSlicesProcesses()) {
    return ExportSharedAtOnce(seq, tenant_id, blocks, layers, end, options.pins,
                              sink);
  }
  for (uint32_t l = 0; l < layers; ++l) {
    if (options.follow_writes) {
      absl::MutexLock lock(&seq->mu);
      for (;;) {
        TRIAX_RETURN_IF_ERROR(CheckOwner(*seq, tenant_id));
        const uint64_t written = seq->written[l];
        if (written >= end) break;
        const std::string what = absl::StrCat(
            "export of sequence_id=", Quote(sequence_id), " waiting for layer ",
            l, " to be written up to token ", end, " (", written, " written)");
        if (options.cancelled && options.cancelled()) {
          return absl::CancelledError(absl::StrCat(what, ": cancelled"));
        }
        const absl::Time now = absl::Now();
        if (now >= options.deadline) {
          return absl::DeadlineExceededError(
              absl::StrCat(what, ": deadline passed"));
        }
        seq->written_cv.WaitWithDeadline(
            &seq->mu,
            std::min(options.deadline, now + absl::Milliseconds(100)));
      }
    }
    absl::StatusOr<std::vector<TransferPage>> pages =
        WithRoom<std::vector<TransferPage>>([&] {
          return ExportLayerOnce(seq, tenant_id, blocks, l, end, options.pins,
                                 options.shared_checksums);
        });
    TRIAX_RETURN_IF_ERROR(pages.status());
    if (options.pins == nullptr) Checksum(&*pages);
    TRIAX_RETURN_IF_ERROR(sink(l, &*pages));
  }
  return absl::OkStatus();
}

absl::Status SequenceStore::ExportSharedAtOnce(
    const std::shared_ptr<Sequence>& seq, absl::string_view tenant_id,
    absl::Span<const ExportBlock> blocks, uint32_t layers, uint64_t end,
    PagePins* pins,
    absl::FunctionRef<absl::Status(uint32_t, std::vector<TransferPage>*)>
        sink) {
  const uint8_t* base = allocator_->arena_base();
  std::vector<std::vector<TransferPage>> group;  // layers [first, first + n)
  uint64_t group_bytes = 0;
  uint64_t unsummed_bytes = 0;  // of the group's pages without a CRC32C
  uint32_t first = 0;
  // Checksums the group's pages in one pass and hands its layers on. The
  // pages are pinned: their bytes stay where they are without the data
  // lock.
  auto flush = [&]() -> absl::Status {
    std::vector<DeviceBytes> ranges;
    std::vector<TransferPage*> unsummed;  // the page of each range
    for (std::vector<TransferPage>& layer : group) {
      for (TransferPage& p : layer) {
        if (p.crc_known) continue;
        ranges.push_back(DeviceBytes{base + p.arena_offset,
                                     static_cast<size_t>(p.shared_bytes)});
        unsummed.push_back(&p);
      }
    }
    if (!ranges.empty()) {
      std::vector<uint32_t> crcs(ranges.size());
      if (absl::Status s = device_->Checksum(ranges, absl::MakeSpan(crcs));
          !s.ok()) {
        return absl::Status(
            s.code(), absl::StrCat("export of sequence_id=", Quote(seq->id),
                                   " checksums: ", s.message()));
      }
      for (size_t j = 0; j < unsummed.size(); ++j) {
        unsummed[j]->crc32c = crcs[j];
        unsummed[j]->crc_known = true;
      }
    }
    for (size_t i = 0; i < group.size(); ++i) {
      TRIAX_RETURN_IF_ERROR(sink(first + static_cast<uint32_t>(i), &group[i]));
    }
    first += static_cast<uint32_t>(group.size());
    group.clear();
    group_bytes = 0;
    unsummed_bytes = 0;
    return absl::OkStatus();
  };
  for (uint32_t l = 0; l < layers; ++l) {
    absl::StatusOr<std::vector<TransferPage>> pages =
        WithRoom<std::vector<TransferPage>>([&] {
          return ExportLayerOnce(seq, tenant_id, blocks, l, end, pins,
                                 /*shared_checksums=*/false);
        });
    TRIAX_RETURN_IF_ERROR(pages.status());
    for (const TransferPage& p : *pages) {
      group_bytes += p.shared_bytes;
      if (!p.crc_known) unsummed_bytes += p.shared_bytes;
    }
    group.push_back(*std::move(pages));
    // Layers whose pages all keep their CRC32C from sealing need no device
    // pass: they go at once.
    if (unsummed_bytes == 0 ||
        group_bytes >= options_.shared_checksum_group_bytes) {
      TRIAX_RETURN_IF_ERROR(flush());
    }
  }
  return group.empty() ? absl::OkStatus() : flush();
}

absl::StatusOr<std::vector<TransferPage>> SequenceStore::ExportLayerOnce(
    const std::shared_ptr<Sequence>& seq_ptr, absl::string_view tenant_id,
    absl::Span<const ExportBlock> blocks, uint32_t layer, uint64_t end,
    PagePins* pins, bool shared_checksums) {
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked, LockOwned(seq_ptr, tenant_id));
  Sequence& seq = *locked;
  // Export checked the list as a whole (encodings, no block named twice);
  // what may have changed since is checked again, the full check naming
  // the fault.
  if (!ExportBlocksStillThere(seq, blocks)) {
    TRIAX_RETURN_IF_ERROR(CheckExportBlocks(*device_, seq, blocks).status());
  }
  if (seq.written[layer] < end) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id=", Quote(seq.id), " layer ", layer, " has ",
        seq.written[layer], " written tokens; the named blocks end at token ",
        end, " (follow_writes waits for them)"));
  }
  const PageShape& shape = seq.shape;
  PageBytesCache page_bytes(shape);
  Scratch scratch(allocator_);
  std::vector<TransferPage> pages(blocks.size());
  std::vector<DemoteJob> jobs;
  std::vector<size_t> job_page;  // pages[] index of each job
  // Shared export: the page whose bytes pages[i] names, all pinned at the
  // end (under the sequence's mutex, before the scratch pages are let go)
  // when the whole layer succeeded.
  const bool shared = pins != nullptr;
  std::vector<Page*> shared_src(shared ? blocks.size() : 0, nullptr);
  auto share = [&](size_t i, Page* page) { shared_src[i] = page; };
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ExportBlock& want = blocks[i];
    const Block& b = seq.blocks[want.index];
    TransferPage& p = pages[i];
    p.layer = layer;
    p.block_index = want.index;
    p.lineage_id = want.lineage_id;
    p.num_tokens = b.spec.num_tokens;
    const bool sealed = want.index < seq.sealed[layer];
    if (!sealed) {
      // In the window (never spilled): the BF16 page holding its tokens.
      const Page* src =
          IsBf16(b.spec.encoding) ? b.target[layer] : b.window[layer];
      if (src == nullptr) {
        return absl::InternalError(
            absl::StrCat("sequence_id=", Quote(seq.id), " ",
                         store_internal::BlockName(b.spec), " layer ", layer,
                         " is unsealed but has no BF16 page"));
      }
      p.encoding = Bf16();
      p.sealed = false;
      const size_t bytes = kernels::PageBytes(Format::kBF16, shape);
      if (shared) {
        share(i, const_cast<Page*>(src));
        continue;
      }
      p.data.resize(bytes);
      TRIAX_RETURN_IF_ERROR(
          device_->CopyToHost(p.data.data(), src->data, p.data.size()));
      continue;
    }
    p.encoding = want.encoding;
    p.sealed = true;
    const size_t bytes = page_bytes(want.encoding);
    if (!shared) p.data.resize(bytes);
    const uint8_t* stored = nullptr;  // device bytes in b.spec.encoding
    if (b.resident()) {
      stored = b.target[layer]->data;
      if (b.spec.encoding == want.encoding) {
        StoredCrc(b.target[layer], &p);
        if (shared) {
          share(i, b.target[layer]);
          p.shared_bytes = bytes;
          continue;
        }
        TRIAX_RETURN_IF_ERROR(
            device_->CopyToHost(p.data.data(), stored, p.data.size()));
        continue;
      }
    } else {
      std::vector<uint8_t> buf;
      const BlockLabel label{seq.id, b.spec.lineage_id, b.spec.index};
      TRIAX_RETURN_IF_ERROR(
          options_.tiers->ReadPage(b.spilled, layer, label, &buf));
      if (b.spec.encoding == want.encoding && !shared) {
        p.data.assign(buf.begin(), buf.end());
        continue;
      }
      TRIAX_ASSIGN_OR_RETURN(Page * staged,
                             scratch.Take(b.spec.encoding, buf.size()));
      TRIAX_RETURN_IF_ERROR(
          device_->CopyFromHost(staged->data, buf.data(), buf.size()));
      if (b.spec.encoding == want.encoding) {  // shared
        share(i, staged);
        continue;
      }
      stored = staged->data;
    }
    TRIAX_ASSIGN_OR_RETURN(Page * dst, scratch.Take(want.encoding, bytes));
    if (shared) share(i, dst);
    DemoteJob job;
    job.from = b.spec.encoding;
    job.src = stored;
    job.num_tokens = static_cast<int>(b.spec.num_tokens);
    job.to = want.encoding;
    job.dst = dst->data;
    jobs.push_back(job);
    job_page.push_back(i);
  }
  if (!jobs.empty()) {
    if (absl::Status s = device_->DemotePages(shape, jobs); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("export of sequence_id=", Quote(seq.id),
                                 " layer ", layer, " re-encoding ", jobs.size(),
                                 " pages: ", s.message()));
    }
    for (size_t j = 0; j < jobs.size() && !shared; ++j) {
      TransferPage& p = pages[job_page[j]];
      TRIAX_RETURN_IF_ERROR(
          device_->CopyToHost(p.data.data(), jobs[j].dst, p.data.size()));
    }
  }
  if (shared) {
    // Offsets in the arena, and CRC32Cs taken on the device for the pages
    // that do not keep one from sealing; then the pins go to the caller.
    const uint8_t* base = allocator_->arena_base();
    std::vector<DeviceBytes> ranges;
    std::vector<size_t> unsummed;  // pages[] index of each range
    for (size_t i = 0; i < pages.size(); ++i) {
      const Page* src = shared_src[i];
      // (Set above for stored pages, the most.)
      const size_t bytes = pages[i].shared_bytes != 0
                               ? pages[i].shared_bytes
                               : page_bytes(pages[i].encoding);
      pages[i].shared = true;
      pages[i].arena_offset = static_cast<uint64_t>(src->data - base);
      pages[i].shared_bytes = bytes;
      if (shared_checksums && !pages[i].crc_known) {
        ranges.push_back(DeviceBytes{src->data, bytes});
        unsummed.push_back(i);
      }
    }
    if (!ranges.empty()) {
      std::vector<uint32_t> crcs(ranges.size());
      if (absl::Status s = device_->Checksum(ranges, absl::MakeSpan(crcs));
          !s.ok()) {
        return absl::Status(
            s.code(),
            absl::StrCat("export of sequence_id=", Quote(seq.id), " layer ",
                         layer, " checksums: ", s.message()));
      }
      for (size_t j = 0; j < unsummed.size(); ++j) {
        pages[unsummed[j]].crc32c = crcs[j];
        pages[unsummed[j]].crc_known = true;
      }
    }
    allocator_->PinAll(shared_src);
    pins->Adopt(&shared_src);
  }
  return pages;
}

// ---------------------------------------------------------------------------
// Import

absl::StatusOr<std::unique_ptr<ImportSession>> SequenceStore::BeginImport(
    const ImportPlan& plan) {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", plan.tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", plan.sequence_id));
  TRIAX_RETURN_IF_ERROR(CheckShape(plan.model, plan.block_tokens));
  const PageShape shape = PageShapeOf(plan.model, plan.block_tokens);
  TRIAX_RETURN_IF_ERROR(store_internal::ValidatePlan(*device_, plan.blocks,
                                                     plan.block_tokens, shape));
  // A prefix hit: its blocks' specs and pages, each page referenced here
  // until the new sequence holds its own reference (or the import fails).
  std::vector<BlockSpec> prefix_specs;
  std::vector<Page*> prefix_pages;  // [block * n_layers + layer]
  struct Unref {
    PageAllocator* allocator;
    std::vector<Page*>* pages;
    ~Unref() {
      for (Page* p : *pages) allocator->Unref(p);
    }
  } unref{allocator_, &prefix_pages};
  if (plan.prefix_blocks > 0) {
    TRIAX_RETURN_IF_ERROR(
        ValidateId("prefix_sequence_id", plan.prefix_sequence_id));
    if (plan.prefix_sequence_id == plan.sequence_id) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix_sequence_id=", Quote(plan.prefix_sequence_id),
                       " equals sequence_id; name another sequence"));
    }
    if (plan.prefix_blocks > plan.blocks.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix_blocks=", plan.prefix_blocks, " is more than the plan's ",
          plan.blocks.size(), " blocks"));
    }
    absl::StatusOr<std::shared_ptr<Sequence>> found =
        Lookup(plan.prefix_sequence_id);
    if (!found.ok()) {
      return absl::NotFoundError(
          absl::StrCat("prefix_sequence_id=", Quote(plan.prefix_sequence_id),
                       " is not on this worker"));
    }
    TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                           LockOwned(*std::move(found), plan.tenant_id));
    const Sequence& prefix = *locked;
    TRIAX_RETURN_IF_ERROR(CheckPrefix(prefix, plan));
    for (uint32_t i = 0; i < plan.prefix_blocks; ++i) {
      prefix_specs.push_back(prefix.blocks[i].spec);
      for (Page* page : prefix.blocks[i].target) {
        allocator_->Ref(page);
        prefix_pages.push_back(page);
      }
    }
  } else if (!plan.prefix_sequence_id.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_sequence_id=", Quote(plan.prefix_sequence_id),
                     " is named with prefix_blocks=0; name both or neither"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (sequences_.contains(plan.sequence_id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("sequence_id=", Quote(plan.sequence_id),
                       " is already on this worker"));
    }
    if (!importing_.insert(plan.sequence_id).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("an import of sequence_id=", Quote(plan.sequence_id),
                       " is already running on this worker"));
    }
  }
  auto state = std::make_unique<ImportSession::State>();
  state->start = absl::Now();
  auto seq = std::make_shared<Sequence>();
  seq->id = plan.sequence_id;
  const uint32_t layers = plan.model.n_layers;
  absl::StatusOr<bool> reserved = WithRoom<bool>([&]() -> absl::StatusOr<bool> {
    absl::MutexLock lock(&seq->mu);
    seq->tenant = plan.tenant_id;
    seq->model = plan.model;
    seq->block_tokens = plan.block_tokens;
    seq->window_tokens = plan.window_tokens.value_or(options_.window_tokens);
    seq->shape = shape;
    seq->written.assign(layers, 0);
    seq->sealed.assign(layers, 0);
    seq->planned = 0;
    ReleaseAll(*seq);  // a second run starts from nothing
    state->result.page_bytes = 0;
    state->result.pages_shared = 0;
    seq->blocks.reserve(plan.blocks.size());
    for (const BlockSpec& spec : plan.blocks) {
      Block b;
      b.spec = spec;
      b.target.assign(layers, nullptr);
      b.window.assign(layers, nullptr);
      b.spec.tier = spec.evicted ? Tier::kUnspecified : Tier::kDevice;
      seq->planned += spec.num_tokens;
      const size_t i = seq->blocks.size();
      if (i < prefix_specs.size()) {
        // Shared with the prefix: its spec (encoding) and its pages.
        b.spec = prefix_specs[i];
        for (uint32_t l = 0; l < layers; ++l) {
          b.target[l] = prefix_pages[i * layers + l];
          allocator_->Ref(b.target[l]);
          state->result.pages_shared += 1;
        }
        seq->blocks.push_back(std::move(b));
        continue;
      }
      seq->blocks.push_back(std::move(b));
      if (spec.evicted) continue;
      Block& nb = seq->blocks.back();
      const size_t bytes = kernels::PageBytes(spec.encoding, shape);
      nb.target.clear();
      if (absl::Status s = allocator_->AllocateMany(
              spec.encoding, bytes, PageUse::kTarget, layers, &nb.target);
          !s.ok()) {
        nb.target.assign(layers, nullptr);
        ReleaseAll(*seq);
        return absl::Status(
            s.code(),
            absl::StrCat("import of sequence_id=", Quote(plan.sequence_id),
                         " reserving ", store_internal::BlockName(spec), " (",
                         layers, " layers): ", s.message()));
      }
      state->result.page_bytes += bytes * layers;
    }
    return true;
  });
  if (!reserved.ok()) {
    absl::MutexLock lock(&mu_);
    importing_.erase(plan.sequence_id);
    return reserved.status();
  }
  state->seq = std::move(seq);
  state->layers = layers;
  state->have.assign(plan.blocks.size() * layers, 0);
  state->layer_pages.assign(layers, 0);
  state->prefix_blocks = plan.prefix_blocks;
  for (size_t i = 0; i < plan.blocks.size(); ++i) {
    if (i < plan.prefix_blocks) {
      // Shared, sealed.
      std::fill_n(state->have.begin() + i * layers, layers, uint8_t{1});
    } else if (!plan.blocks[i].evicted) {
      state->pages_per_layer += 1;
    }
  }
  state->result.layer_done_seconds.assign(layers, 0.0);
  state->bf16_bytes = kernels::PageBytes(Format::kBF16, shape);
  state->result.reserve_seconds =
      absl::ToDoubleSeconds(absl::Now() - state->start);
  return std::unique_ptr<ImportSession>(
      new ImportSession(this, plan, std::move(state)));
}

ImportSession::ImportSession(SequenceStore* store, ImportPlan plan,
                             std::unique_ptr<State> state)
    : store_(store), plan_(std::move(plan)), state_(std::move(state)) {}

ImportSession::~ImportSession() {
  if (state_->committed) return;
  // The device is done with every batch in flight before their pages are
  // unpinned and freed.
  state_->copier.reset();
  for (State::Batch& b : state_->in_flight) {
    store_->allocator_->UnpinAll(b.pinned);
  }
  state_->in_flight.clear();
  {
    absl::MutexLock lock(&store_->mu_);
    store_->importing_.erase(plan_.sequence_id);
  }
  Sequence& seq = *state_->seq;
  absl::MutexLock lock(&seq.mu);
  seq.freed = true;
  store_->ReleaseAll(seq);
}

void ImportSession::CountWait(absl::Duration waited) {
  state_->result.wait_seconds += absl::ToDoubleSeconds(waited);
}

std::string ImportSession::Where(uint32_t block_index, uint32_t layer) const {
  std::string block = block_index < plan_.blocks.size()
                          ? store_internal::BlockName(plan_.blocks[block_index])
                          : absl::StrCat("block ", block_index);
  return absl::StrCat("import of sequence_id=", Quote(plan_.sequence_id), " ",
                      block, " layer ", layer, " from ", plan_.source, ": ");
}

ImportSession::PageRef ImportSession::RefOf(const TransferPage& page) {
  PageRef r;
  r.layer = page.layer;
  r.block_index = page.block_index;
  r.lineage_id = page.lineage_id;
  r.encoding = page.encoding;
  r.num_tokens = page.num_tokens;
  r.sealed = page.sealed;
  r.crc32c = page.crc32c;
  return r;
}

absl::Status ImportSession::Install(const TransferPage& page) {
  if (state_->committed) {
    return absl::FailedPreconditionError(
        absl::StrCat(Where(page.block_index, page.layer),
                     "the import is already committed"));
  }
  return store_
      ->WithRoom<bool>([&]() -> absl::StatusOr<bool> {
        TRIAX_RETURN_IF_ERROR(InstallOnce(page));
        return true;
      })
      .status();
}

absl::StatusOr<Page*> ImportSession::Destination(
    const PageRef& page, size_t bytes, absl::FunctionRef<std::string()> where) {
  // `where` (the message prefix) is built only for an error.
  State& st = *state_;
  Sequence& seq = *st.seq;
  if (page.layer >= seq.model.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), "layer=", page.layer,
                     " is >= model.n_layers=", seq.model.n_layers));
  }
  if (page.block_index >= seq.blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), "block_index=", page.block_index,
                     " is not in the plan of ", seq.blocks.size(), " blocks"));
  }
  Block& b = seq.blocks[page.block_index];
  if (page.lineage_id != b.spec.lineage_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "lineage_id=", page.lineage_id,
        " differs from the plan's lineage_id=", b.spec.lineage_id));
  }
  if (b.spec.evicted) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "the block is evicted in the plan; no page was expected"));
  }
  if (page.block_index < st.prefix_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "the block shares the prefix sequence's pages (prefix_blocks=",
        st.prefix_blocks, "); no page was expected"));
  }
  if (const uint8_t have = st.Have(page.block_index, page.layer); have != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), have == State::kPending
                                  ? "duplicate page (twice in one batch)"
                                  : "duplicate page (already installed)"));
  }
  const Encoding want = page.sealed ? b.spec.encoding : Bf16();
  if (!(page.encoding == want)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), "format (encoding ", EncName(page.encoding),
                     ") of a ", page.sealed ? "sealed" : "window",
                     " page differs from the expected ", EncName(want)));
  }
  const size_t want_bytes = st.BytesOf(want, seq.shape);
  if (bytes != want_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where(), "data has ", bytes,
                                                   " bytes; a ", EncName(want),
                                                   " page has ", want_bytes));
  }
  if (page.num_tokens != b.spec.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "num_tokens=", page.num_tokens,
        " differs from the plan's num_tokens=", b.spec.num_tokens));
  }
  if (page.sealed || IsBf16(b.spec.encoding)) return b.target[page.layer];
  if (b.window[page.layer] == nullptr) {
    absl::StatusOr<Page*> w = store_->allocator_->Allocate(
        Format::kBF16, want_bytes, PageUse::kWindow);
    if (!w.ok()) {
      return absl::Status(
          w.status().code(),
          absl::StrCat(where(), "window page: ", w.status().message()));
    }
    b.window[page.layer] = *w;
    st.result.page_bytes += want_bytes;
  }
  return b.window[page.layer];
}

void ImportSession::Installed(const PageRef& page) {
  State& st = *state_;
  Sequence& seq = *st.seq;
  Block& b = seq.blocks[page.block_index];
  if (page.sealed) MarkSealed(b.target[page.layer], page.crc32c);
  st.Have(page.block_index, page.layer) = page.sealed ? 1 : 2;
  Counted(page.layer, page.encoding, 1);
}

void ImportSession::Counted(uint32_t layer, const Encoding& encoding,
                            uint32_t n) {
  State& st = *state_;
  st.result.pages += n;
  st.result.wire_bytes += uint64_t{n} * st.BytesOf(encoding, st.seq->shape);
  st.result.bf16_bytes += uint64_t{n} * st.bf16_bytes;
  st.layer_pages[layer] += n;
  if (st.layer_pages[layer] == st.pages_per_layer) {
    st.result.layer_done_seconds[layer] =
        absl::ToDoubleSeconds(absl::Now() - st.start);
  }
}

// Install and InstallShared verified the bytes against `crc32c`. The
// import's own pages are reached by no other thread until Commit publishes
// the sequence (under the store's mutex), so seal_mu is not taken.
void ImportSession::MarkSealed(Page* page,
                               uint32_t crc32c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  page->encoded = true;
  page->crc_known = true;
  page->crc32c = crc32c;
}

absl::Status ImportSession::InstallOnce(const TransferPage& page) {
  Sequence& seq = *state_->seq;
  absl::MutexLock lock(&seq.mu);
  auto where = [&] { return Where(page.block_index, page.layer); };
  if (page.shared) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "a shared page (arena_offset) on the stream path"));
  }
  // Plan checks, then the CRC32C before anything is copied.
  const uint32_t crc = Crc32c(page.data.data(), page.data.size());
  const PageRef ref = RefOf(page);
  TRIAX_ASSIGN_OR_RETURN(Page * dst, Destination(ref, page.data.size(), where));
  if (crc != page.crc32c) {
    return absl::DataLossError(absl::StrCat(
        where(),
        absl::StrFormat("CRC32C of the received data is 0x%08x, the source "
                        "sent 0x%08x; the page is not installed",
                        crc, page.crc32c)));
  }
  TRIAX_RETURN_IF_ERROR(store_->device_->CopyFromHost(
      dst->data, page.data.data(), page.data.size()));
  Installed(ref);
  return absl::OkStatus();
}

absl::StatusOr<ImportResult> ImportSession::Commit() {
  State& st = *state_;
  if (st.committed) return st.result;
  TRIAX_RETURN_IF_ERROR(FinishShared());
  const absl::Time commit_start = absl::Now();
  Sequence& seq = *st.seq;
  const std::string what =
      absl::StrCat("import of sequence_id=", Quote(plan_.sequence_id), " from ",
                   plan_.source, ": ");
  {
    absl::ReaderMutexLock data(&store_->data_mu_);
    absl::MutexLock lock(&seq.mu);
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      uint32_t sealed = 0;
      bool window_seen = false;
      for (size_t i = 0; i < seq.blocks.size(); ++i) {
        const Block& b = seq.blocks[i];
        const uint8_t have = st.Have(static_cast<uint32_t>(i), l);
        if (!b.spec.evicted && have == 0) {
          return absl::DataLossError(
              absl::StrCat(what, store_internal::BlockName(b.spec), " layer ",
                           l, " never arrived (the stream ended without it)"));
        }
        const bool is_sealed = b.spec.evicted || have == 1;
        if (is_sealed && window_seen) {
          return absl::InvalidArgumentError(absl::StrCat(
              what, "layer ", l, ": ", store_internal::BlockName(b.spec),
              " is sealed (or evicted) after a block still in the window; "
              "sealed blocks must be a prefix"));
        }
        if (is_sealed) {
          sealed += 1;
        } else {
          window_seen = true;
        }
      }
      seq.sealed[l] = sealed;
      seq.written[l] = seq.planned;
    }
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      if (absl::Status s = store_->SealReady(seq, l); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat(what, s.message()));
      }
    }
    absl::MutexLock store_lock(&store_->mu_);
    if (store_->sequences_.contains(plan_.sequence_id)) {
      return absl::AlreadyExistsError(
          absl::StrCat(what, "sequence_id=", Quote(plan_.sequence_id),
                       " was created on this worker meanwhile"));
    }
    store_->sequences_.emplace(plan_.sequence_id, st.seq);
    store_->importing_.erase(plan_.sequence_id);
    st.committed = true;
  }
  st.result.commit_seconds = absl::ToDoubleSeconds(absl::Now() - commit_start);
  return st.result;
}

}  // namespace triax::worker
