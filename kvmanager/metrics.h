// The kvmanager's Prometheus metrics and readiness (docs/metrics.md lists
// every series).
//
// ManagerMetrics is a prometheus::Collectable. Counters of events (blocks
// created, spilled, restored, evicted, demoted, transfers, ...) are the
// core's EventLog's counts by kind (EventLog::AppendedByKind) less those at
// construction, and the transfer byte sums come from a live subscription to
// the log's SEQUENCE_TRANSFERRED events;
// everything that mirrors state (workers and their pools, watermarks,
// tenants' bytes and budgets, blocks and bytes by tier, encoding and tenant,
// the pressure manager's counters) is read from the core at scrape time
// through its public calls, so nothing is kept in step with the core.
// Admission refusals are the RESOURCE_EXHAUSTED answers of the admitting
// RPCs, read from the RPC series (common/metrics.h).
//
// Cost of a scrape: O(workers + tenants) for the state series plus
// O(open blocks) for the block series (one GetSequence per open sequence,
// each under the core's mutex for that sequence only).
//
// Label cardinality: worker ids (the fleet), tenant ids (at most
// max_tenants; the tenants after the first max_tenants by id are summed
// into tenant="_other"), tiers, formats and encodings (bounded by the
// policies), event kinds. Never sequence or lineage ids.
//
// Thread contract: thread-safe. Collect may run on any thread; the transfer
// sums are updated on the threads that append events (under the core's
// mutex, so Collect never calls back into the core while holding its own
// lock).
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "kvmanager/manager_core.h"
#include "prometheus/collectable.h"

namespace triax::manager {

struct ManagerMetricsOptions {
  // Tenants with their own label value; the rest are summed as "_other".
  size_t max_tenants = 64;
};

class ManagerMetrics : public prometheus::Collectable {
 public:
  // `core` must outlive this; `rpc` (may be null: no refusal series) too.
  // Counts the core's events from now on.
  ManagerMetrics(ManagerCore* core, const RpcMetrics* rpc,
                 ManagerMetricsOptions options = {});
  ~ManagerMetrics() override;  // cancels the subscription

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  void Drain();
  void CollectWorkers(std::vector<prometheus::MetricFamily>* out) const;
  void CollectTenants(std::vector<prometheus::MetricFamily>* out) const;
  void CollectBlocks(std::vector<prometheus::MetricFamily>* out) const;
  void CollectEvents(std::vector<prometheus::MetricFamily>* out) const;
  // The label value of `tenant_id` among `tenants` (sorted ids).
  std::string TenantLabel(const std::string& tenant_id,
                          const std::vector<std::string>& tenants) const;

  ManagerCore* const core_;
  const RpcMetrics* const rpc_;
  const ManagerMetricsOptions options_;
  std::shared_ptr<EventSubscription> sub_;  // SEQUENCE_TRANSFERRED events
  // The log's counts at construction.
  const std::array<uint64_t, EventLog::kKinds> events_before_;
  mutable absl::Mutex mu_;
  uint64_t transfer_wire_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t transfer_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;
};

// What /readyz of the manager answers: ready while it serves (set by main
// once the gRPC server is up, cleared at shutdown) and, when a leader check
// is set, while that check is OK (the hook for a replicated manager, where
// only the leader takes requests). /healthz: the process answers.
// Thread-safe.
class ManagerReadiness {
 public:
  void SetServing(bool serving) { serving_.store(serving); }
  // `check` OK: this manager may take requests; else why not.
  void SetLeaderCheck(std::function<absl::Status()> check);
  HttpResponse Ready() const;

 private:
  std::atomic<bool> serving_{false};
  mutable absl::Mutex mu_;
  std::function<absl::Status()> leader_check_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::manager
