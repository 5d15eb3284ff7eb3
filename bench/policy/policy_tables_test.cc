#include "bench/policy/policy_tables.h"

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
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

TEST(CollapseAxisTest, OutputMeasuresAverageLikeTheDistortion) {
  v1::CalibrationTable t = Table();
  // current user int4 (100 tokens) and older user int4 (300 tokens).
  t.mutable_entries(0)->set_dnll(-0.2);
  t.mutable_entries(1)->set_dnll(0.6);
  t.mutable_entries(0)->set_distortion_answer(1.0);
  t.mutable_entries(1)->set_dnll_answer(2.0);
  auto out = CollapseAxis(t, TagAxis::kTemporal, "m-no-temporal");
  ASSERT_TRUE(out.ok()) << out.status();
  // (-0.2*100 + 0.6*300) / 400 = 0.4; (1*100) / 400; (2*300) / 400.
  for (int i : {0, 1}) {
    EXPECT_THAT(out->entries(i).dnll(), DoubleNear(0.4, 1e-12));
    EXPECT_THAT(out->entries(i).distortion_answer(), DoubleNear(0.25, 1e-12));
    EXPECT_THAT(out->entries(i).dnll_answer(), DoubleNear(1.5, 1e-12));
  }
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

// --- Raw shards --------------------------------------------------------------

RawRow Row(const std::string& conv, const std::string& config,
           const std::string& kind, double nll_sum, double answer_nll_sum,
           uint64_t plan_bytes) {
  RawRow r;
  r.conversation = conv;
  r.config = config;
  r.kind = kind;
  r.budget = kind == "uniform" ? 0 : 4;
  r.count = 100;
  r.nll_sum = nll_sum;
  r.answer_count = 10;
  r.answer_nll_sum = answer_nll_sum;
  r.kl_sum = 0.5;
  r.top1_agree = 90;
  r.plan_bytes = plan_bytes;
  r.worker_bytes = plan_bytes + 7;
  r.seq_tokens = 101;
  r.values_per_token = 3072;
  r.tokens_by_encoding = {{"int4", 60}, {"k=int4,v=int2,g=32", 41}};
  r.attn = {{0.25, 1.5, 12}, {1e-9, 3.0, 12}};
  r.seconds = 1.25;
  r.note = "a note, with spaces";
  return r;
}

TEST(RawShardTest, FormatParseRoundTrip) {
  RawShard s;
  s.sessions = {{"multi_turn_base_42", "multi_turn_base_42 (1814 tokens)"}};
  s.skipped = {{"multi_turn_base_3", "does not render: too long"}};
  s.notes = {{"Calibration", "`t.txtpb` (190 entries)"},
             {"Run settings", "context 2048 tokens"}};  // a key with a space
  s.rows = {Row("multi_turn_base_42", "bf16", "uniform", 100.0 / 3, 7, 1000),
            Row("multi_turn_base_42", "tri-4", "triaxial", 35.1, 7.5, 250)};
  s.rows[1].tokens_by_encoding.clear();
  s.rows[1].attn.clear();
  s.rows[1].note.clear();
  auto p = ParseRaw(FormatRaw(s), "x.tsv");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->sessions, s.sessions);
  EXPECT_EQ(p->skipped, s.skipped);
  EXPECT_EQ(p->notes, s.notes);
  ASSERT_EQ(p->rows.size(), 2u);
  const RawRow& a = p->rows[0];
  EXPECT_EQ(a.nll_sum, 100.0 / 3);  // exact: 17 significant digits
  EXPECT_EQ(a.tokens_by_encoding, s.rows[0].tokens_by_encoding);
  ASSERT_EQ(a.attn.size(), 2u);
  EXPECT_EQ(a.attn[1].sum_sq_diff, 1e-9);
  EXPECT_EQ(a.attn[0].queries, 12);
  EXPECT_EQ(a.note, "a note, with spaces");
  EXPECT_EQ(a.worker_bytes, 1007u);
  EXPECT_TRUE(p->rows[1].tokens_by_encoding.empty());
  EXPECT_TRUE(p->rows[1].attn.empty());
  EXPECT_EQ(p->rows[1].kind, "triaxial");
  EXPECT_EQ(p->rows[1].budget, 4);
  // Formatting the parse gives the same text.
  EXPECT_EQ(FormatRaw(*p), FormatRaw(s));
}

TEST(RawShardTest, BadLinesNameFileAndLine) {
  RawShard s;
  s.rows = {Row("c1", "bf16", "uniform", 10, 1, 100)};
  const std::string good = FormatRaw(s);  // comment, header, row: line 3
  EXPECT_THAT(ParseRaw("", "empty.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("empty.tsv: no header line")));
  EXPECT_THAT(ParseRaw("conversation\tconfig\n", "h.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("h.tsv:1: expected the header line")));
  // Wrong field count on line 4.
  EXPECT_THAT(ParseRaw(good + "c2\tbf16\tuniform\n", "f.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("f.tsv:4: has 3 fields; 19 expected")));
  auto replace_field = [&](int field, const std::string& value) {
    std::vector<std::string> lines = absl::StrSplit(good, '\n');
    std::vector<std::string> f = absl::StrSplit(lines[2], '\t');
    f[field] = value;
    lines[2] = absl::StrJoin(f, "\t");
    return absl::StrJoin(lines, "\n");
  };
  EXPECT_THAT(ParseRaw(replace_field(2, "exotic"), "k.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("k.tsv:3: field kind = \"exotic\"")));
  EXPECT_THAT(ParseRaw(replace_field(5, "-4"), "n.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("n.tsv:3: field count = \"-4\"")));
  EXPECT_THAT(ParseRaw(replace_field(6, "nan"), "d.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("d.tsv:3: field nll_sum = \"nan\"")));
  EXPECT_THAT(ParseRaw(replace_field(15, "int4=3"), "e.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("e.tsv:3: field tokens_by_encoding")));
  EXPECT_THAT(ParseRaw(replace_field(16, "1/2"), "a.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a.tsv:3: field attn")));
  EXPECT_THAT(ParseRaw(replace_field(10, "101"), "t.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("t.tsv:3: field top1_agree")));
  EXPECT_THAT(ParseRaw("#session\tid with space\tx\n" + good, "s.tsv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("s.tsv:1: \"#session\" line")));
}

TEST(RawShardTest, MergeKeepsAgreeingDuplicatesAndRefusesConflicts) {
  RawShard a, b;
  a.sessions = {{"c1", "one"}};
  a.skipped = {{"c2", "no render"}, {"c3", "no render"}};
  a.notes = {{"Calibration", "x"}};
  a.rows = {Row("c1", "bf16", "uniform", 10, 1, 100),
            Row("c1", "int4", "uniform", 11, 1.5, 30)};
  b.sessions = {{"c1", "one"}, {"c3", "three"}};
  b.notes = {{"Calibration", "x"}, {"Calibration", "y"}};
  b.rows = {Row("c1", "bf16", "uniform", 10, 1, 100),
            Row("c3", "bf16", "uniform", 20, 2, 100)};
  b.rows[0].seconds = 99;  // seconds do not take part in the comparison
  auto m = MergeRaw({a, b});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->rows.size(), 3u);
  EXPECT_EQ(m->sessions.size(), 2u);
  ASSERT_EQ(m->skipped.size(), 1u);  // c3 ran in b
  EXPECT_EQ(m->skipped[0].first, "c2");
  EXPECT_EQ(m->notes.size(), 2u);  // x once, y
  // Through text and back, merged again: same rows.
  auto pa = ParseRaw(FormatRaw(a), "a.tsv");
  auto pb = ParseRaw(FormatRaw(b), "b.tsv");
  ASSERT_TRUE(pa.ok() && pb.ok());
  auto m2 = MergeRaw({*pa, *pb});
  ASSERT_TRUE(m2.ok());
  EXPECT_EQ(FormatRaw(*m2), FormatRaw(*m));

  RawShard c;
  c.rows = {Row("c1", "int4", "uniform", 12, 1.5, 30)};
  EXPECT_THAT(MergeRaw({a, c}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("conversation c1 config int4 appears twice")));
  RawShard d;
  d.rows = {Row("c9", "int4", "triaxial", 12, 1.5, 30)};
  EXPECT_THAT(MergeRaw({a, d}), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("config int4 is uniform")));
}

// --- Bootstrap ---------------------------------------------------------------

TEST(BootstrapTest, KnownCaseTwoItems) {
  // Resample means of {1, 3} (equal weights) are 1, 2 or 3 with
  // probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5% points are 1 and 3.
  auto iv = BootstrapRatio({{1, 1}, {3, 1}}, 4000, 7);
  ASSERT_TRUE(iv.ok()) << iv.status();
  EXPECT_DOUBLE_EQ(iv->point, 2);
  EXPECT_DOUBLE_EQ(iv->lo, 1);
  EXPECT_DOUBLE_EQ(iv->hi, 3);
  // Token weighting: (10 + 0) / (10 + 90).
  auto w = BootstrapRatio({{10, 10}, {0, 90}}, 100, 1);
  ASSERT_TRUE(w.ok());
  EXPECT_DOUBLE_EQ(w->point, 0.1);
}

TEST(BootstrapTest, DeterministicBySeedAndContainsPoint) {
  std::vector<RatioItem> items;
  for (int i = 0; i < 11; ++i) {
    items.push_back({0.01 * i * i - 0.3 + 0.07 * (i % 3), 100.0 + 37 * i});
  }
  auto a = BootstrapRatio(items, 2000, 1);
  auto b = BootstrapRatio(items, 2000, 1);
  auto c = BootstrapRatio(items, 2000, 2);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->lo, b->lo);
  EXPECT_EQ(a->hi, b->hi);
  EXPECT_NE(a->lo, c->lo);
  EXPECT_EQ(a->point, c->point);
  EXPECT_LT(a->lo, a->point);
  EXPECT_GT(a->hi, a->point);
}

TEST(BootstrapTest, SingleConversationIsDegenerate) {
  auto iv = BootstrapRatio({{0.5, 200}}, 2000, 1);
  ASSERT_TRUE(iv.ok());
  EXPECT_DOUBLE_EQ(iv->point, 0.0025);
  EXPECT_DOUBLE_EQ(iv->lo, 0.0025);
  EXPECT_DOUBLE_EQ(iv->hi, 0.0025);
}

TEST(BootstrapTest, RejectsBadInput) {
  EXPECT_THAT(
      BootstrapRatio({}, 10, 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no items")));
  EXPECT_THAT(
      BootstrapRatio({{1, 1}}, 0, 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resamples = 0")));
  EXPECT_THAT(
      BootstrapRatio({{1, 0}}, 10, 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sum to 0")));
  EXPECT_THAT(
      BootstrapRatio({{1, -1}}, 10, 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("item 0")));
}

// --- Frontier ----------------------------------------------------------------

// Three conversations; bf16 NLL sums 100 (all, 100 tokens) and 10 (answer,
// 10 tokens). int4 (300 bytes) is +0.01 on all tokens, int2 (150) +0.05;
// tri-a (200 bytes) +0.03 all, +0.0 answer: between them on bytes, so only
// int2 is compared, and tri-a is better. tri-b (160 bytes) +0.08 all:
// int2 dominates on all tokens.
RawShard FrontierShard() {
  RawShard s;
  for (const std::string c : {"c1", "c2", "c3"}) {
    const double jitter = c == "c2" ? 0.2 : (c == "c3" ? -0.1 : 0.0);
    s.rows.push_back(Row(c, "bf16", "uniform", 100, 10, 1000));
    s.rows.push_back(Row(c, "int4", "uniform", 101 + jitter, 10.1, 300));
    s.rows.push_back(Row(c, "int2", "uniform", 105 + jitter, 10.5, 150));
    s.rows.push_back(Row(c, "tri-a", "triaxial", 103 + jitter, 10, 200));
    s.rows.push_back(Row(c, "tri-b", "triaxial", 108 + jitter, 10.2, 160));
  }
  return s;
}

TEST(FrontierTest, DnllItemsArePairedPerConversation) {
  auto items = DnllItems(FrontierShard(), "tri-a", "int2", Metric::kAll);
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 3u);
  for (const RatioItem& it : *items) {
    EXPECT_THAT(it.num, DoubleNear(-2, 1e-9));
    EXPECT_EQ(it.den, 100);
  }
  auto ans = DnllItems(FrontierShard(), "int4", "", Metric::kAnswer);
  ASSERT_TRUE(ans.ok());
  EXPECT_THAT((*ans)[0].num, DoubleNear(0.1, 1e-9));
  EXPECT_EQ((*ans)[0].den, 10);
  RawShard bad = FrontierShard();
  bad.rows[1].count = 99;
  EXPECT_THAT(DnllItems(bad, "int4", "", Metric::kAll),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("conversation c1: config int4 counts 99")));
}

TEST(FrontierTest, VerdictsOnAndOffTheFrontier) {
  auto a = CheckFrontier(FrontierShard(), "tri-a", 500, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_DOUBLE_EQ(a->bytes_ratio, 0.2);
  ASSERT_EQ(a->comparisons.size(), 1u);
  EXPECT_EQ(a->comparisons[0].uniform, "int2");
  EXPECT_DOUBLE_EQ(a->comparisons[0].uniform_bytes_ratio, 0.15);
  EXPECT_THAT(a->comparisons[0].diff_all.point, DoubleNear(-0.02, 1e-12));
  EXPECT_EQ(a->Text(), "on or below the frontier");

  auto b = CheckFrontier(FrontierShard(), "tri-b", 500, 1);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->comparisons.size(), 1u);
  EXPECT_THAT(b->comparisons[0].diff_all.point, DoubleNear(0.03, 1e-12));
  EXPECT_GT(b->comparisons[0].diff_all.lo, 0);
  EXPECT_EQ(b->dominated_all, std::vector<std::string>{"int2"});
  EXPECT_TRUE(b->dominated_answer.empty());  // +0.02 vs +0.05: better
  EXPECT_EQ(b->Text(),
            "dominated (uniform int2 better on all tokens beyond the "
            "interval)");

  EXPECT_EQ(b->comparisons[0].conversations, 3);

  // One shared conversation: the interval is a point; listed, not decisive.
  RawShard one;
  for (const RawRow& r : FrontierShard().rows) {
    if (r.conversation == "c1") one.rows.push_back(r);
  }
  auto b1 = CheckFrontier(one, "tri-b", 500, 1);
  ASSERT_TRUE(b1.ok());
  ASSERT_EQ(b1->comparisons.size(), 1u);
  EXPECT_EQ(b1->comparisons[0].conversations, 1);
  EXPECT_GT(b1->comparisons[0].diff_all.lo, 0);
  EXPECT_TRUE(b1->dominated_all.empty());
  EXPECT_EQ(b1->Text(),
            "on or below the frontier (undecided against int2: fewer than "
            "two shared conversations)");

  EXPECT_THAT(CheckFrontier(FrontierShard(), "tri-z", 10, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tri-z")));
}

}  // namespace
}  // namespace triax::bench
