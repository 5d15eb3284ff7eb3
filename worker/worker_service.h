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
// Its items run as one SequenceStore::AttendBatch: the items that pass
// validation share one device launch (a decode step of a batch is one
// kernel launch on the CUDA backend), results equal running them in order.
// Inventories carry device_error (Device::Health's message; empty while
// healthy).
// An item refused UNAVAILABLE because its blocks are spilled (restore on
// attend off) carries retry_after_ms; a background restore is queued.
//
// Spill tiers (sequence_store.h "Spill tiers"):
//   Spill    INVALID_ARGUMENT: tier not TIER_HOST/TIER_DISK, empty or
//            repeated lineage_ids; NOT_FOUND: unknown sequence or a lineage
//            id not in it; PERMISSION_DENIED: another tenant's sequence;
//            FAILED_PRECONDITION: tier disabled, block unsealed, shared with
//            a fork or evicted; RESOURCE_EXHAUSTED: the tier is full (bytes
//            over named; nothing moved); DATA_LOSS: a host<->disk move found
//            a bad checksum.
//   Restore  empty lineage_ids: every spilled block. background: queued for
//            the store's prefetch thread, answers blocks_queued at once.
//            NOT_FOUND / PERMISSION_DENIED as Spill; FAILED_PRECONDITION:
//            an evicted block; RESOURCE_EXHAUSTED: the pool cannot hold the
//            pages (nothing restored); DATA_LOSS: a page failed its checksum
//            (the block stays spilled, checksum_failures counts it).
//   Evict    INVALID_ARGUMENT: empty or repeated lineage_ids; NOT_FOUND /
//            PERMISSION_DENIED as Spill; FAILED_PRECONDITION: unsealed or
//            shared block. Evicting an evicted block is a no-op.
//
// Idempotency: AllocatePages, ForkSequence, WriteKV (request id on the first
// message of the stream), Demote, FreePages, Spill, Restore and Evict
// remember their successful
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
  grpc::Status Spill(grpc::ServerContext* ctx, const v1::SpillRequest* req,
                     v1::SpillResponse* resp) override;
  grpc::Status Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                       v1::RestoreResponse* resp) override;
  grpc::Status Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                     v1::EvictResponse* resp) override;

 private:
  SequenceStore* const store_;
  IdempotencyCache<v1::AllocatePagesResponse> allocate_cache_;
  IdempotencyCache<v1::WorkerForkResponse> fork_cache_;
  IdempotencyCache<v1::WriteKVResponse> write_cache_;
  IdempotencyCache<v1::FreePagesResponse> free_cache_;
  IdempotencyCache<v1::DemoteResponse> demote_cache_;
  IdempotencyCache<v1::SpillResponse> spill_cache_;
  IdempotencyCache<v1::RestoreResponse> restore_cache_;
  IdempotencyCache<v1::EvictResponse> evict_cache_;
};

}  // namespace triax::worker
