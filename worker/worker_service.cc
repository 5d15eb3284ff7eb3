#include "worker/worker_service.h"

#include <algorithm>
#include <functional>

#include "common/grpc_status.h"
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

WorkerService::WorkerService(WorkerCore* core) : core_(core) {}

template <typename Call, typename Request, typename Reply>
grpc::Status WorkerService::Serve(Call call, const Request& request,
                                  Reply* reply) {
  auto result = std::invoke(call, *core_, request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  return ToGrpcStatus(Answer(*result, reply));
}

grpc::Status WorkerService::AllocatePages(grpc::ServerContext*,
                                          const v1::AllocatePagesRequest* req,
                                          v1::AllocatePagesResponse* resp) {
  return Serve(&WorkerCore::AllocatePages, FromProto(*req), resp);
}

grpc::Status WorkerService::ForkSequence(grpc::ServerContext*,
                                         const v1::WorkerForkRequest* req,
                                         v1::WorkerForkResponse* resp) {
  return Serve(&WorkerCore::Fork, FromProto(*req), resp);
}

grpc::Status WorkerService::WriteKV(
    grpc::ServerContext* ctx, grpc::ServerReader<v1::WriteKVRequest>* reader,
    v1::WriteKVResponse* resp) {
  v1::WriteKVRequest msg;  // the message the pulled views point into
  WriteStream stream;
  stream.next = [&](WriteMessage* out) -> absl::StatusOr<bool> {
    if (!reader->Read(&msg)) {
      // Read fails at the end of the stream and when the client cancels; a
      // cancelled stream must not be remembered as complete.
      if (ctx->IsCancelled()) return absl::CancelledError("WriteKV cancelled");
      return false;
    }
    *out = FromProto(msg);
    return true;
  };
  return Serve(&WorkerCore::WriteKV, stream, resp);
}

grpc::Status WorkerService::ReadKV(grpc::ServerContext* ctx,
                                   const v1::ReadKVRequest* req,
                                   grpc::ServerWriter<v1::KvChunk>* writer) {
  const ReadRequest request = FromProto(*req);
  ReadStream out{ctx, writer, request.layer, request.dtype};
  return Serve(&WorkerCore::Read, request, &out);
}

grpc::Status WorkerService::Attend(grpc::ServerContext*,
                                   const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) {
  return Serve(&WorkerCore::Attend, FromProto(*req), resp);
}

grpc::Status WorkerService::FreePages(grpc::ServerContext*,
                                      const v1::FreePagesRequest* req,
                                      v1::FreePagesResponse* resp) {
  return Serve(&WorkerCore::Free, FromProto(*req), resp);
}

grpc::Status WorkerService::Demote(grpc::ServerContext*,
                                   const v1::DemoteRequest* req,
                                   v1::DemoteResponse* resp) {
  return Serve(&WorkerCore::Demote, FromProto(*req), resp);
}

grpc::Status WorkerService::Spill(grpc::ServerContext*,
                                  const v1::SpillRequest* req,
                                  v1::SpillResponse* resp) {
  return Serve(&WorkerCore::Spill, FromProto(*req), resp);
}

grpc::Status WorkerService::Restore(grpc::ServerContext*,
                                    const v1::RestoreRequest* req,
                                    v1::RestoreResponse* resp) {
  return Serve(&WorkerCore::Restore, FromProto(*req), resp);
}

grpc::Status WorkerService::Evict(grpc::ServerContext*,
                                  const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) {
  return Serve(&WorkerCore::Evict, FromProto(*req), resp);
}

grpc::Status WorkerService::GetInventory(grpc::ServerContext*,
                                         const v1::GetInventoryRequest* req,
                                         v1::Inventory* resp) {
  return Serve(&WorkerCore::GetInventory, FromProto(*req), resp);
}

}  // namespace triax::worker
