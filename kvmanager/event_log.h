// The manager's lifecycle event log: dense ids, bounded retention, a
// per-lineage index for QueryTrace, and subscriptions for WatchEvents.
//
// Storage: events are kept compact, not as `Event` structs: a ring of
// fixed 48-byte records (id, time, kind, tag, format, lineage, and the
// link to the lineage's next event) and, for each record, its strings and
// lineage id list packed into a ring of byte chunks (EventBytes). Both rings
// grow to their bound once and are then reused: at steady state an append
// allocates nothing and touches no new page. Readers get `Event`s rebuilt
// from the records.
//
// Retention: the newest `retention` events are kept (FIFO), and fewer when
// their estimated bytes (EventBytes: the record, its packed strings and
// ids, plus the index's share) pass `retention_bytes` (0: no byte bound);
// the oldest go first. The lineage index holds, per lineage id with
// retained events, its oldest and newest retained event (the events of a
// lineage are linked in id order through their records) plus the block's
// last known plan once the core has forgotten the block (freed or lost);
// an index entry goes when its last event leaves retention, so the index
// is bounded by the retained events.
//
// Subscriptions replay retained events with id >= from_id, then deliver live
// ones, in id order, filtered. A subscription reads the log at its cursor;
// appending never copies an event for it and never blocks on it. A
// subscriber more than `watcher_queue_limit` matching live events behind (or
// whose replay position leaves retention) is ended: Next() returns kEnded
// with RESOURCE_EXHAUSTED saying by how much it fell behind. Live events a
// subscriber has not read yet when they leave retention are copied into
// its own queue first, so a live subscriber loses nothing within its limit.
//
// Thread contract: EventLog and EventSubscription are thread-safe. Lock order:
// subscription notify mutex -> (the subscriber's own locks) -> log mutex.
// Notify callbacks run outside the log mutex, on the appending thread; they
// must not block (a gRPC reactor's StartWrite is fine). The EventLog must
// outlive its subscriptions' use (Cancel them before destroying the log).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
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
  // Ids below replay_end_ are replayed from the retained log (and end the
  // subscription when they leave retention first); ids from replay_end_ on
  // are live and count against the queue limit.
  uint64_t cursor_;      // next id to read from the log
  uint64_t replay_end_;  // first live id
  // Matching live events not delivered yet (in `evicted_` or in the log
  // from cursor_ on).
  uint64_t pending_ = 0;
  // Matching live events that left retention before they were read.
  std::deque<Event> evicted_;
  bool waiting_ = false;  // Next returned kEmpty; notify on the next event
  bool ended_ = false;
  absl::Status end_status_;
};

// Events made in place for EventLog::Append, without Event structs or heap
// strings: the core's block events (created, released, freed, retagged:
// ~60 per RPC of a session). Begin starts an event, Detail appends to its
// detail; the sequence, tenant and worker names are kept once while
// consecutive events name the same strings. Reused after Clear without
// allocating. Thread contract: one thread at a time.
class EventBatch {
 public:
  void Begin(int64_t unix_ms, EventKind kind, const std::string& sequence_id,
             const std::string& tenant_id, const std::string& worker_id,
             uint64_t lineage_id = 0, Tag tag = Tag{},
             Format format = static_cast<Format>(0));
  // Appends to the current event's detail (absl::StrAppend's arguments).
  template <typename... Pieces>
  void Detail(const Pieces&... pieces) {
    const size_t before = chars_.size();
    absl::StrAppend(&chars_, pieces...);
    entries_.back().detail.size += chars_.size() - before;
  }
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  void Clear();

 private:
  friend class EventLog;
  struct Slice {
    uint32_t offset = 0;
    uint32_t size = 0;
  };
  struct Entry {
    int64_t unix_ms;
    uint64_t lineage_id;
    EventKind kind;
    Tag tag;
    Format format;
    Slice sequence_id, tenant_id, worker_id, detail;
  };
  absl::string_view View(Slice s) const {
    return absl::string_view(chars_.data() + s.offset, s.size);
  }
  // Copies `name` into chars_ unless it is the string the last event named.
  Slice Name(int field, const std::string& name);

  std::vector<Entry> entries_;
  std::string chars_;
  const std::string* last_[3] = {nullptr, nullptr, nullptr};
  Slice last_slice_[3];
};

class EventLog {
 public:
  struct Options {
    size_t retention = 1'000'000;         // events kept for replay/trace
    size_t watcher_queue_limit = 65'536;  // live events queued per watcher
    uint64_t retention_bytes = 0;         // 0: no byte bound
  };
  // The bytes one retained event is taken to cost (see "Retention"): its
  // record, its packed strings and lineage ids, and the index's share.
  static uint64_t EventBytes(const Event& e);
  explicit EventLog(Options options);
  ~EventLog();

  struct LastPlan {
    BlockPlan plan;
    std::string creator;  // the sequence that created the block
  };

  // Assigns ids to `events` (in order), stores and indexes them, and wakes
  // matching subscribers. `forgotten` are the last plans of blocks the core
  // just forgot (freed or lost), recorded as by RecordLastPlan.
  void Append(std::vector<Event>* events,
              const std::vector<LastPlan>* forgotten = nullptr);
  // The same for a batch (ids are those from next_id() on); clears it.
  void Append(EventBatch* batch,
              const std::vector<LastPlan>* forgotten = nullptr);

  // The id the next appended event gets (1 for an empty log).
  uint64_t next_id() const;
  // Retained events with id >= from_id that match, at most `max` (0: all).
  std::vector<Event> Retained(uint64_t from_id, const EventFilter& filter,
                              size_t max = 0) const;

  // Lineage index (QueryTrace).
  std::vector<Event> EventsForLineage(uint64_t lineage_id) const;
  // At most `max` of them with id > after_id (QueryTrace's pages); *more:
  // whether others follow. O(max) when after_id is one of the lineage's
  // retained events (the previous page's last), else O(events skipped).
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
  // Events appended since the log was made, by kind (index: the EventKind's
  // value; out-of-range kinds count under kUnspecified).
  static constexpr size_t kKinds =
      static_cast<size_t>(EventKind::kLastEventKind) + 1;
  std::array<uint64_t, kKinds> AppendedByKind() const;

 private:
  friend class EventSubscription;
  // One retained event. Its strings and lineage ids are packed at `packed`
  // in packed_ (see Pack).
  struct Record {
    uint64_t lineage_id;
    int64_t unix_ms;
    uint64_t next_in_lineage;  // id of the lineage's next event; 0: none yet
    uint64_t packed;           // position in packed_
    uint32_t packed_size;
    uint8_t kind;
    uint8_t temporal, modality, role;  // Tag
    uint8_t format;
  };
  // EventBytes of a record.
  static uint64_t StoredBytes(size_t packed_size, uint64_t lineage_id);
  // A record's packed fields, read in place.
  struct View {
    absl::string_view sequence_id, tenant_id, worker_id, detail,
        source_worker_id;
    const char* lineage_ids;  // n_lineage_ids little-endian uint64s
    size_t n_lineage_ids;
  };
  // Bytes in chunks, addressed by a position that only grows; space is
  // taken at the end and given back from the front, and chunks given back
  // are reused.
  class ByteRing {
   public:
    // `n` contiguous bytes at the end; *pos is where they start.
    char* Take(size_t n, uint64_t* pos);
    const char* At(uint64_t pos) const;
    // Gives back every chunk that ends at or before `pos`.
    void ReleaseBefore(uint64_t pos);

   private:
    struct Chunk {
      uint64_t start;
      size_t size;
      std::unique_ptr<char[]> data;
    };
    std::deque<Chunk> chunks_;
    std::vector<Chunk> spare_;  // standard chunks for reuse
    uint64_t end_ = 0;          // position of the next byte to take
  };
  struct LineageEntry {
    uint64_t first = 0;  // oldest retained event
    uint64_t last = 0;   // newest
    // Index in last_plans_ once the core forgot the block; kNoPlan before.
    uint32_t last_plan = kNoPlan;
  };
  static constexpr uint32_t kNoPlan = ~uint32_t{0};
  // Lineage ids are dense and handed out in order, and one call's events
  // name neighbouring ids: the id itself above SwissTable's 7 control bits
  // puts them in neighbouring slots (absl::Hash scattered them: perf showed
  // 70% of StoreLocked's cycles waiting on the index's cache misses); the
  // control bits come from a multiplicative hash.
  struct LineageHash {
    size_t operator()(uint64_t id) const {
      return static_cast<size_t>((id << 7) |
                                 ((id * 0x9E3779B97F4A7C15ull) >> 57));
    }
  };

  Record& RecordLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ring_[id & (ring_.size() - 1)];
  }
  const Record& RecordLocked(uint64_t id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ring_[id & (ring_.size() - 1)];
  }
  View ViewLocked(const Record& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Event LoadLocked(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool MatchesLocked(const EventFilter& filter, const Record& r) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An event's fields for StoreLocked, from an Event or a batch entry.
  struct Fields {
    int64_t unix_ms;
    uint64_t lineage_id;
    EventKind kind;
    Tag tag;
    Format format;
    absl::string_view strings[5];  // sequence, tenant, worker, detail, source
    const std::vector<uint64_t>* lineage_ids;  // null: none
  };
  static Fields FieldsOf(const Event& e);
  void StoreLocked(const Fields& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts f against the subscribers it matches (after StoreLocked).
  void OfferLocked(uint64_t id,
                   std::vector<std::shared_ptr<EventSubscription>>* to_notify)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishAppendLocked(const std::vector<LastPlan>* forgotten)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts down to the byte bound; gives back packed bytes.
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictOneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordLastPlanLocked(const BlockPlan& plan, const std::string& creator)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unsubscribe(EventSubscription* sub);

  const Options options_;
  mutable absl::Mutex mu_;
  // Records of ids first_id_ .. next_id_ - 1 at ring_[id & (size - 1)]; the
  // size is a power of two, doubled while it is full and below retention.
  std::vector<Record> ring_ ABSL_GUARDED_BY(mu_);
  ByteRing packed_ ABSL_GUARDED_BY(mu_);
  uint64_t first_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // EventBytes of the retained
  absl::flat_hash_map<uint64_t, LineageEntry, LineageHash> lineages_
      ABSL_GUARDED_BY(mu_);
  // Last plans by LineageEntry::last_plan; free slots are reused.
  std::vector<LastPlan> last_plans_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_plans_ ABSL_GUARDED_BY(mu_);
  std::array<uint64_t, kKinds> appended_ ABSL_GUARDED_BY(mu_) = {};
  std::vector<std::shared_ptr<EventSubscription>> subs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::manager
