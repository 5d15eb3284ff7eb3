// gRPC adapter of the kvworker (triax.v1.Worker) over a SequenceStore:
// proto <-> domain conversion, status mapping and request-id idempotency.
//
// API choice: the synchronous grpc::Service. Every handler here is
// compute-bound (encode/decode/attention on the CPU backend) with no waits on
// other services, so gRPC's sync thread pool is exactly the worker pool we
// would otherwise have to build behind the callback API; with the callback
// API each handler would have to hop to such a pool anyway so as not to block
// callback threads. Concurrency is bounded by the server's thread pool;
// operations on one sequence serialize on its mutex in the store.
//
// Error codes are the store's (sequence_store.h), plus INVALID_ARGUMENT for
// malformed request ids, dtype, and proto-level fields. Attend answers one
// ItemStatus per item; the RPC itself fails only for a malformed tenant_id.
// Idempotency: AllocatePages, ForkSequence, WriteKV (request id on the first
// message of the stream), Demote and FreePages remember their successful
// replies by (tenant_id, request id); a repeat returns the first reply without
// applying again. Failed requests change nothing and are not remembered, so a
// retry after the cause is fixed (e.g. memory freed) runs again.
//
// Thread contract: thread-safe; handlers run concurrently.
#pragma once

#include <cstdint>
#include <string>

#include "common/idempotency.h"
#include "triax/v1/types.pb.h"
#include "triax/v1/worker.grpc.pb.h"
#include "worker/sequence_store.h"

namespace triax::worker {

void InventoryToProto(const InventorySnapshot& inv, v1::Inventory* out);

class WorkerService final : public v1::Worker::Service {
 public:
  static constexpr uint32_t kMaxReadChunkTokens = 256;

  // `store` must outlive the service.
  explicit WorkerService(SequenceStore* store);

  grpc::Status AllocatePages(grpc::ServerContext* ctx,
                             const v1::AllocatePagesRequest* req,
                             v1::AllocatePagesResponse* resp) override;
  grpc::Status ForkSequence(grpc::ServerContext* ctx,
                            const v1::WorkerForkRequest* req,
                            v1::WorkerForkResponse* resp) override;
  grpc::Status WriteKV(grpc::ServerContext* ctx,
                       grpc::ServerReader<v1::WriteKVRequest>* reader,
                       v1::WriteKVResponse* resp) override;
  grpc::Status ReadKV(grpc::ServerContext* ctx, const v1::ReadKVRequest* req,
                      grpc::ServerWriter<v1::KvChunk>* writer) override;
  grpc::Status Attend(grpc::ServerContext* ctx, const v1::AttendRequest* req,
                      v1::AttendResponse* resp) override;
  grpc::Status FreePages(grpc::ServerContext* ctx,
                         const v1::FreePagesRequest* req,
                         v1::FreePagesResponse* resp) override;
  grpc::Status Demote(grpc::ServerContext* ctx, const v1::DemoteRequest* req,
                      v1::DemoteResponse* resp) override;
  grpc::Status GetInventory(grpc::ServerContext* ctx,
                            const v1::GetInventoryRequest* req,
                            v1::Inventory* resp) override;

 private:
  SequenceStore* const store_;
  IdempotencyCache<v1::AllocatePagesResponse> allocate_cache_;
  IdempotencyCache<v1::WorkerForkResponse> fork_cache_;
  IdempotencyCache<v1::WriteKVResponse> write_cache_;
  IdempotencyCache<v1::FreePagesResponse> free_cache_;
  IdempotencyCache<v1::DemoteResponse> demote_cache_;
};

}  // namespace triax::worker
