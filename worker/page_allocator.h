// Device memory for KV pages: one arena carved into per-encoding paged pools.
//
//   arena   one Device allocation of `capacity` bytes (the --pool_mb flag),
//           handed out as variable-size slabs by first fit with coalescing.
//   pool    one per (encoding, page_bytes). A pool takes slabs of about
//           kSlabBytes (never less than one page, shrunk to what the arena
//           still has) and carves them into fixed-size pages kept on per-slab
//           free lists. A slab whose pages are all free goes back to the
//           arena, so freeing everything returns the arena to empty.
//   page    refcounted: forks share pages; the last Unref returns it to its
//           pool. Pages are either target pages (a block's storage in its
//           encoding) or window pages (BF16 recent-window staging); both come
//           from the same arena and are counted apart in Stats.
//
// Usage is counted per encoding (AllocatorStats::by_encoding) and, summed,
// per K format (AllocatorStats::target: what the proto Inventory.formats
// reports, as it has one format per entry).
//
// Errors: Allocate returns RESOURCE_EXHAUSTED naming the pool (encoding and
// page bytes) and the bytes requested versus what the arena has free.
//
// Thread contract: PageAllocator is thread-safe (one internal mutex).
// Page::seal_mu serializes encoding into a page that several sequences share;
// lock order: a sequence's mutex -> Page::seal_mu -> PageAllocator::mu_.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/layout.h"
#include "worker/device.h"

namespace triax::worker {

enum class PageUse : uint8_t { kTarget = 0, kWindow = 1 };

class PageAllocator;

// One page of device memory. `data`, `bytes`, `encoding` and `use` are fixed
// while the page is allocated.
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

 private:
  friend class PageAllocator;
  int refs = 0;  // guarded by the allocator's mutex
  struct Slab* slab = nullptr;
};

// A contiguous range allocator over [0, capacity); not thread-safe (the
// PageAllocator serializes it).
class Arena {
 public:
  explicit Arena(size_t capacity);
  // Offset of a free run of `bytes` (first fit), or false.
  bool Take(size_t bytes, size_t* offset);
  void Give(size_t offset, size_t bytes);
  size_t free_bytes() const { return free_bytes_; }
  size_t capacity() const { return capacity_; }
  size_t LargestFreeRun() const;

 private:
  size_t capacity_;
  size_t free_bytes_;
  std::map<size_t, size_t> free_runs_;  // offset -> length, non-adjacent
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

struct AllocatorStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;  // target + window pages in use
  // Target pages in use, per encoding and summed per K format (entries only
  // for those with pages in use).
  EncodingUsage by_encoding;
  std::map<kernels::Format, FormatUsage> target;
  FormatUsage window;
  uint64_t slab_bytes = 0;  // arena bytes held by pools (used + free pages)
  uint64_t free_pages = 0;  // pages on pool free lists
};

class PageAllocator {
 public:
  // Preferred slab size: small pages are carved SlabBytes() at a time, which
  // is kSlabBytes, or capacity / kSlabsPerArena for arenas under 64 MiB (at
  // least kMinSlabBytes), so that a small pool is not taken whole by the
  // first encoding that asks (demotions need room for the new encoding's
  // pages while the old ones are still held).
  static constexpr size_t kSlabBytes = size_t{1} << 20;
  static constexpr size_t kMinSlabBytes = size_t{16} << 10;
  static constexpr size_t kSlabsPerArena = 64;
  size_t SlabBytes() const { return slab_bytes_; }

  // Takes `capacity_bytes` from `device` (which must outlive the allocator).
  static absl::StatusOr<std::unique_ptr<PageAllocator>> Create(
      Device* device, size_t capacity_bytes);
  ~PageAllocator();

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // A page of `page_bytes` (> 0, a multiple of 16) with refcount 1.
  // `page_bytes` is PageBytes(encoding, shape) of the caller's shape; the
  // allocator only uses the pair as a pool key.
  absl::StatusOr<Page*> Allocate(const kernels::Encoding& encoding,
                                 size_t page_bytes, PageUse use);
  void Ref(Page* page);
  // Drops one reference; returns true when it was the last (page freed).
  bool Unref(Page* page);
  int RefCount(Page* page) const;

  AllocatorStats Stats() const;
  size_t capacity() const { return capacity_; }

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

  PageAllocator(Device* device, uint8_t* base, size_t capacity);
  static std::string PoolName(const kernels::Encoding& encoding,
                              size_t page_bytes);

  Device* const device_;
  uint8_t* const base_;
  const size_t capacity_;
  const size_t slab_bytes_;

  mutable absl::Mutex mu_;
  Arena arena_ ABSL_GUARDED_BY(mu_);
  std::map<PoolKey, std::unique_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  EncodingUsage target_ ABSL_GUARDED_BY(mu_);
  FormatUsage window_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
