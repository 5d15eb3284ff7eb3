// CalibrationStore (calibration_store.h) through its own interface: table
// validation (each bad field named), canonical storage, the model limit,
// and the lookups for allocation policies and for the pressure ranking.
#include "kvmanager/calibration_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

ModelShape Shape() { return ModelShape{"tiny", 2, 2, 4, 64}; }

CalibrationEntryInfo Entry(Temporal t, Role r, Format f, double d) {
  CalibrationEntryInfo e;
  e.tag = Tag{t, Modality::kText, r};
  e.encoding.format = f;
  e.distortion = d;
  return e;
}

CalibrationTableInfo Table(const std::string& model = "tiny-cal") {
  CalibrationTableInfo t;
  t.model = model;
  t.shape = Shape();
  t.block_tokens = 16;
  t.entries = {Entry(Temporal::kOlder, Role::kUser, Format::kBF16, 0),
               Entry(Temporal::kOlder, Role::kUser, Format::kINT4, 0.5),
               Entry(Temporal::kOlder, Role::kUser, Format::kINT2, 2.0)};
  t.source.tool = "hand-made";
  t.source.calibration_ids = {"a", "b"};
  return t;
}

std::shared_ptr<const Policy> AllocPolicy(const std::string& model) {
  PolicyInfo p;
  p.name = "alloc";
  p.budget_bits = 4;
  p.calibration_model = model;
  auto built = BuildPolicy(p);
  EXPECT_THAT(built, IsOk());
  return *built;
}

TEST(CalibrationStoreTest, BuildStoresEntriesCanonical) {
  CalibrationTableInfo in = Table();
  in.entries[1].tag.modality = Modality::kUnspecified;
  auto t = CalibrationStore::Build(in);
  ASSERT_THAT(t, IsOk());
  const CalibrationTableInfo& info = (*t)->info;
  ASSERT_EQ(info.entries.size(), 3u);
  EXPECT_EQ(info.entries[1].tag.modality, Modality::kText);
  EXPECT_EQ(info.entries[1].encoding.format_v, Format::kINT4);
  EXPECT_EQ(info.entries[1].encoding.group_size, 32u);  // 0 -> 32
  EXPECT_EQ(info.entries[0].encoding.group_size, 0u);   // BF16: none
  ASSERT_EQ((*t)->encodings.size(), 3u);
  EXPECT_EQ((*t)->encodings[2], Format::kINT2);
  EXPECT_EQ(info.source.tool, "hand-made");
  EXPECT_EQ(info.source.calibration_ids.size(), 2u);
}

TEST(CalibrationStoreTest, BuildNamesTheBadField) {
  auto bad = [](auto edit) {
    CalibrationTableInfo t = Table();
    edit(&t);
    return CalibrationStore::Build(t).status();
  };
  EXPECT_THAT(bad([](CalibrationTableInfo* t) { t->model = ""; }),
              StatusIs(C::kInvalidArgument, "table.model is empty"));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) { t->shape.n_layers = 0; }),
              StatusIs(C::kInvalidArgument,
                       "table.shape.n_layers=0 is outside 1..1024"));
  EXPECT_THAT(
      bad([](CalibrationTableInfo* t) { t->block_tokens = 0; }),
      StatusIs(C::kInvalidArgument, "table.block_tokens 0 is outside 1..4096"));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) { t->block_tokens = 4097; }),
              StatusIs(C::kInvalidArgument, HasSubstr("table.block_tokens")));
  EXPECT_THAT(
      bad([](CalibrationTableInfo* t) { t->entries.clear(); }),
      StatusIs(C::kInvalidArgument, HasSubstr("table.entries is empty (model "
                                              "\"tiny-cal\")")));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) {
                t->entries.resize(kMaxCalibrationEntries + 1, t->entries[0]);
              }),
              StatusIs(C::kInvalidArgument,
                       "table.entries has 4097 entries; the limit is 4096"));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) {
                t->entries[2].tag.temporal = Temporal::kUnspecified;
              }),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("table.entries[2].tag.temporal is "
                                 "TEMPORAL_UNSPECIFIED")));
  EXPECT_THAT(
      bad([](CalibrationTableInfo* t) {
        t->entries[1].tag.role = Role::kUnspecified;
      }),
      StatusIs(C::kInvalidArgument, HasSubstr("table.entries[1].tag.role is")));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) {
                t->entries[0].tag.modality = static_cast<Modality>(9);
              }),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("table.entries[0].tag.modality is")));
  EXPECT_THAT(
      bad([](CalibrationTableInfo* t) {
        t->entries[0].encoding.format = Format(0);
      }),
      StatusIs(C::kInvalidArgument, HasSubstr("table.entries[0].format")));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) {
                t->shape.head_dim = 96;
                t->entries[2].encoding.format = Format::kTQ3;
              }),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("table.entries[2] encoding tq3 is invalid "
                                 "for table.block_tokens 16, n_kv_heads 2, "
                                 "head_dim 96: ")));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) {
                t->entries[1].distortion =
                    std::numeric_limits<double>::quiet_NaN();
              }),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("table.entries[1].distortion is nan")));
  EXPECT_THAT(
      bad([](CalibrationTableInfo* t) { t->entries[1].distortion = -1; }),
      StatusIs(C::kInvalidArgument,
               "table.entries[1].distortion is -1; it must be finite and >= "
               "0"));
  EXPECT_THAT(bad([](CalibrationTableInfo* t) {
                t->entries.push_back(t->entries[1]);
                t->entries.back().encoding.group_size = 32;  // same canonical
              }),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("table.entries[3] repeats table.entries[1]: "
                                 "tag TEMPORAL_OLDER/MODALITY_TEXT/ROLE_USER "
                                 "encoding int4")));
}

TEST(CalibrationStoreTest, PutGetAndTheModelLimit) {
  CalibrationStore store;
  EXPECT_THAT(store.Get("tiny-cal"),
              StatusIs(C::kNotFound,
                       "model \"tiny-cal\" has no calibration table; "
                       "PutCalibration it"));
  auto n = store.Put(*CalibrationStore::Build(Table()));
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(*n, 3u);
  auto got = store.Get("tiny-cal");
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ((*got)->info.entries.size(), 3u);
  // Replaced whole; holders of the old version keep it.
  CalibrationTableInfo two = Table();
  two.entries.pop_back();
  ASSERT_THAT(store.Put(*CalibrationStore::Build(two)), IsOk());
  EXPECT_EQ((*got)->info.entries.size(), 3u);
  EXPECT_EQ((*store.Get("tiny-cal"))->info.entries.size(), 2u);
  for (size_t i = 1; i < kMaxCalibrationModels; ++i) {
    ASSERT_THAT(
        store.Put(*CalibrationStore::Build(Table(absl::StrCat("m", i)))),
        IsOk());
  }
  EXPECT_EQ(store.size(), kMaxCalibrationModels);
  EXPECT_THAT(store.Put(*CalibrationStore::Build(Table("extra"))),
              StatusIs(C::kResourceExhausted,
                       "table.model \"extra\" would be calibrated model "
                       "number 1025; the limit is 1024; over by 1"));
  EXPECT_THAT(store.Put(*CalibrationStore::Build(Table("m5"))), IsOk());
}

TEST(CalibrationStoreTest, LookupsForPoliciesAndThePressureRanking) {
  CalibrationStore store;
  EXPECT_THAT(store.ForPolicy(*AllocPolicy("tiny-cal"), Shape()),
              StatusIs(C::kFailedPrecondition,
                       "policy \"alloc\" needs the calibration table of model "
                       "\"tiny-cal\", which is not stored; PutCalibration it "
                       "first"));
  ASSERT_THAT(store.Put(*CalibrationStore::Build(Table())), IsOk());
  auto t = store.ForPolicy(*AllocPolicy("tiny-cal"), Shape());
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ((*t)->info.model, "tiny-cal");
  ModelShape other = Shape();
  other.n_q_heads = 8;
  EXPECT_THAT(store.ForPolicy(*AllocPolicy("tiny-cal"), other),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("calibration \"tiny-cal\" was measured on "
                                 "n_layers 2, n_kv_heads 2, n_q_heads 4, "
                                 "head_dim 64; the model has n_layers 2, "
                                 "n_kv_heads 2, n_q_heads 8, head_dim 64")));
  // The ranking's fallback: the table stored under the model's own name,
  // when the shapes match.
  ModelShape named = Shape();
  named.name = "tiny-cal";
  ASSERT_NE(store.ForModel(named), nullptr);
  EXPECT_EQ((*store.ForModel(named))->info.model, "tiny-cal");
  EXPECT_EQ(store.ForModel(Shape()), nullptr);  // name "tiny"
  named.head_dim = 128;
  EXPECT_EQ(store.ForModel(named), nullptr);
}

}  // namespace
}  // namespace triax::manager
