// The kvworker's Prometheus metrics and readiness (docs/metrics.md lists
// every series).
//
// WorkerMetrics is a prometheus::Collectable that reads the store's
// inventory at scrape time (SequenceStore::Inventory: the page arena, its
// pools per encoding and fragmentation, the spill tiers, and the store's
// own counters of spills, restores, evictions and checksum failures), so
// nothing is kept in step with the store. The gRPC series (RPC counts and
// latencies by method and code) come from common/metrics.h's interceptor.
// Cost of a scrape: O(sequences + pools).
//
// Thread contract: thread-safe (WorkerCore::Inventory is).
#pragma once

#include <atomic>
#include <functional>
#include <vector>

#include "common/http_server.h"
#include "prometheus/collectable.h"
#include "worker/worker_core.h"

namespace triax::worker {

class WorkerMetrics : public prometheus::Collectable {
 public:
  explicit WorkerMetrics(const WorkerCore* core) : core_(core) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const WorkerCore* const core_;
};

// /healthz: 200 while the device is healthy (a sticky CUDA error makes it
// 503: the process must be restarted). /readyz: 200 once the worker serves
// (its pools are up and its gRPC server listens), its device is healthy
// and, when `registered` is set (a worker with --manager), that returns
// true (it has registered with its manager). Thread-safe.
class WorkerReadiness {
 public:
  // `core` must outlive this; `registered` may be null (standalone).
  WorkerReadiness(const WorkerCore* core, std::function<bool()> registered)
      : core_(core), registered_(std::move(registered)) {}
  void SetServing(bool serving) { serving_.store(serving); }
  HttpResponse Health() const;
  HttpResponse Ready() const;

 private:
  const WorkerCore* const core_;
  const std::function<bool()> registered_;
  std::atomic<bool> serving_{false};
};

}  // namespace triax::worker
