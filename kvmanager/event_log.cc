#include "kvmanager/event_log.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace triax::manager {
namespace {

// Bound on retained events scanned per lock hold during replay, so a watcher
// replaying a long history never holds the log mutex for long.
constexpr size_t kReplayScanChunk = 4096;

}  // namespace

EventSubscription::EventSubscription(EventLog* log, EventFilter filter,
                                     uint64_t cursor)
    : log_(log),
      filter_(std::move(filter)),
      replay_cursor_(cursor),
      replay_end_(cursor) {}

EventSubscription::Result EventSubscription::Next(Event* out,
                                                  absl::Status* end) {
  for (;;) {
    absl::MutexLock lock(&log_->mu_);
    if (ended_) {
      *end = end_status_;
      return Result::kEnded;
    }
    if (replay_cursor_ < replay_end_) {
      if (replay_cursor_ < log_->first_id_) {
        ended_ = true;
        end_status_ = absl::ResourceExhaustedError(absl::StrCat(
            "watcher fell behind: events ", replay_cursor_, "..",
            log_->first_id_ - 1,
            " left retention before they were replayed (retention ",
            log_->options_.retention, " events)"));
        live_.clear();
        *end = end_status_;
        return Result::kEnded;
      }
      size_t scanned = 0;
      while (replay_cursor_ < replay_end_ && scanned < kReplayScanChunk) {
        const Event& e = log_->events_[replay_cursor_ - log_->first_id_];
        ++replay_cursor_;
        ++scanned;
        if (filter_.Matches(e)) {
          *out = e;
          return Result::kEvent;
        }
      }
      continue;  // release the lock between chunks
    }
    if (!live_.empty()) {
      *out = std::move(live_.front());
      live_.pop_front();
      return Result::kEvent;
    }
    waiting_ = true;
    return Result::kEmpty;
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

EventLog::EventLog(Options options) : options_(options) {}

EventLog::~EventLog() = default;

void EventLog::Append(std::vector<Event>* events,
                      const std::vector<LastPlan>* forgotten) {
  std::vector<std::shared_ptr<EventSubscription>> to_notify;
  {
    absl::MutexLock lock(&mu_);
    for (Event& e : *events) {
      e.id = next_id_++;
      if (e.lineage_id != 0) lineages_[e.lineage_id].event_ids.push_back(e.id);
      for (const auto& sub : subs_) {
        if (sub->ended_ || e.id < sub->replay_end_ ||
            !sub->filter_.Matches(e)) {
          continue;
        }
        if (sub->live_.size() >= options_.watcher_queue_limit) {
          sub->ended_ = true;
          sub->live_.clear();
          sub->end_status_ = absl::ResourceExhaustedError(absl::StrCat(
              "watcher fell behind by more than ", options_.watcher_queue_limit,
              " events (at event ", e.id, "); reconnect with from_id"));
        } else {
          sub->live_.push_back(e);
        }
        if (sub->waiting_) {
          sub->waiting_ = false;
          to_notify.push_back(sub);
        }
      }
      events_.push_back(e);
      // Of the stored copy: eviction subtracts the same figure.
      bytes_ += EventBytes(events_.back());
    }
    if (forgotten != nullptr) {
      for (const LastPlan& lp : *forgotten)
        RecordLastPlanLocked(lp.plan, lp.creator);
    }
    EvictLocked();
  }
  for (const auto& sub : to_notify) sub->Notify();
}

uint64_t EventLog::EventBytes(const Event& e) {
  // Heap bytes of a string beyond the small-string buffer (libstdc++: 15).
  auto heap = [](const std::string& s) -> uint64_t {
    return s.capacity() > 15 ? s.capacity() + 1 : 0;
  };
  // The index's share: an id in its lineage's queue and a part of the
  // entry (measured: bench/results/manager.md "Retention and memory").
  constexpr uint64_t kIndexBytes = 48;
  return sizeof(Event) + heap(e.sequence_id) + heap(e.tenant_id) +
         heap(e.worker_id) + heap(e.detail) + heap(e.source_worker_id) +
         e.lineage_ids.capacity() * sizeof(uint64_t) +
         (e.lineage_id != 0 ? kIndexBytes : 0);
}

void EventLog::EvictLocked() {
  // The newest event always stays, whatever its bytes.
  while (events_.size() > options_.retention ||
         (options_.retention_bytes != 0 && bytes_ > options_.retention_bytes &&
          events_.size() > 1)) {
    const Event& e = events_.front();
    if (e.lineage_id != 0) {
      auto it = lineages_.find(e.lineage_id);
      if (it != lineages_.end()) {
        auto& ids = it->second.event_ids;
        if (!ids.empty() && ids.front() == e.id) ids.pop_front();
        if (ids.empty()) lineages_.erase(it);
      }
    }
    bytes_ -= EventBytes(e);
    events_.pop_front();
    ++first_id_;
  }
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
    const Event& e = events_[id - first_id_];
    if (!filter.Matches(e)) continue;
    out.push_back(e);
    if (max != 0 && out.size() >= max) break;
  }
  return out;
}

std::vector<Event> EventLog::EventsForLineage(uint64_t lineage_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<Event> out;
  auto it = lineages_.find(lineage_id);
  if (it == lineages_.end()) return out;
  for (uint64_t id : it->second.event_ids) {
    if (id >= first_id_) out.push_back(events_[id - first_id_]);
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
  const IdQueue& ids = it->second.event_ids;
  // Ids below first_id_ have left retention (the entry keeps them until
  // eviction reaches it); the cursor skips them too.
  auto id = std::upper_bound(ids.begin(), ids.end(),
                             std::max(after_id, first_id_ - 1));
  for (; id != ids.end() && out.size() < max; ++id) {
    out.push_back(events_[*id - first_id_]);
  }
  *more = id != ids.end();
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
  it->second.last_plan = std::make_unique<LastPlan>(LastPlan{plan, creator});
}

std::optional<EventLog::LastPlan> EventLog::FindLastPlan(
    uint64_t lineage_id) const {
  absl::MutexLock lock(&mu_);
  auto it = lineages_.find(lineage_id);
  if (it == lineages_.end() || it->second.last_plan == nullptr) {
    return std::nullopt;
  }
  return *it->second.last_plan;
}

std::shared_ptr<EventSubscription> EventLog::Subscribe(
    const EventFilter& filter, uint64_t from_id) {
  absl::MutexLock lock(&mu_);
  const uint64_t start = from_id == 0 ? next_id_ : from_id;
  auto sub = std::make_shared<EventSubscription>(this, filter, start);
  // Retained events before next_id_ are replayed from the log; later ones
  // (including ids >= a future from_id) arrive through the live queue.
  if (start < next_id_) {
    sub->replay_cursor_ = std::max(start, first_id_);
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
  sub->end_status_ = absl::CancelledError("watch cancelled");
}

size_t EventLog::retained() const {
  absl::MutexLock lock(&mu_);
  return events_.size();
}

uint64_t EventLog::retained_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t EventLog::subscribers() const {
  absl::MutexLock lock(&mu_);
  return subs_.size();
}

}  // namespace triax::manager
