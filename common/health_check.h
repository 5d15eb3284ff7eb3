// A client of the standard gRPC health service (grpc.health.v1.Health/Check)
// for tests and tools. Debian's grpc++ ships no generated health proto, so
// its two one-field messages are encoded here by hand over a generic stub:
//   HealthCheckRequest  { string service = 1; }
//   HealthCheckResponse { ServingStatus status = 1; }  (an enum: a varint)
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"

namespace triax {

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus : int {
  kUnknown = 0,
  kServing = 1,
  kNotServing = 2,
  kServiceUnknown = 3,  // Watch only
};

// The status `channel`'s server reports for `service` ("": the server as a
// whole). The RPC's error otherwise: NOT_FOUND for a service the server has
// no status for, UNIMPLEMENTED when health checking is off.
inline absl::StatusOr<ServingStatus> CheckHealth(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
    absl::Duration timeout = absl::Seconds(5)) {
  if (service.size() > 127) {  // one length byte below
    return absl::InvalidArgumentError(
        absl::StrCat("service name of ", service.size(),
                     " bytes; CheckHealth takes at most 127"));
  }
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');  // field 1, length-delimited
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request_buffer, &response_buffer,
                 [&status, &done](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response_buffer.Dump(&slices).ok()) {
    return absl::InternalError("cannot read the health response");
  }
  std::string response;
  for (const grpc::Slice& s : slices) {
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // proto3 leaves a zero status out: an empty response is UNKNOWN.
  if (response.empty()) return ServingStatus::kUnknown;
  if (response.size() != 2 || response[0] != '\x08' ||
      (response[1] & 0x80) != 0) {
    return absl::InternalError(absl::StrCat("unexpected health response of ",
                                            response.size(), " bytes"));
  }
  return static_cast<ServingStatus>(response[1]);
}

}  // namespace triax
