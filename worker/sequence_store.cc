#include "worker/sequence_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;

uint32_t RetryAfterMs(const absl::Status& status) {
  auto p = status.GetPayload(kRetryAfterPayload);
  uint32_t ms = 0;
  if (!p.has_value() || !absl::SimpleAtoi(std::string(*p), &ms)) return 0;
  return ms;
}

struct SequenceStore::Block {
  BlockSpec spec;  // encoding fields track `enc`
  Encoding enc;
  std::vector<Page*> target;  // per layer; null only while being built
  std::vector<Page*> window;  // per layer; BF16 staging, null when none
  // kDevice: target pages hold the block. kHost/kDisk: `spilled` holds it
  // and target pages are null. Evicted: tier kUnspecified, no pages at all.
  Tier tier = Tier::kDevice;
  bool evicted = false;
  SpilledBlock spilled;
  bool prefetch_queued = false;  // a background restore is queued
  absl::Status restore_error;    // why the last background restore failed
  uint64_t end() const { return spec.first_token + spec.num_tokens; }
  bool resident() const { return tier == Tier::kDevice; }
};

// Every field but `id` is guarded by `mu`; helpers taking a Sequence& run
// with its mutex held.
struct SequenceStore::Sequence {
  absl::Mutex mu;
  std::string id;
  std::string tenant ABSL_GUARDED_BY(mu);
  ModelShape model ABSL_GUARDED_BY(mu);
  uint32_t block_tokens ABSL_GUARDED_BY(mu) = 0;
  uint32_t window_tokens ABSL_GUARDED_BY(mu) = 0;
  PageShape shape ABSL_GUARDED_BY(mu);
  std::vector<Block> blocks ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> written ABSL_GUARDED_BY(mu);  // per layer
  std::vector<uint32_t> sealed ABSL_GUARDED_BY(mu);   // per layer
  uint64_t planned ABSL_GUARDED_BY(mu) = 0;
  bool freed ABSL_GUARDED_BY(mu) = false;
};

namespace {

bool IsBf16(const Encoding& e) {
  return e.k == Format::kBF16 && e.v == Format::kBF16;
}

std::string EncName(const Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

// The validated encoding of `b` for pages of `shape`, refused also when the
// backend cannot run it (Device::SupportsEncoding); `field` names the block
// in messages (e.g. "blocks[3]").
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

void FloatsToBf16(const std::vector<float>& in, std::vector<uint16_t>* out) {
  out->resize(in.size());
  for (size_t i = 0; i < in.size(); ++i)
    (*out)[i] = kernels::FloatToBf16(in[i]);
}

// Index of the block holding token `t` (blocks are contiguous and sorted).
template <typename Blocks>
size_t BlockOf(const Blocks& blocks, uint64_t t) {
  auto it = std::partition_point(blocks.begin(), blocks.end(),
                                 [t](const auto& b) { return b.end() <= t; });
  return static_cast<size_t>(it - blocks.begin());
}

}  // namespace

SequenceStore::SequenceStore(Device* device, PageAllocator* allocator,
                             StoreOptions options)
    : device_(device), allocator_(allocator), options_(options) {
  if (options_.prefetch_thread) {
    prefetch_thread_ = std::thread([this] { PrefetchLoop(); });
  }
}

SequenceStore::~SequenceStore() {
  {
    absl::MutexLock lock(&prefetch_mu_);
    prefetch_stop_ = true;
  }
  if (prefetch_thread_.joinable()) prefetch_thread_.join();
  {
    absl::MutexLock lock(&prefetch_mu_);
    prefetch_queue_.clear();
  }
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

namespace {
// Checks, with seq.mu held, that the sequence is still live and the caller's.
template <typename Seq>
absl::Status CheckOwner(const Seq& seq, absl::string_view tenant_id) {
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
}  // namespace

// ---------------------------------------------------------------------------
// AllocatePages

absl::StatusOr<AllocateResult> SequenceStore::AllocatePages(
    absl::string_view tenant_id, absl::string_view sequence_id,
    const ModelShape& model, uint32_t block_tokens,
    absl::Span<const BlockSpec> blocks, std::optional<uint32_t> window_tokens) {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("sequence_id", sequence_id));
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
          last.evicted
              ? "evicted"
              : absl::StrCat("spilled to the ", TierLabel(last.tier), " tier"),
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
    grow_enc = last.enc;
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
    for (uint32_t l = 0; l < seq.model.n_layers; ++l) {
      absl::StatusOr<Page*> p =
          allocator_->Allocate(e, bytes, PageUse::kTarget);
      if (!p.ok()) {
        undo();
        return absl::Status(
            p.status().code(),
            absl::StrCat("AllocatePages sequence_id=", Quote(seq.id), " needs ",
                         needed_pages, " new pages (", needed_bytes,
                         " bytes) for blocks ", old, "..", blocks.size() - 1,
                         " x ", seq.model.n_layers, " layers; ",
                         p.status().message()));
      }
      reserved.push_back(*p);
      pages.push_back(*p);
      new_bytes += bytes;
    }
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
        TRIAX_RETURN_IF_ERROR(PageToBf16(last.enc, seq.shape, t->data,
                                         last.spec.num_tokens, &k, &v));
        TRIAX_RETURN_IF_ERROR(device_->WriteBf16Tokens(
            seq.shape, k.data(), v.data(), 0, last.spec.num_tokens,
            unseal_windows[l]->data));
        last.window[l] = unseal_windows[l];
      }
      {
        absl::MutexLock seal_lock(&t->seal_mu);
        t->encoded = false;
      }
      seq.sealed[l] -= 1;
    }
    seq.planned += blocks[old - 1].num_tokens - last.spec.num_tokens;
    last.spec.num_tokens = blocks[old - 1].num_tokens;
  }
  for (size_t i = old; i < blocks.size(); ++i) {
    Block b;
    b.spec = blocks[i];
    b.enc = blocks[i].encoding;
    b.target = std::move(new_targets[i - old]);
    b.window.assign(seq.model.n_layers, nullptr);
    seq.planned += b.spec.num_tokens;
    seq.blocks.push_back(std::move(b));
  }
  return AllocateResult{needed_pages, new_bytes};
}

// ---------------------------------------------------------------------------
// Writes and sealing

absl::Status SequenceStore::PageToBf16(const Encoding& encoding,
                                       const PageShape& shape,
                                       const uint8_t* page, uint32_t tokens,
                                       std::vector<uint16_t>* k,
                                       std::vector<uint16_t>* v) {
  const size_t n = static_cast<size_t>(tokens) * shape.heads * shape.head_dim;
  std::vector<float> kf(n), vf(n);
  TRIAX_RETURN_IF_ERROR(device_->DecodePage(
      encoding, shape, page, static_cast<int>(tokens), kf.data(), vf.data()));
  FloatsToBf16(kf, k);
  FloatsToBf16(vf, v);
  return absl::OkStatus();
}

absl::Status SequenceStore::WriteLocked(Sequence& seq, const KvWrite& c,
                                        absl::string_view p) {
  if (c.layer >= seq.model.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        p, "layer=", c.layer, " is >= model.n_layers=", seq.model.n_layers));
  }
  if (c.num_tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(p, "num_tokens=0"));
  }
  if (c.dtype != static_cast<int>(KvDtype::kF32) &&
      c.dtype != static_cast<int>(KvDtype::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat(p, "dtype=", c.dtype, " is not F32 (1) or BF16 (2)"));
  }
  const size_t elt = c.dtype == static_cast<int>(KvDtype::kF32) ? 4 : 2;
  const size_t values = static_cast<size_t>(c.num_tokens) *
                        seq.model.n_kv_heads * seq.model.head_dim;
  for (const auto& [name, bytes] :
       {std::pair<const char*, size_t>{"k", c.k.size()}, {"v", c.v.size()}}) {
    if (bytes != values * elt) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, name, " has ", bytes, " bytes; expected ", values * elt,
          " (num_tokens=", c.num_tokens, " x n_kv_heads=", seq.model.n_kv_heads,
          " x head_dim=", seq.model.head_dim, " x ", elt, " bytes)"));
    }
  }
  const uint64_t written = seq.written[c.layer];
  if (c.first_token != written) {
    return absl::FailedPreconditionError(
        absl::StrCat(p, "first_token=", c.first_token, " but layer ", c.layer,
                     " has ", written,
                     " written tokens; writes must continue at the written "
                     "length (rewrites are not supported)"));
  }
  const uint64_t end = c.first_token + c.num_tokens;
  if (end > seq.planned) {
    return absl::OutOfRangeError(
        absl::StrCat(p, "first_token=", c.first_token,
                     " num_tokens=", c.num_tokens, " ends at ", end,
                     ", past the planned total of ", seq.planned, " tokens"));
  }

  std::vector<uint16_t> k(values), v(values);
  if (elt == 2) {
    std::memcpy(k.data(), c.k.data(), values * 2);
    std::memcpy(v.data(), c.v.data(), values * 2);
  } else {
    for (size_t i = 0; i < values; ++i) {
      float fk, fv;
      std::memcpy(&fk, c.k.data() + 4 * i, 4);
      std::memcpy(&fv, c.v.data() + 4 * i, 4);
      k[i] = kernels::FloatToBf16(fk);
      v[i] = kernels::FloatToBf16(fv);
    }
  }

  // Window pages first, so a shortage writes nothing.
  const size_t first_block = BlockOf(seq.blocks, c.first_token);
  const size_t last_block = BlockOf(seq.blocks, end - 1);
  std::vector<Page*> fresh;
  for (size_t b = first_block; b <= last_block; ++b) {
    Block& blk = seq.blocks[b];
    if (IsBf16(blk.enc) || blk.window[c.layer] != nullptr) continue;
    absl::StatusOr<Page*> page = allocator_->Allocate(
        Format::kBF16, kernels::PageBytes(Format::kBF16, seq.shape),
        PageUse::kWindow);
    if (!page.ok()) {
      for (Page* q : fresh) allocator_->Unref(q);
      for (size_t j = first_block; j < b; ++j) {
        Page*& w = seq.blocks[j].window[c.layer];
        if (std::find(fresh.begin(), fresh.end(), w) != fresh.end())
          w = nullptr;
      }
      return absl::Status(
          page.status().code(),
          absl::StrCat("sequence_id=", Quote(seq.id), " ", p, "layer=", c.layer,
                       " window page: ", page.status().message()));
    }
    fresh.push_back(*page);
    blk.window[c.layer] = *page;
  }

  const size_t stride =
      static_cast<size_t>(seq.shape.heads) * seq.shape.head_dim;
  for (size_t b = first_block; b <= last_block; ++b) {
    Block& blk = seq.blocks[b];
    const uint64_t from = std::max(c.first_token, blk.spec.first_token);
    const uint64_t to = std::min(end, blk.end());
    Page* page = IsBf16(blk.enc) ? blk.target[c.layer] : blk.window[c.layer];
    const size_t off = (from - c.first_token) * stride;
    TRIAX_RETURN_IF_ERROR(
        device_->WriteBf16Tokens(seq.shape, k.data() + off, v.data() + off,
                                 static_cast<int>(from - blk.spec.first_token),
                                 static_cast<int>(to - from), page->data));
  }
  seq.written[c.layer] = end;
  return SealReady(seq, c.layer);
}

absl::Status SequenceStore::SealReady(Sequence& seq, uint32_t layer) {
  while (seq.sealed[layer] < seq.blocks.size()) {
    Block& b = seq.blocks[seq.sealed[layer]];
    if (seq.written[layer] < b.end() + seq.window_tokens) break;
    Page* t = b.target[layer];
    {
      absl::MutexLock seal_lock(&t->seal_mu);
      if (!t->encoded && !IsBf16(b.enc)) {
        Page* w = b.window[layer];
        if (w == nullptr) {
          return absl::InternalError(
              absl::StrCat("sequence_id=", Quote(seq.id), " block ",
                           b.spec.index, " layer ", layer,
                           " has neither a window page nor an encoded "
                           "target page"));
        }
        // BF16 -> float -> BF16 is exact, so this is EncodePage of the
        // window's tokens, run where the pages live.
        DemoteJob job;
        job.from = Format::kBF16;
        job.src = w->data;
        job.num_tokens = static_cast<int>(b.spec.num_tokens);
        job.to = b.enc;
        job.dst = t->data;
        TRIAX_RETURN_IF_ERROR(
            device_->DemotePages(seq.shape, absl::MakeConstSpan(&job, 1)));
      }
      t->encoded = true;
    }
    if (b.window[layer] != nullptr) {
      allocator_->Unref(b.window[layer]);
      b.window[layer] = nullptr;
    }
    seq.sealed[layer] += 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SequenceStore::Write(absl::string_view tenant_id,
                                              absl::string_view sequence_id,
                                              const KvWrite& chunk) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq,
                         LookupOwned(tenant_id, sequence_id));
  absl::MutexLock lock(&seq->mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(*seq, tenant_id));
  TRIAX_RETURN_IF_ERROR(WriteLocked(*seq, chunk, ""));
  return chunk.num_tokens;
}

// ---------------------------------------------------------------------------
// Demotion

absl::StatusOr<DemoteResult> SequenceStore::Demote(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const BlockSpec> blocks) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq_ptr,
                         LookupOwned(tenant_id, sequence_id));
  if (blocks.empty()) {
    return absl::InvalidArgumentError("blocks is empty; name >= 1 block");
  }
  Sequence& seq = *seq_ptr;
  absl::MutexLock lock(&seq.mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  const uint32_t layers = seq.model.n_layers;

  // 1. Validate every entry before touching anything.
  struct Job {
    size_t block;
    Encoding enc;
  };
  std::vector<Job> jobs;
  std::vector<bool> named(seq.blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockSpec& want = blocks[i];
    if (want.index >= seq.blocks.size()) {
      return absl::NotFoundError(absl::StrCat(
          "blocks[", i, "].index=", want.index, " (lineage_id=",
          want.lineage_id, ") is not a block of sequence_id=", Quote(seq.id),
          ", which has ", seq.blocks.size(), " blocks"));
    }
    if (named[want.index]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks[", i, "].index=", want.index, " is named more than once"));
    }
    named[want.index] = true;
    const Block& b = seq.blocks[want.index];
    if (want.lineage_id != b.spec.lineage_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (index=", want.index,
          ") lineage_id=", want.lineage_id,
          " mismatches the installed block's lineage_id=", b.spec.lineage_id));
    }
    TRIAX_ASSIGN_OR_RETURN(
        Encoding enc,
        BlockEncoding(*device_, want, absl::StrCat("blocks[", i, "]"),
                      seq.shape));
    if (b.evicted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (index=", want.index, " lineage_id=",
          want.lineage_id, ") is evicted; evicted blocks cannot be demoted"));
    }
    if (!b.resident()) {
      return absl::FailedPreconditionError(
          absl::StrCat("blocks[", i, "] (index=", want.index,
                       " lineage_id=", want.lineage_id, ") is spilled to the ",
                       TierLabel(b.tier), " tier; Restore it before demoting"));
    }
    for (uint32_t l = 0; l < layers; ++l) {
      const int refs = allocator_->RefCount(b.target[l]);
      if (refs > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "blocks[", i, "] (index=", want.index,
            " lineage_id=", want.lineage_id, ") is shared by ", refs,
            " sequences (a fork); shared blocks cannot be demoted"));
      }
    }
    if (enc == b.enc) continue;  // already there: nothing to do
    jobs.push_back({want.index, enc});
  }

  // 2. Reserve every page the new state needs, all or nothing.
  struct Step {
    Page* target = nullptr;  // new target page
    Page* window = nullptr;  // new window page (BF16 block leaving BF16)
    bool sealed = false;
    uint32_t tokens = 0;  // tokens of the block written on this layer
  };
  std::vector<std::vector<Step>> steps(jobs.size(), std::vector<Step>(layers));
  std::vector<Page*> reserved;
  auto undo = [&] {
    for (Page* p : reserved) allocator_->Unref(p);
  };
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
      if (!st.sealed && IsBf16(b.enc) && !IsBf16(jobs[j].enc) &&
          st.tokens > 0) {
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
          allocator_->Allocate(jobs[j].enc, bytes, PageUse::kTarget);
      absl::StatusOr<Page*> w(static_cast<Page*>(nullptr));
      if (t.ok()) {
        reserved.push_back(*t);
        st.target = *t;
        if (!st.sealed && IsBf16(b.enc) && !IsBf16(jobs[j].enc) &&
            st.tokens > 0) {
          w = allocator_->Allocate(Format::kBF16, window_bytes,
                                   PageUse::kWindow);
          if (w.ok()) {
            reserved.push_back(*w);
            st.window = *w;
          }
        }
      }
      if (!t.ok() || !w.ok()) {
        undo();
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

  // 3. Fill the new pages; the old ones are untouched until every fill
  //    succeeded. Sealed pages are re-encoded in one DemotePages call.
  std::vector<DemoteJob> reencode;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Block& b = seq.blocks[jobs[j].block];
    for (uint32_t l = 0; l < layers; ++l) {
      if (!steps[j][l].sealed) continue;
      DemoteJob job;
      job.from = b.enc;
      job.src = b.target[l]->data;
      job.num_tokens = static_cast<int>(b.spec.num_tokens);
      job.to = jobs[j].enc;
      job.dst = steps[j][l].target->data;
      reencode.push_back(job);
    }
  }
  if (absl::Status s = device_->DemotePages(seq.shape, reencode); !s.ok()) {
    undo();
    return absl::Status(
        s.code(),
        absl::StrCat("Demote sequence_id=", Quote(seq.id), " re-encoding ",
                     reencode.size(), " sealed pages: ", s.message()));
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Block& b = seq.blocks[jobs[j].block];
    const Encoding& enc = jobs[j].enc;
    for (uint32_t l = 0; l < layers; ++l) {
      Step& st = steps[j][l];
      absl::Status s;
      if (st.sealed) {
        continue;
      } else if (IsBf16(enc)) {
        // The new target page is written straight from now on: move the
        // staged tokens into it (from the window, or the old BF16 target).
        const Page* from = IsBf16(b.enc) ? b.target[l] : b.window[l];
        if (from != nullptr && st.tokens > 0) {
          s = device_->CopyPage(st.target->data, from->data, window_bytes);
        }
      } else if (st.window != nullptr) {
        // Leaving BF16: the old target page's tokens move to a window page.
        s = device_->CopyPage(st.window->data, b.target[l]->data, window_bytes);
      }
      if (!s.ok()) {
        undo();
        return absl::Status(
            s.code(),
            absl::StrCat("Demote sequence_id=", Quote(seq.id), " block ",
                         jobs[j].block, " layer ", l, ": ", s.message()));
      }
    }
  }

  // 4. Commit: swap the pages in and free the old ones.
  DemoteResult result;
  for (size_t j = 0; j < jobs.size(); ++j) {
    Block& b = seq.blocks[jobs[j].block];
    const Encoding& enc = jobs[j].enc;
    for (uint32_t l = 0; l < layers; ++l) {
      Step& st = steps[j][l];
      result.bytes_delta += static_cast<int64_t>(st.target->bytes);
      if (st.window != nullptr) {
        result.bytes_delta += static_cast<int64_t>(st.window->bytes);
      }
      {
        absl::MutexLock seal_lock(&st.target->seal_mu);
        st.target->encoded = st.sealed;
      }
      Page* old_target = b.target[l];
      b.target[l] = st.target;
      const size_t old_bytes = old_target->bytes;
      if (allocator_->Unref(old_target)) {
        result.bytes_delta -= static_cast<int64_t>(old_bytes);
      }
      if (!st.sealed && IsBf16(enc) && b.window[l] != nullptr) {
        const size_t wb = b.window[l]->bytes;
        if (allocator_->Unref(b.window[l])) {
          result.bytes_delta -= static_cast<int64_t>(wb);
        }
        b.window[l] = nullptr;
      }
      if (st.window != nullptr) b.window[l] = st.window;
      result.pages_reencoded += 1;
    }
    b.enc = enc;
    const BlockSpec& want = *std::find_if(
        blocks.begin(), blocks.end(),
        [&](const BlockSpec& x) { return x.index == jobs[j].block; });
    b.spec.encoding = want.encoding;
  }
  return result;
}

// ---------------------------------------------------------------------------
// Attention and reads

// An item ready for the device: its query/output buffers, page list and
// per-query attended token counts.
struct SequenceStore::PreparedAttend {
  size_t item = 0;
  kernels::PageShape shape;
  int n_q_heads = 0;
  float scale = 0.f;
  std::vector<float> q, out;  // [num_queries][n_q_heads][head_dim]
  std::vector<kernels::PageRef> refs;
  std::vector<long> attend;  // per query
};

absl::Status SequenceStore::PrepareAttend(
    const std::shared_ptr<Sequence>& seq_ptr, absl::string_view tenant_id,
    const AttendSpec& spec,
    PreparedAttend* prep) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Sequence& seq = *seq_ptr;
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  const ModelShape& m = seq.model;
  if (spec.layer >= m.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer=", spec.layer, " is >= model.n_layers=", m.n_layers));
  }
  if (spec.num_queries == 0) {
    return absl::InvalidArgumentError("num_queries=0; must be >= 1");
  }
  const size_t qvalues =
      static_cast<size_t>(spec.num_queries) * m.n_q_heads * m.head_dim;
  if (spec.queries.size() != qvalues * 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries has ", spec.queries.size(), " bytes; expected ", qvalues * 4,
        " (num_queries=", spec.num_queries, " x n_q_heads=", m.n_q_heads,
        " x head_dim=", m.head_dim, " x 4 bytes float32)"));
  }
  if (!spec.positions.empty() && spec.positions.size() != spec.num_queries) {
    return absl::InvalidArgumentError(
        absl::StrCat("positions has ", spec.positions.size(),
                     " entries; expected 0 or num_queries=", spec.num_queries));
  }
  if (!std::isfinite(spec.scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale=", spec.scale, " is not finite"));
  }
  uint64_t after = seq.written[spec.layer];
  if (spec.append != nullptr) {
    if (spec.append->layer != spec.layer) {
      return absl::InvalidArgumentError(
          absl::StrCat("append.layer=", spec.append->layer,
                       " differs from layer=", spec.layer));
    }
    after += spec.append->num_tokens;
  }
  if (after == 0) {
    return absl::OutOfRangeError(absl::StrCat(
        "layer ", spec.layer, " has no written tokens to attend to"));
  }
  for (size_t i = 0; i < spec.positions.size(); ++i) {
    if (spec.positions[i] >= after) {
      return absl::OutOfRangeError(absl::StrCat(
          "positions[", i, "]=", spec.positions[i], " is not written: layer ",
          spec.layer, " has ", after, " tokens"));
    }
  }
  // Spilled blocks come back (or the call is refused) before the append, so
  // an UNAVAILABLE answer changes nothing and the retry can append again.
  uint64_t upto = after;
  if (!spec.positions.empty()) {
    upto = *std::max_element(spec.positions.begin(), spec.positions.end()) + 1;
  }
  TRIAX_RETURN_IF_ERROR(EnsureResident(seq_ptr, 0, upto));
  if (spec.append != nullptr) {
    TRIAX_RETURN_IF_ERROR(WriteLocked(seq, *spec.append, "append."));
  }

  const uint32_t layer = spec.layer;
  const uint64_t written = seq.written[layer];
  std::vector<kernels::PageRef>& refs = prep->refs;
  std::vector<const Block*> evicted;  // skipped; their positions still count
  for (size_t b = 0; b < seq.blocks.size(); ++b) {
    const Block& blk = seq.blocks[b];
    // Blocks past the last attended position may be spilled (only those up
    // to it were made resident) and are not read.
    if (blk.spec.first_token >= std::min(written, upto)) break;
    if (blk.evicted) {
      evicted.push_back(&blk);
      continue;
    }
    kernels::PageRef r;
    r.num_tokens = static_cast<int>(std::min<uint64_t>(
        blk.spec.num_tokens, written - blk.spec.first_token));
    if (b < seq.sealed[layer] || IsBf16(blk.enc)) {
      r.encoding = blk.enc;
      r.data = blk.target[layer]->data;
    } else {
      r.encoding = Format::kBF16;
      r.data = blk.window[layer]->data;
    }
    refs.push_back(r);
  }
  for (uint32_t i = 0; i < spec.num_queries; ++i) {
    const uint64_t through =
        spec.positions.empty() ? written : spec.positions[i] + 1;
    uint64_t skipped = 0;
    for (const Block* e : evicted) {
      if (e->spec.first_token >= through) break;
      skipped += std::min(e->end(), through) - e->spec.first_token;
    }
    if (skipped == through) {
      return absl::FailedPreconditionError(absl::StrCat(
          "query ", i, " at position ", through - 1,
          " has no tokens to attend to: every block up to it is evicted"));
    }
    prep->attend.push_back(static_cast<long>(through - skipped));
  }
  prep->shape = seq.shape;
  prep->n_q_heads = static_cast<int>(m.n_q_heads);
  prep->scale = spec.scale != 0.f
                    ? spec.scale
                    : 1.f / std::sqrt(static_cast<float>(m.head_dim));
  prep->q.resize(qvalues);
  std::memcpy(prep->q.data(), spec.queries.data(), qvalues * 4);
  prep->out.assign(qvalues, 0.f);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> SequenceStore::Attend(
    absl::string_view tenant_id, absl::string_view sequence_id,
    const AttendSpec& spec) {
  AttendBatchItem item;
  item.sequence_id = sequence_id;
  item.spec = spec;
  return std::move(AttendBatch(tenant_id, absl::MakeConstSpan(&item, 1))[0]);
}

std::vector<absl::StatusOr<std::vector<float>>> SequenceStore::AttendBatch(
    absl::string_view tenant_id,
    absl::Span<const AttendBatchItem> items) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<absl::StatusOr<std::vector<float>>> results(
      items.size(), absl::InternalError("item not run"));
  std::vector<std::shared_ptr<Sequence>> seqs(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    absl::StatusOr<std::shared_ptr<Sequence>> seq =
        LookupOwned(tenant_id, items[i].sequence_id);
    if (seq.ok()) {
      seqs[i] = *std::move(seq);
    } else {
      results[i] = seq.status();
    }
  }
  // Every sequence's mutex, in one global order (id, then address).
  std::vector<Sequence*> locks;
  for (const auto& s : seqs) {
    if (s != nullptr) locks.push_back(s.get());
  }
  std::sort(locks.begin(), locks.end(),
            [](const Sequence* a, const Sequence* b) {
              return a->id != b->id ? a->id < b->id : a < b;
            });
  locks.erase(std::unique(locks.begin(), locks.end()), locks.end());
  for (Sequence* s : locks) s->mu.Lock();

  std::vector<PreparedAttend> pending;
  std::vector<const Sequence*> pending_seqs;
  auto flush = [&] {
    if (pending.empty()) return;
    std::vector<kernels::DecodeParams> params;
    std::vector<size_t> first(pending.size() + 1, 0);
    for (size_t k = 0; k < pending.size(); ++k) {
      PreparedAttend& p = pending[k];
      const size_t per_query =
          static_cast<size_t>(p.n_q_heads) * p.shape.head_dim;
      first[k] = params.size();
      for (size_t i = 0; i < p.attend.size(); ++i) {
        kernels::DecodeParams d;
        d.q = p.q.data() + i * per_query;
        d.out = p.out.data() + i * per_query;
        d.n_q_heads = p.n_q_heads;
        d.shape = p.shape;
        d.scale = p.scale;
        d.pages = p.refs.data();
        d.num_pages = static_cast<int>(p.refs.size());
        d.attend_tokens = p.attend[i];
        params.push_back(d);
      }
    }
    first[pending.size()] = params.size();
    const absl::Status all = device_->DecodeAttentionBatch(params);
    for (size_t k = 0; k < pending.size(); ++k) {
      absl::Status s = all;
      if (!s.ok() && s.code() != absl::StatusCode::kUnavailable &&
          s.code() != absl::StatusCode::kInternal) {
        // An entry the device refused: run each item alone so only the
        // items at fault fail.
        s = device_->DecodeAttentionBatch(absl::MakeConstSpan(
            params.data() + first[k], first[k + 1] - first[k]));
      }
      if (s.ok()) {
        results[pending[k].item] = std::move(pending[k].out);
      } else {
        results[pending[k].item] = s;
      }
    }
    pending.clear();
    pending_seqs.clear();
  };
  for (size_t i = 0; i < items.size(); ++i) {
    if (seqs[i] == nullptr) continue;
    if (items[i].spec.append != nullptr &&
        std::find(pending_seqs.begin(), pending_seqs.end(), seqs[i].get()) !=
            pending_seqs.end()) {
      flush();  // the pending reads of this sequence must not see the append
    }
    PreparedAttend prep;
    prep.item = i;
    if (absl::Status s =
            PrepareAttend(seqs[i], tenant_id, items[i].spec, &prep);
        !s.ok()) {
      results[i] = s;
      continue;
    }
    pending.push_back(std::move(prep));
    pending_seqs.push_back(seqs[i].get());
  }
  flush();
  for (auto it = locks.rbegin(); it != locks.rend(); ++it) (*it)->mu.Unlock();
  return results;
}

absl::StatusOr<ReadResult> SequenceStore::Read(absl::string_view tenant_id,
                                               absl::string_view sequence_id,
                                               uint32_t layer,
                                               uint64_t first_token,
                                               uint32_t num_tokens) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq_ptr,
                         LookupOwned(tenant_id, sequence_id));
  Sequence& seq = *seq_ptr;
  absl::MutexLock lock(&seq.mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  if (layer >= seq.model.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer=", layer, " is >= model.n_layers=", seq.model.n_layers));
  }
  const uint64_t written = seq.written[layer];
  if (first_token > written) {
    return absl::OutOfRangeError(
        absl::StrCat("first_token=", first_token, " is past the ", written,
                     " written tokens of layer ", layer));
  }
  const uint64_t n = num_tokens != 0 ? num_tokens : written - first_token;
  if (first_token + n > written) {
    return absl::OutOfRangeError(absl::StrCat(
        "first_token=", first_token, " num_tokens=", num_tokens,
        " reads past the ", written, " written tokens of layer ", layer));
  }
  for (size_t b = BlockOf(seq.blocks, first_token);
       n > 0 && b < seq.blocks.size() &&
       seq.blocks[b].spec.first_token < first_token + n;
       ++b) {
    const Block& blk = seq.blocks[b];
    if (blk.evicted) {
      return absl::FailedPreconditionError(
          absl::StrCat("first_token=", first_token, " num_tokens=", n,
                       " reads block ", b, " (lineage_id=", blk.spec.lineage_id,
                       ", tokens ", blk.spec.first_token, "..", blk.end() - 1,
                       "), which is evicted; its tokens are gone"));
    }
  }
  if (n > 0)
    TRIAX_RETURN_IF_ERROR(
        EnsureResident(seq_ptr, first_token, first_token + n));
  ReadResult r;
  r.first_token = first_token;
  r.num_tokens = static_cast<uint32_t>(n);
  r.token_values = seq.model.n_kv_heads * seq.model.head_dim;
  r.k.resize(n * r.token_values);
  r.v.resize(n * r.token_values);
  if (n == 0) return r;
  const uint64_t end = first_token + n;
  std::vector<float> kb, vb;
  for (size_t b = BlockOf(seq.blocks, first_token);
       b < seq.blocks.size() && seq.blocks[b].spec.first_token < end; ++b) {
    const Block& blk = seq.blocks[b];
    const uint32_t valid = static_cast<uint32_t>(std::min<uint64_t>(
        blk.spec.num_tokens, written - blk.spec.first_token));
    const bool in_target = b < seq.sealed[layer] || IsBf16(blk.enc);
    const Page* page = in_target ? blk.target[layer] : blk.window[layer];
    kb.resize(static_cast<size_t>(valid) * r.token_values);
    vb.resize(kb.size());
    TRIAX_RETURN_IF_ERROR(device_->DecodePage(
        in_target ? blk.enc : Encoding(Format::kBF16), seq.shape, page->data,
        static_cast<int>(valid), kb.data(), vb.data()));
    const uint64_t from = std::max(first_token, blk.spec.first_token);
    const uint64_t to = std::min(end, blk.spec.first_token + valid);
    const size_t src = (from - blk.spec.first_token) * r.token_values;
    const size_t dst = (from - first_token) * r.token_values;
    const size_t len = (to - from) * r.token_values;
    std::copy_n(kb.begin() + src, len, r.k.begin() + dst);
    std::copy_n(vb.begin() + src, len, r.v.begin() + dst);
  }
  return r;
}

// ---------------------------------------------------------------------------
// Fork

absl::Status SequenceStore::CopyTokensAsBf16(
    const Sequence& src, uint32_t block, uint32_t layer, uint32_t tokens,
    uint8_t* dst) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const Block& b = src.blocks[block];
  const bool in_target = block < src.sealed[layer] || IsBf16(b.enc);
  const Page* page = in_target ? b.target[layer] : b.window[layer];
  const Encoding f = in_target ? b.enc : Encoding(Format::kBF16);
  if (IsBf16(f)) {
    return device_->CopyPage(dst, page->data,
                             kernels::PageBytes(Format::kBF16, src.shape));
  }
  std::vector<uint16_t> k, v;
  TRIAX_RETURN_IF_ERROR(PageToBf16(f, src.shape, page->data, tokens, &k, &v));
  return device_->WriteBf16Tokens(src.shape, k.data(), v.data(), 0,
                                  static_cast<int>(tokens), dst);
}

absl::StatusOr<ForkResult> SequenceStore::Fork(
    absl::string_view tenant_id, absl::string_view parent_id,
    absl::string_view child_id, uint64_t num_tokens,
    absl::Span<const BlockSpec> blocks) {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("parent_sequence_id", parent_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("child_sequence_id", child_id));
  if (parent_id == child_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "child_sequence_id=", Quote(child_id), " equals parent_sequence_id"));
  }
  if (num_tokens == 0) {
    return absl::InvalidArgumentError("num_tokens=0; a fork needs >= 1 token");
  }
  absl::StatusOr<std::shared_ptr<Sequence>> found = Lookup(parent_id);
  if (!found.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "parent_sequence_id=", Quote(parent_id), " is not on this worker"));
  }
  std::shared_ptr<Sequence> parent_ptr = *std::move(found);
  if (Lookup(child_id).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("child_sequence_id=", Quote(child_id), " already exists"));
  }
  Sequence& parent = *parent_ptr;
  absl::MutexLock parent_lock(&parent.mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(parent, tenant_id));
  TRIAX_RETURN_IF_ERROR(
      ValidatePlan(*device_, blocks, parent.block_tokens, parent.shape));
  if (num_tokens > parent.planned) {
    return absl::OutOfRangeError(absl::StrCat("num_tokens=", num_tokens,
                                              " is past the parent's planned ",
                                              parent.planned, " tokens"));
  }
  const uint64_t child_planned =
      blocks.back().first_token + blocks.back().num_tokens;
  if (child_planned < num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks cover ", child_planned,
                     " tokens, fewer than num_tokens=", num_tokens));
  }
  for (size_t i = 0; i < parent.blocks.size(); ++i) {
    const Block& pb = parent.blocks[i];
    if (pb.spec.first_token >= num_tokens) break;
    if (pb.evicted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parent block ", i, " (lineage_id=", pb.spec.lineage_id,
          ") lies within num_tokens=", num_tokens,
          " but is evicted; a fork cannot inherit evicted tokens"));
    }
    if (!pb.resident()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parent block ", i, " (lineage_id=", pb.spec.lineage_id,
          ") lies within num_tokens=", num_tokens, " but is spilled to the ",
          TierLabel(pb.tier), " tier; Restore it before forking"));
    }
  }
  const uint32_t layers = parent.model.n_layers;
  std::vector<bool> shared(blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockSpec& want = blocks[i];
    size_t j = parent.blocks.size();
    for (size_t k = 0; k < parent.blocks.size(); ++k) {
      if (parent.blocks[k].spec.lineage_id == want.lineage_id) j = k;
    }
    if (j == parent.blocks.size()) {
      // A copied block takes its tokens from the parent's block at the same
      // index, so the tokens it inherits must all lie in that block.
      if (want.first_token < num_tokens) {
        const uint64_t inherit_end =
            std::min<uint64_t>(want.first_token + want.num_tokens, num_tokens);
        if (i >= parent.blocks.size() ||
            parent.blocks[i].spec.first_token != want.first_token ||
            inherit_end > parent.blocks[i].end()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "blocks[", i, "] (first_token=", want.first_token, " num_tokens=",
              want.num_tokens, ") does not line up with the parent's block ", i,
              " within num_tokens=", num_tokens));
        }
      }
      continue;
    }
    const BlockSpec& have = parent.blocks[j].spec;
    // A shared block keeps the parent's (current) encoding.
    if (j != i || have.first_token != want.first_token ||
        have.num_tokens != want.num_tokens) {
      return absl::FailedPreconditionError(
          absl::StrCat("blocks[", i, "] (lineage_id=", want.lineage_id,
                       ") mismatches the parent's block ", j, " (first_token=",
                       have.first_token, " num_tokens=", have.num_tokens, ")"));
    }
    if (have.first_token + have.num_tokens > num_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (lineage_id=", want.lineage_id, ") ends at token ",
          have.first_token + have.num_tokens, ", past num_tokens=", num_tokens,
          "; only whole blocks are shared"));
    }
    for (uint32_t l = 0; l < layers; ++l) {
      if (parent.written[l] < have.first_token + have.num_tokens) {
        return absl::FailedPreconditionError(
            absl::StrCat("blocks[", i, "] (lineage_id=", want.lineage_id,
                         ") is not fully written in the parent on layer ", l,
                         " (", parent.written[l],
                         " tokens written); only written blocks are "
                         "shared"));
      }
    }
    shared[i] = true;
  }

  auto child = std::make_shared<Sequence>();
  child->id = std::string(child_id);
  ForkResult result;
  {
    absl::MutexLock child_lock(&child->mu);
    Sequence& c = *child;
    c.tenant = parent.tenant;
    c.model = parent.model;
    c.block_tokens = parent.block_tokens;
    c.window_tokens = parent.window_tokens;
    c.shape = parent.shape;
    c.sealed.assign(layers, 0);
    c.written.resize(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      c.written[l] = std::min(parent.written[l], num_tokens);
    }
    c.planned = child_planned;
    auto fail = [&](const absl::Status& s) {
      ReleaseAll(c);
      return s;
    };
    for (size_t i = 0; i < blocks.size(); ++i) {
      Block b;
      if (shared[i]) {
        b.spec = parent.blocks[i].spec;
        b.enc = parent.blocks[i].enc;
      } else {
        b.spec = blocks[i];
        b.enc = blocks[i].encoding;
      }
      b.window.assign(layers, nullptr);
      b.target.assign(layers, nullptr);
      c.blocks.push_back(std::move(b));
      Block& cb = c.blocks.back();
      for (uint32_t l = 0; l < layers; ++l) {
        if (shared[i]) {
          cb.target[l] = parent.blocks[i].target[l];
          allocator_->Ref(cb.target[l]);
          ++result.pages_shared;
          continue;
        }
        absl::StatusOr<Page*> p = allocator_->Allocate(
            cb.enc, kernels::PageBytes(cb.enc, c.shape), PageUse::kTarget);
        if (!p.ok()) {
          return fail(absl::Status(
              p.status().code(),
              absl::StrCat("ForkSequence child_sequence_id=", Quote(child_id),
                           " blocks[", i, "] layer ", l, ": ",
                           p.status().message())));
        }
        cb.target[l] = *p;
      }
    }
    // Fill each layer: a leading run of already-encoded pages stays sealed;
    // the rest is staged through BF16 (the window, or the BF16 target page).
    for (uint32_t l = 0; l < layers; ++l) {
      bool prefix = true;
      for (size_t i = 0; i < c.blocks.size(); ++i) {
        Block& cb = c.blocks[i];
        if (c.written[l] <= cb.spec.first_token) break;
        const uint32_t tokens = static_cast<uint32_t>(std::min<uint64_t>(
            cb.spec.num_tokens, c.written[l] - cb.spec.first_token));
        const Block& pb = parent.blocks[i];
        Page* t = cb.target[l];
        bool encoded = false;
        if (shared[i]) {
          absl::MutexLock seal_lock(&t->seal_mu);
          encoded = t->encoded;
        } else {
          ++result.pages_copied;
          if (i < parent.sealed[l] && pb.enc == cb.enc &&
              tokens == cb.spec.num_tokens && tokens == pb.spec.num_tokens) {
            if (absl::Status s =
                    device_->CopyPage(t->data, pb.target[l]->data, t->bytes);
                !s.ok()) {
              return fail(s);
            }
            absl::MutexLock seal_lock(&t->seal_mu);
            t->encoded = encoded = true;
          }
        }
        if (encoded && prefix) {
          c.sealed[l] += 1;
          continue;
        }
        prefix = false;
        if (IsBf16(cb.enc)) {
          if (shared[i]) continue;  // the shared page already holds the data
          if (absl::Status s = CopyTokensAsBf16(
                  parent, static_cast<uint32_t>(i), l, tokens, t->data);
              !s.ok()) {
            return fail(s);
          }
          continue;
        }
        absl::StatusOr<Page*> w = allocator_->Allocate(
            Format::kBF16, kernels::PageBytes(Format::kBF16, c.shape),
            PageUse::kWindow);
        if (!w.ok()) {
          return fail(absl::Status(
              w.status().code(),
              absl::StrCat("ForkSequence child_sequence_id=", Quote(child_id),
                           " window page for blocks[", i, "] layer ", l, ": ",
                           w.status().message())));
        }
        cb.window[l] = *w;
        if (absl::Status s = CopyTokensAsBf16(parent, static_cast<uint32_t>(i),
                                              l, tokens, (*w)->data);
            !s.ok()) {
          return fail(s);
        }
      }
      if (absl::Status s = SealReady(c, l); !s.ok()) return fail(s);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (!sequences_.contains(child_id)) {
      sequences_.emplace(std::string(child_id), child);
      return result;
    }
  }
  absl::MutexLock child_lock(&child->mu);
  ReleaseAll(*child);
  return absl::AlreadyExistsError(
      absl::StrCat("child_sequence_id=", Quote(child_id), " already exists"));
}

// ---------------------------------------------------------------------------
// Free, inventory, introspection

FreeResult SequenceStore::ReleaseAll(Sequence& seq)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  FreeResult r;
  for (Block& b : seq.blocks) {
    if (b.tier == Tier::kHost || b.tier == Tier::kDisk) {
      options_.tiers->Release(&b.spilled);
    }
    for (std::vector<Page*>* pages : {&b.target, &b.window}) {
      for (Page*& p : *pages) {
        if (p == nullptr) continue;
        const size_t bytes = p->bytes;
        if (allocator_->Unref(p)) {
          r.pages_freed += 1;
          r.bytes_freed += bytes;
        }
        p = nullptr;
      }
    }
  }
  seq.blocks.clear();
  return r;
}

absl::StatusOr<FreeResult> SequenceStore::Free(absl::string_view tenant_id,
                                               absl::string_view sequence_id) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq,
                         LookupOwned(tenant_id, sequence_id));
  {
    absl::MutexLock lock(&seq->mu);
    TRIAX_RETURN_IF_ERROR(CheckOwner(*seq, tenant_id));
    seq->freed = true;
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(sequence_id);
    if (it != sequences_.end() && it->second == seq) sequences_.erase(it);
  }
  absl::MutexLock lock(&seq->mu);
  return ReleaseAll(*seq);
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
  {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(sequence_id);
    if (it != sequences_.end() && it->second == seq) sequences_.erase(it);
  }
  absl::MutexLock lock(&seq->mu);
  return ReleaseAll(*seq);
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
  for (const Block& b : seq->blocks) {
    s.blocks.push_back(b.spec);
    s.blocks.back().tier = b.tier;
    s.blocks.back().evicted = b.evicted;
  }
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

// ---------------------------------------------------------------------------
// Spill tiers

namespace {

BlockLabel LabelOf(const std::string& seq_id, const BlockSpec& spec) {
  BlockLabel l;
  l.sequence_id = seq_id;
  l.lineage_id = spec.lineage_id;
  l.index = spec.index;
  return l;
}

std::string BlockName(const BlockSpec& spec) {
  return absl::StrCat("block ", spec.index, " (lineage_id=", spec.lineage_id,
                      ")");
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

absl::StatusOr<SpillResult> SequenceStore::Spill(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids, Tier tier) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq_ptr,
                         LookupOwned(tenant_id, sequence_id));
  if (tier != Tier::kHost && tier != Tier::kDisk) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier=", static_cast<int>(tier), " (", TierLabel(tier),
                     ") is not a spill tier (2 host, 3 disk)"));
  }
  if (lineage_ids.empty()) {
    return absl::InvalidArgumentError("lineage_ids is empty; name >= 1 block");
  }
  if (options_.tiers == nullptr) {
    return absl::FailedPreconditionError(
        "this worker has no spill tiers configured");
  }
  TRIAX_RETURN_IF_ERROR(options_.tiers->CheckTier(tier));
  Sequence& seq = *seq_ptr;
  absl::MutexLock lock(&seq.mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  TRIAX_ASSIGN_OR_RETURN(std::vector<size_t> named, BlocksOf(seq, lineage_ids));
  std::vector<size_t> jobs;
  for (size_t b : named) {
    const Block& blk = seq.blocks[b];
    if (blk.evicted) {
      return absl::FailedPreconditionError(
          absl::StrCat("Spill sequence_id=", Quote(seq.id), " ",
                       BlockName(blk.spec), " is evicted"));
    }
    if (blk.tier == tier) continue;  // already there
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
    need += blk.resident() ? layers * kernels::PageBytes(blk.enc, seq.shape)
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
    blk.tier = tier;
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
    const size_t bytes = kernels::PageBytes(blk.enc, seq.shape);
    fresh.emplace_back();
    for (uint32_t l = 0; l < layers; ++l) {
      absl::StatusOr<Page*> p =
          allocator_->Allocate(blk.enc, bytes, PageUse::kTarget);
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
      }
      blk.target[l] = p;
    }
    result.pages_restored += layers;
    result.bytes_restored += blk.spilled.bytes();
    options_.tiers->Release(&blk.spilled);
    blk.tier = Tier::kDevice;
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

absl::StatusOr<RestoreResult> SequenceStore::Restore(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids, bool background) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq_ptr,
                         LookupOwned(tenant_id, sequence_id));
  Sequence& seq = *seq_ptr;
  absl::MutexLock lock(&seq.mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  std::vector<size_t> jobs;
  if (lineage_ids.empty()) {
    for (size_t b = 0; b < seq.blocks.size(); ++b) {
      if (!seq.blocks[b].resident() && !seq.blocks[b].evicted)
        jobs.push_back(b);
    }
  } else {
    TRIAX_ASSIGN_OR_RETURN(std::vector<size_t> named,
                           BlocksOf(seq, lineage_ids));
    for (size_t b : named) {
      const Block& blk = seq.blocks[b];
      if (blk.evicted) {
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
    QueuePrefetch(seq_ptr, jobs);
    return r;
  }
  return RestoreLocked(seq, jobs, /*on_its_own=*/false);
}

absl::StatusOr<EvictResult> SequenceStore::Evict(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq_ptr,
                         LookupOwned(tenant_id, sequence_id));
  if (lineage_ids.empty()) {
    return absl::InvalidArgumentError("lineage_ids is empty; name >= 1 block");
  }
  Sequence& seq = *seq_ptr;
  absl::MutexLock lock(&seq.mu);
  TRIAX_RETURN_IF_ERROR(CheckOwner(seq, tenant_id));
  TRIAX_ASSIGN_OR_RETURN(std::vector<size_t> named, BlocksOf(seq, lineage_ids));
  std::vector<size_t> jobs;
  for (size_t b : named) {
    if (seq.blocks[b].evicted) continue;  // already gone
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
    blk.tier = Tier::kUnspecified;
    blk.evicted = true;
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
    if (!blk.evicted && !blk.resident()) spilled.push_back(b);
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
                                 TierLabel(blk.tier), " tier"));
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
  PrefetchJob job;
  job.seq = seq;
  for (size_t b : blocks) {
    Block& blk = seq->blocks[b];
    blk.prefetch_queued = true;
    job.lineage_ids.push_back(blk.spec.lineage_id);
  }
  if (job.lineage_ids.empty()) return;
  absl::MutexLock lock(&prefetch_mu_);
  prefetch_queue_.push_back(std::move(job));
}

void SequenceStore::RunPrefetch(const PrefetchJob& job)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Sequence& seq = *job.seq;
  absl::MutexLock lock(&seq.mu);
  if (seq.freed) return;
  std::vector<size_t> todo;
  for (uint64_t lineage : job.lineage_ids) {
    for (size_t b = 0; b < seq.blocks.size(); ++b) {
      const Block& blk = seq.blocks[b];
      if (blk.spec.lineage_id == lineage && blk.prefetch_queued &&
          !blk.resident() && !blk.evicted) {
        todo.push_back(b);
      }
    }
  }
  // One block at a time, so a bad block does not hold back the others.
  for (size_t b : todo) {
    absl::StatusOr<RestoreResult> r = RestoreLocked(seq, {b});
    if (r.ok()) continue;
    Block& blk = seq.blocks[b];
    blk.prefetch_queued = false;
    if (blk.restore_error.ok()) blk.restore_error = r.status();
    Log(LogLevel::kWarn, "worker", "background restore failed",
        absl::StrCat(Kv("sequence_id", seq.id), " ",
                     Kv("lineage_id", blk.spec.lineage_id), " ",
                     Kv("code", static_cast<int>(r.status().code())), " ",
                     Kv("error", r.status().message())));
  }
}

size_t SequenceStore::ServePrefetchQueue() {
  size_t ran = 0;
  for (;;) {
    PrefetchJob job;
    {
      absl::MutexLock lock(&prefetch_mu_);
      if (prefetch_queue_.empty()) return ran;
      job = std::move(prefetch_queue_.front());
      prefetch_queue_.pop_front();
      ++prefetch_running_;
    }
    RunPrefetch(job);
    ++ran;
    absl::MutexLock lock(&prefetch_mu_);
    --prefetch_running_;
  }
}

void SequenceStore::PrefetchLoop() {
  for (;;) {
    PrefetchJob job;
    {
      absl::MutexLock lock(&prefetch_mu_);
      prefetch_mu_.Await(absl::Condition(
          +[](SequenceStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->prefetch_mu_) {
            return s->prefetch_stop_ || !s->prefetch_queue_.empty();
          },
          this));
      if (prefetch_stop_) return;
      job = std::move(prefetch_queue_.front());
      prefetch_queue_.pop_front();
      ++prefetch_running_;
    }
    RunPrefetch(job);
    absl::MutexLock lock(&prefetch_mu_);
    --prefetch_running_;
  }
}

void SequenceStore::WaitPrefetchIdle() {
  absl::MutexLock lock(&prefetch_mu_);
  prefetch_mu_.Await(absl::Condition(
      +[](SequenceStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->prefetch_mu_) {
        return s->prefetch_queue_.empty() && s->prefetch_running_ == 0;
      },
      this));
}

absl::StatusOr<SpilledBlock> SequenceStore::SpilledPages(
    absl::string_view sequence_id, uint32_t block) {
  TRIAX_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Lookup(sequence_id));
  absl::MutexLock lock(&seq->mu);
  if (block >= seq->blocks.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("block=", block, " is outside the sequence"));
  }
  const Block& b = seq->blocks[block];
  if (b.evicted || b.resident()) {
    return absl::FailedPreconditionError(
        absl::StrCat("block=", block, " is not spilled"));
  }
  return b.spilled;
}

}  // namespace triax::worker
