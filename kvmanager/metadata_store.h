// MetadataStore: the manager's embedded durable store (--metadata=file:DIR;
// docs/manager.md "Durable metadata"). A MetadataJournal that encodes the
// core's changed records as triax.v1.meta.MetadataRecord
// (proto/triax/v1/metadata.proto) into a MetadataLog (metadata_log.h), and
// that decodes a directory's snapshot and log back into a RecoveredState.
//
// Policies and calibration tables are stored once per version (a sequence
// keeps the version it was opened with): each version the core holds gets a
// ref when first written, and sequences name it by ref. A snapshot is taken
// when the log since the last one passes snapshot_bytes (and at start,
// after recovery), under the core's mutex: its cost is the encoding of the
// whole state (bench/manager: recovery figures).
//
// Thread contract: Write and Snapshot are called with the core's mutex held
// (they are serialized by it); Wait from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kvmanager/metadata_journal.h"
#include "kvmanager/metadata_log.h"
#include "triax/v1/metadata.pb.h"

namespace triax::manager {

struct MetadataStoreOptions {
  std::string dir;
  bool sync = true;                              // MetadataLogOptions::sync
  uint64_t snapshot_bytes = uint64_t{64} << 20;  // log bytes between snapshots
};

struct RecoveryFigures {
  uint64_t records = 0;  // snapshot and log records read
  uint64_t bytes = 0;
  double read_seconds = 0;  // reading and decoding the files
  uint64_t epoch = 0;       // this start's (1 on an empty directory)
};

class MetadataStore : public MetadataJournal {
 public:
  // Opens and locks `options.dir` (MetadataLog::Open's errors) and decodes
  // what it holds into *recovered (empty state on a new directory).
  // DATA_LOSS for corrupt files or records.
  static absl::StatusOr<std::unique_ptr<MetadataStore>> Open(
      const MetadataStoreOptions& options, RecoveredState* recovered,
      RecoveryFigures* figures = nullptr);
  // The same over any backend (the etcd log: etcd_log.h); options.dir and
  // options.sync are the backend's business then.
  static absl::StatusOr<std::unique_ptr<MetadataStore>> Open(
      std::unique_ptr<GroupCommitLog> log, const MetadataStoreOptions& options,
      RecoveredState* recovered, RecoveryFigures* figures = nullptr);

  uint64_t Write(const ChangeSet& changes, const StateView& view) override;
  uint64_t Snapshot(const StateView& view) override;
  void Wait(uint64_t ticket) override;
  void OnDurable(uint64_t ticket, std::function<void()> fn) override;

  uint64_t epoch() const { return epoch_; }
  MetadataLogStats log_stats() const { return log_->stats(); }

 private:
  MetadataStore(const MetadataStoreOptions& options,
                std::unique_ptr<GroupCommitLog> log, uint64_t epoch,
                uint64_t next_ref);
  struct Interned {
    uint64_t ref = 0;
    std::shared_ptr<const void> keep;  // holds the address stable
  };

  const MetadataStoreOptions options_;
  std::unique_ptr<GroupCommitLog> log_;
  const uint64_t epoch_;
  // Refs of the policy and calibration versions already written since the
  // last snapshot (by address; the shared_ptr keeps the address unique).
  absl::flat_hash_map<const void*, Interned> interned_;
  uint64_t next_ref_ = 1;
  // Write's record, cleared and reused; a record of more sequences than
  // kReusedSequences is dropped after use.
  static constexpr int kReusedSequences = 64;
  triax::v1::meta::MetadataRecord record_;

  friend class MetadataEncoder;
};

}  // namespace triax::manager
