#include "worker/worker_service.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/model_proto.h"
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

// The returned view points into `c`.
KvWrite WriteFromProto(const v1::KvChunk& c) {
  KvWrite w;
  w.layer = c.layer();
  w.first_token = c.first_token();
  w.num_tokens = c.num_tokens();
  w.dtype = static_cast<int>(c.dtype());
  w.k = c.k();
  w.v = c.v();
  return w;
}

absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

void InventoryToProto(const InventorySnapshot& inv, v1::Inventory* out) {
  out->set_capacity_bytes(inv.capacity_bytes);
  out->set_used_bytes(inv.used_bytes);
  out->set_window_bytes(inv.window_bytes);
  for (const auto& [format, usage] : inv.formats) {
    v1::FormatInventory* f = out->add_formats();
    f->set_format(static_cast<v1::Format>(format));
    f->set_pages_used(usage.pages);
    f->set_bytes_used(usage.bytes);
  }
  for (const std::string& id : inv.sequence_ids) out->add_sequence_ids(id);
  for (const auto& [tier, usage] :
       {std::pair<v1::Tier, const TierUsage*>{v1::TIER_HOST, &inv.host},
        {v1::TIER_DISK, &inv.disk}}) {
    v1::TierInventory* t = out->add_tiers();
    t->set_tier(tier);
    t->set_capacity_bytes(usage->capacity_bytes);
    t->set_used_bytes(usage->used_bytes);
    t->set_blocks(usage->blocks);
  }
  out->set_spills(inv.spills);
  out->set_restores(inv.restores);
  out->set_checksum_failures(inv.checksum_failures);
  out->set_evictions(inv.evictions);
  out->set_device_error(inv.device_error);
}

WorkerService::WorkerService(SequenceStore* store) : store_(store) {}

grpc::Status WorkerService::AllocatePages(grpc::ServerContext*,
                                          const v1::AllocatePagesRequest* req,
                                          v1::AllocatePagesResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (auto hit =
          allocate_cache_.Find(absl::StrCat("AllocatePages/", req->tenant_id()),
                               req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  const std::vector<BlockSpec> plan = PlanFromProto(req->blocks());
  std::optional<uint32_t> window;
  if (req->has_window_tokens()) window = req->window_tokens();
  absl::StatusOr<AllocateResult> r = store_->AllocatePages(
      req->tenant_id(), req->sequence_id(), FromProto(req->model()),
      req->block_tokens(), plan, window);
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_allocated(r->pages_allocated);
  resp->set_bytes_allocated(r->bytes_allocated);
  allocate_cache_.Put(absl::StrCat("AllocatePages/", req->tenant_id()),
                      req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ForkSequence(grpc::ServerContext*,
                                         const v1::WorkerForkRequest* req,
                                         v1::WorkerForkResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (auto hit = fork_cache_.Find(
          absl::StrCat("ForkSequence/", req->tenant_id()), req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  const std::vector<BlockSpec> plan = PlanFromProto(req->blocks());
  absl::StatusOr<ForkResult> r =
      store_->Fork(req->tenant_id(), req->parent_sequence_id(),
                   req->child_sequence_id(), req->num_tokens(), plan);
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_shared(r->pages_shared);
  resp->set_pages_copied(r->pages_copied);
  fork_cache_.Put(absl::StrCat("ForkSequence/", req->tenant_id()),
                  req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::WriteKV(
    grpc::ServerContext*, grpc::ServerReader<v1::WriteKVRequest>* reader,
    v1::WriteKVResponse* resp) {
  v1::WriteKVRequest msg;
  std::string request_id, tenant_id;
  bool replay = false;
  uint64_t tokens = 0, bytes = 0;
  for (uint64_t index = 0; reader->Read(&msg); ++index) {
    if (index == 0) {
      request_id = msg.request_id();
      tenant_id = msg.tenant_id();
      if (absl::Status s = ValidateRequestId(request_id); !s.ok()) {
        return ToGrpcStatus(s);
      }
      if (auto hit = write_cache_.Find(
              absl::StrCat("WriteKV/", msg.tenant_id()), request_id)) {
        *resp = hit->reply;
        replay = true;
      }
    }
    if (replay) continue;  // drain the stream; it was applied before
    if (!msg.has_chunk()) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("message ", index, ": chunk is missing")));
    }
    absl::StatusOr<uint64_t> n = store_->Write(
        msg.tenant_id(), msg.sequence_id(), WriteFromProto(msg.chunk()));
    if (!n.ok()) {
      return ToGrpcStatus(Prefixed(
          n.status(),
          absl::StrCat("message ", index, " (", tokens,
                       " tokens of earlier messages were written): ")));
    }
    tokens += *n;
    bytes += msg.chunk().k().size() + msg.chunk().v().size();
  }
  if (replay) return grpc::Status::OK;
  resp->set_tokens_written(tokens);
  resp->set_bytes_received(bytes);
  write_cache_.Put(absl::StrCat("WriteKV/", tenant_id), request_id,
                   absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ReadKV(grpc::ServerContext* ctx,
                                   const v1::ReadKVRequest* req,
                                   grpc::ServerWriter<v1::KvChunk>* writer) {
  const v1::KvDtype dtype = req->dtype();
  if (dtype != v1::KV_DTYPE_F32 && dtype != v1::KV_DTYPE_BF16) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "dtype=", static_cast<int>(dtype), " is not F32 (1) or BF16 (2)")));
  }
  absl::StatusOr<ReadResult> r =
      store_->Read(req->tenant_id(), req->sequence_id(), req->layer(),
                   req->first_token(), req->num_tokens());
  if (!r.ok()) return ToGrpcStatus(r.status());
  const size_t per = r->token_values;
  for (uint32_t done = 0; done < r->num_tokens;) {
    if (ctx->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "ReadKV cancelled");
    }
    const uint32_t n = std::min(kMaxReadChunkTokens, r->num_tokens - done);
    v1::KvChunk chunk;
    chunk.set_layer(req->layer());
    chunk.set_first_token(r->first_token + done);
    chunk.set_num_tokens(n);
    chunk.set_dtype(dtype);
    const float* k = r->k.data() + done * per;
    const float* v = r->v.data() + done * per;
    const size_t values = n * per;
    if (dtype == v1::KV_DTYPE_F32) {
      chunk.set_k(reinterpret_cast<const char*>(k), values * 4);
      chunk.set_v(reinterpret_cast<const char*>(v), values * 4);
    } else {
      std::vector<uint16_t> kb(values), vb(values);
      for (size_t i = 0; i < values; ++i) {
        kb[i] = kernels::FloatToBf16(k[i]);
        vb[i] = kernels::FloatToBf16(v[i]);
      }
      chunk.set_k(reinterpret_cast<const char*>(kb.data()), values * 2);
      chunk.set_v(reinterpret_cast<const char*>(vb.data()), values * 2);
    }
    if (!writer->Write(chunk)) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "ReadKV client went away");
    }
    done += n;
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Attend(grpc::ServerContext*,
                                   const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) {
  if (absl::Status s = ValidateId("tenant_id", req->tenant_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  // Every item goes to the store as one batch (one device launch for the
  // items that pass validation); results stay per item.
  const int n = req->items_size();
  std::vector<KvWrite> appends(n);  // stable: specs point into it
  std::vector<AttendBatchItem> items(n);
  for (int i = 0; i < n; ++i) {
    const v1::AttendItem& item = req->items(i);
    AttendSpec& spec = items[i].spec;
    items[i].sequence_id = item.sequence_id();
    spec.layer = item.layer();
    spec.num_queries = item.num_queries();
    spec.positions =
        absl::MakeConstSpan(item.positions().data(), item.positions().size());
    spec.queries = item.queries();
    spec.scale = item.scale();
    if (item.has_append()) {
      appends[i] = WriteFromProto(item.append());
      spec.append = &appends[i];
    }
  }
  std::vector<absl::StatusOr<std::vector<float>>> outs =
      store_->AttendBatch(req->tenant_id(), items);
  for (int i = 0; i < n; ++i) {
    v1::AttendResult* result = resp->add_results();
    const absl::StatusOr<std::vector<float>>& out = outs[i];
    if (!out.ok()) {
      result->mutable_status()->set_code(static_cast<int>(out.status().code()));
      result->mutable_status()->set_message(
          absl::StrCat("items[", i, "]: ", out.status().message()));
      result->set_retry_after_ms(RetryAfterMs(out.status()));
      continue;
    }
    result->mutable_status()->set_code(0);
    result->set_output(reinterpret_cast<const char*>(out->data()),
                       out->size() * sizeof(float));
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::FreePages(grpc::ServerContext*,
                                      const v1::FreePagesRequest* req,
                                      v1::FreePagesResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (auto hit = free_cache_.Find(absl::StrCat("FreePages/", req->tenant_id()),
                                  req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  absl::StatusOr<FreeResult> r =
      store_->Free(req->tenant_id(), req->sequence_id());
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_freed(r->pages_freed);
  resp->set_bytes_freed(r->bytes_freed);
  free_cache_.Put(absl::StrCat("FreePages/", req->tenant_id()),
                  req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Demote(grpc::ServerContext*,
                                   const v1::DemoteRequest* req,
                                   v1::DemoteResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (auto hit = demote_cache_.Find(absl::StrCat("Demote/", req->tenant_id()),
                                    req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  const std::vector<BlockSpec> blocks = PlanFromProto(req->blocks());
  absl::StatusOr<DemoteResult> r =
      store_->Demote(req->tenant_id(), req->sequence_id(), blocks);
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_reencoded(r->pages_reencoded);
  resp->set_bytes_delta(r->bytes_delta);
  demote_cache_.Put(absl::StrCat("Demote/", req->tenant_id()),
                    req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Spill(grpc::ServerContext*,
                                  const v1::SpillRequest* req,
                                  v1::SpillResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  const std::string scope = absl::StrCat("Spill/", req->tenant_id());
  if (auto hit = spill_cache_.Find(scope, req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  if (req->tier() != v1::TIER_HOST && req->tier() != v1::TIER_DISK) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("tier=", static_cast<int>(req->tier()),
                     " is not TIER_HOST (2) or TIER_DISK (3)")));
  }
  if (req->lineage_ids().empty()) {
    return ToGrpcStatus(
        absl::InvalidArgumentError("lineage_ids is empty; name >= 1 block"));
  }
  absl::StatusOr<SpillResult> r = store_->Spill(
      req->tenant_id(), req->sequence_id(),
      absl::MakeConstSpan(req->lineage_ids().data(), req->lineage_ids_size()),
      static_cast<Tier>(req->tier()));
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_moved(r->pages_moved);
  resp->set_bytes_moved(r->bytes_moved);
  resp->set_device_bytes_freed(r->device_bytes_freed);
  spill_cache_.Put(scope, req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Restore(grpc::ServerContext*,
                                    const v1::RestoreRequest* req,
                                    v1::RestoreResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  const std::string scope = absl::StrCat("Restore/", req->tenant_id());
  if (auto hit = restore_cache_.Find(scope, req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  absl::StatusOr<RestoreResult> r = store_->Restore(
      req->tenant_id(), req->sequence_id(),
      absl::MakeConstSpan(req->lineage_ids().data(), req->lineage_ids_size()),
      req->background());
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_restored(r->pages_restored);
  resp->set_bytes_restored(r->bytes_restored);
  resp->set_blocks_queued(r->blocks_queued);
  restore_cache_.Put(scope, req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Evict(grpc::ServerContext*,
                                  const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) {
  if (absl::Status s = ValidateRequestId(req->request_id()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  const std::string scope = absl::StrCat("Evict/", req->tenant_id());
  if (auto hit = evict_cache_.Find(scope, req->request_id())) {
    *resp = hit->reply;
    return ToGrpcStatus(hit->status);
  }
  if (req->lineage_ids().empty()) {
    return ToGrpcStatus(
        absl::InvalidArgumentError("lineage_ids is empty; name >= 1 block"));
  }
  absl::StatusOr<EvictResult> r = store_->Evict(
      req->tenant_id(), req->sequence_id(),
      absl::MakeConstSpan(req->lineage_ids().data(), req->lineage_ids_size()));
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_pages_freed(r->pages_freed);
  resp->set_bytes_freed(r->bytes_freed);
  evict_cache_.Put(scope, req->request_id(), absl::OkStatus(), *resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetInventory(grpc::ServerContext*,
                                         const v1::GetInventoryRequest*,
                                         v1::Inventory* resp) {
  InventoryToProto(store_->Inventory(), resp);
  return grpc::Status::OK;
}

}  // namespace triax::worker
