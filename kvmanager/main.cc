// kvmanager: the triaxkv control-plane server. Flags and the server builder
// only; the logic lives in manager_core (kvmanager/manager_core.h) and its
// gRPC adapter (kvmanager/manager_service.h).
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/daemon_flags.h"
#include "common/local_socket.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/parse_errors.h"
#include "common/port_file.h"
#include "common/tls.h"
#include "kvmanager/dashboard.h"
#include "kvmanager/etcd_log.h"
#include "kvmanager/kv_events.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/manager_service.h"
#include "kvmanager/metadata_store.h"
#include "kvmanager/metrics.h"
#include "kvmanager/standby.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "host:port to listen on; port 0 picks a free port");
ABSL_FLAG(
    std::string, port_file, "",
    "if set, the bound port is written here as decimal text (atomically)");
ABSL_FLAG(std::string, local_listen, "",
          "unix:/PATH: also serve on this Unix-domain socket, for clients on "
          "this host (gRPC local credentials: no TLS; tokens apply; "
          "RegisterWorker and Heartbeat, which need a worker certificate "
          "under mutual TLS, are refused there); docs/security.md \"Local "
          "socket\"; empty: off");
ABSL_FLAG(std::string, local_listen_mode, "0660",
          "octal file mode of the --local_listen socket: who may connect");
ABSL_FLAG(std::string, http_listen, "",
          "host:port of the HTTP endpoints /metrics (Prometheus), /healthz, "
          "/readyz and the live dashboard (/ and /api/...); port 0 picks a "
          "free port; empty: off");
ABSL_FLAG(std::string, http_port_file, "",
          "if set, the bound HTTP port is written here (atomically)");
ABSL_FLAG(uint32_t, metrics_max_tenants, 64,
          "tenants with their own label in /metrics (the first by id); the "
          "rest are summed as tenant=\"_other\"");
ABSL_FLAG(int64_t, worker_timeout_ms, 3000,
          "a worker without a heartbeat for this long is SUSPECT: nothing new "
          "is placed on it, its sequences stay open");
ABSL_FLAG(int64_t, worker_down_timeout_ms, 30000,
          "a worker without a heartbeat for this long is DOWN: its sequences "
          "are LOST until it returns with the same incarnation; must be above "
          "--worker_timeout_ms");
ABSL_FLAG(uint32_t, heartbeat_interval_ms, 1000,
          "heartbeat interval told to workers at registration");
ABSL_FLAG(uint32_t, default_block_tokens, 16,
          "tokens per block when a request says 0 (1..4096)");
ABSL_FLAG(uint32_t, recent_turns, 2,
          "turns before the newest whose blocks are tagged RECENT_TURNS");
ABSL_FLAG(uint64_t, event_retention, 1000000,
          "lifecycle events kept for WatchEvents replay and QueryTrace "
          "(oldest dropped first); >= 1");
ABSL_FLAG(uint64_t, event_retention_bytes, uint64_t{1} << 30,
          "and fewer events when their estimated bytes pass this (about 330 "
          "bytes a block event; oldest dropped first); 0: no byte bound");
ABSL_FLAG(uint64_t, closed_retention, 100000,
          "closed and lost sequences kept queryable (GetSequence, "
          "ListSequences include_closed) after they end, oldest dropped "
          "first (then NOT_FOUND); 0: none");
ABSL_FLAG(uint64_t, idempotency_capacity, 16384,
          "replies remembered per mutating method for request-id retries, "
          "oldest dropped first (a retry older than that is applied again); "
          ">= 1");
ABSL_FLAG(uint64_t, watcher_queue_limit, 65536,
          "live events a WatchEvents stream may lag behind before it is "
          "ended RESOURCE_EXHAUSTED; >= 1");
ABSL_FLAG(std::string, default_policy, "triaxial-static",
          "built-in policy for tenants without their own: triaxial-static, "
          "bf16, fp8, int8, int4, int2, tq4, tq3, tq2");
ABSL_FLAG(int64_t, worker_rpc_timeout_ms, 30000,
          "deadline of the manager's calls to workers (DemoteBlocks, tier "
          "plans)");
ABSL_FLAG(std::string, pressure_mode, "demote-first",
          "memory-pressure response: demote-first (demote, spill, evict by "
          "quality lost per byte), graph-evict (evict only, graph-weighted), "
          "lru (evict the least recently used block)");
ABSL_FLAG(double, high_watermark, 0.90,
          "fraction of a pool above which the manager reclaims");
ABSL_FLAG(double, low_watermark, 0.80, "fraction a reclaim brings a pool to");
ABSL_FLAG(int64_t, pressure_interval_ms, 200,
          "period of the background ranking and watermark check; 0: off "
          "(admission still reclaims)");
ABSL_FLAG(std::string, protected_roles, "system,tool_schema",
          "roles never evicted (comma-separated: system, tool_schema, user, "
          "assistant, reasoning, tool_call, tool_result, delimiter; empty: "
          "none)");
ABSL_FLAG(double, evict_factor, 4.0,
          "eviction distortion of a tag = this x its largest calibrated "
          "distortion");
ABSL_FLAG(double, spill_host_penalty, 1e-3,
          "distortion-equivalent per token of restoring a host-spilled block");
ABSL_FLAG(double, spill_disk_penalty, 4e-3,
          "distortion-equivalent per token of restoring a disk-spilled block");
ABSL_FLAG(uint32_t, window_guard_tokens, 64,
          "blocks ending within this many tokens of a sequence's end are "
          "taken to be in the worker's BF16 window: never spilled or evicted "
          "by the pressure manager (set it to the workers' --window_tokens)");
ABSL_FLAG(int64_t, active_guard_ms, 5000,
          "a sequence used (Open, Extend, ReportAccess) within this many ms "
          "is not spilled by the pressure manager, so a session restored "
          "for its turn stays on the device for it; >= 0, 0: off");
ABSL_FLAG(double, reuse_half_life_ms, 30000,
          "half-life of the reuse probability of an idle sequence's blocks");
ABSL_FLAG(int64_t, admission_deadline_ms, 5000,
          "how long the reclaim round of a refused Open / Extend or of a "
          "ReportAccess(active) restore may run (the call's own deadline "
          "ends it sooner); > 0");
ABSL_FLAG(bool, resume_reserve, true,
          "an Open must fit beside the bytes of spilled blocks of open "
          "sequences (on its worker and under its tenant's ceiling), so they "
          "can be restored");
ABSL_FLAG(std::string, metadata, "file:kvmanager-metadata",
          "where the manager keeps what it cannot rebuild (tenants, budgets, "
          "policies, calibration tables, sequences and their blocks, id "
          "counters): file:DIR (a write-ahead log and snapshots in DIR, "
          "created if missing; relative to the working directory), "
          "etcd://HOST:PORT,... (several managers share one etcd cluster; one "
          "leads, the others stand by) or memory (nothing survives a "
          "restart)");
ABSL_FLAG(std::string, advertise, "",
          "host:port clients and workers reach this manager at, published as "
          "the leader's address with --metadata=etcd://... (default: the "
          "--listen host and bound port)");
ABSL_FLAG(std::string, etcd_prefix, "/triaxkv/default",
          "with --metadata=etcd://...: the key prefix of this cluster's "
          "leader key and log (managers of one cluster share it)");
ABSL_FLAG(std::string, etcd_tls_ca, "",
          "with etcd: PEM CA certificates that verify the members (TLS to "
          "etcd; empty: plaintext)");
ABSL_FLAG(std::string, etcd_tls_cert, "",
          "with --etcd_tls_ca: PEM client certificate for members that "
          "require one (etcd --client-cert-auth)");
ABSL_FLAG(std::string, etcd_tls_key, "", "PEM private key of --etcd_tls_cert");
ABSL_FLAG(int64_t, etcd_lease_seconds, 2,
          "with --metadata=etcd://...: the leader lease's TTL; a standby "
          "takes over about this long after the leader dies; >= 1");
ABSL_FLAG(uint64_t, metadata_snapshot_mb, 64,
          "log bytes (MiB) after which the state is snapshotted and the log "
          "before it deleted; > 0");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "ZeroMQ PUB endpoint of KV events in vLLM's format, e.g. "
          "tcp://*:5557 (bound when it has '*', else connected); empty: off "
          "(docs/kv_events.md)");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "ZeroMQ ROUTER endpoint answering replay requests for missed KV "
          "event batches, e.g. tcp://*:5558; empty: no replay");
ABSL_FLAG(std::string, kv_events_topic, "",
          "topic frame of every KV event batch");
ABSL_FLAG(uint64_t, kv_events_buffer, 10000,
          "KV event batches kept for replay (> 0)");
ABSL_FLAG(int64_t, data_parallel_rank, 0,
          "data_parallel_rank of every KV event batch; a non-zero rank also "
          "offsets the KV event ports by itself, as vLLM does");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve gRPC (and --http_listen as HTTPS) "
          "over TLS with it, and present it on the calls to workers; empty: "
          "plaintext (docs/security.md)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: verify the workers dialed and ask every "
          "client for a certificate signed by them (worker RPCs then need "
          "one named in --tls_worker_names)");
ABSL_FLAG(std::string, tls_worker_server_name, "",
          "with --tls_ca: verify workers' certificates against this DNS "
          "name instead of the address dialed (workers advertise addresses, "
          "such as pod IPs, a shared certificate cannot name); empty: the "
          "address");
ABSL_FLAG(bool, tls_require_client_cert, false,
          "refuse clients without a certificate signed by --tls_ca (mutual "
          "TLS on every call)");
ABSL_FLAG(std::string, tls_worker_names, "kvworker",
          "with --tls_ca: the client certificate names (common name, else "
          "first SAN) allowed to call RegisterWorker and Heartbeat, "
          "comma-separated; a trailing * matches a prefix (kvworker-*); "
          "empty: any client");
ABSL_FLAG(std::string, auth, "none",
          "none: any caller may make any call (a trusted network only); "
          "token: every call carries \"authorization: Bearer <token>\" "
          "(tenant, worker and admin roles; docs/security.md); needs "
          "--admin_token_file");
ABSL_FLAG(uint32_t, capability_ttl_seconds, 86400,
          "--auth=token: how long the capability a sequence's reply carries "
          "lets its tenant call the worker (every Open, Extend, Fork and "
          "GetSequence reply signs a fresh one); 1..2592000");
ABSL_FLAG(std::string, admin_token_file, "",
          "--auth=token: the bootstrap admin token (created, mode 0600, "
          "when the file does not exist; refused when others may read it)");
ABSL_FLAG(uint32_t, transfer_timeout_ms, 10000,
          "bound on a TransferSequence whose request gives no timeout_ms: "
          "allocate, pull, verify and commit, else it aborts; "
          "1..3600000");
// Limits (docs/flags.md "Limits"): each refused RESOURCE_EXHAUSTED naming
// the limit and its value.
ABSL_FLAG(uint32_t, max_message_bytes, triax::manager::kMaxRequestBytes,
          "largest request message the server receives, bytes; "
          "1048576..2147483647");
ABSL_FLAG(uint32_t, max_spans_per_request, 65536,
          "spans of one OpenSequence / ExtendSequence; 0: no limit");
ABSL_FLAG(uint32_t, max_sequences_per_tenant, 1000000,
          "open sequences one tenant may hold (Open, Fork); 0: no limit");
ABSL_FLAG(uint32_t, max_watchers, 1024,
          "WatchEvents streams open at once; 0: no limit");
ABSL_FLAG(uint64_t, max_events_per_watch, 0,
          "events one WatchEvents stream sends before it ends (the client "
          "resumes with the from_id the message names); 0: no limit");
ABSL_FLAG(uint32_t, max_call_streams, 256,
          "SequenceCalls streams open at once; 0: no limit");
ABSL_FLAG(uint32_t, max_stream_calls, 256,
          "calls of one SequenceCalls stream in flight, from arrival to the "
          "reply's write (the stream is not read further meanwhile; calls "
          "of a batch past the room left are answered RESOURCE_EXHAUSTED, "
          "a larger batch ends the stream RESOURCE_EXHAUSTED); >= 1");

namespace {

constexpr char kUsage[] =
    "the triaxkv control plane: tracks every tagged KV block of the cluster,\n"
    "tenants and their budgets, placement on workers, policies and\n"
    "calibration tables, memory pressure (demote, spill, evict) and the\n"
    "lifecycle event log. Workers register with it; frontends open, extend,\n"
    "fork and close sequences through it.\n"
    "\n"
    "  kvmanager --listen=0.0.0.0:7070\n"
    "  kvmanager --listen=127.0.0.1:0 --port_file=/tmp/m.port\n"
    "\n"
    "Serves triax.v1.Manager and grpc.health.v1.Health on --listen (\"\" and\n"
    "\"triax.v1.Manager\" are SERVING while it runs, NOT_SERVING from\n"
    "shutdown on) and prints \"kvmanager listening on HOST:PORT\" once\n"
    "serving. With --http_listen it also serves /metrics (Prometheus text),\n"
    "/healthz and /readyz over HTTP (docs/metrics.md), and a live dashboard\n"
    "at / with its JSON under /api/ (docs/dashboard.md). Exit status: 0 after\n"
    "SIGTERM / SIGINT (graceful shutdown), 1 when it cannot start, 2 for\n"
    "flags out of range or contradicting each other (and unreadable or\n"
    "invalid --tls_* files).\n"
    "\n"
    "What it cannot rebuild from its workers it keeps in --metadata (an\n"
    "embedded write-ahead log and snapshots; docs/manager.md \"Durable\n"
    "metadata\"): killed and started again on the same flags it recovers.\n"
    "With --metadata=etcd://HOST:PORT,... several managers share one etcd:\n"
    "one leads (an etcd lease), the others answer UNAVAILABLE naming it and\n"
    "take over when it dies (docs/manager.md \"Failover on etcd\").\n"
    "Memory beyond open sequences and their blocks is bounded by\n"
    "--event_retention, --event_retention_bytes, --closed_retention,\n"
    "--idempotency_capacity and --watcher_queue_limit; docs/manager.md\n"
    "\"Retention and memory\" gives the bytes per item. List RPCs answer\n"
    "pages of at most 10000 items (page_size 0: 1000); kvctl follows the\n"
    "pages. With --tls_cert/--tls_key it serves TLS (and HTTPS); with\n"
    "--tls_ca only workers' certificates may register and heartbeat\n"
    "(docs/security.md). Flags:";

// Ranges the core does not check, and flags that contradict each other;
// messages name the flags and their values. ManagerCore::Create checks the
// rest (block tokens, retention, watermarks, ranker options).
absl::Status CheckFlags() {
  const int64_t timeout = absl::GetFlag(FLAGS_worker_timeout_ms);
  const uint32_t heartbeat = absl::GetFlag(FLAGS_heartbeat_interval_ms);
  if (heartbeat == 0) {
    return absl::InvalidArgumentError("--heartbeat_interval_ms=0 must be > 0");
  }
  if (timeout > 0 && heartbeat >= timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--heartbeat_interval_ms=", heartbeat,
        " is not below --worker_timeout_ms=", timeout,
        ": every worker would be marked suspect between two heartbeats"));
  }
  if (const int64_t down = absl::GetFlag(FLAGS_worker_down_timeout_ms);
      down <= timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--worker_down_timeout_ms=", down, " is not above --worker_timeout_ms=",
        timeout, ": a silent worker must be SUSPECT before it is DOWN"));
  }
  if (const int64_t t = absl::GetFlag(FLAGS_worker_rpc_timeout_ms); t <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker_rpc_timeout_ms=", t, " must be > 0"));
  }
  if (const int64_t d = absl::GetFlag(FLAGS_admission_deadline_ms); d <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--admission_deadline_ms=", d, " must be > 0"));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, uint64_t>{"event_retention",
                                         absl::GetFlag(FLAGS_event_retention)},
        {"idempotency_capacity", absl::GetFlag(FLAGS_idempotency_capacity)},
        {"watcher_queue_limit", absl::GetFlag(FLAGS_watcher_queue_limit)}}) {
    if (value == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=0 must be >= 1"));
    }
  }
  if (const int64_t p = absl::GetFlag(FLAGS_pressure_interval_ms); p < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pressure_interval_ms=", p, " must be >= 0 (0: off)"));
  }
  return absl::OkStatus();
}

constexpr char kServiceName[] = "triax.v1.Manager";

}  // namespace

int main(int argc, char** argv) {
  triax::InitDaemonFlags("kvmanager/main.cc", kUsage);
  triax::DisableMutexDeadlockDetectionInRelease();
  absl::ParseCommandLine(argc, argv);
  using triax::Kv;
  using triax::Log;
  using triax::LogLevel;
  if (absl::Status s = CheckFlags(); !s.ok()) {
    Log(LogLevel::kError, "manager", "bad flags", Kv("error", s.ToString()));
    return 2;
  }

  // Block the shutdown signals before gRPC starts threads, so that only
  // sigwait below receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // One thread takes them for the whole run: a standby's campaign and the
  // leader's serving both end on it.
  absl::Notification shutdown;
  std::atomic<int> shutdown_signal{0};
  std::thread([&signals, &shutdown, &shutdown_signal] {
    int sig = 0;
    sigwait(&signals, &sig);
    shutdown_signal = sig;
    shutdown.Notify();
  }).detach();

  triax::manager::ManagerOptions options;
  options.worker_timeout_ms = absl::GetFlag(FLAGS_worker_timeout_ms);
  options.worker_down_timeout_ms = absl::GetFlag(FLAGS_worker_down_timeout_ms);
  options.heartbeat_interval_ms = absl::GetFlag(FLAGS_heartbeat_interval_ms);
  options.default_block_tokens = absl::GetFlag(FLAGS_default_block_tokens);
  options.recent_turns = absl::GetFlag(FLAGS_recent_turns);
  options.event_retention = absl::GetFlag(FLAGS_event_retention);
  options.event_retention_bytes = absl::GetFlag(FLAGS_event_retention_bytes);
  options.closed_retention = absl::GetFlag(FLAGS_closed_retention);
  options.idempotency_capacity = absl::GetFlag(FLAGS_idempotency_capacity);
  options.watcher_queue_limit = absl::GetFlag(FLAGS_watcher_queue_limit);
  options.default_policy = absl::GetFlag(FLAGS_default_policy);
  {
    auto mode =
        triax::manager::ParsePressureMode(absl::GetFlag(FLAGS_pressure_mode));
    if (!mode.ok()) {
      Log(LogLevel::kError, "manager", "bad flags",
          Kv("error", mode.status().ToString()));
      return 2;
    }
    options.ranker.mode = *mode;
    auto roles = triax::ParseRoleList(absl::GetFlag(FLAGS_protected_roles));
    if (!roles.ok()) {
      Log(LogLevel::kError, "manager", "bad flags",
          Kv("error", roles.status().ToString()));
      return 2;
    }
    options.ranker.protected_roles = *roles;
    options.ranker.evict_factor = absl::GetFlag(FLAGS_evict_factor);
    options.ranker.spill_host_penalty = absl::GetFlag(FLAGS_spill_host_penalty);
    options.ranker.spill_disk_penalty = absl::GetFlag(FLAGS_spill_disk_penalty);
    options.ranker.reuse_half_life_ms = absl::GetFlag(FLAGS_reuse_half_life_ms);
    options.window_guard_tokens = absl::GetFlag(FLAGS_window_guard_tokens);
    options.active_guard_ms = absl::GetFlag(FLAGS_active_guard_ms);
    options.watermarks.high = absl::GetFlag(FLAGS_high_watermark);
    options.watermarks.low = absl::GetFlag(FLAGS_low_watermark);
    options.admission_deadline_ms = absl::GetFlag(FLAGS_admission_deadline_ms);
    options.resume_reserve = absl::GetFlag(FLAGS_resume_reserve);
  }
  options.transfer_timeout_ms = absl::GetFlag(FLAGS_transfer_timeout_ms);
  auto tls =
      triax::LoadTls({absl::GetFlag(FLAGS_tls_cert),
                      absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca),
                      absl::GetFlag(FLAGS_tls_require_client_cert)});
  if (!tls.ok()) {
    Log(LogLevel::kError, "manager", "bad flags",
        Kv("error", tls.status().ToString()));
    return 2;
  }
  std::shared_ptr<grpc::ServerCredentials> credentials =
      triax::ServerCredentials(*tls);
  std::vector<std::string> worker_certificate_names;
  if (tls->server_enabled() && tls->client_enabled()) {
    // Only real workers register and heartbeat: their client certificates
    // carry a worker name; a frontend's (or none) is refused at the call.
    std::vector<std::string> names = absl::StrSplit(
        absl::GetFlag(FLAGS_tls_worker_names), ',', absl::SkipWhitespace());
    worker_certificate_names = std::move(names);
  } else if (tls->server_enabled()) {
    Log(LogLevel::kWarn, "manager",
        "TLS without --tls_ca: client certificates are not asked for, so any "
        "client may register and heartbeat as a worker");
  }
  options.max_sequences_per_tenant =
      absl::GetFlag(FLAGS_max_sequences_per_tenant);
  const uint32_t max_message = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message < (1u << 20) || max_message > INT32_MAX) {
    Log(LogLevel::kError, "manager", "bad flags",
        Kv("error", absl::StrCat("--max_message_bytes = ", max_message,
                                 "; must be 1048576..2147483647")));
    return 2;
  }
  auto core =
      triax::manager::ManagerCore::Create(options, triax::RealClock::Get());
  if (!core.ok()) {
    Log(LogLevel::kError, "manager", "bad flags",
        Kv("error", core.status().ToString()));
    return 2;
  }
  // Durable metadata: recover before serving, then journal every change.
  std::string listen = absl::GetFlag(FLAGS_listen);
  std::unique_ptr<triax::manager::EtcdClient> etcd_client;
  std::unique_ptr<triax::manager::EtcdLeadership> leadership;
  std::unique_ptr<triax::manager::MetadataStore> store;
  {
    const std::string metadata = absl::GetFlag(FLAGS_metadata);
    const uint64_t snapshot_mb = absl::GetFlag(FLAGS_metadata_snapshot_mb);
    const bool etcd = absl::StartsWith(metadata, "etcd://");
    if (metadata != "memory" && !etcd &&
        (!absl::StartsWith(metadata, "file:") || metadata.size() == 5)) {
      Log(LogLevel::kError, "manager", "bad flags",
          Kv("error",
             absl::StrCat("--metadata=", metadata,
                          " is neither file:DIR, etcd://HOST:PORT,... nor "
                          "memory")));
      return 2;
    }
    if (etcd) {
      auto endpoints = triax::manager::ParseEtcdEndpoints(metadata);
      if (!endpoints.ok() || absl::GetFlag(FLAGS_etcd_lease_seconds) < 1) {
        Log(LogLevel::kError, "manager", "bad flags",
            Kv("error",
               endpoints.ok()
                   ? absl::StrCat("--etcd_lease_seconds=",
                                  absl::GetFlag(FLAGS_etcd_lease_seconds),
                                  " must be >= 1")
                   : endpoints.status().ToString()));
        return 2;
      }
      auto etcd_tls =
          triax::LoadTls({absl::GetFlag(FLAGS_etcd_tls_cert),
                          absl::GetFlag(FLAGS_etcd_tls_key),
                          absl::GetFlag(FLAGS_etcd_tls_ca), false, "etcd_tls"});
      if (!etcd_tls.ok() ||
          (!etcd_tls->cert_pem.empty() && !etcd_tls->client_enabled())) {
        Log(LogLevel::kError, "manager", "bad flags",
            Kv("error", etcd_tls.ok()
                            ? std::string("--etcd_tls_cert needs --etcd_tls_ca")
                            : etcd_tls.status().ToString()));
        return 2;
      }
      etcd_client = std::make_unique<triax::manager::EtcdClient>(
          *endpoints, absl::Seconds(5),
          etcd_tls->client_enabled() ? triax::ChannelCredentials(*etcd_tls)
                                     : nullptr);
    }
    if (snapshot_mb == 0) {
      Log(LogLevel::kError, "manager", "bad flags",
          Kv("error", "--metadata_snapshot_mb=0 must be > 0"));
      return 2;
    }
    if (etcd_client != nullptr) {
      // Stand by until this manager leads: RPCs get UNAVAILABLE naming the
      // leader meanwhile.
      auto standby = triax::manager::StandbyServer::Start(listen, credentials);
      if (!standby.ok()) {
        Log(LogLevel::kError, "manager",
            std::string(standby.status().message()), Kv("listen", listen));
        return 1;
      }
      listen = absl::StrCat(listen.substr(0, listen.rfind(':')), ":",
                            (*standby)->port());
      std::string advertise = absl::GetFlag(FLAGS_advertise);
      if (advertise.empty()) advertise = listen;
      (*standby)->SetSelf(advertise);
      if (const std::string port_file = absl::GetFlag(FLAGS_port_file);
          !port_file.empty()) {
        triax::WritePortFile(port_file, (*standby)->port()).IgnoreError();
      }
      triax::manager::EtcdLeadershipOptions lead;
      lead.prefix = absl::GetFlag(FLAGS_etcd_prefix);
      lead.advertise = advertise;
      lead.lease_seconds = absl::GetFlag(FLAGS_etcd_lease_seconds);
      leadership = std::make_unique<triax::manager::EtcdLeadership>(
          etcd_client.get(), lead);
      Log(LogLevel::kInfo, "manager", "campaigning for leadership",
          absl::StrCat(Kv("etcd", etcd_client->endpoints()), " ",
                       Kv("prefix", lead.prefix), " ",
                       Kv("advertise", advertise)));
      const absl::Status won = leadership->Campaign(
          [&](const std::string& leader) {
            (*standby)->SetLeader(leader);
            Log(LogLevel::kInfo, "manager", "standing by",
                Kv("leader", leader.empty() ? "-" : leader));
          },
          &shutdown);
      (*standby)->Stop();
      if (!won.ok()) return 0;  // shut down while standing by
      Log(LogLevel::kInfo, "manager", "leading",
          absl::StrCat(Kv("advertise", advertise), " ",
                       Kv("revision", leadership->create_revision())));
    }
    if (metadata != "memory") {
      triax::manager::MetadataStoreOptions store_options;
      store_options.dir = etcd_client != nullptr ? "" : metadata.substr(5);
      store_options.snapshot_bytes = snapshot_mb << 20;
      triax::manager::RecoveredState recovered;
      triax::manager::RecoveryFigures figures;
      auto opened =
          etcd_client != nullptr
              ? triax::manager::MetadataStore::Open(
                    std::make_unique<triax::manager::EtcdLog>(
                        etcd_client.get(), absl::GetFlag(FLAGS_etcd_prefix),
                        leadership->create_revision()),
                    store_options, &recovered, &figures)
              : triax::manager::MetadataStore::Open(store_options, &recovered,
                                                    &figures);
      if (!opened.ok()) {
        Log(LogLevel::kError, "manager", "cannot open the metadata store",
            absl::StrCat(Kv("dir", store_options.dir), " ",
                         Kv("error", opened.status().ToString())));
        return 1;
      }
      store = *std::move(opened);
      const auto start = std::chrono::steady_clock::now();
      if (absl::Status s = (*core)->Restore(std::move(recovered)); !s.ok()) {
        Log(LogLevel::kError, "manager", "cannot restore the metadata store",
            absl::StrCat(Kv("dir", store_options.dir), " ",
                         Kv("error", s.ToString())));
        return 1;
      }
      (*core)->SetJournal(store.get());
      // Replies wait for durability in the journal's writer thread, not in
      // gRPC's callback threads (ManagerService FinishDurable).
      (*core)->DeferDurableWaits(true);
      if (leadership != nullptr) {
        // No two leaders: one that cannot keep its lease stops serving
        // before a standby can win (and its log writes are fenced anyway).
        leadership->KeepAlive([](const std::string& why) {
          Log(LogLevel::kError, "manager", "lost leadership, stopping",
              Kv("reason", why));
          std::_Exit(75);
        });
      }
      const auto counts = (*core)->GetCounts();
      Log(LogLevel::kInfo, "manager", "metadata recovered",
          absl::StrCat(
              Kv("dir", store_options.dir), " ", Kv("epoch", figures.epoch),
              " ", Kv("records", figures.records), " ",
              Kv("bytes", figures.bytes), " ", Kv("tenants", counts.tenants),
              " ", Kv("workers", counts.workers), " ",
              Kv("sequences", counts.sequences), " ",
              Kv("blocks", counts.blocks), " ",
              Kv("read_seconds", figures.read_seconds), " ",
              Kv("restore_seconds",
                 std::chrono::duration<double>(
                     std::chrono::steady_clock::now() - start)
                     .count())));
    }
  }
  // Check often enough that a silent worker is noticed within ~1/4 of the
  // timeout past it.
  const int64_t check_ms = std::max<int64_t>(
      10, std::min<int64_t>(1000, options.worker_timeout_ms / 4));
  triax::manager::ManagerService service(
      core->get(), check_ms, absl::GetFlag(FLAGS_worker_rpc_timeout_ms),
      absl::GetFlag(FLAGS_pressure_interval_ms));
  service.SetWorkerCredentials(triax::ChannelCredentials(*tls),
                               absl::GetFlag(FLAGS_tls_worker_server_name));
  if (!worker_certificate_names.empty()) {
    service.RequireWorkerCertificates(std::move(worker_certificate_names));
  }
  if (const std::string auth = absl::GetFlag(FLAGS_auth); auth == "token") {
    const std::string path = absl::GetFlag(FLAGS_admin_token_file);
    if (const uint32_t ttl = absl::GetFlag(FLAGS_capability_ttl_seconds);
        ttl < 1 || ttl > 2592000) {
      Log(LogLevel::kError, "manager",
          absl::StrCat("--capability_ttl_seconds=", ttl,
                       " is not in [1, 2592000]"));
      return 2;
    }
    if (path.empty()) {
      Log(LogLevel::kError, "manager",
          "--auth=token needs --admin_token_file (the bootstrap admin token)");
      return 2;
    }
    bool created = false;
    absl::StatusOr<std::string> admin = triax::manager::ReadOrCreateAdminToken(
        path, (*core)->NowMs(), &created);
    absl::Status added =
        admin.ok() ? (*core)->AddBootstrapToken(*admin) : admin.status();
    if (!added.ok()) {
      Log(LogLevel::kError, "manager", "cannot use the admin token",
          Kv("error", added.ToString()));
      return 2;
    }
    absl::StatusOr<std::string> key = (*core)->EnsureCapabilityKey();
    if (!key.ok()) {
      Log(LogLevel::kError, "manager", "no capability key",
          Kv("error", key.status().ToString()));
      return 1;
    }
    service.RequireTokens(
        *std::move(key),
        int64_t{1000} * absl::GetFlag(FLAGS_capability_ttl_seconds));
    Log(LogLevel::kInfo, "manager", "bearer tokens required",
        absl::StrCat(Kv("admin_token_file", path), " ",
                     Kv("created", created ? "true" : "false"), " ",
                     Kv("stored_tokens", (*core)->ListTokens().size())));
  } else if (auth != "none") {
    Log(LogLevel::kError, "manager",
        absl::StrCat("--auth=", auth, " is not one of none, token"));
    return 2;
  }
  triax::manager::ServiceLimits limits;
  limits.max_spans_per_request = absl::GetFlag(FLAGS_max_spans_per_request);
  limits.max_watchers = absl::GetFlag(FLAGS_max_watchers);
  limits.max_events_per_watch = absl::GetFlag(FLAGS_max_events_per_watch);
  limits.max_call_streams = absl::GetFlag(FLAGS_max_call_streams);
  limits.max_stream_calls = absl::GetFlag(FLAGS_max_stream_calls);
  if (limits.max_stream_calls == 0) {
    Log(LogLevel::kError, "manager", "--max_stream_calls=0: must be >= 1");
    return 2;
  }
  service.SetLimits(limits);

  triax::RpcMetrics rpc_metrics("triaxkv_manager");
  service.SetCallRecorder([&rpc_metrics](const std::string& method, int code,
                                         absl::Duration elapsed) {
    rpc_metrics.Record("triax.v1.Manager", method, code, elapsed);
  });
  triax::manager::ManagerMetricsOptions metrics_options;
  metrics_options.max_tenants = absl::GetFlag(FLAGS_metrics_max_tenants);
  triax::manager::ManagerMetrics metrics(core->get(), &rpc_metrics,
                                         metrics_options);
  triax::manager::ManagerReadiness readiness;
  triax::manager::Dashboard dashboard(core->get());
  if (absl::GetFlag(FLAGS_auth) == "token") dashboard.RequireAdminTokens();

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, credentials, &port);
  const std::string local_listen = absl::GetFlag(FLAGS_local_listen);
  mode_t local_mode = 0;
  if (!local_listen.empty()) {
    absl::Status s = triax::CheckLocalListen("local_listen", local_listen);
    absl::StatusOr<mode_t> mode = triax::ParseSocketMode(
        "local_listen_mode", absl::GetFlag(FLAGS_local_listen_mode));
    if (s.ok()) s = mode.status();
    if (!s.ok()) {
      Log(LogLevel::kError, "manager", "bad flags", Kv("error", s.ToString()));
      return 2;
    }
    local_mode = *mode;
    builder.AddListeningPort(local_listen,
                             triax::LocalSocketServerCredentials());
  }
  {
    std::vector<
        std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    // First, so that the metrics record the status the client gets.
    interceptors.push_back(triax::ParseErrorInterceptorFactory());
    interceptors.push_back(rpc_metrics.InterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  // gRPC would otherwise bind with SO_REUSEPORT, and a second kvmanager on
  // this port would start and split the connections with this one.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    Log(LogLevel::kError, "manager",
        absl::StrCat("cannot listen on --listen=", listen,
                     ": the port is in use or the host is not an address of "
                     "this machine"),
        Kv("listen", listen));
    return 1;
  }
  // The socket file goes with the process, however it ends here.
  absl::Cleanup remove_socket = [&local_listen] {
    triax::RemoveSocket(local_listen);
  };
  if (!local_listen.empty()) {
    if (absl::Status s = triax::RestrictSocket(local_listen, local_mode);
        !s.ok()) {
      Log(LogLevel::kError, "manager", std::string(s.message()),
          Kv("local_listen", local_listen));
      server->Shutdown();
      return 1;
    }
  }
  // Before the port file, so that whoever waits on it finds HTTP up too.
  std::unique_ptr<triax::HttpServer> http;
  if (const std::string http_listen = absl::GetFlag(FLAGS_http_listen);
      !http_listen.empty()) {
    auto started = triax::StartOperatorHttp(
        http_listen, absl::GetFlag(FLAGS_http_port_file),
        {[&] {
           return triax::MetricsResponse({&rpc_metrics.registry(), &metrics});
         },
         [] { return triax::ProbeResponse(true, ""); },
         [&readiness] { return readiness.Ready(); }, dashboard.Routes(),
         tls->cert_pem, tls->key_pem});
    if (!started.ok()) {
      Log(LogLevel::kError, "manager", std::string(started.status().message()),
          Kv("http_listen", http_listen));
      server->Shutdown();
      return 1;
    }
    http = std::move(*started);
  }
  std::unique_ptr<triax::manager::KvEventPublisher> kv_events;
  if (const std::string ep = absl::GetFlag(FLAGS_kv_events_endpoint);
      !ep.empty() || !absl::GetFlag(FLAGS_kv_events_replay_endpoint).empty()) {
    triax::manager::KvEventsOptions kv;
    kv.endpoint = ep;
    kv.replay_endpoint = absl::GetFlag(FLAGS_kv_events_replay_endpoint);
    kv.topic = absl::GetFlag(FLAGS_kv_events_topic);
    kv.buffer_steps = absl::GetFlag(FLAGS_kv_events_buffer);
    kv.data_parallel_rank = absl::GetFlag(FLAGS_data_parallel_rank);
    absl::StatusOr<std::unique_ptr<triax::manager::KvEventPublisher>> started =
        absl::InvalidArgumentError(
            "--kv_events_replay_endpoint needs --kv_events_endpoint (empty)");
    if (!ep.empty()) {
      started = triax::manager::KvEventPublisher::Start(core->get(), kv);
    }
    if (!started.ok()) {
      Log(LogLevel::kError, "manager", std::string(started.status().message()),
          Kv("kv_events_endpoint", ep));
      server->Shutdown();
      return 1;
    }
    kv_events = *std::move(started);
    Log(LogLevel::kInfo, "manager", "publishing KV events",
        absl::StrCat(Kv("endpoint", kv_events->endpoint()), " ",
                     Kv("replay_endpoint", kv_events->replay_endpoint())));
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    if (absl::Status s = triax::WritePortFile(port_file, port); !s.ok()) {
      Log(LogLevel::kError, "manager", "cannot write port file",
          absl::StrCat(Kv("path", port_file), " ", Kv("error", s.message())));
      server->Shutdown();
      return 1;
    }
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) {
    Log(LogLevel::kError, "manager", "the gRPC health service did not start");
    server->Shutdown();
    return 1;
  }
  health->SetServingStatus(kServiceName, true);
  readiness.SetServing(true);
  std::cout << "kvmanager listening on " << host << ":" << port << std::endl;
  Log(LogLevel::kInfo, "manager", "listening",
      absl::StrCat(Kv("address", absl::StrCat(host, ":", port)), " ",
                   Kv("default_policy", options.default_policy), " ",
                   Kv("worker_timeout_ms", options.worker_timeout_ms), " ",
                   Kv("worker_down_timeout_ms", options.worker_down_timeout_ms),
                   " ", Kv("local_listen", local_listen)));

  shutdown.WaitForNotification();
  Log(LogLevel::kInfo, "manager", "shutting down",
      Kv("signal", shutdown_signal.load()));
  // NOT_SERVING for the drain, so health probes stop routing here first.
  readiness.SetServing(false);
  health->Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  service.Stop();
  server->Wait();
  kv_events.reset();             // reads the core; goes before it
  (*core)->SetJournal(nullptr);  // the store closes before the core
  if (http) http->Stop();
  return 0;
}
