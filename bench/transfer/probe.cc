#include "bench/transfer/probe.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/port_file.h"

namespace triax::bench {
namespace {

namespace pv1 = triax::bench::v1;

constexpr uint32_t kMaxMessageBytes = 64u << 20;

class ProbeService final : public pv1::StreamProbe::Service {
  grpc::Status Stream(grpc::ServerContext* ctx, const pv1::StreamRequest* req,
                      grpc::ServerWriter<pv1::StreamChunk>* writer) override {
    if (req->message_bytes() == 0 || req->message_bytes() > kMaxMessageBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("message_bytes=", req->message_bytes(),
                                       " must be in 1..", kMaxMessageBytes));
    }
    pv1::StreamChunk chunk;
    std::string* data = chunk.mutable_data();
    data->resize(req->message_bytes());
    for (size_t i = 0; i < data->size(); ++i) {
      (*data)[i] = static_cast<char>(i * 131 + 7);
    }
    for (uint64_t sent = 0; sent < req->bytes();) {
      const uint64_t n =
          std::min<uint64_t>(req->message_bytes(), req->bytes() - sent);
      if (n < data->size()) data->resize(n);
      if (ctx->IsCancelled() || !writer->Write(chunk)) {
        return grpc::Status(grpc::StatusCode::CANCELLED,
                            "the client went away");
      }
      sent += n;
    }
    return grpc::Status::OK;
  }
};

}  // namespace

int RunProbeServer(const std::string& listen, const std::string& port_file) {
  ProbeService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "probe server: cannot listen on " << listen << "\n";
    return 1;
  }
  if (!port_file.empty()) {
    absl::Status s = WritePortFile(port_file, port);
    if (!s.ok()) {
      std::cerr << "probe server: " << s << "\n";
      return 1;
    }
  }
  server->Wait();
  return 0;
}

ProbeClient::ProbeClient(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes + (1 << 20));
  stub_ = pv1::StreamProbe::NewStub(grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), args));
}

absl::StatusOr<double> ProbeClient::Stream(uint64_t bytes,
                                           uint32_t message_bytes) {
  pv1::StreamRequest req;
  req.set_bytes(bytes);
  req.set_message_bytes(message_bytes);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub_->Stream(&ctx, req);
  pv1::StreamChunk chunk;
  uint64_t got = 0;
  while (reader->Read(&chunk)) got += chunk.data().size();
  absl::Status s = FromGrpcStatus(reader->Finish());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (!s.ok()) return s;
  if (got != bytes) {
    return absl::InternalError(
        absl::StrCat("probe stream delivered ", got, " of ", bytes, " bytes"));
  }
  return seconds;
}

}  // namespace triax::bench
