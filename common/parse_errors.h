// Requests that protobuf cannot parse, answered INVALID_ARGUMENT.
//
// gRPC parses a request before any handler runs; when protobuf refuses it
// (a proto3 `string` field holding invalid UTF-8, or bytes that are not a
// message of the request type) gRPC 1.51 answers UNIMPLEMENTED (callback
// services: the manager) or INTERNAL (sync services: the worker), both with
// an empty message, and nothing of ours sees the bytes. The interceptor of
// ParseErrorInterceptorFactory() replaces that status with INVALID_ARGUMENT
// naming the request type and, for invalid UTF-8, the field
// ("request triax.v1.OpenSequenceRequest: string field
// triax.v1.OpenSequenceRequest.tenant_id is not valid UTF-8 ...").
//
// The field's name comes from protobuf itself: its parser logs
// "String field '<full name>' contains invalid UTF-8 data when parsing ..."
// and returns false, on the thread that then runs the interceptors. A
// protobuf log handler (installed once, forwarding every message to the
// handler it replaces) keeps that name for the thread; the interceptor takes
// it at POST_RECV_MESSAGE, where gRPC hands it a null message for a request
// that did not parse, and rewrites the status at PRE_SEND_STATUS.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <memory>

namespace triax {

// Register first among the server's interceptors (ServerBuilder::
// experimental().SetInterceptorCreators) so that the others see the status
// the client gets.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ParseErrorInterceptorFactory();

}  // namespace triax
