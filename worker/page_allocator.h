// Device memory for KV pages: one arena cut into frames of one size, any free
// frame serving any encoding.
//
//   arena   one Device allocation of `capacity` bytes (the --pool_mb flag),
//           cut into capacity / frame_bytes frames of frame_bytes (the
//           --frame_kb flag); the last capacity % frame_bytes bytes are
//           never used (the arena tail).
//   frame   free, or held by exactly one pool. A pool carves a frame into
//           frame_bytes / page_bytes slots; the frame_bytes % page_bytes
//           bytes after the last slot are the frame's tail (unused while the
//           pool holds it). A frame whose slots are all free goes back to the
//           free list at once, so freeing everything returns every frame.
//   pool    one per (encoding, page_bytes): the frames it holds. Allocate
//           takes a free slot of the pool's lowest-index frame with one
//           (the most recently freed slot; a fresh frame hands out low
//           slots first), else the lowest free frame.
//   page    refcounted: forks share pages; the last Unref returns its slot.
//           Page objects come from slabs of the allocator's and are reused
//           once freed; AllocateMany takes its pages run by run (a frame's
//           free slots, then whole fresh frames) under one lock, the same
//           slots in the same order as as many Allocate calls.
//           Page objects never move; Compact moves their bytes and changes
//           Page::data (see Compaction). Pages are either target pages (a
//           block's storage in its encoding) or window pages (BF16
//           recent-window staging); both come from the same frames (a BF16
//           pool holds both) and are counted apart in Stats.
//
// Pages larger than a frame are refused (INVALID_ARGUMENT naming page_bytes
// and frame_bytes): a frame is the unit every encoding can take, and a page
// spanning frames would need a contiguous run of them, the very thing that
// fragments. The store refuses such shapes at AllocatePages, before anything
// is reserved; the default frame (kDefaultFrameBytes, 256 KiB) holds a BF16
// page of 64 tokens x 8 KV heads x head_dim 128.
//
// Compaction. Compact() moves, per pool, the pages of its least-used frames
// into free slots of its most-used frames (Device::CopyPage, then Page::data
// is updated) until at most one of its frames has free slots; emptied frames
// go back to the free list. Pinned pages (Pin) stay where they are, so a
// frame holding one is not emptied. A shared page is one Page object and moves
// once. The caller guarantees that nobody reads or writes page data, nor holds
// a page's data pointer, while Compact runs (SequenceStore holds its data lock
// exclusively).
//
// Fragmentation (AllocatorStats::fragmentation) is the share of free bytes
// that are not in free frames: free slots of frames held by pools, frame
// tails and the arena tail, over capacity - used_bytes (0 when nothing is
// free). Free slots count only for their own pool; compaction brings the
// slot part down to at most one frame per pool.
//
// Usage is counted per encoding (AllocatorStats::by_encoding) and, summed,
// per K format (AllocatorStats::target: what the proto Inventory.formats
// reports, as it has one format per entry).
//
// Errors: Allocate returns RESOURCE_EXHAUSTED naming the pool (encoding and
// page bytes), the bytes requested, the free bytes and the free frames, with
// the payload kShortfallPayload (so callers can tell an allocator shortfall
// from other exhaustion and compact).
//
// Thread contract: PageAllocator is thread-safe (one internal mutex, held
// during Compact's copies too).
// Page::seal_mu serializes encoding into a page that several sequences share;
// lock order: a sequence's mutex -> Page::seal_mu -> PageAllocator::mu_.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/layout.h"
#include "worker/device.h"

namespace triax::worker {

enum class PageUse : uint8_t { kTarget = 0, kWindow = 1 };

class PageAllocator;

// One page of device memory. `bytes`, `encoding` and `use` are fixed while
// the page is allocated; `data` changes only under PageAllocator::Compact.
struct Page {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  kernels::Encoding encoding;
  PageUse use = PageUse::kTarget;

  // True once the block's tokens have been encoded into this (target) page.
  // Shared pages are encoded by whichever sharer seals first; the others see
  // the flag and skip the encode.
  absl::Mutex seal_mu;
  bool encoded ABSL_GUARDED_BY(seal_mu) = false;
  // The CRC32C of the encoded page's bytes, when known: taken when the
  // page seals (in one pass per write), verified on import, carried over by
  // a fork's copy. A transfer's source sends it instead of checksumming on
  // the device while the peer copies (on one GPU the two processes'
  // kernels time-slice). Cleared whenever `encoded` is; pages whose bytes
  // are re-encoded (Demote) start without one and are checksummed when
  // they are exported.
  bool crc_known ABSL_GUARDED_BY(seal_mu) = false;
  uint32_t crc32c ABSL_GUARDED_BY(seal_mu) = 0;

 private:
  friend class PageAllocator;
  // Guarded by the allocator's mutex.
  int refs = 0;
  int pins = 0;      // <= refs; a pinned page does not move
  size_t frame = 0;  // index of the frame holding it
  uint32_t slot = 0;
};

// A range allocator over [0, capacity), first fit with coalescing (the host
// spill tier's, worker/tier_store.h); not thread-safe (its owner serializes
// it). Free runs are kept by offset (first fit, coalescing) and by length
// (largest first), so LargestFreeRun is O(1) and TakeLargest O(log runs).
class Arena {
 public:
  // One range handed out by Gather.
  struct Run {
    size_t offset = 0;
    size_t bytes = 0;
  };

  explicit Arena(size_t capacity);
  // Offset of a free run of `bytes` (first fit), or false.
  bool Take(size_t bytes, size_t* offset);
  // Takes up to `max_bytes` from the start of the largest free run (the
  // lowest-offset one among equals), a multiple of `unit` (> 0) bytes:
  // min(max_bytes, the run's length rounded down to `unit`). Returns the
  // bytes taken, 0 when no run holds `unit` bytes (nothing taken then).
  // `max_bytes` should be a multiple of `unit` for the result to be one.
  size_t TakeLargest(size_t max_bytes, size_t unit, size_t* offset);
  // Takes `bytes` (a multiple of `unit`, > 0) as one run when a free run
  // holds them (first fit), else as several: each step takes the rest in one
  // run if one holds it (first fit), else all of the largest run (rounded
  // down to `unit`). Appends the runs in the order taken; all or nothing:
  // false, nothing taken and `runs` untouched, when the free runs (each
  // rounded down to `unit`) do not cover `bytes`. When every Take / Give /
  // Gather uses multiples of `unit` and the capacity is one, Gather succeeds
  // exactly when bytes <= free_bytes().
  bool Gather(size_t bytes, size_t unit, std::vector<Run>* runs);
  void Give(size_t offset, size_t bytes);
  size_t free_bytes() const { return free_bytes_; }
  size_t capacity() const { return capacity_; }
  size_t LargestFreeRun() const;
  size_t free_runs() const { return free_runs_.size(); }

 private:
  // Longest first, then lowest offset.
  struct LongerFirst {
    bool operator()(const std::pair<size_t, size_t>& a,
                    const std::pair<size_t, size_t>& b) const {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    }
  };
  void AddRun(size_t offset, size_t bytes);
  void EraseRun(std::map<size_t, size_t>::iterator it);
  // Takes `bytes` from the start of the run at `it` (bytes <= its length).
  void TakeFrom(std::map<size_t, size_t>::iterator it, size_t bytes);

  size_t capacity_;
  size_t free_bytes_;
  std::map<size_t, size_t> free_runs_;  // offset -> length, non-adjacent
  // (length, offset) of every entry of free_runs_.
  std::set<std::pair<size_t, size_t>, LongerFirst> by_length_;
};

struct FormatUsage {
  uint64_t pages = 0;
  uint64_t bytes = 0;
};

// A strict total order on encodings consistent with Encoding::operator==
// (the group compares as Group(), so 0 and 32 are one key).
struct EncodingLess {
  bool operator()(const kernels::Encoding& a, const kernels::Encoding& b) const;
};
using EncodingUsage = std::map<kernels::Encoding, FormatUsage, EncodingLess>;

// One pool as Stats sees it.
struct PoolStats {
  kernels::Encoding encoding;
  uint64_t page_bytes = 0;
  uint64_t pages_per_frame = 0;  // frame_bytes / page_bytes
  uint64_t frames = 0;           // frames the pool holds
  uint64_t pages_used = 0;       // target + window pages in use
  uint64_t free_slots = 0;       // free pages inside the pool's frames
  // Pages of this pool Allocate can hand out now: free_slots + free_frames *
  // pages_per_frame.
  uint64_t allocatable_pages = 0;
  // Free slots once Compact packed the pool into ceil(pages_used /
  // pages_per_frame) frames.
  uint64_t free_slots_compacted = 0;
};

// What a Compact call did.
struct CompactionResult {
  uint64_t pages_moved = 0;
  uint64_t bytes_moved = 0;
  uint64_t frames_freed = 0;  // frames returned to the free list
  double seconds = 0;         // wall time of the call, copies included
};

struct AllocatorStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;  // target + window pages in use
  // Target pages in use, per encoding and summed per K format (entries only
  // for those with pages in use).
  EncodingUsage by_encoding;
  std::map<kernels::Format, FormatUsage> target;
  FormatUsage window;
  uint64_t frame_bytes = 0;
  uint64_t frames = 0;       // capacity / frame_bytes
  uint64_t free_frames = 0;  // frames held by no pool
  // Free frames once Compact packed every pool (what an allocation that
  // compacts on a shortfall can count on).
  uint64_t free_frames_compacted = 0;
  uint64_t free_bytes = 0;  // capacity - used_bytes
  uint64_t held_bytes = 0;  // bytes of frames held by pools
  uint64_t free_slots = 0;  // free pages inside held frames, all pools
  // Bytes no page can use: frame tails of held frames + the arena tail.
  uint64_t tail_bytes = 0;
  double fragmentation = 0;      // see the header comment
  std::vector<PoolStats> pools;  // ordered by (page_bytes, encoding)
  // Since the allocator was created.
  uint64_t compactions = 0;  // Compact calls that moved at least one page
  uint64_t pages_moved = 0;
  uint64_t bytes_moved = 0;
  uint64_t frames_freed_by_compaction = 0;
};

// Payload of Allocate's RESOURCE_EXHAUSTED (value: the requested page bytes).
inline constexpr char kShortfallPayload[] = "triax.dev/allocator_shortfall";

class PageAllocator {
 public:
  // 256 KiB: a BF16 page of 64 tokens x 8 KV heads x head_dim 128 fits one
  // frame; kvproxy-18m at 16-token blocks (2 KV heads x 128) has 16 KiB
  // BF16 pages (16 a frame, no tail) and 4608-byte INT4 g32 pages (56 a
  // frame, a 4 KiB tail: 1.6%). Larger frames leave more free slots
  // stranded per pool (at most one partly used frame per pool after
  // compaction), smaller ones refuse larger pages.
  static constexpr size_t kDefaultFrameBytes = size_t{256} << 10;

  // Takes `capacity_bytes` from `device` (which must outlive the allocator).
  // INVALID_ARGUMENT unless 0 < frame_bytes <= capacity_bytes and
  // frame_bytes is a multiple of 16.
  static absl::StatusOr<std::unique_ptr<PageAllocator>> Create(
      Device* device, size_t capacity_bytes,
      size_t frame_bytes = kDefaultFrameBytes);
  ~PageAllocator();

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // A page of `page_bytes` (> 0, a multiple of 16, <= frame_bytes) with
  // refcount 1. `page_bytes` is PageBytes(encoding, shape) of the caller's
  // shape; the allocator only uses the pair as a pool key.
  absl::StatusOr<Page*> Allocate(const kernels::Encoding& encoding,
                                 size_t page_bytes, PageUse use);
  // `n` such pages under one lock, appended to *out: all or nothing (on an
  // error the ones taken are freed and *out is as it was).
  absl::Status AllocateMany(const kernels::Encoding& encoding,
                            size_t page_bytes, PageUse use, size_t n,
                            std::vector<Page*>* out);
  void Ref(Page* page);
  // Drops one reference; returns true when it was the last (page freed).
  bool Unref(Page* page);
  // Unref of every page under one lock (a page may appear twice); returns
  // the pages freed and adds their bytes to *bytes_freed.
  uint64_t UnrefAll(absl::Span<Page* const> pages, uint64_t* bytes_freed);
  int RefCount(Page* page) const;

  // Pinning (transfers on the ipc path, where a peer process copies a page
  // by its offset in the arena): Pin takes a reference and keeps the page's
  // bytes where they are — Compact moves no pinned page — until the
  // matching Unpin, which drops that reference (true when it was the last).
  void Pin(Page* page);
  bool Unpin(Page* page);
  int PinCount(Page* page) const;
  // Pin / Unpin of every page, under one lock (a page may appear twice).
  void PinAll(absl::Span<Page* const> pages);
  void UnpinAll(absl::Span<Page* const> pages);
  // The arena's base and length (the ipc path shares them).
  uint8_t* arena_base() const { return base_; }
  size_t arena_bytes() const { return capacity_; }

  // See "Compaction" above. A failed copy stops it (the page being moved
  // stays where it was) and returns the device's error.
  absl::StatusOr<CompactionResult> Compact();

  // RESOURCE_EXHAUSTED refusals of Allocate since start: a caller compares
  // it before and after an operation to tell an allocator shortfall from
  // other exhaustion (e.g. a full spill tier).
  uint64_t Shortfalls() const { return shortfalls_.load(); }

  AllocatorStats Stats() const;
  size_t capacity() const { return capacity_; }
  size_t frame_bytes() const { return frame_bytes_; }

 private:
  struct PoolKey {
    kernels::Encoding encoding;
    size_t page_bytes;
    bool operator<(const PoolKey& o) const {
      if (page_bytes != o.page_bytes) return page_bytes < o.page_bytes;
      return EncodingLess()(encoding, o.encoding);
    }
  };
  struct Pool;
  struct Frame {
    Pool* pool = nullptr;        // null: free
    std::vector<Page*> slots;    // null: free slot
    std::vector<uint32_t> free;  // free slot numbers, lowest last
    uint32_t used = 0;
  };

  PageAllocator(Device* device, uint8_t* base, size_t capacity,
                size_t frame_bytes);
  static std::string PoolName(const kernels::Encoding& encoding,
                              size_t page_bytes);
  uint8_t* SlotData(size_t frame, uint32_t slot, size_t page_bytes) const {
    return base_ + frame * frame_bytes_ + size_t{slot} * page_bytes;
  }
  // Gives a frame whose slots are all free back to the free list.
  void ReleaseFrame(size_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool UnrefLocked(Page* page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Allocate's checks of page_bytes (no lock needed).
  absl::Status CheckPageBytes(const kernels::Encoding& encoding,
                              size_t page_bytes) const;
  // Up to `max` (>= 1) pages from `*pool` (looked up or made on first use,
  // then reused by the caller's next call), appended to *out: the free
  // slots of one frame with some, else up to a whole fresh frame. Counts
  // them in used_bytes_ but not in target_ / window_ (the caller adds the
  // pages to `*usage`). RESOURCE_EXHAUSTED when the pool has no free slot
  // and no frame is free.
  absl::Status AllocateRunLocked(const kernels::Encoding& encoding,
                                 size_t page_bytes, PageUse use, size_t max,
                                 Pool** pool, std::vector<Page*>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The usage figure a page of `encoding` and `use` counts in.
  FormatUsage& UsageLocked(const kernels::Encoding& encoding, PageUse use)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return use == PageUse::kWindow ? window_ : target_[encoding];
  }
  // Page objects come from slabs and go back to a free list
  // (spare_pages_; the import of a long sequence makes tens of thousands at
  // once). Reserve adds slabs until the list holds `n`.
  void ReserveSparePagesLocked(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeletePageLocked(Page* page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lowest free frame, taken off the free set (the set is not empty).
  size_t TakeFreeFrameLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Device* const device_;
  uint8_t* const base_;
  const size_t capacity_;
  const size_t frame_bytes_;

  std::atomic<uint64_t> shortfalls_{0};
  mutable absl::Mutex mu_;
  std::vector<Frame> frames_ ABSL_GUARDED_BY(mu_);
  // Free frames: a bit per frame (set: free), their count, and a word index
  // below which no bit is set (the lowest free frame is found from there).
  std::vector<uint64_t> free_bits_ ABSL_GUARDED_BY(mu_);
  size_t free_frames_ ABSL_GUARDED_BY(mu_) = 0;
  size_t free_hint_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<Page[]>> page_slabs_ ABSL_GUARDED_BY(mu_);
  std::vector<Page*> spare_pages_ ABSL_GUARDED_BY(mu_);
  std::map<PoolKey, std::unique_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  EncodingUsage target_ ABSL_GUARDED_BY(mu_);
  FormatUsage window_ ABSL_GUARDED_BY(mu_);
  CompactionResult compacted_ ABSL_GUARDED_BY(mu_);  // totals since start
  uint64_t compactions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace triax::worker
