// What a standby kvmanager (--metadata=etcd://..., not leading) serves on
// its --listen address until it leads: every RPC answered UNAVAILABLE with
// "kvmanager SELF is a standby; the leader is at LEADER" (clients and
// workers given several manager addresses move to the leader; the message
// names it when one is known), and the gRPC health service with "" SERVING
// (the process is alive) and "triax.v1.Manager" NOT_SERVING.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace triax::manager {

// The message a standby answers with (clients look for "is a standby").
std::string StandbyMessage(const std::string& self, const std::string& leader);

class StandbyServer {
 public:
  // Binds `listen` exclusively, with the leader's listener's credentials
  // (TLS: a standby answers clients that only speak TLS); INTERNAL naming it
  // when it cannot.
  static absl::StatusOr<std::unique_ptr<StandbyServer>> Start(
      const std::string& listen,
      std::shared_ptr<grpc::ServerCredentials> credentials =
          grpc::InsecureServerCredentials());
  ~StandbyServer();  // Stop()

  int port() const { return port_; }
  void SetSelf(const std::string& self);
  void SetLeader(const std::string& leader);
  // Stops serving and frees the port (the leader's server binds it next).
  void Stop();

 private:
  class Service;
  StandbyServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace triax::manager
