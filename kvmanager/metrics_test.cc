#include "kvmanager/metrics.h"

#include <map>
#include <optional>
#include <string>

#include "kvmanager/manager_core_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::testing::Optional;

// The value of the sample of `name` whose labels are exactly `labels`.
std::optional<double> Sample(const std::vector<prometheus::MetricFamily>& fs,
                             const std::string& name,
                             const std::map<std::string, std::string>& labels) {
  for (const auto& f : fs) {
    if (f.name != name) continue;
    for (const auto& m : f.metric) {
      std::map<std::string, std::string> have;
      for (const auto& l : m.label) have[l.name] = l.value;
      if (have != labels) continue;
      return f.type == prometheus::MetricType::Counter ? m.counter.value
                                                       : m.gauge.value;
    }
  }
  return std::nullopt;
}

// Sum of every sample of `name` whose labels include `match`.
double Sum(const std::vector<prometheus::MetricFamily>& fs,
           const std::string& name,
           const std::map<std::string, std::string>& match) {
  double total = 0;
  for (const auto& f : fs) {
    if (f.name != name) continue;
    for (const auto& m : f.metric) {
      bool ok = true;
      for (const auto& [k, v] : match) {
        bool found = false;
        for (const auto& l : m.label) found |= l.name == k && l.value == v;
        ok &= found;
      }
      if (ok) total += m.gauge.value + m.counter.value;
    }
  }
  return total;
}

class ManagerMetricsTest : public CoreTest {};

TEST_F(ManagerMetricsTest, BlocksAndBytesFollowOpensAndCloses) {
  ManagerMetrics metrics(core_.get(), nullptr);
  auto a = Open({S(Role::kSystem, 32), S(Role::kUser, 40)});
  ASSERT_THAT(a, ::triax::testing::IsOk());
  auto b = Open({S(Role::kUser, 20)});
  ASSERT_THAT(b, ::triax::testing::IsOk());
  const double blocks = a->blocks.size() + b->blocks.size();

  auto fs = metrics.Collect();
  EXPECT_EQ(Sum(fs, "triaxkv_manager_blocks", {{"tenant", "acme"}}), blocks);
  EXPECT_EQ(Sum(fs, "triaxkv_manager_blocks", {{"tier", "device"}}), blocks);
  // The block bytes are what the tenant is charged on the device.
  EXPECT_EQ(Sum(fs, "triaxkv_manager_block_bytes", {{"tenant", "acme"}}),
            static_cast<double>(DeviceUsage()));
  EXPECT_THAT(Sample(fs, "triaxkv_manager_tenant_used_bytes",
                     {{"tenant", "acme"}, {"tier", "device"}}),
              Optional(static_cast<double>(DeviceUsage())));
  // The system prompt takes BF16 under the default triaxial policy.
  EXPECT_GT(Sum(fs, "triaxkv_manager_blocks", {{"encoding", "bf16"}}), 0);
  EXPECT_THAT(
      Sample(fs, "triaxkv_manager_events_total", {{"kind", "block_created"}}),
      Optional(blocks));
  EXPECT_THAT(
      Sample(fs, "triaxkv_manager_events_total", {{"kind", "sequence_opened"}}),
      Optional(2.0));
  EXPECT_THAT(
      Sample(fs, "triaxkv_manager_tenant_open_sequences", {{"tenant", "acme"}}),
      Optional(2.0));

  ASSERT_THAT(core_->CloseSequence({"", "acme", a->sequence_id}),
              ::triax::testing::IsOk());
  fs = metrics.Collect();
  EXPECT_EQ(Sum(fs, "triaxkv_manager_blocks", {}),
            static_cast<double>(b->blocks.size()));
  EXPECT_THAT(
      Sample(fs, "triaxkv_manager_events_total", {{"kind", "block_freed"}}),
      Optional(static_cast<double>(a->blocks.size())));
  EXPECT_THAT(
      Sample(fs, "triaxkv_manager_events_total", {{"kind", "sequence_closed"}}),
      Optional(1.0));
}

TEST_F(ManagerMetricsTest, WorkersPoolsAndWatermarks) {
  ManagerMetrics metrics(core_.get(), nullptr);
  const auto fs = metrics.Collect();
  EXPECT_THAT(Sample(fs, "triaxkv_manager_workers", {{"state", "up"}}),
              Optional(1.0));
  EXPECT_THAT(Sample(fs, "triaxkv_manager_workers", {{"state", "down"}}),
              Optional(0.0));
  EXPECT_THAT(Sample(fs, "triaxkv_manager_worker_capacity_bytes",
                     {{"worker", "w1"}, {"tier", "device"}}),
              Optional(static_cast<double>(1ull << 40)));
  const auto cap = Sample(fs, "triaxkv_manager_pool_capacity_bytes",
                          {{"worker", "w1"}, {"tier", "device"}});
  const auto high = Sample(fs, "triaxkv_manager_pool_high_watermark_bytes",
                           {{"worker", "w1"}, {"tier", "device"}});
  const auto low = Sample(fs, "triaxkv_manager_pool_low_watermark_bytes",
                          {{"worker", "w1"}, {"tier", "device"}});
  ASSERT_TRUE(cap && high && low);
  EXPECT_EQ(*cap, static_cast<double>(1ull << 40));
  EXPECT_LT(*low, *high);
  EXPECT_LT(*high, *cap);
  EXPECT_THAT(Sample(fs, "triaxkv_manager_pressure_actions_total",
                     {{"action", "spill"}}),
              Optional(0.0));
}

TEST_F(ManagerMetricsTest, TenantsPastTheLimitAreSummedAsOther) {
  ASSERT_THAT(core_->CreateTenant({"", "zeta", {}, ""}),
              ::triax::testing::IsOk());
  ASSERT_THAT(Open({S(Role::kUser, 40)}, "zeta"), ::triax::testing::IsOk());
  ASSERT_THAT(Open({S(Role::kUser, 40)}, "acme"), ::triax::testing::IsOk());
  ManagerMetricsOptions options;
  options.max_tenants = 1;
  ManagerMetrics metrics(core_.get(), nullptr, options);
  const auto fs = metrics.Collect();
  EXPECT_THAT(Sample(fs, "triaxkv_manager_tenants", {}), Optional(2.0));
  EXPECT_EQ(Sum(fs, "triaxkv_manager_block_bytes", {{"tenant", "_other"}}),
            static_cast<double>(DeviceUsage("zeta")));
  EXPECT_EQ(Sum(fs, "triaxkv_manager_blocks", {{"tenant", "zeta"}}), 0);
  EXPECT_THAT(Sample(fs, "triaxkv_manager_tenant_used_bytes",
                     {{"tenant", "_other"}, {"tier", "device"}}),
              Optional(static_cast<double>(DeviceUsage("zeta"))));
  EXPECT_GT(Sum(fs, "triaxkv_manager_blocks", {{"tenant", "acme"}}), 0);
}

TEST_F(ManagerMetricsTest, AdmissionRefusalsComeFromTheRpcSeries) {
  RpcMetrics rpc("triaxkv_manager");
  ManagerMetrics metrics(core_.get(), &rpc);
  const int exhausted = static_cast<int>(absl::StatusCode::kResourceExhausted);
  rpc.Record("triax.v1.Manager", "OpenSequence", exhausted,
             absl::Milliseconds(1));
  rpc.Record("triax.v1.Manager", "OpenSequence", exhausted,
             absl::Milliseconds(1));
  rpc.Record("triax.v1.Manager", "OpenSequence", 0, absl::Milliseconds(1));
  rpc.Record("triax.v1.Manager", "ExtendSequence", exhausted,
             absl::Milliseconds(1));
  const auto fs = metrics.Collect();
  EXPECT_THAT(Sample(fs, "triaxkv_manager_admission_refusals_total",
                     {{"method", "OpenSequence"}}),
              Optional(2.0));
  EXPECT_THAT(Sample(fs, "triaxkv_manager_admission_refusals_total",
                     {{"method", "ExtendSequence"}}),
              Optional(1.0));
  EXPECT_THAT(Sample(fs, "triaxkv_manager_admission_refusals_total",
                     {{"method", "TransferSequence"}}),
              Optional(0.0));
}

TEST(ManagerReadinessTest, ServingAndTheLeaderHook) {
  ManagerReadiness r;
  EXPECT_EQ(r.Ready().status, 503);
  EXPECT_EQ(r.Ready().body, "not serving\n");
  r.SetServing(true);
  EXPECT_EQ(r.Ready().status, 200);
  r.SetLeaderCheck([] { return absl::UnavailableError("follower of m2"); });
  EXPECT_EQ(r.Ready().status, 503);
  EXPECT_THAT(r.Ready().body, HasSubstr("not the leader: follower of m2"));
  r.SetLeaderCheck([] { return absl::OkStatus(); });
  EXPECT_EQ(r.Ready().status, 200);
  r.SetServing(false);
  EXPECT_EQ(r.Ready().status, 503);
}

}  // namespace
}  // namespace triax::manager
