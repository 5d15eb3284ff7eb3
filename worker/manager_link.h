// The worker's link to the kvmanager: registers (RegisterWorker, retried
// every `retry_ms` until the manager answers OK), then heartbeats the
// inventory (with the spill tiers' usage and counters) every
// heartbeat_interval_ms the manager asked for; a heartbeat
// answered NOT_FOUND (the manager forgot us, e.g. it restarted, or marked us
// DOWN after a pause) registers again. Registration and heartbeats carry the
// link's incarnation (fixed for the process, so the manager tells a pause
// from a restart) and the inventory. Sequences the manager reports lost on
// registration, and those it says to release (registration or heartbeat:
// sequences it no longer holds open here), are dropped through `on_lost`.
//
// Thread contract: Start/Stop from one owner thread; the link runs on its
// own thread; the counters are thread-safe.
#pragma once

#include <grpcpp/security/credentials.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "triax/v1/manager.grpc.pb.h"
#include "worker/worker_core.h"

namespace triax::worker {

struct ManagerLinkOptions {
  // host:port of the kvmanager, or several, comma-separated (managers on
  // etcd: the link follows the leader — see ManagerLink).
  std::string manager_address;
  std::string worker_id;
  std::string advertise_address;  // host:port frontends dial
  std::string backend;            // "cpu" | "cuda"
  uint64_t capacity_bytes = 0;
  uint64_t host_capacity_bytes = 0;  // host spill tier; 0: none
  uint64_t disk_capacity_bytes = 0;  // disk spill tier; 0: none
  int retry_ms = 200;                // between registration attempts
  int default_heartbeat_ms = 1000;   // when the manager says 0
  int rpc_deadline_ms = 2000;
  // Empty: "<unix micros at start>-<16 random hex digits>".
  std::string incarnation;
  // Of the channels to the managers (TLS with the worker's client
  // certificate, common/tls.h); null: insecure.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Bearer token of role worker for a manager with --auth=token (kvworker
  // --token_file); empty: none.
  std::string token;
  // Called with the capability key of every RegisterWorker and Heartbeat
  // reply that carries one, before on_registered.
  std::function<void(const std::string&)> on_capability_key;
  // Called on the link's thread after every successful RegisterWorker (the
  // worker's readiness waits for the first: HealthReporter::MarkRegistered).
  std::function<void()> on_registered;
};

class ManagerLink {
 public:
  using InventoryFn = std::function<v1::Inventory()>;
  using LostFn = std::function<void(const std::vector<std::string>&)>;
  // Called with the inventory of a heartbeat the manager did not accept
  // (so what it carried, e.g. restored_lineage_ids, can be sent again).
  using UnsentFn = std::function<void(const v1::Inventory&)>;

  ManagerLink(ManagerLinkOptions options, InventoryFn inventory, LostFn on_lost,
              UnsentFn on_unsent = nullptr);
  ~ManagerLink();  // Stops.

  void Start();
  // Returns once the link thread has exited; idempotent.
  void Stop();

  const std::string& incarnation() const { return incarnation_; }
  int registrations() const;  // successful RegisterWorker calls
  int heartbeats() const;     // successful Heartbeat calls
  // Waits until at least `registrations` RegisterWorker and `heartbeats`
  // Heartbeat calls succeeded; false when `timeout` passed first.
  bool WaitForCounts(int registrations, int heartbeats,
                     absl::Duration timeout) const;

 private:
  void Run();
  // Waits up to `ms`; returns true when stopping.
  bool WaitStop(int ms);

  const ManagerLinkOptions options_;
  const std::string incarnation_;
  const InventoryFn inventory_;
  const LostFn on_lost_;
  const UnsentFn on_unsent_;
  // One stub per manager address; calls go to stubs_[current_] (Run's
  // thread only). A call answered UNAVAILABLE (a standby, or a manager
  // gone) moves to the leader the answer names, else to the next address.
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<v1::Manager::Stub>> stubs_;
  size_t current_ = 0;
  v1::Manager::Stub* stub() { return stubs_[current_].get(); }
  void FollowLeader(const grpc::Status& s);
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
};

// The link of a worker over `core`: heartbeats carry its inventory with the
// lineage ids it restored on its own (given back to it when the heartbeat
// fails, so the next one carries them), and the sequences the manager
// declares lost are dropped. `core` must outlive the link. Not started.
std::unique_ptr<ManagerLink> NewManagerLink(ManagerLinkOptions options,
                                            WorkerCore* core);

}  // namespace triax::worker
