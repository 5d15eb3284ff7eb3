// TenantLedger (tenant_ledger.h) through its own interface: budget checks,
// creation and lookup, admission against the device ceiling, overage after
// a lowered budget, and the TenantInfo view.
#include "kvmanager/tenant_ledger.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);

TEST(TenantLedgerTest, BudgetsAreChecked) {
  EXPECT_THAT(TenantLedger::ValidateBudget("b", {Tier::kDevice, 10, 20}),
              IsOk());
  EXPECT_THAT(TenantLedger::ValidateBudget("b", {Tier::kUnspecified, 0, 20}),
              StatusIs(C::kInvalidArgument, "b.tier is TIER_UNSPECIFIED"));
  EXPECT_THAT(
      TenantLedger::ValidateBudget("b", {Tier::kHost, 0, 0}),
      StatusIs(C::kInvalidArgument, "b.ceiling_bytes is 0; it must be > 0"));
  EXPECT_THAT(TenantLedger::ValidateBudget("b", {Tier::kDisk, 30, 20}),
              StatusIs(C::kInvalidArgument,
                       "b.floor_bytes 30 exceeds ceiling_bytes 20"));
  auto ok = TenantLedger::ValidateBudgets(
      {{Tier::kHost, 0, 5}, {Tier::kDevice, 1, 9}});
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ((*ok)[kDev]->ceiling_bytes, 9u);
  EXPECT_EQ((*ok)[kHost]->ceiling_bytes, 5u);
  EXPECT_FALSE((*ok)[static_cast<int>(Tier::kDisk)].has_value());
  EXPECT_THAT(TenantLedger::ValidateBudgets(
                  {{Tier::kDevice, 0, 5}, {Tier::kDevice, 0, 9}}),
              StatusIs(C::kInvalidArgument,
                       "budgets[1].tier TIER_DEVICE appears twice"));
  EXPECT_THAT(TenantLedger::ValidateBudgets({{Tier::kDevice, 0, 0}}),
              StatusIs(C::kInvalidArgument, HasSubstr("budgets[0].ceiling")));
}

TEST(TenantLedgerTest, CreateAndFind) {
  TenantLedger ledger;
  auto t = ledger.Create("acme", {}, "bf16");
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ((*t)->id, "acme");
  EXPECT_EQ((*t)->default_policy, "bf16");
  EXPECT_THAT(ledger.Create("acme", {}, "int4"),
              StatusIs(C::kAlreadyExists, "tenant_id \"acme\" already exists"));
  EXPECT_EQ((*t)->default_policy, "bf16");  // unchanged
  auto found = ledger.Find("acme");
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(*found, *t);
  EXPECT_THAT(
      ledger.Find("nope"),
      StatusIs(C::kNotFound, "tenant_id \"nope\" is not a known tenant"));
  EXPECT_THAT(ledger.Find(""),
              StatusIs(C::kInvalidArgument, "tenant_id is empty"));
  EXPECT_EQ(ledger.FindOrNull("acme"), *t);
  EXPECT_EQ(ledger.FindOrNull("nope"), nullptr);
}

TEST(TenantLedgerTest, AdmissionAgainstTheDeviceCeiling) {
  TenantLedger ledger;
  TenantRecord* free = *ledger.Create("free", {}, "bf16");
  free->used[kDev] = uint64_t{1} << 50;
  EXPECT_THAT(TenantLedger::Admit(*free, uint64_t{1} << 50), IsOk());
  EXPECT_EQ(TenantLedger::DeviceOverage(*free), 0u);

  TenantLedger::Budgets budgets;
  budgets[kDev] = Budget{Tier::kDevice, 0, 49152};
  TenantRecord* acme = *ledger.Create("acme", budgets, "bf16");
  acme->used[kDev] = 40960;
  acme->used[kHost] = 1 << 20;  // other tiers do not count
  EXPECT_THAT(TenantLedger::Admit(*acme, 8192), IsOk());
  EXPECT_THAT(TenantLedger::Admit(*acme, 12288),
              StatusIs(C::kResourceExhausted,
                       "tenant \"acme\" tier TIER_DEVICE: request needs "
                       "12288 bytes, 40960 of ceiling 49152 in use; over by "
                       "4096 bytes"));
  // A lowered ceiling leaves the tenant over it.
  TenantLedger::SetBudget(acme, Budget{Tier::kDevice, 0, 32768});
  EXPECT_EQ(TenantLedger::DeviceOverage(*acme), 8192u);
  EXPECT_THAT(TenantLedger::Admit(*acme, 0),
              StatusIs(C::kResourceExhausted, HasSubstr("over by 8192")));
  // A host budget does not touch the device one.
  TenantLedger::SetBudget(acme, Budget{Tier::kHost, 0, 1});
  EXPECT_EQ(acme->budgets[kDev]->ceiling_bytes, 32768u);
}

TEST(TenantLedgerTest, InfoAndList) {
  TenantLedger ledger;
  TenantLedger::Budgets budgets;
  budgets[kHost] = Budget{Tier::kHost, 5, 10};
  TenantRecord* z = *ledger.Create("zeta", budgets, "int4");
  ledger.Create("alpha", {}, "bf16").IgnoreError();
  z->used[kDev] = 3;
  z->used[kHost] = 4;
  z->open_sequences = 2;
  const TenantInfo info = TenantLedger::Info(*z);
  EXPECT_EQ(info.tenant_id, "zeta");
  ASSERT_EQ(info.budgets.size(), 1u);  // only tiers with a budget
  EXPECT_EQ(info.budgets[0].tier, Tier::kHost);
  ASSERT_EQ(info.usage.size(), 3u);  // DEVICE, HOST, DISK
  EXPECT_EQ(info.usage[0].tier, Tier::kDevice);
  EXPECT_EQ(info.usage[0].used_bytes, 3u);
  EXPECT_EQ(info.usage[1].used_bytes, 4u);
  EXPECT_EQ(info.usage[2].used_bytes, 0u);
  EXPECT_EQ(info.open_sequences, 2u);
  EXPECT_EQ(info.default_policy, "int4");
  const std::vector<TenantInfo> list = ledger.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].tenant_id, "alpha");
  EXPECT_EQ(list[1].tenant_id, "zeta");
}

}  // namespace
}  // namespace triax::manager
