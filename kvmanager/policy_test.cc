// Policies (policy.h): the built-ins, canonical encodings and their wire
// form, and first-match rule lookup.
#include "kvmanager/policy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::triax::testing::IsOk;

PolicyRuleInfo R(Temporal t, Role r, Format k, Format v = Format(0),
                 uint32_t group = 0, int scale = 0) {
  PolicyRuleInfo rule;
  rule.temporal = t;
  rule.role = r;
  rule.encoding = EncodingSpec{k, v, group, scale};
  return rule;
}

TEST(PolicyTest, BuiltinsAndCanonicalEncodings) {
  std::vector<std::string> names;
  for (const auto& p : BuiltinPolicies()) {
    names.push_back(p->name);
    EXPECT_TRUE(p->builtin);
    EXPECT_TRUE(p->rules.back().IsCatchAll());
  }
  EXPECT_THAT(names, ElementsAre("triaxial-static", "bf16", "fp8", "int8",
                                 "int4", "int2", "tq4", "tq3", "tq2"));
  EXPECT_EQ(FindBuiltinPolicy("tq2")->EncodingFor({}), Format::kTQ2);
  EXPECT_EQ(FindBuiltinPolicy("nope"), nullptr);
  // Group and scale dtype only matter with an INT format.
  const Encoding tq = CanonicalEncoding(
      Encoding(Format::kTQ3, Format::kTQ3, 64, ScaleDtype::kFP8));
  EXPECT_EQ(tq.group, 0);
  EXPECT_EQ(tq.scale_dtype, ScaleDtype::kFP16);
  auto e =
      ResolveEncoding("x", EncodingSpec{Format::kFP8, Format::kINT4, 0, 2});
  ASSERT_THAT(e, IsOk());
  EXPECT_EQ(e->k, Format::kFP8);
  EXPECT_EQ(e->v, Format::kINT4);
  EXPECT_EQ(e->group, 32);
  EXPECT_EQ(e->scale_dtype, ScaleDtype::kFP8);
  const EncodingSpec spec = SpecOf(*e);
  EXPECT_EQ(spec.group_size, 32u);
  EXPECT_EQ(spec.scale_dtype, 2);
  EXPECT_EQ(SpecOf(Format::kBF16).group_size, 0u);
  EXPECT_EQ(SpecOf(Format::kBF16).format_v, Format::kBF16);
}

TEST(PolicyTest, FirstMatchingRuleWins) {
  PolicyInfo info;
  info.name = "p";
  PolicyRuleInfo img =
      R(Temporal::kUnspecified, Role::kUnspecified, Format::kINT8);
  img.modality = Modality::kImage;
  info.rules = {R(Temporal::kOlder, Role::kUser, Format::kINT2), img,
                R(Temporal::kOlder, Role::kUnspecified, Format::kINT4),
                R(Temporal::kUnspecified, Role::kUnspecified, Format::kFP8)};
  auto p = BuildPolicy(info);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ((*p)->EncodingFor({Temporal::kOlder, Modality::kText, Role::kUser}),
            Format::kINT2);
  EXPECT_EQ(
      (*p)->EncodingFor({Temporal::kOlder, Modality::kImage, Role::kUser}),
      Format::kINT2);
  EXPECT_EQ(
      (*p)->EncodingFor({Temporal::kOlder, Modality::kImage, Role::kSystem}),
      Format::kINT8);
  EXPECT_EQ(
      (*p)->EncodingFor({Temporal::kOlder, Modality::kText, Role::kSystem}),
      Format::kINT4);
  EXPECT_EQ((*p)->EncodingFor({Temporal::kSink, Modality::kText, Role::kUser}),
            Format::kFP8);
}

}  // namespace
}  // namespace triax::manager
