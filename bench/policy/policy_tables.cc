#include "bench/policy/policy_tables.h"

#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace triax::bench {
namespace {

// (encoding, tag with `axis` cleared): the merge key.
using Key = std::tuple<int, int, uint32_t, int, int, int, int>;

Key MergeKey(const v1::CalibrationEntry& e, TagAxis axis) {
  int temporal = e.tag().temporal(), modality = e.tag().modality(),
      role = e.tag().role();
  switch (axis) {
    case TagAxis::kTemporal:
      temporal = -1;
      break;
    case TagAxis::kModality:
      modality = -1;
      break;
    case TagAxis::kRole:
      role = -1;
      break;
  }
  return {e.format(), e.format_v(), e.group_size(), e.scale_dtype(), temporal,
          modality,   role};
}

}  // namespace

const char* TagAxisName(TagAxis a) {
  switch (a) {
    case TagAxis::kTemporal:
      return "temporal";
    case TagAxis::kModality:
      return "modality";
    case TagAxis::kRole:
      return "role";
  }
  return "?";
}

absl::StatusOr<v1::CalibrationTable> CollapseAxis(
    const v1::CalibrationTable& table, TagAxis axis, const std::string& model,
    int* groups_merged) {
  if (model.empty()) {
    return absl::InvalidArgumentError("CollapseAxis: model is empty");
  }
  if (table.entries_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CollapseAxis: table of model \"", table.model(), "\" has no entries"));
  }
  struct Acc {
    double weighted = 0, weight = 0;
    std::set<std::tuple<int, int, int>> tags;
  };
  std::map<Key, Acc> acc;
  for (const auto& e : table.entries()) {
    Acc& a = acc[MergeKey(e, axis)];
    const double w = e.tokens() > 0 ? static_cast<double>(e.tokens()) : 1.0;
    a.weighted += w * e.distortion();
    a.weight += w;
    a.tags.insert({e.tag().temporal(), e.tag().modality(), e.tag().role()});
  }
  v1::CalibrationTable out = table;
  out.set_model(model);
  for (auto& e : *out.mutable_entries()) {
    const Acc& a = acc[MergeKey(e, axis)];
    e.set_distortion(a.weighted / a.weight);
  }
  if (groups_merged != nullptr) {
    // Count merge groups per tag set (not per encoding).
    std::set<std::set<std::tuple<int, int, int>>> merged;
    for (const auto& [key, a] : acc) {
      if (a.tags.size() > 1) merged.insert(a.tags);
    }
    *groups_merged = static_cast<int>(merged.size());
  }
  return out;
}

std::optional<SweepPoint> SmallestMatching(const std::vector<SweepPoint>& sweep,
                                           double target_dnll) {
  std::optional<SweepPoint> best;
  for (const SweepPoint& p : sweep) {
    if (p.dnll > target_dnll) continue;
    if (!best || p.budget_bits < best->budget_bits) best = p;
  }
  return best;
}

}  // namespace triax::bench
