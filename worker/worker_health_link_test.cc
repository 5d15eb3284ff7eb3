// The worker's gRPC health service following the device, and ManagerLink
// registering, retrying and re-registering against a fake manager, with its
// incarnation, and dropping the sequences the manager says to release.

#include <set>
#include <string>

#include "worker/worker_service.h"
#include "worker/worker_service_test_util.h"

namespace triax::worker {
namespace {

TEST_F(ServiceTest, HealthServiceFollowsTheDevice) {
  ASSERT_NE(server_->GetHealthCheckService(), nullptr);
  HealthReporter health(core_.get(), server_->GetHealthCheckService());
  const auto status = [this](const std::string& service) {
    absl::StatusOr<ServingStatus> s = CheckHealth(channel_, service);
    EXPECT_TRUE(s.ok()) << service << ": " << s.status();
    return s.value_or(ServingStatus::kUnknown);
  };
  EXPECT_THAT(health.Check(), IsOk());
  EXPECT_EQ(status(""), ServingStatus::kServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);

  device_.SetUnhealthy("cuda backend unhealthy (restart the worker) since: X");
  EXPECT_THAT(health.Check(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("since: X")));
  EXPECT_EQ(status(""), ServingStatus::kNotServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kNotServing);

  device_.SetUnhealthy("");
  EXPECT_THAT(health.Check(), IsOk());
  EXPECT_EQ(status(""), ServingStatus::kServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);
  EXPECT_THAT(CheckHealth(channel_, "triax.v1.Manager"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// Built to await registration (kvworker --manager), the reporter keeps ""
// (readiness) NOT_SERVING until MarkRegistered, while triax.v1.Worker
// (liveness) follows the device alone; an unhealthy device takes both down.
TEST_F(ServiceTest, ReadinessWaitsForRegistration) {
  HealthReporter health(core_.get(), server_->GetHealthCheckService(),
                        /*await_registration=*/true);
  const auto status = [this](const std::string& service) {
    return CheckHealth(channel_, service).value_or(ServingStatus::kUnknown);
  };
  EXPECT_THAT(health.Check(), IsOk());
  EXPECT_EQ(status(""), ServingStatus::kNotServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);

  health.MarkRegistered();
  EXPECT_EQ(status(""), ServingStatus::kServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);

  device_.SetUnhealthy("device poisoned: test");
  EXPECT_FALSE(health.Check().ok());
  EXPECT_EQ(status(""), ServingStatus::kNotServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kNotServing);
  device_.SetUnhealthy("");
  health.MarkRegistered();  // a second registration changes nothing
  EXPECT_THAT(health.Check(), IsOk());
  EXPECT_EQ(status(""), ServingStatus::kServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);
}

// Started, the reporter notices a device turning unhealthy on its own
// thread (no RPC waits for the device); stopped, it leaves the last status.
TEST_F(ServiceTest, HealthReporterPollsTheDevice) {
  HealthReporter health(core_.get(), server_->GetHealthCheckService());
  health.Start(absl::Milliseconds(2));
  EXPECT_EQ(CheckHealth(channel_, "triax.v1.Worker")
                .value_or(ServingStatus::kUnknown),
            ServingStatus::kServing);
  device_.SetUnhealthy("device poisoned: test");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ServingStatus seen = ServingStatus::kServing;
  while (seen != ServingStatus::kNotServing && absl::Now() < deadline) {
    seen = CheckHealth(channel_, "").value_or(ServingStatus::kUnknown);
  }
  EXPECT_EQ(seen, ServingStatus::kNotServing);
  health.Stop();
  device_.SetUnhealthy("");
  EXPECT_EQ(CheckHealth(channel_, "").value_or(ServingStatus::kUnknown),
            ServingStatus::kNotServing);
}

class FakeManager final : public v1::Manager::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*,
                              const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse* resp) override {
    absl::MutexLock lock(&mu_);
    if (++register_calls_ <= 2) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "starting");
    }
    last_register_ = *req;
    register_incarnations_.insert(req->incarnation());
    resp->set_heartbeat_interval_ms(10);
    if (register_calls_ == 3) resp->add_lost_sequence_ids("lost-seq");
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    absl::MutexLock lock(&mu_);
    heartbeat_incarnations_.insert(req->incarnation());
    if (++heartbeat_calls_ == 1) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    }
    // The manager no longer holds this one open (closed while we were
    // away): the link drops it.
    if (heartbeat_calls_ == 2) resp->add_release_sequence_ids("released-seq");
    last_inventory_ = req->inventory();
    return grpc::Status::OK;
  }
  absl::Mutex mu_;
  int register_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeat_calls_ ABSL_GUARDED_BY(mu_) = 0;
  v1::RegisterWorkerRequest last_register_ ABSL_GUARDED_BY(mu_);
  v1::Inventory last_inventory_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> register_incarnations_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> heartbeat_incarnations_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ServiceTest, ManagerLinkRegistersRetriesAndReregisters) {
  ASSERT_TRUE(Allocate(AllocRequest("lost-seq", 16)).ok());
  ASSERT_TRUE(Allocate(AllocRequest("kept", 16)).ok());
  ASSERT_TRUE(Allocate(AllocRequest("released-seq", 16)).ok());
  FakeManager manager;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&manager);
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  ManagerLinkOptions opts;
  opts.manager_address = "127.0.0.1:" + std::to_string(port);
  opts.worker_id = "worker-test";
  opts.advertise_address = "127.0.0.1:9999";
  opts.backend = "cpu";
  opts.capacity_bytes = 4 << 20;
  opts.host_capacity_bytes = 1 << 20;
  opts.disk_capacity_bytes = 3 << 20;
  opts.retry_ms = 20;
  std::unique_ptr<ManagerLink> link = NewManagerLink(opts, core_.get());
  device_.SetUnhealthy("device poisoned: test");
  link->Start();
  EXPECT_TRUE(link->WaitForCounts(2, 2, absl::Seconds(10)));
  link->Stop();
  EXPECT_EQ(link->registrations(), 2);  // first, then after NOT_FOUND
  EXPECT_GE(link->heartbeats(), 2);
  absl::MutexLock lock(&manager.mu_);
  EXPECT_GE(manager.register_calls_, 4);  // two UNAVAILABLE retried
  EXPECT_EQ(manager.last_register_.worker_id(), "worker-test");
  EXPECT_EQ(manager.last_register_.address(), "127.0.0.1:9999");
  EXPECT_EQ(manager.last_register_.backend(), "cpu");
  EXPECT_EQ(manager.last_register_.capacity_bytes(), 4u << 20);
  EXPECT_EQ(manager.last_register_.host_capacity_bytes(), 1u << 20);
  EXPECT_EQ(manager.last_register_.disk_capacity_bytes(), 3u << 20);
  EXPECT_EQ(manager.last_inventory_.capacity_bytes(), 4u << 20);
  // Tier inventory rides along (this store has no tiers: capacity 0).
  ASSERT_EQ(manager.last_inventory_.tiers_size(), 2);
  EXPECT_EQ(manager.last_inventory_.tiers(0).tier(), v1::TIER_HOST);
  EXPECT_EQ(manager.last_inventory_.tiers(1).tier(), v1::TIER_DISK);
  EXPECT_EQ(manager.last_inventory_.tiers(0).capacity_bytes(), 0u);
  // The device's health rides in every heartbeat.
  EXPECT_EQ(manager.last_inventory_.device_error(), "device poisoned: test");
  // The sequence the manager declared lost and the one it said to release
  // were dropped; the other is kept.
  ASSERT_EQ(manager.last_inventory_.sequence_ids_size(), 1);
  EXPECT_EQ(manager.last_inventory_.sequence_ids(0), "kept");
  // One incarnation for the process, in every registration and heartbeat;
  // registrations carry the inventory.
  EXPECT_THAT(manager.register_incarnations_,
              ::testing::ElementsAre(link->incarnation()));
  EXPECT_THAT(manager.heartbeat_incarnations_,
              ::testing::ElementsAre(link->incarnation()));
  EXPECT_THAT(link->incarnation(),
              ::testing::MatchesRegex("[0-9]+-[0-9a-f]{16}"));
  EXPECT_GT(manager.last_register_.inventory().capacity_bytes(), 0u);
  server->Shutdown();
}

// The same service over a store with spill tiers (host 256 KiB, disk under a
// temp directory), restore on attend off and the prefetch queue served by
// the test.

}  // namespace
}  // namespace triax::worker
