// Integration: a CalibrationTable built by kvcalibrate's code is stored by a
// real kvmanager (PutCalibration) and read back unchanged (GetCalibration).
#include <memory>
#include <string>
#include <vector>

#include "client/calibrate/calibration_proto.h"
#include "client/calibrate/calibration_rpc.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/process.h"

namespace triax::calibrate {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

v1::CalibrationTable MakeTable() {
  TableMeta m;
  m.model = "kvproxy-18m";
  m.shape.set_name("kvproxy-18m");
  m.shape.set_n_layers(6);
  m.shape.set_n_kv_heads(2);
  m.shape.set_n_q_heads(4);
  m.shape.set_head_dim(128);
  m.block_tokens = 16;
  m.source.set_tool("kvcalibrate test");
  m.source.set_model_file("model.bin sha256:00");
  m.source.set_dataset("BFCL v4 multi_turn_base");
  m.source.add_calibration_ids("multi_turn_base_1");
  for (const std::string& id : HeldOutIds()) m.source.add_held_out_ids(id);
  m.source.set_metric(MetricDescription(8, 64, 2));
  m.source.set_created_unix_ms(1700000000000);
  std::vector<CalibrationResultEntry> es;
  double d = 0;
  for (Role role : {Role::kSystem, Role::kToolSchema, Role::kDelimiter}) {
    for (const kernels::Encoding& e : DefaultEncodings()) {
      CalibrationResultEntry r;
      r.tag = Tag{Temporal::kOlder, Modality::kText, role};
      r.encoding = e;
      r.distortion = e == kernels::Encoding(kernels::Format::kBF16) ? 0 : d;
      d += 0.125;
      r.tokens = 100;
      r.queries = 10;
      es.push_back(r);
    }
  }
  auto t = BuildTable(m, es);
  EXPECT_THAT(t.status(), IsOk());
  return *t;
}

TEST(CalibrationManagerTest, PutCalibrationRoundTrips) {
  auto dir = testing::TempDir::Create("kvcalibrate");
  ASSERT_THAT(dir.status(), IsOk());
  auto manager = testing::Process::Start(
      "kvmanager", "kvmanager",
      {"--listen=127.0.0.1:0",
       "--metadata=file:" + (*dir)->path() + "/metadata"},
      (*dir)->path());
  ASSERT_THAT(manager.status(), IsOk());
  client::ClientOptions o;
  o.manager_address = (*manager)->address();
  o.rpc_timeout_ms = 5000;
  auto c = client::Client::Connect(o);
  ASSERT_THAT(c.status(), IsOk());
  const v1::CalibrationTable table = MakeTable();
  EXPECT_THAT(PutAndVerify(c->get(), table), IsOk());
  // A second table replaces the first.
  v1::CalibrationTable second = table;
  second.mutable_entries(1)->set_distortion(42);
  EXPECT_THAT(PutAndVerify(c->get(), second), IsOk());
  // An output-metric table: distortion_answer, dnll and dnll_answer (dNLL
  // may be negative) come back as stored.
  v1::CalibrationTable output = table;
  output.mutable_source()->set_metric(OutputMetricDescription(64, 2));
  for (int i = 0; i < output.entries_size(); ++i) {
    v1::CalibrationEntry* e = output.mutable_entries(i);
    if (e->distortion() == 0) continue;
    e->set_distortion_answer(2 * e->distortion());
    e->set_dnll(-0.25 * e->distortion());
    e->set_dnll_answer(0.5 * e->distortion());
  }
  EXPECT_THAT(PutAndVerify(c->get(), output), IsOk());
  // The manager's own validation comes back with the call named.
  v1::CalibrationTable empty = table;
  empty.clear_entries();
  EXPECT_THAT(PutAndVerify(c->get(), empty),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("PutCalibration: table.entries is empty")));
}

}  // namespace
}  // namespace triax::calibrate
