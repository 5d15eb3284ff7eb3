// The pieces of pressure_replay (the BFCL replay under memory pressure)
// that need no server: which sessions to replay, the pool arithmetic, the
// round-robin order of turns, the per-mode tallies and the report table.
// Plain C++: no gRPC or protobuf.
//
// Thread contract: free functions are thread-safe; ModeResult is a plain
// value (thread-compatible).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace triax::bench::replay {

// The 8 BFCL multi_turn_base conversations the committed kvproxy-18m
// calibration table was measured on (bench/results/calibration.md); the
// replay refuses them so that quality is measured on unseen sessions.
const std::vector<std::string>& CalibrationIds();

// Parses `csv` (comma-separated BFCL ids) and keeps the first
// `max_sessions` (0: all). INVALID_ARGUMENT, naming `flag` and the value,
// for an empty list, an id that is not "multi_turn_base_<n>", a duplicate,
// or a calibration id.
absl::StatusOr<std::vector<std::string>> ParseSessionIds(
    const std::string& flag, const std::string& csv, int max_sessions);

// Device bytes of a sequence of `tokens` tokens held in BF16: whole blocks
// of `block_tokens` tokens, each `bf16_block_bytes` per layer, `n_layers`
// layers. 0 when any count is 0.
uint64_t Bf16PlanBytes(uint64_t tokens, uint32_t block_tokens,
                       uint64_t bf16_block_bytes, int n_layers);

// The device pool that holds `fraction` of `total_bytes` (the sessions'
// final KV in BF16): pool_mb = ceil(total * fraction / MiB), at least 1.
struct PoolSize {
  uint64_t total_bytes = 0;
  double fraction = 0;
  int pool_mb = 0;
  // "12 sessions, 22,118 tokens, BF16 final KV 135.9 MiB x 0.333 = 45.3 MiB
  // -> --pool_mb=46 (holds 33.9% of it)".
  std::string Explain(int sessions, uint64_t tokens) const;
};
// INVALID_ARGUMENT for total_bytes 0 or fraction outside (0, 1].
absl::StatusOr<PoolSize> SizePool(uint64_t total_bytes, double fraction);

// One step of the replay: turn `turn` of session `session`.
struct Step {
  int session = 0;
  int turn = 0;
  bool operator==(const Step& o) const {
    return session == o.session && turn == o.turn;
  }
};
// Round robin: turn 0 of every session in order, then turn 1 of every
// session that has one, and so on. `turns[i]` is session i's turn count.
std::vector<Step> RoundRobin(const std::vector<int>& turns);

// Rounds in which only some sessions are active: round 0 is turn 0 of every
// session (all arrive); in each later round every session with turns left
// is active with probability `active_fraction` (a fixed pseudo-random
// sequence from `seed`), and an active session plays its next turn; when
// no session would be active, the first with turns left is. A session is
// never idle more than `max_idle_rounds` rounds in a row. Sessions in a
// round go in index order. active_fraction 1 gives RoundRobin's order.
// INVALID_ARGUMENT for active_fraction outside (0, 1] or max_idle_rounds
// < 0.
absl::StatusOr<std::vector<Step>> IdleRounds(const std::vector<int>& turns,
                                             double active_fraction,
                                             uint32_t seed,
                                             int max_idle_rounds);

// A block of a sequence's plan, for BlockWeights.
struct BlockSpan {
  uint64_t lineage_id = 0;
  int64_t first_token = 0;
  int64_t num_tokens = 0;
  bool live = true;  // on some tier (not evicted)
};
// The live blocks and their share of `token_mass` (attention mass per token
// position, e.g. Fp32KvStore::TakeMass over a turn): each block's mass over
// its tokens divided by the live blocks' total (so the weights sum to 1 and
// lie in 0..1). Blocks beyond token_mass get 0. All weights 0 when the live
// blocks have no mass.
struct AccessReport {
  std::vector<uint64_t> lineage_ids;
  std::vector<float> weights;
};
AccessReport BlockWeights(const std::vector<BlockSpan>& blocks,
                          const std::vector<double>& token_mass);

// The local fp32 reference of one session, as pressure_replay computes it:
// the NLL of every focus token (NaN elsewhere) and, by turn, the attention
// mass the turn's queries put on each earlier token (empty when not
// tracked).
struct SessionReference {
  std::string id;
  std::vector<double> nll;
  std::vector<std::vector<double>> turn_mass;
};
// A text file of references (exact: every double printed round-trip), so
// that runs side by side compute them once. ReadReferences checks that the
// file holds `ids` in that order with the given token counts
// (FAILED_PRECONDITION naming the first difference; NOT_FOUND when the
// file is missing; DATA_LOSS when it does not parse).
absl::Status WriteReferences(const std::string& path,
                             const std::vector<SessionReference>& refs);
absl::StatusOr<std::vector<SessionReference>> ReadReferences(
    const std::string& path, const std::vector<std::string>& ids,
    const std::vector<size_t>& tokens);

// What one manager mode did to the replay.
struct ModeResult {
  std::string mode;    // --pressure_mode
  std::string policy;  // the sessions' policy
  int sessions = 0;
  int admitted = 0;             // Open succeeded (possibly after waiting)
  int admitted_after_wait = 0;  // ... only after a RESOURCE_EXHAUSTED
  int rejected_open = 0;        // RESOURCE_EXHAUSTED at Open, gave up
  int rejected_extend = 0;      // RESOURCE_EXHAUSTED at Extend, gave up
  // RESOURCE_EXHAUSTED bringing spilled blocks back before a later turn
  // (no device room to restore them), gave up.
  int rejected_resume = 0;
  int failed = 0;       // any other error ended the session
  int completed = 0;    // every turn replayed
  int turns = 0;        // turns replayed
  uint64_t tokens = 0;  // tokens prefilled through the service
  // Teacher-forced NLL of assistant/tool-call tokens, service minus the
  // session's local fp32 reference, summed; "late" only turns >= 1 (the
  // ones that see KV the pressure response touched).
  int64_t scored = 0, scored_late = 0;
  double dnll_sum = 0, dnll_late_sum = 0;
  // The manager's counters (GetPressure) and the worker's (Inventory).
  uint64_t demotions = 0, spills = 0, restores = 0, evictions = 0;
  uint64_t worker_spills = 0, worker_restores = 0, worker_evictions = 0;
  uint64_t checksum_failures = 0;
  uint64_t peak_device_bytes = 0;  // sampled worker pool bytes in use
  uint64_t pool_bytes = 0;         // the device pool
  uint64_t retry_waits = 0;  // Open/Extend retries after RESOURCE_EXHAUSTED
  // Blocks of the surviving sessions' final plans, by where they are /
  // their encoding ("evicted", "host", "disk", "bf16", "int4", ...).
  std::map<std::string, uint64_t> final_blocks;
  double seconds = 0;

  // ΔNLL sum and count by (session, turn), for comparing rows on the turns
  // every row replayed.
  std::map<std::pair<int, int>, std::pair<double, int64_t>> by_turn;

  // One scored token of turn `turn` (late: turn >= 1) of session `session`.
  void AddScore(int session, int turn, double service_nll,
                double reference_nll);
  double mean_dnll() const { return scored ? dnll_sum / scored : 0.0; }
  double mean_dnll_late() const {
    return scored_late ? dnll_late_sum / scored_late : 0.0;
  }
};

// Mean ΔNLL of each row over the (session, turn) pairs with turn >= 1 that
// every row scored, and how many tokens that is (the same in every row).
// NaN means when no later turn is common to all rows.
struct CommonTurns {
  int turns = 0;
  int64_t tokens = 0;
  std::vector<double> mean_dnll;  // by row
};
CommonTurns CommonLaterTurns(const std::vector<ModeResult>& results);

// The markdown results table, one row per mode (with the common-turns
// ΔNLL), and a second table with the final plans' block placement.
std::string ResultsTable(const std::vector<ModeResult>& results);

}  // namespace triax::bench::replay
