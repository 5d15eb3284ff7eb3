#include "client/calibrate/calibration_proto.h"

#include <cmath>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax::calibrate {
namespace {

namespace v1 = ::triax::v1;
using kernels::Format;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

TableMeta Meta() {
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
  m.source.add_calibration_ids("multi_turn_base_2");
  for (const std::string& id : HeldOutIds()) m.source.add_held_out_ids(id);
  m.source.set_metric(MetricDescription(8, 64, 2));
  m.source.set_created_unix_ms(1700000000000);
  return m;
}

std::vector<CalibrationResultEntry> Entries() {
  std::vector<CalibrationResultEntry> es;
  const Tag sink{Temporal::kSink, Modality::kText, Role::kDelimiter};
  const Tag older{Temporal::kOlder, Modality::kText, Role::kToolSchema};
  const std::vector<std::pair<kernels::Encoding, double>> encs = {
      {Format::kBF16, 0.0},
      {Format::kFP8, 0.01},
      {Format::kINT4, 0.1},
      {kernels::Encoding(Format::kINT4, Format::kINT2), 0.4}};
  for (const Tag& t : {sink, older}) {
    for (const auto& [e, d] : encs) {
      CalibrationResultEntry r;
      r.tag = t;
      r.encoding = e;
      r.distortion = t == sink ? 10 * d : d;
      r.tokens = 16;
      r.queries = 3;
      es.push_back(r);
    }
  }
  return es;
}

TEST(BuildTableTest, CanonicalWellFormedTable) {
  auto table = BuildTable(Meta(), Entries());
  ASSERT_THAT(table.status(), IsOk());
  EXPECT_EQ(table->model(), "kvproxy-18m");
  EXPECT_EQ(table->block_tokens(), 16u);
  ASSERT_EQ(table->entries_size(), 8);
  const v1::CalibrationEntry& bf16 = table->entries(0);
  EXPECT_EQ(bf16.tag().temporal(), v1::TEMPORAL_SINK);
  EXPECT_EQ(bf16.tag().modality(), v1::MODALITY_TEXT);
  EXPECT_EQ(bf16.tag().role(), v1::ROLE_DELIMITER);
  EXPECT_EQ(bf16.format(), v1::FORMAT_BF16);
  EXPECT_EQ(bf16.format_v(), v1::FORMAT_BF16);
  EXPECT_EQ(bf16.group_size(), 0u);
  EXPECT_EQ(bf16.scale_dtype(), v1::SCALE_DTYPE_UNSPECIFIED);
  const v1::CalibrationEntry& fp8 = table->entries(1);
  EXPECT_EQ(fp8.format(), v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(fp8.group_size(), 0u);
  const v1::CalibrationEntry& mixed = table->entries(3);
  EXPECT_EQ(mixed.format(), v1::FORMAT_INT4);
  EXPECT_EQ(mixed.format_v(), v1::FORMAT_INT2);
  EXPECT_EQ(mixed.group_size(), 32u);
  EXPECT_EQ(mixed.scale_dtype(), v1::SCALE_DTYPE_FP16);
  EXPECT_DOUBLE_EQ(mixed.distortion(), 4.0);
  EXPECT_EQ(mixed.tokens(), 16u);
  EXPECT_EQ(mixed.queries(), 3u);
  EXPECT_EQ(table->source().held_out_ids_size(), 26);
  EXPECT_THAT(table->source().metric(), HasSubstr("every 8 positions"));

  // Survives the wire.
  std::string bytes;
  ASSERT_TRUE(table->SerializeToString(&bytes));
  v1::CalibrationTable back;
  ASSERT_TRUE(back.ParseFromString(bytes));
  EXPECT_THAT(ValidateTable(back), IsOk());
  EXPECT_EQ(back.entries(3).distortion(), 4.0);
}

TEST(ValidateTableTest, RejectsMalformedTables) {
  auto good = BuildTable(Meta(), Entries());
  ASSERT_THAT(good.status(), IsOk());
  struct Case {
    const char* want;
    void (*mutate)(v1::CalibrationTable*);
  };
  const Case cases[] = {
      {"model is empty", [](v1::CalibrationTable* t) { t->clear_model(); }},
      {"shape",
       [](v1::CalibrationTable* t) { t->mutable_shape()->set_n_q_heads(3); }},
      {"block_tokens 0",
       [](v1::CalibrationTable* t) { t->set_block_tokens(0); }},
      {"entries is empty", [](v1::CalibrationTable* t) { t->clear_entries(); }},
      {"entries[2].tag has an unspecified field",
       [](v1::CalibrationTable* t) {
         t->mutable_entries(2)->mutable_tag()->clear_role();
       }},
      {"entries[2].distortion -1",
       [](v1::CalibrationTable* t) {
         t->mutable_entries(2)->set_distortion(-1);
       }},
      {"for bf16",
       [](v1::CalibrationTable* t) {
         t->mutable_entries(0)->set_distortion(0.5);
       }},
      {"entries[2].distortion_answer -0.5",
       [](v1::CalibrationTable* t) {
         t->mutable_entries(2)->set_distortion_answer(-0.5);
       }},
      {"entries[3].dnll / dnll_answer 0 / inf are not finite",
       [](v1::CalibrationTable* t) {
         t->mutable_entries(3)->set_dnll_answer(HUGE_VAL);
       }},
      {"entries[0].distortion 0 (answer 0, dnll 0.25",
       [](v1::CalibrationTable* t) { t->mutable_entries(0)->set_dnll(0.25); }},
      {"entries[6] repeats tag older/text/tool_schema encoding fp8",
       [](v1::CalibrationTable* t) { *t->mutable_entries(6) = t->entries(5); }},
      {"group_size 16",
       [](v1::CalibrationTable* t) {
         t->mutable_entries(2)->set_group_size(16);
       }},
      {"tokens 0",
       [](v1::CalibrationTable* t) { t->mutable_entries(2)->set_tokens(0); }},
      {"source.tool is empty",
       [](v1::CalibrationTable* t) { t->mutable_source()->clear_tool(); }},
      {"source.calibration_ids is empty",
       [](v1::CalibrationTable* t) {
         t->mutable_source()->clear_calibration_ids();
       }},
      {"\"multi_turn_base_42\" is also in source.held_out_ids",
       [](v1::CalibrationTable* t) {
         t->mutable_source()->add_calibration_ids("multi_turn_base_42");
       }},
      {"created_unix_ms 0",
       [](v1::CalibrationTable* t) {
         t->mutable_source()->set_created_unix_ms(0);
       }},
  };
  for (const Case& c : cases) {
    v1::CalibrationTable t = *good;
    c.mutate(&t);
    EXPECT_THAT(ValidateTable(t),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.want)))
        << c.want;
  }
  // BuildTable validates too.
  std::vector<CalibrationResultEntry> es = Entries();
  es[1].distortion = std::nan("");
  EXPECT_THAT(BuildTable(Meta(), es).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("entries[1].distortion")));
}

TEST(BuildTableTest, OutputMetricFieldsRoundTrip) {
  TableMeta meta = Meta();
  meta.source.set_metric(OutputMetricDescription(64, 2));
  std::vector<CalibrationResultEntry> es = Entries();
  for (CalibrationResultEntry& e : es) {
    if (e.distortion == 0) continue;
    e.distortion_answer = 2 * e.distortion;
    e.dnll = -0.5 * e.distortion;  // dNLL may be negative
    e.dnll_answer = 3 * e.distortion;
  }
  auto table = BuildTable(meta, es);
  ASSERT_THAT(table.status(), IsOk());
  EXPECT_THAT(table->source().metric(), ::testing::StartsWith("output-kl"));
  EXPECT_THAT(table->source().metric(), HasSubstr("chunks of 64 tokens"));
  const v1::CalibrationEntry& mixed = table->entries(3);
  EXPECT_DOUBLE_EQ(mixed.distortion_answer(), 8.0);
  EXPECT_DOUBLE_EQ(mixed.dnll(), -2.0);
  EXPECT_DOUBLE_EQ(mixed.dnll_answer(), 12.0);
  EXPECT_EQ(table->entries(0).distortion_answer(), 0.0);
  std::string bytes;
  ASSERT_TRUE(table->SerializeToString(&bytes));
  v1::CalibrationTable back;
  ASSERT_TRUE(back.ParseFromString(bytes));
  EXPECT_THAT(ValidateTable(back), IsOk());
  EXPECT_EQ(back.entries(3).dnll(), -2.0);
  // Both tables in the Markdown.
  const std::string md = MarkdownTable(*table);
  EXPECT_THAT(md, HasSubstr("distortion_answer: KL"));
  EXPECT_THAT(md, HasSubstr("| sink/text/delimiter | 0 | 0.1 | 1 | 4 |"));
  EXPECT_THAT(md, HasSubstr("| sink/text/delimiter | 0 | 0.2 | 2 | 8 |"));
  // The attention table has one.
  auto attention = BuildTable(Meta(), Entries());
  ASSERT_THAT(attention.status(), IsOk());
  EXPECT_THAT(MarkdownTable(*attention),
              ::testing::Not(HasSubstr("distortion_answer")));
}

// Runs over the same conversations with different encodings join into one
// table; anything that makes them different runs is refused.
TEST(UnionTablesTest, JoinsDisjointEncodingsOfTheSameRun) {
  std::vector<CalibrationResultEntry> a, b;
  for (const CalibrationResultEntry& e : Entries()) {
    // bf16 and fp8 in the first run, bf16 and int4 pairs in the second.
    const bool first = e.encoding == kernels::Encoding(Format::kBF16) ||
                       e.encoding == kernels::Encoding(Format::kFP8);
    if (first || e.encoding == kernels::Encoding(Format::kBF16)) a.push_back(e);
    if (!first || e.encoding == kernels::Encoding(Format::kBF16)) {
      b.push_back(e);
    }
  }
  TableMeta later = Meta();
  later.source.set_created_unix_ms(1700000000999);
  auto ta = BuildTable(Meta(), a);
  auto tb = BuildTable(later, b);
  auto all = BuildTable(Meta(), Entries());
  ASSERT_TRUE(ta.ok() && tb.ok() && all.ok());
  auto u = UnionTables({*ta, *tb});
  ASSERT_TRUE(u.ok()) << u.status();
  // Every entry of the one-run table, BF16 once per tag.
  EXPECT_EQ(u->entries_size(), all->entries_size());
  EXPECT_EQ(u->source().created_unix_ms(), 1700000000999);
  EXPECT_TRUE(ValidateTable(*u).ok());
  // The same entry twice, another model, another metric: refused.
  EXPECT_THAT(UnionTables({*all, *tb}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("already in an earlier table")));
  v1::CalibrationTable other = *tb;
  other.set_model("other");
  EXPECT_THAT(UnionTables({*ta, other}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tables[1].model differs")));
  other = *tb;
  other.mutable_source()->set_metric(OutputMetricDescription(64, 2));
  EXPECT_THAT(UnionTables({*ta, other}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tables[1].source.metric differs")));
  other = *tb;
  other.mutable_source()->add_calibration_ids("multi_turn_base_1");
  EXPECT_THAT(UnionTables({*ta, other}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("source.calibration_ids differs")));
  EXPECT_THAT(
      UnionTables({}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tables")));
}

TEST(MarkdownTableTest, RowsSortedMostSensitiveFirst) {
  auto table = BuildTable(Meta(), Entries());
  ASSERT_THAT(table.status(), IsOk());
  const std::string md = MarkdownTable(*table);
  EXPECT_THAT(md, HasSubstr("| tag | bf16 | fp8 | int4 | k=int4,v=int2 | "
                            "tokens | queries |"));
  const size_t sink =
      md.find("| sink/text/delimiter | 0 | 0.1 | 1 | 4 | 16 | 3 |");
  const size_t older =
      md.find("| older/text/tool_schema | 0 | 0.01 | 0.1 | 0.4 |");
  ASSERT_NE(sink, std::string::npos) << md;
  ASSERT_NE(older, std::string::npos) << md;
  EXPECT_LT(sink, older);
}

}  // namespace
}  // namespace triax::calibrate
