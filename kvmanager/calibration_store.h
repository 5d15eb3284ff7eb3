// CalibrationStore: one calibration table per model id (PutCalibration /
// GetCalibration), validated and stored canonical, and the lookups of the
// table a sequence uses: its allocation policy's, or for the pressure
// ranking the one stored under the model's name.
//
// Validation (Build; INVALID_ARGUMENT naming the field and the value, e.g.
// `table.entries[2] encoding tq3 is invalid for table.block_tokens 16,
// n_kv_heads 2, head_dim 96: ...`): table.model an id; table.shape a valid
// model (ValidateModelShape, field "table.shape"); table.block_tokens in
// 1..kMaxBlockTokens; 1..kMaxCalibrationEntries entries; per entry temporal
// SINK..OLDER, a role, modality in range (UNSPECIFIED is stored as TEXT), a
// valid encoding that is valid for {block_tokens, n_kv_heads, head_dim},
// distortion finite and >= 0; no two entries with the same tag and
// canonical encoding. Entries are stored canonical (SpecOf), the source
// exactly as given.
//
// Error codes: INVALID_ARGUMENT (above), RESOURCE_EXHAUSTED (past
// kMaxCalibrationModels models), NOT_FOUND (no table for the model),
// FAILED_PRECONDITION (an allocation policy's table missing or measured on
// another shape).
//
// Thread contract: Build is pure (ManagerCore runs it before taking its
// lock); the rest is not thread-safe and is called with ManagerCore::mu_
// held. Stored tables are immutable and shared (shared_ptr<const>).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/policy.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr size_t kMaxCalibrationEntries = 4096;
inline constexpr size_t kMaxCalibrationModels = 1024;

class CalibrationStore {
 public:
  // See "Validation" above.
  static absl::StatusOr<std::shared_ptr<const CalibrationTable>> Build(
      const CalibrationTableInfo& table);

  // Stores (replaces) the table of table->info.model; returns the number of
  // entries.
  absl::StatusOr<uint32_t> Put(std::shared_ptr<const CalibrationTable> table);
  // NOT_FOUND naming the model ("... has no calibration table;
  // PutCalibration it").
  absl::StatusOr<std::shared_ptr<const CalibrationTable>> Get(
      const std::string& model) const;
  // The table allocation policy `policy` needs for a sequence of `model`:
  // FAILED_PRECONDITION when it is not stored or its shape (n_layers,
  // n_kv_heads, n_q_heads, head_dim) differs from the model's.
  absl::StatusOr<std::shared_ptr<const CalibrationTable>> ForPolicy(
      const Policy& policy, const ModelShape& model) const;
  // The table stored under model.name when its shape matches; nullptr
  // otherwise.
  const std::shared_ptr<const CalibrationTable>* ForModel(
      const ModelShape& model) const;
  size_t size() const { return tables_.size(); }
  // The tables by model (snapshots).
  const auto& all() const { return tables_; }

 private:
  absl::flat_hash_map<std::string, std::shared_ptr<const CalibrationTable>>
      tables_;
};

}  // namespace triax::manager
