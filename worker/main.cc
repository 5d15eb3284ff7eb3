// kvworker: flags and the gRPC server; everything else lives in
// worker_core / worker_service.
//
// Prints "kvworker listening on HOST:PORT" (HOST as given in --listen, PORT
// the bound one) on stdout once serving; exits 0 on SIGTERM/SIGINT after a
// graceful shutdown, 1 on startup errors.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/port_file.h"
#include "worker/device.h"
#include "worker/manager_link.h"
#include "worker/page_allocator.h"
#include "worker/sequence_store.h"
#include "worker/tier_store.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7071",
          "host:port to serve on; port 0 picks a free port");
ABSL_FLAG(std::string, port_file, "",
          "if set, the bound port is written here (atomically)");
ABSL_FLAG(std::string, manager, "",
          "kvmanager host:port to register with; empty runs standalone");
ABSL_FLAG(std::string, worker_id, "",
          "worker id; default worker-<hostname>-<port>");
ABSL_FLAG(std::string, advertise, "",
          "host:port frontends dial; default the bound listen address");
ABSL_FLAG(int64_t, pool_mb, 1024, "KV page arena size in MiB");
ABSL_FLAG(int32_t, window_tokens, 32,
          "default BF16 recent-window tokens per sequence and layer, unless "
          "AllocatePages names window_tokens (0: seal blocks as soon as they "
          "are full)");
ABSL_FLAG(std::string, backend, "auto",
          "auto | cpu | cuda; auto picks cuda when this build has CUDA and a "
          "CUDA device is visible, else cpu");
ABSL_FLAG(int32_t, cuda_device, 0,
          "CUDA device ordinal for the cuda backend (one worker per GPU)");
ABSL_FLAG(int64_t, host_tier_mb, 256,
          "host spill tier in MiB (pinned memory on CUDA); 0 disables it");
ABSL_FLAG(std::string, disk_tier_dir, "",
          "directory of the disk spill tier (files under "
          "<dir>/<worker_id or pid-N>/); empty disables it");
ABSL_FLAG(int64_t, disk_tier_mb, 4096,
          "disk spill tier capacity in MiB of page bytes");
ABSL_FLAG(bool, restore_on_attend, true,
          "Attend/ReadKV over spilled blocks restore them first; false: "
          "answer UNAVAILABLE with retry_after_ms and restore in the "
          "background");
ABSL_FLAG(int32_t, retry_after_ms, 20,
          "retry delay suggested when restore_on_attend is false");

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "kvworker: %s\n", what.c_str());
  return 1;
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace triax::worker;  // NOLINT

  // Signals are taken synchronously by sigwait below; block them before any
  // thread starts so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const int64_t pool_mb = absl::GetFlag(FLAGS_pool_mb);
  if (pool_mb <= 0) {
    return Fail(absl::StrCat("--pool_mb=", pool_mb, " must be > 0"));
  }
  const int32_t window = absl::GetFlag(FLAGS_window_tokens);
  if (window < 0) {
    return Fail(absl::StrCat("--window_tokens=", window, " must be >= 0"));
  }
  DeviceOptions device_options;
  device_options.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  auto device = CreateDevice(absl::GetFlag(FLAGS_backend), device_options);
  if (!device.ok()) return Fail(std::string(device.status().message()));
  auto allocator =
      PageAllocator::Create(device->get(), static_cast<size_t>(pool_mb) << 20);
  if (!allocator.ok()) return Fail(std::string(allocator.status().message()));
  const int64_t host_tier_mb = absl::GetFlag(FLAGS_host_tier_mb);
  const int64_t disk_tier_mb = absl::GetFlag(FLAGS_disk_tier_mb);
  const int32_t retry_after_ms = absl::GetFlag(FLAGS_retry_after_ms);
  if (host_tier_mb < 0) {
    return Fail(absl::StrCat("--host_tier_mb=", host_tier_mb, " must be >= 0"));
  }
  if (disk_tier_mb < 0) {
    return Fail(absl::StrCat("--disk_tier_mb=", disk_tier_mb, " must be >= 0"));
  }
  if (retry_after_ms < 0) {
    return Fail(
        absl::StrCat("--retry_after_ms=", retry_after_ms, " must be >= 0"));
  }
  TierStoreOptions tier_options;
  tier_options.host_capacity_bytes = static_cast<uint64_t>(host_tier_mb) << 20;
  tier_options.disk_dir = absl::GetFlag(FLAGS_disk_tier_dir);
  tier_options.disk_capacity_bytes = static_cast<uint64_t>(disk_tier_mb) << 20;
  tier_options.owner = absl::GetFlag(FLAGS_worker_id);  // empty: pid-<pid>
  auto tiers = TierStore::Create(device->get(), tier_options);
  if (!tiers.ok()) return Fail(std::string(tiers.status().message()));
  StoreOptions store_options;
  store_options.window_tokens = static_cast<uint32_t>(window);
  store_options.tiers = tiers->get();
  store_options.restore_on_attend = absl::GetFlag(FLAGS_restore_on_attend);
  store_options.retry_after_ms = static_cast<uint32_t>(retry_after_ms);
  SequenceStore store(device->get(), allocator->get(), store_options);
  WorkerService service(&store);

  const std::string listen = absl::GetFlag(FLAGS_listen);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.SetMaxSendMessageSize(256 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::StrCat("cannot listen on --listen=", listen));
  }
  const std::string bound = absl::StrCat(HostOf(listen), ":", port);

  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    if (absl::Status s = triax::WritePortFile(port_file, port); !s.ok()) {
      server->Shutdown();
      return Fail(absl::StrCat("cannot write --port_file: ", s.message()));
    }
  }

  std::unique_ptr<ManagerLink> link;
  const std::string manager = absl::GetFlag(FLAGS_manager);
  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    worker_id = absl::StrCat("worker-", host, "-", port);
  }
  if (!manager.empty()) {
    if (absl::Status s = triax::ValidateId("worker_id", worker_id); !s.ok()) {
      server->Shutdown();
      return Fail(std::string(s.message()));
    }
    ManagerLinkOptions opts;
    opts.manager_address = manager;
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
    link = std::make_unique<ManagerLink>(
        opts,
        [&store] {
          triax::v1::Inventory inv;
          InventoryToProto(store.Inventory(), &inv);
          for (uint64_t id : store.TakeSelfRestored()) {
            inv.add_restored_lineage_ids(id);
          }
          return inv;
        },
        [&store](const std::vector<std::string>& lost) {
          for (const std::string& id : lost) (void)store.Drop(id);
        },
        [&store](const triax::v1::Inventory& unsent) {
          store.ReturnSelfRestored(
              std::vector<uint64_t>(unsent.restored_lineage_ids().begin(),
                                    unsent.restored_lineage_ids().end()));
        });
    link->Start();
  }

  std::printf("kvworker listening on %s\n", bound.c_str());
  std::fflush(stdout);
  triax::Log(triax::LogLevel::kInfo, "worker", "serving",
             absl::StrCat(triax::Kv("address", bound), " ",
                          triax::Kv("worker_id", worker_id), " ",
                          triax::Kv("backend", (*device)->Name()), " ",
                          triax::Kv("pool_mb", pool_mb), " ",
                          triax::Kv("window_tokens", window), " ",
                          triax::Kv("host_tier_mb", host_tier_mb), " ",
                          triax::Kv("disk_tier_dir", (*tiers)->disk_dir()), " ",
                          triax::Kv("manager", manager)));

  int sig = 0;
  sigwait(&signals, &sig);
  triax::Log(triax::LogLevel::kInfo, "worker", "shutting down",
             triax::Kv("signal", sig));
  if (link) link->Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  return 0;
}
