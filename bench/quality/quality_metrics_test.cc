#include "bench/quality/quality_metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <regex>
#include <set>

#include "common/status_matchers.h"

namespace triax::bench {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

TEST(QualityMetricsTest, KlOfIdenticalIsZeroAndOfKnownPairMatches) {
  const float p[3] = {1.0f, 2.0f, 0.5f};
  EXPECT_NEAR(KlDivergence(p, p, 3), 0.0, 1e-12);
  // Shifting all logits does not change the distribution.
  const float p_shift[3] = {11.0f, 12.0f, 10.5f};
  EXPECT_NEAR(KlDivergence(p, p_shift, 3), 0.0, 1e-12);
  // Two outcomes: P = (0.5, 0.5), Q = (e/(1+e), 1/(1+e)).
  const float a[2] = {0.0f, 0.0f};
  const float b[2] = {1.0f, 0.0f};
  const double q0 = std::exp(1.0) / (1.0 + std::exp(1.0));
  const double want = 0.5 * std::log(0.5 / q0) + 0.5 * std::log(0.5 / (1 - q0));
  EXPECT_NEAR(KlDivergence(a, b, 2), want, 1e-7);
  EXPECT_GT(KlDivergence(a, b, 2), 0.0);
}

TEST(QualityMetricsTest, AddSequenceEqualsAddPerPosition) {
  // Three tokens, vocab 3: rows 0 and 1 predict tokens 1 and 2.
  const std::vector<float> ref = {3.0f, 1.0f, 0.0f, 0.0f, 2.0f, 1.0f};
  const std::vector<float> mine = {0.0f, 1.0f, 3.0f, 0.5f, 2.0f, 1.0f};
  const std::vector<int> tokens = {2, 0, 1};
  const std::vector<bool> focus = {true, false, true};
  NextTokenStats seq, one;
  ASSERT_TRUE(seq.AddSequence(ref, mine, 3, tokens, focus).ok());
  one.Add(&ref[0], &mine[0], 3, 0, false);
  one.Add(&ref[3], &mine[3], 3, 1, true);
  EXPECT_EQ(seq.count, 2);
  EXPECT_EQ(seq.focus_count, 1);
  EXPECT_DOUBLE_EQ(seq.nll_sum, one.nll_sum);
  EXPECT_DOUBLE_EQ(seq.kl_sum, one.kl_sum);
  EXPECT_EQ(seq.top1_agree, one.top1_agree);
  EXPECT_DOUBLE_EQ(seq.focus_nll_sum, one.focus_nll_sum);
}

TEST(QualityMetricsTest, AddSequenceRejectsBadShapes) {
  const std::vector<float> rows(6, 0.0f);
  NextTokenStats s;
  EXPECT_THAT(s.AddSequence(rows, rows, 3, {0, 1, 2}, {false, false}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("focus has 2 entries")));
  EXPECT_THAT(
      s.AddSequence(rows, {0.0f}, 3, {0, 1, 2}, {false, false, false}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("need 6")));
  EXPECT_THAT(
      s.AddSequence(rows, rows, 3, {0, 1, 7}, {false, false, false}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens[2]=7")));
  EXPECT_THAT(
      s.AddSequence(rows, rows, 0, {0, 1}, {false, false}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab=0")));
  EXPECT_EQ(s.count, 0);
}

TEST(QualityMetricsTest, NextTokenStatsAccumulates) {
  const float ref[3] = {3.0f, 1.0f, 0.0f};
  const float same[3] = {3.0f, 1.0f, 0.0f};
  const float other[3] = {0.0f, 1.0f, 3.0f};
  NextTokenStats s;
  s.Add(ref, same, 3, /*target=*/0, /*focus=*/false);
  s.Add(ref, other, 3, /*target=*/0, /*focus=*/true);
  EXPECT_EQ(s.count, 2);
  EXPECT_EQ(s.top1_agree, 1);
  EXPECT_DOUBLE_EQ(s.top1(), 0.5);
  const double lse = std::log(std::exp(3.0) + std::exp(1.0) + 1.0);
  EXPECT_NEAR(s.nll(), ((lse - 3.0) + (lse - 0.0)) / 2, 1e-6);
  EXPECT_EQ(s.focus_count, 1);
  EXPECT_NEAR(s.focus_nll(), lse, 1e-6);
  EXPECT_NEAR(s.kl(), KlDivergence(ref, other, 3) / 2, 1e-12);
  NextTokenStats t;
  t.Merge(s);
  t.Merge(s);
  EXPECT_EQ(t.count, 4);
  EXPECT_NEAR(t.nll(), s.nll(), 1e-12);
  EXPECT_EQ(NextTokenStats().nll(), 0.0);
}

TEST(QualityMetricsTest, BitsPerValue) {
  // 16 tokens, 2 layers, 2 heads, head_dim 8, BF16: 2 bytes per value.
  const uint64_t values = 2ull * 16 * 2 * 2 * 8;
  EXPECT_DOUBLE_EQ(BitsPerValue(values * 2, 16, 2, 2, 8), 16.0);
  EXPECT_DOUBLE_EQ(BitsPerValue(values / 2, 16, 2, 2, 8), 4.0);
  EXPECT_EQ(BitsPerValue(100, 0, 2, 2, 8), 0.0);
}

TEST(QualityMetricsTest, ConfigsAreUniqueValidPoliciesWithBf16First) {
  const auto& all = AllConfigs();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all[0].name, "bf16");
  EXPECT_EQ(all[0].enc, kernels::Encoding(kernels::Format::kBF16));
  std::set<std::string> names;
  const std::regex policy_re("[A-Za-z0-9._:-]{1,128}");
  for (const auto& c : all) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate " << c.name;
    EXPECT_TRUE(std::regex_match(c.policy(), policy_re)) << c.policy();
  }
  // Every format appears as a uniform configuration.
  for (kernels::Format f : kernels::kAllFormats) {
    EXPECT_TRUE(names.count(kernels::FormatName(f))) << kernels::FormatName(f);
  }
}

TEST(QualityMetricsTest, SelectConfigs) {
  auto all = SelectConfigs("configs", "all");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), AllConfigs().size());
  auto core = SelectConfigs("configs", "core");
  ASSERT_TRUE(core.ok());
  EXPECT_LT(core->size(), all->size());
  EXPECT_EQ((*core)[0].name, "bf16");
  auto list = SelectConfigs("configs", "int2.w32,int4");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);  // bf16 is always added, in report order
  EXPECT_EQ((*list)[0].name, "bf16");
  EXPECT_EQ((*list)[1].name, "int4");
  EXPECT_EQ((*list)[2].name, "int2.w32");
  EXPECT_EQ((*list)[2].window, 32u);
  EXPECT_THAT(SelectConfigs("kvproxy_configs", "int4,int3"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--kvproxy_configs: unknown configuration "
                                 "\"int3\"")));
}

}  // namespace
}  // namespace triax::bench
