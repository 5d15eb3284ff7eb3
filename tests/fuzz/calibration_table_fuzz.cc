// Fuzz target: the calibration-table readers. The bytes after the first are
// a table file (kvcalibrate's output, client/calibrate/calibration_proto.h):
// text format when data[0] is odd (a .txtpb), binary otherwise. The file is
// read with ReadTableFile and checked with ValidateTable; a valid table is
// rendered (MarkdownTable) and joined with itself (UnionTables). Whatever
// parses is also put into a ManagerCore (PutCalibration through
// kvmanager/convert.h, as the service does; the core validates on its own)
// and read back. Refusals must be INVALID_ARGUMENT (or RESOURCE_EXHAUSTED /
// NOT_FOUND where documented) with a message, and a table the manager
// stored must be found again.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "client/calibrate/calibration_proto.h"
#include "common/clock.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_core.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

const std::string& TableDir() {
  static const std::string* dir = [] {
    std::string tmpl = "/tmp/triax-fuzz-calibration-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    return new std::string(tmpl);
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using triax::fuzz::FuzzCheck;
  if (size < 1) return 0;
  const bool text = data[0] & 1;
  const std::string path =
      TableDir() + (text ? "/table.txtpb" : "/table.binpb");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data + 1),
              static_cast<std::streamsize>(size - 1));
    if (!out.good()) std::abort();
  }
  auto table = triax::calibrate::ReadTableFile(path);
  FuzzCheck(table, "ReadTableFile");
  if (!table.ok()) return 0;

  const absl::Status valid = triax::calibrate::ValidateTable(*table);
  FuzzCheck(valid, "ValidateTable");
  if (valid.ok()) {
    (void)triax::calibrate::MarkdownTable(*table);
    FuzzCheck(triax::calibrate::UnionTables({*table, *table}), "UnionTables");
  }

  triax::FakeClock clock;
  auto core = triax::manager::ManagerCore::Create({}, &clock);
  if (!core.ok()) triax::fuzz::FuzzFail("Create", core.status(), "setup");
  triax::v1::PutCalibrationRequest put;
  *put.mutable_table() = *table;
  auto stored = (*core)->PutCalibration(triax::manager::FromProto(put));
  FuzzCheck(stored, "PutCalibration");
  if (stored.ok()) {
    auto got = (*core)->GetCalibration(table->model());
    FuzzCheck(got, "GetCalibration");
    if (!got.ok()) {
      triax::fuzz::FuzzFail("GetCalibration", got.status(),
                            "a stored table is not found");
    }
    triax::v1::CalibrationTable back;
    triax::manager::ToProto(*got, &back);
  }
  return 0;
}
