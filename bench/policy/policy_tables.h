// Helpers of policy_bench: ablated calibration tables and the "matched
// quality" lookup. Uses the triax.v1 protobuf types (a bench, not a core
// library).
//
// Thread contract: free functions, no shared state; thread-safe.
#pragma once

#include <optional>
#include <string>
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

// One point of the triaxial sweep: budget (effective bits) and its quality
// loss (ΔNLL vs BF16; smaller is better).
struct SweepPoint {
  double budget_bits = 0;
  double dnll = 0;
  double kv_bytes = 0;
};

// The point with the smallest budget_bits whose dnll <= `target_dnll`, or
// nullopt when none reaches it. Ties on budget: the first in `sweep`.
std::optional<SweepPoint> SmallestMatching(const std::vector<SweepPoint>& sweep,
                                           double target_dnll);

}  // namespace triax::bench
