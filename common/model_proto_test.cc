#include "common/model_proto.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"
#include "triax/v1/manager.pb.h"

namespace triax {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

TEST(ModelProtoTest, ModelShapeRoundTrips) {
  const ModelShape m{"llama", 32, 8, 32, 128};
  v1::ModelShape p;
  ToProto(m, &p);
  EXPECT_EQ(p.n_layers(), 32u);
  EXPECT_EQ(p.head_dim(), 128u);
  const ModelShape back = FromProto(p);
  EXPECT_EQ(back.name, "llama");
  EXPECT_EQ(back.n_layers, 32u);
  EXPECT_EQ(back.n_kv_heads, 8u);
  EXPECT_EQ(back.n_q_heads, 32u);
  EXPECT_EQ(back.head_dim, 128u);
}

TEST(ModelProtoTest, TagRoundTripsAndKeepsOutOfRangeValues) {
  const Tag t{Temporal::kOlder, Modality::kImage, Role::kToolCall};
  v1::Tag p;
  ToProto(t, &p);
  EXPECT_EQ(p.role(), v1::ROLE_TOOL_CALL);
  EXPECT_EQ(FromProto(p), t);
  v1::Tag bad;
  bad.set_role(static_cast<v1::Role>(77));
  EXPECT_EQ(FromProto(bad).role, static_cast<Role>(77));
  EXPECT_FALSE(IsValid(FromProto(bad).role));
}

TEST(ModelProtoTest, EncodingFieldsFromAnyMessage) {
  v1::BlockPlan b;
  b.set_format(v1::FORMAT_INT4);
  Encoding e = EncodingFromProto(b);
  EXPECT_EQ(e, Encoding(Format::kINT4));  // format_v unspecified = K format
  EXPECT_EQ(e.scale_dtype, ScaleDtype::kFP16);
  EXPECT_EQ(e.group, 0);

  v1::BlockEncoding be;
  be.set_format(v1::FORMAT_INT4);
  be.set_format_v(v1::FORMAT_INT2);
  be.set_group_size(64);
  be.set_scale_dtype(v1::SCALE_DTYPE_FP8_E4M3);
  EXPECT_EQ(EncodingFromProto(be),
            Encoding(Format::kINT4, Format::kINT2, 64, ScaleDtype::kFP8));

  v1::PolicyRule r;
  r.set_format(v1::FORMAT_TQ4);
  EXPECT_EQ(EncodingFromProto(r), Encoding(Format::kTQ4));
}

TEST(ModelProtoTest, OutOfRangeWireValuesAreRefusedByName) {
  v1::BlockPlan b;
  b.set_format(static_cast<v1::Format>(300));  // wraps to 44 if cast to u8
  EXPECT_EQ(EncodingFromProto(b).k, static_cast<Format>(255));
  EXPECT_THAT(ValidateEncodingFields(EncodingFromProto(b), "blocks[0]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].format=255")));
  b.set_format(v1::FORMAT_UNSPECIFIED);
  EXPECT_THAT(ValidateEncodingFields(EncodingFromProto(b), "blocks[0]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].format=0")));
  b.set_format(v1::FORMAT_INT8);
  b.set_scale_dtype(static_cast<v1::ScaleDtype>(9));
  EXPECT_THAT(ValidateEncodingFields(EncodingFromProto(b), "blocks[0]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].scale_dtype=9")));
  b.set_scale_dtype(v1::SCALE_DTYPE_FP16);
  b.set_group_size(4000000000u);
  EXPECT_THAT(ValidateEncodingFields(EncodingFromProto(b), "blocks[0]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks[0].group_size=")));
}

TEST(ModelProtoTest, EncodingToProtoIsCanonical) {
  v1::BlockPlan p;
  EncodingToProto(Encoding(Format::kFP8), &p);
  EXPECT_EQ(p.format(), v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(p.format_v(), v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(p.group_size(), 0u);  // no INT format: group means nothing
  EXPECT_EQ(p.scale_dtype(), v1::SCALE_DTYPE_UNSPECIFIED);

  EncodingToProto(Encoding(Format::kBF16, Format::kINT2), &p);
  EXPECT_EQ(p.format_v(), v1::FORMAT_INT2);
  EXPECT_EQ(p.group_size(), 32u);  // group 0 is written as 32
  EXPECT_EQ(p.scale_dtype(), v1::SCALE_DTYPE_FP16);
  EXPECT_EQ(EncodingFromProto(p), Encoding(Format::kBF16, Format::kINT2));
}

TEST(ModelProtoTest, BlockSpecRoundTrips) {
  BlockSpec s;
  s.index = 3;
  s.lineage_id = 99;
  s.first_token = 48;
  s.num_tokens = 7;
  s.encoding = Encoding(Format::kINT8, Format::kINT4, 128, ScaleDtype::kFP8);
  s.tier = Tier::kHost;
  s.evicted = true;
  v1::BlockPlan p;
  ToProto(s, &p);
  EXPECT_EQ(p.tier(), v1::TIER_HOST);
  const BlockSpec back = FromProto(p);
  EXPECT_EQ(back.index, 3u);
  EXPECT_EQ(back.lineage_id, 99u);
  EXPECT_EQ(back.first_token, 48u);
  EXPECT_EQ(back.num_tokens, 7u);
  EXPECT_EQ(back.encoding, s.encoding);
  EXPECT_EQ(back.tier, Tier::kHost);
  EXPECT_TRUE(back.evicted);
  // Unspecified tier stays unspecified (a worker reads it as the device).
  p.set_tier(v1::TIER_UNSPECIFIED);
  EXPECT_EQ(FromProto(p).tier, Tier::kUnspecified);
}

}  // namespace
}  // namespace triax
