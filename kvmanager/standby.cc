#include "kvmanager/standby.h"

#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"

namespace triax::manager {

std::string StandbyMessage(const std::string& self, const std::string& leader) {
  return absl::StrCat("kvmanager ", self, " is a standby; ",
                      leader.empty()
                          ? "no leader is known yet (retry)"
                          : absl::StrCat("the leader is at ", leader));
}

class StandbyServer::Service final : public grpc::CallbackGenericService {
 public:
  void SetSelf(const std::string& self) {
    absl::MutexLock lock(&mu_);
    self_ = self;
  }
  void SetLeader(const std::string& leader) {
    absl::MutexLock lock(&mu_);
    leader_ = leader;
  }

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override {
    std::string message;
    std::string leader;
    {
      absl::MutexLock lock(&mu_);
      message = StandbyMessage(self_, leader_);
      leader = leader_;
    }
    if (!leader.empty()) ctx->AddTrailingMetadata("triax-leader", leader);
    return new Refusal(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, std::move(message)));
  }

 private:
  class Refusal final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Refusal(const grpc::Status& s) { Finish(s); }
    void OnDone() override { delete this; }
  };

  absl::Mutex mu_;
  std::string self_ ABSL_GUARDED_BY(mu_);
  std::string leader_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<StandbyServer>> StandbyServer::Start(
    const std::string& listen,
    std::shared_ptr<grpc::ServerCredentials> credentials) {
  std::unique_ptr<StandbyServer> s(new StandbyServer());
  s->service_ = std::make_unique<Service>();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, std::move(credentials), &s->port_);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterCallbackGenericService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::InternalError(absl::StrCat(
        "cannot listen on --listen=", listen,
        ": the port is in use or the host is not an address of this machine"));
  }
  if (grpc::HealthCheckServiceInterface* health =
          s->server_->GetHealthCheckService()) {
    health->SetServingStatus("", true);
    health->SetServingStatus("triax.v1.Manager", false);
  }
  return s;
}

StandbyServer::~StandbyServer() { Stop(); }

void StandbyServer::SetSelf(const std::string& self) {
  service_->SetSelf(self);
}

void StandbyServer::SetLeader(const std::string& leader) {
  service_->SetLeader(leader);
}

void StandbyServer::Stop() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(200));
  server_->Wait();
  server_.reset();
}

}  // namespace triax::manager
