// Device memory for KV pages: one arena carved into per-format paged pools.
//
//   arena   one Device allocation of `capacity` bytes (the --pool_mb flag),
//           handed out as variable-size slabs by first fit with coalescing.
//   pool    one per (format, page_bytes). A pool takes slabs of about
//           kSlabBytes (never less than one page, shrunk to what the arena
//           still has) and carves them into fixed-size pages kept on per-slab
//           free lists. A slab whose pages are all free goes back to the
//           arena, so freeing everything returns the arena to empty.
//   page    refcounted: forks share pages; the last Unref returns it to its
//           pool. Pages are either target pages (a block's storage in its
//           format) or window pages (BF16 recent-window staging); both come
//           from the same arena and are counted apart in Stats.
//
// Errors: Allocate returns RESOURCE_EXHAUSTED naming the pool (format and
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

// One page of device memory. `data`, `bytes`, `format` and `use` are fixed
// while the page is allocated.
struct Page {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  kernels::Format format = kernels::Format::kBF16;
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

struct AllocatorStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;  // target + window pages in use
  std::map<kernels::Format, FormatUsage> target;  // formats with pages in use
  FormatUsage window;
  uint64_t slab_bytes = 0;  // arena bytes held by pools (used + free pages)
  uint64_t free_pages = 0;  // pages on pool free lists
};

class PageAllocator {
 public:
  // Preferred slab size; small pages are carved kSlabBytes at a time.
  static constexpr size_t kSlabBytes = size_t{1} << 20;

  // Takes `capacity_bytes` from `device` (which must outlive the allocator).
  static absl::StatusOr<std::unique_ptr<PageAllocator>> Create(
      Device* device, size_t capacity_bytes);
  ~PageAllocator();

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // A page of `page_bytes` (> 0, a multiple of 16) with refcount 1.
  absl::StatusOr<Page*> Allocate(kernels::Format format, size_t page_bytes,
                                 PageUse use);
  void Ref(Page* page);
  // Drops one reference; returns true when it was the last (page freed).
  bool Unref(Page* page);
  int RefCount(Page* page) const;

  AllocatorStats Stats() const;
  size_t capacity() const { return capacity_; }

 private:
  struct PoolKey {
    kernels::Format format;
    size_t page_bytes;
    bool operator<(const PoolKey& o) const {
      return format != o.format ? format < o.format : page_bytes < o.page_bytes;
    }
  };
  struct Pool;

  PageAllocator(Device* device, uint8_t* base, size_t capacity);
  static std::string PoolName(kernels::Format format, size_t page_bytes);

  Device* const device_;
  uint8_t* const base_;
  const size_t capacity_;

  mutable absl::Mutex mu_;
  Arena arena_ ABSL_GUARDED_BY(mu_);
  std::map<PoolKey, std::unique_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<kernels::Format, FormatUsage> target_ ABSL_GUARDED_BY(mu_);
  FormatUsage window_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
