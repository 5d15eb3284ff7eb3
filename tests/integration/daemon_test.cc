// The daemons from the outside, as an operator or Kubernetes sees them:
// both serve grpc.health.v1.Health, overall and for their service (the
// readiness probes), --help explains each and lists its flags, --version
// (kvctl's too) prints the build's version, contradicting flags stop them at
// start-up naming the flags, a port in use stops them at start-up naming the
// address, and SIGTERM ends them with status 0.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "absl/strings/strip.h"
#include "common/health_check.h"
#include "common/logfmt.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::shared_ptr<grpc::Channel> Dial(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

TEST(DaemonTest, BothServeHealthAndStopOnSigterm) {
  ClusterOptions o;
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  auto worker = Dial(cluster.worker_process(0)->address());
  auto manager = Dial(cluster.manager_address());

  // The manager lists the worker UP as it answers RegisterWorker; the
  // worker's readiness ("") follows once that answer has arrived.
  absl::StatusOr<ServingStatus> overall = ServingStatus::kUnknown;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(10);
       absl::Now() < deadline; absl::SleepFor(absl::Milliseconds(10))) {
    overall = CheckHealth(worker, "");
    if (!overall.ok() || *overall == ServingStatus::kServing) break;
  }
  ASSERT_THAT(overall, IsOk());
  EXPECT_EQ(*overall, ServingStatus::kServing);
  auto service = CheckHealth(worker, "triax.v1.Worker");
  ASSERT_THAT(service, IsOk());
  EXPECT_EQ(*service, ServingStatus::kServing);
  auto manager_overall = CheckHealth(manager, "");
  ASSERT_THAT(manager_overall, IsOk());
  EXPECT_EQ(*manager_overall, ServingStatus::kServing);
  auto manager_service = CheckHealth(manager, "triax.v1.Manager");
  ASSERT_THAT(manager_service, IsOk());
  EXPECT_EQ(*manager_service, ServingStatus::kServing);

  for (Process* p : {cluster.worker_process(0), cluster.manager_process()}) {
    ASSERT_EQ(::kill(p->pid(), SIGTERM), 0);
    auto code = p->Wait(absl::Seconds(10));
    ASSERT_THAT(code, IsOk());
    EXPECT_EQ(*code, 0) << p->Log();
  }
}

TEST(DaemonTest, KvmanagerHelpExplainsItselfAndListsItsFlags) {
  auto dir = TempDir::Create("daemon");
  ASSERT_THAT(dir, IsOk());
  std::string out, err;
  auto rc =
      RunToCompletion("kvmanager", {"--help"}, (*dir)->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_THAT(
      out + err,
      AllOf(HasSubstr("triaxkv control plane"),
            HasSubstr("grpc.health.v1.Health"), HasSubstr("Exit status"),
            HasSubstr("--listen"), HasSubstr("--worker_timeout_ms"),
            HasSubstr("--worker_down_timeout_ms"), HasSubstr("--pressure_mode"),
            HasSubstr("--high_watermark"), HasSubstr("--closed_retention"),
            HasSubstr("--event_retention_bytes"),
            HasSubstr("--idempotency_capacity"),
            HasSubstr("--watcher_queue_limit"),
            HasSubstr("Retention and memory")));
}

TEST(DaemonTest, KvmanagerRefusesContradictingFlagsNamingThem) {
  auto dir = TempDir::Create("daemon");
  ASSERT_THAT(dir, IsOk());
  const std::vector<
      std::pair<std::vector<std::string>, std::vector<std::string>>>
      cases = {
          {{"--heartbeat_interval_ms=3000", "--worker_timeout_ms=3000"},
           {"--heartbeat_interval_ms=3000", "--worker_timeout_ms=3000"}},
          {{"--heartbeat_interval_ms=0"}, {"--heartbeat_interval_ms=0"}},
          {{"--worker_timeout_ms=5000", "--worker_down_timeout_ms=5000"},
           {"--worker_down_timeout_ms=5000", "--worker_timeout_ms=5000"}},
          {{"--worker_down_timeout_ms=100"},
           {"--worker_down_timeout_ms=100", "--worker_timeout_ms=3000"}},
          {{"--worker_rpc_timeout_ms=0"}, {"--worker_rpc_timeout_ms=0"}},
          {{"--pressure_interval_ms=-5"}, {"--pressure_interval_ms=-5"}},
          {{"--admission_deadline_ms=0"}, {"--admission_deadline_ms=0"}},
          {{"--admission_deadline_ms=-3"}, {"--admission_deadline_ms=-3"}},
          {{"--default_policy=fastest"}, {"fastest"}},
          {{"--pressure_mode=random"}, {"random"}},
          {{"--event_retention=0"}, {"--event_retention=0"}},
          {{"--idempotency_capacity=0"}, {"--idempotency_capacity=0"}},
          {{"--watcher_queue_limit=0"}, {"--watcher_queue_limit=0"}},
      };
  for (const auto& [args, words] : cases) {
    std::string out, err;
    auto rc = RunToCompletion("kvmanager", args, (*dir)->path(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 2) << args[0] << ": " << err;
    for (const std::string& word : words) {
      EXPECT_THAT(out + err, HasSubstr(word)) << args[0];
    }
    EXPECT_THAT(out, ::testing::Not(HasSubstr("listening")));
  }
}

// The retention flags reach the core: a closed sequence past
// --closed_retention is NOT_FOUND; a request id older than
// --idempotency_capacity replies is applied again.
TEST(DaemonTest, KvmanagerRetentionFlagsTakeEffect) {
  ClusterOptions o;
  o.manager_flags = {"--closed_retention=1", "--idempotency_capacity=1"};
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  ASSERT_THAT(cluster.CreateTenant("ops"), IsOk());
  auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    return (cluster.manager()->*method)(&ctx, req, resp);
  };
  auto open = [&](const std::string& request_id) {
    triax::v1::OpenSequenceRequest req;
    req.set_request_id(request_id);
    req.set_tenant_id("ops");
    *req.mutable_model() = SmallModel();
    *req.add_spans() = MakeSpan(triax::v1::ROLE_USER, 20);
    triax::v1::OpenSequenceResponse resp;
    grpc::Status s = call(&triax::v1::Manager::Stub::OpenSequence, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.sequence().sequence_id();
  };
  auto close = [&](const std::string& id) {
    triax::v1::CloseSequenceRequest req;
    req.set_tenant_id("ops");
    req.set_sequence_id(id);
    triax::v1::CloseSequenceResponse resp;
    grpc::Status s = call(&triax::v1::Manager::Stub::CloseSequence, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  };
  auto get = [&](const std::string& id) {
    triax::v1::GetSequenceRequest req;
    req.set_sequence_id(id);
    triax::v1::GetSequenceResponse resp;
    return call(&triax::v1::Manager::Stub::GetSequence, req, &resp);
  };

  const std::string a = open("open-a");
  const std::string b = open("open-b");
  ASSERT_NE(a, b);
  // open-a's reply left the cache (capacity 1) when open-b's came in: the
  // same request id opens another sequence.
  const std::string again = open("open-a");
  EXPECT_NE(again, a);
  EXPECT_NE(again, b);
  // The newest reply is still remembered.
  EXPECT_EQ(open("open-a"), again);

  close(a);
  EXPECT_TRUE(get(a).ok());
  close(b);
  grpc::Status s = get(a);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(a));
  EXPECT_TRUE(get(b).ok());
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
            HasSubstr("--pool_mb"), HasSubstr("--frame_kb"),
            HasSubstr("--manager"), HasSubstr("--disk_tier_dir"),
            HasSubstr("--restore_on_attend")));
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
          {{"--frame_kb=0"}, {"--frame_kb=0", "multiple of 16"}},
          {{"--frame_kb=24"}, {"--frame_kb=24", "multiple of 16"}},
          {{"--pool_mb=1", "--frame_kb=2048"},
           {"--frame_kb=2048", "--pool_mb=1"}},
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

// --transfer_path=link needs links it can make: a CPU worker's TCP
// listeners on an IP address peers can reach (exit 1 naming the flag);
// an unknown path is a flag error (exit 2) listing the four.
TEST(DaemonTest, KvworkerRefusesLinksItCannotMake) {
  auto dir = TempDir::Create("daemon");
  ASSERT_THAT(dir, IsOk());
  struct Case {
    std::vector<std::string> args;
    int rc;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {{"--backend=cpu", "--transfer_path=link", "--link_host=0.0.0.0"},
       1,
       {"--transfer_path=link", "\"0.0.0.0\"", "wildcard", "--link_host"}},
      {{"--backend=cpu", "--transfer_path=link", "--listen=localhost:0"},
       1,
       {"--transfer_path=link", "\"localhost\"", "not an IP address"}},
      {{"--transfer_path=nccl"},
       2,
       {"transfer_path=\"nccl\"", "auto, stream, ipc, link"}},
  };
  for (const Case& c : cases) {
    std::string out, err;
    auto rc = RunToCompletion("kvworker", c.args, (*dir)->path(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, c.rc) << c.args.back() << ": " << err;
    // A start that fails (exit 1) is a logfmt error record; its msg, with
    // the escapes undone, names the flags. Flag errors (exit 2) are plain.
    std::string text = err;
    if (c.rc == 1) {
      absl::string_view line = absl::StripSuffix(err, "\n");
      auto record = ParseLogfmt(line);
      ASSERT_THAT(record, IsOk()) << err;
      EXPECT_EQ(LogfmtValue(*record, "level"), "error") << err;
      text = LogfmtValue(*record, "msg");
    }
    for (const std::string& word : c.words) {
      EXPECT_THAT(text, HasSubstr(word)) << c.args.back();
    }
    EXPECT_THAT(out, ::testing::Not(HasSubstr("listening")));
  }
}

// --version: the project version and the build's git commit, exit 0, for
// both daemons and kvctl.
TEST(DaemonTest, VersionPrintsTheBuildAndExitsZero) {
  auto dir = TempDir::Create("daemon");
  ASSERT_THAT(dir, IsOk());
  for (const std::string binary : {"kvmanager", "kvworker", "kvctl"}) {
    std::string out, err;
    auto rc =
        RunToCompletion(binary, {"--version"}, (*dir)->path(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 0) << binary << ": " << err;
    EXPECT_THAT(
        out, ::testing::MatchesRegex("triaxkv [0-9]+\\.[0-9]+\\.[0-9]+ \\(git "
                                     "([0-9a-f]{12}|unknown)\\)\n"))
        << binary;
  }
}

// Ports are bound exclusively (no SO_REUSEPORT): a second kvmanager or
// kvworker on a port in use exits 1 at start-up naming the address, and the
// first keeps serving.
TEST(DaemonTest, ASecondDaemonOnAPortInUseExitsNamingIt) {
  ClusterOptions o;
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  struct Case {
    std::string binary;
    std::string address;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {"kvmanager", cluster.manager_address(), {"--metadata=memory"}},
      {"kvworker",
       cluster.worker_process(0)->address(),
       {"--pool_mb=16", "--window_tokens=32"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.flags;
    args.push_back("--listen=" + c.address);
    std::string out, err;
    auto rc = RunToCompletion(c.binary, args, cluster.dir(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 1) << c.binary << ": " << err;
    EXPECT_THAT(err, HasSubstr("cannot listen on --listen=" + c.address))
        << c.binary;
    EXPECT_THAT(out, ::testing::Not(HasSubstr("listening"))) << c.binary;
  }
  for (const std::string& address :
       {cluster.manager_address(), cluster.worker_process(0)->address()}) {
    auto health = CheckHealth(Dial(address), "");
    ASSERT_THAT(health, IsOk());
    EXPECT_EQ(*health, ServingStatus::kServing) << address;
  }
}

}  // namespace
}  // namespace triax::testing
