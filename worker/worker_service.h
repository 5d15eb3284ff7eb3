// gRPC adapter of the kvworker (triax.v1.Worker) over WorkerCore. Every RPC
// goes through one helper (Serve): the request converted (convert.h), the
// core called, the reply converted, the status mapped one to one
// (common/grpc_status.h). Validation, idempotency and error codes are the
// core's (worker_core.h) and the store's (sequence_store.h); messages pass
// through unchanged.
//
// API choice: the synchronous grpc::Service. Every handler here is
// compute-bound (encode/decode/attention on the CPU backend) with no waits on
// other services, so gRPC's sync thread pool is exactly the worker pool we
// would otherwise have to build behind the callback API; with the callback
// API each handler would have to hop to such a pool anyway so as not to block
// callback threads. Concurrency is bounded by the server's thread pool;
// operations on one sequence serialize on its mutex in the store.
//
// Streams. WriteKV: the core pulls the messages (request id on the first);
// a client that cancels mid-stream gets CANCELLED and the stream is not
// remembered. ReadKV answers chunks of at most kMaxReadChunkTokens tokens
// in the asked dtype; CANCELLED when the client cancels or goes away.
//
// Attend answers one ItemStatus per item ("items[<i>]: <message>", with
// retry_after_ms when the item was refused because its blocks are spilled);
// the RPC itself fails only for a malformed tenant_id. Inventories carry
// device_error (Device::Health's message; empty while healthy).
//
// Thread contract: thread-safe; handlers run concurrently.
#pragma once

#include <cstdint>
#include <functional>

#include "triax/v1/worker.grpc.pb.h"
#include "worker/worker_core.h"

namespace triax::worker {

class WorkerService final : public v1::Worker::Service {
 public:
  static constexpr uint32_t kMaxReadChunkTokens = 256;

  // `core` must outlive the service.
  explicit WorkerService(WorkerCore* core);

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
  grpc::Status Spill(grpc::ServerContext* ctx, const v1::SpillRequest* req,
                     v1::SpillResponse* resp) override;
  grpc::Status Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                       v1::RestoreResponse* resp) override;
  grpc::Status Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                     v1::EvictResponse* resp) override;

 private:
  // The one path of every RPC: `call` (a WorkerCore member) on the domain
  // `request`, then the result written into `reply` (a response message, or
  // ReadKV's stream), then the status mapped.
  template <typename Call, typename Request, typename Reply>
  grpc::Status Serve(Call call, const Request& request, Reply* reply);

  WorkerCore* const core_;
};

}  // namespace triax::worker
