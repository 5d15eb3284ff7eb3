// The pressure ranking's snapshot of the registry: SnapshotBuilder copies
// every rankable block into the ranker's input (block_ranker.h
// PressureInput) in chunks, and PressureSnapshot is the ranked result the
// planners read (pressure_coordinator.h).
//
// What is copied: the UP workers (capacity and usage per tier), every
// tenant (floor, ceiling and usage per tier), and every open sequence on an
// UP worker with its blocks that are exclusively held (refcount 1), not
// evicted and not busy. A block is sealed (rankable) when it can no longer
// grow (it is full, or a later block follows it: a span that ended short of
// a block boundary leaves a partial block the worker seals like a full one)
// and ends at least window_guard_tokens before its sequence's end (the
// blocks after it are taken to be the worker's BF16 window). Its option set:
// the encodings of its tag in the sequence's calibration table (the allocation
// policy's, else the table stored under the model's name when the shapes
// match) that are valid for the sequence's page shape, plus BF16; without
// one, a fallback noise model 2^(-2 (bits - 2)) over BF16/FP8/INT8/INT4/
// INT2. Importance comes from the block graph, and a block gains
// kAdjacencyShare of its more important neighbour's (index +-1).
//
// Cost: O(blocks), in chunks of about chunk_blocks blocks; the snapshot is
// so not one instant's view (the planners re-check every action against
// the live registry).
//
// Thread contract: Begin and CopyChunk read the registry and need
// ManagerCore::mu_ held; release it between the steps. input() and the
// snapshot are the builder's own (no lock). One builder per refresh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/clock.h"
#include "kvmanager/block_graph.h"
#include "kvmanager/block_ranker.h"
#include "kvmanager/calibration_store.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/sequence_table.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

// Whether block `b` of `s` is sealed as above: not the last block unless
// full, and ending window_guard_tokens or more before the sequence's end.
inline bool SealedOutsideWindow(const SequenceRecord& s, const BlockRecord& b,
                                uint32_t window_guard_tokens) {
  const bool final = b.num_tokens == b.capacity ||
                     (!s.blocks.empty() && s.blocks.back() != &b);
  return final &&
         b.first_token + b.num_tokens + window_guard_tokens <= s.num_tokens;
}

// Temporal adjacency in the block graph: a block gains this share of the
// importance of its more important neighbour in the sequence (index +-1),
// so the blocks around an attended one are kept too.
inline constexpr double kAdjacencyShare = 0.5;

// The published snapshot: the ranking plus what maps its indices back to
// the registry. Immutable once published.
struct PressureSnapshot {
  Ranking ranking;
  int64_t built_ms = 0;
  double snapshot_ms = 0;      // the whole copy (in chunks)
  double longest_hold_ms = 0;  // the longest hold of the core mutex in it
  std::vector<std::string> worker_ids;    // PressureInput::workers order
  std::vector<std::string> sequence_ids;  // PressureInput::sequences order
  std::vector<std::string> tenant_ids;    // PressureInput::tenants order
};

class SnapshotBuilder {
 public:
  struct Options {
    double evict_factor = 4.0;  // RankerOptions'
    double default_evict_distortion = 1.0;
    uint32_t window_guard_tokens = 64;
    size_t chunk_blocks = 4096;  // blocks copied per CopyChunk
    // False: the workers' host and disk tiers are given to the ranker as
    // absent, so no block's candidate is a spill (its cheapest demotion or
    // eviction instead).
    bool spill_tiers = true;
  };
  // The parts must outlive the builder.
  SnapshotBuilder(const Options& options, const WorkerRegistry& workers,
                  const TenantLedger& tenants, const SequenceTable& sequences,
                  const CalibrationStore& calibrations,
                  const BlockGraph& graph);

  // Workers, tenants and the list of open sequences at now_ms.
  void Begin(int64_t now_ms);
  // Whether every listed sequence was copied.
  bool done() const { return next_ >= ids_.size(); }
  // Copies the blocks of the next sequences, about chunk_blocks blocks.
  void CopyChunk();

  PressureInput& input() { return input_; }
  // The snapshot being built (ranking still empty).
  PressureSnapshot& snapshot() { return *snap_; }
  std::shared_ptr<PressureSnapshot> TakeSnapshot() { return std::move(snap_); }

 private:
  // Builds the option set of `tag` for sequence `s` (its table may be
  // null) and records it in `group` under `code` (its dense tag code, -1
  // when out of range); CopyChunk looks it up there first.
  int32_t BuildOptionSet(const SequenceRecord& s, const Tag& tag,
                         const CalibrationTable* table, int code,
                         std::vector<int32_t>* group);

  const Options options_;
  const WorkerRegistry& workers_;
  const TenantLedger& tenants_;
  const SequenceTable& sequences_;
  const CalibrationStore& calibrations_;
  const BlockGraph& graph_;

  PressureInput input_;
  std::shared_ptr<PressureSnapshot> snap_;
  int64_t now_ms_ = 0;
  absl::flat_hash_map<const WorkerRecord*, uint32_t> worker_index_;
  absl::flat_hash_map<const TenantRecord*, uint32_t> tenant_index_;
  // Option sets per (table, shape) group and tag: the group is looked up
  // once per sequence, the tag by a dense index per block.
  std::map<std::tuple<const void*, uint32_t, uint32_t, uint32_t, uint32_t>,
           std::vector<int32_t>>
      groups_;
  std::vector<std::string> ids_;  // open sequences at Begin
  size_t next_ = 0;
  std::vector<std::shared_ptr<const CalibrationTable>> tables_;  // kept alive
};

}  // namespace triax::manager
