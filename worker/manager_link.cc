#include "worker/manager_link.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/bearer.h"
#include "common/log.h"
#include "worker/convert.h"

namespace triax::worker {

namespace {

std::string NewIncarnation() {
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd();
  return absl::StrCat(absl::ToUnixMicros(absl::Now()), "-",
                      absl::Hex(r, absl::kZeroPad16));
}

}  // namespace

ManagerLink::ManagerLink(ManagerLinkOptions options, InventoryFn inventory,
                         LostFn on_lost, UnsentFn on_unsent)
    : options_(std::move(options)),
      incarnation_(options_.incarnation.empty() ? NewIncarnation()
                                                : options_.incarnation),
      inventory_(std::move(inventory)),
      on_lost_(std::move(on_lost)),
      on_unsent_(std::move(on_unsent)) {
  addresses_ = absl::StrSplit(options_.manager_address, ',', absl::SkipEmpty());
  if (addresses_.empty()) addresses_.push_back(options_.manager_address);
  for (const std::string& a : addresses_) {
    stubs_.push_back(v1::Manager::NewStub(
        grpc::CreateChannel(a, options_.credentials != nullptr
                                   ? options_.credentials
                                   : grpc::InsecureChannelCredentials())));
  }
}

void ManagerLink::FollowLeader(const grpc::Status& s) {
  if (addresses_.size() < 2) return;
  if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
      s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
    return;
  }
  size_t next = (current_ + 1) % addresses_.size();
  const std::string& m = s.error_message();
  const size_t at = m.find("the leader is at ");
  if (at != std::string::npos) {
    const std::string leader = m.substr(at + 17);
    for (size_t i = 0; i < addresses_.size(); ++i) {
      if (addresses_[i] == leader) next = i;
    }
  }
  if (next != current_) {
    Log(LogLevel::kInfo, "worker", "moving to another manager",
        absl::StrCat(Kv("from", addresses_[current_]), " ",
                     Kv("to", addresses_[next]), " ",
                     Kv("error", s.error_message())));
  }
  current_ = next;
}

ManagerLink::~ManagerLink() { Stop(); }

void ManagerLink::Start() {
  thread_ = std::thread([this] { Run(); });
}

void ManagerLink::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int ManagerLink::registrations() const {
  absl::MutexLock lock(&mu_);
  return registrations_;
}

int ManagerLink::heartbeats() const {
  absl::MutexLock lock(&mu_);
  return heartbeats_;
}

bool ManagerLink::WaitForCounts(int registrations, int heartbeats,
                                absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return registrations_ >= registrations && heartbeats_ >= heartbeats;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
}

bool ManagerLink::WaitStop(int ms) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(ms));
  return stop_;
}

void ManagerLink::Run() {
  const std::string kvs =
      absl::StrCat(Kv("manager", options_.manager_address), " ",
                   Kv("worker_id", options_.worker_id));
  int interval_ms = 0;
  bool registered = false;
  int failures = 0;
  while (true) {
    if (!registered) {
      v1::RegisterWorkerRequest req;
      req.set_request_id(absl::StrCat(options_.worker_id, "-register-",
                                      absl::ToUnixMicros(absl::Now())));
      req.set_worker_id(options_.worker_id);
      req.set_address(options_.advertise_address);
      req.set_backend(options_.backend);
      req.set_capacity_bytes(options_.capacity_bytes);
      req.set_host_capacity_bytes(options_.host_capacity_bytes);
      req.set_disk_capacity_bytes(options_.disk_capacity_bytes);
      req.set_incarnation(incarnation_);
      *req.mutable_inventory() = inventory_();
      v1::RegisterWorkerResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(options_.rpc_deadline_ms));
      AddBearer(&ctx, options_.token);
      const grpc::Status s = stub()->RegisterWorker(&ctx, req, &resp);
      if (!s.ok() && on_unsent_) on_unsent_(req.inventory());
      if (s.ok()) {
        if (!resp.capability_key().empty() && options_.on_capability_key) {
          options_.on_capability_key(resp.capability_key());
        }
        registered = true;
        failures = 0;
        interval_ms = resp.heartbeat_interval_ms() > 0
                          ? static_cast<int>(resp.heartbeat_interval_ms())
                          : options_.default_heartbeat_ms;
        {
          absl::MutexLock lock(&mu_);
          ++registrations_;
        }
        Log(LogLevel::kInfo, "worker", "registered with manager",
            absl::StrCat(
                kvs, " ", Kv("incarnation", incarnation_), " ",
                Kv("heartbeat_ms", interval_ms), " ",
                Kv("lost_sequences", resp.lost_sequence_ids_size()), " ",
                Kv("recovered_sequences", resp.recovered_sequence_ids_size()),
                " ",
                Kv("release_sequences", resp.release_sequence_ids_size())));
        if (resp.lost_sequence_ids_size() > 0 && on_lost_) {
          on_lost_(std::vector<std::string>(resp.lost_sequence_ids().begin(),
                                            resp.lost_sequence_ids().end()));
        }
        if (resp.release_sequence_ids_size() > 0 && on_lost_) {
          on_lost_(std::vector<std::string>(resp.release_sequence_ids().begin(),
                                            resp.release_sequence_ids().end()));
        }
        if (options_.on_registered) options_.on_registered();
      } else {
        // Log the first failure and then every 25th (~5 s), not every retry.
        FollowLeader(s);
        if (failures++ % 25 == 0) {
          Log(LogLevel::kWarn, "worker", "RegisterWorker failed; retrying",
              absl::StrCat(kvs, " ",
                           Kv("code", static_cast<int>(s.error_code())), " ",
                           Kv("error", s.error_message())));
        }
        if (WaitStop(options_.retry_ms)) return;
        continue;
      }
    }
    if (WaitStop(interval_ms)) return;
    v1::HeartbeatRequest req;
    req.set_worker_id(options_.worker_id);
    req.set_incarnation(incarnation_);
    *req.mutable_inventory() = inventory_();
    v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options_.rpc_deadline_ms));
    AddBearer(&ctx, options_.token);
    const grpc::Status s = stub()->Heartbeat(&ctx, req, &resp);
    if (!s.ok() && on_unsent_) on_unsent_(req.inventory());
    if (s.ok()) {
      if (!resp.capability_key().empty() && options_.on_capability_key) {
        options_.on_capability_key(resp.capability_key());
      }
      if (resp.release_sequence_ids_size() > 0) {
        Log(LogLevel::kInfo, "worker",
            "releasing sequences the manager does not hold",
            absl::StrCat(kvs, " ",
                         Kv("sequences",
                            absl::StrJoin(resp.release_sequence_ids(), ","))));
        if (on_lost_) {
          on_lost_(std::vector<std::string>(resp.release_sequence_ids().begin(),
                                            resp.release_sequence_ids().end()));
        }
      }
      absl::MutexLock lock(&mu_);
      ++heartbeats_;
    } else if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      Log(LogLevel::kWarn, "worker",
          "manager does not know this worker; "
          "registering again",
          kvs);
      registered = false;
    } else {
      FollowLeader(s);
      Log(LogLevel::kWarn, "worker", "Heartbeat failed",
          absl::StrCat(kvs, " ", Kv("code", static_cast<int>(s.error_code())),
                       " ", Kv("error", s.error_message())));
    }
  }
}

std::unique_ptr<ManagerLink> NewManagerLink(ManagerLinkOptions options,
                                            WorkerCore* core) {
  return std::make_unique<ManagerLink>(
      std::move(options),
      [core] {
        v1::Inventory inv;
        ToProto(core->Inventory(), &inv);
        for (uint64_t id : core->TakeSelfRestored()) {
          inv.add_restored_lineage_ids(id);
        }
        for (const auto& [id, unix_ms] : core->TakeSealed()) {
          v1::SealedBlock* s = inv.add_sealed_blocks();
          s->set_lineage_id(id);
          s->set_unix_ms(unix_ms);
        }
        return inv;
      },
      [core](const std::vector<std::string>& lost) { core->DropLost(lost); },
      [core](const v1::Inventory& unsent) {
        core->ReturnSelfRestored(
            std::vector<uint64_t>(unsent.restored_lineage_ids().begin(),
                                  unsent.restored_lineage_ids().end()));
        std::vector<std::pair<uint64_t, int64_t>> sealed;
        for (const v1::SealedBlock& s : unsent.sealed_blocks()) {
          sealed.emplace_back(s.lineage_id(), s.unix_ms());
        }
        core->ReturnSealed(sealed);
      });
}

}  // namespace triax::worker
