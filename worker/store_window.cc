// SequenceStore's BF16 window and sealing: Write, the append of an Attend
// (WriteLocked) and SealReady, which encodes a block into its target page
// and releases its window page once the window has moved past it (see
// "Storage" in sequence_store.h). Tokens are appended in order per layer;
// BF16 blocks are written straight into their target page, every other
// block into a BF16 window page taken on first write.
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"
#include "worker/sequence_store.h"
#include "worker/sequence_store_internal.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;
using store_internal::Block;
using store_internal::BlockOf;
using store_internal::IsBf16;

namespace {

void FloatsToBf16(const std::vector<float>& in, std::vector<uint16_t>* out) {
  out->resize(in.size());
  for (size_t i = 0; i < in.size(); ++i)
    (*out)[i] = kernels::FloatToBf16(in[i]);
}

}  // namespace

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
                                        absl::string_view p,
                                        DeferredWrite* defer) {
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
    if (IsBf16(blk.spec.encoding) || blk.window[c.layer] != nullptr) continue;
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
    Page* page =
        IsBf16(blk.spec.encoding) ? blk.target[c.layer] : blk.window[c.layer];
    const size_t off = (from - c.first_token) * stride;
    const int slot = static_cast<int>(from - blk.spec.first_token);
    const int n = static_cast<int>(to - from);
    if (defer != nullptr) {
      defer->segments.push_back({off, slot, n, page->data});
      continue;
    }
    TRIAX_RETURN_IF_ERROR(device_->WriteBf16Tokens(
        seq.shape, k.data() + off, v.data() + off, slot, n, page->data));
  }
  if (defer != nullptr) {
    defer->layer = c.layer;
    defer->end = end;
    defer->shape = seq.shape;
    defer->k = std::move(k);
    defer->v = std::move(v);
    return absl::OkStatus();
  }
  seq.written[c.layer] = end;
  seq.written_cv.SignalAll();
  return SealReady(seq, c.layer);
}

absl::Status SequenceStore::FinishWriteLocked(Sequence& seq,
                                              const DeferredWrite& d,
                                              std::vector<Page*>* unsummed) {
  seq.written[d.layer] = d.end;
  seq.written_cv.SignalAll();
  return SealReadyPages(seq, d.layer, unsummed);
}

absl::Status SequenceStore::SealReady(Sequence& seq, uint32_t layer) {
  // Target pages sealed here whose CRC32C is not known yet: checksummed
  // together once the loop is done (one device pass per write).
  std::vector<Page*> unsummed;
  absl::Status sealing = SealReadyPages(seq, layer, &unsummed);
  if (absl::Status s = ChecksumSealed(unsummed); !s.ok()) {
    // The pages are sealed; without their checksums an export takes them.
    return sealing.ok() ? SealedChecksumError(seq, layer, unsummed.size(), s)
                        : sealing;
  }
  return sealing;
}

absl::Status SequenceStore::ChecksumSealed(absl::Span<Page* const> unsummed) {
  if (unsummed.empty()) return absl::OkStatus();
  std::vector<DeviceBytes> ranges;
  ranges.reserve(unsummed.size());
  for (const Page* t : unsummed)
    ranges.push_back(DeviceBytes{t->data, t->bytes});
  std::vector<uint32_t> crcs(ranges.size());
  TRIAX_RETURN_IF_ERROR(device_->Checksum(ranges, absl::MakeSpan(crcs)));
  for (size_t i = 0; i < unsummed.size(); ++i) {
    Page* t = unsummed[i];
    absl::MutexLock seal_lock(&t->seal_mu);
    if (t->encoded && !t->crc_known) {
      t->crc_known = true;
      t->crc32c = crcs[i];
    }
  }
  return absl::OkStatus();
}

absl::Status SequenceStore::SealedChecksumError(const Sequence& seq,
                                                uint32_t layer, size_t pages,
                                                const absl::Status& s) {
  return absl::Status(
      s.code(),
      absl::StrCat("sequence_id=", Quote(seq.id), " layer ", layer,
                   " checksums of ", pages, " sealed pages: ", s.message()));
}

absl::Status SequenceStore::SealReadyPages(Sequence& seq, uint32_t layer,
                                           std::vector<Page*>* unsummed) {
  while (seq.sealed[layer] < seq.blocks.size()) {
    Block& b = seq.blocks[seq.sealed[layer]];
    if (seq.written[layer] < b.end() + seq.window_tokens) break;
    Page* t = b.target[layer];
    {
      absl::MutexLock seal_lock(&t->seal_mu);
      if (!t->encoded && !IsBf16(b.spec.encoding)) {
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
        job.to = b.spec.encoding;
        job.dst = t->data;
        TRIAX_RETURN_IF_ERROR(
            device_->DemotePages(seq.shape, absl::MakeConstSpan(&job, 1)));
      }
      t->encoded = true;
      if (!t->crc_known) unsummed->push_back(t);
    }
    if (b.window[layer] != nullptr) {
      allocator_->Unref(b.window[layer]);
      b.window[layer] = nullptr;
    }
    seq.sealed[layer] += 1;
    // The last layer to seal this block seals the block.
    const uint32_t index = seq.sealed[layer] - 1;
    if (std::all_of(seq.sealed.begin(), seq.sealed.end(),
                    [index](uint32_t s) { return s > index; })) {
      ReportSealed(b.spec.lineage_id);
    }
  }
  return absl::OkStatus();
}

void SequenceStore::ReportSealed(uint64_t lineage_id) {
  const int64_t now = absl::ToUnixMillis(absl::Now());
  absl::MutexLock lock(&sealed_mu_);
  if (sealed_.size() >= kMaxSealReports) {
    ++sealed_dropped_;
    return;
  }
  sealed_.emplace_back(lineage_id, now);
}

std::vector<std::pair<uint64_t, int64_t>> SequenceStore::TakeSealed() {
  absl::MutexLock lock(&sealed_mu_);
  std::vector<std::pair<uint64_t, int64_t>> out;
  out.swap(sealed_);
  return out;
}

void SequenceStore::ReturnSealed(
    const std::vector<std::pair<uint64_t, int64_t>>& sealed) {
  absl::MutexLock lock(&sealed_mu_);
  for (const auto& s : sealed) {
    if (sealed_.size() >= kMaxSealReports) {
      ++sealed_dropped_;
      continue;
    }
    sealed_.push_back(s);
  }
}

uint64_t SequenceStore::SealReportsDropped() const {
  absl::MutexLock lock(&sealed_mu_);
  return sealed_dropped_;
}

absl::StatusOr<uint64_t> SequenceStore::WriteOnce(absl::string_view tenant_id,
                                                  absl::string_view sequence_id,
                                                  const KvWrite& chunk) {
  TRIAX_ASSIGN_OR_RETURN(LockedSequence seq, LockOwned(tenant_id, sequence_id));
  TRIAX_RETURN_IF_ERROR(WriteLocked(*seq, chunk, ""));
  return chunk.num_tokens;
}

}  // namespace triax::worker
