// The prediction check of calibration tables (calibration_validate): how
// well a table's additive model, predicted(A) = mean over positions of
// sum_k share_k(p) * D_k(A(k)), tracks the measured effect of whole
// allocations A (output_calibration.h passes with a per-tag encoding map).
//
// Measured per allocation, pooled over conversations: mean KL(ref || A) and
// mean dNLL over all predicted positions and over answer positions.
// Predicted per table: the additive sum with `distortion` (all positions),
// `distortion_answer` (answer positions; `distortion` for tables without
// the output metric), and, for output tables, `dnll` / `dnll_answer`.
// A table of the attention metric predicts in attention-error units: only
// its rank correlation with the measured effects is comparable.
//
// Thread contract: TablePredictor is immutable after Create (share freely);
// MeasureAllocations runs its passes on its own threads.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/calibrate/output_calibration.h"
#include "triax/v1/types.pb.h"

namespace triax::calibrate {

// Sums over positions (divide by the position counts for means).
struct EffectSums {
  double kl = 0, kl_answer = 0, dnll = 0, dnll_answer = 0;
  int64_t positions = 0, answer_positions = 0;
  void Add(const EffectSums& o);
  double Mean(double sum, bool answer) const;
};

class TablePredictor {
 public:
  // INVALID_ARGUMENT when the table fails ValidateTable or its block_tokens
  // is not `block_tokens` (the message names the table).
  static absl::StatusOr<TablePredictor> Create(
      const triax::v1::CalibrationTable& table, const std::string& name,
      int block_tokens);

  // Predicted sums over `conv`'s positions for `alloc`; (tag, encoding)
  // pairs present in the conversation but not in the table count 0 and are
  // counted in *missing.
  EffectSums Predict(const OutputConversation& conv, const Allocation& alloc,
                     int64_t* missing) const;

  const std::string& name() const { return name_; }
  bool output_metric() const { return output_metric_; }

 private:
  struct Values {
    double kl = 0, kl_answer = 0, dnll = 0, dnll_answer = 0;
  };
  std::string name_;
  bool output_metric_ = false;
  std::map<std::pair<Tag, std::string>, Values> values_;  // by encoding name
};

// A named allocation to measure.
struct NamedAllocation {
  std::string name;
  Allocation alloc;
};

// "uniform <enc>" for every encoding, then `random` allocations that give
// each of `tags` an encoding drawn uniformly from `encodings` (seeded).
std::vector<NamedAllocation> CheckAllocations(
    const std::vector<Tag>& tags,
    const std::vector<kernels::Encoding>& encodings, int random, uint64_t seed);

// Measured sums per allocation (index as `allocs`), pooled over `convs`:
// one reference pass per conversation, then one pass per (allocation,
// conversation) on `threads` threads. `progress(line)` gets one line per
// pass. INVALID_ARGUMENT for threads outside 1..64.
absl::StatusOr<std::vector<EffectSums>> MeasureAllocations(
    const frontend::Model& model, const std::vector<OutputConversation>& convs,
    const std::vector<NamedAllocation>& allocs, int threads,
    const std::function<void(const std::string&)>& progress);

// Spearman rank correlation (ties get their mean rank); 0 when either side
// is constant or fewer than 2 values are given.
double Spearman(const std::vector<double>& x, const std::vector<double>& y);

// The Markdown report: one row per allocation (measured means and each
// table's predictions), then per table the rank correlations of its
// prediction with measured KL and dNLL (all and answer positions) and the
// mean absolute and relative error of the prediction against the measured
// value of the same kind (KL for distortion, dNLL for dnll).
std::string PredictionReport(
    const std::vector<NamedAllocation>& allocs,
    const std::vector<EffectSums>& measured,
    const std::vector<TablePredictor>& tables,
    const std::vector<std::vector<EffectSums>>& predicted);  // [table][alloc]

}  // namespace triax::calibrate
