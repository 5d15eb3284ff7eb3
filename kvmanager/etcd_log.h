// Metadata on etcd (--metadata=etcd://HOST:PORT,...; docs/manager.md
// "Failover on etcd"): several kvmanagers share one etcd cluster; one leads,
// the others stand by, and the leader's log lives in etcd, so that a
// standby that takes over recovers the same state a restarted manager
// would from its directory.
//
// Keys, under --etcd_prefix P (default /triaxkv/default):
//   P/leader            the leader's advertised address, under its lease
//   P/log/<n>           log pieces (20 decimal digits): a kind byte ('C' the
//                       piece ends on a record boundary, 'P' it continues in
//                       the next key) and framed records (metadata_log.h)
//   P/snap/<g>/<i>      pieces of snapshot g (framed records)
//   P/snapshot          "<g> <n>": snapshot g is the state before P/log/<n>
//
// Leadership (EtcdLeadership): a manager campaigns by creating P/leader
// under a lease of --etcd_lease_seconds in a transaction that requires the
// key to be absent; the one that succeeds leads, the rest poll the key (and
// answer RPCs with UNAVAILABLE naming the leader). The leader keeps its
// lease alive; when it cannot confirm it for 3/4 of the TTL it stops the
// process (before etcd can expire the lease and let a standby win), and
// every write of its log is a transaction guarded by P/leader's creation
// revision, so that a deposed leader can write nothing: no two leaders ever
// write, and a leader that loses its key stops.
//
// Values are kept under 1 MiB (etcd refuses requests over
// --max-request-bytes, 1.5 MiB by default); a record longer than that
// spans several keys.
//
// Thread contract: EtcdClient is thread-safe; EtcdLeadership's Campaign
// and KeepAlive are called once each, from one thread; EtcdLog as
// GroupCommitLog.
#pragma once

#include <grpcpp/security/credentials.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "etcd/etcd_v3.grpc.pb.h"
#include "kvmanager/metadata_log.h"

namespace triax::manager {

// "etcd://h1:p1,h2:p2" -> {"h1:p1", "h2:p2"}; INVALID_ARGUMENT naming
// --metadata otherwise.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(
    const std::string& metadata);

// The few etcd v3 calls the manager makes, synchronous, over one channel
// to every endpoint (pick_first: the next member when one is down).
class EtcdClient {
 public:
  // `credentials`: TLS to the members (common/tls.h ChannelCredentials of
  // --etcd_tls_*); null: plaintext.
  EtcdClient(const std::vector<std::string>& endpoints,
             absl::Duration rpc_timeout,
             std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

  absl::StatusOr<etcdserverpb::RangeResponse> Range(
      const std::string& key, const std::string& range_end = "",
      int64_t limit = 0);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(
      const etcdserverpb::TxnRequest& req);
  absl::StatusOr<int64_t> LeaseGrant(int64_t ttl_seconds);
  // The lease's remaining TTL in seconds (<= 0: expired).
  absl::StatusOr<int64_t> KeepAliveOnce(int64_t lease);
  absl::Status LeaseRevoke(int64_t lease);
  const std::string& endpoints() const { return endpoints_; }

 private:
  void SetDeadline(grpc::ClientContext* ctx) const;
  const std::string endpoints_;
  const absl::Duration rpc_timeout_;
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease_;
};

// The end of the range of keys that start with `prefix`.
std::string PrefixEnd(const std::string& prefix);

struct EtcdLeadershipOptions {
  std::string prefix = "/triaxkv/default";
  std::string advertise;  // what P/leader holds: where clients reach us
  int64_t lease_seconds = 2;
  absl::Duration poll = absl::Milliseconds(100);
};

class EtcdLeadership {
 public:
  EtcdLeadership(EtcdClient* client, EtcdLeadershipOptions options);
  ~EtcdLeadership();  // stops keeping the lease alive and revokes it

  // Blocks until this manager leads (OK) or `stop` is notified
  // (CANCELLED). on_standby(leader) is called whenever the leader seen
  // changes (empty: none). etcd errors are retried (logged).
  absl::Status Campaign(
      const std::function<void(const std::string& leader)>& on_standby,
      absl::Notification* stop = nullptr);
  // P/leader's creation revision (the log's guard) and the lease.
  int64_t create_revision() const { return create_revision_; }
  int64_t lease() const { return lease_; }
  // Keeps the lease alive from a thread; calls on_lost once when it could
  // not be confirmed within 3/4 of the TTL, or etcd says it expired.
  void KeepAlive(std::function<void(const std::string& why)> on_lost);

 private:
  EtcdClient* const client_;
  const EtcdLeadershipOptions options_;
  int64_t lease_ = 0;
  int64_t create_revision_ = 0;
  std::atomic<bool> stop_{false};
  std::thread keeper_;
};

// The group-commit log on etcd, guarded by the leader key's revision.
class EtcdLog final : public GroupCommitLog {
 public:
  EtcdLog(EtcdClient* client, std::string prefix,
          int64_t leader_create_revision);
  ~EtcdLog() override;
  std::string where() const override;

 private:
  absl::Status ReplayStored(
      const std::function<absl::Status(absl::string_view, bool)>& fn) override;
  absl::Status WriteRecords(
      const std::vector<const std::string*>& records) override;
  absl::Status WriteSnapshot(const std::vector<std::string>& snapshot) override;
  // One guarded transaction of `ops`; FAILED_PRECONDITION when this manager
  // no longer leads.
  absl::Status GuardedTxn(std::vector<etcdserverpb::RequestOp> ops);
  absl::Status PutPieces(const std::string& blob, bool log,
                         const std::string& snap_prefix);
  std::string LogKey(uint64_t n) const;

  EtcdClient* const client_;
  const std::string prefix_;
  const int64_t guard_revision_;
  uint64_t next_key_ = 1;  // writer thread only (after Replay)
};

}  // namespace triax::manager
