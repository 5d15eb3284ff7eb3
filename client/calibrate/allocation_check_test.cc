#include "client/calibrate/allocation_check.h"

#include <cmath>
#include <string>
#include <vector>

#include "client/calibrate/calibrate_test_util.h"
#include "client/calibrate/calibration_proto.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax::calibrate {
namespace {

using kernels::Format;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

TEST(SpearmanTest, RanksWithTies) {
  EXPECT_DOUBLE_EQ(Spearman({1, 2, 3, 4}, {10, 20, 35, 40}), 1.0);
  EXPECT_DOUBLE_EQ(Spearman({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0);
  // Ranks x: 1 2 3 4; y (ties 2.5, 2.5): 1 2.5 2.5 4.
  EXPECT_NEAR(Spearman({1, 2, 3, 4}, {0, 5, 5, 9}), 0.9486832980505138, 1e-12);
  EXPECT_EQ(Spearman({1, 1, 1}, {1, 2, 3}), 0.0);
  EXPECT_EQ(Spearman({1}, {1}), 0.0);
  EXPECT_EQ(Spearman({1, 2}, {1, 2, 3}), 0.0);
}

TEST(CheckAllocationsTest, UniformThenSeededRandom) {
  const std::vector<Tag> tags = {
      {Temporal::kSink, Modality::kText, Role::kDelimiter},
      {Temporal::kOlder, Modality::kText, Role::kUser}};
  const std::vector<kernels::Encoding> encs = DefaultEncodings();
  const auto a = CheckAllocations(tags, encs, 5, 7);
  ASSERT_EQ(a.size(), encs.size() + 5);
  EXPECT_EQ(a[0].name, "uniform bf16");
  EXPECT_EQ(a[3].name, "uniform int4");
  for (const Tag& t : tags) EXPECT_EQ(a[3].alloc.at(t), Format::kINT4);
  EXPECT_EQ(a[encs.size()].name, "random 0 (seed 7)");
  const auto b = CheckAllocations(tags, encs, 5, 7);
  const auto c = CheckAllocations(tags, encs, 5, 8);
  bool differs = false;
  for (size_t i = encs.size(); i < a.size(); ++i) {
    ASSERT_EQ(a[i].alloc.size(), tags.size());
    EXPECT_EQ(a[i].alloc, b[i].alloc);
    differs |= a[i].alloc != c[i].alloc;
  }
  EXPECT_TRUE(differs);
  EXPECT_EQ(CheckAllocations(tags, encs, 0, 1).size(), encs.size());
}

TableMeta OutputMeta(const frontend::ModelConfig& cfg) {
  TableMeta m;
  m.model = "toy";
  m.shape.set_n_layers(cfg.n_layers);
  m.shape.set_n_kv_heads(cfg.n_kv_heads);
  m.shape.set_n_q_heads(cfg.n_heads);
  m.shape.set_head_dim(cfg.head_dim());
  m.block_tokens = 16;
  m.source.set_tool("allocation_check_test");
  m.source.set_model_file("synthetic");
  m.source.set_dataset("synthetic");
  m.source.add_calibration_ids("synthetic");
  m.source.set_metric(OutputMetricDescription(64, 2));
  m.source.set_created_unix_ms(1);
  return m;
}

TEST(PredictionTest, AdditiveTablePredictsWholeAllocations) {
  const frontend::RenderedConversation conv =
      testutil::MakeConversation(3, 60, 24);
  frontend::ByteTokenizer bt;
  auto oc =
      PrepareOutputConversation(conv, bt.Encode(conv.text, true), 1, 16, 2, 64);
  ASSERT_THAT(oc.status(), IsOk());
  auto model = frontend::MakeSyntheticModel(testutil::SmallConfig(2), 31);
  OutputCalibratorOptions opt;
  opt.encodings = {Format::kBF16, Format::kINT8, Format::kINT4, Format::kINT2};
  opt.threads = 2;
  auto cal = OutputCalibrator::Create(model->config, opt);
  ASSERT_THAT(cal.status(), IsOk());
  ASSERT_THAT(cal->AddConversation(*model, *oc), IsOk());
  auto table = BuildTable(OutputMeta(model->config), cal->Entries());
  ASSERT_THAT(table.status(), IsOk());
  auto pred = TablePredictor::Create(*table, "output", 16);
  ASSERT_THAT(pred.status(), IsOk());
  EXPECT_TRUE(pred->output_metric());

  std::vector<NamedAllocation> allocs =
      CheckAllocations(oc->tags, opt.encodings, 6, 3);
  // One tag alone: the table entry was measured on exactly this pass.
  allocs.push_back({"one tag", {{oc->tags[1], Format::kINT2}}});
  const std::vector<OutputConversation> convs = {*oc};
  int lines = 0;
  auto measured = MeasureAllocations(*model, convs, allocs, 2,
                                     [&](const std::string&) { ++lines; });
  ASSERT_THAT(measured.status(), IsOk());
  EXPECT_EQ(lines, static_cast<int>(allocs.size()) + 1);
  std::vector<EffectSums> predicted;
  std::vector<double> p, m;
  for (size_t a = 0; a < allocs.size(); ++a) {
    int64_t missing = 0;
    predicted.push_back(pred->Predict(*oc, allocs[a].alloc, &missing));
    EXPECT_EQ(missing, 0);
    const EffectSums& got = (*measured)[a];
    const EffectSums& want = predicted.back();
    EXPECT_EQ(got.positions, oc->positions());
    p.push_back(want.Mean(want.kl, false));
    m.push_back(got.Mean(got.kl, false));
  }
  // bf16: both 0.
  EXPECT_EQ(m[0], 0.0);
  EXPECT_EQ(p[0], 0.0);
  // The single-tag allocation is predicted exactly.
  EXPECT_NEAR(p.back(), m.back(), 1e-9 * m.back());
  EXPECT_GT(m.back(), 0.0);
  // Whole allocations: the additive model is an approximation; on this toy
  // model it stays within a factor of 3 and ranks the allocations well.
  for (size_t a = 1; a < allocs.size(); ++a) {
    if (m[a] == 0) continue;
    EXPECT_LT(p[a], 3 * m[a]) << allocs[a].name;
    EXPECT_GT(p[a], m[a] / 3) << allocs[a].name;
  }
  EXPECT_GT(Spearman(p, m), 0.8);

  const std::string md =
      PredictionReport(allocs, *measured, {*pred}, {predicted});
  EXPECT_THAT(md, HasSubstr("| uniform int2 |"));
  EXPECT_THAT(md, HasSubstr("| output | "));
  EXPECT_THAT(md, HasSubstr("ρ(pred, KL)"));
}

TEST(PredictionTest, MissingEntriesAttentionTablesAndBadTables) {
  const frontend::RenderedConversation conv =
      testutil::MakeConversation(2, 40, 20);
  frontend::ByteTokenizer bt;
  auto oc =
      PrepareOutputConversation(conv, bt.Encode(conv.text, true), 1, 16, 2, 64);
  ASSERT_THAT(oc.status(), IsOk());
  const frontend::ModelConfig cfg = testutil::SmallConfig(1);
  TableMeta meta = OutputMeta(cfg);
  meta.source.set_metric(MetricDescription(8, 64, 2));  // attention
  CalibrationResultEntry e;
  e.tag = oc->tags[0];
  e.encoding = Format::kINT4;
  e.distortion = 2.0;
  e.tokens = 1;
  e.queries = 1;
  auto table = BuildTable(meta, {e});
  ASSERT_THAT(table.status(), IsOk());
  auto pred = TablePredictor::Create(*table, "attention", 16);
  ASSERT_THAT(pred.status(), IsOk());
  EXPECT_FALSE(pred->output_metric());
  Allocation all4;
  for (const Tag& t : oc->tags) all4[t] = Format::kINT4;
  int64_t missing = 0;
  const EffectSums s = pred->Predict(*oc, all4, &missing);
  EXPECT_EQ(missing, static_cast<int64_t>(oc->tags.size()) - 1);
  // Only tags[0] counts: 2 x its share summed over positions; the answer
  // prediction of an attention table uses `distortion`.
  double share = 0, share_answer = 0;
  for (int64_t p = 0; p < oc->positions(); ++p) {
    share += oc->share[p * oc->tags.size()];
    if (oc->answer[p]) share_answer += oc->share[p * oc->tags.size()];
  }
  EXPECT_NEAR(s.kl, 2 * share, 1e-9);
  EXPECT_NEAR(s.kl_answer, 2 * share_answer, 1e-9);
  EXPECT_EQ(s.dnll, 0.0);

  const std::vector<NamedAllocation> allocs = {{"uniform int4", all4}};
  EffectSums measured;
  measured.kl = 1;
  measured.positions = 1;
  const std::string md = PredictionReport(allocs, {measured}, {*pred}, {{s}});
  EXPECT_THAT(md, HasSubstr("n/a (attention units)"));

  EXPECT_THAT(TablePredictor::Create(*table, "t.txtpb", 32).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("table t.txtpb: block_tokens 16")));
  v1::CalibrationTable bad = *table;
  bad.clear_model();
  EXPECT_THAT(TablePredictor::Create(bad, "bad.pb", 16).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("table bad.pb: model is empty")));
  auto model = frontend::MakeSyntheticModel(cfg, 3);
  EXPECT_THAT(
      MeasureAllocations(*model, {*oc}, allocs, 0, nullptr).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("threads 0")));
}

}  // namespace
}  // namespace triax::calibrate
