// The helper every simple unary Manager RPC goes through (the handlers in
// manager_service*.cc).
#pragma once

#include <grpcpp/grpcpp.h>

#include "common/grpc_status.h"
#include "kvmanager/manager_service.h"

namespace triax::manager {

// The one helper every simple unary RPC goes through: runs `body` (which
// fills the response and returns a Status) and finishes with the mapped
// status (FinishDurable).
template <typename F>
grpc::ServerUnaryReactor* Unary(ManagerCore* core,
                                grpc::CallbackServerContext* ctx, F&& body) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  FinishDurable(core, reactor, ToGrpcStatus(body()));
  return reactor;
}

}  // namespace triax::manager
