// kvcalibrate and calibration_validate refuse bad flags with exit code 2
// and a message naming the flag and the value, before loading any data.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/process.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;

struct Outcome {
  int rc = -1;
  std::string out, err;
};

Outcome RunBinary(const std::string& binary,
                  const std::vector<std::string>& args) {
  Outcome r;
  auto dir = TempDir::Create("calibrate_flags");
  EXPECT_TRUE(dir.ok()) << dir.status();
  if (!dir.ok()) return r;
  auto rc = RunToCompletion(binary, args, (*dir)->path(), &r.out, &r.err,
                            absl::Seconds(30));
  EXPECT_TRUE(rc.ok()) << rc.status();
  if (rc.ok()) r.rc = *rc;
  return r;
}

TEST(CalibrateFlagsTest, KvcalibrateRefusesUnknownMetricAndHeldOutIds) {
  Outcome r = RunBinary("kvcalibrate", {"--metric=kl"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--metric \"kl\" is not attention or output"));
  r = RunBinary("kvcalibrate", {"--metric=output", "--output_chunk=0"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--output_chunk 0 is outside 1..256"));
  r = RunBinary("kvcalibrate", {"--metric=output",
                                "--ids=multi_turn_base_1,multi_turn_base_3"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("\"multi_turn_base_3\" is held out"));
  // --model is a directory name under models/, not a path.
  r = RunBinary("kvcalibrate", {"--model=../etc"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--model"));
  EXPECT_THAT(r.err, HasSubstr("../etc"));
  r = RunBinary("kvcalibrate", {"--union_tables=a.txtpb,b.txtpb"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--union_tables needs --out"));
  r = RunBinary("kvcalibrate", {"--encodings=tq4;int5"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--encodings: \"int5\" is not an encoding"));
  // Sums files belong to the output metric only.
  r = RunBinary("kvcalibrate", {"--sums_out=x.sums"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("--sums_out and --merge_sums need --metric=output"));
  r = RunBinary("kvcalibrate", {"--merge_sums=a.sums", "--ids="});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("--sums_out and --merge_sums need --metric=output"));
  // Without --merge_sums an empty --ids is refused as before.
  r = RunBinary("kvcalibrate", {"--metric=output", "--ids="});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--ids is empty"));
}

TEST(CalibrateFlagsTest, CalibrationValidateRefusesBadValues) {
  Outcome r = RunBinary("calibration_validate", {"--validate=-1"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--validate -1 must be >= 0"));
  r = RunBinary("calibration_validate", {"--threads=0"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--threads 0 is outside 1..64"));
  r = RunBinary("calibration_validate", {"--tables="});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--tables is empty"));
  r = RunBinary("calibration_validate", {"--model=a/b"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--model"));
  r = RunBinary("calibration_validate", {"--chunk=300"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--chunk 300 is outside 1..256"));
}

}  // namespace
}  // namespace triax::testing
