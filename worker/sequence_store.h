// The worker's sequences: block plans, written lengths, the BF16 recent
// window, sealing into target encodings, demotion, forks, reads and decode
// attention. Core logic only: no gRPC or protobuf; numeric enum values equal
// the proto's (Format: 1 bf16, 2 int4, 3 int2, 4 fp8_e4m3, 5 int8, 6 tq4,
// 7 tq3, 8 tq2; ScaleDtype: 0/1 fp16, 2 fp8_e4m3; KvDtype: 1 f32, 2 bf16).
//
// Encodings. Each block has one kernels::Encoding (K format, V format, INT
// group, scale dtype; see kernels/layout.h) taken from its BlockSpec and
// checked with kernels::ValidateEncoding against the sequence's page shape
// (block_tokens x n_kv_heads x head_dim); an invalid one is INVALID_ARGUMENT
// naming the block and the reason. A block is "BF16" when K and V both are.
//
// Layouts (little-endian, token-major as on the wire):
//   K, V input/output:  [num_tokens][n_kv_heads][head_dim], f32 or bf16
//   queries, outputs:   float32 [num_queries][n_q_heads][head_dim]
//
// Storage. AllocatePages reserves, for every block and every layer, one page
// in the block's target encoding (all or nothing). Tokens are written in order
// per layer into BF16 window pages (BF16 blocks are written straight into
// their target page). A block is sealed for a layer - encoded into its target
// page and its window page released - once all its tokens are written and its
// end <= written_length - window_tokens (window_tokens 0 seals as soon as a
// block is full). window_tokens is per sequence: the AllocatePages argument,
// else StoreOptions::window_tokens, fixed by the first call; forks inherit the
// parent's. Sealed blocks are always a prefix of the sequence. Attention for a
// query at position p reads tokens [0, p] over the sealed pages (in their
// encodings) and the window pages (BF16).
//
// Frames and compaction (worker/page_allocator.h). Pages come from frames
// of PageAllocator::frame_bytes that any encoding can take. A shape whose
// BF16 page (window pages; BF16 blocks) is larger than a frame is refused by
// AllocatePages (INVALID_ARGUMENT naming block_tokens, the page bytes and
// frame_bytes). When an operation that reserves pages (AllocatePages, Write
// and Attend appends, Demote, Fork, Restore, restores on Attend/Read and
// background restores) is refused by the allocator, it releases its locks,
// the store compacts the arena (pages of a pool packed into its fullest
// frames, emptied frames freed; Page objects stay, only Page::data changes,
// and nothing keeps a data pointer between operations) and runs the
// operation once more. A RESOURCE_EXHAUSTED that still leaves names the
// encoding, the bytes needed, the free bytes and frames, and what
// compaction moved and freed. AttendBatch retries an item refused so only
// when no later item of the batch names the same sequence (it would then
// run after that item); otherwise the refusal stands.
//
// Installed blocks keep their encoding: a later AllocatePages (or a fork's
// shared block) naming another encoding for an installed block is accepted
// and the installed encoding wins, because the manager may Demote a block
// while a frontend still holds a plan fetched before. Only Demote changes
// an installed block's encoding.
//
// Demotion. Demote re-encodes named blocks in place. Per layer: a sealed page
// is decoded to float, rounded to BF16 and encoded into a fresh page of the
// new encoding, which replaces it (all sealed pages of the call in one
// Device::DemotePages: on the GPU with the CUDA backend, no host round
// trip; sealing a window page into its target encoding uses it too); an
// unsealed block (still in the window) only swaps its target reservation for
// one of the new encoding (a BF16 block whose tokens lived in its target page
// moves them to a window page, and a block becoming BF16 moves its window
// page's tokens into the new target page). All or nothing: every new page is
// reserved and every re-encode done before anything is swapped. Blocks shared
// with a fork (a page refcount > 1) are refused FAILED_PRECONDITION: the
// sharers' block records are not reachable from here, so demoting one sharer
// would leave the others describing a stale encoding. Demote the block once the
// fork is gone, or plan the child with a copied block (new lineage id) instead.
//
// Forks. A child block whose lineage id is the parent's block at the same
// index shares the parent's pages (refcount); such blocks must lie within
// num_tokens and be fully written on every layer. A block with a new lineage
// id gets its own pages, filled from the parent's block at the same index
// (byte copy of a sealed page of the same format, else through the BF16
// window). The child's written length per layer is min(parent's, num_tokens).
// Pages a child got already sealed stay sealed.
//
// Spill tiers (StoreOptions::tiers, worker/tier_store.h). Each block is in
// one of four states: on the device (its target pages in the pool), spilled
// to the host or the disk tier (every layer's target page copied out with a
// CRC32C, the device pages freed), or evicted (its pages freed everywhere).
// Only sealed blocks (out of the BF16 window on every layer) that are not
// shared with a fork move; moves are all or nothing per call.
//   Spill    device -> host/disk, or host <-> disk (checksums verified on
//            the way). A block already in the named tier is left alone.
//   Restore  reserves device pages for every named block first
//            (RESOURCE_EXHAUSTED changes nothing), copies each page back and
//            verifies its checksum; a mismatch is DATA_LOSS naming the
//            sequence, block, lineage, layer and tier, nothing is restored,
//            the block stays spilled (never served) and checksum_failures
//            counts it; Evict is then the way on without it. Background
//            restores go to a prefetch queue served by the store's thread.
//   Evict    frees the block's pages wherever they are. Its tokens are no
//            longer attended (positions still count: a query at position p
//            attends to the non-evicted tokens of [0, p]); Read of a range
//            touching it is FAILED_PRECONDITION naming it.
// Attend and Read over spilled blocks: with restore_on_attend they restore
// them synchronously first. Without it they queue a background restore and
// answer UNAVAILABLE naming the blocks, with RetryAfterMs(status) set to
// StoreOptions::retry_after_ms, changing nothing (an append is not written);
// blocks already queued are restored in line instead (the caller waits for
// the prefetch rather than retrying). A block whose background restore failed
// answers that error (DATA_LOSS stays until the block is evicted or freed).
// Demote of a spilled or evicted block is FAILED_PRECONDITION (restore it
// first); Fork of a parent whose inherited blocks are spilled or evicted is
// FAILED_PRECONDITION, and a fork ignores the tier fields of its plan.
// AllocatePages naming an installed block with another tier/evicted state is
// accepted (the installed state wins, as for encodings); a new block named
// spilled or evicted is INVALID_ARGUMENT (only installed blocks move). Free
// and Drop release tier space too (files deleted); FreeResult counts device
// pages only.
//
// Batched attention. AttendBatch takes items of any sequences of one tenant
// (the same sequence more than once included) and runs every query of the
// items that pass validation as one Device::DecodeAttentionBatch (one
// kernel launch on the CUDA backend for a decode step of a batch). Each
// item's result, error or output, is what Attend would give running the
// items one by one in order: items are prepared (validated, restored) in
// order; the pending batch's appends then go to the device in one
// Device::WriteBf16TokensBatch (one upload and one synchronization on
// CUDA, not one per item), full blocks seal, and every item's pages are
// listed as they now are. An item appending to a sequence that an earlier
// item of the pending batch reads, or reading a layer that an earlier
// pending item appends to, runs the pending batch first, so no item sees a
// later item's append and each sees every earlier one. Device attention
// outputs are batch-invariant (device.h), so outputs are bit-identical
// too.
//
// Error codes (messages name the field and the value):
//   INVALID_ARGUMENT    malformed ids, shapes, plans, byte sizes, zero sizes,
//                       unspecified dtype or format, encodings invalid for
//                       the shape, encodings or shapes the Device backend
//                       refuses (Device::SupportsEncoding / SupportsAttention,
//                       e.g. TQ formats on CUDA: checked by AllocatePages,
//                       Demote and Fork before anything is reserved),
//                       layer >= n_layers, a block named twice in one Demote,
//                       Spill or Evict; an empty Spill/Evict list; a tier
//                       that is not host (2) or disk (3)
//   NOT_FOUND           unknown sequence; Demote of a block index the
//                       sequence does not have; a lineage id the sequence
//                       does not have (Spill, Restore, Evict)
//   ALREADY_EXISTS      fork child id taken
//   PERMISSION_DENIED   the sequence belongs to another tenant
//   RESOURCE_EXHAUSTED  the arena cannot hold the pages (nothing changes)
//   FAILED_PRECONDITION plan mismatch (lineage/shape/window_tokens),
//                       out-of-order write, shared block that cannot be
//                       shared, grown or demoted, Demote lineage mismatch;
//                       Spill/Evict of an unsealed, shared or (Spill)
//                       evicted block, Restore of an evicted block, a tier
//                       disabled on this worker, Read of an evicted range
//   UNAVAILABLE         Attend/Read over spilled blocks with
//                       restore_on_attend off (RetryAfterMs set), a poisoned
//                       device
//   DATA_LOSS           a spilled page failed its checksum on restore
//   OUT_OF_RANGE        tokens past the plan, positions/reads past what is
//                       written
//
// Thread contract: thread-safe. Operations on one sequence are serialized by
// its mutex; different sequences run in parallel. AttendBatch holds the
// mutexes of all its sequences at once, taken in sequence-id order (then
// address, for a freed and re-created id); no other operation holds two
// live sequences' mutexes. Lock order: the data lock (data_mu_: shared for
// operations on page data, exclusive for Compact) -> sequences' mutexes ->
// the store's mutex
// -> the prefetch queue's mutex -> page seal mutex
// -> allocator mutex (-> the tier store's); the self-restored list's mutex
// is a leaf (nothing is taken under it). The store and queue mutexes are
// never held while taking a sequence's. One prefetch thread (unless
// StoreOptions::prefetch_thread is false) serves background restores.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/model.h"
#include "kernels/layout.h"
#include "worker/device.h"
#include "worker/op_timings.h"
#include "worker/page_allocator.h"
#include "worker/prefetch_queue.h"
#include "worker/tier_store.h"

namespace triax::worker {

class ImportSession;
struct ImportPlan;
struct ExportBlock;
struct ExportOptions;
struct TransferPage;
class PagePins;
struct SharedArenaInfo;

namespace store_internal {
struct Sequence;
struct PreparedAttend;
struct DeferredWrite;
class LockedSequence;
}  // namespace store_internal

enum class KvDtype : int { kUnspecified = 0, kF32 = 1, kBF16 = 2 };

// One chunk of K/V for one layer. k and v hold num_tokens * n_kv_heads *
// head_dim values of `dtype`; F32 is rounded to BF16 on write.
struct KvWrite {
  uint32_t layer = 0;
  uint64_t first_token = 0;
  uint32_t num_tokens = 0;
  int dtype = 0;  // KvDtype value
  absl::string_view k;
  absl::string_view v;
};

struct AttendSpec {
  uint32_t layer = 0;
  uint32_t num_queries = 0;              // >= 1
  absl::Span<const uint64_t> positions;  // empty, or one per query
  absl::string_view queries;             // [nq][n_q_heads][head_dim], dtype
  // Of `queries`: F32 or BF16 (kUnspecified: F32); any other value is
  // INVALID_ARGUMENT. The output is float32 whatever it is.
  KvDtype dtype = KvDtype::kF32;
  float scale = 0.f;                // 0: 1/sqrt(head_dim)
  const KvWrite* append = nullptr;  // written first when set
};

// One item of SequenceStore::AttendBatch.
struct AttendBatchItem {
  absl::string_view sequence_id;
  AttendSpec spec;
};

struct AllocateResult {
  uint64_t pages_allocated = 0;
  uint64_t bytes_allocated = 0;
};
struct ForkResult {
  uint64_t pages_shared = 0;
  uint64_t pages_copied = 0;
};
struct DemoteResult {
  uint64_t pages_reencoded = 0;  // target pages replaced (blocks x layers)
  int64_t bytes_delta = 0;       // change of pool bytes in use
};
struct FreeResult {
  uint64_t pages_freed = 0;  // pages whose last reference went away
  uint64_t bytes_freed = 0;
};
struct SpillResult {
  uint64_t pages_moved = 0;         // blocks x layers moved into the tier
  uint64_t bytes_moved = 0;         // page bytes now held by the tier
  uint64_t device_bytes_freed = 0;  // pool bytes released
};
struct RestoreResult {
  uint64_t pages_restored = 0;  // synchronous restores done by the call
  uint64_t bytes_restored = 0;
  uint64_t blocks_queued = 0;  // background: blocks queued for restore
};
struct EvictResult {
  uint64_t pages_freed = 0;  // device pages and spilled pages released
  uint64_t bytes_freed = 0;
};
struct ReadResult {
  uint64_t first_token = 0;
  uint32_t num_tokens = 0;
  uint32_t token_values = 0;  // n_kv_heads * head_dim
  std::vector<float> k, v;    // [num_tokens][n_kv_heads][head_dim]
};
struct InventorySnapshot {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;    // target + window pages in use
  uint64_t window_bytes = 0;  // BF16 window pages in use
  std::map<kernels::Format, FormatUsage> formats;  // target pages by K format
  EncodingUsage encodings;                         // target pages by encoding
  std::vector<std::string> sequence_ids;           // sorted
  TierUsage host, disk;   // spill tiers (capacity 0: disabled)
  uint64_t spills = 0;    // blocks spilled (device -> tier, or between tiers)
  uint64_t restores = 0;  // blocks restored
  uint64_t checksum_failures = 0;  // restores refused for a bad checksum
  uint64_t evictions = 0;          // blocks evicted
  // Empty while Device::Health() is OK; else its message (e.g. a sticky
  // CUDA error): the worker reports it and the manager stops placing
  // sequences on it.
  std::string device_error;
  // The arena's frames, pools, fragmentation and compaction counters
  // (PageAllocator::Stats).
  AllocatorStats arena;
  // Blocks of the sequences a GetInventory asked to describe (WorkerCore).
  std::vector<std::pair<std::string, std::vector<BlockSpec>>> described;
};

// Attend/Read answer UNAVAILABLE with this payload (decimal milliseconds)
// when they queued a background restore of spilled blocks.
inline constexpr char kRetryAfterPayload[] = "triax.dev/retry_after_ms";
// The retry delay a status carries (0 when none).
uint32_t RetryAfterMs(const absl::Status& status);

// What the store knows about one sequence (for tests and diagnostics).
struct SequenceSnapshot {
  std::string tenant_id;
  ModelShape model;
  uint32_t block_tokens = 0;
  uint32_t window_tokens = 0;
  std::vector<BlockSpec> blocks;       // encoding fields: the current ones
  std::vector<uint64_t> written;       // per layer
  std::vector<uint32_t> sealed;        // sealed prefix blocks per layer
  std::vector<uint32_t> window_pages;  // window pages held per layer
  uint64_t planned_tokens = 0;
};

struct StoreOptions {
  uint32_t window_tokens = 32;
  // Spill tiers; null: none (Spill is FAILED_PRECONDITION). Must outlive
  // the store.
  TierStore* tiers = nullptr;
  bool restore_on_attend = true;  // else UNAVAILABLE + background restore
  uint32_t retry_after_ms = 20;   // the delay UNAVAILABLE suggests
  // False: no prefetch thread; background restores wait in the queue for
  // ServePrefetchQueue (deterministic tests).
  bool prefetch_thread = true;
  // On a device that time-slices processes (Device::TimeSlicesProcesses),
  // a shared export of stored pages takes its CRC32Cs a group of layers of
  // at least this many page bytes at a time.
  uint64_t shared_checksum_group_bytes = uint64_t{1} << 30;
};

class SequenceStore {
 public:
  // `device` and `allocator` must outlive the store.
  SequenceStore(Device* device, PageAllocator* allocator,
                StoreOptions options = {});
  ~SequenceStore();

  SequenceStore(const SequenceStore&) = delete;
  SequenceStore& operator=(const SequenceStore&) = delete;

  // Installs a new sequence's plan, or extends an existing one (more blocks,
  // or the last installed block's num_tokens grown). Reserves every new
  // block's target page on every layer, all or nothing. `window_tokens`
  // (nullopt: StoreOptions::window_tokens) is fixed by the call that installs
  // the sequence; a later call naming a different value is
  // FAILED_PRECONDITION.
  absl::StatusOr<AllocateResult> AllocatePages(
      absl::string_view tenant_id, absl::string_view sequence_id,
      const ModelShape& model, uint32_t block_tokens,
      absl::Span<const BlockSpec> blocks,
      std::optional<uint32_t> window_tokens = std::nullopt);

  // Re-encodes blocks in place (see "Demotion" above). Each entry names a
  // block by index and lineage_id and gives the new encoding in format,
  // format_v, group_size and scale_dtype; other fields are ignored. Blocks
  // already in the named encoding are left alone (not counted). Errors:
  // INVALID_ARGUMENT (empty list, a block named twice, an encoding out of
  // range or invalid for the shape), NOT_FOUND (sequence, block index),
  // PERMISSION_DENIED, FAILED_PRECONDITION (lineage mismatch, shared block),
  // RESOURCE_EXHAUSTED (new pages do not fit; nothing changes).
  absl::StatusOr<DemoteResult> Demote(absl::string_view tenant_id,
                                      absl::string_view sequence_id,
                                      absl::Span<const BlockSpec> blocks);

  // parent_tenant_id (empty: tenant_id) owns the parent; the child is
  // tenant_id's (prefix reuse across tenants that share a prefix salt).
  absl::StatusOr<ForkResult> Fork(absl::string_view tenant_id,
                                  absl::string_view parent_id,
                                  absl::string_view child_id,
                                  uint64_t num_tokens,
                                  absl::Span<const BlockSpec> blocks,
                                  absl::string_view parent_tenant_id = {});

  // Writes one chunk atomically (all its tokens or none); returns the
  // number of tokens written.
  absl::StatusOr<uint64_t> Write(absl::string_view tenant_id,
                                 absl::string_view sequence_id,
                                 const KvWrite& chunk);

  // Returns float32 [num_queries][n_q_heads][head_dim]. Query i attends to
  // tokens [0, positions[i]] (all written tokens when positions is empty);
  // KV head of query head h is h / (n_q_heads / n_kv_heads).
  absl::StatusOr<std::vector<float>> Attend(absl::string_view tenant_id,
                                            absl::string_view sequence_id,
                                            const AttendSpec& spec);

  // Attends every item (see "Batched attention" above); returns one result
  // per item, in order, each as Attend(tenant_id, item.sequence_id,
  // item.spec) run in item order would return it.
  std::vector<absl::StatusOr<std::vector<float>>> AttendBatch(
      absl::string_view tenant_id, absl::Span<const AttendBatchItem> items);

  // Dequantized tokens [first_token, first_token + num_tokens) of a layer;
  // num_tokens 0 reads to the end of what is written.
  absl::StatusOr<ReadResult> Read(absl::string_view tenant_id,
                                  absl::string_view sequence_id, uint32_t layer,
                                  uint64_t first_token, uint32_t num_tokens);

  absl::StatusOr<FreeResult> Free(absl::string_view tenant_id,
                                  absl::string_view sequence_id);

  // Drops a sequence whatever its tenant (the manager declared it lost);
  // NOT_FOUND when absent.
  absl::StatusOr<FreeResult> Drop(absl::string_view sequence_id);

  // Lineage ids of the blocks restored on the worker's own initiative
  // (restore on Attend/Read, background restores) since the previous call:
  // the manager's accounting still has them spilled until the heartbeat
  // carries them (Inventory.restored_lineage_ids). ReturnSelfRestored puts
  // back ids a failed heartbeat did not deliver.
  std::vector<uint64_t> TakeSelfRestored();
  void ReturnSelfRestored(const std::vector<uint64_t>& lineage_ids);

  // Blocks sealed since the previous call (every layer written and encoded
  // into the block's format), with the unix ms of the seal of their last
  // layer, for the manager's EVENT_BLOCK_SEALED (Inventory.sealed_blocks).
  // At most kMaxSealReports wait; past that the newest are dropped and
  // counted (SealReportsDropped). ReturnSealed puts back what a failed
  // heartbeat did not deliver.
  static constexpr size_t kMaxSealReports = 1 << 20;
  std::vector<std::pair<uint64_t, int64_t>> TakeSealed();
  void ReturnSealed(const std::vector<std::pair<uint64_t, int64_t>>& sealed);
  uint64_t SealReportsDropped() const;

  // Spill tiers (see "Spill tiers" above). `lineage_ids` name blocks of the
  // sequence; Restore with an empty list takes every spilled block.
  absl::StatusOr<SpillResult> Spill(absl::string_view tenant_id,
                                    absl::string_view sequence_id,
                                    absl::Span<const uint64_t> lineage_ids,
                                    Tier tier);
  absl::StatusOr<RestoreResult> Restore(absl::string_view tenant_id,
                                        absl::string_view sequence_id,
                                        absl::Span<const uint64_t> lineage_ids,
                                        bool background);
  absl::StatusOr<EvictResult> Evict(absl::string_view tenant_id,
                                    absl::string_view sequence_id,
                                    absl::Span<const uint64_t> lineage_ids);

  // Runs every queued background restore on the calling thread; returns the
  // number of jobs run. For stores without a prefetch thread.
  size_t ServePrefetchQueue();
  // Waits until the prefetch queue is empty and no job runs.
  void WaitPrefetchIdle();

  // Compacts the page arena (PageAllocator::Compact) with the data lock held
  // exclusively: waits for every operation touching page data to finish
  // and holds new ones back until the moves are done.
  absl::StatusOr<CompactionResult> Compact();

  absl::StatusOr<SequenceSnapshot> Describe(absl::string_view sequence_id);
  InventorySnapshot Inventory() const;
  // Timings of attention batches and imports for /metrics (op_timings.h).
  OpTimings& timings() { return timings_; }
  const OpTimings& timings() const { return timings_; }

  // Worker-to-worker transfer (worker/store_transfer.h, store_transfer.cc):
  // streams a sequence's pages layer by layer into `sink`, and installs a
  // sequence from pages another worker sent.
  absl::Status Export(
      absl::string_view tenant_id, absl::string_view sequence_id,
      absl::Span<const ExportBlock> blocks, const ExportOptions& options,
      absl::FunctionRef<absl::Status(uint32_t, std::vector<TransferPage>*)>
          sink);
  absl::StatusOr<std::unique_ptr<ImportSession>> BeginImport(
      const ImportPlan& plan);
  // This worker's arena as a peer maps it for a shared export
  // (Device::ShareArena; UNIMPLEMENTED when the backend does not share).
  // The arena never moves, so the first success is kept and every later
  // call answers the same handle (a peer keeps its mapping).
  absl::StatusOr<SharedArenaInfo> SharedArena() const;
  // Device::ShareDomain() of this worker's backend.
  std::string ShareDomain() const { return device_->ShareDomain(); }
  // An empty pin set over this store's pages (ExportOptions::pins).
  std::unique_ptr<PagePins> NewPagePins() const;
  // Where a shared export's arena offsets count from.
  const uint8_t* ArenaBase() const;

  // Target page of (block, layer), for tests that build PageRefs directly.
  absl::StatusOr<Page*> TargetPage(absl::string_view sequence_id,
                                   uint32_t block, uint32_t layer);
  // A copy of a spilled block's tier record (file paths, host extents,
  // checksums), for tests that corrupt it; FAILED_PRECONDITION when the
  // block is not spilled.
  absl::StatusOr<SpilledBlock> SpilledPages(absl::string_view sequence_id,
                                            uint32_t block);

 private:
  friend class ImportSession;
  using Sequence = store_internal::Sequence;
  using LockedSequence = store_internal::LockedSequence;
  using PreparedAttend = store_internal::PreparedAttend;
  using DeferredWrite = store_internal::DeferredWrite;

  // Lookup, and the preamble of every operation on one of a tenant's
  // sequences (sequence_store.cc).
  absl::StatusOr<std::shared_ptr<Sequence>> Lookup(
      absl::string_view sequence_id) const;
  // Lookup after checking both ids (INVALID_ARGUMENT naming the field).
  absl::StatusOr<std::shared_ptr<Sequence>> LookupOwned(
      absl::string_view tenant_id, absl::string_view sequence_id) const;
  // LookupOwned, then `check_args` (the operation's own argument checks,
  // answered before the sequence's mutex is taken), then LockOwned(seq).
  absl::StatusOr<LockedSequence> LockOwned(
      absl::string_view tenant_id, absl::string_view sequence_id,
      absl::FunctionRef<absl::Status()> check_args);
  absl::StatusOr<LockedSequence> LockOwned(absl::string_view tenant_id,
                                           absl::string_view sequence_id);
  // Takes seq's mutex and checks it is live and the tenant's (CheckOwner);
  // on an error the mutex is released again.
  static absl::StatusOr<LockedSequence> LockOwned(std::shared_ptr<Sequence> seq,
                                                  absl::string_view tenant_id);

  // The operations' bodies, run with data_mu_ held shared by the public
  // wrappers (store_compact.cc), which compact and run them once more after
  // an allocator shortfall; each is all or nothing, so a second run starts
  // from the state the first found.
  absl::StatusOr<AllocateResult> AllocatePagesOnce(
      absl::string_view tenant_id, absl::string_view sequence_id,
      const ModelShape& model, uint32_t block_tokens,
      absl::Span<const BlockSpec> blocks,
      std::optional<uint32_t> window_tokens);
  absl::StatusOr<DemoteResult> DemoteOnce(absl::string_view tenant_id,
                                          absl::string_view sequence_id,
                                          absl::Span<const BlockSpec> blocks);
  absl::StatusOr<ForkResult> ForkOnce(absl::string_view tenant_id,
                                      absl::string_view parent_id,
                                      absl::string_view child_id,
                                      uint64_t num_tokens,
                                      absl::Span<const BlockSpec> blocks,
                                      absl::string_view parent_tenant_id);
  absl::StatusOr<uint64_t> WriteOnce(absl::string_view tenant_id,
                                     absl::string_view sequence_id,
                                     const KvWrite& chunk);
  std::vector<absl::StatusOr<std::vector<float>>> AttendBatchOnce(
      absl::string_view tenant_id, absl::Span<const AttendBatchItem> items);
  absl::StatusOr<ReadResult> ReadOnce(absl::string_view tenant_id,
                                      absl::string_view sequence_id,
                                      uint32_t layer, uint64_t first_token,
                                      uint32_t num_tokens);
  absl::StatusOr<SpillResult> SpillOnce(absl::string_view tenant_id,
                                        absl::string_view sequence_id,
                                        absl::Span<const uint64_t> lineage_ids,
                                        Tier tier);
  absl::StatusOr<RestoreResult> RestoreOnce(
      absl::string_view tenant_id, absl::string_view sequence_id,
      absl::Span<const uint64_t> lineage_ids, bool background);

  // A shared export without follow_writes (store_transfer.cc): layers in
  // groups of at least StoreOptions::shared_checksum_group_bytes of pages
  // (the last may be smaller), each group's pages pinned, then their
  // CRC32Cs in one Device::Checksum, then the sink per layer of the group.
  absl::Status ExportSharedAtOnce(
      const std::shared_ptr<Sequence>& seq, absl::string_view tenant_id,
      absl::Span<const ExportBlock> blocks, uint32_t layers, uint64_t end,
      PagePins* pins,
      absl::FunctionRef<absl::Status(uint32_t, std::vector<TransferPage>*)>
          sink);
  // One layer of an Export (store_transfer.cc): the pages of `blocks` copied
  // out under the sequence's mutex, re-encoded where asked; `end` is where
  // the last named block ends.
  absl::StatusOr<std::vector<TransferPage>> ExportLayerOnce(
      const std::shared_ptr<Sequence>& seq, absl::string_view tenant_id,
      absl::Span<const ExportBlock> blocks, uint32_t layer, uint64_t end,
      PagePins* pins, bool shared_checksums);

  // Runs `op` with data_mu_ held shared; when it fails RESOURCE_EXHAUSTED
  // after an allocator shortfall (PageAllocator::Shortfalls grew), releases
  // the lock, compacts, and runs it once more (also when compaction freed
  // nothing: pages freed meanwhile count too).
  // A refusal that leaves says what compaction did (AfterCompaction).
  template <typename T, typename Op>
  absl::StatusOr<T> WithRoom(Op op) {
    const uint64_t before = allocator_->Shortfalls();
    absl::StatusOr<T> r;
    {
      absl::ReaderMutexLock lock(&data_mu_);
      r = op();
    }
    if (!NeedsCompaction(r.status(), before)) return r;
    absl::StatusOr<CompactionResult> c = Compact();
    if (c.ok()) {
      absl::ReaderMutexLock lock(&data_mu_);
      r = op();
    }
    if (!r.ok()) return AfterCompaction(r.status(), c);
    return r;
  }
  bool NeedsCompaction(const absl::Status& s, uint64_t shortfalls_before) const;
  // `s` with what compaction did (or why it failed) and the arena's free
  // bytes and frames appended, when it is RESOURCE_EXHAUSTED.
  absl::Status AfterCompaction(const absl::Status& s,
                               const absl::StatusOr<CompactionResult>& c) const;
  // The model shape and block_tokens of a new sequence: valid, supported by
  // the backend, and BF16 pages that fit a frame.
  absl::Status CheckShape(const ModelShape& model, uint32_t block_tokens) const;
  absl::StatusOr<AllocateResult> Extend(Sequence& seq,
                                        absl::string_view tenant_id,
                                        const ModelShape& model,
                                        uint32_t block_tokens,
                                        absl::Span<const BlockSpec> blocks);
  // Unlists a sequence already marked freed and releases its pages.
  FreeResult Retire(const std::shared_ptr<Sequence>& seq);
  FreeResult ReleaseAll(Sequence& seq);

  // The BF16 window and sealing (store_window.cc). With `defer`, the
  // write is checked and its window pages taken but nothing is written:
  // *defer gets the tokens and their slots, for FinishWriteLocked once the
  // device has written them (nothing else may write the layer before),
  // which moves the written count and seals as SealReadyPages does; the
  // caller takes the CRC32Cs of *unsummed (ChecksumSealed, one call for a
  // batch's sequences).
  absl::Status WriteLocked(Sequence& seq, const KvWrite& chunk,
                           absl::string_view prefix,
                           DeferredWrite* defer = nullptr);
  absl::Status FinishWriteLocked(Sequence& seq, const DeferredWrite& d,
                                 std::vector<Page*>* unsummed);
  // Seals every block of `layer` the window has moved past, then takes
  // the CRC32Cs of the target pages it sealed in one Device::Checksum
  // (Page::crc32c). SealReadyPages is the sealing alone; it lists the pages
  // sealed without a known CRC32C in *unsummed.
  absl::Status SealReady(Sequence& seq, uint32_t layer);
  absl::Status SealReadyPages(Sequence& seq, uint32_t layer,
                              std::vector<Page*>* unsummed);
  // The CRC32Cs of sealed target pages (Page::crc32c) in one
  // Device::Checksum; the device's error as it is.
  absl::Status ChecksumSealed(absl::Span<Page* const> unsummed);
  // SealReady's error for a failed ChecksumSealed of `pages` pages.
  static absl::Status SealedChecksumError(const Sequence& seq, uint32_t layer,
                                          size_t pages, const absl::Status& s);
  // BF16 copies of the first `tokens` tokens of a page.
  absl::Status PageToBf16(const kernels::Encoding& encoding,
                          const kernels::PageShape& shape, const uint8_t* page,
                          uint32_t tokens, std::vector<uint16_t>* k,
                          std::vector<uint16_t>* v);

  // Fork (store_fork.cc). Writes the first `tokens` tokens of src's block
  // `block` on `layer` into the BF16 page `dst` (slots from 0).
  absl::Status CopyTokensAsBf16(const Sequence& src, uint32_t block,
                                uint32_t layer, uint32_t tokens, uint8_t* dst);
  // Fills the child's pages of `layer` from the parent's, sealing what can
  // be; `shared[i]`: block i shares the parent's pages.
  absl::Status FillForkLayer(const Sequence& parent, Sequence& child,
                             const std::vector<bool>& shared, uint32_t layer,
                             ForkResult* result);

  // Attention (store_attend.cc). Attend's part before the device runs, with
  // seq.mu held, in two steps: PrepareAttend validates `spec`, makes the
  // attended blocks resident and prepares the append (out->append, not yet
  // written: AttendBatchOnce writes a batch's appends in one device call
  // and finishes them); CompleteAttend, after that, fills `out` with the
  // item's page list, per-query token counts and queries.
  absl::Status PrepareAttend(const std::shared_ptr<Sequence>& seq_ptr,
                             absl::string_view tenant_id,
                             const AttendSpec& spec, PreparedAttend* out);
  absl::Status CompleteAttend(const Sequence& seq, PreparedAttend* prep);

  // Spill tiers (store_spill.cc). Block indices of `lineage_ids`
  // (INVALID_ARGUMENT for a repeat, NOT_FOUND for one the sequence does not
  // have).
  absl::StatusOr<std::vector<size_t>> BlocksOf(
      const Sequence& seq, absl::Span<const uint64_t> lineage_ids) const;
  // FAILED_PRECONDITION unless block `b` is sealed on every layer and not
  // shared with a fork (`op` names the operation in the message).
  absl::Status CheckMovable(const Sequence& seq, size_t b,
                            absl::string_view op) const;
  // Restores spilled blocks `blocks`, all or nothing. `on_its_own`: not
  // asked for by a synchronous Restore call (restore on Attend/Read, a
  // background restore), so the manager learns of it from
  // TakeSelfRestored.
  absl::StatusOr<RestoreResult> RestoreLocked(Sequence& seq,
                                              const std::vector<size_t>& blocks,
                                              bool on_its_own = true);
  // Makes the spilled blocks overlapping tokens [from, to) resident per
  // restore_on_attend (see the header comment).
  absl::Status EnsureResident(const std::shared_ptr<Sequence>& seq,
                              uint64_t from, uint64_t to);
  // Queues a background restore of blocks (marks them queued).
  void QueuePrefetch(const std::shared_ptr<Sequence>& seq,
                     const std::vector<size_t>& blocks);
  // A queued background restore: the blocks of `lineage_ids` still queued
  // and spilled, one at a time.
  void RunPrefetch(Sequence& seq, const std::vector<uint64_t>& lineage_ids);

  Device* const device_;
  PageAllocator* const allocator_;
  const StoreOptions options_;

  // The data lock: held shared by every operation that reads or writes page
  // data or holds a page's data pointer (AllocatePages, Write, Attend,
  // AttendBatch, Read, Demote, Fork, Spill, Restore, background restores),
  // exclusively by Compact, which moves pages. Taken before any sequence
  // mutex, never while one is held, and never twice by one thread.
  absl::Mutex data_mu_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> sequences_
      ABSL_GUARDED_BY(mu_);
  // Ids of sequences being imported (not yet in sequences_).
  absl::flat_hash_set<std::string> importing_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex shared_arena_mu_;
  // Device::ShareArena's handle of the arena, once made.
  mutable std::optional<std::string> shared_arena_handle_
      ABSL_GUARDED_BY(shared_arena_mu_);

  mutable absl::Mutex sealed_mu_;
  std::vector<std::pair<uint64_t, int64_t>> sealed_ ABSL_GUARDED_BY(sealed_mu_);
  uint64_t sealed_dropped_ ABSL_GUARDED_BY(sealed_mu_) = 0;
  void ReportSealed(uint64_t lineage_id);
  absl::Mutex self_restored_mu_;
  std::vector<uint64_t> self_restored_ ABSL_GUARDED_BY(self_restored_mu_);
  std::atomic<uint64_t> spills_{0}, restores_{0}, checksum_failures_{0},
      evictions_{0};
  OpTimings timings_;  // attention batches (store_attend.cc), imports

  PrefetchQueue prefetch_;
};

}  // namespace triax::worker
