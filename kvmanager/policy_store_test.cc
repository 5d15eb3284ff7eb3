// PolicyStore (policy_store.h) through its own interface: lookup of
// built-in and operator policies, replacement, the operator-policy limit,
// listing, and the check of a policy against a page shape.
#include "kvmanager/policy_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

// A one-rule policy: every block in `f`.
std::shared_ptr<const Policy> Uniform(const std::string& name, Format f) {
  PolicyInfo info;
  info.name = name;
  PolicyRuleInfo rule;
  rule.encoding.format = f;
  info.rules = {rule};
  auto p = BuildPolicy(info);
  EXPECT_THAT(p, IsOk());
  return p.ok() ? *p : nullptr;
}

TEST(PolicyStoreTest, FindsBuiltinsThenOperatorPolicies) {
  PolicyStore store;
  auto b = store.Find("policy", "int4");
  ASSERT_THAT(b, IsOk());
  EXPECT_TRUE((*b)->builtin);
  ASSERT_THAT(store.Put(Uniform("zz-ops", Format::kINT8)), IsOk());
  ASSERT_THAT(store.Put(Uniform("aa-ops", Format::kFP8)), IsOk());
  auto o = store.Find("policy", "aa-ops");
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ((*o)->EncodingFor({}), Format::kFP8);
  // Unknown: the known names, built-ins in order, then operator ones sorted.
  EXPECT_THAT(
      store.Find("default_policy", "nope"),
      StatusIs(C::kInvalidArgument,
               "default_policy \"nope\" is not a known policy; known: "
               "triaxial-static, bf16, fp8, int8, int4, int2, tq4, tq3, tq2, "
               "aa-ops, zz-ops"));
}

TEST(PolicyStoreTest, PutReplacesButNeverABuiltin) {
  PolicyStore store;
  ASSERT_THAT(store.Put(Uniform("mine", Format::kINT8)), IsOk());
  std::shared_ptr<const Policy> v1 = *store.Find("policy", "mine");
  ASSERT_THAT(store.Put(Uniform("mine", Format::kINT2)), IsOk());
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ((*store.Find("policy", "mine"))->EncodingFor({}), Format::kINT2);
  EXPECT_EQ(v1->EncodingFor({}), Format::kINT8);  // holders keep their version
  EXPECT_THAT(store.Put(Uniform("tq3", Format::kINT8)),
              StatusIs(C::kFailedPrecondition,
                       "policy.name \"tq3\" is a built-in policy; built-in "
                       "policies cannot be replaced"));
  const std::vector<PolicyInfo> ops = store.ListOperator();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].name, "mine");
}

TEST(PolicyStoreTest, OperatorPoliciesAreLimited) {
  PolicyStore store;
  for (size_t i = 0; i < kMaxOperatorPolicies; ++i) {
    ASSERT_THAT(store.Put(Uniform(absl::StrCat("p", i), Format::kINT8)),
                IsOk());
  }
  EXPECT_THAT(store.Put(Uniform("one-more", Format::kINT8)),
              StatusIs(C::kResourceExhausted,
                       HasSubstr("would be operator policy number 1025; the "
                                 "limit is 1024; over by 1")));
  // Replacing one at the limit is fine.
  EXPECT_THAT(store.Put(Uniform("p7", Format::kINT2)), IsOk());
  const std::vector<PolicyInfo> ops = store.ListOperator();
  ASSERT_EQ(ops.size(), kMaxOperatorPolicies);
  EXPECT_EQ(ops[0].name, "p0");
  EXPECT_EQ(ops[1].name, "p1");
  EXPECT_EQ(ops[2].name, "p10");  // by name, not by insertion
}

TEST(PolicyStoreTest, PoliciesAreCheckedAgainstThePageShape) {
  const ModelShape model{"m", 2, 2, 4, 96};  // head_dim not a power of two
  EXPECT_THAT(CheckPolicyForShape(*FindBuiltinPolicy("int4"), model, 16),
              IsOk());
  EXPECT_THAT(
      CheckPolicyForShape(*FindBuiltinPolicy("tq3"), model, 16),
      StatusIs(C::kInvalidArgument,
               HasSubstr("policy \"tq3\" rules[0] encoding tq3 is invalid for "
                         "block_tokens 16, n_kv_heads 2, head_dim 96: ")));
  // INT key groups min(g, T) must divide T.
  EXPECT_THAT(CheckPolicyForShape(*FindBuiltinPolicy("int4"),
                                  ModelShape{"m", 2, 2, 4, 64}, 48),
              StatusIs(C::kInvalidArgument, HasSubstr("rules[0]")));
  // Allocation policies: their candidates too.
  PolicyInfo alloc;
  alloc.name = "alloc";
  alloc.budget_bits = 4;
  alloc.calibration_model = "m";
  alloc.candidates = {EncodingSpec{Format::kINT4, Format(0), 0, 0},
                      EncodingSpec{Format::kTQ4, Format(0), 0, 0}};
  auto p = BuildPolicy(alloc);
  ASSERT_THAT(p, IsOk());
  EXPECT_THAT(CheckPolicyForShape(**p, model, 16),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("policy \"alloc\" candidates[1] encoding "
                                 "tq4 is invalid")));
}

}  // namespace
}  // namespace triax::manager
