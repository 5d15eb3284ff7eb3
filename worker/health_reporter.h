// Keeps the gRPC health service (grpc.health.v1.Health, turned on with
// grpc::EnableDefaultHealthCheckService before the server is built) in step
// with the device and the worker's registration:
//   triax.v1.Worker  SERVING while WorkerCore::DeviceHealth() is OK,
//                    NOT_SERVING while it is not (a sticky CUDA error: a
//                    poisoned context must not keep taking traffic; restart
//                    the worker). Kubernetes' liveness probe asks this one.
//   "" (the server)  SERVING when the device is healthy and, for a reporter
//                    built with `await_registration` (kvworker --manager),
//                    once the worker has registered with the manager
//                    (MarkRegistered); NOT_SERVING otherwise. The readiness
//                    probe asks this one, so a rollout waits until each new
//                    worker has joined, while a manager that is down does
//                    not get healthy workers restarted by the liveness probe.
// Registration counts once: a manager that later restarts or fails over does
// not turn a worker unready (it registers again on its own).
//
// The device is polled on a thread of its own every `interval`, so the
// health RPCs (answered by gRPC from the last status set) never wait on the
// device, and a device that turns unhealthy is reported within one
// interval. A poll is cheap: Device::Health() reads a sticky flag.
//
// Thread contract: Start and Stop from one owner thread; Check and
// MarkRegistered are thread-safe. Stop before the server's health service is
// shut down (its Shutdown sets every status NOT_SERVING for the drain).
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
                 grpc::HealthCheckServiceInterface* health,
                 bool await_registration = false);
  ~HealthReporter();  // Stop()

  HealthReporter(const HealthReporter&) = delete;
  HealthReporter& operator=(const HealthReporter&) = delete;

  // Reads the device's health now and sets both statuses to match (logging
  // a change); returns the health read.
  absl::Status Check();

  // The worker has registered with its manager: "" may turn SERVING (now,
  // when the device is healthy). Idempotent.
  void MarkRegistered();

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
  bool registered_ ABSL_GUARDED_BY(mu_);
  // The statuses last set (triax.v1.Worker, ""); nullopt before the first
  // Check.
  std::optional<bool> serving_ ABSL_GUARDED_BY(mu_);
  std::optional<bool> ready_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
