#include "worker/convert.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/proto_fingerprint.h"
#include "kernels/numeric.h"

namespace triax::worker {
namespace {

std::vector<BlockSpec> PlanFromProto(
    const google::protobuf::RepeatedPtrField<v1::BlockPlan>& blocks) {
  std::vector<BlockSpec> plan;
  plan.reserve(blocks.size());
  for (const v1::BlockPlan& b : blocks) plan.push_back(FromProto(b));
  return plan;
}

std::vector<uint64_t> IdsFromProto(
    const google::protobuf::RepeatedField<uint64_t>& ids) {
  return std::vector<uint64_t>(ids.begin(), ids.end());
}

}  // namespace

AllocatePagesRequest FromProto(const v1::AllocatePagesRequest& p) {
  AllocatePagesRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.model = FromProto(p.model());
  d.block_tokens = p.block_tokens();
  d.blocks = PlanFromProto(p.blocks());
  if (p.has_window_tokens()) d.window_tokens = p.window_tokens();
  return d;
}

ForkRequest FromProto(const v1::WorkerForkRequest& p) {
  ForkRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.parent_sequence_id = p.parent_sequence_id();
  d.child_sequence_id = p.child_sequence_id();
  d.num_tokens = p.num_tokens();
  d.blocks = PlanFromProto(p.blocks());
  d.parent_tenant_id = p.parent_tenant_id();
  return d;
}

DemoteRequest FromProto(const v1::DemoteRequest& p) {
  DemoteRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.blocks = PlanFromProto(p.blocks());
  return d;
}

FreeRequest FromProto(const v1::FreePagesRequest& p) {
  FreeRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  return d;
}

SpillRequest FromProto(const v1::SpillRequest& p) {
  SpillRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.lineage_ids = IdsFromProto(p.lineage_ids());
  d.tier = TierFromProto(p.tier());
  return d;
}

RestoreRequest FromProto(const v1::RestoreRequest& p) {
  RestoreRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.lineage_ids = IdsFromProto(p.lineage_ids());
  d.background = p.background();
  return d;
}

EvictRequest FromProto(const v1::EvictRequest& p) {
  EvictRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.lineage_ids = IdsFromProto(p.lineage_ids());
  return d;
}

KvWrite FromProto(const v1::KvChunk& p) {
  KvWrite d;
  d.layer = p.layer();
  d.first_token = p.first_token();
  d.num_tokens = p.num_tokens();
  d.dtype = static_cast<int>(p.dtype());
  d.k = p.k();
  d.v = p.v();
  return d;
}

WriteMessage FromProto(const v1::WriteKVRequest& p) {
  WriteMessage d;
  d.request_id = p.request_id();
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  if (p.has_chunk()) d.chunk = FromProto(p.chunk());
  return d;
}

ReadRequest FromProto(const v1::ReadKVRequest& p) {
  ReadRequest d;
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.layer = p.layer();
  d.first_token = p.first_token();
  d.num_tokens = p.num_tokens();
  d.dtype = static_cast<KvDtype>(p.dtype());
  return d;
}

AttendRequest FromProto(const v1::AttendRequest& p) {
  AttendRequest d;
  d.tenant_id = p.tenant_id();
  d.items.resize(p.items_size());
  for (int i = 0; i < p.items_size(); ++i) {
    const v1::AttendItem& item = p.items(i);
    AttendItem& out = d.items[i];
    out.sequence_id = item.sequence_id();
    out.spec.layer = item.layer();
    out.spec.num_queries = item.num_queries();
    out.spec.positions =
        absl::MakeConstSpan(item.positions().data(), item.positions_size());
    out.spec.queries = item.queries();
    out.spec.dtype = static_cast<KvDtype>(item.dtype());
    out.spec.scale = item.scale();
    if (item.has_append()) out.append = FromProto(item.append());
  }
  return d;
}

InventoryRequest FromProto(const v1::GetInventoryRequest& p) {
  InventoryRequest r;
  r.describe_sequence_ids.assign(p.describe_sequence_ids().begin(),
                                 p.describe_sequence_ids().end());
  return r;
}

void ToProto(const AllocateResult& d, v1::AllocatePagesResponse* p) {
  p->set_pages_allocated(d.pages_allocated);
  p->set_bytes_allocated(d.bytes_allocated);
}

void ToProto(const ForkResult& d, v1::WorkerForkResponse* p) {
  p->set_pages_shared(d.pages_shared);
  p->set_pages_copied(d.pages_copied);
}

void ToProto(const WriteResult& d, v1::WriteKVResponse* p) {
  p->set_tokens_written(d.tokens_written);
  p->set_bytes_received(d.bytes_received);
}

void ToProto(const DemoteResult& d, v1::DemoteResponse* p) {
  p->set_pages_reencoded(d.pages_reencoded);
  p->set_bytes_delta(d.bytes_delta);
}

void ToProto(const FreeResult& d, v1::FreePagesResponse* p) {
  p->set_pages_freed(d.pages_freed);
  p->set_bytes_freed(d.bytes_freed);
}

void ToProto(const SpillResult& d, v1::SpillResponse* p) {
  p->set_pages_moved(d.pages_moved);
  p->set_bytes_moved(d.bytes_moved);
  p->set_device_bytes_freed(d.device_bytes_freed);
}

void ToProto(const RestoreResult& d, v1::RestoreResponse* p) {
  p->set_pages_restored(d.pages_restored);
  p->set_bytes_restored(d.bytes_restored);
  p->set_blocks_queued(d.blocks_queued);
}

void ToProto(const EvictResult& d, v1::EvictResponse* p) {
  p->set_pages_freed(d.pages_freed);
  p->set_bytes_freed(d.bytes_freed);
}

void ToProto(const AttendResult& d, v1::AttendResponse* p) {
  for (size_t i = 0; i < d.items.size(); ++i) {
    v1::AttendResult* result = p->add_results();
    const absl::StatusOr<std::vector<float>>& out = d.items[i];
    if (!out.ok()) {
      result->mutable_status()->set_code(static_cast<int>(out.status().code()));
      result->mutable_status()->set_message(
          absl::StrCat("items[", i, "]: ", out.status().message()));
      result->set_retry_after_ms(RetryAfterMs(out.status()));
      continue;
    }
    result->mutable_status()->set_code(0);
    if (i < d.dtypes.size() && d.dtypes[i] == KvDtype::kBF16) {
      std::string* bytes = result->mutable_output();
      bytes->resize(out->size() * 2);
      char* dst = bytes->data();
      for (size_t j = 0; j < out->size(); ++j) {
        const uint16_t h = kernels::FloatToBf16((*out)[j]);
        std::memcpy(dst + 2 * j, &h, 2);
      }
    } else {
      result->set_output(reinterpret_cast<const char*>(out->data()),
                         out->size() * sizeof(float));
    }
  }
}

void ToProto(const ReadResult& d, uint32_t layer, KvDtype dtype,
             uint32_t offset, uint32_t n, v1::KvChunk* p) {
  p->set_layer(layer);
  p->set_first_token(d.first_token + offset);
  p->set_num_tokens(n);
  p->set_dtype(static_cast<v1::KvDtype>(dtype));
  const size_t values = static_cast<size_t>(n) * d.token_values;
  const float* k = d.k.data() + static_cast<size_t>(offset) * d.token_values;
  const float* v = d.v.data() + static_cast<size_t>(offset) * d.token_values;
  if (dtype == KvDtype::kF32) {
    p->set_k(reinterpret_cast<const char*>(k), values * sizeof(float));
    p->set_v(reinterpret_cast<const char*>(v), values * sizeof(float));
    return;
  }
  std::vector<uint16_t> kb(values), vb(values);
  for (size_t i = 0; i < values; ++i) {
    kb[i] = kernels::FloatToBf16(k[i]);
    vb[i] = kernels::FloatToBf16(v[i]);
  }
  p->set_k(reinterpret_cast<const char*>(kb.data()), values * 2);
  p->set_v(reinterpret_cast<const char*>(vb.data()), values * 2);
}

void ToProto(const InventorySnapshot& d, v1::Inventory* p) {
  for (const auto& [id, blocks] : d.described) {
    v1::DescribedSequence* ds = p->add_described();
    ds->set_sequence_id(id);
    for (const BlockSpec& b : blocks) ToProto(b, ds->add_blocks());
  }
  p->set_capacity_bytes(d.capacity_bytes);
  p->set_used_bytes(d.used_bytes);
  p->set_window_bytes(d.window_bytes);
  for (const auto& [format, usage] : d.formats) {
    v1::FormatInventory* f = p->add_formats();
    f->set_format(static_cast<v1::Format>(format));
    f->set_pages_used(usage.pages);
    f->set_bytes_used(usage.bytes);
  }
  for (const std::string& id : d.sequence_ids) p->add_sequence_ids(id);
  for (const auto& [tier, usage] :
       {std::pair<v1::Tier, const TierUsage*>{v1::TIER_HOST, &d.host},
        {v1::TIER_DISK, &d.disk}}) {
    v1::TierInventory* t = p->add_tiers();
    t->set_tier(tier);
    t->set_capacity_bytes(usage->capacity_bytes);
    t->set_used_bytes(usage->used_bytes);
    t->set_blocks(usage->blocks);
    t->set_free_bytes(usage->free_bytes);
    t->set_free_runs(usage->free_runs);
  }
  p->set_spills(d.spills);
  p->set_restores(d.restores);
  p->set_checksum_failures(d.checksum_failures);
  p->set_evictions(d.evictions);
  p->set_device_error(d.device_error);
  const AllocatorStats& a = d.arena;
  p->set_frame_bytes(a.frame_bytes);
  p->set_frames(a.frames);
  p->set_free_frames(a.free_frames);
  p->set_free_bytes(a.free_bytes);
  p->set_tail_bytes(a.tail_bytes);
  p->set_fragmentation(a.fragmentation);
  for (const PoolStats& pool : a.pools) {
    v1::PoolInventory* q = p->add_pools();
    q->set_format(static_cast<v1::Format>(pool.encoding.k));
    q->set_format_v(static_cast<v1::Format>(pool.encoding.v));
    q->set_group_size(static_cast<uint32_t>(pool.encoding.Group()));
    q->set_scale_dtype(static_cast<v1::ScaleDtype>(pool.encoding.scale_dtype));
    q->set_page_bytes(pool.page_bytes);
    q->set_pages_per_frame(pool.pages_per_frame);
    q->set_frames(pool.frames);
    q->set_pages_used(pool.pages_used);
    q->set_free_slots(pool.free_slots);
    q->set_allocatable_pages(pool.allocatable_pages);
    q->set_free_slots_compacted(pool.free_slots_compacted);
  }
  p->set_compactions(a.compactions);
  p->set_pages_moved(a.pages_moved);
  p->set_bytes_moved(a.bytes_moved);
  p->set_frames_freed_by_compaction(a.frames_freed_by_compaction);
  p->set_free_frames_compacted(a.free_frames_compacted);
}

// ---------------------------------------------------------------------------
// Transfers

ImportRequest FromProto(const v1::ImportSequenceRequest& p) {
  ImportRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) {
    // The capability is fresh on every attempt: not part of the payload.
    v1::ImportSequenceRequest payload = p;
    payload.clear_source_capability();
    d.fingerprint = ProtoFingerprint(payload);
  }
  d.transfer_id = p.transfer_id();
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.model = FromProto(p.model());
  d.block_tokens = p.block_tokens();
  if (p.has_window_tokens()) d.window_tokens = p.window_tokens();
  d.blocks = PlanFromProto(p.blocks());
  d.source_address = p.source_address();
  d.source_worker_id = p.source_worker_id();
  if (p.has_source_capability()) {
    d.source_capability = p.source_capability().SerializeAsString();
  }
  d.timeout_ms = p.timeout_ms();
  d.follow_writes = p.follow_writes();
  d.prefix_sequence_id = p.prefix_sequence_id();
  d.prefix_blocks = p.prefix_blocks();
  return d;
}

ExportRequest FromProto(const v1::ExportPagesRequest& p) {
  ExportRequest d;
  d.transfer_id = p.transfer_id();
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.blocks = PlanFromProto(p.blocks());
  d.follow_writes = p.follow_writes();
  return d;
}

v1::ExportPagesRequest ExportRequestFor(const ImportRequest& req) {
  v1::ExportPagesRequest r;
  r.set_transfer_id(req.transfer_id);
  r.set_tenant_id(req.tenant_id);
  r.set_sequence_id(req.sequence_id);
  r.set_follow_writes(req.follow_writes);
  for (const BlockSpec& b : req.blocks) {
    // Evicted blocks have no pages; a prefix hit's blocks are shared here.
    if (b.evicted || b.index < req.prefix_blocks) continue;
    v1::BlockPlan* out = r.add_blocks();
    out->set_index(b.index);
    out->set_lineage_id(b.lineage_id);
    EncodingToProto(b.encoding, out);
  }
  return r;
}

TransferPage FromProto(v1::PagePayload* p) {
  TransferPage d;
  d.layer = p->layer();
  d.block_index = p->block_index();
  d.lineage_id = p->lineage_id();
  d.encoding = EncodingFromProto(*p);
  d.num_tokens = p->num_tokens();
  d.sealed = p->sealed();
  d.data = std::move(*p->mutable_data());
  d.crc32c = p->crc32c();
  d.shared = p->shared();
  d.arena_offset = p->arena_offset();
  d.shared_bytes = p->shared_bytes();
  return d;
}

void ToProto(TransferPage&& d, v1::PagePayload* p) {
  p->set_layer(d.layer);
  p->set_block_index(d.block_index);
  p->set_lineage_id(d.lineage_id);
  EncodingToProto(d.encoding, p);
  p->set_num_tokens(d.num_tokens);
  p->set_sealed(d.sealed);
  *p->mutable_data() = std::move(d.data);
  p->set_crc32c(d.crc32c);
  p->set_shared(d.shared);
  p->set_arena_offset(d.arena_offset);
  p->set_shared_bytes(d.shared_bytes);
}

void AppendRefs(absl::Span<const TransferPage> pages, v1::PageBatch* batch) {
  v1::PageRefs* r = batch->mutable_refs();
  // The batch's encodings so far, to find each page's index (a handful).
  std::vector<Encoding> known;
  known.reserve(batch->encodings_size() + 4);
  for (const v1::PageEncoding& e : batch->encodings()) {
    known.push_back(EncodingFromProto(e));
  }
  const int n = r->layer_size() + static_cast<int>(pages.size());
  r->mutable_layer()->Reserve(n);
  r->mutable_block_index()->Reserve(n);
  r->mutable_lineage_id()->Reserve(n);
  r->mutable_encoding()->Reserve(n);
  r->mutable_num_tokens()->Reserve(n);
  r->mutable_sealed()->Reserve(n);
  r->mutable_offset()->Reserve(n);
  r->mutable_bytes()->Reserve(n);
  r->mutable_crc32c()->Reserve(n);
  size_t last = 0;  // consecutive pages mostly share an encoding
  for (const TransferPage& d : pages) {
    if (last >= known.size() || !(known[last] == d.encoding)) {
      last = std::find(known.begin(), known.end(), d.encoding) - known.begin();
      if (last == known.size()) {
        known.push_back(d.encoding);
        EncodingToProto(d.encoding, batch->add_encodings());
      }
    }
    r->add_layer(d.layer);
    r->add_block_index(d.block_index);
    r->add_lineage_id(d.lineage_id);
    r->add_encoding(static_cast<uint32_t>(last));
    r->add_num_tokens(d.num_tokens);
    r->add_sealed(d.sealed);
    r->add_offset(d.arena_offset);
    r->add_bytes(d.shared_bytes);
    r->add_crc32c(d.crc32c);
  }
}

absl::Status PagesWithoutBytes(v1::PageBatch* batch,
                               std::vector<TransferPage>* out) {
  const v1::PageRefs& r = batch->refs();
  const int n = r.layer_size();
  const std::pair<const char*, int> sizes[] = {
      {"block_index", r.block_index_size()},
      {"lineage_id", r.lineage_id_size()},
      {"encoding", r.encoding_size()},
      {"num_tokens", r.num_tokens_size()},
      {"sealed", r.sealed_size()},
      {"offset", r.offset_size()},
      {"bytes", r.bytes_size()},
      {"crc32c", r.crc32c_size()}};
  for (const auto& [field, size] : sizes) {
    if (size != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "refs.", field, " has ", size, " entries; refs.layer has ", n));
    }
  }
  std::vector<Encoding> encodings;
  encodings.reserve(batch->encodings_size());
  for (const v1::PageEncoding& e : batch->encodings()) {
    encodings.push_back(EncodingFromProto(e));
  }
  out->reserve(out->size() + batch->pages_size() + n);
  for (v1::PagePayload& payload : *batch->mutable_pages()) {
    out->push_back(FromProto(&payload));
  }
  for (int i = 0; i < n; ++i) {
    const uint32_t e = r.encoding(i);
    if (e >= encodings.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("refs.encoding[", i, "]=", e, " is not an index into ",
                       encodings.size(), " encodings"));
    }
    TransferPage& d = out->emplace_back();
    d.layer = r.layer(i);
    d.block_index = r.block_index(i);
    d.lineage_id = r.lineage_id(i);
    d.encoding = encodings[e];
    d.num_tokens = r.num_tokens(i);
    d.sealed = r.sealed(i);
    d.crc32c = r.crc32c(i);
    d.shared = true;
    d.arena_offset = r.offset(i);
    d.shared_bytes = r.bytes(i);
  }
  return absl::OkStatus();
}

void RunWriter::Add(const TransferPage& page) {
  if (open_ && page.layer == layer_ &&
      page.block_index == first_block_ + count_ && page.sealed == sealed_ &&
      page.num_tokens == num_tokens_ && page.shared_bytes == bytes_ &&
      page.encoding == encoding_) {
    bool next = false;
    if (count_ == 1) {
      next = page.arena_offset >= offset_ + bytes_;
      if (next) stride_ = page.arena_offset - offset_;
    } else {
      next = page.arena_offset == offset_ + stride_ * count_;
    }
    if (next) {
      count_ += 1;
      v1::PageRuns* r = batch_->mutable_runs();
      r->add_lineage_id(page.lineage_id);
      r->add_crc32c(page.crc32c);
      pages_ += 1;
      return;
    }
  }
  Finish();
  if (known_.empty() || !(known_[encoding_index_] == page.encoding)) {
    encoding_index_ = static_cast<uint32_t>(
        std::find(known_.begin(), known_.end(), page.encoding) -
        known_.begin());
    if (encoding_index_ == known_.size()) {
      known_.push_back(page.encoding);
      EncodingToProto(page.encoding, batch_->add_encodings());
    }
  }
  open_ = true;
  encoding_ = page.encoding;
  layer_ = page.layer;
  first_block_ = page.block_index;
  count_ = 1;
  num_tokens_ = page.num_tokens;
  sealed_ = page.sealed;
  offset_ = page.arena_offset;
  bytes_ = page.shared_bytes;
  stride_ = bytes_;
  v1::PageRuns* r = batch_->mutable_runs();
  r->add_lineage_id(page.lineage_id);
  r->add_crc32c(page.crc32c);
  pages_ += 1;
}

void RunWriter::Finish() {
  if (!open_) return;
  open_ = false;
  v1::PageRuns* r = batch_->mutable_runs();
  r->add_layer(layer_);
  r->add_first_block(first_block_);
  r->add_count(count_);
  r->add_encoding(encoding_index_);
  r->add_num_tokens(num_tokens_);
  r->add_sealed(sealed_);
  r->add_offset(offset_);
  r->add_stride(stride_);
  r->add_bytes(bytes_);
}

void RunWriter::Reset() {
  known_.clear();
  encoding_index_ = 0;
  pages_ = 0;
  open_ = false;
}

absl::Status SharedRunsOf(const v1::PageBatch& batch,
                          std::vector<SharedRun>* out) {
  if (!batch.has_runs()) return absl::OkStatus();
  const v1::PageRuns& r = batch.runs();
  const int n = r.layer_size();
  const std::pair<const char*, int> sizes[] = {
      {"first_block", r.first_block_size()},
      {"count", r.count_size()},
      {"encoding", r.encoding_size()},
      {"num_tokens", r.num_tokens_size()},
      {"sealed", r.sealed_size()},
      {"offset", r.offset_size()},
      {"stride", r.stride_size()},
      {"bytes", r.bytes_size()}};
  for (const auto& [field, size] : sizes) {
    if (size != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "runs.", field, " has ", size, " entries; runs.layer has ", n));
    }
  }
  uint64_t pages = 0;
  for (int i = 0; i < n; ++i) pages += r.count(i);
  if (pages != static_cast<uint64_t>(r.lineage_id_size()) ||
      pages != static_cast<uint64_t>(r.crc32c_size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "runs.lineage_id has ", r.lineage_id_size(), " and runs.crc32c ",
        r.crc32c_size(), " entries; the runs' counts sum to ", pages));
  }
  std::vector<Encoding> encodings;
  encodings.reserve(batch.encodings_size());
  for (const v1::PageEncoding& e : batch.encodings()) {
    encodings.push_back(EncodingFromProto(e));
  }
  out->reserve(out->size() + n);
  const uint64_t* lineage = r.lineage_id().data();
  const uint32_t* crc = r.crc32c().data();
  for (int i = 0; i < n; ++i) {
    const uint32_t e = r.encoding(i);
    if (e >= encodings.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("runs.encoding[", i, "]=", e, " is not an index into ",
                       encodings.size(), " encodings"));
    }
    SharedRun& run = out->emplace_back();
    run.layer = r.layer(i);
    run.first_block = r.first_block(i);
    run.count = r.count(i);
    run.encoding = encodings[e];
    run.num_tokens = r.num_tokens(i);
    run.sealed = r.sealed(i);
    run.offset = r.offset(i);
    run.stride = r.stride(i);
    run.bytes = r.bytes(i);
    run.lineage_ids = lineage;
    run.crc32cs = crc;
    lineage += run.count;
    crc += run.count;
  }
  return absl::OkStatus();
}

void ToProto(const ImportReply& d, v1::ImportSequenceResponse* p) {
  p->set_pages(d.result.pages);
  p->set_wire_bytes(d.result.wire_bytes);
  p->set_bf16_bytes(d.result.bf16_bytes);
  p->set_page_bytes(d.result.page_bytes);
  p->set_seconds(d.seconds);
  for (double s : d.result.layer_done_seconds) p->add_layer_done_seconds(s);
  p->set_data_path(d.data_path);
  p->set_copy_seconds(d.result.copy_seconds);
  p->set_reserve_seconds(d.result.reserve_seconds);
  p->set_wait_seconds(d.result.wait_seconds);
  p->set_commit_seconds(d.result.commit_seconds);
}

}  // namespace triax::worker
