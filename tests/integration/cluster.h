// A real triaxkv cluster on loopback for integration tests: one kvmanager and
// N kvworker processes (ids "w0", "w1", ...) started from $TRIAX_BIN_DIR on
// 127.0.0.1 port 0, all in one temp dir, stopped by the destructor.
// Thread-compatible.
#pragma once

#include <grpcpp/security/credentials.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kv_client.h"
#include "tests/integration/process.h"
#include "triax/v1/manager.grpc.pb.h"

namespace triax::testing {

struct ClusterOptions {
  int num_workers = 1;
  int worker_timeout_ms = 5000;        // silent this long: SUSPECT
  int worker_down_timeout_ms = 20000;  // silent this long: DOWN
  int heartbeat_interval_ms = 100;
  int pool_mb = 64;
  int window_tokens = 32;
  // Extra command-line flags, appended after the defaults (so they win).
  // "$DIR" in a flag is replaced by the cluster's directory.
  std::vector<std::string> manager_flags;
  std::vector<std::string> worker_flags;
  // Flags of worker i only (when given), after worker_flags ("$DIR" as
  // above).
  std::vector<std::vector<std::string>> per_worker_flags;
  // Of the cluster's own stub and of NewClient (a TLS cluster: the daemons'
  // --tls_* flags in manager_flags / worker_flags); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_worker_server_name;  // NewClient's (ClientOptions)
};

class Cluster {
 public:
  // Starts the manager, then the workers, and waits until every worker is
  // UP in ListWorkers (bounded: 10 s).
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(
      const ClusterOptions& options);
  ~Cluster();

  const std::string& dir() const { return dir_->path(); }
  std::string manager_address() const { return manager_->address(); }
  Process* manager_process() { return manager_.get(); }
  Process* worker_process(int i) { return workers_[i].get(); }
  static std::string WorkerId(int i) { return "w" + std::to_string(i); }

  // Kills the manager (SIGKILL when `kill9`, else SIGTERM with grace) and
  // starts it again with the same flags on the same port, so that workers
  // and clients keep their address; it recovers from its metadata
  // directory (<dir>/metadata). The stub is replaced.
  absl::Status RestartManager(bool kill9 = true);

  // A fresh stub to the manager, calls bounded by the caller's context.
  triax::v1::Manager::Stub* manager() { return stub_.get(); }
  absl::StatusOr<std::unique_ptr<client::Client>> NewClient(
      const std::string& tenant_id);

  // CreateTenant with a device budget when `device_ceiling_bytes` > 0.
  absl::Status CreateTenant(const std::string& tenant_id,
                            uint64_t device_ceiling_bytes = 0,
                            const std::string& default_policy = "");
  absl::StatusOr<triax::v1::WorkerInfo> GetWorker(const std::string& id);
  absl::StatusOr<triax::v1::TenantInfo> GetTenant(const std::string& id);

  // Polls `probe` every 20 ms until it returns true, an error, or `timeout`
  // passes (DEADLINE_EXCEEDED naming `what` and the last probe error).
  static absl::Status WaitFor(
      const std::string& what, absl::Duration timeout,
      const std::function<absl::StatusOr<bool>()>& probe);

  // Waits until worker `id` is in `state`.
  absl::Status WaitForWorkerState(const std::string& id,
                                  triax::v1::WorkerState state,
                                  absl::Duration timeout = absl::Seconds(10));

 private:
  Cluster() = default;
  ClusterOptions options_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Process> manager_;
  std::vector<std::string> manager_args_;
  int restarts_ = 0;
  std::vector<std::unique_ptr<Process>> workers_;
  std::unique_ptr<triax::v1::Manager::Stub> stub_;
};

}  // namespace triax::testing
