#include "kvmanager/calibration_store.h"

#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::manager {

absl::StatusOr<std::shared_ptr<const CalibrationTable>> CalibrationStore::Build(
    const CalibrationTableInfo& t) {
  TRIAX_RETURN_IF_ERROR(ValidateId("table.model", t.model));
  TRIAX_RETURN_IF_ERROR(ValidateModelShape(t.shape, "table.shape"));
  if (t.block_tokens < 1 || t.block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.block_tokens ", t.block_tokens, " is outside 1..",
                     kMaxBlockTokens));
  }
  if (t.entries.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.entries is empty (model ", Quote(t.model),
                     "); a calibration table needs at least one entry"));
  }
  if (t.entries.size() > kMaxCalibrationEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.entries has ", t.entries.size(),
                     " entries; the limit is ", kMaxCalibrationEntries));
  }
  auto table = std::make_shared<CalibrationTable>();
  table->info.model = t.model;
  table->info.shape = t.shape;
  table->info.block_tokens = t.block_tokens;
  table->info.source = t.source;
  table->info.entries.reserve(t.entries.size());
  table->encodings.reserve(t.entries.size());
  const kernels::PageShape shape = PageShapeOf(t.shape, t.block_tokens);
  std::map<std::pair<int, std::string>, size_t> seen;
  for (size_t i = 0; i < t.entries.size(); ++i) {
    const CalibrationEntryInfo& in = t.entries[i];
    const std::string field = absl::StrCat("table.entries[", i, "]");
    const int temporal = static_cast<int>(in.tag.temporal);
    if (temporal < 1 || temporal > static_cast<int>(Temporal::kOlder)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".tag.temporal is ", TemporalName(in.tag.temporal),
          "; a temporal class SINK..OLDER is required"));
    }
    if (!IsValid(in.tag.role)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".tag.role is ",
                                                     RoleName(in.tag.role),
                                                     "; a role is required"));
    }
    if (!IsValid(in.tag.modality)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".tag.modality is ",
                       ModalityName(in.tag.modality), "; out of range"));
    }
    TRIAX_ASSIGN_OR_RETURN(const Encoding e,
                           ResolveEncoding(field, in.encoding));
    if (const char* why = kernels::ValidateEncoding(e, shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " encoding ", EncodingString(e), " is invalid for ",
          "table.block_tokens ", t.block_tokens, ", n_kv_heads ",
          t.shape.n_kv_heads, ", head_dim ", t.shape.head_dim, ": ", why));
    }
    if (!std::isfinite(in.distortion) || in.distortion < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".distortion is ", in.distortion,
                       "; it must be finite and >= 0"));
    }
    if (!std::isfinite(in.distortion_answer) || in.distortion_answer < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".distortion_answer is ", in.distortion_answer,
                       "; it must be finite and >= 0"));
    }
    if (!std::isfinite(in.dnll) || !std::isfinite(in.dnll_answer)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dnll / dnll_answer are ", in.dnll, " / ",
                       in.dnll_answer, "; they must be finite"));
    }
    CalibrationEntryInfo entry = in;
    entry.tag.modality = NormalizeModality(in.tag.modality);
    entry.encoding = SpecOf(e);
    const auto key = std::make_pair(TagKey(entry.tag), EncodingString(e));
    auto [dup, fresh] = seen.emplace(key, i);
    if (!fresh) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " repeats table.entries[", dup->second, "]: tag ",
          TemporalName(entry.tag.temporal), "/",
          ModalityName(entry.tag.modality), "/", RoleName(entry.tag.role),
          " encoding ", EncodingString(e)));
    }
    table->info.entries.push_back(entry);
    table->encodings.push_back(e);
  }
  return table;
}

absl::StatusOr<uint32_t> CalibrationStore::Put(
    std::shared_ptr<const CalibrationTable> table) {
  const std::string& model = table->info.model;
  if (!tables_.contains(model) && tables_.size() >= kMaxCalibrationModels) {
    return absl::ResourceExhaustedError(
        absl::StrCat("table.model ", Quote(model),
                     " would be calibrated model number ", tables_.size() + 1,
                     "; the limit is ", kMaxCalibrationModels, "; over by 1"));
  }
  const uint32_t n = static_cast<uint32_t>(table->info.entries.size());
  const std::string key = model;
  tables_[key] = std::move(table);
  return n;
}

absl::StatusOr<std::shared_ptr<const CalibrationTable>> CalibrationStore::Get(
    const std::string& model) const {
  auto it = tables_.find(model);
  if (it == tables_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model ", Quote(model),
                     " has no calibration table; PutCalibration it"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<const CalibrationTable>>
CalibrationStore::ForPolicy(const Policy& policy,
                            const ModelShape& model) const {
  auto it = tables_.find(policy.calibration_model);
  if (it == tables_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy ", Quote(policy.name), " needs the calibration table of ",
        "model ", Quote(policy.calibration_model),
        ", which is not stored; PutCalibration it first"));
  }
  const ModelShape& cm = it->second->info.shape;
  if (!SameShape(cm, model)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy ", Quote(policy.name), ": calibration ",
        Quote(policy.calibration_model), " was measured on n_layers ",
        cm.n_layers, ", n_kv_heads ", cm.n_kv_heads, ", n_q_heads ",
        cm.n_q_heads, ", head_dim ", cm.head_dim, "; the model has n_layers ",
        model.n_layers, ", n_kv_heads ", model.n_kv_heads, ", n_q_heads ",
        model.n_q_heads, ", head_dim ", model.head_dim));
  }
  return it->second;
}

const std::shared_ptr<const CalibrationTable>* CalibrationStore::ForModel(
    const ModelShape& model) const {
  auto it = tables_.find(model.name);
  if (it == tables_.end() || !SameShape(it->second->info.shape, model)) {
    return nullptr;
  }
  return &it->second;
}

}  // namespace triax::manager
