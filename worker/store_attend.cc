// SequenceStore's reads of the pages for a caller: Attend, AttendBatch (see
// "Batched attention" in sequence_store.h) and Read. PrepareAttend does an
// item's work before the device runs (validation, residency, the append);
// AttendBatch then runs every prepared item's queries as one
// Device::DecodeAttentionBatch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"
#include "worker/sequence_store.h"
#include "worker/sequence_store_internal.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using store_internal::Block;
using store_internal::BlockOf;
using store_internal::CheckOwner;
using store_internal::IsBf16;

namespace store_internal {

// An item ready for the device: its query/output buffers, page list and
// per-query attended token counts.
struct PreparedAttend {
  size_t item = 0;
  Sequence* seq = nullptr;
  const AttendSpec* spec = nullptr;  // the item's (outlives the batch)
  uint64_t upto = 0;  // attended blocks were made resident up to this token
  bool has_append = false;
  DeferredWrite append;  // when has_append: written by the batch's flush
  kernels::PageShape shape;
  int n_q_heads = 0;
  float scale = 0.f;
  std::vector<float> q, out;  // [num_queries][n_q_heads][head_dim]
  std::vector<kernels::PageRef> refs;
  std::vector<long> attend;  // per query
};

}  // namespace store_internal

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
  if (spec.dtype != KvDtype::kUnspecified && spec.dtype != KvDtype::kF32 &&
      spec.dtype != KvDtype::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype=", static_cast<int>(spec.dtype), " is not F32 (1) or BF16 (2)"));
  }
  const bool bf16 = spec.dtype == KvDtype::kBF16;
  const size_t qvalues =
      static_cast<size_t>(spec.num_queries) * m.n_q_heads * m.head_dim;
  const size_t value_bytes = bf16 ? 2 : 4;
  if (spec.queries.size() != qvalues * value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries has ", spec.queries.size(), " bytes; expected ",
                     qvalues * value_bytes, " (num_queries=", spec.num_queries,
                     " x n_q_heads=", m.n_q_heads, " x head_dim=", m.head_dim,
                     bf16 ? " x 2 bytes bf16)" : " x 4 bytes float32)"));
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
    TRIAX_RETURN_IF_ERROR(
        WriteLocked(seq, *spec.append, "append.", &prep->append));
    prep->has_append = true;
  }
  prep->seq = &seq;
  prep->spec = &spec;
  prep->upto = upto;
  return absl::OkStatus();
}

absl::Status SequenceStore::CompleteAttend(
    const Sequence& seq, PreparedAttend* prep) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AttendSpec& spec = *prep->spec;
  const ModelShape& m = seq.model;
  const uint64_t upto = prep->upto;
  const uint32_t layer = spec.layer;
  const uint64_t written = seq.written[layer];
  std::vector<kernels::PageRef>& refs = prep->refs;
  std::vector<const Block*> evicted;  // skipped; their positions still count
  for (size_t b = 0; b < seq.blocks.size(); ++b) {
    const Block& blk = seq.blocks[b];
    // Blocks past the last attended position may be spilled (only those up
    // to it were made resident) and are not read.
    if (blk.spec.first_token >= std::min(written, upto)) break;
    if (blk.spec.evicted) {
      evicted.push_back(&blk);
      continue;
    }
    kernels::PageRef r;
    r.num_tokens = static_cast<int>(std::min<uint64_t>(
        blk.spec.num_tokens, written - blk.spec.first_token));
    if (b < seq.sealed[layer] || IsBf16(blk.spec.encoding)) {
      r.encoding = blk.spec.encoding;
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
  const bool bf16 = spec.dtype == KvDtype::kBF16;
  const size_t qvalues =
      static_cast<size_t>(spec.num_queries) * m.n_q_heads * m.head_dim;
  prep->shape = seq.shape;
  prep->n_q_heads = static_cast<int>(m.n_q_heads);
  prep->scale = spec.scale != 0.f
                    ? spec.scale
                    : 1.f / std::sqrt(static_cast<float>(m.head_dim));
  prep->q.resize(qvalues);
  if (bf16) {
    const char* src = spec.queries.data();
    for (size_t i = 0; i < qvalues; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      prep->q[i] = kernels::Bf16ToFloat(h);
    }
  } else {
    std::memcpy(prep->q.data(), spec.queries.data(), qvalues * 4);
  }
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

std::vector<absl::StatusOr<std::vector<float>>> SequenceStore::AttendBatchOnce(
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
  // The pending items' sequences, each with the layers its items append to.
  std::vector<std::pair<const Sequence*, std::vector<uint32_t>>> pending_seqs;
  auto flush = [&] {
    if (pending.empty()) return;
    // The appends first, all in one device call per page shape; then each
    // appending sequence's written count moves and its full blocks seal,
    // in item order; then every item's pages are listed as they now are.
    std::vector<bool> failed(pending.size(), false);
    std::vector<kernels::PageShape> shapes;
    for (const PreparedAttend& p : pending) {
      if (p.has_append && std::find(shapes.begin(), shapes.end(),
                                    p.append.shape) == shapes.end()) {
        shapes.push_back(p.append.shape);
      }
    }
    for (const kernels::PageShape& shape : shapes) {
      std::vector<TokenWrite> writes;
      for (const PreparedAttend& p : pending) {
        if (p.has_append && p.append.shape == shape)
          p.append.AddWrites(&writes);
      }
      const absl::Status s = device_->WriteBf16TokensBatch(shape, writes);
      if (s.ok()) continue;
      for (size_t k = 0; k < pending.size(); ++k) {
        if (pending[k].has_append && pending[k].append.shape == shape) {
          results[pending[k].item] =
              absl::Status(s.code(), absl::StrCat("append: ", s.message()));
          failed[k] = true;
        }
      }
    }
    // Blocks the appends filled seal item by item; the CRC32Cs of every
    // page sealed go in one device pass.
    std::vector<Page*> unsummed;
    std::vector<std::pair<size_t, size_t>> sealed(pending.size());  // range
    for (size_t k = 0; k < pending.size(); ++k) {
      PreparedAttend& p = pending[k];
      if (failed[k] || !p.has_append) continue;
      const size_t from = unsummed.size();
      const absl::Status s = FinishWriteLocked(*p.seq, p.append, &unsummed);
      sealed[k] = {from, unsummed.size()};
      if (!s.ok()) {
        results[p.item] = s;
        failed[k] = true;
      }
    }
    if (absl::Status s = ChecksumSealed(unsummed); !s.ok()) {
      for (size_t k = 0; k < pending.size(); ++k) {
        const size_t n = sealed[k].second - sealed[k].first;
        if (n == 0 || failed[k]) continue;
        results[pending[k].item] =
            SealedChecksumError(*pending[k].seq, pending[k].append.layer, n, s);
        failed[k] = true;
      }
    }
    for (size_t k = 0; k < pending.size(); ++k) {
      PreparedAttend& p = pending[k];
      if (failed[k]) continue;
      if (absl::Status s = CompleteAttend(*p.seq, &p); !s.ok()) {
        results[p.item] = s;
        failed[k] = true;
      }
    }
    size_t kept = 0;
    for (size_t k = 0; k < pending.size(); ++k) {
      if (failed[k]) continue;
      if (kept != k) pending[kept] = std::move(pending[k]);
      ++kept;
    }
    pending.resize(kept);
    if (pending.empty()) {
      pending_seqs.clear();
      return;
    }
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
    // Page reads by K format (each query reads its item's pages), for the
    // batch's timing under its format mix (op_timings.h).
    std::vector<uint64_t> pages_by_format(
        static_cast<size_t>(kernels::Format::kTQ2) + 1, 0);
    for (const PreparedAttend& p : pending) {
      for (const kernels::PageRef& r : p.refs) {
        const size_t f = static_cast<size_t>(r.encoding.k);
        if (f < pages_by_format.size()) pages_by_format[f] += p.attend.size();
      }
    }
    const absl::Time start = absl::Now();
    const absl::Status all = device_->DecodeAttentionBatch(params);
    if (all.ok()) {
      timings_.RecordAttention(pages_by_format,
                               absl::ToDoubleSeconds(absl::Now() - start));
    }
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
    const bool appends = items[i].spec.append != nullptr;
    const uint32_t layer = items[i].spec.layer;
    auto seen =
        std::find_if(pending_seqs.begin(), pending_seqs.end(),
                     [&](const auto& e) { return e.first == seqs[i].get(); });
    if (seen != pending_seqs.end() &&
        (appends || std::find(seen->second.begin(), seen->second.end(),
                              layer) != seen->second.end())) {
      // The pending items of this sequence must not see this item's append;
      // this item must see a pending append to its layer (written once the
      // batch is flushed) and continue after it.
      flush();
      seen = pending_seqs.end();
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
    if (seen == pending_seqs.end()) {
      pending_seqs.emplace_back(seqs[i].get(), std::vector<uint32_t>());
      seen = pending_seqs.end() - 1;
    }
    if (appends) seen->second.push_back(layer);
  }
  flush();
  for (auto it = locks.rbegin(); it != locks.rend(); ++it) (*it)->mu.Unlock();
  return results;
}

absl::StatusOr<ReadResult> SequenceStore::ReadOnce(
    absl::string_view tenant_id, absl::string_view sequence_id, uint32_t layer,
    uint64_t first_token, uint32_t num_tokens) {
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked,
                         LockOwned(tenant_id, sequence_id));
  Sequence& seq = *locked;
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
    if (blk.spec.evicted) {
      return absl::FailedPreconditionError(
          absl::StrCat("first_token=", first_token, " num_tokens=", n,
                       " reads block ", b, " (lineage_id=", blk.spec.lineage_id,
                       ", tokens ", blk.spec.first_token, "..", blk.end() - 1,
                       "), which is evicted; its tokens are gone"));
    }
  }
  if (n > 0)
    TRIAX_RETURN_IF_ERROR(
        EnsureResident(locked.shared(), first_token, first_token + n));
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
    const bool in_target = b < seq.sealed[layer] || IsBf16(blk.spec.encoding);
    const Page* page = in_target ? blk.target[layer] : blk.window[layer];
    kb.resize(static_cast<size_t>(valid) * r.token_values);
    vb.resize(kb.size());
    TRIAX_RETURN_IF_ERROR(device_->DecodePage(
        in_target ? blk.spec.encoding : Encoding(Format::kBF16), seq.shape,
        page->data, static_cast<int>(valid), kb.data(), vb.data()));
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

}  // namespace triax::worker
