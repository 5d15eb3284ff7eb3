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
// the RPC itself fails only for a malformed tenant_id (or, with
// capabilities required, one the call lacks). AttendStream serves each
// message of its stream as Attend (the same helper, AttendOnce) on the
// handler's sync-pool thread, one message at a time, answering each before
// it reads the next; what would fail an Attend ends the stream with that
// status prefixed "messages[<n>]: ". A client that cancels or goes away
// ends it CANCELLED (appends of the messages already read stay written, as
// for an Attend whose client went away). Inventories carry device_error
// (Device::Health's message; empty while healthy).
//
// Transfers. ImportSequence runs the whole import on its handler thread
// (a sync-pool thread, so waiting on the source blocks no callback thread):
// WorkerCore::Import with a TransferClient that pulls the source's
// ExportPages stream. ExportPages sends a layer's pages in PageBatch
// messages of at most max_batch_bytes (0: kDefaultMaxBatchBytes; a page
// larger than that goes alone), each layer's last batch flushed before the
// next layer is waited for, so a destination holds layer 0 while later
// layers are still being written (follow_writes). The client's deadline
// and cancellation bound the export (a cancelled stream stops at the next
// wait or batch and its scratch pages are freed). The test hook
// WorkerServiceOptions::testing_corrupt_export_pages = N flips one byte of
// every N-th exported page after its CRC32C was taken (kvworker
// --testing_corrupt_export_pages), so a destination must answer DATA_LOSS.
//
// SharePages (the ipc path, worker/transfer_client.h): UNIMPLEMENTED when
// this worker's own transfer_path is stream (it shares nothing), and unless
// the destination's share_domain equals this worker's (same host, same
// backend) and the arena can be shared; then the same export as
// ExportPages with pages pinned instead of copied out, sent in batches of
// at most kDefaultMaxSharedBatchBytes of page bytes (the first batch
// carries the arena's handle), their pages as runs (PageBatch.runs) when
// the destination set accepts_runs, else as refs; with runs the export's
// last batch (one without pages when none are left) and, with
// follow_writes, each layer's last is flagged `flush`, as the destination
// may hold a batch's copies in flight until the next batch comes. At most
// kMaxUnackedBatches batches are ahead of the destination's installed_batches;
// each acknowledgement unpins its batches, and the call ends once every batch
// is acknowledged (whatever is still pinned when the call ends — a destination
// gone, a deadline — is unpinned then). An acknowledgement of a batch not sent,
// or going backwards, is INVALID_ARGUMENT.
//
// OpenLink / LinkPages (the link path, worker/link_transfer.h): OpenLink
// is UNIMPLEMENTED unless this worker runs with transfer_path auto or link
// and its device's link backend (Device::LinkBackend) is the caller's; it
// joins the caller's link as rank 1 within timeout_ms (and the call's
// deadline) and keeps it in the link registry under link_key, replacing
// the owner's older links. LinkPages claims the link named by link_key
// (NOT_FOUND when there is none, ABORTED when another transfer holds it),
// exports as SharePages does and sends each batch over the link
// (SendOverLink); a failed transfer drops the link. The corruption hook
// flips one bit of every N-th page's CRC32C, as on the ipc path.
//
// Thread contract: thread-safe; handlers run concurrently.
#pragma once

#include <grpcpp/security/credentials.h>

#include <atomic>
#include <cstdint>
#include <functional>

#include "common/capability.h"
#include "triax/v1/worker.grpc.pb.h"
#include "worker/transfer_client.h"
#include "worker/worker_core.h"

namespace triax::worker {

struct WorkerServiceOptions {
  // Test hook: 0 off; N flips one byte of every N-th exported page after
  // its checksum was taken (on the ipc path, whose bytes are the stored
  // page, one bit of the CRC32C sent instead).
  uint32_t testing_corrupt_export_pages = 0;
  // The destination's data path (TransferClient) and the device that maps
  // peers' arenas on the ipc path (the store's; null: stream only).
  TransferPath transfer_path = TransferPath::kStream;
  Device* device = nullptr;
  // The link path's batch size when this worker imports (tests make it
  // small to move a sequence in many batches); at most kLinkBatchBytes.
  uint64_t link_batch_bytes = kLinkBatchBytes;
  // Of the channels to source workers (TLS, common/tls.h); null: insecure.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // With TLS: the name source workers' certificates are verified against
  // instead of their address (empty: the address).
  std::string peer_server_name;
  // Capabilities the calls must carry (kvworker --token_file; null: none;
  // docs/security.md "Capabilities"). Must outlive the service.
  const CapabilityVerifier* capabilities = nullptr;
  // Mutual TLS: method ("Demote") -> the client certificate names that may
  // call it (IdentityMatches); a call to a listed method without such a
  // certificate is refused in its handler, UNAUTHENTICATED or
  // PERMISSION_DENIED naming the method (CheckPeerIdentity), on every
  // listener alike (a --local_listen socket carries no certificate). Empty:
  // none checked.
  std::map<std::string, std::vector<std::string>, std::less<>>
      certificate_names;
};

class WorkerService final : public v1::Worker::Service {
 public:
  static constexpr uint32_t kMaxReadChunkTokens = 256;
  static constexpr uint32_t kDefaultMaxBatchBytes = 4 << 20;
  // SharePages: page bytes named per batch (0 max_batch_bytes), and batches
  // sent ahead of the destination's acknowledgement.
  static constexpr uint32_t kDefaultMaxSharedBatchBytes = 64 << 20;
  static constexpr uint64_t kMaxUnackedBatches = 4;

  // `core` must outlive the service.
  explicit WorkerService(WorkerCore* core, WorkerServiceOptions options = {});

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
  grpc::Status AttendStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream)
      override;
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
  grpc::Status ImportSequence(grpc::ServerContext* ctx,
                              const v1::ImportSequenceRequest* req,
                              v1::ImportSequenceResponse* resp) override;
  grpc::Status ExportPages(grpc::ServerContext* ctx,
                           const v1::ExportPagesRequest* req,
                           grpc::ServerWriter<v1::PageBatch>* writer) override;
  grpc::Status SharePages(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::PageBatch, v1::SharePagesRequest>* stream)
      override;
  grpc::Status OpenLink(grpc::ServerContext* ctx,
                        const v1::OpenLinkRequest* req,
                        v1::OpenLinkResponse* resp) override;
  grpc::Status LinkPages(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::PageBatch, v1::LinkPagesRequest>* stream)
      override;

  // Links this worker joined as a source (tests look at it).
  const LinkRegistry& links() const { return links_; }

 private:
  // OK without options_.capabilities; else CapabilityVerifier::CheckAll.
  absl::Status Allowed(const grpc::ServerContext& ctx, absl::string_view method,
                       const std::vector<CapabilityNeed>& needs) const;
  // One Attend (of the Attend RPC or one message of AttendStream): every
  // item's sequence checked against the call's capabilities (`method`
  // names the RPC in refusals), then WorkerCore::Attend into *resp.
  grpc::Status AttendOnce(const grpc::ServerContext& ctx,
                          absl::string_view method,
                          const v1::AttendRequest& req,
                          v1::AttendResponse* resp);
  // The one path of every RPC: `call` (a WorkerCore member) on the domain
  // `request`, then the result written into `reply` (a response message, or
  // ReadKV's stream), then the status mapped.
  template <typename Call, typename Request, typename Reply>
  grpc::Status Serve(Call call, const Request& request, Reply* reply);

  WorkerCore* const core_;
  const WorkerServiceOptions options_;
  TransferClient transfers_;
  LinkRegistry links_;
  std::atomic<uint64_t> exported_pages_{0};  // for the corruption hook
};

}  // namespace triax::worker
