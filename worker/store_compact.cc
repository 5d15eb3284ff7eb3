// SequenceStore's public operations on page data: each runs its body (the
// *Once methods in the other store_*.cc files) under the data lock and, after
// an allocator shortfall, compacts the arena and runs it once more
// (WithRoom); Compact itself.
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "worker/sequence_store.h"

namespace triax::worker {

absl::StatusOr<CompactionResult> SequenceStore::Compact() {
  absl::WriterMutexLock lock(&data_mu_);
  absl::StatusOr<CompactionResult> r = allocator_->Compact();
  if (r.ok() && r->pages_moved > 0) {
    Log(LogLevel::kInfo, "worker", "compacted the page arena",
        absl::StrCat(Kv("pages_moved", r->pages_moved), " ",
                     Kv("bytes_moved", r->bytes_moved), " ",
                     Kv("frames_freed", r->frames_freed), " ",
                     Kv("ms", r->seconds * 1e3)));
  }
  return r;
}

bool SequenceStore::NeedsCompaction(const absl::Status& s,
                                    uint64_t shortfalls_before) const {
  return absl::IsResourceExhausted(s) &&
         allocator_->Shortfalls() != shortfalls_before;
}

absl::Status SequenceStore::AfterCompaction(
    const absl::Status& s, const absl::StatusOr<CompactionResult>& c) const {
  if (!absl::IsResourceExhausted(s)) return s;
  const AllocatorStats st = allocator_->Stats();
  std::string what =
      c.ok() ? absl::StrCat("compaction moved ", c->pages_moved, " pages (",
                            c->bytes_moved, " bytes) and freed ",
                            c->frames_freed, " frames")
             : absl::StrCat("compaction failed: ", c.status().message());
  return absl::Status(
      s.code(), absl::StrCat(s.message(), "; ", what, "; now ", st.free_bytes,
                             " bytes free, ", st.free_frames,
                             " free frames of ", st.frame_bytes, " bytes"));
}

absl::StatusOr<AllocateResult> SequenceStore::AllocatePages(
    absl::string_view tenant_id, absl::string_view sequence_id,
    const ModelShape& model, uint32_t block_tokens,
    absl::Span<const BlockSpec> blocks, std::optional<uint32_t> window_tokens) {
  return WithRoom<AllocateResult>([&] {
    return AllocatePagesOnce(tenant_id, sequence_id, model, block_tokens,
                             blocks, window_tokens);
  });
}

absl::StatusOr<DemoteResult> SequenceStore::Demote(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const BlockSpec> blocks) {
  return WithRoom<DemoteResult>(
      [&] { return DemoteOnce(tenant_id, sequence_id, blocks); });
}

absl::StatusOr<ForkResult> SequenceStore::Fork(
    absl::string_view tenant_id, absl::string_view parent_id,
    absl::string_view child_id, uint64_t num_tokens,
    absl::Span<const BlockSpec> blocks, absl::string_view parent_tenant_id) {
  return WithRoom<ForkResult>([&] {
    return ForkOnce(tenant_id, parent_id, child_id, num_tokens, blocks,
                    parent_tenant_id);
  });
}

absl::StatusOr<uint64_t> SequenceStore::Write(absl::string_view tenant_id,
                                              absl::string_view sequence_id,
                                              const KvWrite& chunk) {
  return WithRoom<uint64_t>(
      [&] { return WriteOnce(tenant_id, sequence_id, chunk); });
}

absl::StatusOr<ReadResult> SequenceStore::Read(absl::string_view tenant_id,
                                               absl::string_view sequence_id,
                                               uint32_t layer,
                                               uint64_t first_token,
                                               uint32_t num_tokens) {
  return WithRoom<ReadResult>([&] {
    return ReadOnce(tenant_id, sequence_id, layer, first_token, num_tokens);
  });
}

absl::StatusOr<SpillResult> SequenceStore::Spill(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids, Tier tier) {
  return WithRoom<SpillResult>(
      [&] { return SpillOnce(tenant_id, sequence_id, lineage_ids, tier); });
}

absl::StatusOr<RestoreResult> SequenceStore::Restore(
    absl::string_view tenant_id, absl::string_view sequence_id,
    absl::Span<const uint64_t> lineage_ids, bool background) {
  return WithRoom<RestoreResult>([&] {
    return RestoreOnce(tenant_id, sequence_id, lineage_ids, background);
  });
}

std::vector<absl::StatusOr<std::vector<float>>> SequenceStore::AttendBatch(
    absl::string_view tenant_id, absl::Span<const AttendBatchItem> items) {
  const uint64_t before = allocator_->Shortfalls();
  std::vector<absl::StatusOr<std::vector<float>>> results;
  {
    absl::ReaderMutexLock lock(&data_mu_);
    results = AttendBatchOnce(tenant_id, items);
  }
  // Items refused for room that no later item of the batch follows on the
  // same sequence: running them again after compaction cannot reorder them
  // against another item of the batch.
  std::vector<size_t> again;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!NeedsCompaction(results[i].status(), before)) continue;
    bool followed = false;
    for (size_t j = i + 1; j < items.size() && !followed; ++j) {
      followed = items[j].sequence_id == items[i].sequence_id;
    }
    if (!followed) again.push_back(i);
  }
  if (again.empty()) return results;
  absl::StatusOr<CompactionResult> c = Compact();
  for (size_t i : again) {
    if (c.ok()) {
      absl::ReaderMutexLock lock(&data_mu_);
      results[i] = std::move(
          AttendBatchOnce(tenant_id, absl::MakeConstSpan(&items[i], 1))[0]);
    }
    if (!results[i].ok()) {
      results[i] = AfterCompaction(results[i].status(), c);
    }
  }
  return results;
}

}  // namespace triax::worker
