// kvworker: the triaxkv data-plane server. Flags, their validation against
// each other, and the server builder only; the logic lives in worker_core
// (worker/worker_core.h over worker/sequence_store.h) and its gRPC adapter
// (worker/worker_service.h), the device's health on the gRPC health service
// in worker/health_reporter.h, registration in worker/manager_link.h.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/bearer.h"
#include "common/capability.h"
#include "common/daemon_flags.h"
#include "common/ids.h"
#include "common/local_socket.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/parse_errors.h"
#include "common/port_file.h"
#include "common/tls.h"
#include "worker/device.h"
#include "worker/health_reporter.h"
#include "worker/manager_link.h"
#include "worker/metrics.h"
#include "worker/page_allocator.h"
#include "worker/sequence_store.h"
#include "worker/tier_store.h"
#include "worker/worker_core.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7071",
          "host:port to serve on; port 0 picks a free port");
ABSL_FLAG(std::string, port_file, "",
          "if set, the bound port is written here (atomically)");
ABSL_FLAG(std::string, local_listen, "",
          "unix:/PATH: also serve on this Unix-domain socket, for clients on "
          "this host (gRPC local credentials: no TLS; tokens and capabilities "
          "apply; methods that need a certificate are refused there); "
          "docs/security.md \"Local socket\"; empty: off");
ABSL_FLAG(std::string, local_listen_mode, "0660",
          "octal file mode of the --local_listen socket: who may connect");
ABSL_FLAG(std::string, http_listen, "",
          "host:port of the HTTP endpoints /metrics (Prometheus), /healthz "
          "and /readyz; port 0 picks a free port; empty: off");
ABSL_FLAG(std::string, http_port_file, "",
          "if set, the bound HTTP port is written here (atomically)");
ABSL_FLAG(std::string, manager, "",
          "kvmanager host:port to register with, or several comma-separated "
          "(managers on etcd: the worker follows the leader); empty runs "
          "standalone");
ABSL_FLAG(std::string, token_file, "",
          "file holding this worker's bearer token (role worker) for a "
          "kvmanager with --auth=token");
ABSL_FLAG(std::string, worker_id, "",
          "worker id ([A-Za-z0-9._:-]{1,128}), also the disk tier's "
          "subdirectory; default worker-<hostname>-<port>");
ABSL_FLAG(std::string, advertise, "",
          "host:port the manager hands to frontends (needs --manager); "
          "default the bound listen address");
ABSL_FLAG(int64_t, pool_mb, 1024, "KV page arena size in MiB");
ABSL_FLAG(int64_t, frame_kb, 256,
          "page frame size in KiB (a multiple of 16, at most --pool_mb): the "
          "arena is cut into frames any encoding can take; a shape whose "
          "BF16 page is larger than a frame is refused at AllocatePages");
ABSL_FLAG(int32_t, window_tokens, 32,
          "default BF16 recent-window tokens per sequence and layer, unless "
          "AllocatePages names window_tokens (0: seal blocks as soon as they "
          "are full)");
ABSL_FLAG(std::string, backend, "auto",
          "auto | cpu | cuda; auto picks cuda when this build has CUDA and a "
          "CUDA device is visible, else cpu");
ABSL_FLAG(int32_t, cuda_device, 0,
          "CUDA device ordinal for the cuda backend (one worker per GPU); "
          "not with --backend=cpu");
ABSL_FLAG(int64_t, host_tier_mb, 256,
          "host spill tier in MiB (pinned memory on CUDA); 0 disables it");
ABSL_FLAG(std::string, disk_tier_dir, "",
          "directory of the disk spill tier (files under "
          "<dir>/<worker_id or pid-N>/); empty disables it");
ABSL_FLAG(int64_t, disk_tier_mb, 4096,
          "disk spill tier capacity in MiB of page bytes; > 0 when "
          "--disk_tier_dir is set");
ABSL_FLAG(bool, restore_on_attend, true,
          "Attend/ReadKV over spilled blocks restore them first; false: "
          "answer UNAVAILABLE with retry_after_ms and restore in the "
          "background");
ABSL_FLAG(int32_t, retry_after_ms, 20,
          "retry delay suggested when restore_on_attend is false");
ABSL_FLAG(std::string, transfer_path, "auto",
          "how this worker pulls a sequence it imports: stream (pages over "
          "the source's gRPC ExportPages stream), ipc (the source's arena "
          "mapped here and pages copied device to device: CUDA IPC, or "
          "shared memory between CPU workers, which then share their arena; "
          "same host only, no fallback), link (a point-to-point link between "
          "the two devices: NCCL between CUDA workers, TCP between CPU "
          "workers; no fallback), auto (ipc where the source can share with "
          "this worker, else an NCCL link between CUDA workers when NCCL "
          "loads, else stream; CPU workers stream); a worker on stream also "
          "shares nothing with importers and makes no links");
ABSL_FLAG(std::string, link_host, "",
          "link transfer path, CPU workers: the IP address at which peers "
          "reach this worker's TCP link listeners; empty: the host of "
          "--advertise, else of --listen");
ABSL_FLAG(std::string, nccl_library, "libnccl.so.2",
          "link transfer path, CUDA workers: the NCCL library to load "
          "(a file name searched on the library path, or a path)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve gRPC (and --http_listen as HTTPS) "
          "over TLS with it, and present it as the client certificate to the "
          "manager and to source workers (it needs serverAuth and "
          "clientAuth); empty: plaintext (docs/security.md)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: dial the manager and source workers over TLS "
          "verified by them, and ask clients for certificates signed by "
          "them");
ABSL_FLAG(std::string, tls_worker_server_name, "",
          "with --tls_ca: verify source workers' certificates against this "
          "DNS name instead of the address dialed (workers advertise "
          "addresses, such as pod IPs, a shared certificate cannot name); "
          "empty: the address");
ABSL_FLAG(std::string, tls_manager_names, "kvmanager",
          "with --tls_cert and --tls_ca: the client certificate names "
          "(common name, else first SAN; comma-separated; a trailing * "
          "matches a prefix) allowed to call the manager's RPCs here: "
          "Demote, Spill, Restore, Evict, ImportSequence; empty: any client");
ABSL_FLAG(std::string, tls_worker_names, "kvworker",
          "with --tls_cert and --tls_ca: the client certificate names "
          "allowed to pull pages from here as a transfer's destination: "
          "ExportPages, SharePages, OpenLink, LinkPages; empty: any client");
ABSL_FLAG(bool, tls_require_client_cert, false,
          "refuse clients without a certificate signed by --tls_ca (mutual "
          "TLS on every call)");
ABSL_FLAG(uint32_t, max_message_bytes, 256u << 20,
          "largest message the server receives and sends, bytes (a WriteKV "
          "chunk, an ImportSequence page batch); 1048576..2147483647");
ABSL_FLAG(int32_t, testing_corrupt_export_pages, 0,
          "TEST HOOK: flip one byte of every N-th page this worker exports "
          "(ExportPages), after its CRC32C was taken, so that the importing "
          "worker answers DATA_LOSS; 0 (the default) is off");

namespace {

constexpr char kUsage[] =
    "the triaxkv data plane: holds the KV pages of sequences in mixed\n"
    "encodings on one GPU (or the CPU backend) and runs decode attention\n"
    "over them. It registers with a kvmanager (--manager) and heartbeats its\n"
    "inventory, or runs standalone.\n"
    "\n"
    "  kvworker --listen=0.0.0.0:7071 --manager=kvmanager:7070 \\\n"
    "      --advertise=10.0.0.5:7071 --pool_mb=16384 --backend=cuda\n"
    "  kvworker --listen=127.0.0.1:0 --port_file=/tmp/w.port --backend=cpu\n"
    "\n"
    "Serves triax.v1.Worker and grpc.health.v1.Health on --listen:\n"
    "\"triax.v1.Worker\" is NOT_SERVING while the device is unhealthy (e.g.\n"
    "after a sticky CUDA error: the liveness probe), \"\" is SERVING once the\n"
    "device is healthy and, with --manager, the worker has registered (the\n"
    "readiness probe); both NOT_SERVING from shutdown on. Prints \"kvworker\n"
    "listening on HOST:PORT\" once serving. With --http_listen it also\n"
    "serves /metrics (Prometheus text), /healthz and /readyz over HTTP, the\n"
    "same probes (docs/metrics.md). Exit status: 0 after SIGTERM / SIGINT\n"
    "(graceful shutdown), 1 when it cannot start, 2 for flags out of range\n"
    "or contradicting each other (and unreadable or invalid --tls_* files).\n"
    "With --tls_cert/--tls_key/--tls_ca it serves TLS (and HTTPS) and dials\n"
    "the manager and source workers over TLS with its certificate\n"
    "(docs/security.md). Flags:";

// Values of at most 16 TiB, so MiB -> bytes cannot overflow.
constexpr int64_t kMaxMb = int64_t{1} << 24;

// Bad flags (code 2) are usage, printed plain; a start that fails (code 1)
// is an error record in the log like every other.
int Fail(int code, absl::string_view what) {
  if (code != 2) {
    triax::Log(triax::LogLevel::kError, "worker", what);
    return code;
  }
  std::fprintf(stderr, "kvworker: %.*s\n", static_cast<int>(what.size()),
               what.data());
  return code;
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

absl::Status CheckMb(absl::string_view flag, int64_t value, int64_t min) {
  if (value < min || value > kMaxMb) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", value, " is outside ", min, "..", kMaxMb));
  }
  return absl::OkStatus();
}

// Each flag's own range first, then the flags that contradict each other;
// every message names the flags and their values.
absl::Status CheckFlags() {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const int32_t cuda_device = absl::GetFlag(FLAGS_cuda_device);
  const std::string manager = absl::GetFlag(FLAGS_manager);
  const std::string advertise = absl::GetFlag(FLAGS_advertise);
  const std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  const std::string disk_dir = absl::GetFlag(FLAGS_disk_tier_dir);
  if (absl::Status s =
          triax::worker::ParseTransferPath(absl::GetFlag(FLAGS_transfer_path))
              .status();
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
  }
  const int64_t disk_mb = absl::GetFlag(FLAGS_disk_tier_mb);

  if (!worker_id.empty()) {
    if (absl::Status s = triax::ValidateId("--worker_id", worker_id); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = CheckMb("pool_mb", absl::GetFlag(FLAGS_pool_mb), 1);
      !s.ok()) {
    return s;
  }
  if (const int64_t f = absl::GetFlag(FLAGS_frame_kb); f <= 0 || f % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--frame_kb=", f, " must be a positive multiple of 16"));
  }
  if (const int64_t f = absl::GetFlag(FLAGS_frame_kb),
      pool = absl::GetFlag(FLAGS_pool_mb);
      f > pool * 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--frame_kb=", f, " is larger than the pool: --pool_mb=", pool, " is ",
        pool * 1024, " KiB"));
  }
  if (absl::Status s =
          CheckMb("host_tier_mb", absl::GetFlag(FLAGS_host_tier_mb), 0);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckMb("disk_tier_mb", disk_mb, 0); !s.ok()) return s;
  if (const int32_t w = absl::GetFlag(FLAGS_window_tokens); w < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--window_tokens=", w, " must be >= 0"));
  }
  if (const int32_t r = absl::GetFlag(FLAGS_retry_after_ms); r < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--retry_after_ms=", r, " must be >= 0"));
  }
  if (const int32_t n = absl::GetFlag(FLAGS_testing_corrupt_export_pages);
      n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--testing_corrupt_export_pages=", n, " must be >= 0"));
  }
  if (backend != "auto" && backend != "cpu" && backend != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--backend=", triax::Quote(backend), " is not one of auto, cpu, cuda"));
  }
  if (cuda_device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_device=", cuda_device, " must be >= 0"));
  }

  if (backend == "cpu" && cuda_device != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_device=", cuda_device,
                     " names a CUDA device, but --backend=cpu runs none; drop "
                     "--cuda_device or use --backend=cuda"));
  }
  if (!disk_dir.empty() && disk_mb == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--disk_tier_dir=", triax::Quote(disk_dir),
        " turns the disk tier on, but --disk_tier_mb=0 gives it no room; set "
        "--disk_tier_mb > 0 or drop --disk_tier_dir"));
  }
  if (!advertise.empty() && manager.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--advertise=", triax::Quote(advertise),
        " is the address the manager hands out, but --manager is empty "
        "(standalone); set --manager or drop --advertise"));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  triax::InitDaemonFlags("worker/main.cc", kUsage);
  triax::DisableMutexDeadlockDetectionInRelease();
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = CheckFlags(); !s.ok()) return Fail(2, s.message());
  using namespace triax::worker;  // NOLINT

  // Signals are taken synchronously by sigwait below; block them before any
  // thread starts so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const int64_t pool_mb = absl::GetFlag(FLAGS_pool_mb);
  const int32_t window = absl::GetFlag(FLAGS_window_tokens);
  const int64_t host_tier_mb = absl::GetFlag(FLAGS_host_tier_mb);
  const TransferPath transfer_path =
      *ParseTransferPath(absl::GetFlag(FLAGS_transfer_path));
  auto tls =
      triax::LoadTls({absl::GetFlag(FLAGS_tls_cert),
                      absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca),
                      absl::GetFlag(FLAGS_tls_require_client_cert)});
  if (!tls.ok()) return Fail(2, tls.status().message());
  DeviceOptions device_options;
  device_options.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  device_options.share_arena = transfer_path == TransferPath::kIpc;
  auto device = CreateDevice(absl::GetFlag(FLAGS_backend), device_options);
  if (!device.ok()) return Fail(1, device.status().message());
  const int64_t frame_kb = absl::GetFlag(FLAGS_frame_kb);
  auto allocator =
      PageAllocator::Create(device->get(), static_cast<size_t>(pool_mb) << 20,
                            static_cast<size_t>(frame_kb) << 10);
  if (!allocator.ok()) return Fail(1, allocator.status().message());
  TierStoreOptions tier_options;
  tier_options.host_capacity_bytes = static_cast<uint64_t>(host_tier_mb) << 20;
  tier_options.disk_dir = absl::GetFlag(FLAGS_disk_tier_dir);
  tier_options.disk_capacity_bytes =
      static_cast<uint64_t>(absl::GetFlag(FLAGS_disk_tier_mb)) << 20;
  tier_options.owner = absl::GetFlag(FLAGS_worker_id);  // empty: pid-<pid>
  auto tiers = TierStore::Create(device->get(), tier_options);
  if (!tiers.ok()) return Fail(1, tiers.status().message());
  StoreOptions store_options;
  store_options.window_tokens = static_cast<uint32_t>(window);
  store_options.tiers = tiers->get();
  store_options.restore_on_attend = absl::GetFlag(FLAGS_restore_on_attend);
  store_options.retry_after_ms =
      static_cast<uint32_t>(absl::GetFlag(FLAGS_retry_after_ms));
  SequenceStore store(device->get(), allocator->get(), store_options);
  WorkerCore core(&store, device->get());
  // A worker of a cluster with tokens (--token_file) serves only calls
  // carrying the manager's capabilities, from its first call on.
  std::string token;
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> read =
        triax::ReadBearerToken("token_file", path);
    if (!read.ok()) return Fail(2, read.status().message());
    token = *std::move(read);
  }
  triax::CapabilityVerifier capabilities(
      +[]() -> int64_t { return absl::ToUnixMillis(absl::Now()); });
  WorkerServiceOptions service_options;
  if (!token.empty()) {
    capabilities.Require();
    service_options.capabilities = &capabilities;
  }
  service_options.testing_corrupt_export_pages =
      static_cast<uint32_t>(absl::GetFlag(FLAGS_testing_corrupt_export_pages));
  service_options.transfer_path = transfer_path;
  service_options.device = device->get();
  if (transfer_path == TransferPath::kIpc && (*device)->ShareDomain().empty()) {
    return Fail(1, absl::StrCat("--transfer_path=ipc: the ", (*device)->Name(),
                                " backend cannot share its arena"));
  }
  const bool cuda = std::string((*device)->Name()) == "cuda";
  // The CPU workers' TCP link carries pages without encryption, so with TLS
  // on it is refused; auto already streams over the (TLS) gRPC channel.
  if (transfer_path == TransferPath::kLink && !cuda &&
      (tls->server_enabled() || tls->client_enabled())) {
    return Fail(2,
                "--transfer_path=link: the TCP link between CPU workers is "
                "not encrypted, so it is refused with --tls_cert/--tls_ca; "
                "use stream (over TLS) or ipc (same host)");
  }
  service_options.peer_credentials = triax::ChannelCredentials(*tls);
  service_options.peer_server_name =
      absl::GetFlag(FLAGS_tls_worker_server_name);
  if (transfer_path == TransferPath::kLink ||
      (transfer_path == TransferPath::kAuto && cuda)) {
    LinkOptions link_options;
    link_options.tcp_host = absl::GetFlag(FLAGS_link_host);
    if (link_options.tcp_host.empty()) {
      link_options.tcp_host = HostOf(absl::GetFlag(FLAGS_advertise).empty()
                                         ? absl::GetFlag(FLAGS_listen)
                                         : absl::GetFlag(FLAGS_advertise));
    }
    link_options.nccl_library = absl::GetFlag(FLAGS_nccl_library);
    if (absl::Status s = (*device)->EnableLinks(link_options); !s.ok()) {
      if (transfer_path == TransferPath::kLink) {
        return Fail(
            1, absl::StrCat("--transfer_path=link: ", s.message(),
                            cuda ? " (--nccl_library)" : " (--link_host)"));
      }
      triax::Log(triax::LogLevel::kInfo, "worker",
                 "no NCCL links; transfers use ipc or stream",
                 triax::Kv("why", s.message()));
    }
  }
  if (tls->server_enabled() && tls->client_enabled()) {
    // The manager's plans and the transfers' page pulls come from the
    // manager's and the workers' certificates; frontends only hold their
    // own sequences' pages through the data-plane RPCs. Checked in the
    // handlers of these methods only, so other calls pay nothing.
    const auto add = [&service_options](
                         const std::string& flag,
                         std::initializer_list<const char*> methods) {
      std::vector<std::string> names =
          absl::StrSplit(flag, ',', absl::SkipWhitespace());
      if (names.empty()) return;
      for (const char* m : methods) {
        service_options.certificate_names[m] = names;
      }
    };
    add(absl::GetFlag(FLAGS_tls_manager_names),
        {"Demote", "Spill", "Restore", "Evict", "ImportSequence"});
    add(absl::GetFlag(FLAGS_tls_worker_names),
        {"ExportPages", "SharePages", "OpenLink", "LinkPages"});
  }
  WorkerService service(&core, service_options);

  triax::RpcMetrics rpc_metrics("triaxkv_worker");
  WorkerMetrics metrics(&core);
  // Registered: the manager link (set once it starts) has registered.
  std::atomic<ManagerLink*> registered_link{nullptr};
  WorkerReadiness readiness(
      &core, absl::GetFlag(FLAGS_manager).empty()
                 ? std::function<bool()>()
                 : [&registered_link] {
                     ManagerLink* l = registered_link.load();
                     return l != nullptr && l->registrations() > 0;
                   });

  const std::string listen = absl::GetFlag(FLAGS_listen);
  int port = 0;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials =
      triax::ServerCredentials(*tls);
  builder.AddListeningPort(listen, credentials, &port);
  const std::string local_listen = absl::GetFlag(FLAGS_local_listen);
  mode_t local_mode = 0;
  if (!local_listen.empty()) {
    if (absl::Status s = triax::CheckLocalListen("local_listen", local_listen);
        !s.ok()) {
      return Fail(2, s.message());
    }
    absl::StatusOr<mode_t> mode = triax::ParseSocketMode(
        "local_listen_mode", absl::GetFlag(FLAGS_local_listen_mode));
    if (!mode.ok()) return Fail(2, mode.status().message());
    local_mode = *mode;
    // The socket carries no client certificate: the methods only the
    // manager's or a worker's may call are refused there by their handlers
    // (WorkerServiceOptions::certificate_names).
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
  // gRPC would otherwise bind with SO_REUSEPORT, and a second kvworker on
  // this port would start and split the connections with this one.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&service);
  const uint32_t max_message = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message < (1u << 20) || max_message > INT32_MAX) {
    return Fail(2, absl::StrCat("--max_message_bytes = ", max_message,
                                "; must be 1048576..2147483647"));
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(1, absl::StrCat("cannot listen on --listen=", listen,
                                ": the port is in use or the host is not an "
                                "address of this machine"));
  }
  const std::string bound = absl::StrCat(HostOf(listen), ":", port);
  // The socket file goes with the process, however it ends here.
  absl::Cleanup remove_socket = [&local_listen] {
    triax::RemoveSocket(local_listen);
  };
  if (!local_listen.empty()) {
    if (absl::Status s = triax::RestrictSocket(local_listen, local_mode);
        !s.ok()) {
      server->Shutdown();
      return Fail(1, absl::StrCat("--local_listen: ", s.message()));
    }
  }
  if (server->GetHealthCheckService() == nullptr) {
    server->Shutdown();
    return Fail(1, "the gRPC health service did not start");
  }
  // With a manager, "" stays NOT_SERVING until the first registration.
  const std::string manager = absl::GetFlag(FLAGS_manager);
  HealthReporter health(&core, server->GetHealthCheckService(),
                        /*await_registration=*/!manager.empty());
  health.Start(absl::Seconds(1));
  // Before the port file, so that whoever waits on it finds HTTP up too.
  std::unique_ptr<triax::HttpServer> http;
  if (const std::string http_listen = absl::GetFlag(FLAGS_http_listen);
      !http_listen.empty()) {
    auto started = triax::StartOperatorHttp(
        http_listen, absl::GetFlag(FLAGS_http_port_file),
        {[&] {
           return triax::MetricsResponse({&rpc_metrics.registry(), &metrics});
         },
         [&readiness] { return readiness.Health(); },
         [&readiness] { return readiness.Ready(); },
         {},
         tls->cert_pem,
         tls->key_pem});
    if (!started.ok()) {
      server->Shutdown();
      return Fail(1, started.status().message());
    }
    http = std::move(*started);
  }
  readiness.SetServing(true);

  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    if (absl::Status s = triax::WritePortFile(port_file, port); !s.ok()) {
      server->Shutdown();
      return Fail(1, absl::StrCat("cannot write --port_file: ", s.message()));
    }
  }

  std::unique_ptr<ManagerLink> link;
  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    worker_id = absl::StrCat("worker-", host, "-", port);
  }
  if (!manager.empty()) {
    if (absl::Status s = triax::ValidateId("worker_id", worker_id); !s.ok()) {
      server->Shutdown();
      return Fail(1, s.message());
    }
    ManagerLinkOptions opts;
    opts.manager_address = manager;
    opts.token = token;
    if (capabilities.required()) {
      capabilities.SetWorkerId(worker_id);
      opts.on_capability_key = [&capabilities](const std::string& key) {
        capabilities.SetKey(key);
      };
    }
    opts.worker_id = worker_id;
    opts.advertise_address = absl::GetFlag(FLAGS_advertise).empty()
                                 ? bound
                                 : absl::GetFlag(FLAGS_advertise);
    opts.backend = (*device)->Name();
    opts.capacity_bytes = (*allocator)->capacity();
    opts.host_capacity_bytes =
        (*tiers)->Usage(triax::Tier::kHost).capacity_bytes;
    opts.disk_capacity_bytes =
        (*tiers)->Usage(triax::Tier::kDisk).capacity_bytes;
    opts.on_registered = [&health] { health.MarkRegistered(); };
    opts.credentials = triax::ChannelCredentials(*tls);
    link = NewManagerLink(opts, &core);
    link->Start();
    registered_link.store(link.get());
  }

  std::printf("kvworker listening on %s\n", bound.c_str());
  std::fflush(stdout);
  triax::Log(triax::LogLevel::kInfo, "worker", "serving",
             absl::StrCat(triax::Kv("address", bound), " ",
                          triax::Kv("worker_id", worker_id), " ",
                          triax::Kv("backend", (*device)->Name()), " ",
                          triax::Kv("pool_mb", pool_mb), " ",
                          triax::Kv("frame_kb", frame_kb), " ",
                          triax::Kv("window_tokens", window), " ",
                          triax::Kv("host_tier_mb", host_tier_mb), " ",
                          triax::Kv("disk_tier_dir", (*tiers)->disk_dir()), " ",
                          triax::Kv("manager", manager), " ",
                          triax::Kv("local_listen", local_listen)));

  int sig = 0;
  sigwait(&signals, &sig);
  triax::Log(triax::LogLevel::kInfo, "worker", "shutting down",
             triax::Kv("signal", sig));
  readiness.SetServing(false);
  if (link) link->Stop();
  // NOT_SERVING for the drain, so health probes stop routing here first.
  health.Stop();
  server->GetHealthCheckService()->Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  if (http) http->Stop();
  return 0;
}
