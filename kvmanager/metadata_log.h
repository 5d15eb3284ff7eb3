// MetadataLog: the files of the manager's embedded durable store — a
// write-ahead log in segments and snapshots, in one directory, with group
// commit. It knows records only as bytes; metadata_store.h says what they
// hold.
//
// Files (DIR is --metadata=file:DIR):
//   DIR/LOCK                 flock'ed while a manager uses DIR (a second
//                            manager on the same DIR fails FAILED_PRECONDITION)
//   DIR/wal-<n>.log          log segment n (16 decimal digits)
//   DIR/snap-<n>.pb          the state before segment n: written as
//                            snap-<n>.tmp, fsync'ed, then renamed
// Every record, in both kinds of file, is framed as
//   u32 length (little endian) | u32 CRC-32 of the payload (zlib) | payload.
//
// Recovery (Replay): the newest snapshot, then every segment from its
// number on, in order. A torn or corrupt frame at the end of the newest
// segment (a write the crash cut) is dropped, and the segment truncated
// there; anywhere else it is DATA_LOSS naming the file and offset, and the
// manager does not start. After Replay, appends go to a new segment.
//
// Group commit: Append queues a record and returns its sequence number;
// one writer thread writes whatever is queued, fdatasync's the segment once
// for the lot, and wakes every Wait for a number up to the last one written.
// AppendSnapshot queues a snapshot: the writer starts a new segment at that
// point, writes the snapshot of the state before it, and then deletes the
// segments and snapshots it replaces.
//
// Thread contract: Append, AppendSnapshot and Wait are thread-safe;
// Open and Replay run before the first Append, on one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace triax::manager {

struct MetadataLogOptions {
  std::string dir;
  // fdatasync after each group of writes (off: only for benchmarks of the
  // encoding cost; a crash of the machine may then lose acknowledged calls).
  bool sync = true;
};

struct MetadataLogStats {
  uint64_t appended_records = 0;
  uint64_t appended_bytes = 0;
  uint64_t syncs = 0;  // fdatasync calls (one per group)
  uint64_t snapshots = 0;
  uint64_t bytes_since_snapshot = 0;
  uint64_t segment = 0;  // number of the segment appends go to
};

// The group commit every metadata backend shares (the file log below, the
// etcd log of etcd_log.h): a queue of records and snapshots, one writer
// thread that hands whatever is queued to the backend at once, sequence
// numbers, waits and callbacks on durability. A backend implements Replay
// and the two writes.
class GroupCommitLog {
 public:
  virtual ~GroupCommitLog();

  // Calls fn for each stored record in order: the snapshot's (from_snapshot
  // true), then the log's. Stops at fn's first error. Starts the writer.
  absl::Status Replay(const std::function<absl::Status(
                          absl::string_view record, bool from_snapshot)>& fn);
  // Queues one record; returns its sequence number (from 1).
  uint64_t Append(std::string record);
  // Queues a snapshot (its records in order); returns its sequence number.
  uint64_t AppendSnapshot(std::vector<std::string> records);
  // Blocks until every record up to `seq` is durable, or the writer failed:
  // then returns its error (every later Wait too).
  absl::Status Wait(uint64_t seq);
  // Calls fn once every record up to `seq` is durable (OK) or the writer
  // failed (its error): from the writer thread, or now from this one when
  // that is already so. fn must not call back into the log.
  void OnDurable(uint64_t seq, std::function<void(const absl::Status&)> fn);

  MetadataLogStats stats() const;
  // Where the log is, for messages ("metadata directory X", "etcd ...").
  virtual std::string where() const = 0;

 protected:
  GroupCommitLog() = default;
  // Stops the writer after what is queued (a backend's destructor calls it
  // first, while the backend is still whole).
  void StopWriter();
  // The backend's recovery (Replay calls it before starting the writer).
  virtual absl::Status ReplayStored(
      const std::function<absl::Status(absl::string_view, bool)>& fn) = 0;
  // Writer thread: makes `records` durable, in order, appended to the log.
  virtual absl::Status WriteRecords(
      const std::vector<const std::string*>& records) = 0;
  // Writer thread: makes `snapshot` the state before every later record,
  // and drops what it replaces.
  virtual absl::Status WriteSnapshot(
      const std::vector<std::string>& snapshot) = 0;

  mutable absl::Mutex mu_;
  MetadataLogStats stats_ ABSL_GUARDED_BY(mu_);

 private:
  struct Item {
    uint64_t seq = 0;
    std::string record;                 // a log record, or
    std::vector<std::string> snapshot;  // a snapshot (is_snapshot)
    bool is_snapshot = false;
  };
  void WriterLoop();

  std::thread writer_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t durable_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::multimap<uint64_t, std::function<void(const absl::Status&)>> callbacks_
      ABSL_GUARDED_BY(mu_);
};

// The file backend: segments and snapshots in one directory (see above).
class MetadataLog final : public GroupCommitLog {
 public:
  // Creates DIR if missing and locks it. FAILED_PRECONDITION when another
  // process holds the lock; INTERNAL (with errno text) for I/O errors.
  static absl::StatusOr<std::unique_ptr<MetadataLog>> Open(
      const MetadataLogOptions& options);
  ~MetadataLog() override;  // writes what is queued, stops, unlocks

  const std::string& dir() const { return options_.dir; }
  std::string where() const override {
    return "metadata directory " + options_.dir;
  }

 private:
  explicit MetadataLog(const MetadataLogOptions& options);
  absl::Status ReplayStored(
      const std::function<absl::Status(absl::string_view, bool)>& fn) override;
  absl::Status WriteRecords(
      const std::vector<const std::string*>& records) override;
  absl::Status WriteSnapshot(const std::vector<std::string>& snapshot) override;
  absl::Status OpenSegment(uint64_t n);
  void RemoveBefore(uint64_t n);

  const MetadataLogOptions options_;
  int lock_fd_ = -1;
  int segment_fd_ = -1;   // writer thread only (after Replay)
  uint64_t segment_ = 0;  // writer thread only (after Replay)
};

// Frames `payload` (length, CRC, payload) onto *out.
void AppendFrame(absl::string_view payload, std::string* out);
// Calls fn for every whole, valid frame of `data` in order; returns the
// offset of the first byte that is not one (data.size() when all are), or
// fn's first error.
absl::StatusOr<size_t> ForEachFrame(
    absl::string_view data, bool from_snapshot,
    const std::function<absl::Status(absl::string_view, bool)>& fn);

}  // namespace triax::manager
