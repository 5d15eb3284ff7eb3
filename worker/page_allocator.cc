#include "worker/page_allocator.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <tuple>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace triax::worker {

struct PageAllocator::Pool {
  PoolKey key;
  size_t pages_per_frame = 0;
  size_t frames = 0;  // frames held
  uint64_t pages_used = 0;
  std::set<size_t> with_free;  // held frames with a free slot
};

// ---------------------------------------------------------------------------
// Arena

Arena::Arena(size_t capacity) : capacity_(capacity), free_bytes_(capacity) {
  if (capacity > 0) AddRun(0, capacity);
}

void Arena::AddRun(size_t offset, size_t bytes) {
  free_runs_.emplace(offset, bytes);
  by_length_.emplace(bytes, offset);
}

void Arena::EraseRun(std::map<size_t, size_t>::iterator it) {
  by_length_.erase({it->second, it->first});
  free_runs_.erase(it);
}

void Arena::TakeFrom(std::map<size_t, size_t>::iterator it, size_t bytes) {
  const size_t rest = it->second - bytes;
  const size_t rest_offset = it->first + bytes;
  EraseRun(it);
  if (rest > 0) AddRun(rest_offset, rest);
  free_bytes_ -= bytes;
}

bool Arena::Take(size_t bytes, size_t* offset) {
  for (auto it = free_runs_.begin(); it != free_runs_.end(); ++it) {
    if (it->second < bytes) continue;
    *offset = it->first;
    TakeFrom(it, bytes);
    return true;
  }
  return false;
}

size_t Arena::TakeLargest(size_t max_bytes, size_t unit, size_t* offset) {
  if (by_length_.empty() || unit == 0) return 0;
  const auto [length, at] = *by_length_.begin();
  const size_t bytes = std::min(max_bytes, length - length % unit);
  if (bytes == 0) return 0;
  *offset = at;
  TakeFrom(free_runs_.find(at), bytes);
  return bytes;
}

bool Arena::Gather(size_t bytes, size_t unit, std::vector<Run>* runs) {
  if (bytes == 0 || unit == 0 || bytes % unit != 0) return false;
  size_t usable = 0;
  for (const auto& [len, off] : by_length_) {
    if (len < unit) break;  // longest first: the rest are shorter still
    usable += len - len % unit;
    if (usable >= bytes) break;
  }
  if (usable < bytes) return false;
  // Each step lowers the usable bytes by exactly what it takes (runs start
  // and end on `unit` when every caller uses multiples of it), so the check
  // above guarantees progress; the guard keeps all-or-nothing regardless.
  const size_t first = runs->size();
  size_t rest = bytes;
  while (rest > 0) {
    Run run;
    if (Take(rest, &run.offset)) {
      run.bytes = rest;
    } else {
      // No run holds the rest, so the largest is shorter than it and
      // TakeLargest takes all of it (rounded down to `unit`).
      run.bytes = TakeLargest(rest, unit, &run.offset);
    }
    if (run.bytes == 0) {
      for (size_t i = first; i < runs->size(); ++i) {
        Give((*runs)[i].offset, (*runs)[i].bytes);
      }
      runs->resize(first);
      return false;
    }
    runs->push_back(run);
    rest -= run.bytes;
  }
  return true;
}

void Arena::Give(size_t offset, size_t bytes) {
  auto next = free_runs_.lower_bound(offset);
  size_t start = offset, len = bytes;
  if (next != free_runs_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      len += prev->second;
      EraseRun(prev);
    }
  }
  if (next != free_runs_.end() && offset + bytes == next->first) {
    len += next->second;
    EraseRun(next);
  }
  AddRun(start, len);
  free_bytes_ += bytes;
}

size_t Arena::LargestFreeRun() const {
  return by_length_.empty() ? 0 : by_length_.begin()->first;
}

// ---------------------------------------------------------------------------
// PageAllocator

absl::StatusOr<std::unique_ptr<PageAllocator>> PageAllocator::Create(
    Device* device, size_t capacity_bytes, size_t frame_bytes) {
  if (capacity_bytes == 0) {
    return absl::InvalidArgumentError("pool capacity must be > 0 bytes");
  }
  if (frame_bytes == 0 || frame_bytes % 16 != 0 ||
      frame_bytes > capacity_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frame_bytes ", frame_bytes,
        " must be a positive multiple of 16 no larger than the pool's ",
        capacity_bytes, " bytes"));
  }
  absl::StatusOr<uint8_t*> base = device->AllocateArena(capacity_bytes);
  if (!base.ok()) return base.status();
  return std::unique_ptr<PageAllocator>(
      new PageAllocator(device, *base, capacity_bytes, frame_bytes));
}

PageAllocator::PageAllocator(Device* device, uint8_t* base, size_t capacity,
                             size_t frame_bytes)
    : device_(device),
      base_(base),
      capacity_(capacity),
      frame_bytes_(frame_bytes),
      frames_(capacity / frame_bytes) {
  free_bits_.assign((frames_.size() + 63) / 64, ~uint64_t{0});
  if (frames_.size() % 64 != 0) {
    free_bits_.back() = (uint64_t{1} << (frames_.size() % 64)) - 1;
  }
  free_frames_ = frames_.size();
}

// Page objects live in page_slabs_ (freed with the allocator).
PageAllocator::~PageAllocator() { device_->FreeArena(base_, capacity_); }

void PageAllocator::ReserveSparePagesLocked(size_t n) {
  constexpr size_t kSlab = 256;
  while (spare_pages_.size() < n) {
    page_slabs_.push_back(std::make_unique<Page[]>(kSlab));
    Page* slab = page_slabs_.back().get();
    spare_pages_.reserve(spare_pages_.size() + kSlab);
    for (size_t i = kSlab; i-- > 0;) spare_pages_.push_back(&slab[i]);
  }
}

// A page goes back to the list as a fresh one (its seal_mu is not held:
// nobody holds a reference).
void PageAllocator::DeletePageLocked(Page* page)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  page->data = nullptr;
  page->bytes = 0;
  page->encoding = kernels::Encoding();
  page->use = PageUse::kTarget;
  page->encoded = false;
  page->crc_known = false;
  page->crc32c = 0;
  page->refs = 0;
  page->pins = 0;
  page->frame = 0;
  page->slot = 0;
  spare_pages_.push_back(page);
}

size_t PageAllocator::TakeFreeFrameLocked() {
  size_t w = free_hint_;
  while (free_bits_[w] == 0) ++w;
  free_hint_ = w;
  const int bit = __builtin_ctzll(free_bits_[w]);
  free_bits_[w] &= free_bits_[w] - 1;
  free_frames_ -= 1;
  return w * 64 + static_cast<size_t>(bit);
}

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

absl::Status PageAllocator::CheckPageBytes(const kernels::Encoding& encoding,
                                           size_t page_bytes) const {
  if (page_bytes == 0 || page_bytes % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_bytes ", page_bytes, " must be a positive multiple of 16"));
  }
  if (page_bytes > frame_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_bytes ", page_bytes, " of pool ",
                     PoolName(encoding, page_bytes), " exceed frame_bytes ",
                     frame_bytes_, " (--frame_kb): pages never span frames"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Page*> PageAllocator::Allocate(const kernels::Encoding& encoding,
                                              size_t page_bytes, PageUse use) {
  TRIAX_RETURN_IF_ERROR(CheckPageBytes(encoding, page_bytes));
  absl::MutexLock lock(&mu_);
  Pool* pool = nullptr;
  std::vector<Page*> one;
  one.reserve(1);
  TRIAX_RETURN_IF_ERROR(
      AllocateRunLocked(encoding, page_bytes, use, 1, &pool, &one));
  FormatUsage& usage = UsageLocked(encoding, use);
  usage.pages += 1;
  usage.bytes += page_bytes;
  return one[0];
}

absl::Status PageAllocator::AllocateMany(const kernels::Encoding& encoding,
                                         size_t page_bytes, PageUse use,
                                         size_t n, std::vector<Page*>* out) {
  TRIAX_RETURN_IF_ERROR(CheckPageBytes(encoding, page_bytes));
  const size_t before = out->size();
  out->reserve(before + n);
  absl::MutexLock lock(&mu_);
  Pool* pool = nullptr;
  FormatUsage* usage = nullptr;
  while (out->size() - before < n) {
    const size_t had = out->size();
    absl::Status s = AllocateRunLocked(encoding, page_bytes, use,
                                       n - (had - before), &pool, out);
    if (!s.ok()) {
      for (size_t j = before; j < out->size(); ++j) UnrefLocked((*out)[j]);
      out->resize(before);
      return s;
    }
    // Counted per run (one lookup), before anything could be given back.
    if (usage == nullptr) usage = &UsageLocked(encoding, use);
    usage->pages += out->size() - had;
    usage->bytes += (out->size() - had) * page_bytes;
  }
  return absl::OkStatus();
}

absl::Status PageAllocator::AllocateRunLocked(const kernels::Encoding& encoding,
                                              size_t page_bytes, PageUse use,
                                              size_t max, Pool** pool_cache,
                                              std::vector<Page*>* out) {
  const PoolKey key{encoding, page_bytes};
  Pool* pool = *pool_cache;
  if (pool == nullptr) {
    auto pool_it = pools_.find(key);
    if (pool_it != pools_.end()) pool = pool_it->second.get();
  }

  size_t frame_index = 0;
  if (pool != nullptr && !pool->with_free.empty()) {
    frame_index = *pool->with_free.begin();
  } else {
    if (free_frames_ == 0) {
      absl::Status s = absl::ResourceExhaustedError(
          absl::StrCat("pool ", PoolName(encoding, page_bytes), " (",
                       use == PageUse::kWindow ? "window" : "target",
                       " page) exhausted: needs ", page_bytes, " bytes; ",
                       capacity_ - used_bytes_, " bytes free of ", capacity_,
                       ", 0 free frames of ", frames_.size(), " x ",
                       frame_bytes_, " bytes, no free slot in this pool's ",
                       pool == nullptr ? 0 : pool->frames, " frames"));
      s.SetPayload(kShortfallPayload, absl::Cord(absl::StrCat(page_bytes)));
      shortfalls_.fetch_add(1);
      return s;
    }
    if (pool == nullptr) {
      auto fresh = std::make_unique<Pool>();
      fresh->key = key;
      fresh->pages_per_frame = frame_bytes_ / page_bytes;
      pool = fresh.get();
      pools_.emplace(key, std::move(fresh));
    }
    frame_index = TakeFreeFrameLocked();
    Frame& f = frames_[frame_index];
    f.pool = pool;
    f.used = 0;
    f.slots.assign(pool->pages_per_frame, nullptr);
    f.free.clear();
    // Hand out low addresses first. A run that takes the whole frame needs
    // no list.
    if (max < pool->pages_per_frame) {
      f.free.reserve(pool->pages_per_frame);
      for (size_t i = pool->pages_per_frame; i-- > 0;) {
        f.free.push_back(static_cast<uint32_t>(i));
      }
    }
    pool->frames += 1;
    // Joins with_free below unless this run fills it.
  }

  *pool_cache = pool;
  Frame& f = frames_[frame_index];
  const bool listed = f.used > 0;  // a held frame with a free slot
  // A fresh frame without a list: every slot, lowest first.
  const bool whole = f.used == 0 && f.free.empty();
  const size_t take = whole ? f.slots.size() : std::min(max, f.free.size());
  ReserveSparePagesLocked(take);
  for (size_t i = 0; i < take; ++i) {
    uint32_t slot = static_cast<uint32_t>(i);
    if (!whole) {
      slot = f.free.back();
      f.free.pop_back();
    }
    Page* page = spare_pages_.back();
    spare_pages_.pop_back();
    page->data = SlotData(frame_index, slot, page_bytes);
    page->bytes = page_bytes;
    page->encoding = encoding;
    page->use = use;
    page->refs = 1;
    page->frame = frame_index;
    page->slot = slot;
    f.slots[slot] = page;
    out->push_back(page);
  }
  f.used += static_cast<uint32_t>(take);
  if (listed && f.free.empty()) {
    pool->with_free.erase(frame_index);
  } else if (!listed && !f.free.empty()) {
    pool->with_free.insert(frame_index);
  }
  pool->pages_used += take;
  used_bytes_ += take * page_bytes;
  return absl::OkStatus();
}

void PageAllocator::Ref(Page* page) {
  absl::MutexLock lock(&mu_);
  ++page->refs;
}

void PageAllocator::Pin(Page* page) {
  absl::MutexLock lock(&mu_);
  ++page->refs;
  ++page->pins;
}

bool PageAllocator::Unpin(Page* page) {
  absl::MutexLock lock(&mu_);
  --page->pins;
  return UnrefLocked(page);
}

int PageAllocator::PinCount(Page* page) const {
  absl::MutexLock lock(&mu_);
  return page->pins;
}

int PageAllocator::RefCount(Page* page) const {
  absl::MutexLock lock(&mu_);
  return page->refs;
}

void PageAllocator::ReleaseFrame(size_t index) {
  Frame& f = frames_[index];
  Pool* pool = f.pool;
  pool->with_free.erase(index);
  pool->frames -= 1;
  f.pool = nullptr;
  f.slots.clear();
  f.free.clear();
  f.used = 0;
  free_bits_[index / 64] |= uint64_t{1} << (index % 64);
  free_frames_ += 1;
  free_hint_ = std::min(free_hint_, index / 64);
  if (pool->frames == 0) pools_.erase(pool->key);
}

void PageAllocator::PinAll(absl::Span<Page* const> pages) {
  absl::MutexLock lock(&mu_);
  for (Page* p : pages) {
    ++p->refs;
    ++p->pins;
  }
}

void PageAllocator::UnpinAll(absl::Span<Page* const> pages) {
  absl::MutexLock lock(&mu_);
  for (Page* p : pages) {
    --p->pins;
    UnrefLocked(p);
  }
}

bool PageAllocator::Unref(Page* page) {
  absl::MutexLock lock(&mu_);
  return UnrefLocked(page);
}

uint64_t PageAllocator::UnrefAll(absl::Span<Page* const> pages,
                                 uint64_t* bytes_freed) {
  uint64_t freed = 0;
  absl::MutexLock lock(&mu_);
  for (Page* p : pages) {
    const size_t bytes = p->bytes;
    if (UnrefLocked(p)) {
      freed += 1;
      *bytes_freed += bytes;
    }
  }
  return freed;
}

bool PageAllocator::UnrefLocked(Page* page) {
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
  const size_t index = page->frame;
  Frame& f = frames_[index];
  f.slots[page->slot] = nullptr;
  // A held frame is in with_free exactly when it has a free slot.
  if (f.free.empty()) f.pool->with_free.insert(index);
  f.free.push_back(page->slot);
  f.used -= 1;
  f.pool->pages_used -= 1;
  DeletePageLocked(page);
  // Every page of the frame is free: any pool may take it now.
  if (f.used == 0) ReleaseFrame(index);
  return true;
}

absl::StatusOr<CompactionResult> PageAllocator::Compact() {
  const auto start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  CompactionResult r;
  absl::Status error;
  for (auto& [key, pool_ptr] : pools_) {
    Pool& pool = *pool_ptr;
    if (pool.with_free.size() < 2) continue;
    // Frames with free slots, fullest first (ties: lower index first); pages
    // move from the back of the list into the front.
    std::vector<size_t> order(pool.with_free.begin(), pool.with_free.end());
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return frames_[a].used > frames_[b].used;
    });
    size_t i = 0, j = order.size() - 1;
    while (i < j && error.ok()) {
      Frame& dst = frames_[order[i]];
      Frame& src = frames_[order[j]];
      if (dst.free.empty()) {
        ++i;
        continue;
      }
      if (src.used == 0) {
        --j;
        continue;
      }
      // The highest used unpinned slot of src moves into the lowest free
      // slot of dst; a frame left with pinned pages only is done.
      uint32_t from = static_cast<uint32_t>(src.slots.size());
      while (from > 0 && (src.slots[from - 1] == nullptr ||
                          src.slots[from - 1]->pins > 0)) {
        --from;
      }
      if (from == 0) {
        --j;
        continue;
      }
      --from;
      Page* page = src.slots[from];
      const uint32_t to = dst.free.back();
      uint8_t* target = SlotData(order[i], to, key.page_bytes);
      error = device_->CopyPage(target, page->data, key.page_bytes);
      if (!error.ok()) break;
      dst.free.pop_back();
      dst.slots[to] = page;
      dst.used += 1;
      if (dst.free.empty()) pool.with_free.erase(order[i]);
      src.slots[from] = nullptr;
      src.free.push_back(from);
      src.used -= 1;
      page->data = target;
      page->frame = order[i];
      page->slot = to;
      r.pages_moved += 1;
      r.bytes_moved += key.page_bytes;
    }
    // Keep each remaining frame's free list ordered lowest slot last.
    for (size_t k : order) {
      Frame& f = frames_[k];
      std::sort(f.free.begin(), f.free.end(), std::greater<uint32_t>());
    }
    if (!error.ok()) break;
  }
  // Frames emptied by the moves go back to the free list (after the loop:
  // releasing the last frame of a pool erases the pool).
  for (size_t k = 0; k < frames_.size(); ++k) {
    if (frames_[k].pool != nullptr && frames_[k].used == 0) {
      ReleaseFrame(k);
      r.frames_freed += 1;
    }
  }
  r.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (r.pages_moved > 0) compactions_ += 1;
  compacted_.pages_moved += r.pages_moved;
  compacted_.bytes_moved += r.bytes_moved;
  compacted_.frames_freed += r.frames_freed;
  compacted_.seconds += r.seconds;
  if (!error.ok()) return error;
  return r;
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
  s.frame_bytes = frame_bytes_;
  s.frames = frames_.size();
  s.free_frames = free_frames_;
  s.free_bytes = capacity_ - used_bytes_;
  s.tail_bytes = capacity_ - frames_.size() * frame_bytes_;
  for (const auto& [key, pool] : pools_) {
    PoolStats p;
    p.encoding = key.encoding;
    p.page_bytes = key.page_bytes;
    p.pages_per_frame = pool->pages_per_frame;
    p.frames = pool->frames;
    p.pages_used = pool->pages_used;
    p.free_slots = pool->frames * pool->pages_per_frame - pool->pages_used;
    p.allocatable_pages = p.free_slots + s.free_frames * p.pages_per_frame;
    const uint64_t packed =
        (pool->pages_used + pool->pages_per_frame - 1) / pool->pages_per_frame;
    p.free_slots_compacted = packed * pool->pages_per_frame - pool->pages_used;
    s.free_frames_compacted += pool->frames - packed;
    s.held_bytes += pool->frames * frame_bytes_;
    s.free_slots += p.free_slots;
    s.tail_bytes +=
        pool->frames * (frame_bytes_ - pool->pages_per_frame * key.page_bytes);
    s.pools.push_back(p);
  }
  s.free_frames_compacted += s.free_frames;
  const uint64_t in_free_frames = s.free_frames * frame_bytes_;
  s.fragmentation = s.free_bytes == 0
                        ? 0.0
                        : static_cast<double>(s.free_bytes - in_free_frames) /
                              static_cast<double>(s.free_bytes);
  s.compactions = compactions_;
  s.pages_moved = compacted_.pages_moved;
  s.bytes_moved = compacted_.bytes_moved;
  s.frames_freed_by_compaction = compacted_.frames_freed;
  return s;
}

}  // namespace triax::worker
