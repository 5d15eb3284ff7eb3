#include "bench/policy/policy_tables.h"

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax::bench {
namespace {

using ::testing::DoubleNear;
using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

v1::CalibrationEntry Entry(v1::Temporal t, v1::Role r, v1::Format f,
                           double distortion, uint64_t tokens) {
  v1::CalibrationEntry e;
  e.mutable_tag()->set_temporal(t);
  e.mutable_tag()->set_modality(v1::MODALITY_TEXT);
  e.mutable_tag()->set_role(r);
  e.set_format(f);
  e.set_format_v(f);
  e.set_distortion(distortion);
  e.set_tokens(tokens);
  return e;
}

v1::CalibrationTable Table() {
  v1::CalibrationTable t;
  t.set_model("m");
  // user: current 0.1 (100 tokens), older 0.4 (300 tokens) at int4.
  *t.add_entries() = Entry(v1::TEMPORAL_CURRENT_TURN, v1::ROLE_USER,
                           v1::FORMAT_INT4, 0.1, 100);
  *t.add_entries() =
      Entry(v1::TEMPORAL_OLDER, v1::ROLE_USER, v1::FORMAT_INT4, 0.4, 300);
  // user at int2: only current.
  *t.add_entries() = Entry(v1::TEMPORAL_CURRENT_TURN, v1::ROLE_USER,
                           v1::FORMAT_INT2, 0.9, 100);
  // tool call, current, int4.
  *t.add_entries() = Entry(v1::TEMPORAL_CURRENT_TURN, v1::ROLE_TOOL_CALL,
                           v1::FORMAT_INT4, 0.5, 100);
  return t;
}

TEST(CollapseAxisTest, TemporalAveragesOverTemporalClassesByTokens) {
  int merged = -1;
  auto out =
      CollapseAxis(Table(), TagAxis::kTemporal, "m-no-temporal", &merged);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->model(), "m-no-temporal");
  ASSERT_EQ(out->entries_size(), 4);
  // (0.1*100 + 0.4*300) / 400 = 0.325 for both user int4 entries.
  EXPECT_THAT(out->entries(0).distortion(), DoubleNear(0.325, 1e-12));
  EXPECT_THAT(out->entries(1).distortion(), DoubleNear(0.325, 1e-12));
  EXPECT_THAT(out->entries(2).distortion(), DoubleNear(0.9, 1e-12));
  EXPECT_THAT(out->entries(3).distortion(), DoubleNear(0.5, 1e-12));
  EXPECT_EQ(out->entries(1).tag().temporal(), v1::TEMPORAL_OLDER);
  EXPECT_EQ(merged, 1);
}

TEST(CollapseAxisTest, RoleAveragesOverRoles) {
  auto out = CollapseAxis(Table(), TagAxis::kRole, "m-no-role");
  ASSERT_TRUE(out.ok()) << out.status();
  // current int4: user 0.1 and tool call 0.5, 100 tokens each.
  EXPECT_THAT(out->entries(0).distortion(), DoubleNear(0.3, 1e-12));
  EXPECT_THAT(out->entries(3).distortion(), DoubleNear(0.3, 1e-12));
  EXPECT_THAT(out->entries(1).distortion(), DoubleNear(0.4, 1e-12));
}

TEST(CollapseAxisTest, ModalityIsVacuousOnTextOnlyTable) {
  int merged = -1;
  auto out = CollapseAxis(Table(), TagAxis::kModality, "m-no-mod", &merged);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(merged, 0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(out->entries(i).distortion(), Table().entries(i).distortion());
  }
}

TEST(CollapseAxisTest, RejectsBadInput) {
  EXPECT_THAT(
      CollapseAxis(Table(), TagAxis::kRole, ""),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CollapseAxis")));
  EXPECT_THAT(
      CollapseAxis(v1::CalibrationTable(), TagAxis::kRole, "x"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CollapseAxis")));
}

TEST(SmallestMatchingTest, PicksSmallestBudgetWithinTarget) {
  std::vector<SweepPoint> s = {
      {2.5, 0.30, 1}, {3, 0.10, 2}, {3.5, 0.05, 3}, {4, 0.12, 4}};
  auto p = SmallestMatching(s, 0.11);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->budget_bits, 3);
  EXPECT_FALSE(SmallestMatching(s, 0.01).has_value());
  EXPECT_EQ(SmallestMatching(s, 1.0)->budget_bits, 2.5);
}

}  // namespace
}  // namespace triax::bench
