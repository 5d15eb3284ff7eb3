#include "worker/worker_core.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::worker {
namespace {

// `s` with `prefix` before its message; code and payloads (e.g. the retry
// delay) kept.
absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(prefix, s.message()));
  s.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

absl::Status EmptyLineageIds() {
  return absl::InvalidArgumentError("lineage_ids is empty; name >= 1 block");
}

}  // namespace

class WorkerCore::InFlight {
 public:
  InFlight(WorkerCore* core, std::string key)
      : core_(core), key_(std::move(key)) {
    absl::MutexLock lock(&core_->in_flight_mu_);
    auto free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->in_flight_mu_) {
      return !core_->in_flight_.contains(key_);
    };
    core_->in_flight_mu_.Await(absl::Condition(&free));
    core_->in_flight_.insert(key_);
  }
  ~InFlight() {
    absl::MutexLock lock(&core_->in_flight_mu_);
    core_->in_flight_.erase(key_);
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  WorkerCore* const core_;
  const std::string key_;
};

WorkerCore::WorkerCore(SequenceStore* store, Device* device,
                       WorkerCoreOptions options)
    : store_(store),
      device_(device),
      allocate_cache_(options.idempotency_capacity),
      fork_cache_(options.idempotency_capacity),
      write_cache_(options.idempotency_capacity),
      demote_cache_(options.idempotency_capacity),
      free_cache_(options.idempotency_capacity),
      spill_cache_(options.idempotency_capacity),
      restore_cache_(options.idempotency_capacity),
      evict_cache_(options.idempotency_capacity),
      import_cache_(options.idempotency_capacity) {}

namespace {

// The fingerprint of one WriteKV message folded into `h`.
uint64_t AddWriteMessage(uint64_t h, const WriteMessage& m) {
  h = FingerprintAdd(h, m.sequence_id);
  if (!m.chunk.has_value()) return FingerprintAdd(h, "no chunk");
  const KvWrite& c = *m.chunk;
  h = FingerprintAdd(h, absl::StrCat(c.layer, ",", c.first_token, ",",
                                     c.num_tokens, ",", c.dtype));
  h = FingerprintAdd(h, c.k);
  return FingerprintAdd(h, c.v);
}

}  // namespace

template <typename Reply, typename Apply>
absl::StatusOr<Reply> WorkerCore::Once(IdempotencyCache<Reply>& cache,
                                       absl::string_view method,
                                       const std::string& tenant_id,
                                       const std::string& request_id,
                                       uint64_t fingerprint, Apply apply) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(request_id));
  if (request_id.empty()) return apply();
  const std::string scope = absl::StrCat(method, "/", tenant_id);
  // The '\0' keeps (scope, id) pairs apart: ids have no '\0'.
  InFlight hold(this,
                absl::StrCat(scope, absl::string_view("\0", 1), request_id));
  TRIAX_ASSIGN_OR_RETURN(auto hit,
                         cache.Lookup(scope, request_id, fingerprint, method));
  if (hit) return std::move(hit->reply);
  absl::StatusOr<Reply> result = apply();
  if (result.ok()) {
    cache.Put(scope, request_id, fingerprint, absl::OkStatus(), *result);
  }
  return result;
}

absl::StatusOr<AllocateResult> WorkerCore::AllocatePages(
    const AllocatePagesRequest& req) {
  return Once(allocate_cache_, "AllocatePages", req.tenant_id, req.request_id,
              req.fingerprint, [&] {
                return store_->AllocatePages(req.tenant_id, req.sequence_id,
                                             req.model, req.block_tokens,
                                             req.blocks, req.window_tokens);
              });
}

absl::StatusOr<ForkResult> WorkerCore::Fork(const ForkRequest& req) {
  return Once(fork_cache_, "ForkSequence", req.tenant_id, req.request_id,
              req.fingerprint, [&] {
                return store_->Fork(req.tenant_id, req.parent_sequence_id,
                                    req.child_sequence_id, req.num_tokens,
                                    req.blocks, req.parent_tenant_id);
              });
}

absl::StatusOr<WriteResult> WorkerCore::WriteKV(const WriteStream& stream) {
  WriteMessage first;
  TRIAX_ASSIGN_OR_RETURN(const bool any, stream.next(&first));
  if (!any) return WriteResult{};
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(first.request_id));
  if (first.request_id.empty()) return WriteMessages(stream, first, nullptr);
  uint64_t fingerprint = 0;
  const std::string scope = absl::StrCat("WriteKV/", first.tenant_id);
  InFlight hold(
      this, absl::StrCat(scope, absl::string_view("\0", 1), first.request_id));
  if (auto hit = write_cache_.Find(scope, first.request_id)) {
    // A remembered stream was applied before: pull the rest, write nothing,
    // and answer the first reply if it carried the same messages.
    fingerprint = AddWriteMessage(fingerprint, first);
    WriteMessage rest;
    while (true) {
      TRIAX_ASSIGN_OR_RETURN(const bool more, stream.next(&rest));
      if (!more) break;
      fingerprint = AddWriteMessage(fingerprint, rest);
    }
    if (fingerprint != hit->fingerprint) {
      return RequestIdReused("WriteKV", first.request_id);
    }
    return hit->reply;
  }
  absl::StatusOr<WriteResult> result =
      WriteMessages(stream, first, &fingerprint);
  if (result.ok()) {
    write_cache_.Put(scope, first.request_id, fingerprint, absl::OkStatus(),
                     *result);
  }
  return result;
}

absl::StatusOr<WriteResult> WorkerCore::WriteMessages(const WriteStream& stream,
                                                      const WriteMessage& first,
                                                      uint64_t* fingerprint) {
  WriteResult result;
  WriteMessage later;
  const WriteMessage* msg = &first;
  for (uint64_t index = 0;; ++index) {
    if (!msg->chunk.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("message ", index, ": chunk is missing"));
    }
    if (fingerprint != nullptr) {
      *fingerprint = AddWriteMessage(*fingerprint, *msg);
    }
    absl::StatusOr<uint64_t> n =
        store_->Write(msg->tenant_id, msg->sequence_id, *msg->chunk);
    if (!n.ok()) {
      return Prefixed(
          n.status(),
          absl::StrCat("message ", index, " (", result.tokens_written,
                       " tokens of earlier messages were "
                       "written): "));
    }
    result.tokens_written += *n;
    result.bytes_received += msg->chunk->k.size() + msg->chunk->v.size();
    // `msg`'s views are dead once the next message is pulled.
    TRIAX_ASSIGN_OR_RETURN(const bool more, stream.next(&later));
    if (!more) return result;
    msg = &later;
  }
}

absl::StatusOr<DemoteResult> WorkerCore::Demote(const DemoteRequest& req) {
  return Once(demote_cache_, "Demote", req.tenant_id, req.request_id,
              req.fingerprint, [&] {
                return store_->Demote(req.tenant_id, req.sequence_id,
                                      req.blocks);
              });
}

absl::StatusOr<FreeResult> WorkerCore::Free(const FreeRequest& req) {
  return Once(free_cache_, "FreePages", req.tenant_id, req.request_id,
              req.fingerprint,
              [&] { return store_->Free(req.tenant_id, req.sequence_id); });
}

absl::StatusOr<SpillResult> WorkerCore::Spill(const SpillRequest& req) {
  return Once(spill_cache_, "Spill", req.tenant_id, req.request_id,
              req.fingerprint, [&]() -> absl::StatusOr<SpillResult> {
                if (req.tier != Tier::kHost && req.tier != Tier::kDisk) {
                  return absl::InvalidArgumentError(
                      absl::StrCat("tier=", static_cast<int>(req.tier),
                                   " is not TIER_HOST (2) or TIER_DISK (3)"));
                }
                if (req.lineage_ids.empty()) return EmptyLineageIds();
                return store_->Spill(req.tenant_id, req.sequence_id,
                                     req.lineage_ids, req.tier);
              });
}

absl::StatusOr<RestoreResult> WorkerCore::Restore(const RestoreRequest& req) {
  return Once(restore_cache_, "Restore", req.tenant_id, req.request_id,
              req.fingerprint, [&] {
                return store_->Restore(req.tenant_id, req.sequence_id,
                                       req.lineage_ids, req.background);
              });
}

absl::StatusOr<EvictResult> WorkerCore::Evict(const EvictRequest& req) {
  return Once(evict_cache_, "Evict", req.tenant_id, req.request_id,
              req.fingerprint, [&]() -> absl::StatusOr<EvictResult> {
                if (req.lineage_ids.empty()) return EmptyLineageIds();
                return store_->Evict(req.tenant_id, req.sequence_id,
                                     req.lineage_ids);
              });
}

absl::StatusOr<AttendResult> WorkerCore::Attend(const AttendRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", req.tenant_id));
  std::vector<AttendBatchItem> batch(req.items.size());
  for (size_t i = 0; i < req.items.size(); ++i) {
    const AttendItem& item = req.items[i];
    batch[i].sequence_id = item.sequence_id;
    batch[i].spec = item.spec;
    batch[i].spec.append = item.append.has_value() ? &*item.append : nullptr;
  }
  AttendResult result;
  result.items = store_->AttendBatch(req.tenant_id, batch);
  result.dtypes.reserve(req.items.size());
  for (const AttendItem& item : req.items) {
    result.dtypes.push_back(item.spec.dtype);
  }
  return result;
}

absl::StatusOr<ReadResult> WorkerCore::Read(const ReadRequest& req) {
  if (req.dtype != KvDtype::kF32 && req.dtype != KvDtype::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype=", static_cast<int>(req.dtype), " is not F32 (1) or BF16 (2)"));
  }
  return store_->Read(req.tenant_id, req.sequence_id, req.layer,
                      req.first_token, req.num_tokens);
}

absl::StatusOr<InventorySnapshot> WorkerCore::GetInventory(
    const InventoryRequest& req) const {
  if (req.describe_sequence_ids.size() > kMaxDescribed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "describe_sequence_ids has ", req.describe_sequence_ids.size(),
        " ids; at most ", kMaxDescribed));
  }
  InventorySnapshot snap = store_->Inventory();
  for (const std::string& id : req.describe_sequence_ids) {
    absl::StatusOr<SequenceSnapshot> d = store_->Describe(id);
    if (d.ok()) snap.described.emplace_back(id, std::move(d->blocks));
  }
  return snap;
}

std::vector<uint64_t> WorkerCore::TakeSelfRestored() {
  return store_->TakeSelfRestored();
}

std::vector<std::pair<uint64_t, int64_t>> WorkerCore::TakeSealed() {
  return store_->TakeSealed();
}

void WorkerCore::ReturnSealed(
    const std::vector<std::pair<uint64_t, int64_t>>& sealed) {
  store_->ReturnSealed(sealed);
}

void WorkerCore::ReturnSelfRestored(const std::vector<uint64_t>& lineage_ids) {
  store_->ReturnSelfRestored(lineage_ids);
}

void WorkerCore::DropLost(const std::vector<std::string>& sequence_ids) {
  for (const std::string& id : sequence_ids) (void)store_->Drop(id);
}

// ---------------------------------------------------------------------------
// Transfers

std::string SourceLabel(const ImportRequest& req) {
  return req.source_worker_id.empty()
             ? absl::StrCat("source worker at ", req.source_address)
             : absl::StrCat("source ", req.source_worker_id, " at ",
                            req.source_address);
}

absl::StatusOr<ImportReply> WorkerCore::Import(const ImportRequest& req,
                                               const PageFetcher& fetch) {
  auto import = [&]() -> absl::StatusOr<ImportReply> {
    if (req.source_address.empty()) {
      return absl::InvalidArgumentError(
          "source_address is empty; name the source worker's address");
    }
    if (req.timeout_ms > kMaxImportTimeoutMs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "timeout_ms=", req.timeout_ms, " is above ", kMaxImportTimeoutMs,
          " (0 means ", kDefaultImportTimeoutMs, ")"));
    }
    const absl::Time start = absl::Now();
    const uint32_t timeout_ms =
        req.timeout_ms == 0 ? kDefaultImportTimeoutMs : req.timeout_ms;
    ImportPlan plan;
    plan.tenant_id = req.tenant_id;
    plan.sequence_id = req.sequence_id;
    plan.model = req.model;
    plan.block_tokens = req.block_tokens;
    plan.window_tokens = req.window_tokens;
    plan.blocks = req.blocks;
    plan.source = SourceLabel(req);
    plan.prefix_sequence_id = req.prefix_sequence_id;
    plan.prefix_blocks = req.prefix_blocks;
    TRIAX_ASSIGN_OR_RETURN(std::unique_ptr<ImportSession> session,
                           store_->BeginImport(plan));
    ImportReply reply;
    bool pull = false;  // a block neither shared nor evicted
    for (const BlockSpec& b : req.blocks) {
      pull = pull || (!b.evicted && b.index >= req.prefix_blocks);
    }
    if (pull) {
      TRIAX_ASSIGN_OR_RETURN(
          reply.data_path,
          fetch(req, start + absl::Milliseconds(timeout_ms), session.get()));
    } else {
      reply.data_path = "none";
    }
    TRIAX_ASSIGN_OR_RETURN(reply.result, session->Commit());
    reply.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    return reply;
  };
  return Once(import_cache_, "ImportSequence", req.tenant_id, req.request_id,
              req.fingerprint, [&]() -> absl::StatusOr<ImportReply> {
                // Applied imports only (a remembered reply is not timed);
                // a failed one has no data path yet.
                const absl::Time start = absl::Now();
                absl::StatusOr<ImportReply> r = import();
                store_->timings().RecordImport(
                    r.ok() ? r->data_path : "unknown", r.ok(),
                    r.ok() ? r->result.wire_bytes : 0,
                    absl::ToDoubleSeconds(absl::Now() - start));
                return r;
              });
}

absl::Status WorkerCore::Export(const ExportRequest& req,
                                const ExportOptions& options, ExportSink sink) {
  std::vector<ExportBlock> blocks;
  blocks.reserve(req.blocks.size());
  for (const BlockSpec& b : req.blocks) {
    blocks.push_back(ExportBlock{b.index, b.lineage_id, b.encoding});
  }
  return store_->Export(req.tenant_id, req.sequence_id, blocks, options, sink);
}

}  // namespace triax::worker
