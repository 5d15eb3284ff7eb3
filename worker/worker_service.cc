#include "worker/worker_service.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "worker/convert.h"

namespace triax::worker {
namespace {

// A successful result into its response message.
template <typename Result, typename Message>
absl::Status Answer(const Result& result, Message* reply) {
  ToProto(result, reply);
  return absl::OkStatus();
}

// ReadKV's reply: the chunks, written to the client one by one.
struct ReadStream {
  grpc::ServerContext* ctx;
  grpc::ServerWriter<v1::KvChunk>* writer;
  uint32_t layer;
  KvDtype dtype;
};

absl::Status Answer(const ReadResult& result, ReadStream* out) {
  for (uint32_t done = 0; done < result.num_tokens;) {
    if (out->ctx->IsCancelled()) {
      return absl::CancelledError("ReadKV cancelled");
    }
    const uint32_t n =
        std::min(WorkerService::kMaxReadChunkTokens, result.num_tokens - done);
    v1::KvChunk chunk;
    ToProto(result, out->layer, out->dtype, done, n, &chunk);
    if (!out->writer->Write(chunk)) {
      return absl::CancelledError("ReadKV client went away");
    }
    done += n;
  }
  return absl::OkStatus();
}

}  // namespace

WorkerService::WorkerService(WorkerCore* core, WorkerServiceOptions options)
    : core_(core),
      options_(std::move(options)),
      transfers_(options_.device, options_.transfer_path,
                 options_.link_batch_bytes, options_.peer_credentials,
                 options_.peer_server_name) {}

namespace {

uint64_t PlanTokens(
    const google::protobuf::RepeatedPtrField<v1::BlockPlan>& b) {
  uint64_t tokens = 0;
  for (const v1::BlockPlan& p : b) tokens += p.num_tokens();
  return tokens;
}

}  // namespace

absl::Status WorkerService::Allowed(
    const grpc::ServerContext& ctx, absl::string_view method,
    const std::vector<CapabilityNeed>& needs) const {
  if (const auto names = options_.certificate_names.find(method);
      names != options_.certificate_names.end()) {
    const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth == nullptr) {
      return absl::UnauthenticatedError(
          absl::StrCat(method,
                       " needs a client certificate; the call has no "
                       "authentication context"));
    }
    TRIAX_RETURN_IF_ERROR(CheckPeerIdentity(
        *auth, absl::StrCat("/triax.v1.Worker/", method), names->second));
  }
  if (options_.capabilities == nullptr) return absl::OkStatus();
  return options_.capabilities->CheckAll(ctx, method, needs);
}

#define TRIAX_ALLOWED(ctx, method, ...)                              \
  if (absl::Status allowed = Allowed(*(ctx), method, {__VA_ARGS__}); \
      !allowed.ok()) {                                               \
    return ToGrpcStatus(allowed);                                    \
  }

template <typename Call, typename Request, typename Reply>
grpc::Status WorkerService::Serve(Call call, const Request& request,
                                  Reply* reply) {
  auto result = std::invoke(call, *core_, request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  return ToGrpcStatus(Answer(*result, reply));
}

grpc::Status WorkerService::AllocatePages(grpc::ServerContext* ctx,
                                          const v1::AllocatePagesRequest* req,
                                          v1::AllocatePagesResponse* resp) {
  TRIAX_ALLOWED(
      ctx, "AllocatePages",
      CapabilityNeed{req->tenant_id(), req->sequence_id(),
                     v1::Capability::SCOPE_CLIENT, PlanTokens(req->blocks())});
  return Serve(&WorkerCore::AllocatePages, FromProto(*req), resp);
}

grpc::Status WorkerService::ForkSequence(grpc::ServerContext* ctx,
                                         const v1::WorkerForkRequest* req,
                                         v1::WorkerForkResponse* resp) {
  TRIAX_ALLOWED(
      ctx, "ForkSequence",
      CapabilityNeed{req->tenant_id(), req->child_sequence_id(),
                     v1::Capability::SCOPE_CLIENT, PlanTokens(req->blocks())},
      CapabilityNeed{req->parent_tenant_id().empty() ? req->tenant_id()
                                                     : req->parent_tenant_id(),
                     req->parent_sequence_id(), v1::Capability::SCOPE_FORK});
  return Serve(&WorkerCore::Fork, FromProto(*req), resp);
}

grpc::Status WorkerService::WriteKV(
    grpc::ServerContext* ctx, grpc::ServerReader<v1::WriteKVRequest>* reader,
    v1::WriteKVResponse* resp) {
  v1::WriteKVRequest msg;  // the message the pulled views point into
  WriteStream stream;
  std::string allowed_tenant, allowed_sequence;  // the last checked
  stream.next = [&](WriteMessage* out) -> absl::StatusOr<bool> {
    if (!reader->Read(&msg)) {
      // Read fails at the end of the stream and when the client cancels; a
      // cancelled stream must not be remembered as complete.
      if (ctx->IsCancelled()) return absl::CancelledError("WriteKV cancelled");
      return false;
    }
    if (options_.capabilities != nullptr &&
        (msg.tenant_id() != allowed_tenant ||
         msg.sequence_id() != allowed_sequence)) {
      TRIAX_RETURN_IF_ERROR(
          Allowed(*ctx, "WriteKV",
                  {CapabilityNeed{msg.tenant_id(), msg.sequence_id(),
                                  v1::Capability::SCOPE_CLIENT}}));
      allowed_tenant = msg.tenant_id();
      allowed_sequence = msg.sequence_id();
    }
    *out = FromProto(msg);
    return true;
  };
  return Serve(&WorkerCore::WriteKV, stream, resp);
}

grpc::Status WorkerService::ReadKV(grpc::ServerContext* ctx,
                                   const v1::ReadKVRequest* req,
                                   grpc::ServerWriter<v1::KvChunk>* writer) {
  TRIAX_ALLOWED(ctx, "ReadKV",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_CLIENT});
  const ReadRequest request = FromProto(*req);
  ReadStream out{ctx, writer, request.layer, request.dtype};
  return Serve(&WorkerCore::Read, request, &out);
}

grpc::Status WorkerService::AttendOnce(const grpc::ServerContext& ctx,
                                       absl::string_view method,
                                       const v1::AttendRequest& req,
                                       v1::AttendResponse* resp) {
  if (options_.capabilities != nullptr) {
    std::vector<CapabilityNeed> needs;
    needs.reserve(req.items_size());
    for (const v1::AttendItem& item : req.items()) {
      needs.push_back(CapabilityNeed{req.tenant_id(), item.sequence_id(),
                                     v1::Capability::SCOPE_CLIENT});
    }
    if (absl::Status a = Allowed(ctx, method, needs); !a.ok()) {
      return ToGrpcStatus(a);
    }
  }
  return Serve(&WorkerCore::Attend, FromProto(req), resp);
}

grpc::Status WorkerService::Attend(grpc::ServerContext* ctx,
                                   const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) {
  return AttendOnce(*ctx, "Attend", *req, resp);
}

grpc::Status WorkerService::AttendStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream) {
  // One request and one response for the whole stream: parsing into them
  // and clearing them keeps their buffers (queries, outputs) from message
  // to message.
  v1::AttendRequest req;
  v1::AttendResponse resp;
  for (uint64_t n = 0;; ++n) {
    if (!stream->Read(&req)) {
      // Read fails at the end of the stream, when the client cancels, and
      // for a message that does not parse (the parse-error interceptor
      // then answers INVALID_ARGUMENT naming it).
      if (ctx->IsCancelled()) {
        return grpc::Status(
            grpc::StatusCode::CANCELLED,
            absl::StrCat("AttendStream cancelled after ", n, " messages"));
      }
      return grpc::Status::OK;
    }
    resp.Clear();
    if (grpc::Status s = AttendOnce(*ctx, "AttendStream", req, &resp);
        !s.ok()) {
      return grpc::Status(
          s.error_code(),
          absl::StrCat("messages[", n, "]: ", s.error_message()));
    }
    if (!stream->Write(resp)) {
      return grpc::Status(
          grpc::StatusCode::CANCELLED,
          absl::StrCat("AttendStream: the client went away before the "
                       "answer to messages[",
                       n, "]"));
    }
  }
}

grpc::Status WorkerService::FreePages(grpc::ServerContext* ctx,
                                      const v1::FreePagesRequest* req,
                                      v1::FreePagesResponse* resp) {
  TRIAX_ALLOWED(ctx, "FreePages",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_CLIENT});
  return Serve(&WorkerCore::Free, FromProto(*req), resp);
}

grpc::Status WorkerService::Demote(grpc::ServerContext* ctx,
                                   const v1::DemoteRequest* req,
                                   v1::DemoteResponse* resp) {
  TRIAX_ALLOWED(ctx, "Demote",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  return Serve(&WorkerCore::Demote, FromProto(*req), resp);
}

grpc::Status WorkerService::Spill(grpc::ServerContext* ctx,
                                  const v1::SpillRequest* req,
                                  v1::SpillResponse* resp) {
  TRIAX_ALLOWED(ctx, "Spill",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  return Serve(&WorkerCore::Spill, FromProto(*req), resp);
}

grpc::Status WorkerService::Restore(grpc::ServerContext* ctx,
                                    const v1::RestoreRequest* req,
                                    v1::RestoreResponse* resp) {
  TRIAX_ALLOWED(ctx, "Restore",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  return Serve(&WorkerCore::Restore, FromProto(*req), resp);
}

grpc::Status WorkerService::Evict(grpc::ServerContext* ctx,
                                  const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) {
  TRIAX_ALLOWED(ctx, "Evict",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  return Serve(&WorkerCore::Evict, FromProto(*req), resp);
}

grpc::Status WorkerService::GetInventory(grpc::ServerContext* ctx,
                                         const v1::GetInventoryRequest* req,
                                         v1::Inventory* resp) {
  TRIAX_ALLOWED(ctx, "GetInventory",
                CapabilityNeed{"", "", v1::Capability::SCOPE_MANAGER});
  return Serve(&WorkerCore::GetInventory, FromProto(*req), resp);
}

grpc::Status WorkerService::ImportSequence(grpc::ServerContext* ctx,
                                           const v1::ImportSequenceRequest* req,
                                           v1::ImportSequenceResponse* resp) {
  TRIAX_ALLOWED(ctx, "ImportSequence",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  absl::StatusOr<ImportReply> reply =
      core_->Import(FromProto(*req), transfers_.AsFetcher());
  if (!reply.ok()) return ToGrpcStatus(reply.status());
  ToProto(*reply, resp);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ExportPages(
    grpc::ServerContext* ctx, const v1::ExportPagesRequest* req,
    grpc::ServerWriter<v1::PageBatch>* writer) {
  TRIAX_ALLOWED(ctx, "ExportPages",
                CapabilityNeed{req->tenant_id(), req->sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  const uint32_t max_batch = req->max_batch_bytes() == 0
                                 ? kDefaultMaxBatchBytes
                                 : req->max_batch_bytes();
  ExportOptions options;
  options.follow_writes = req->follow_writes();
  // A deadline more than a day away (or none) counts as none.
  const auto deadline = ctx->deadline();
  if (deadline - std::chrono::system_clock::now() < std::chrono::hours(24)) {
    options.deadline = absl::FromChrono(deadline);
  }
  options.cancelled = [ctx] { return ctx->IsCancelled(); };
  const uint32_t corrupt_every = options_.testing_corrupt_export_pages;
  auto sink = [&](uint32_t, std::vector<TransferPage>* pages) -> absl::Status {
    v1::PageBatch batch;
    size_t bytes = 0;
    auto flush = [&]() -> absl::Status {
      if (batch.pages_size() == 0) return absl::OkStatus();
      if (ctx->IsCancelled() || !writer->Write(batch)) {
        return absl::CancelledError("ExportPages: the client went away");
      }
      batch.Clear();
      bytes = 0;
      return absl::OkStatus();
    };
    for (TransferPage& page : *pages) {
      if (bytes > 0 && bytes + page.data.size() > max_batch) {
        if (absl::Status s = flush(); !s.ok()) return s;
      }
      if (corrupt_every > 0 && !page.data.empty() &&
          (exported_pages_.fetch_add(1) + 1) % corrupt_every == 0) {
        page.data[page.data.size() / 2] ^= 0x40;  // after the CRC was taken
      }
      bytes += page.data.size();
      ToProto(std::move(page), batch.add_pages());
    }
    return flush();
  };
  return ToGrpcStatus(core_->Export(FromProto(*req), options, sink));
}

// A destination holds up to CheckedCopies::kMaxInFlight batches
// unacknowledged while their copies run; the source must send that many.
static_assert(WorkerService::kMaxUnackedBatches >= CheckedCopies::kMaxInFlight,
              "SharePages would wait for a batch its destination holds");

grpc::Status WorkerService::SharePages(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::PageBatch, v1::SharePagesRequest>* stream) {
  v1::SharePagesRequest first;
  if (!stream->Read(&first)) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "SharePages: the stream ended before its request");
  }
  if (!first.has_request()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "SharePages: the first message has no request");
  }
  // Before anything that shares the arena.
  TRIAX_ALLOWED(
      ctx, "SharePages",
      CapabilityNeed{first.request().tenant_id(), first.request().sequence_id(),
                     v1::Capability::SCOPE_MANAGER});
  if (options_.transfer_path == TransferPath::kStream) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this worker runs with --transfer_path=stream and "
                        "does not share its arena");
  }
  const std::string domain = core_->ShareDomain();
  if (domain.empty()) {
    return grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        "this worker's backend does not share its arena (a CPU worker "
        "shares with --transfer_path=ipc)");
  }
  if (first.share_domain() != domain) {
    return grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        absl::StrCat("share_domain=", Quote(first.share_domain()),
                     " of the destination differs from this worker's ",
                     Quote(domain), " (another host or backend)"));
  }
  absl::StatusOr<SharedArenaInfo> arena = core_->SharedArena();
  if (!arena.ok()) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        std::string(arena.status().message()));
  }
  const v1::ExportPagesRequest& req = first.request();
  const uint64_t max_batch = req.max_batch_bytes() == 0
                                 ? kDefaultMaxSharedBatchBytes
                                 : req.max_batch_bytes();
  std::unique_ptr<PagePins> pins = core_->NewPagePins();
  ExportOptions options;
  options.follow_writes = req.follow_writes();
  const auto deadline = ctx->deadline();
  if (deadline - std::chrono::system_clock::now() < std::chrono::hours(24)) {
    options.deadline = absl::FromChrono(deadline);
  }
  options.cancelled = [ctx] { return ctx->IsCancelled(); };
  options.pins = pins.get();
  // ends[k]: pins held by batches [0, k] (pins are in page order).
  std::vector<size_t> ends;
  uint64_t acked = 0;
  auto read_ack = [&]() -> absl::Status {
    v1::SharePagesRequest m;
    if (!stream->Read(&m)) {
      return absl::CancelledError(
          absl::StrCat("SharePages: the destination went away with ", acked,
                       " of ", ends.size(), " batches acknowledged"));
    }
    const uint64_t n = m.installed_batches();
    if (n < acked || n > ends.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("installed_batches=", n, " is outside [", acked, ", ",
                       ends.size(), "] (acknowledged so far, sent)"));
    }
    acked = n;
    if (acked > 0) pins->ReleaseFirst(ends[acked - 1]);
    return absl::OkStatus();
  };
  const uint32_t corrupt_every = options_.testing_corrupt_export_pages;
  // Pages exported and not yet sent (their pins are the last ones): in the
  // batch's runs when the destination reads them, else kept for its refs.
  const bool use_runs = first.accepts_runs();
  v1::PageBatch batch;
  RunWriter runs(&batch);
  std::vector<TransferPage> pending;
  uint64_t pending_bytes = 0;
  size_t pending_pages = 0;
  size_t sent_pins = 0;
  // `last`: the destination installs what it holds before it reads on
  // (PageBatch.flush); a destination reading runs gets a batch without
  // pages for it when none is pending.
  bool flushed = true;  // the last batch sent was flagged
  auto flush = [&](bool last) -> absl::Status {
    if (pending_pages == 0 && !(last && use_runs && !flushed)) {
      return absl::OkStatus();
    }
    if (ends.empty()) {
      v1::SharedArena* a = batch.mutable_arena();
      a->set_backend(arena->backend);
      a->set_handle(arena->handle);
      a->set_bytes(arena->bytes);
    }
    if (use_runs) {
      runs.Finish();
      batch.set_flush(last);
      flushed = last;
    } else {
      AppendRefs(pending, &batch);
      pending.clear();
    }
    sent_pins += pending_pages;
    ends.push_back(sent_pins);
    pending_pages = 0;
    pending_bytes = 0;
    const bool written = !ctx->IsCancelled() && stream->Write(batch);
    batch.Clear();  // keeps its arrays' room for the next batch
    runs.Reset();
    if (!written) {
      return absl::CancelledError("SharePages: the destination went away");
    }
    while (ends.size() - acked > kMaxUnackedBatches) {
      TRIAX_RETURN_IF_ERROR(read_ack());
    }
    return absl::OkStatus();
  };
  // Batches span layers; with follow_writes each layer's last batch goes
  // before the next layer is waited for.
  auto sink = [&](uint32_t, std::vector<TransferPage>* pages) -> absl::Status {
    for (TransferPage& page : *pages) {
      if (pending_bytes > 0 && pending_bytes + page.shared_bytes > max_batch) {
        TRIAX_RETURN_IF_ERROR(flush(/*last=*/false));
      }
      if (corrupt_every > 0 &&
          (exported_pages_.fetch_add(1) + 1) % corrupt_every == 0) {
        page.crc32c ^= 0x40;  // the page's bytes are the stored ones
      }
      pending_bytes += page.shared_bytes;
      pending_pages += 1;
      if (use_runs) {
        runs.Add(page);
      } else {
        pending.push_back(std::move(page));
      }
    }
    return req.follow_writes() ? flush(/*last=*/true) : absl::OkStatus();
  };
  absl::Status s = core_->Export(FromProto(req), options, sink);
  if (s.ok()) s = flush(/*last=*/true);
  while (s.ok() && acked < ends.size()) s = read_ack();
  return ToGrpcStatus(s);
}

grpc::Status WorkerService::OpenLink(grpc::ServerContext* ctx,
                                     const v1::OpenLinkRequest* req,
                                     v1::OpenLinkResponse* resp) {
  TRIAX_ALLOWED(ctx, "OpenLink",
                CapabilityNeed{"", "", v1::Capability::SCOPE_MANAGER, 0,
                               /*any_sequence=*/true});
  if (options_.transfer_path == TransferPath::kStream ||
      options_.transfer_path == TransferPath::kIpc) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrCat("this worker runs with --transfer_path=",
                                     TransferPathName(options_.transfer_path),
                                     " and makes no links"));
  }
  Device* const device = core_->device();
  const std::string backend = device->LinkBackend();
  if (backend.empty()) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrCat("this worker's ", device->Name(),
                                     " device has no links enabled"));
  }
  if (req->backend() != backend) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrCat("backend=", Quote(req->backend()),
                                     " differs from this worker's link "
                                     "backend ",
                                     Quote(backend)));
  }
  if (req->link_id().empty() || req->link_key().empty() ||
      req->owner().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(req->link_id().empty()    ? "link_id"
                                     : req->link_key().empty() ? "link_key"
                                                               : "owner",
                                     " must not be empty"));
  }
  absl::Time deadline =
      absl::Now() + absl::Milliseconds(req->timeout_ms() == 0
                                           ? kDefaultImportTimeoutMs
                                           : req->timeout_ms());
  const auto call_deadline = ctx->deadline();
  if (call_deadline - std::chrono::system_clock::now() <
      std::chrono::hours(24)) {
    deadline = std::min(deadline, absl::FromChrono(call_deadline));
  }
  absl::StatusOr<std::unique_ptr<DeviceLink>> link = device->ConnectLink(
      req->link_id(), 1, deadline, [ctx] { return ctx->IsCancelled(); });
  if (!link.ok()) {
    // The caller falls back to another path on FAILED_PRECONDITION.
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("cannot join the ", backend,
                                     " link: ", link.status().message()));
  }
  links_.Add(req->link_key(), req->owner(),
             std::make_shared<LinkEnd>(device, *std::move(link)));
  resp->set_backend(backend);
  return grpc::Status::OK;
}

grpc::Status WorkerService::LinkPages(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::PageBatch, v1::LinkPagesRequest>* stream) {
  v1::LinkPagesRequest first;
  if (!stream->Read(&first)) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "LinkPages: the stream ended before its request");
  }
  if (!first.has_request() || first.link_key().empty()) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("LinkPages: the first message has no ",
                     first.has_request() ? "link_key" : "request"));
  }
  const v1::ExportPagesRequest& req = first.request();
  TRIAX_ALLOWED(ctx, "LinkPages",
                CapabilityNeed{req.tenant_id(), req.sequence_id(),
                               v1::Capability::SCOPE_MANAGER});
  if (req.max_batch_bytes() > kLinkBatchBytes) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("max_batch_bytes=", req.max_batch_bytes(),
                     " is over the link's staging slot of ", kLinkBatchBytes));
  }
  absl::StatusOr<std::shared_ptr<LinkEnd>> end = links_.Claim(first.link_key());
  if (!end.ok()) return ToGrpcStatus(end.status());
  LinkSendOptions options;
  const auto deadline = ctx->deadline();
  if (deadline - std::chrono::system_clock::now() < std::chrono::hours(24)) {
    options.deadline = absl::FromChrono(deadline);
  }
  options.cancelled = [ctx] { return ctx->IsCancelled(); };
  options.max_batch_bytes = req.max_batch_bytes();
  if (const uint32_t every = options_.testing_corrupt_export_pages; every > 0) {
    options.corrupt_next = [this, every] {
      return (exported_pages_.fetch_add(1) + 1) % every == 0;
    };
  }
  auto sink = [&](std::vector<TransferPage>* pages,
                  uint64_t link_bytes) -> absl::Status {
    v1::PageBatch batch;
    batch.set_link_bytes(link_bytes);
    AppendRefs(*pages, &batch);
    if (ctx->IsCancelled() || !stream->Write(batch)) {
      return absl::CancelledError("LinkPages: the destination went away");
    }
    return absl::OkStatus();
  };
  absl::Status s =
      SendOverLink(core_, FromProto(req), options, end->get(), sink);
  if (s.ok()) {
    // The end marker; both ends keep the link only when the destination
    // then confirms by half-closing (it cancels when it failed).
    if (!stream->Write(v1::PageBatch())) {
      s = absl::CancelledError("LinkPages: the destination went away");
    } else {
      v1::LinkPagesRequest extra;
      while (stream->Read(&extra)) {
      }
      if (ctx->IsCancelled()) {
        s = absl::CancelledError(
            "LinkPages: the destination did not confirm the transfer");
      }
    }
  }
  links_.Release(first.link_key(), s.ok());
  return ToGrpcStatus(s);
}

}  // namespace triax::worker
