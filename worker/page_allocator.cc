#include "worker/page_allocator.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace triax::worker {

// A run of arena bytes owned by one pool, carved into equal pages.
struct Slab {
  size_t offset = 0;
  size_t bytes = 0;
  std::vector<std::unique_ptr<Page>> pages;
  std::vector<Page*> free_list;
};

struct PageAllocator::Pool {
  std::vector<std::unique_ptr<Slab>> slabs;
};

// ---------------------------------------------------------------------------
// Arena

Arena::Arena(size_t capacity) : capacity_(capacity), free_bytes_(capacity) {
  if (capacity > 0) free_runs_.emplace(0, capacity);
}

bool Arena::Take(size_t bytes, size_t* offset) {
  for (auto it = free_runs_.begin(); it != free_runs_.end(); ++it) {
    if (it->second < bytes) continue;
    *offset = it->first;
    const size_t rest = it->second - bytes;
    const size_t rest_offset = it->first + bytes;
    free_runs_.erase(it);
    if (rest > 0) free_runs_.emplace(rest_offset, rest);
    free_bytes_ -= bytes;
    return true;
  }
  return false;
}

void Arena::Give(size_t offset, size_t bytes) {
  auto next = free_runs_.lower_bound(offset);
  size_t start = offset, len = bytes;
  if (next != free_runs_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      len += prev->second;
      free_runs_.erase(prev);
    }
  }
  if (next != free_runs_.end() && offset + bytes == next->first) {
    len += next->second;
    free_runs_.erase(next);
  }
  free_runs_.emplace(start, len);
  free_bytes_ += bytes;
}

size_t Arena::LargestFreeRun() const {
  size_t best = 0;
  for (const auto& [off, len] : free_runs_) best = std::max(best, len);
  return best;
}

// ---------------------------------------------------------------------------
// PageAllocator

absl::StatusOr<std::unique_ptr<PageAllocator>> PageAllocator::Create(
    Device* device, size_t capacity_bytes) {
  if (capacity_bytes == 0) {
    return absl::InvalidArgumentError("pool capacity must be > 0 bytes");
  }
  absl::StatusOr<uint8_t*> base = device->AllocateArena(capacity_bytes);
  if (!base.ok()) return base.status();
  return std::unique_ptr<PageAllocator>(
      new PageAllocator(device, *base, capacity_bytes));
}

PageAllocator::PageAllocator(Device* device, uint8_t* base, size_t capacity)
    : device_(device),
      base_(base),
      capacity_(capacity),
      slab_bytes_(std::min(kSlabBytes,
                           std::max(kMinSlabBytes, capacity / kSlabsPerArena))),
      arena_(capacity) {}

PageAllocator::~PageAllocator() { device_->FreeArena(base_, capacity_); }

bool EncodingLess::operator()(const kernels::Encoding& a,
                              const kernels::Encoding& b) const {
  auto key = [](const kernels::Encoding& e) {
    return std::make_tuple(static_cast<int>(e.k), static_cast<int>(e.v),
                           e.Group(), static_cast<int>(e.scale_dtype));
  };
  return key(a) < key(b);
}

std::string PageAllocator::PoolName(const kernels::Encoding& encoding,
                                    size_t page_bytes) {
  char buf[96];
  return absl::StrCat(kernels::EncodingName(encoding, buf, sizeof(buf)), "/",
                      page_bytes, "B");
}

absl::StatusOr<Page*> PageAllocator::Allocate(const kernels::Encoding& encoding,
                                              size_t page_bytes, PageUse use) {
  if (page_bytes == 0 || page_bytes % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_bytes ", page_bytes, " must be a positive multiple of 16"));
  }
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Pool>& pool = pools_[PoolKey{encoding, page_bytes}];
  if (pool == nullptr) pool = std::make_unique<Pool>();

  Slab* slab = nullptr;
  for (auto& s : pool->slabs) {
    if (!s->free_list.empty()) {
      slab = s.get();
      break;
    }
  }
  if (slab == nullptr) {
    // Carve a new slab: SlabBytes() worth of pages (at least one page), shrunk
    // to the largest run the arena still has.
    size_t pages = std::max<size_t>(1, slab_bytes_ / page_bytes);
    pages = std::min(pages, arena_.LargestFreeRun() / page_bytes);
    size_t offset = 0;
    if (pages == 0 || !arena_.Take(pages * page_bytes, &offset)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pool ", PoolName(encoding, page_bytes), " (",
          use == PageUse::kWindow ? "window" : "target",
          " page) exhausted: requested ", page_bytes, " bytes, arena has ",
          arena_.free_bytes(), " bytes free (largest run ",
          arena_.LargestFreeRun(), ") of ", capacity_, " capacity, ",
          used_bytes_, " bytes in use"));
    }
    auto s = std::make_unique<Slab>();
    s->offset = offset;
    s->bytes = pages * page_bytes;
    s->pages.reserve(pages);
    s->free_list.reserve(pages);
    for (size_t i = 0; i < pages; ++i) {
      auto p = std::make_unique<Page>();
      p->data = base_ + offset + i * page_bytes;
      p->bytes = page_bytes;
      p->encoding = encoding;
      p->slab = s.get();
      s->pages.push_back(std::move(p));
    }
    // Hand out low addresses first.
    for (size_t i = pages; i-- > 0;) s->free_list.push_back(s->pages[i].get());
    slab = s.get();
    pool->slabs.push_back(std::move(s));
  }

  Page* page = slab->free_list.back();
  slab->free_list.pop_back();
  page->refs = 1;
  page->use = use;
  {
    absl::MutexLock seal_lock(&page->seal_mu);
    page->encoded = false;
  }
  used_bytes_ += page_bytes;
  FormatUsage& usage = use == PageUse::kWindow ? window_ : target_[encoding];
  usage.pages += 1;
  usage.bytes += page_bytes;
  return page;
}

void PageAllocator::Ref(Page* page) {
  absl::MutexLock lock(&mu_);
  ++page->refs;
}

int PageAllocator::RefCount(Page* page) const {
  absl::MutexLock lock(&mu_);
  return page->refs;
}

bool PageAllocator::Unref(Page* page) {
  absl::MutexLock lock(&mu_);
  if (--page->refs > 0) return false;
  used_bytes_ -= page->bytes;
  if (page->use == PageUse::kWindow) {
    window_.pages -= 1;
    window_.bytes -= page->bytes;
  } else {
    FormatUsage& usage = target_[page->encoding];
    usage.pages -= 1;
    usage.bytes -= page->bytes;
    if (usage.pages == 0) target_.erase(page->encoding);
  }
  Slab* slab = page->slab;
  slab->free_list.push_back(page);
  if (slab->free_list.size() == slab->pages.size()) {
    // Every page of the slab is free: give its bytes back to the arena so
    // other pools can use them.
    auto pool_it = pools_.find(PoolKey{page->encoding, page->bytes});
    arena_.Give(slab->offset, slab->bytes);
    auto& slabs = pool_it->second->slabs;
    slabs.erase(std::find_if(
        slabs.begin(), slabs.end(),
        [slab](const std::unique_ptr<Slab>& s) { return s.get() == slab; }));
    if (slabs.empty()) pools_.erase(pool_it);
  }
  return true;
}

AllocatorStats PageAllocator::Stats() const {
  absl::MutexLock lock(&mu_);
  AllocatorStats s;
  s.capacity_bytes = capacity_;
  s.used_bytes = used_bytes_;
  s.by_encoding = target_;
  for (const auto& [encoding, usage] : target_) {
    FormatUsage& k = s.target[encoding.k];
    k.pages += usage.pages;
    k.bytes += usage.bytes;
  }
  s.window = window_;
  s.slab_bytes = capacity_ - arena_.free_bytes();
  for (const auto& [key, pool] : pools_) {
    for (const auto& slab : pool->slabs) s.free_pages += slab->free_list.size();
  }
  return s;
}

}  // namespace triax::worker
