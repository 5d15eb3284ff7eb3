// The daemons from the outside, as an operator or Kubernetes sees them:
// both serve grpc.health.v1.Health (the worker also per service, for its
// readiness probe), kvworker's --help explains it and lists its flags,
// contradicting flags stop it at start-up naming them, and SIGTERM ends it
// with status 0.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <vector>

#include "common/health_check.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"

namespace triax::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::shared_ptr<grpc::Channel> Dial(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

TEST(DaemonTest, BothServeHealthAndTheWorkerStopsOnSigterm) {
  ClusterOptions o;
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  auto worker = Dial(cluster.worker_process(0)->address());
  auto manager = Dial(cluster.manager_address());

  auto overall = CheckHealth(worker, "");
  ASSERT_THAT(overall, IsOk());
  EXPECT_EQ(*overall, ServingStatus::kServing);
  auto service = CheckHealth(worker, "triax.v1.Worker");
  ASSERT_THAT(service, IsOk());
  EXPECT_EQ(*service, ServingStatus::kServing);
  auto manager_overall = CheckHealth(manager, "");
  ASSERT_THAT(manager_overall, IsOk());
  EXPECT_EQ(*manager_overall, ServingStatus::kServing);

  Process* w = cluster.worker_process(0);
  ASSERT_EQ(::kill(w->pid(), SIGTERM), 0);
  auto code = w->Wait(absl::Seconds(10));
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 0) << w->Log();
}

TEST(DaemonTest, KvworkerHelpExplainsItselfAndListsItsFlags) {
  auto dir = TempDir::Create("daemon");
  ASSERT_THAT(dir, IsOk());
  std::string out, err;
  auto rc = RunToCompletion("kvworker", {"--help"}, (*dir)->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_THAT(
      out + err,
      AllOf(HasSubstr("triaxkv data plane"), HasSubstr("grpc.health.v1.Health"),
            HasSubstr("Exit status"), HasSubstr("--listen"),
            HasSubstr("--pool_mb"), HasSubstr("--manager"),
            HasSubstr("--disk_tier_dir"), HasSubstr("--restore_on_attend")));
}

TEST(DaemonTest, KvworkerRefusesContradictingFlagsNamingThem) {
  auto dir = TempDir::Create("daemon");
  ASSERT_THAT(dir, IsOk());
  const std::vector<
      std::pair<std::vector<std::string>, std::vector<std::string>>>
      cases = {
          {{"--backend=cpu", "--cuda_device=1"},
           {"--cuda_device=1", "--backend=cpu"}},
          {{"--disk_tier_dir=/tmp/nowhere", "--disk_tier_mb=0"},
           {"--disk_tier_dir=\"/tmp/nowhere\"", "--disk_tier_mb=0"}},
          {{"--advertise=10.0.0.5:7071"},
           {"--advertise=\"10.0.0.5:7071\"", "--manager is empty"}},
          {{"--pool_mb=0"}, {"--pool_mb=0"}},
          {{"--window_tokens=-1"}, {"--window_tokens=-1"}},
      };
  for (const auto& [args, words] : cases) {
    std::string out, err;
    auto rc = RunToCompletion("kvworker", args, (*dir)->path(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 2) << args[0] << ": " << err;
    for (const std::string& word : words) {
      EXPECT_THAT(err, HasSubstr(word)) << args[0];
    }
    EXPECT_THAT(out, ::testing::Not(HasSubstr("listening")));
  }
}

}  // namespace
}  // namespace triax::testing
