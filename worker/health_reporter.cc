#include "worker/health_reporter.h"

#include <grpcpp/health_check_service_interface.h>

#include <string>

#include "common/log.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::worker {

HealthReporter::HealthReporter(const WorkerCore* core,
                               grpc::HealthCheckServiceInterface* health,
                               bool await_registration)
    : core_(core), health_(health), registered_(!await_registration) {}

HealthReporter::~HealthReporter() { Stop(); }

absl::Status HealthReporter::Check() {
  absl::Status health = core_->DeviceHealth();
  const bool serving = health.ok();
  absl::MutexLock lock(&mu_);
  const bool ready = serving && registered_;
  // Under mu_ so that two concurrent checks cannot leave the older status.
  if (ready_ != ready) {
    health_->SetServingStatus("", ready);
    ready_ = ready;
  }
  if (serving_ == serving) return health;
  const bool first = !serving_.has_value();
  serving_ = serving;
  health_->SetServingStatus(v1::Worker::service_full_name(), serving);
  if (!serving) {
    Log(LogLevel::kError, "worker", "device unhealthy: health NOT_SERVING",
        Kv("error", health.ToString()));
  } else if (!first) {
    Log(LogLevel::kInfo, "worker", "device healthy again: health SERVING", "");
  }
  return health;
}

void HealthReporter::MarkRegistered() {
  {
    absl::MutexLock lock(&mu_);
    if (registered_) return;
    registered_ = true;
  }
  (void)Check();
}

void HealthReporter::Start(absl::Duration interval) {
  (void)Check();
  thread_ = std::thread([this, interval] {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (mu_.AwaitWithTimeout(absl::Condition(&stop_), interval)) return;
      }
      (void)Check();
    }
  });
}

void HealthReporter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace triax::worker
