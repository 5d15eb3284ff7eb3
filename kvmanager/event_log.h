// The manager's lifecycle event log: dense ids, bounded retention, a
// per-lineage index for QueryTrace, and subscriptions for WatchEvents.
//
// Retention: the newest `retention` events are kept (FIFO), and fewer when
// their estimated bytes (EventBytes: the struct, its strings' heap and its
// lineage id list, plus the index's share) pass `retention_bytes` (0: no
// byte bound); the oldest go first. The lineage index
// holds, per lineage id, the ids of its retained events plus the block's last
// known plan once the core has forgotten the block (freed or lost); an index
// entry goes when its last event leaves retention.
//
// Subscriptions replay retained events with id >= from_id, then deliver live
// ones, in id order, filtered. Appending never blocks on a subscriber: live
// events are queued per subscriber, and a subscriber whose queue passes
// `watcher_queue_limit` events (or whose replay position leaves retention) is
// ended: Next() returns kEnded with RESOURCE_EXHAUSTED saying by how much it
// fell behind.
//
// Thread contract: EventLog and EventSubscription are thread-safe. Lock order:
// subscription notify mutex -> (the subscriber's own locks) -> log mutex.
// Notify callbacks run outside the log mutex, on the appending thread; they
// must not block (a gRPC reactor's StartWrite is fine). The EventLog must
// outlive its subscriptions' use (Cancel them before destroying the log).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kvmanager/types.h"

namespace triax::manager {

class EventLog;

class EventSubscription {
 public:
  enum class Result { kEvent, kEmpty, kEnded };

  // The next matching event in id order: kEvent fills *out; kEmpty means
  // nothing yet (the notify callback fires when something arrives); kEnded
  // fills *end (RESOURCE_EXHAUSTED when the subscriber fell behind, CANCELLED
  // after Cancel).
  Result Next(Event* out, absl::Status* end);

  // Called, outside the log mutex, whenever an event becomes available after
  // Next returned kEmpty, and when the subscription is ended by overflow.
  void SetNotify(std::function<void()> notify);

  // Unsubscribes. After Cancel returns, the notify callback is not running
  // and never runs again.
  void Cancel();

  EventSubscription(EventLog* log, EventFilter filter, uint64_t cursor);

 private:
  friend class EventLog;
  void Notify();

  EventLog* const log_;
  const EventFilter filter_;

  absl::Mutex notify_mu_;
  std::function<void()> notify_ ABSL_GUARDED_BY(notify_mu_);

  // Guarded by log_->mu_ (the annotation cannot name it across classes).
  uint64_t replay_cursor_;  // next id to replay from the retained log
  uint64_t replay_end_;     // first id delivered through live_ instead
  std::deque<Event> live_;
  bool waiting_ = false;  // Next returned kEmpty; notify on the next event
  bool ended_ = false;
  absl::Status end_status_;
};

class EventLog {
 public:
  struct Options {
    size_t retention = 1'000'000;         // events kept for replay/trace
    size_t watcher_queue_limit = 65'536;  // live events queued per watcher
    uint64_t retention_bytes = 0;         // 0: no byte bound
  };
  // The bytes one retained event is taken to cost (see "Retention").
  static uint64_t EventBytes(const Event& e);
  explicit EventLog(Options options);
  ~EventLog();

  struct LastPlan {
    BlockPlan plan;
    std::string creator;  // the sequence that created the block
  };

  // Assigns ids to `events` (in order), stores and indexes them, and hands
  // them to matching subscribers. `forgotten` are the last plans of blocks
  // the core just forgot (freed or lost), recorded as by RecordLastPlan.
  void Append(std::vector<Event>* events,
              const std::vector<LastPlan>* forgotten = nullptr);

  // The id the next appended event gets (1 for an empty log).
  uint64_t next_id() const;
  // Retained events with id >= from_id that match, at most `max` (0: all).
  std::vector<Event> Retained(uint64_t from_id, const EventFilter& filter,
                              size_t max = 0) const;

  // Lineage index (QueryTrace).
  std::vector<Event> EventsForLineage(uint64_t lineage_id) const;
  // At most `max` of them with id > after_id (QueryTrace's pages); *more:
  // whether others follow. O(log + max).
  std::vector<Event> EventsForLineage(uint64_t lineage_id, uint64_t after_id,
                                      size_t max, bool* more) const;
  // Remembers the last plan of a block the core forgets (freed or lost), and
  // the sequence that created it; kept while the lineage has retained events.
  void RecordLastPlan(const BlockPlan& plan, const std::string& creator);
  std::optional<LastPlan> FindLastPlan(uint64_t lineage_id) const;

  // Starts a subscription. from_id 0 means live only.
  std::shared_ptr<EventSubscription> Subscribe(const EventFilter& filter,
                                               uint64_t from_id);
  size_t subscribers() const;
  // Retained events and their estimated bytes (EventBytes).
  size_t retained() const;
  uint64_t retained_bytes() const;

 private:
  friend class EventSubscription;
  // The ids of one lineage's retained events, oldest first. Most blocks
  // have a few (created, released, freed), kept inline; popped from the
  // front in amortized O(1). (A std::deque here cost 512 bytes a lineage.)
  class IdQueue {
   public:
    bool empty() const { return head_ == ids_.size(); }
    uint64_t front() const { return ids_[head_]; }
    void push_back(uint64_t id) { ids_.push_back(id); }
    void pop_front() {
      if (++head_ == ids_.size()) {
        ids_.clear();
        head_ = 0;
      } else if (head_ >= 16 && 2 * head_ >= ids_.size()) {
        ids_.erase(ids_.begin(), ids_.begin() + head_);
        head_ = 0;
      }
    }
    const uint64_t* begin() const { return ids_.data() + head_; }
    const uint64_t* end() const { return ids_.data() + ids_.size(); }

   private:
    absl::InlinedVector<uint64_t, 3> ids_;
    size_t head_ = 0;
  };
  struct LineageEntry {
    IdQueue event_ids;
    // Set once the core forgot the block; boxed, since most entries are of
    // live blocks and go before they have one.
    std::unique_ptr<LastPlan> last_plan;
  };
  void Unsubscribe(EventSubscription* sub);
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordLastPlanLocked(const BlockPlan& plan, const std::string& creator)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  uint64_t first_id_ ABSL_GUARDED_BY(mu_) = 1;  // id of events_.front()
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // EventBytes of events_
  absl::flat_hash_map<uint64_t, LineageEntry> lineages_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<EventSubscription>> subs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::manager
