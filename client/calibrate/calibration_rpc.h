// Stores a calibration table with the manager and reads it back.
//
// PutAndVerify: PutCalibration(table), then GetCalibration(table.model) and
// a field-by-field comparison. Errors: the manager's status (e.g.
// INVALID_ARGUMENT for a table it rejects, UNIMPLEMENTED for a manager
// without calibration storage), prefixed "PutCalibration: " /
// "GetCalibration: "; DATA_LOSS when the table read back differs (the
// message names the first differing field) or the reply's entry count is
// not the table's.
// Thread contract: as client::Client (thread-safe).
#pragma once

#include "absl/status/status.h"
#include "client/kv_client.h"
#include "triax/v1/types.pb.h"

namespace triax::calibrate {

absl::Status PutAndVerify(client::Client* client,
                          const triax::v1::CalibrationTable& table);

}  // namespace triax::calibrate
