#include "kvmanager/event_log.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace triax::manager {
namespace {

// Bound on retained events scanned per lock hold during replay, so a watcher
// replaying a long history never holds the log mutex for long.
constexpr size_t kReplayScanChunk = 4096;

// Records the ring starts with; it doubles up to the retention bound.
constexpr size_t kInitialRecords = 4096;

// Packed bytes are taken in chunks of this size (a larger event gets a chunk
// of its own); a few freed chunks are kept for reuse.
constexpr size_t kChunkBytes = size_t{1} << 20;
constexpr size_t kSpareChunks = 2;

// The lineage index's share of a lineage event: its entry (a 32-byte slot
// of the hash map at most 7/8 full) over the few events a block has.
constexpr uint64_t kIndexBytes = 16;

// --- Packing: the strings and lineage ids of an event ----------------------
// Layout: varint lengths of sequence_id, tenant_id, worker_id, detail,
// source_worker_id, varint count of lineage_ids; the five strings' bytes;
// the lineage ids as native uint64s.

size_t VarintSize(uint64_t v) {
  if (v < 0x80) return 1;  // ids, names and most details
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

char* PutVarint(uint64_t v, char* p) {
  while (v >= 0x80) {
    *p++ = static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<char>(v);
  return p;
}

const char* GetVarint(const char* p, uint64_t* v) {
  uint64_t out = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = static_cast<uint8_t>(*p++);
    out |= uint64_t{b & 0x7fu} << shift;
    if ((b & 0x80) == 0) break;
  }
  *v = out;
  return p;
}

// The five strings are sequence_id, tenant_id, worker_id, detail,
// source_worker_id; `ids` the lineage ids (null: none).
size_t PackedSize(const absl::string_view (&strings)[5],
                  const std::vector<uint64_t>* ids) {
  const size_t n_ids = ids != nullptr ? ids->size() : 0;
  size_t n = VarintSize(n_ids) + n_ids * sizeof(uint64_t);
  for (absl::string_view s : strings) n += VarintSize(s.size()) + s.size();
  return n;
}

void Pack(const absl::string_view (&strings)[5],
          const std::vector<uint64_t>* ids, char* p) {
  const size_t n_ids = ids != nullptr ? ids->size() : 0;
  for (absl::string_view s : strings) p = PutVarint(s.size(), p);
  p = PutVarint(n_ids, p);
  for (absl::string_view s : strings) {
    if (s.empty()) continue;
    std::memcpy(p, s.data(), s.size());
    p += s.size();
  }
  if (n_ids > 0) std::memcpy(p, ids->data(), n_ids * sizeof(uint64_t));
}

uint8_t Byte(int v) { return static_cast<uint8_t>(v); }

}  // namespace

// --- ByteRing ----------------------------------------------------------------

char* EventLog::ByteRing::Take(size_t n, uint64_t* pos) {
  if (chunks_.empty() ||
      end_ + n > chunks_.back().start + chunks_.back().size) {
    const uint64_t start =
        chunks_.empty() ? end_ : chunks_.back().start + chunks_.back().size;
    Chunk c;
    if (n <= kChunkBytes && !spare_.empty()) {
      c = std::move(spare_.back());
      spare_.pop_back();
    } else {
      c.size = std::max(n, kChunkBytes);
      c.data.reset(new char[c.size]);
    }
    c.start = start;
    chunks_.push_back(std::move(c));
    end_ = start;
  }
  Chunk& c = chunks_.back();
  *pos = end_;
  char* p = c.data.get() + (end_ - c.start);
  end_ += n;
  return p;
}

const char* EventLog::ByteRing::At(uint64_t pos) const {
  // Most reads are of recent events.
  const Chunk& back = chunks_.back();
  if (pos >= back.start) return back.data.get() + (pos - back.start);
  auto it =
      std::upper_bound(chunks_.begin(), chunks_.end(), pos,
                       [](uint64_t p, const Chunk& c) { return p < c.start; });
  --it;
  return it->data.get() + (pos - it->start);
}

void EventLog::ByteRing::ReleaseBefore(uint64_t pos) {
  while (chunks_.size() > 1 &&
         chunks_.front().start + chunks_.front().size <= pos) {
    if (chunks_.front().size == kChunkBytes && spare_.size() < kSpareChunks) {
      spare_.push_back(std::move(chunks_.front()));
    }
    chunks_.pop_front();
  }
}

// --- EventBatch
// ---------------------------------------------------------------

void EventBatch::Begin(int64_t unix_ms, EventKind kind,
                       const std::string& sequence_id,
                       const std::string& tenant_id,
                       const std::string& worker_id, uint64_t lineage_id,
                       Tag tag, Format format) {
  Entry& e = entries_.emplace_back();
  e.unix_ms = unix_ms;
  e.lineage_id = lineage_id;
  e.kind = kind;
  e.tag = tag;
  e.format = format;
  e.sequence_id = Name(0, sequence_id);
  e.tenant_id = Name(1, tenant_id);
  e.worker_id = Name(2, worker_id);
  e.detail = Slice{static_cast<uint32_t>(chars_.size()), 0};
}

EventBatch::Slice EventBatch::Name(int field, const std::string& name) {
  if (last_[field] == &name && last_slice_[field].size == name.size()) {
    return last_slice_[field];
  }
  const Slice s{static_cast<uint32_t>(chars_.size()),
                static_cast<uint32_t>(name.size())};
  chars_.append(name);
  last_[field] = &name;
  last_slice_[field] = s;
  return s;
}

void EventBatch::Clear() {
  entries_.clear();
  chars_.clear();
  for (const std::string*& p : last_) p = nullptr;
}

// --- EventSubscription -------------------------------------------------------

EventSubscription::EventSubscription(EventLog* log, EventFilter filter,
                                     uint64_t cursor)
    : log_(log),
      filter_(std::move(filter)),
      cursor_(cursor),
      replay_end_(cursor) {}

EventSubscription::Result EventSubscription::Next(Event* out,
                                                  absl::Status* end) {
  for (;;) {
    absl::MutexLock lock(&log_->mu_);
    if (ended_) {
      *end = end_status_;
      return Result::kEnded;
    }
    if (cursor_ < replay_end_) {
      if (cursor_ < log_->first_id_) {
        ended_ = true;
        end_status_ = absl::ResourceExhaustedError(absl::StrCat(
            "watcher fell behind: events ", cursor_, "..", log_->first_id_ - 1,
            " left retention before they were replayed (retention ",
            log_->options_.retention, " events)"));
        evicted_.clear();
        pending_ = 0;
        *end = end_status_;
        return Result::kEnded;
      }
      size_t scanned = 0;
      while (cursor_ < replay_end_ && scanned < kReplayScanChunk) {
        const uint64_t id = cursor_++;
        ++scanned;
        if (log_->MatchesLocked(filter_, log_->RecordLocked(id))) {
          *out = log_->LoadLocked(id);
          return Result::kEvent;
        }
      }
      continue;  // release the lock between chunks
    }
    if (!evicted_.empty()) {
      *out = std::move(evicted_.front());
      evicted_.pop_front();
      --pending_;
      return Result::kEvent;
    }
    if (pending_ == 0) {
      // Nothing of ours between the cursor and the end: skip the scan.
      cursor_ = std::max(cursor_, log_->next_id_);
      waiting_ = true;
      return Result::kEmpty;
    }
    size_t scanned = 0;
    while (cursor_ < log_->next_id_ && scanned < kReplayScanChunk) {
      const uint64_t id = cursor_++;
      ++scanned;
      if (log_->MatchesLocked(filter_, log_->RecordLocked(id))) {
        --pending_;
        *out = log_->LoadLocked(id);
        return Result::kEvent;
      }
    }
    if (cursor_ == log_->next_id_) pending_ = 0;  // counted, then not found
  }
}

void EventSubscription::SetNotify(std::function<void()> notify) {
  absl::MutexLock lock(&notify_mu_);
  notify_ = std::move(notify);
}

void EventSubscription::Notify() {
  absl::MutexLock lock(&notify_mu_);
  if (notify_) notify_();
}

void EventSubscription::Cancel() {
  {
    absl::MutexLock lock(&notify_mu_);
    notify_ = nullptr;
  }
  log_->Unsubscribe(this);
}

// --- EventLog
// ------------------------------------------------------------------

EventLog::EventLog(Options options) : options_(options) {}

EventLog::~EventLog() = default;

uint64_t EventLog::StoredBytes(size_t packed_size, uint64_t lineage_id) {
  return sizeof(Record) + packed_size + (lineage_id != 0 ? kIndexBytes : 0);
}

EventLog::Fields EventLog::FieldsOf(const Event& e) {
  return Fields{
      e.unix_ms,
      e.lineage_id,
      e.kind,
      e.tag,
      e.format,
      {e.sequence_id, e.tenant_id, e.worker_id, e.detail, e.source_worker_id},
      e.lineage_ids.empty() ? nullptr : &e.lineage_ids};
}

uint64_t EventLog::EventBytes(const Event& e) {
  const Fields f = FieldsOf(e);
  return StoredBytes(PackedSize(f.strings, f.lineage_ids), e.lineage_id);
}

void EventLog::Append(std::vector<Event>* events,
                      const std::vector<LastPlan>* forgotten) {
  std::vector<std::shared_ptr<EventSubscription>> to_notify;
  {
    absl::MutexLock lock(&mu_);
    for (Event& e : *events) {
      e.id = next_id_;
      StoreLocked(FieldsOf(e));
      if (!subs_.empty()) OfferLocked(e.id, &to_notify);
    }
    FinishAppendLocked(forgotten);
  }
  for (const auto& sub : to_notify) sub->Notify();
}

void EventLog::Append(EventBatch* batch,
                      const std::vector<LastPlan>* forgotten) {
  std::vector<std::shared_ptr<EventSubscription>> to_notify;
  {
    absl::MutexLock lock(&mu_);
    for (const EventBatch::Entry& b : batch->entries_) {
      const uint64_t id = next_id_;
      StoreLocked(Fields{b.unix_ms,
                         b.lineage_id,
                         b.kind,
                         b.tag,
                         b.format,
                         {batch->View(b.sequence_id), batch->View(b.tenant_id),
                          batch->View(b.worker_id), batch->View(b.detail),
                          absl::string_view()},
                         nullptr});
      if (!subs_.empty()) OfferLocked(id, &to_notify);
    }
    FinishAppendLocked(forgotten);
  }
  batch->Clear();
  for (const auto& sub : to_notify) sub->Notify();
}

void EventLog::OfferLocked(
    uint64_t id, std::vector<std::shared_ptr<EventSubscription>>* to_notify) {
  const Record& r = RecordLocked(id);
  for (const auto& sub : subs_) {
    if (sub->ended_ || id < sub->replay_end_ ||
        !MatchesLocked(sub->filter_, r)) {
      continue;
    }
    if (sub->pending_ >= options_.watcher_queue_limit) {
      sub->ended_ = true;
      sub->evicted_.clear();
      sub->pending_ = 0;
      sub->end_status_ = absl::ResourceExhaustedError(absl::StrCat(
          "watcher fell behind by more than ", options_.watcher_queue_limit,
          " events (at event ", id, "); reconnect with from_id"));
    } else {
      ++sub->pending_;
    }
    if (sub->waiting_) {
      sub->waiting_ = false;
      to_notify->push_back(sub);
    }
  }
}

void EventLog::FinishAppendLocked(const std::vector<LastPlan>* forgotten) {
  if (forgotten != nullptr) {
    for (const LastPlan& lp : *forgotten)
      RecordLastPlanLocked(lp.plan, lp.creator);
  }
  EvictLocked();
}

void EventLog::StoreLocked(const Fields& f) {
  // The count bound is kept while storing, so the ring never grows past it.
  while (next_id_ - first_id_ >= std::max<size_t>(options_.retention, 1)) {
    EvictOneLocked();
  }
  if (next_id_ - first_id_ == ring_.size()) {
    std::vector<Record> ring(ring_.empty() ? kInitialRecords
                                           : 2 * ring_.size());
    for (uint64_t id = first_id_; id < next_id_; ++id) {
      ring[id & (ring.size() - 1)] = RecordLocked(id);
    }
    ring_.swap(ring);
  }
  const uint64_t id = next_id_++;
  Record& r = RecordLocked(id);
  r.lineage_id = f.lineage_id;
  r.unix_ms = f.unix_ms;
  r.next_in_lineage = 0;
  const size_t size = PackedSize(f.strings, f.lineage_ids);
  Pack(f.strings, f.lineage_ids, packed_.Take(size, &r.packed));
  r.packed_size = static_cast<uint32_t>(size);
  const int kind = static_cast<int>(f.kind);
  r.kind = kind >= 0 && kind < static_cast<int>(kKinds) ? Byte(kind) : 0;
  r.temporal = Byte(static_cast<int>(f.tag.temporal));
  r.modality = Byte(static_cast<int>(f.tag.modality));
  r.role = Byte(static_cast<int>(f.tag.role));
  r.format = static_cast<uint8_t>(f.format);
  ++appended_[r.kind];
  bytes_ += StoredBytes(size, f.lineage_id);
  if (f.lineage_id != 0) {
    auto [it, inserted] = lineages_.try_emplace(f.lineage_id);
    if (inserted) {
      it->second.first = id;
    } else {
      RecordLocked(it->second.last).next_in_lineage = id;
    }
    it->second.last = id;
  }
}

void EventLog::EvictLocked() {
  // The newest event always stays, whatever its bytes.
  while (options_.retention_bytes != 0 && bytes_ > options_.retention_bytes &&
         next_id_ - first_id_ > 1) {
    EvictOneLocked();
  }
  if (first_id_ < next_id_)
    packed_.ReleaseBefore(RecordLocked(first_id_).packed);
}

void EventLog::EvictOneLocked() {
  const uint64_t id = first_id_;
  const Record& r = RecordLocked(id);
  // Live subscribers that have not read it yet keep a copy; one still
  // replaying is ended by its next Next (its replay left retention).
  for (const auto& sub : subs_) {
    if (sub->ended_ || sub->cursor_ > id || sub->cursor_ < sub->replay_end_) {
      continue;
    }
    if (MatchesLocked(sub->filter_, r)) sub->evicted_.push_back(LoadLocked(id));
    sub->cursor_ = id + 1;
  }
  if (r.lineage_id != 0) {
    auto it = lineages_.find(r.lineage_id);
    if (it != lineages_.end()) {
      if (r.next_in_lineage == 0) {
        if (it->second.last_plan != kNoPlan) {
          free_plans_.push_back(it->second.last_plan);
        }
        lineages_.erase(it);
      } else {
        it->second.first = r.next_in_lineage;
      }
    }
  }
  bytes_ -= StoredBytes(r.packed_size, r.lineage_id);
  ++first_id_;
}

EventLog::View EventLog::ViewLocked(const Record& r) const {
  View v;
  const char* p = packed_.At(r.packed);
  uint64_t len[5];
  for (uint64_t& l : len) p = GetVarint(p, &l);
  uint64_t n = 0;
  p = GetVarint(p, &n);
  absl::string_view* fields[] = {&v.sequence_id, &v.tenant_id, &v.worker_id,
                                 &v.detail, &v.source_worker_id};
  for (int i = 0; i < 5; ++i) {
    *fields[i] = absl::string_view(p, len[i]);
    p += len[i];
  }
  v.lineage_ids = p;
  v.n_lineage_ids = n;
  return v;
}

Event EventLog::LoadLocked(uint64_t id) const {
  const Record& r = RecordLocked(id);
  const View v = ViewLocked(r);
  Event e;
  e.id = id;
  e.unix_ms = r.unix_ms;
  e.kind = static_cast<EventKind>(r.kind);
  e.lineage_id = r.lineage_id;
  e.sequence_id = std::string(v.sequence_id);
  e.tenant_id = std::string(v.tenant_id);
  e.worker_id = std::string(v.worker_id);
  e.tag = Tag{static_cast<Temporal>(r.temporal),
              static_cast<Modality>(r.modality), static_cast<Role>(r.role)};
  e.format = static_cast<Format>(r.format);
  e.detail = std::string(v.detail);
  e.lineage_ids.resize(v.n_lineage_ids);
  if (v.n_lineage_ids > 0) {
    std::memcpy(e.lineage_ids.data(), v.lineage_ids,
                v.n_lineage_ids * sizeof(uint64_t));
  }
  e.source_worker_id = std::string(v.source_worker_id);
  return e;
}

bool EventLog::MatchesLocked(const EventFilter& filter, const Record& r) const {
  if (filter.kind != EventKind::kUnspecified &&
      static_cast<int>(filter.kind) != r.kind) {
    return false;
  }
  if (filter.tenant_id.empty() && filter.sequence_id.empty() &&
      (filter.lineage_id == 0 || filter.lineage_id == r.lineage_id)) {
    return true;
  }
  const View v = ViewLocked(r);
  if (!filter.tenant_id.empty() && v.tenant_id != filter.tenant_id) {
    return false;
  }
  if (!filter.sequence_id.empty() && v.sequence_id != filter.sequence_id) {
    return false;
  }
  if (filter.lineage_id != 0 && r.lineage_id != filter.lineage_id) {
    for (size_t i = 0; i < v.n_lineage_ids; ++i) {
      uint64_t id;
      std::memcpy(&id, v.lineage_ids + i * sizeof(uint64_t), sizeof(id));
      if (id == filter.lineage_id) return true;
    }
    return false;
  }
  return true;
}

uint64_t EventLog::next_id() const {
  absl::MutexLock lock(&mu_);
  return next_id_;
}

std::vector<Event> EventLog::Retained(uint64_t from_id,
                                      const EventFilter& filter,
                                      size_t max) const {
  absl::MutexLock lock(&mu_);
  std::vector<Event> out;
  for (uint64_t id = std::max(from_id, first_id_); id < next_id_; ++id) {
    if (!MatchesLocked(filter, RecordLocked(id))) continue;
    out.push_back(LoadLocked(id));
    if (max != 0 && out.size() >= max) break;
  }
  return out;
}

std::vector<Event> EventLog::EventsForLineage(uint64_t lineage_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<Event> out;
  auto it = lineages_.find(lineage_id);
  if (it == lineages_.end()) return out;
  for (uint64_t id = it->second.first; id != 0;
       id = RecordLocked(id).next_in_lineage) {
    out.push_back(LoadLocked(id));
  }
  return out;
}

std::vector<Event> EventLog::EventsForLineage(uint64_t lineage_id,
                                              uint64_t after_id, size_t max,
                                              bool* more) const {
  absl::MutexLock lock(&mu_);
  std::vector<Event> out;
  *more = false;
  auto it = lineages_.find(lineage_id);
  if (it == lineages_.end()) return out;
  uint64_t id = it->second.first;
  if (after_id >= id && after_id < next_id_ &&
      RecordLocked(after_id).lineage_id == lineage_id) {
    id = RecordLocked(after_id).next_in_lineage;  // the previous page's last
  } else {
    // A cursor below retention starts at the oldest retained event.
    while (id != 0 && id <= after_id) id = RecordLocked(id).next_in_lineage;
  }
  for (; id != 0 && out.size() < max; id = RecordLocked(id).next_in_lineage) {
    out.push_back(LoadLocked(id));
  }
  *more = id != 0;
  return out;
}

void EventLog::RecordLastPlan(const BlockPlan& plan,
                              const std::string& creator) {
  absl::MutexLock lock(&mu_);
  RecordLastPlanLocked(plan, creator);
}

void EventLog::RecordLastPlanLocked(const BlockPlan& plan,
                                    const std::string& creator) {
  auto it = lineages_.find(plan.lineage_id);
  // A lineage without retained events is forgotten anyway.
  if (it == lineages_.end()) return;
  uint32_t& slot = it->second.last_plan;
  if (slot == kNoPlan) {
    if (!free_plans_.empty()) {
      slot = free_plans_.back();
      free_plans_.pop_back();
    } else {
      slot = static_cast<uint32_t>(last_plans_.size());
      last_plans_.emplace_back();
    }
  }
  last_plans_[slot].plan = plan;
  last_plans_[slot].creator = creator;
}

std::optional<EventLog::LastPlan> EventLog::FindLastPlan(
    uint64_t lineage_id) const {
  absl::MutexLock lock(&mu_);
  auto it = lineages_.find(lineage_id);
  if (it == lineages_.end() || it->second.last_plan == kNoPlan) {
    return std::nullopt;
  }
  return last_plans_[it->second.last_plan];
}

std::shared_ptr<EventSubscription> EventLog::Subscribe(
    const EventFilter& filter, uint64_t from_id) {
  absl::MutexLock lock(&mu_);
  const uint64_t start = from_id == 0 ? next_id_ : from_id;
  auto sub = std::make_shared<EventSubscription>(this, filter, start);
  // Retained events before next_id_ are replayed from the log; later ones
  // (including ids >= a future from_id) are live.
  if (start < next_id_) {
    sub->cursor_ = std::max(start, first_id_);
    sub->replay_end_ = next_id_;
  }
  subs_.push_back(sub);
  return sub;
}

void EventLog::Unsubscribe(EventSubscription* sub) {
  absl::MutexLock lock(&mu_);
  subs_.erase(
      std::remove_if(subs_.begin(), subs_.end(),
                     [sub](const std::shared_ptr<EventSubscription>& s) {
                       return s.get() == sub;
                     }),
      subs_.end());
  sub->ended_ = true;
  sub->evicted_.clear();
  sub->pending_ = 0;
  sub->end_status_ = absl::CancelledError("watch cancelled");
}

size_t EventLog::retained() const {
  absl::MutexLock lock(&mu_);
  return next_id_ - first_id_;
}

uint64_t EventLog::retained_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t EventLog::subscribers() const {
  absl::MutexLock lock(&mu_);
  return subs_.size();
}

std::array<uint64_t, EventLog::kKinds> EventLog::AppendedByKind() const {
  absl::MutexLock lock(&mu_);
  return appended_;
}

}  // namespace triax::manager
