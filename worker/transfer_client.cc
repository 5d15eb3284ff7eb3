#include "worker/transfer_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "triax/v1/worker.grpc.pb.h"
#include "worker/convert.h"

namespace triax::worker {

std::shared_ptr<grpc::Channel> TransferClient::ChannelFor(
    const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReceiveBytes);
  auto channel = grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), args);
  channels_.emplace(address, channel);
  return channel;
}

absl::Status TransferClient::Fetch(
    const ImportRequest& req, absl::Time deadline,
    absl::FunctionRef<absl::Status(const TransferPage&)> install) {
  auto stub = v1::Worker::NewStub(ChannelFor(req.source_address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  const v1::ExportPagesRequest request = ExportRequestFor(req);
  std::unique_ptr<grpc::ClientReader<v1::PageBatch>> reader =
      stub->ExportPages(&ctx, request);
  v1::PageBatch batch;
  absl::Status local;
  while (local.ok() && reader->Read(&batch)) {
    for (v1::PagePayload& payload : *batch.mutable_pages()) {
      local = install(FromProto(&payload));
      if (!local.ok()) break;
    }
  }
  if (!local.ok()) {
    ctx.TryCancel();
    reader->Finish();  // drains the cancelled call
    return local;
  }
  const grpc::Status s = reader->Finish();
  if (s.ok()) return absl::OkStatus();
  std::string message = absl::StrCat(SourceLabel(req), ": ", s.error_message());
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    absl::StrAppend(
        &message, " (the import's timeout_ms=",
        req.timeout_ms == 0 ? kDefaultImportTimeoutMs : req.timeout_ms,
        " passed)");
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), message);
}

PageFetcher TransferClient::AsFetcher() {
  return [this](const ImportRequest& req, absl::Time deadline,
                absl::FunctionRef<absl::Status(const TransferPage&)> install) {
    return Fetch(req, deadline, install);
  };
}

}  // namespace triax::worker
