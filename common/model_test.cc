#include "common/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "common/status_matchers.h"

namespace triax {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::IsOk;
using testing::IsOkAndHolds;
using testing::StatusIs;

ModelShape Shape() { return ModelShape{"m", 4, 2, 8, 64}; }

TEST(ModelShapeTest, AcceptsAValidShape) {
  EXPECT_THAT(ValidateModelShape(Shape()), IsOk());
  ModelShape edge{"", 1024, 1024, 1024, 512};
  EXPECT_THAT(ValidateModelShape(edge), IsOk());
  ModelShape small{"", 1, 1, 1024, 2};
  EXPECT_THAT(ValidateModelShape(small), IsOk());
}

TEST(ModelShapeTest, NamesTheFieldAndTheValue) {
  ModelShape m = Shape();
  m.n_layers = 0;
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.n_layers=0")));
  m = Shape();
  m.n_layers = 1025;
  EXPECT_THAT(ValidateModelShape(m, "table.shape"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("table.shape.n_layers=1025")));
  m = Shape();
  m.n_kv_heads = 0;
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.n_kv_heads=0")));
  m = Shape();
  m.n_q_heads = 3;  // not a multiple of 2
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.n_q_heads=3")));
  m = Shape();
  m.n_q_heads = 0;
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.n_q_heads=0")));
  m = ModelShape{"", 1, 1, 1025, 64};  // GQA ratio over 1024
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.n_q_heads=1025")));
  m = Shape();
  m.head_dim = 7;
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.head_dim=7")));
  m.head_dim = 514;
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.head_dim=514")));
  m = Shape();
  m.name = std::string(257, 'x');
  EXPECT_THAT(ValidateModelShape(m),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.name is 257 bytes")));
}

TEST(ModelShapeTest, PageShapeOfIsBlockTokensByKvHeadsByHeadDim) {
  const kernels::PageShape s = PageShapeOf(Shape(), 16);
  EXPECT_EQ(s.tokens, 16);
  EXPECT_EQ(s.heads, 2);
  EXPECT_EQ(s.head_dim, 64);
}

TEST(NamesTest, ProtoNamesAndLabels) {
  EXPECT_EQ(RoleName(Role::kToolSchema), "ROLE_TOOL_SCHEMA");
  EXPECT_EQ(RoleName(static_cast<Role>(42)), "ROLE(42)");
  EXPECT_EQ(ModalityName(Modality::kImage), "MODALITY_IMAGE");
  EXPECT_EQ(TemporalName(Temporal::kRecentTurns), "TEMPORAL_RECENT_TURNS");
  EXPECT_EQ(TierName(Tier::kDisk), "TIER_DISK");
  EXPECT_EQ(TierName(static_cast<Tier>(-1)), "TIER(-1)");
  EXPECT_EQ(FormatProtoName(Format::kFP8), "FORMAT_FP8_E4M3");
  EXPECT_EQ(FormatProtoName(static_cast<Format>(9)), "FORMAT(9)");

  EXPECT_EQ(RoleLabel(Role::kToolResult), "tool_result");
  EXPECT_EQ(ModalityLabel(Modality::kAudio), "audio");
  EXPECT_EQ(TemporalLabel(Temporal::kCurrentTurn), "current_turn");
  EXPECT_EQ(TierLabel(Tier::kHost), "host");
  EXPECT_EQ(TierLabel(static_cast<Tier>(7)), "tier(7)");
  EXPECT_EQ(TagLabel(Tag{Temporal::kOlder, Modality::kUnspecified,
                         Role::kToolSchema}),
            "older/text/tool_schema");
}

TEST(NamesTest, ParseRoleListRoundTripsLabels) {
  EXPECT_THAT(ParseRoleList(" system, tool_call ,,delimiter"),
              IsOkAndHolds(ElementsAre(Role::kSystem, Role::kToolCall,
                                       Role::kDelimiter)));
  EXPECT_THAT(ParseRoleList(""), IsOkAndHolds(ElementsAre()));
  for (int i = 1; i < kNumRoles; ++i) {
    const Role r = static_cast<Role>(i);
    EXPECT_THAT(ParseRoleList(RoleLabel(r)), IsOkAndHolds(ElementsAre(r)));
  }
  EXPECT_THAT(
      ParseRoleList("system,wizard"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"wizard\"")));
  EXPECT_THAT(ParseRoleList("unspecified"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"unspecified\"")));
}

TEST(ValidityTest, EnumRanges) {
  EXPECT_FALSE(IsValid(Role::kUnspecified));
  EXPECT_TRUE(IsValid(Role::kSystem));
  EXPECT_TRUE(IsValid(Role::kDelimiter));
  EXPECT_FALSE(IsValid(static_cast<Role>(9)));
  EXPECT_TRUE(IsValid(Modality::kUnspecified));
  EXPECT_FALSE(IsValid(static_cast<Modality>(4)));
  EXPECT_FALSE(IsValid(Temporal::kUnspecified));
  EXPECT_TRUE(IsValid(Temporal::kOlder));
  EXPECT_FALSE(IsValid(Tier::kUnspecified));
  EXPECT_TRUE(IsValid(Tier::kDisk));
  EXPECT_FALSE(IsValid(static_cast<Tier>(4)));
  EXPECT_FALSE(IsValidFormat(static_cast<Format>(0)));
  EXPECT_TRUE(IsValidFormat(Format::kTQ2));
  EXPECT_FALSE(IsValidFormat(static_cast<Format>(9)));
}

TEST(TagTest, OrdersByTemporalThenModalityThenRole) {
  std::map<Tag, int> m;
  m[Tag{Temporal::kOlder, Modality::kText, Role::kUser}] = 3;
  m[Tag{Temporal::kSink, Modality::kText, Role::kToolCall}] = 2;
  m[Tag{Temporal::kSink, Modality::kText, Role::kSystem}] = 1;
  m[Tag{Temporal::kSink, Modality::kText, Role::kSystem}] = 1;
  ASSERT_EQ(m.size(), 3u);
  int want = 1;
  for (const auto& [tag, v] : m) EXPECT_EQ(v, want++);
  EXPECT_NE((Tag{Temporal::kSink, Modality::kText, Role::kUser}),
            (Tag{Temporal::kSink, Modality::kImage, Role::kUser}));
}

TEST(TemporalForTest, SinkCurrentRecentOlder) {
  // Block 0 is the sink whatever its turn.
  EXPECT_EQ(TemporalFor(0, 0, 9, 2), Temporal::kSink);
  EXPECT_EQ(TemporalFor(5, 9, 9, 2), Temporal::kCurrentTurn);
  EXPECT_EQ(TemporalFor(5, 8, 9, 2), Temporal::kRecentTurns);
  EXPECT_EQ(TemporalFor(5, 7, 9, 2), Temporal::kRecentTurns);
  EXPECT_EQ(TemporalFor(5, 6, 9, 2), Temporal::kOlder);
  EXPECT_EQ(TemporalFor(5, 8, 9, 0), Temporal::kOlder);
}

TEST(EncodingFieldsTest, RefusesEachFieldByName) {
  EXPECT_THAT(ValidateEncodingFields(Encoding(Format::kINT4), "blocks[0]"),
              IsOk());
  EXPECT_THAT(
      ValidateEncodingFields(
          Encoding(Format::kINT4, Format::kINT2, 128, ScaleDtype::kFP8), "b"),
      IsOk());
  Encoding e(Format::kINT4);
  e.k = static_cast<Format>(0);
  EXPECT_THAT(ValidateEncodingFields(e, "blocks[3]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[3].format=0")));
  e = Encoding(Format::kINT4);
  e.v = static_cast<Format>(9);
  EXPECT_THAT(ValidateEncodingFields(e, "blocks[1]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[1].format_v=9")));
  e = Encoding(Format::kINT4);
  e.group = 48;
  EXPECT_THAT(ValidateEncodingFields(e, "b"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("b.group_size=48")));
  e = Encoding(Format::kINT4);
  e.scale_dtype = static_cast<ScaleDtype>(3);
  EXPECT_THAT(ValidateEncodingFields(e, "b"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("b.scale_dtype=3")));
}

}  // namespace
}  // namespace triax
