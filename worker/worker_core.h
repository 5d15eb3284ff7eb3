// The kvworker's core behind its gRPC adapter (worker_service.h): request-id
// idempotency over the SequenceStore, the store's calls as domain requests,
// and the device's health, so that the service has this one dependency. No
// gRPC or protobuf: domain structs in, absl::Status / StatusOr out.
//
// Idempotency. The mutating calls (AllocatePages, Fork, WriteKV, Demote,
// Free, Spill, Restore, Evict) with a non-empty request_id remember their
// successful reply per method and tenant (the newest
// WorkerCoreOptions::idempotency_capacity per method); the same (method,
// tenant_id, request_id) again returns that reply without applying anything
// and without looking at the rest of the request: a different payload under
// a reused request id is not detected, it gets the first reply. Failed calls
// change nothing and are not remembered, so a retry after the cause is fixed
// (e.g. memory freed) runs again. Calls that share a key run one at a time:
// a duplicate arriving while the first is running waits for it, then gets
// its reply (or runs itself when the first failed), so a request applies at
// most once even when a client retries before the first attempt finished.
// The request id is checked before anything else: empty (no idempotency) or
// [A-Za-z0-9._:-]{1,128}, else INVALID_ARGUMENT naming request_id.
//
// WriteKV is a stream of messages pulled through WriteStream::next; the
// first message carries the request id and tenant. A repeat of a remembered
// stream is drained (every message pulled, nothing written) and answered
// with the first reply. A stream whose `next` fails (the client went away)
// ends with that error and is not remembered, whatever it wrote.
//
// Error codes are the store's (sequence_store.h "Error codes"), plus
// INVALID_ARGUMENT for: a malformed request id; Attend's tenant_id (the
// only error that fails a whole Attend; its items fail one by one); a Read
// dtype other than F32 / BF16; a Spill tier other than host / disk; an empty
// lineage_ids list of Spill or Evict; a WriteKV message without a chunk.
// WriteKV errors name the message ("message 2 (40 tokens of earlier messages
// were written): ..."): chunks before it stay written.
//
// Transfers. Import (the destination side) is idempotent per request id
// like the mutating calls: a repeat of a finished import answers its reply.
// It checks source_address (non-empty), timeout_ms (0 means
// kDefaultImportTimeoutMs; at most kMaxImportTimeoutMs) and the plan
// (SequenceStore::BeginImport: ids, shape, blocks; ALREADY_EXISTS when the
// sequence is here), then pulls the pages through a PageFetcher (the
// service's gRPC client: worker/transfer_client.h) with a deadline of now +
// timeout_ms, installs them as they arrive and commits. Export (the source
// side) is read-only: SequenceStore::Export.
//
// Thread contract: thread-safe; calls run concurrently on the caller's
// thread (the store serializes operations on one sequence). Only calls
// sharing an idempotency key wait for each other. No lock is held across a
// store call: the in-flight mutex only marks and clears keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/idempotency.h"
#include "common/model.h"
#include "worker/device.h"
#include "worker/sequence_store.h"
#include "worker/store_transfer.h"

namespace triax::worker {

// --- Requests ---------------------------------------------------------------
// Strings and vectors are owned; absl::string_view and absl::Span fields are
// views into the caller's buffers (the tensors), valid for the call.

struct AllocatePagesRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  ModelShape model;
  uint32_t block_tokens = 0;
  std::vector<BlockSpec> blocks;
  std::optional<uint32_t> window_tokens;  // nullopt: the store's default
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct ForkRequest {
  std::string request_id;
  std::string tenant_id;
  std::string parent_sequence_id;
  std::string child_sequence_id;
  uint64_t num_tokens = 0;
  std::vector<BlockSpec> blocks;  // the child's plan
  std::string parent_tenant_id;   // empty: tenant_id
  uint64_t fingerprint = 0;       // of the payload: IdempotencyCache::Lookup
};

// Each block names index and lineage_id, and the new encoding.
struct DemoteRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<BlockSpec> blocks;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct FreeRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct SpillRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<uint64_t> lineage_ids;  // >= 1, no repeats
  Tier tier = Tier::kUnspecified;     // kHost or kDisk
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct RestoreRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<uint64_t> lineage_ids;  // empty: every spilled block
  bool background = false;            // queue for the prefetch thread
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct EvictRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<uint64_t> lineage_ids;  // >= 1, no repeats
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

// One message of a WriteKV stream. request_id and tenant_id of the first
// message name the stream for idempotency; every message's chunk is written
// as (its tenant_id, its sequence_id).
struct WriteMessage {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::optional<KvWrite> chunk;  // views valid until the next pull
};

struct WriteStream {
  // Fills the next message and returns true; false at the end of the
  // stream; an error when the stream broke (the client went away).
  std::function<absl::StatusOr<bool>(WriteMessage*)> next;
};

struct WriteResult {
  uint64_t tokens_written = 0;  // summed over chunks
  uint64_t bytes_received = 0;  // K and V bytes of the chunks
};

struct ReadRequest {
  std::string tenant_id;
  std::string sequence_id;
  uint32_t layer = 0;
  uint64_t first_token = 0;
  uint32_t num_tokens = 0;                // 0: to the end of what is written
  KvDtype dtype = KvDtype::kUnspecified;  // F32 or BF16: the values' wire form
};

// One item of an Attend (SequenceStore::AttendBatch); views into the
// caller's message.
struct AttendItem {
  absl::string_view sequence_id;
  AttendSpec spec;                // spec.append is set by the core
  std::optional<KvWrite> append;  // written before attention
};

struct AttendRequest {
  std::string tenant_id;
  std::vector<AttendItem> items;
};

// One result per item, in order: the store's status (the adapter names the
// item) or float32 [num_queries][n_q_heads][head_dim], which the adapter
// sends in the item's dtype (its queries' dtype: F32 or BF16).
struct AttendResult {
  std::vector<absl::StatusOr<std::vector<float>>> items;
  std::vector<KvDtype> dtypes;  // one per item
};

struct InventoryRequest {
  // At most kMaxDescribed; see GetInventoryRequest.describe_sequence_ids.
  std::vector<std::string> describe_sequence_ids;
};
inline constexpr size_t kMaxDescribed = 1024;

// The destination side of a transfer (see "Transfers" above).
struct ImportRequest {
  std::string request_id;
  std::string transfer_id;
  std::string tenant_id;
  std::string sequence_id;
  ModelShape model;
  uint32_t block_tokens = 0;
  std::optional<uint32_t> window_tokens;  // nullopt: the store's default
  std::vector<BlockSpec> blocks;          // the plan here
  std::string source_address;             // the source worker's address
  std::string source_worker_id;           // for messages; may be empty
  uint32_t timeout_ms = 0;                // 0: kDefaultImportTimeoutMs
  bool follow_writes = false;
  // A prefix hit (ImportPlan::prefix_blocks): blocks [0, prefix_blocks)
  // share prefix_sequence_id's pages here and are not pulled.
  std::string prefix_sequence_id;
  uint32_t prefix_blocks = 0;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
  // With capabilities required: the manager's capability for the source's
  // sequence (a serialized v1::Capability), sent with the pulling calls.
  std::string source_capability;
};

struct ImportReply {
  ImportResult result;
  double seconds = 0;  // the whole import
  // The PageFetcher's: "stream" or "ipc"; "none" when every block was
  // shared with the prefix or evicted (nothing to pull).
  std::string data_path;
};

// The source side: the blocks of `blocks` (index, lineage_id and the wanted
// encoding) sent layer by layer.
struct ExportRequest {
  std::string transfer_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<BlockSpec> blocks;
  bool follow_writes = false;
};

// Pulls the pages of `req` from its source until `deadline` and installs
// them into `session` in arrival order (ImportSession::Install, or
// InstallShared on the ipc path); returns the data path it used ("stream"
// or "ipc"), the session's first error unchanged (and stops the stream),
// or the source's error with the canonical code and the source named
// ("source worker-a at 127.0.0.1:1234: ...").
using PageFetcher = std::function<absl::StatusOr<std::string>(
    const ImportRequest& req, absl::Time deadline, ImportSession* session)>;

// "source worker-a at 127.0.0.1:1234" (the id left out when empty).
std::string SourceLabel(const ImportRequest& req);

inline constexpr uint32_t kDefaultImportTimeoutMs = 10000;
inline constexpr uint32_t kMaxImportTimeoutMs = 3600 * 1000;

struct WorkerCoreOptions {
  size_t idempotency_capacity = 65536;  // remembered replies per method
};

class WorkerCore {
 public:
  // `store` and `device` (the store's) must outlive the core.
  WorkerCore(SequenceStore* store, Device* device,
             WorkerCoreOptions options = {});

  WorkerCore(const WorkerCore&) = delete;
  WorkerCore& operator=(const WorkerCore&) = delete;

  // --- Mutating calls: idempotent by (tenant_id, request_id) ----------------
  absl::StatusOr<AllocateResult> AllocatePages(const AllocatePagesRequest& req);
  absl::StatusOr<ForkResult> Fork(const ForkRequest& req);
  // Pulls every message of the stream (see "WriteKV" above). An empty
  // stream writes nothing and answers zeros.
  absl::StatusOr<WriteResult> WriteKV(const WriteStream& stream);
  absl::StatusOr<DemoteResult> Demote(const DemoteRequest& req);
  absl::StatusOr<FreeResult> Free(const FreeRequest& req);
  absl::StatusOr<SpillResult> Spill(const SpillRequest& req);
  absl::StatusOr<RestoreResult> Restore(const RestoreRequest& req);
  absl::StatusOr<EvictResult> Evict(const EvictRequest& req);

  // Installs a sequence from another worker (see "Transfers" above):
  // validates the request, reserves the plan's pages, pulls the pages
  // through `fetch` and commits; any error frees everything.
  absl::StatusOr<ImportReply> Import(const ImportRequest& req,
                                     const PageFetcher& fetch);

  // --- Read-only calls ---------------------------------------------------
  // The source side of a transfer (SequenceStore::Export; a shared export
  // when options.pins is set).
  absl::Status Export(const ExportRequest& req, const ExportOptions& options,
                      ExportSink sink);
  // The ipc path's source side: where this worker's arena can be mapped
  // (empty: nowhere), the arena as a peer maps it, and a pin set for a
  // shared export.
  std::string ShareDomain() const { return store_->ShareDomain(); }
  absl::StatusOr<SharedArenaInfo> SharedArena() const {
    return store_->SharedArena();
  }
  std::unique_ptr<PagePins> NewPagePins() const {
    return store_->NewPagePins();
  }
  // The link path's source side: the device that sends, and where a
  // shared export's arena offsets count from.
  Device* device() const { return device_; }
  const uint8_t* ArenaBase() const { return store_->ArenaBase(); }

  // INVALID_ARGUMENT for a malformed tenant_id; otherwise one result per
  // item (SequenceStore::AttendBatch: one device batch where appends allow).
  absl::StatusOr<AttendResult> Attend(const AttendRequest& req);
  absl::StatusOr<ReadResult> Read(const ReadRequest& req);
  absl::StatusOr<InventorySnapshot> GetInventory(const InventoryRequest&) const;

  // --- For the manager link and the health service -----------------------
  InventorySnapshot Inventory() const { return store_->Inventory(); }
  // The store's attention and import timings (op_timings.h), for /metrics.
  const OpTimings& timings() const { return store_->timings(); }
  // SequenceStore::TakeSelfRestored / ReturnSelfRestored.
  std::vector<uint64_t> TakeSelfRestored();
  void ReturnSelfRestored(const std::vector<uint64_t>& lineage_ids);
  // SequenceStore::TakeSealed / ReturnSealed.
  std::vector<std::pair<uint64_t, int64_t>> TakeSealed();
  void ReturnSealed(const std::vector<std::pair<uint64_t, int64_t>>& sealed);
  // Drops sequences the manager declared lost, whatever their tenant; ids
  // this worker does not hold are skipped.
  void DropLost(const std::vector<std::string>& sequence_ids);
  // Device::Health(): OK, or why the device must not serve (a sticky CUDA
  // error). A cheap read; never waits on the device.
  absl::Status DeviceHealth() const { return device_->Health(); }
  // Device::AttentionKernelSeconds(), for /metrics.
  double AttentionKernelSeconds() const {
    return device_->AttentionKernelSeconds();
  }

 private:
  // Marks (method, tenant, request id) in flight for its lifetime, after
  // waiting until no other call holds it.
  class InFlight;

  // Runs `apply` once per key: validates the request id, answers a
  // remembered reply when the request's fingerprint is the remembered one
  // (FAILED_PRECONDITION, request id reused, when not), else applies and
  // remembers a success.
  template <typename Reply, typename Apply>
  absl::StatusOr<Reply> Once(IdempotencyCache<Reply>& cache,
                             absl::string_view method,
                             const std::string& tenant_id,
                             const std::string& request_id,
                             uint64_t fingerprint, Apply apply);

  // Writes `first` and every later message of `stream`; *fingerprint (when
  // given) gets the fingerprint of the messages taken.
  absl::StatusOr<WriteResult> WriteMessages(const WriteStream& stream,
                                            const WriteMessage& first,
                                            uint64_t* fingerprint);

  SequenceStore* const store_;
  Device* const device_;

  absl::Mutex in_flight_mu_;
  absl::flat_hash_set<std::string> in_flight_ ABSL_GUARDED_BY(in_flight_mu_);

  IdempotencyCache<AllocateResult> allocate_cache_;
  IdempotencyCache<ForkResult> fork_cache_;
  IdempotencyCache<WriteResult> write_cache_;
  IdempotencyCache<DemoteResult> demote_cache_;
  IdempotencyCache<FreeResult> free_cache_;
  IdempotencyCache<SpillResult> spill_cache_;
  IdempotencyCache<RestoreResult> restore_cache_;
  IdempotencyCache<EvictResult> evict_cache_;
  IdempotencyCache<ImportReply> import_cache_;
};

}  // namespace triax::worker
