#include "kvmanager/etcd_log.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"

namespace triax::manager {

namespace pb = ::etcdserverpb;

namespace {

// etcd refuses requests over --max-request-bytes (1.5 MiB by default).
constexpr size_t kMaxPiece = size_t{1} << 20;

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd ", what, ": ", s.error_message()));
}

pb::RequestOp PutOp(const std::string& key, std::string value,
                    int64_t lease = 0) {
  pb::RequestOp op;
  pb::PutRequest* put = op.mutable_request_put();
  put->set_key(key);
  put->set_value(std::move(value));
  put->set_lease(lease);
  return op;
}

pb::RequestOp DeleteOp(const std::string& key, const std::string& end) {
  pb::RequestOp op;
  op.mutable_request_delete_range()->set_key(key);
  op.mutable_request_delete_range()->set_range_end(end);
  return op;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(
    const std::string& metadata) {
  if (!absl::StartsWith(metadata, "etcd://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metadata=", metadata, " is not etcd://HOST:PORT,..."));
  }
  std::vector<std::string> out =
      absl::StrSplit(metadata.substr(7), ',', absl::SkipEmpty());
  for (const std::string& e : out) {
    const size_t colon = e.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(e.substr(colon + 1), &port) || port <= 0 ||
        port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--metadata=", metadata, ": endpoint \"", e, "\" is not HOST:PORT"));
    }
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metadata=", metadata, " names no etcd endpoint"));
  }
  return out;
}

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    const unsigned char c = static_cast<unsigned char>(end.back());
    if (c < 0xff) {
      end.back() = static_cast<char>(c + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// --- EtcdClient
// ----------------------------------------------------------------

EtcdClient::EtcdClient(const std::vector<std::string>& endpoints,
                       absl::Duration rpc_timeout,
                       std::shared_ptr<grpc::ChannelCredentials> credentials)
    : endpoints_(absl::StrJoin(endpoints, ",")), rpc_timeout_(rpc_timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(8 << 20);
  // Reconnect fast: a member that comes back should be used again soon.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  if (credentials == nullptr) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    // An "ipv4:" target has no host name: members' certificates are
    // checked against the first endpoint's host (an IP SAN, or a name).
    args.SetSslTargetNameOverride(
        std::string(absl::string_view(endpoints.front())
                        .substr(0, endpoints.front().rfind(':'))));
  }
  auto channel =
      grpc::CreateCustomChannel("ipv4:" + endpoints_, credentials, args);
  kv_ = pb::KV::NewStub(channel);
  lease_ = pb::Lease::NewStub(channel);
}

void EtcdClient::SetDeadline(grpc::ClientContext* ctx) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_));
}

absl::StatusOr<pb::RangeResponse> EtcdClient::Range(const std::string& key,
                                                    const std::string& end,
                                                    int64_t limit) {
  pb::RangeRequest req;
  req.set_key(key);
  req.set_range_end(end);
  req.set_limit(limit);
  pb::RangeResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (absl::Status s = FromGrpc(kv_->Range(&ctx, req, &resp), "Range");
      !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<pb::TxnResponse> EtcdClient::Txn(const pb::TxnRequest& req) {
  pb::TxnResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (absl::Status s = FromGrpc(kv_->Txn(&ctx, req, &resp), "Txn"); !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<int64_t> EtcdClient::LeaseGrant(int64_t ttl_seconds) {
  pb::LeaseGrantRequest req;
  req.set_ttl(ttl_seconds);
  pb::LeaseGrantResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (absl::Status s =
          FromGrpc(lease_->LeaseGrant(&ctx, req, &resp), "LeaseGrant");
      !s.ok()) {
    return s;
  }
  if (!resp.error().empty()) {
    return absl::UnavailableError(
        absl::StrCat("etcd LeaseGrant: ", resp.error()));
  }
  return resp.id();
}

absl::StatusOr<int64_t> EtcdClient::KeepAliveOnce(int64_t lease) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  auto stream = lease_->LeaseKeepAlive(&ctx);
  pb::LeaseKeepAliveRequest req;
  req.set_id(lease);
  pb::LeaseKeepAliveResponse resp;
  if (!stream->Write(req) || !stream->Read(&resp)) {
    stream->WritesDone();
    absl::Status s = FromGrpc(stream->Finish(), "LeaseKeepAlive");
    return s.ok() ? absl::UnavailableError("etcd LeaseKeepAlive: no answer")
                  : s;
  }
  stream->WritesDone();
  ctx.TryCancel();  // the stream's end does not matter once answered
  stream->Finish();
  return resp.ttl();
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease) {
  pb::LeaseRevokeRequest req;
  req.set_id(lease);
  pb::LeaseRevokeResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return FromGrpc(lease_->LeaseRevoke(&ctx, req, &resp), "LeaseRevoke");
}

// --- EtcdLeadership
// --------------------------------------------------------------

EtcdLeadership::EtcdLeadership(EtcdClient* client,
                               EtcdLeadershipOptions options)
    : client_(client), options_(std::move(options)) {}

EtcdLeadership::~EtcdLeadership() {
  stop_ = true;
  if (keeper_.joinable()) keeper_.join();
  // Step down at once (a standby need not wait for the TTL).
  if (lease_ != 0) client_->LeaseRevoke(lease_).IgnoreError();
}

absl::Status EtcdLeadership::Campaign(
    const std::function<void(const std::string&)>& on_standby,
    absl::Notification* stop) {
  const std::string key = options_.prefix + "/leader";
  std::string seen = "\x01";  // nothing reported yet
  int failures = 0;
  while (stop == nullptr || !stop->HasBeenNotified()) {
    absl::StatusOr<pb::RangeResponse> r = client_->Range(key);
    absl::Status st = r.status();
    if (st.ok() && r->kvs_size() == 0) {
      absl::StatusOr<int64_t> lease =
          client_->LeaseGrant(options_.lease_seconds);
      st = lease.status();
      if (st.ok()) {
        pb::TxnRequest txn;
        pb::Compare* c = txn.add_compare();
        c->set_key(key);
        c->set_target(pb::Compare::CREATE);
        c->set_result(pb::Compare::EQUAL);
        c->set_create_revision(0);
        *txn.add_success() = PutOp(key, options_.advertise, *lease);
        absl::StatusOr<pb::TxnResponse> t = client_->Txn(txn);
        st = t.status();
        if (st.ok() && t->succeeded()) {
          lease_ = *lease;
          create_revision_ = t->header().revision();
          return absl::OkStatus();
        }
        client_->LeaseRevoke(*lease).IgnoreError();
      }
    }
    if (st.ok()) {
      const std::string leader =
          r->kvs_size() > 0 ? r->kvs(0).value() : std::string();
      if (leader != seen) {
        seen = leader;
        on_standby(leader);
      }
      failures = 0;
    } else if (failures++ % 50 == 0) {
      Log(LogLevel::kWarn, "manager", "etcd campaign failed; retrying",
          absl::StrCat(Kv("etcd", client_->endpoints()), " ",
                       Kv("error", st.ToString())));
    }
    if (stop != nullptr) {
      stop->WaitForNotificationWithTimeout(options_.poll);
    } else {
      absl::SleepFor(options_.poll);
    }
  }
  return absl::CancelledError("campaign stopped");
}

void EtcdLeadership::KeepAlive(
    std::function<void(const std::string&)> on_lost) {
  keeper_ = std::thread([this, on_lost = std::move(on_lost)] {
    const absl::Duration ttl = absl::Seconds(options_.lease_seconds);
    absl::Time confirmed = absl::Now();
    while (!stop_) {
      absl::SleepFor(ttl / 6);
      if (stop_) return;
      const absl::Time asked = absl::Now();
      absl::StatusOr<int64_t> left = client_->KeepAliveOnce(lease_);
      if (left.ok() && *left <= 0) {
        on_lost("etcd says the leader lease expired");
        return;
      }
      if (left.ok()) confirmed = asked;
      // etcd counts the TTL from when it got a keep-alive, which is after
      // `asked`: stopping 3/4 of a TTL after the last confirmed one is
      // before any standby can win.
      if (absl::Now() - confirmed > ttl * 3 / 4) {
        on_lost(absl::StrCat("the leader lease could not be renewed for ",
                             absl::FormatDuration(absl::Now() - confirmed),
                             left.ok() ? "" : ": ",
                             left.ok() ? "" : left.status().ToString()));
        return;
      }
    }
  });
}

// --- EtcdLog
// ---------------------------------------------------------------------

EtcdLog::EtcdLog(EtcdClient* client, std::string prefix,
                 int64_t leader_create_revision)
    : client_(client),
      prefix_(std::move(prefix)),
      guard_revision_(leader_create_revision) {}

EtcdLog::~EtcdLog() { StopWriter(); }

std::string EtcdLog::where() const {
  return absl::StrCat("etcd ", client_->endpoints(), " under ", prefix_);
}

std::string EtcdLog::LogKey(uint64_t n) const {
  return absl::StrFormat("%s/log/%020d", prefix_, n);
}

absl::Status EtcdLog::GuardedTxn(std::vector<pb::RequestOp> ops) {
  pb::TxnRequest txn;
  pb::Compare* c = txn.add_compare();
  c->set_key(prefix_ + "/leader");
  c->set_target(pb::Compare::CREATE);
  c->set_result(pb::Compare::EQUAL);
  c->set_create_revision(guard_revision_);
  for (pb::RequestOp& op : ops) *txn.add_success() = std::move(op);
  absl::StatusOr<pb::TxnResponse> r = client_->Txn(txn);
  if (!r.ok()) return r.status();
  if (!r->succeeded()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this kvmanager no longer leads (", prefix_,
                     "/leader was replaced); its log writes are refused"));
  }
  return absl::OkStatus();
}

absl::Status EtcdLog::PutPieces(const std::string& blob, bool log,
                                const std::string& snap_prefix) {
  size_t off = 0;
  int piece = 0;
  do {
    const size_t n = std::min(kMaxPiece, blob.size() - off);
    std::vector<pb::RequestOp> ops;
    if (log) {
      const bool last = off + n == blob.size();
      ops.push_back(PutOp(LogKey(next_key_), std::string(1, last ? 'C' : 'P') +
                                                 blob.substr(off, n)));
    } else {
      ops.push_back(PutOp(absl::StrFormat("%s%06d", snap_prefix, piece),
                          blob.substr(off, n)));
    }
    if (absl::Status st = GuardedTxn(std::move(ops)); !st.ok()) return st;
    if (log) ++next_key_;
    ++piece;
    off += n;
  } while (off < blob.size());
  return absl::OkStatus();
}

absl::Status EtcdLog::WriteRecords(
    const std::vector<const std::string*>& records) {
  std::string blob;
  for (const std::string* r : records) AppendFrame(*r, &blob);
  return PutPieces(blob, /*log=*/true, "");
}

absl::Status EtcdLog::WriteSnapshot(const std::vector<std::string>& recs) {
  const uint64_t gen = next_key_;
  std::string blob;
  for (const std::string& r : recs) AppendFrame(r, &blob);
  const std::string snap = absl::StrFormat("%s/snap/%020d/", prefix_, gen);
  if (absl::Status st = PutPieces(blob, /*log=*/false, snap); !st.ok()) {
    return st;
  }
  // Publish it and drop what it replaces, in one transaction.
  std::vector<pb::RequestOp> ops;
  ops.push_back(PutOp(prefix_ + "/snapshot", absl::StrCat(gen, " ", gen)));
  ops.push_back(DeleteOp(prefix_ + "/log/", LogKey(gen)));
  ops.push_back(DeleteOp(prefix_ + "/snap/", snap));
  if (absl::Status st = GuardedTxn(std::move(ops)); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  stats_.snapshots++;
  return absl::OkStatus();
}

absl::Status EtcdLog::ReplayStored(
    const std::function<absl::Status(absl::string_view, bool)>& fn) {
  uint64_t first = 1;
  absl::StatusOr<pb::RangeResponse> head =
      client_->Range(prefix_ + "/snapshot");
  if (!head.ok()) return head.status();
  if (head->kvs_size() > 0) {
    std::vector<std::string> parts = absl::StrSplit(head->kvs(0).value(), ' ');
    uint64_t gen = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &gen) ||
        !absl::SimpleAtoi(parts[1], &first)) {
      return absl::DataLossError(
          absl::StrCat(prefix_, "/snapshot holds \"", head->kvs(0).value(),
                       "\", not \"<generation> <first log key>\""));
    }
    const std::string snap = absl::StrFormat("%s/snap/%020d/", prefix_, gen);
    std::string blob;
    std::string from = snap;
    for (;;) {
      absl::StatusOr<pb::RangeResponse> r =
          client_->Range(from, PrefixEnd(snap), 16);
      if (!r.ok()) return r.status();
      for (const pb::KeyValue& kv : r->kvs()) blob += kv.value();
      if (!r->more() || r->kvs_size() == 0) break;
      from = r->kvs(r->kvs_size() - 1).key() + '\0';
    }
    absl::StatusOr<size_t> end = ForEachFrame(blob, true, fn);
    if (!end.ok()) return end.status();
    if (*end != blob.size()) {
      return absl::DataLossError(absl::StrCat(
          "snapshot ", gen, " under ", prefix_, " is corrupt at byte ", *end));
    }
  }
  next_key_ = first;
  std::string pending;  // pieces of a record not yet complete
  std::vector<std::string> pending_keys;
  std::string from = LogKey(first);
  const std::string end_key = PrefixEnd(prefix_ + "/log/");
  for (;;) {
    absl::StatusOr<pb::RangeResponse> r = client_->Range(from, end_key, 16);
    if (!r.ok()) return r.status();
    for (const pb::KeyValue& kv : r->kvs()) {
      uint64_t n = 0;
      const std::string& key = kv.key();
      if (key.size() < 20 ||
          !absl::SimpleAtoi(key.substr(key.size() - 20), &n) ||
          kv.value().empty()) {
        return absl::DataLossError(
            absl::StrCat("log key ", key, " under ", prefix_, " is malformed"));
      }
      next_key_ = n + 1;
      pending += kv.value().substr(1);
      pending_keys.push_back(key);
      if (kv.value()[0] == 'P') continue;
      absl::StatusOr<size_t> done = ForEachFrame(pending, false, fn);
      if (!done.ok()) return done.status();
      if (*done != pending.size()) {
        return absl::DataLossError(absl::StrCat("log key ", key, " under ",
                                                prefix_, " is corrupt at byte ",
                                                *done));
      }
      pending.clear();
      pending_keys.clear();
    }
    if (!r->more() || r->kvs_size() == 0) break;
    from = r->kvs(r->kvs_size() - 1).key() + '\0';
  }
  if (!pending_keys.empty()) {
    // A record the previous leader did not finish writing: never
    // acknowledged; drop its pieces so that the next key starts clean.
    Log(LogLevel::kWarn, "metadata",
        absl::StrCat("dropping ", pending_keys.size(),
                     " pieces of an unfinished record under ", prefix_));
    std::vector<pb::RequestOp> ops;
    ops.push_back(DeleteOp(pending_keys.front(), end_key));
    if (absl::Status st = GuardedTxn(std::move(ops)); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace triax::manager
