// Reclaim ranking of the manager's memory pressure: every block of a
// snapshot (PressureInput, filled by pressure_snapshot.h) scored by its
// cheapest reclaim action, pools ordered, and reclaim selection. The block
// graph that feeds the views' importance is block_graph.h. No gRPC, no I/O,
// no locks of its own beyond what is stated per class.
//
// Actions on a block (each frees device-pool bytes, except spills out of
// the host tier, which free host-tier bytes):
//   DEMOTE      re-encode into a smaller encoding; quality cost from the
//               calibration table: tokens * (D_tag(new) - D_tag(current)).
//   SPILL_HOST  move the pages to the worker's host tier; no quality cost,
//   SPILL_DISK  but a restore cost if the block is used again:
//               tokens * spill_{host,disk}_penalty * reuse, where reuse is
//               the probability the block is attended again soon:
//               reuse = 2^(-idle / reuse_half_life_ms), idle = now -
//               max(sequence.last_access_ms, block.last_access_ms) (>= 0);
//               the graph raises it through the weight below.
//   EVICT       drop the block: its tokens are no longer attended. Cost
//               tokens * evict_distortion of its tag (by default
//               evict_factor x the tag's largest calibrated distortion).
//               Blocks of protected roles are never evicted.
// Every cost is multiplied by the block's graph weight
// (1 + importance_weight * importance) and divided by the bytes the action
// frees: the ranking key is "quality lost per byte freed". A block's
// candidate (at most one per block) is its cheapest allowed action.
//
// Modes (the pressure benchmark compares them):
//   kDemoteFirst  all four actions, ranked by cost per byte.
//   kGraphEvict   EVICT only, ranked by the graph-weighted cost per byte.
//   kLru          EVICT only, least recently accessed block first.
//
// Tenants: a candidate whose tenant uses more than its floor on the
// candidate's tier ranks before every candidate of a tenant at or below its
// floor ("tenants above their floor give memory first"); within a class,
// by cost per byte, the more a tenant is over its floor the cheaper (cost
// divided by 1 + overage / floor).
//
// Which blocks are candidates, and where:
//   - never: refcount > 1 (shared with a fork), unsealed (in the worker's
//     BF16 window), bytes == 0, or on TIER_DISK (the last tier);
//   - TIER_DEVICE blocks -> pools[worker][TIER_DEVICE]: DEMOTE to every
//     option of its option set with fewer bytes than `bytes` (cost
//     tokens * max(0, D(new) - D(current)), frees bytes - option.bytes);
//     SPILL_HOST when the worker's host tier is present (capacity > 0) and
//     has room for the block now (capacity - used >= bytes); SPILL_DISK
//     likewise for the disk tier; EVICT unless the role is protected.
//   - TIER_HOST blocks -> pools[worker][TIER_HOST]: SPILL_DISK (as above)
//     and EVICT (unless protected).
//   Room in a spill tier is checked per block against the snapshot; the
//   caller checks the sum when it applies a batch.
//
// Ordering inside a pool (a total order, so the ranking is deterministic):
//   above_floor first, then the key ascending (kLru: the last access
//   max(block, sequence) ascending, i.e. `cost` = age descending), then
//   lineage_id ascending. A block's own action is chosen by the smallest
//   cost per byte; ties go to the action freeing more bytes, then to
//   DEMOTE < SPILL_HOST < SPILL_DISK < EVICT, then to the earlier option
//   of the option set.
//
// Cost of Rank (1M blocks in <= 50 ms is the design target,
// bench/results/pressure.md): one O(N) pass scores every block into a
// compact candidate array (one candidate per block) and an 8-byte
// (float key, bucket) array; a counting pass splits the candidates by
// (worker, tier, above_floor); each part is ordered by a stable LSD radix
// sort (3 passes of 11/11/10 bits) of (32-bit order-preserving image of
// float(key), candidate index) pairs, small parts by std::sort of the same
// pairs; the RankedActions are then gathered in that order. float(key) is
// monotone in the double key, so the only misordering left is inside runs
// of equal float keys: each such run is re-sorted by (double key,
// lineage_id) as it is gathered, unless it is already in order (runs are
// short unless many keys are exactly equal, e.g. a sequence's blocks in
// kLru mode; they are already in lineage order when the input lists blocks
// by lineage). Full order, not a bounded prefix: a reclaim for one
// tenant's ceiling skips other tenants' candidates and may go deep into
// the pool. Buffers are reused through RankScratch and new ones get
// transparent huge pages (first-touch faults dominated before).
// Threads (RankerOptions::threads): the scoring and split passes run over
// equal block ranges, one per thread (candidate indices stay increasing in
// block order, so the sort's tie-break is unchanged); sort, gather and the
// equal-key runs run per pool, pools handed out largest first. Every pool
// is built by one thread from the same items, so the ranking does not
// depend on the thread count.
// Measured on the 2-core dev VM (p50, 1M blocks): one thread 73 ms
// demote-first, 60 ms graph-evict, 45 ms lru; two threads 35-37, 28-29 and
// 20 ms; 100k blocks 3-6 ms (one thread: below 2 x parallel_min_blocks).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmanager/block_graph.h"
#include "kvmanager/types.h"

namespace triax::manager {

enum class PressureMode : int { kDemoteFirst = 0, kGraphEvict = 1, kLru = 2 };
// "demote-first", "graph-evict", "lru"; INVALID_ARGUMENT naming the value.
absl::StatusOr<PressureMode> ParsePressureMode(absl::string_view name);
const char* PressureModeName(PressureMode mode);

// Values equal triax.v1.PressureAction.
enum class PressureAction : int {
  kUnspecified = 0,
  kDemote = 1,
  kSpillHost = 2,
  kSpillDisk = 3,
  kEvict = 4,
};

inline bool IsSpill(PressureAction a) {
  return a == PressureAction::kSpillHost || a == PressureAction::kSpillDisk;
}

// One demotion target of a tag for a sequence's shape.
struct DemoteOption {
  Encoding encoding;
  uint64_t bytes = 0;     // n_layers * PageBytes(encoding, shape)
  double distortion = 0;  // calibration D_tag(encoding), per token
};

// The options of one (calibration table, shape, tag): every calibrated
// encoding, sorted by bytes descending, and the tag's eviction distortion.
struct OptionSet {
  std::vector<DemoteOption> options;
  double evict_distortion = 0;  // per token
};

// One block as the ranker sees it. Filled by the manager core.
struct BlockView {
  uint64_t lineage_id = 0;
  uint32_t sequence = 0;  // index into PressureInput::sequences
  uint32_t index = 0;     // position in its sequence
  Tag tag;
  Tier tier = Tier::kDevice;  // where the pages are
  uint32_t tokens = 0;
  uint32_t refcount = 1;  // > 1: shared with a fork; never acted on
  bool sealed = true;     // false: still in the worker's BF16 window
  Encoding encoding;
  uint64_t bytes = 0;  // current bytes (n_layers pages)
  // Index into PressureInput::option_sets, or -1 when the block's sequence
  // has no calibration table (then DEMOTE is not offered and the eviction
  // distortion is default_evict_distortion).
  int32_t option_set = -1;
  double distortion = 0;  // D_tag(current encoding); 0 when unknown
  // From BlockGraph at snapshot time.
  double importance = 0;
  uint32_t hits = 0;
  int64_t last_access_ms = 0;
};

struct SequenceView {
  std::string sequence_id;
  uint32_t tenant = 0;         // index into PressureInput::tenants
  uint32_t worker = 0;         // index into PressureInput::workers
  int64_t last_access_ms = 0;  // last Attend report / Extend / Open
};

struct TenantView {
  std::string tenant_id;
  // Indexed by Tier value; ceiling 0 means unlimited.
  uint64_t floor[kNumTiers] = {};
  uint64_t ceiling[kNumTiers] = {};
  uint64_t used[kNumTiers] = {};
};

struct WorkerView {
  std::string worker_id;
  // Indexed by Tier value: capacity 0 means the tier is absent (no spills
  // to it).
  uint64_t capacity[kNumTiers] = {};
  uint64_t used[kNumTiers] = {};
};

struct PressureInput {
  int64_t now_ms = 0;
  std::vector<OptionSet> option_sets;
  std::vector<SequenceView> sequences;
  std::vector<TenantView> tenants;
  std::vector<WorkerView> workers;
  std::vector<BlockView> blocks;
};

struct RankerOptions {
  PressureMode mode = PressureMode::kDemoteFirst;
  // Roles never evicted (demote and spill still allowed).
  std::vector<Role> protected_roles = {Role::kSystem, Role::kToolSchema};
  double spill_host_penalty = 1e-3;  // distortion-equivalent per token
  double spill_disk_penalty = 4e-3;  //   of a restore, times reuse
  double reuse_half_life_ms = 30'000;
  double evict_factor = 4.0;  // x the tag's largest calibrated distortion
  double default_evict_distortion = 1.0;  // tags without a calibration
  double importance_weight = 1.0;  // weight = 1 + importance_weight * imp
  // Threads of one Rank (the caller plus threads - 1 started for the call),
  // 1..kMaxRankThreads; 1 is the single-threaded path. The ranking is the
  // same for every value (bit-identical pools, order and costs). Rank uses
  // at most one thread per parallel_min_blocks blocks (0: no such limit),
  // since starting a thread (~50 us) outweighs the work on small snapshots.
  int threads = 2;
  size_t parallel_min_blocks = 65536;
};
inline constexpr int kMaxRankThreads = 64;

// One ranked candidate. Fields ordered widest first (56 bytes, not 64:
// the gather writes one per candidate).
struct RankedAction {
  uint64_t lineage_id = 0;
  uint64_t bytes_freed = 0;
  // Quality lost per byte freed, after the graph weight and the tenant
  // overage divisor; kLru: the age now_ms - last access in ms (>= 0).
  double cost = 0;
  uint32_t block = 0;         // index into PressureInput::blocks
  uint32_t sequence = 0;      // index into PressureInput::sequences
  Tier from = Tier::kDevice;  // the tier whose bytes it frees
  Encoding encoding;          // kDemote: the target; otherwise default (unused)
  PressureAction action = PressureAction::kUnspecified;
  bool above_floor = false;  // the tenant is above its floor on `from`
};

// The ranking of one snapshot: per worker and tier, candidates in the order
// they should be taken. Immutable once built; the hot path reads it through
// a shared_ptr<const Ranking>.
struct Ranking {
  int64_t built_ms = 0;
  double ranking_ms = 0;  // wall time of Rank
  size_t blocks = 0;
  // pools[worker][tier]: tier 1 (device) and 2 (host; spills to disk or
  // evictions of host blocks).
  std::vector<std::vector<std::vector<RankedAction>>> pools;
};

// Ranks every block of `input` (O(blocks) plus a radix sort of each pool's
// candidates; see the top of the file). pools has one entry per worker,
// each kNumTiers vectors (TIER_UNSPECIFIED and TIER_DISK stay empty).
// INVALID_ARGUMENT, naming the field and the value, for: an out-of-range
// index (blocks[i].sequence, blocks[i].option_set, sequences[i].tenant,
// sequences[i].worker), blocks[i].tier not DEVICE/HOST/DISK, a negative or
// non-finite distortion, importance, option distortion or evict
// distortion, more than 65535 options in a set, more than 2^32 - 1
// blocks, and bad options (negative or non-finite penalties, factor or
// weight; reuse_half_life_ms <= 0; an unknown mode).
absl::StatusOr<Ranking> Rank(const PressureInput& input,
                             const RankerOptions& options);

// Working memory of Rank (about 64 bytes per block), kept between calls by
// a ranking thread so that each Rank does not page-fault fresh buffers.
// Thread contract: one Rank at a time per scratch. Rank itself starts up to
// threads - 1 std::threads per parallel pass and joins them before it
// returns (no thread outlives the call); they only read `input` and write
// disjoint parts of the scratch and of the new Ranking.
class RankScratch {
 public:
  RankScratch();
  ~RankScratch();
  RankScratch(const RankScratch&) = delete;
  RankScratch& operator=(const RankScratch&) = delete;

 private:
  friend absl::StatusOr<Ranking> Rank(const PressureInput& input,
                                      const RankerOptions& options,
                                      RankScratch* scratch);
  struct Buffers;
  std::unique_ptr<Buffers> buffers_;
};
// The same, reusing `scratch` (required, non-null).
absl::StatusOr<Ranking> Rank(const PressureInput& input,
                             const RankerOptions& options,
                             RankScratch* scratch);

// Picks, from ranking.pools[worker][tier], the shortest prefix of
// candidates whose bytes_freed sum to at least `bytes_needed`, skipping
// candidates for which `skip(action)` is true (e.g. blocks that changed
// since the snapshot, or of other tenants when reclaiming for a tenant's
// ceiling). Returns fewer bytes than needed when the pool cannot free
// enough (the caller reports the shortfall).
template <typename Skip>
std::vector<RankedAction> SelectReclaim(const Ranking& ranking, uint32_t worker,
                                        Tier tier, uint64_t bytes_needed,
                                        Skip skip) {
  std::vector<RankedAction> out;
  if (worker >= ranking.pools.size()) return out;
  const auto& by_tier = ranking.pools[worker];
  const int t = static_cast<int>(tier);
  if (t < 0 || static_cast<size_t>(t) >= by_tier.size()) return out;
  uint64_t freed = 0;
  for (const RankedAction& a : by_tier[t]) {
    if (freed >= bytes_needed) break;
    if (skip(a)) continue;
    out.push_back(a);
    freed += a.bytes_freed;
  }
  return out;
}

// Watermarks of a pool: above high, reclaim down to low.
struct Watermarks {
  double high = 0.90;  // fractions of capacity, 0 < low <= high <= 1
  double low = 0.80;
};
// INVALID_ARGUMENT naming the field and value unless 0 < low <= high <= 1.
absl::Status ValidateWatermarks(const Watermarks& w);
// Bytes to reclaim in a pool: used - floor(low * capacity) when used >
// high * capacity, else 0 (also 0 when capacity is 0).
uint64_t ReclaimTarget(const Watermarks& w, uint64_t capacity, uint64_t used);

}  // namespace triax::manager
