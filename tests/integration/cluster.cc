#include "tests/integration/cluster.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"

namespace triax::testing {
namespace {

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

std::shared_ptr<grpc::ChannelCredentials> CredentialsOf(
    const ClusterOptions& options) {
  return options.credentials != nullptr ? options.credentials
                                        : grpc::InsecureChannelCredentials();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(
    const ClusterOptions& options) {
  std::unique_ptr<Cluster> c(new Cluster());
  c->options_ = options;
  auto dir = TempDir::Create("triax-it");
  if (!dir.ok()) return dir.status();
  c->dir_ = std::move(*dir);

  std::vector<std::string> manager_args = {
      "--listen=127.0.0.1:0",
      absl::StrCat("--worker_timeout_ms=", options.worker_timeout_ms),
      absl::StrCat("--worker_down_timeout_ms=", options.worker_down_timeout_ms),
      absl::StrCat("--heartbeat_interval_ms=", options.heartbeat_interval_ms),
      absl::StrCat("--metadata=file:", c->dir(), "/metadata")};
  for (const std::string& f : options.manager_flags) {
    manager_args.push_back(absl::StrReplaceAll(f, {{"$DIR", c->dir()}}));
  }
  c->manager_args_ = manager_args;
  auto manager =
      Process::Start("kvmanager", "kvmanager", manager_args, c->dir());
  if (!manager.ok()) return manager.status();
  c->manager_ = std::move(*manager);
  c->stub_ = triax::v1::Manager::NewStub(
      grpc::CreateChannel(c->manager_address(), CredentialsOf(options)));

  for (int i = 0; i < options.num_workers; ++i) {
    std::vector<std::string> worker_args = {
        "--listen=127.0.0.1:0",
        absl::StrCat("--manager=", c->manager_address()),
        absl::StrCat("--worker_id=", WorkerId(i)),
        absl::StrCat("--pool_mb=", options.pool_mb),
        absl::StrCat("--window_tokens=", options.window_tokens)};
    for (const std::string& f : options.worker_flags) {
      worker_args.push_back(absl::StrReplaceAll(f, {{"$DIR", c->dir()}}));
    }
    if (static_cast<size_t>(i) < options.per_worker_flags.size()) {
      for (const std::string& f : options.per_worker_flags[i]) {
        worker_args.push_back(absl::StrReplaceAll(f, {{"$DIR", c->dir()}}));
      }
    }
    auto w = Process::Start(WorkerId(i), "kvworker", worker_args, c->dir());
    if (!w.ok()) return w.status();
    c->workers_.push_back(std::move(*w));
  }
  for (int i = 0; i < options.num_workers; ++i) {
    absl::Status s =
        c->WaitForWorkerState(WorkerId(i), triax::v1::WORKER_STATE_UP);
    if (!s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat(s.message(), "\nworker log:\n", c->workers_[i]->Log(),
                       "\nmanager log:\n", c->manager_->Log()));
    }
  }
  return c;
}

Cluster::~Cluster() {
  // Workers first, so they do not log a lost manager on the way out.
  for (auto& w : workers_) w->Stop();
  if (manager_) manager_->Stop();
}

absl::Status Cluster::RestartManager(bool kill9) {
  const int port = manager_->port();
  if (kill9) {
    manager_->Kill();
  } else {
    manager_->Stop();
  }
  std::vector<std::string> args = manager_args_;
  args[0] = absl::StrCat("--listen=127.0.0.1:", port);
  // A new name: its own log and port file.
  auto manager = Process::Start(absl::StrCat("kvmanager-", ++restarts_),
                                "kvmanager", args, dir());
  if (!manager.ok()) return manager.status();
  manager_ = std::move(*manager);
  stub_ = triax::v1::Manager::NewStub(
      grpc::CreateChannel(manager_address(), CredentialsOf(options_)));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<client::Client>> Cluster::NewClient(
    const std::string& tenant_id) {
  client::ClientOptions o;
  o.manager_address = manager_address();
  o.tenant_id = tenant_id;
  o.rpc_timeout_ms = 5000;
  o.credentials = options_.credentials;
  o.tls_worker_server_name = options_.tls_worker_server_name;
  return client::Client::Connect(o);
}

absl::Status Cluster::CreateTenant(const std::string& tenant_id,
                                   uint64_t device_ceiling_bytes,
                                   const std::string& default_policy) {
  triax::v1::CreateTenantRequest req;
  req.set_request_id(absl::StrCat("create-", tenant_id));
  req.set_tenant_id(tenant_id);
  req.set_default_policy(default_policy);
  if (device_ceiling_bytes > 0) {
    auto* b = req.add_budgets();
    b->set_tier(triax::v1::TIER_DEVICE);
    b->set_floor_bytes(0);
    b->set_ceiling_bytes(device_ceiling_bytes);
  }
  grpc::ClientContext ctx;
  Deadline(&ctx);
  triax::v1::CreateTenantResponse resp;
  return FromGrpcStatus(stub_->CreateTenant(&ctx, req, &resp));
}

absl::StatusOr<triax::v1::WorkerInfo> Cluster::GetWorker(
    const std::string& id) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  triax::v1::ListWorkersResponse resp;
  absl::Status s = FromGrpcStatus(stub_->ListWorkers(&ctx, {}, &resp));
  if (!s.ok()) return s;
  for (const auto& w : resp.workers()) {
    if (w.worker_id() == id) return w;
  }
  return absl::NotFoundError(absl::StrCat("worker ", id, " not listed"));
}

absl::StatusOr<triax::v1::TenantInfo> Cluster::GetTenant(
    const std::string& id) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  triax::v1::ListTenantsResponse resp;
  absl::Status s = FromGrpcStatus(stub_->ListTenants(&ctx, {}, &resp));
  if (!s.ok()) return s;
  for (const auto& t : resp.tenants()) {
    if (t.tenant_id() == id) return t;
  }
  return absl::NotFoundError(absl::StrCat("tenant ", id, " not listed"));
}

absl::Status Cluster::WaitFor(
    const std::string& what, absl::Duration timeout,
    const std::function<absl::StatusOr<bool>()>& probe) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last;
  while (true) {
    absl::StatusOr<bool> r = probe();
    if (r.ok() && *r) return absl::OkStatus();
    if (!r.ok()) last = r.status();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "timed out after ", absl::FormatDuration(timeout), " waiting for ",
          what,
          last.ok() ? "" : absl::StrCat("; last error: ", last.ToString())));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::Status Cluster::WaitForWorkerState(const std::string& id,
                                         triax::v1::WorkerState state,
                                         absl::Duration timeout) {
  return WaitFor(absl::StrCat("worker ", id, " in state ",
                              triax::v1::WorkerState_Name(state)),
                 timeout, [&]() -> absl::StatusOr<bool> {
                   auto w = GetWorker(id);
                   if (!w.ok()) return w.status();
                   return w->state() == state;
                 });
}

}  // namespace triax::testing
