// Keeps the gRPC health service (grpc.health.v1.Health, turned on with
// grpc::EnableDefaultHealthCheckService before the server is built) in step
// with the device: the server as a whole ("") and triax.v1.Worker are
// NOT_SERVING while WorkerCore::DeviceHealth() is not OK (a sticky CUDA
// error: a poisoned context must not keep taking traffic; restart the
// worker) and SERVING otherwise.
//
// The state is polled on a thread of its own every `interval`, so the health
// RPCs (answered by gRPC from the last status set) never wait on the device,
// and a device that turns unhealthy is reported within one interval. A
// poll is cheap: Device::Health() reads a sticky flag.
//
// Thread contract: Start and Stop from one owner thread; Check is
// thread-safe. Stop before the server's health service is shut down.
#pragma once

#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/worker_core.h"

namespace grpc {
class HealthCheckServiceInterface;
}  // namespace grpc

namespace triax::worker {

class HealthReporter {
 public:
  // `core` and `health` (the server's GetHealthCheckService()) must outlive
  // the reporter.
  HealthReporter(const WorkerCore* core,
                 grpc::HealthCheckServiceInterface* health);
  ~HealthReporter();  // Stop()

  HealthReporter(const HealthReporter&) = delete;
  HealthReporter& operator=(const HealthReporter&) = delete;

  // Reads the device's health now and sets both statuses to match (logging
  // a change); returns the health read.
  absl::Status Check();

  // Checks once on the calling thread, then every `interval` on the
  // reporter's thread until Stop.
  void Start(absl::Duration interval);
  // Returns once the thread has exited; idempotent.
  void Stop();

 private:
  const WorkerCore* const core_;
  grpc::HealthCheckServiceInterface* const health_;
  std::thread thread_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The statuses last set; nullopt before the first Check.
  std::optional<bool> serving_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
