// A benchmark's private service: a kvmanager and kvworker(s) started by the
// integration launcher (tests/integration/cluster.h), one tenant and its
// client, and the few manager/worker calls the harnesses make outside
// triax::client (PutPolicy, PutCalibration, GetInventory).
//
// Thread contract: BenchCluster is owned by one thread; the free functions
// are as thread-safe as client::Client (each makes its own ClientContext).
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kv_client.h"
#include "tests/integration/cluster.h"

namespace triax::bench {

struct BenchCluster {
  std::unique_ptr<testing::Cluster> cluster;
  std::unique_ptr<client::Client> client;  // destroyed before the cluster
};

// One worker with a `pool_mb` MiB pool; window_tokens = 0 (every sequence
// names its own BF16 window).
testing::ClusterOptions OneWorkerOptions(int pool_mb);

// Starts the cluster, creates `tenant` and a client of it. Errors of the
// launcher, CreateTenant or NewClient.
absl::StatusOr<BenchCluster> StartBenchCluster(
    const testing::ClusterOptions& options, const std::string& tenant);

// Manager calls with a fresh request id and a 30 s deadline.
absl::Status PutPolicy(client::Client* c, const v1::Policy& policy);
absl::Status PutCalibration(client::Client* c,
                            const v1::CalibrationTable& table);

// The worker at `address`'s GetInventory, with `deadline`.
absl::StatusOr<v1::Inventory> WorkerInventory(
    client::Client* c, const std::string& address,
    absl::Duration deadline = absl::Seconds(30));

}  // namespace triax::bench
