// Worker-to-worker transfer at the store level: the source's export of a
// sequence's pages and the destination's import that installs them as a new
// sequence. No gRPC: the service (worker_service.h) moves TransferPages over
// the network; another data path (device to device) can drive the same
// ImportSession with its own pages.
//
// Export (SequenceStore::Export). For a sequence and a list of blocks
// (index, lineage id, wanted encoding), produces every layer's pages in
// order: layer 0 of every named block, then layer 1, ... Per (block, layer):
//   - a sealed page whose encoding is the wanted one: its stored bytes;
//   - a sealed page of another encoding: re-encoded exactly as Demote does
//     (Device::DemotePages from the stored page into a scratch page of the
//     pool, so the bytes equal what a Demote would have stored);
//   - a block still in the BF16 window on that layer: its BF16 window page
//     (the target page of a BF16 block), sealed = false; the destination
//     keeps it in its own window and seals it later;
//   - a block spilled to the host or disk tier: read from the tier with its
//     checksum verified (DATA_LOSS on a mismatch), re-encoded through
//     scratch pages when the wanted encoding differs.
// Every page carries the CRC32C of its bytes (worker/checksum.h): a stored
// page's from when it sealed (Page::crc32c), which also catches bytes that
// changed at rest since; others' taken by the export. A layer's
// pages are copied out under the sequence's mutex and handed to the sink
// after it is released: the sink (the network) never runs under a store lock.
// Without follow_writes every named block must be written on every layer
// (FAILED_PRECONDITION naming the layer otherwise). With follow_writes the
// export waits before each layer until it is written up to the end of the
// last named block: a condition variable signalled by every write of the
// sequence (and by Free), woken at least every 100 ms to look at the
// cancellation callback, bounded by the deadline (DEADLINE_EXCEEDED) and
// the callback (CANCELLED). Errors: INVALID_ARGUMENT (empty list, a block
// named twice, an encoding invalid for the shape or the backend), NOT_FOUND
// (sequence, block index), PERMISSION_DENIED, FAILED_PRECONDITION (lineage
// mismatch, an evicted block, an unwritten layer), DATA_LOSS (a spilled
// page failed its checksum), RESOURCE_EXHAUSTED (no room for a scratch page).
//
// Import (SequenceStore::BeginImport, then ImportSession). BeginImport checks
// the plan as AllocatePages does (model shape, block_tokens, window pages fit
// a frame, indices from 0, contiguous tokens, encodings valid and supported
// here) and reserves every non-evicted block's target page on every layer,
// all or nothing; the id must be free (ALREADY_EXISTS when a sequence or
// another import holds it). Evicted blocks of the plan are created evicted
// and move no bytes; the tier fields of the plan are otherwise ignored: an
// imported block lands on the device. Install checks each page against the
// plan before its CRC32C and the CRC32C before copying anything:
//   INVALID_ARGUMENT  layer >= n_layers, a block index not in the plan, a
//                     lineage id other than the plan's, a page for an
//                     evicted block, a page installed twice, an encoding
//                     other than the block's (sealed) or BF16 (window
//                     page), data size other than PageBytes of that
//                     encoding, num_tokens other than the block's;
//   DATA_LOSS         a CRC32C mismatch (the message names the sequence,
//                     block, lineage, layer and the source; nothing of that
//                     page is installed and the import must be aborted).
// Commit checks that every (block, layer) arrived (DATA_LOSS naming the
// first missing one) and that each layer's sealed pages form a prefix,
// sets every layer's written length to the plan's tokens, seals what the
// window rule seals here, and only then makes the sequence visible (or
// answers ALREADY_EXISTS when AllocatePages created the id meanwhile): until
// Commit it is not listed, and Attend, Read, Write and AllocatePages do not
// see it (its pages count as used in the inventory). A session destroyed
// without a successful Commit frees every page it allocated.
//
// A prefix hit (ImportPlan::prefix_blocks = K > 0). Blocks [0, K) of the
// plan are not sent: BeginImport takes a reference on every layer's page of
// blocks [0, K) of prefix_sequence_id (a sequence of the same tenant here,
// not the imported one), as ForkSequence shares a parent's blocks, so the
// prefix sequence may be freed while the import runs; a session destroyed
// without a Commit drops those references. The shared blocks keep the
// prefix's encodings (the plan's encodings of blocks [0, K) are ignored)
// and, being full and sealed, take no writes (a Write below the written
// length is refused, as for a fork). BeginImport refuses, before reserving
// anything:
//   INVALID_ARGUMENT    prefix_sequence_id empty or not an id, or equal to
//                       sequence_id; K > the plan's blocks;
//   NOT_FOUND           the prefix sequence is not here;
//   PERMISSION_DENIED   it is another tenant's;
//   FAILED_PRECONDITION another model shape or block_tokens; fewer than K
//                       blocks; a block i < K whose lineage id, first_token
//                       or num_tokens differ from the plan's (the message
//                       names i and both lineage ids), that is not full, is
//                       evicted or spilled, or is not sealed on every layer.
// Install refuses a page of a shared block (INVALID_ARGUMENT).
//
// Thread contract: Export is thread-safe like every store operation. An
// ImportSession is used by one thread at a time; sessions for different
// sequences run in parallel with each other and with the store's other
// operations. Both take the store's data lock (shared) only while they
// touch page data, never while they wait.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/model.h"
#include "kernels/layout.h"
#include "worker/page_allocator.h"
#include "worker/sequence_store.h"

namespace triax::worker {

// One block to export: which one, and the encoding its pages travel in.
struct ExportBlock {
  uint32_t index = 0;
  uint64_t lineage_id = 0;
  kernels::Encoding encoding;
};

// One page of a transfer (one layer of one block).
struct TransferPage {
  uint32_t layer = 0;
  uint32_t block_index = 0;
  uint64_t lineage_id = 0;
  kernels::Encoding encoding;  // of the bytes: BF16 for a window page
  uint32_t num_tokens = 0;     // tokens the page holds
  bool sealed = false;         // false: a BF16 window page
  std::string data;            // PageBytes(encoding, shape) bytes
  uint32_t crc32c = 0;         // CRC32C of the page's bytes
  // Export: crc32c is the stored page's, kept from when it sealed
  // (Page::crc32c), so the export need not checksum it.
  bool crc_known = false;
  // The ipc path: no `data`; the bytes lie at `arena_offset` of the
  // source's shared arena, `shared_bytes` long.
  bool shared = false;
  uint64_t arena_offset = 0;
  uint64_t shared_bytes = 0;
};

// A run of shared pages (the ipc path): `count` (> 0) pages of `layer`, of
// blocks first_block, first_block + 1, ..., all of one encoding, sealed
// flag, num_tokens and length `bytes`, page k's bytes at offset + k * stride
// of the peer's arena; lineage_ids[k] and crc32cs[k] are page k's (arrays
// of `count` entries the caller keeps alive during the install). A page
// is a run of one.
struct SharedRun {
  uint32_t layer = 0;
  uint32_t first_block = 0;
  uint32_t count = 0;
  kernels::Encoding encoding;
  uint32_t num_tokens = 0;
  bool sealed = false;
  uint64_t offset = 0;
  uint64_t stride = 0;
  uint64_t bytes = 0;
  const uint64_t* lineage_ids = nullptr;
  const uint32_t* crc32cs = nullptr;
};

// Pages a shared export pinned (PageAllocator::Pin) for a peer that copies
// them by arena offset; each is unpinned by ReleaseFirst or when the set is
// destroyed. Thread-safe: an exporter adds while the peer's acknowledgements
// release.
class PagePins {
 public:
  explicit PagePins(PageAllocator* allocator) : allocator_(allocator) {}
  ~PagePins();
  PagePins(const PagePins&) = delete;
  PagePins& operator=(const PagePins&) = delete;

  // Takes over one pin of each page (the caller pinned them).
  void Adopt(std::vector<Page*>* pinned);
  // Pins added so far.
  size_t size() const;
  // Unpins pins [released so far, n) (n is clamped to size()).
  void ReleaseFirst(size_t n);
  size_t held() const;  // pinned and not yet released

 private:
  PageAllocator* const allocator_;
  mutable absl::Mutex mu_;
  std::vector<Page*> pages_ ABSL_GUARDED_BY(mu_);
  size_t released_ ABSL_GUARDED_BY(mu_) = 0;
};

struct ExportOptions {
  bool follow_writes = false;
  absl::Time deadline = absl::InfiniteFuture();
  // Polled while waiting for writes; true stops the export (CANCELLED).
  std::function<bool()> cancelled;
  // Set: a shared export (the ipc path). No bytes are copied out: each page
  // is shared = true with its offset and length in this worker's arena
  // (SequenceStore::SharedArena), its CRC32C the one the page keeps from
  // sealing (Page::crc32c) or else computed on the device, and
  // stays pinned in *pins — so compaction, frees and demotions leave its
  // bytes in place — until the caller releases it. Stored pages are pinned
  // where they are; re-encoded and spilled ones in scratch pages of the
  // pool, which the pins keep.
  PagePins* pins = nullptr;
  // A shared export without checksums: crc32c is left 0 (the link path
  // takes each page's CRC32C as it gathers the page to send it).
  bool shared_checksums = true;
};

// This worker's arena as a peer maps it (Device::ShareArena).
struct SharedArenaInfo {
  std::string backend;  // Device::Name()
  std::string handle;
  uint64_t bytes = 0;
};

// Receives one layer's pages (in block order); an error stops the export.
using ExportSink = absl::FunctionRef<absl::Status(
    uint32_t layer, std::vector<TransferPage>* pages)>;

struct ImportPlan {
  std::string tenant_id;
  std::string sequence_id;
  ModelShape model;
  uint32_t block_tokens = 0;
  std::optional<uint32_t> window_tokens;  // nullopt: the store's default
  std::vector<BlockSpec> blocks;
  // Who sends the pages, for messages ("source worker-a at 10.0.0.1:7070").
  std::string source;
  // A prefix hit: blocks [0, prefix_blocks) are not sent; they share the
  // pages of the same blocks of `prefix_sequence_id` (a sequence of the
  // tenant here), as a fork's shared blocks do. 0: every block is sent.
  std::string prefix_sequence_id;
  uint32_t prefix_blocks = 0;
};

struct ImportResult {
  uint64_t pages = 0;         // pages installed
  uint64_t wire_bytes = 0;    // page bytes received
  uint64_t bf16_bytes = 0;    // the same tokens as BF16 pages
  uint64_t page_bytes = 0;    // pool bytes allocated here (target + window)
  uint64_t pages_shared = 0;  // pages shared with the prefix sequence
  // Per layer: seconds from BeginImport until the layer's last page was
  // installed (0 for a layer without pages).
  std::vector<double> layer_done_seconds;
  // The ipc and link paths: seconds spent in Device::CopyPagesChecked (the
  // device copies and their CRC32Cs, host synchronization included); in
  // the ipc path's pipeline (StartSharedRuns) the host's time launching
  // the copies and waiting for them, which leaves out what they overlap.
  double copy_seconds = 0;
  // Seconds in BeginImport (reserving the plan's pages), waiting for the
  // source (ImportSession::CountWait, by the data path), and in Commit.
  double reserve_seconds = 0;
  double wait_seconds = 0;
  double commit_seconds = 0;
};

class ImportSession {
 public:
  ~ImportSession();  // frees everything unless committed
  ImportSession(const ImportSession&) = delete;
  ImportSession& operator=(const ImportSession&) = delete;

  // Checks `page` (see the header comment) and copies it into its page.
  absl::Status Install(const TransferPage& page);
  // The ipc path: checks each page as Install does (with shared_bytes for
  // the data size, and the range inside the peer's arena of `peer_bytes`
  // mapped at `peer_base`), copies them all device to device with their
  // CRC32C taken on the way (Device::CopyPagesChecked) and compares each
  // with the page's crc32c (DATA_LOSS naming the first mismatch; nothing
  // of this batch counts as installed then).
  absl::Status InstallShared(absl::Span<const TransferPage> pages,
                             const uint8_t* peer_base, uint64_t peer_bytes);
  // The same for runs of pages (SharedRun), each page checked as Install
  // does; the checks of what a run's pages share are made once per run.
  // StartSharedRuns followed by FinishShared: installed in order after any
  // batches already started.
  absl::Status InstallSharedRuns(absl::Span<const SharedRun> runs,
                                 const uint8_t* peer_base, uint64_t peer_bytes);
  // The ipc path in a pipeline: checks `runs` as InstallSharedRuns does and
  // starts their copies (Device::NewCheckedCopies), their pages pinned
  // until the batch is finished; then, while the device copies them,
  // finishes the batch started before, if any: its CRC32Cs compared
  // (DATA_LOSS naming the first mismatch) and its pages installed. So when
  // it returns OK every batch but the last one started is installed;
  // FinishShared (and Commit) installs that one. What the batch needs
  // later (the CRC32Cs) is copied: the caller may reuse `runs`' arrays.
  // After an error the session is to be destroyed, which waits for the
  // device before it frees the pages.
  absl::Status StartSharedRuns(absl::Span<const SharedRun> runs,
                               const uint8_t* peer_base, uint64_t peer_bytes);
  absl::Status FinishShared();
  // Batches started and not yet installed (0, 1 or 2).
  size_t SharedInFlight() const;
  // The data path's time blocked on the source (the next batch, a link's
  // receive), added to ImportResult::wait_seconds.
  void CountWait(absl::Duration waited);
  // Completes the import and makes the sequence visible; on an error the
  // session still holds its pages until it is destroyed.
  absl::StatusOr<ImportResult> Commit();

  const ImportPlan& plan() const { return plan_; }

 private:
  friend class SequenceStore;
  struct State;
  ImportSession(SequenceStore* store, ImportPlan plan,
                std::unique_ptr<State> state);
  // What the checks read of one page.
  struct PageRef {
    uint32_t layer = 0;
    uint32_t block_index = 0;
    uint64_t lineage_id = 0;
    kernels::Encoding encoding;
    uint32_t num_tokens = 0;
    bool sealed = false;
    uint32_t crc32c = 0;
  };
  static PageRef RefOf(const TransferPage& page);
  absl::Status InstallOnce(const TransferPage& page);
  absl::Status StartSharedOnce(absl::Span<const SharedRun> runs,
                               const uint8_t* peer_base, uint64_t peer_bytes);
  // With the mutex held: checks every page of `runs` (Destination), marks
  // them pending and lists their copies and pages in the state; on an
  // error nothing stays marked.
  absl::Status CheckShared(absl::Span<const SharedRun> runs,
                           const uint8_t* peer_base, uint64_t peer_bytes);
  // With the mutex held: DATA_LOSS for the first page whose copy's CRC32C
  // (crcs, in page order) differs from the source's.
  absl::Status CompareCrcs(absl::Span<const SharedRun> runs,
                           absl::Span<const uint32_t> crcs) const;
  // With the mutex held: records the pages of `runs` as installed.
  void InstallRuns(absl::Span<const SharedRun> runs);
  // Waits for the oldest batch in flight, then compares and installs it.
  absl::Status FinishOldest();
  // With the imported sequence's mutex held: checks `page` against the
  // plan (its bytes `bytes` long; CRC32C not yet) and returns the page its
  // bytes go to, allocating the block's window page for a window page of a
  // non-BF16 block (kept on the block, so a retry reuses it).
  absl::StatusOr<Page*> Destination(const PageRef& page, size_t bytes,
                                    absl::FunctionRef<std::string()> where);
  // With the mutex held: records an installed page (figures, per-layer
  // completion).
  void Installed(const PageRef& page);
  // Adds n installed pages of `layer` to the figures (per-layer completion).
  void Counted(uint32_t layer, const kernels::Encoding& encoding, uint32_t n);
  static void MarkSealed(Page* page, uint32_t crc32c);
  std::string Where(uint32_t block_index, uint32_t layer) const;

  SequenceStore* const store_;
  const ImportPlan plan_;
  std::unique_ptr<State> state_;
};

}  // namespace triax::worker
