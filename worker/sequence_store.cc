// SequenceStore, the sequence-wide part: looking sequences up and the
// preamble every per-sequence operation starts with (LockOwned), plan
// validation, installing and extending plans (AllocatePages), Free and Drop,
// and the inventory and introspection calls. The other operations live in
// the store_*.cc files (sequence_store_internal.h lists them).
#include "worker/sequence_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "worker/sequence_store_internal.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;
using store_internal::Block;
using store_internal::CheckOwner;
using store_internal::IsBf16;
using store_internal::ValidatePlan;

uint32_t RetryAfterMs(const absl::Status& status) {
  auto p = status.GetPayload(kRetryAfterPayload);
  uint32_t ms = 0;
  if (!p.has_value() || !absl::SimpleAtoi(std::string(*p), &ms)) return 0;
  return ms;
}

namespace store_internal {

std::string EncName(const Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

absl::StatusOr<Encoding> BlockEncoding(const Device& device, const BlockSpec& b,
                                       absl::string_view field,
                                       const PageShape& shape) {
  TRIAX_RETURN_IF_ERROR(ValidateEncodingFields(b.encoding, field));
  const Encoding& e = b.encoding;
  if (const char* why = kernels::ValidateEncoding(e, shape); why != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": encoding ", EncName(e),
        " is invalid for block_tokens=", shape.tokens,
        " n_kv_heads=", shape.heads, " head_dim=", shape.head_dim, ": ", why));
  }
  if (absl::Status s = device.SupportsEncoding(e, shape); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat(field, ": encoding ", EncName(e),
                                     " is not supported by the ", device.Name(),
                                     " backend: ", s.message()));
  }
  return e;
}

absl::Status ValidatePlan(const Device& device,
                          absl::Span<const BlockSpec> blocks,
                          uint32_t block_tokens, const PageShape& shape) {
  if (blocks.empty()) {
    return absl::InvalidArgumentError("blocks is empty");
  }
  uint64_t next = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockSpec& b = blocks[i];
    if (b.index != i) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].index=", b.index, " must be ", i));
    }
    if (b.first_token != next) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].first_token=", b.first_token,
                       " must be ", next, " (blocks are contiguous)"));
    }
    if (b.num_tokens < 1 || b.num_tokens > block_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].num_tokens=", b.num_tokens,
                       " is outside 1..block_tokens=", block_tokens));
    }
    TRIAX_RETURN_IF_ERROR(
        BlockEncoding(device, b, absl::StrCat("blocks[", i, "]"), shape)
            .status());
    if (static_cast<int>(b.tier) < 0 || static_cast<int>(b.tier) > 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].tier=", static_cast<int>(b.tier),
                       " is not a tier (0/1 device, 2 host, 3 disk)"));
    }
    next += b.num_tokens;
  }
  return absl::OkStatus();
}

}  // namespace store_internal

namespace {

absl::Status ValidateBlockTokens(uint32_t block_tokens) {
  if (block_tokens < 1 || block_tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tokens=", block_tokens, " is outside 1..4096"));
  }
  return absl::OkStatus();
}

std::string ShapeMismatch(const ModelShape& want, const ModelShape& have) {
  if (want.n_layers != have.n_layers) {
    return absl::StrCat("model.n_layers=", want.n_layers,
                        " differs from the installed ", have.n_layers);
  }
  if (want.n_kv_heads != have.n_kv_heads) {
    return absl::StrCat("model.n_kv_heads=", want.n_kv_heads,
                        " differs from the installed ", have.n_kv_heads);
  }
  if (want.n_q_heads != have.n_q_heads) {
    return absl::StrCat("model.n_q_heads=", want.n_q_heads,
                        " differs from the installed ", have.n_q_heads);
  }
  if (want.head_dim != have.head_dim) {
    return absl::StrCat("model.head_dim=", want.head_dim,
                        " differs from the installed ", have.head_dim);
  }
  return "";
}

}  // namespace

SequenceStore::SequenceStore(Device* device, PageAllocator* allocator,
                             StoreOptions options)
    : device_(device),
      allocator_(allocator),
      options_(options),
      prefetch_(options.prefetch_thread) {}

SequenceStore::~SequenceStore() {
  // Queued restores hold sequences: they go before the pages are released.
  prefetch_.Stop();
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(sequences_);
  }
  for (auto& [id, seq] : all) {
    absl::MutexLock seq_lock(&seq->mu);
    ReleaseAll(*seq);
  }
}

// ---------------------------------------------------------------------------
// Lookup and the per-sequence preamble

absl::StatusOr<std::shared_ptr<SequenceStore::Sequence>> SequenceStore::Lookup(
    absl::string_view sequence_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id=", Quote(sequence_id),
                                            " is not on this worker"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<SequenceStore::Sequence>>
SequenceStore::LookupOwned(absl::string_view tenant_id,
                           absl::string_view sequence_id) const {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", sequence_id));
  return Lookup(sequence_id);
}

absl::StatusOr<SequenceStore::LockedSequence> SequenceStore::LockOwned(
    std::shared_ptr<Sequence> seq, absl::string_view tenant_id) {
  LockedSequence locked(std::move(seq));
  TRIAX_RETURN_IF_ERROR(CheckOwner(*locked, tenant_id));
  return locked;
}

absl::StatusOr<SequenceStore::LockedSequence> SequenceStore::LockOwned(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::FunctionRef<absl::Status()> check_args) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq,
                         LookupOwned(tenant_id, sequence_id));
  TRIAX_RETURN_IF_ERROR(check_args());
  return LockOwned(std::move(seq), tenant_id);
}

absl::StatusOr<SequenceStore::LockedSequence> SequenceStore::LockOwned(
    absl::string_view tenant_id, absl::string_view sequence_id) {
  return LockOwned(tenant_id, sequence_id, [] { return absl::OkStatus(); });
}

// ---------------------------------------------------------------------------
// AllocatePages

absl::Status SequenceStore::CheckShape(const ModelShape& model,
                                       uint32_t block_tokens) const {
  TRIAX_RETURN_IF_ERROR(ValidateModelShape(model));
  TRIAX_RETURN_IF_ERROR(ValidateBlockTokens(block_tokens));
  const PageShape shape = PageShapeOf(model, block_tokens);
  if (absl::Status s =
          device_->SupportsAttention(shape, static_cast<int>(model.n_q_heads));
      !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("model n_q_heads=", model.n_q_heads,
                               " n_kv_heads=", model.n_kv_heads, " head_dim=",
                               model.head_dim, " block_tokens=", block_tokens,
                               " is not supported by the ", device_->Name(),
                               " backend: ", s.message()));
  }
  // Window pages are BF16, the largest encoding: its page must fit a frame.
  if (const size_t bf16 = kernels::PageBytes(Format::kBF16, shape);
      bf16 > allocator_->frame_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tokens=", block_tokens, " with n_kv_heads=", model.n_kv_heads,
        " head_dim=", model.head_dim, " makes BF16 pages of ", bf16,
        " bytes, larger than this worker's frame_bytes ",
        allocator_->frame_bytes(),
        " (--frame_kb); use smaller blocks or a larger --frame_kb"));
  }
  return absl::OkStatus();
}

absl::StatusOr<AllocateResult> SequenceStore::AllocatePagesOnce(
    absl::string_view tenant_id, absl::string_view sequence_id,
    const ModelShape& model, uint32_t block_tokens,
    absl::Span<const BlockSpec> blocks, std::optional<uint32_t> window_tokens) {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", sequence_id));
  TRIAX_RETURN_IF_ERROR(CheckShape(model, block_tokens));
  const PageShape shape = PageShapeOf(model, block_tokens);
  TRIAX_RETURN_IF_ERROR(ValidatePlan(*device_, blocks, block_tokens, shape));

  for (;;) {
    absl::StatusOr<std::shared_ptr<Sequence>> existing = Lookup(sequence_id);
    if (existing.ok()) {
      Sequence& seq = **existing;
      absl::MutexLock lock(&seq.mu);
      if (seq.freed) continue;  // freed meanwhile: install it afresh
      if (window_tokens.has_value() && *window_tokens != seq.window_tokens &&
          seq.tenant == tenant_id) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence_id=", Quote(seq.id), ": window_tokens=", *window_tokens,
            " differs from the installed ", seq.window_tokens,
            " (fixed by the first AllocatePages)"));
      }
      return Extend(seq, tenant_id, model, block_tokens, blocks);
    }
    auto fresh = std::make_shared<Sequence>();
    fresh->id = std::string(sequence_id);
    absl::StatusOr<AllocateResult> result;
    {
      absl::MutexLock lock(&fresh->mu);
      fresh->tenant = std::string(tenant_id);
      fresh->model = model;
      fresh->block_tokens = block_tokens;
      fresh->window_tokens = window_tokens.value_or(options_.window_tokens);
      fresh->shape = PageShapeOf(model, block_tokens);
      fresh->written.assign(model.n_layers, 0);
      fresh->sealed.assign(model.n_layers, 0);
      result = Extend(*fresh, tenant_id, model, block_tokens, blocks);
    }
    if (!result.ok()) return result.status();
    {
      absl::MutexLock lock(&mu_);
      if (!sequences_.contains(sequence_id)) {
        sequences_.emplace(std::string(sequence_id), fresh);
        return result;
      }
    }
    // Another call installed the same id first: undo ours and extend theirs.
    absl::MutexLock lock(&fresh->mu);
    ReleaseAll(*fresh);
  }
}

absl::StatusOr<AllocateResult> SequenceStore::Extend(
    Sequence& seq, absl::string_view tenant_id, const ModelShape& model,
    uint32_t block_tokens, absl::Span<const BlockSpec> blocks) {
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  if (std::string m = ShapeMismatch(model, seq.model); !m.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id=", Quote(seq.id), ": ", m));
  }
  if (block_tokens != seq.block_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id=", Quote(seq.id), ": block_tokens=", block_tokens,
        " differs from the installed ", seq.block_tokens));
  }
  const size_t old = seq.blocks.size();
  if (blocks.size() < old) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id=", Quote(seq.id), ": the plan has ", blocks.size(),
        " blocks but ", old, " are installed; plans only grow"));
  }
  for (size_t i = 0; i < old; ++i) {
    // The installed encoding wins (see the header: Demote may have changed
    // it after the caller fetched its plan).
    const BlockSpec& have = seq.blocks[i].spec;
    const BlockSpec& want = blocks[i];
    if (want.lineage_id != have.lineage_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence_id=", Quote(seq.id), ": blocks[", i,
          "].lineage_id=", want.lineage_id,
          " mismatches the installed block's lineage_id=", have.lineage_id));
    }
    const bool last = i + 1 == old;
    if (want.num_tokens < have.num_tokens ||
        (!last && want.num_tokens != have.num_tokens)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence_id=", Quote(seq.id), ": blocks[", i,
          "].num_tokens=", want.num_tokens, " mismatches the installed ",
          have.num_tokens, last ? " (the last block may only grow)" : ""));
    }
  }
  for (size_t i = old; i < blocks.size(); ++i) {
    if (blocks[i].evicted ||
        static_cast<int>(blocks[i].tier) > static_cast<int>(Tier::kDevice)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks[", i, "] (lineage_id=", blocks[i].lineage_id,
          ") is not installed on this worker but the plan names it ",
          blocks[i].evicted
              ? "evicted"
              : absl::StrCat("in tier ", static_cast<int>(blocks[i].tier)),
          "; only installed blocks are spilled or evicted"));
    }
  }
  bool grow = false;  // the last installed block's num_tokens grows
  Encoding grow_enc;
  if (old > 0 &&
      blocks[old - 1].num_tokens > seq.blocks[old - 1].spec.num_tokens) {
    Block& last = seq.blocks[old - 1];
    if (!last.resident()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence_id=", Quote(seq.id), ": blocks[", old - 1,
          "] (lineage_id=", last.spec.lineage_id, ") is ",
          last.spec.evicted ? "evicted"
                            : absl::StrCat("spilled to the ",
                                           TierLabel(last.spec.tier), " tier"),
          " and cannot grow to num_tokens=", blocks[old - 1].num_tokens));
    }
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      const int refs = allocator_->RefCount(last.target[l]);
      if (refs > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence_id=", Quote(seq.id), ": blocks[", old - 1,
            "] (lineage_id=", last.spec.lineage_id, ") is shared by ", refs,
            " sequences and cannot grow to num_tokens=",
            blocks[old - 1].num_tokens));
      }
    }
    grow = true;
    grow_enc = last.spec.encoding;
  }

  // Reserve everything first so a shortage changes nothing.
  std::vector<Page*> reserved;
  uint64_t new_bytes = 0;
  uint64_t needed_pages = 0, needed_bytes = 0;
  for (size_t i = old; i < blocks.size(); ++i) {
    needed_pages += seq.model.n_layers;
    needed_bytes +=
        seq.model.n_layers * kernels::PageBytes(blocks[i].encoding, seq.shape);
  }
  auto undo = [&] {
    for (Page* p : reserved) allocator_->Unref(p);
  };
  std::vector<std::vector<Page*>> new_targets;
  for (size_t i = old; i < blocks.size(); ++i) {
    const Encoding e = blocks[i].encoding;
    const size_t bytes = kernels::PageBytes(e, seq.shape);
    std::vector<Page*> pages;
    if (absl::Status s = allocator_->AllocateMany(e, bytes, PageUse::kTarget,
                                                  seq.model.n_layers, &pages);
        !s.ok()) {
      undo();
      return absl::Status(
          s.code(),
          absl::StrCat("AllocatePages sequence_id=", Quote(seq.id), " needs ",
                       needed_pages, " new pages (", needed_bytes,
                       " bytes) for blocks ", old, "..", blocks.size() - 1,
                       " x ", seq.model.n_layers, " layers; ", s.message()));
    }
    reserved.insert(reserved.end(), pages.begin(), pages.end());
    new_bytes += bytes * pages.size();
    new_targets.push_back(std::move(pages));
  }
  // A sealed last block that grows goes back to the window (non-BF16 blocks
  // need a window page for that).
  std::vector<Page*> unseal_windows(seq.model.n_layers, nullptr);
  if (grow && !IsBf16(grow_enc)) {
    const size_t wbytes = kernels::PageBytes(Format::kBF16, seq.shape);
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      if (seq.sealed[l] != old) continue;
      absl::StatusOr<Page*> p =
          allocator_->Allocate(Format::kBF16, wbytes, PageUse::kWindow);
      if (!p.ok()) {
        undo();
        return absl::Status(
            p.status().code(),
            absl::StrCat("AllocatePages sequence_id=", Quote(seq.id),
                         " growing blocks[", old - 1, "] needs a window page; ",
                         p.status().message()));
      }
      reserved.push_back(*p);
      unseal_windows[l] = *p;
    }
  }

  // Commit.
  if (grow) {
    Block& last = seq.blocks[old - 1];
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      if (seq.sealed[l] != old) continue;
      Page* t = last.target[l];
      if (unseal_windows[l] != nullptr) {
        std::vector<uint16_t> k, v;
        TRIAX_RETURN_IF_ERROR(PageToBf16(last.spec.encoding, seq.shape, t->data,
                                         last.spec.num_tokens, &k, &v));
        TRIAX_RETURN_IF_ERROR(device_->WriteBf16Tokens(
            seq.shape, k.data(), v.data(), 0, last.spec.num_tokens,
            unseal_windows[l]->data));
        last.window[l] = unseal_windows[l];
      }
      {
        absl::MutexLock seal_lock(&t->seal_mu);
        t->encoded = false;
        t->crc_known = false;
      }
      seq.sealed[l] -= 1;
    }
    seq.planned += blocks[old - 1].num_tokens - last.spec.num_tokens;
    last.spec.num_tokens = blocks[old - 1].num_tokens;
  }
  for (size_t i = old; i < blocks.size(); ++i) {
    Block b;
    b.spec = blocks[i];
    b.spec.tier = Tier::kDevice;  // kUnspecified in a plan means the device
    b.target = std::move(new_targets[i - old]);
    b.window.assign(seq.model.n_layers, nullptr);
    seq.planned += b.spec.num_tokens;
    seq.blocks.push_back(std::move(b));
  }
  return AllocateResult{needed_pages, new_bytes};
}

// ---------------------------------------------------------------------------
// Free, inventory, introspection

FreeResult SequenceStore::ReleaseAll(Sequence& seq)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  FreeResult r;
  // Every page's reference dropped under one allocator lock.
  std::vector<Page*> pages;
  for (Block& b : seq.blocks) {
    if (b.spec.tier == Tier::kHost || b.spec.tier == Tier::kDisk) {
      options_.tiers->Release(&b.spilled);
    }
    for (std::vector<Page*>* held : {&b.target, &b.window}) {
      for (Page*& p : *held) {
        if (p == nullptr) continue;
        pages.push_back(p);
        p = nullptr;
      }
    }
  }
  r.pages_freed = allocator_->UnrefAll(pages, &r.bytes_freed);
  seq.blocks.clear();
  return r;
}

FreeResult SequenceStore::Retire(const std::shared_ptr<Sequence>& seq) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(seq->id);
    if (it != sequences_.end() && it->second == seq) sequences_.erase(it);
  }
  absl::MutexLock lock(&seq->mu);
  seq->written_cv.SignalAll();
  return ReleaseAll(*seq);
}

absl::StatusOr<FreeResult> SequenceStore::Free(absl::string_view tenant_id,
                                               absl::string_view sequence_id) {
  std::shared_ptr<Sequence> seq;
  {
    TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                           LockOwned(tenant_id, sequence_id));
    locked->freed = true;
    seq = locked.shared();
  }
  return Retire(seq);
}

absl::StatusOr<FreeResult> SequenceStore::Drop(absl::string_view sequence_id) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Lookup(sequence_id));
  {
    absl::MutexLock lock(&seq->mu);
    if (seq->freed) {
      return absl::NotFoundError(absl::StrCat(
          "sequence_id=", Quote(sequence_id), " is not on this worker"));
    }
    seq->freed = true;
  }
  return Retire(seq);
}

InventorySnapshot SequenceStore::Inventory() const {
  InventorySnapshot inv;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, seq] : sequences_) inv.sequence_ids.push_back(id);
  }
  std::sort(inv.sequence_ids.begin(), inv.sequence_ids.end());
  const AllocatorStats s = allocator_->Stats();
  inv.capacity_bytes = s.capacity_bytes;
  inv.used_bytes = s.used_bytes;
  inv.window_bytes = s.window.bytes;
  inv.formats = s.target;
  inv.encodings = s.by_encoding;
  inv.arena = s;
  if (options_.tiers != nullptr) {
    inv.host = options_.tiers->Usage(Tier::kHost);
    inv.disk = options_.tiers->Usage(Tier::kDisk);
  }
  inv.spills = spills_.load();
  inv.restores = restores_.load();
  inv.checksum_failures = checksum_failures_.load();
  inv.evictions = evictions_.load();
  if (absl::Status h = device_->Health(); !h.ok()) {
    inv.device_error = std::string(h.message());
  }
  return inv;
}

absl::StatusOr<SequenceSnapshot> SequenceStore::Describe(
    absl::string_view sequence_id) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Lookup(sequence_id));
  absl::MutexLock lock(&seq->mu);
  SequenceSnapshot s;
  s.tenant_id = seq->tenant;
  s.model = seq->model;
  s.block_tokens = seq->block_tokens;
  s.window_tokens = seq->window_tokens;
  for (const Block& b : seq->blocks) s.blocks.push_back(b.spec);
  s.written = seq->written;
  s.sealed = seq->sealed;
  s.window_pages.assign(seq->model.n_layers, 0);
  for (const Block& b : seq->blocks) {
    for (uint32_t l = 0; l < seq->model.n_layers; ++l) {
      if (b.window[l] != nullptr) s.window_pages[l] += 1;
    }
  }
  s.planned_tokens = seq->planned;
  return s;
}

absl::StatusOr<Page*> SequenceStore::TargetPage(absl::string_view sequence_id,
                                                uint32_t block,
                                                uint32_t layer) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Lookup(sequence_id));
  absl::MutexLock lock(&seq->mu);
  if (block >= seq->blocks.size() || layer >= seq->model.n_layers) {
    return absl::OutOfRangeError(absl::StrCat("block=", block, " layer=", layer,
                                              " is outside the sequence"));
  }
  return seq->blocks[block].target[layer];
}

}  // namespace triax::worker
