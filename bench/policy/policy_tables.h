// Helpers of policy_bench: ablated calibration tables, the raw
// per-(conversation, configuration) results and their shard files, and the
// session bootstrap. Uses the triax.v1 protobuf types (a bench, not a core
// library).
//
// Thread contract: free functions, no shared state; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "triax/v1/types.pb.h"

namespace triax::bench {

// The axis of the triaxial tag (temporal, modality, role) an ablation drops.
enum class TagAxis { kTemporal, kModality, kRole };
const char* TagAxisName(TagAxis a);  // "temporal", "modality", "role"

// A copy of `table` renamed to `model` (and its shape.name kept) in which the
// allocator cannot tell tags apart along `axis`: for every tag and encoding,
// the distortion becomes the token-weighted mean of that encoding's
// distortion over all tags that differ from it only in `axis` (entries with
// tokens == 0 weigh 1). Every original entry is kept (same tag, encoding,
// tokens, queries), only its distortion changes, so the allocator still sees
// every tag with the same options. `*groups_merged` (optional) receives the
// number of groups that merged two or more distinct tags (0: the ablation is
// vacuous on this table).
// Errors: INVALID_ARGUMENT for an empty `model` or a table without entries.
absl::StatusOr<v1::CalibrationTable> CollapseAxis(
    const v1::CalibrationTable& table, TagAxis axis, const std::string& model,
    int* groups_merged = nullptr);

// ---------------------------------------------------------------------------
// Raw results: one row per (conversation, configuration), the sums every
// statistic of the report is made from.

struct LayerErrSums {
  double sum_sq_diff = 0, sum_sq_ref = 0;
  int64_t queries = 0;
};

struct RawRow {
  std::string conversation;  // BFCL id
  std::string config;        // configuration name (no whitespace)
  std::string kind;          // "uniform", "triaxial" or "ablation"
  double budget = 0;         // budget_bits; 0 for uniform configurations
  uint32_t window = 0;       // BF16 residual window (tokens)
  // Next-token sums over predicted tokens (all) and over assistant +
  // tool-call tokens (answer); NLL in nats.
  int64_t count = 0;
  double nll_sum = 0;
  int64_t answer_count = 0;
  double answer_nll_sum = 0;
  double kl_sum = 0;  // KL(P_bf16 || P_cfg) summed over all predicted tokens
  int64_t top1_agree = 0;
  uint64_t plan_bytes = 0;        // Σ PageBytes(block encoding) × layers, end
  uint64_t worker_bytes = 0;      // kvworker used_bytes with only it open, end
  uint64_t seq_tokens = 0;        // tokens of the sequence
  uint32_t values_per_token = 0;  // 2 × layers × KV heads × head_dim
  std::map<std::string, uint64_t> tokens_by_encoding;  // final plan
  std::vector<LayerErrSums>
      attn;            // teacher-forced attention error; may be empty
  double seconds = 0;  // wall time of the run (not compared)
  std::string note;    // free text, no tabs or newlines
};

// A shard: the rows of one or more runs, the sessions they ran (id and a
// description) and the conversations that were skipped (id and reason).
struct RawShard {
  std::vector<std::pair<std::string, std::string>> sessions;
  std::vector<std::pair<std::string, std::string>> skipped;
  // Notes of the runs (key and text), e.g. the calibration table used.
  std::vector<std::pair<std::string, std::string>> notes;
  std::vector<RawRow> rows;
};

// The shard file (text, tab-separated):
//   "#session\t<id>\t<description>", "#skipped\t<id>\t<reason>" and
//   "#note\t<key>\t<text>" lines (a key is any non-empty text without a
//   tab);
//   other lines starting with '#' and empty lines are ignored;
//   the header line RawHeader(), then one line per row with the header's
//   fields: numbers in decimal (doubles with 17 significant digits),
//   tokens_by_encoding as "<label>:<tokens>" joined by ';', attn as
//   "<sum_sq_diff>/<sum_sq_ref>/<queries>" per layer joined by ';', "-" for
//   an empty map or list.
std::string RawHeader();
std::string FormatRaw(const RawShard& shard);

// Parses FormatRaw's text. INVALID_ARGUMENT naming `file` and the line
// number (1-based) for a missing or wrong header, a wrong field count, an
// unparsable or negative number, an unknown kind, an empty or whitespace
// name, or a text field with a tab.
absl::StatusOr<RawShard> ParseRaw(const std::string& text,
                                  const std::string& file);

// Merges shards: sessions, skipped conversations, notes (each distinct
// (key, text) once) and rows in first-seen order. A (conversation, config) pair
// or session seen twice is kept once when both copies agree (every field but
// seconds); INVALID_ARGUMENT naming both when they differ, or when one
// configuration name has two different kinds, budgets or windows. A
// conversation that one shard skipped and another ran counts as run.
absl::StatusOr<RawShard> MergeRaw(const std::vector<RawShard>& shards);

// ---------------------------------------------------------------------------
// Statistics over conversations.

// One conversation's contribution to a token-weighted mean: Σ num / Σ den.
struct RatioItem {
  double num = 0, den = 0;
};

struct Interval {
  double point = 0, lo = 0, hi = 0;
};

// The token-weighted mean Σ num / Σ den of `items` and its 95% percentile
// bootstrap interval over `resamples` resamples of the items with
// replacement (mt19937_64 seeded with `seed`; the i-th draw of a resample is
// item rng() % n). Calls with the same seed and the same number of items
// draw the same resamples, so intervals of several statistics over one list
// of conversations are paired. Percentiles interpolate linearly between
// order statistics; a resample whose Σ den is 0 is left out.
// Errors: INVALID_ARGUMENT for no items, resamples < 1, a non-finite value,
// a negative den, or Σ den == 0.
absl::StatusOr<Interval> BootstrapRatio(const std::vector<RatioItem>& items,
                                        int resamples, uint64_t seed);

// The statistic a report row or comparison is about.
enum class Metric { kAll, kAnswer };

// Per conversation (in `merged.rows` order, conversations that have a row of
// "bf16", of `config` and, when `minus` is not empty, of `minus`): ΔNLL sum
// of `config` against "bf16" (minus that of `minus`) over the metric's
// tokens, and the token count. INVALID_ARGUMENT when a row's counts differ
// from its conversation's bf16 row (the runs did not see the same tokens).
absl::StatusOr<std::vector<RatioItem>> DnllItems(const RawShard& merged,
                                                 const std::string& config,
                                                 const std::string& minus,
                                                 Metric metric);

// One uniform configuration against a triaxial point: the paired
// difference triaxial − uniform of ΔNLL (negative: the triaxial point is
// better) with its interval, on both metrics.
struct FrontierComparison {
  std::string uniform;
  double uniform_bytes_ratio = 0;  // its plan bytes / bf16's
  int conversations = 0;           // conversations both ran
  Interval diff_all, diff_answer;
};

struct FrontierVerdict {
  std::string triaxial;
  double bytes_ratio = 0;                       // plan bytes / bf16's
  std::vector<FrontierComparison> comparisons;  // uniform with <= bytes
  // Empty when on or below the frontier; else the names of the uniform
  // configurations better beyond the interval on all tokens
  // (dominated_all) or on answer tokens (dominated_answer).
  std::vector<std::string> dominated_all, dominated_answer;
  // "on or below the frontier" (with the uniform configurations shared on
  // fewer than two conversations named as undecided) or "dominated (...)".
  std::string Text() const;
};

// The frontier check of `triaxial`: every configuration of kind "uniform"
// (except "bf16") whose plan bytes, summed over the conversations both ran,
// are <= the triaxial point's over the same conversations. A uniform
// configuration dominates on a metric when the lower end of the paired
// interval of triaxial − uniform is > 0 (it is better beyond the interval)
// and the two share at least two conversations (with one, the interval is a
// point and says nothing about the spread; the comparison is listed but
// decides nothing).
// INVALID_ARGUMENT when `triaxial` has no row beside a bf16 row, or as
// DnllItems and BootstrapRatio.
absl::StatusOr<FrontierVerdict> CheckFrontier(const RawShard& merged,
                                              const std::string& triaxial,
                                              int resamples, uint64_t seed);

}  // namespace triax::bench
