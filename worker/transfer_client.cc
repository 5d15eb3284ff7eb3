#include "worker/transfer_client.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "triax/v1/worker.grpc.pb.h"
#include "worker/convert.h"

namespace triax::worker {

absl::StatusOr<TransferPath> ParseTransferPath(absl::string_view name) {
  if (name == "auto") return TransferPath::kAuto;
  if (name == "stream") return TransferPath::kStream;
  if (name == "ipc") return TransferPath::kIpc;
  return absl::InvalidArgumentError(absl::StrCat(
      "transfer_path=", Quote(name), " is not one of auto, stream, ipc"));
}

const char* TransferPathName(TransferPath path) {
  switch (path) {
    case TransferPath::kAuto:
      return "auto";
    case TransferPath::kStream:
      return "stream";
    case TransferPath::kIpc:
      return "ipc";
  }
  return "?";
}

struct TransferClient::PeerArena {
  Device* device = nullptr;
  std::string handle;
  const uint8_t* base = nullptr;
  uint64_t bytes = 0;
  ~PeerArena() {
    if (device != nullptr && base != nullptr) {
      device->ClosePeerArena(base, bytes);
    }
  }
};

TransferClient::TransferClient(Device* device, TransferPath path)
    : device_(device),
      path_(device == nullptr ? TransferPath::kStream : path),
      share_domain_(device == nullptr ? "" : device->ShareDomain()) {}

TransferClient::~TransferClient() = default;

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

absl::Status TransferClient::SourceError(const ImportRequest& req,
                                         const grpc::Status& s) {
  std::string message = absl::StrCat(SourceLabel(req), ": ", s.error_message());
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    absl::StrAppend(
        &message, " (the import's timeout_ms=",
        req.timeout_ms == 0 ? kDefaultImportTimeoutMs : req.timeout_ms,
        " passed)");
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), message);
}

absl::StatusOr<std::string> TransferClient::Fetch(const ImportRequest& req,
                                                  absl::Time deadline,
                                                  ImportSession* session) {
  if (path_ != TransferPath::kStream && !share_domain_.empty()) {
    std::string why;
    TRIAX_ASSIGN_OR_RETURN(const bool shared,
                           FetchShared(req, deadline, session, &why));
    if (shared) return std::string("ipc");
    if (path_ == TransferPath::kIpc) {
      return absl::FailedPreconditionError(
          absl::StrCat("transfer_path=ipc: ", SourceLabel(req),
                       " cannot share its pages with this worker: ", why));
    }
    Log(LogLevel::kInfo, "worker", "ipc transfer path unavailable; streaming",
        absl::StrCat(Kv("sequence_id", req.sequence_id), " ",
                     Kv("source", req.source_address), " ", Kv("why", why)));
  }
  TRIAX_RETURN_IF_ERROR(FetchStream(req, deadline, session));
  return std::string("stream");
}

absl::Status TransferClient::FetchStream(const ImportRequest& req,
                                         absl::Time deadline,
                                         ImportSession* session) {
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
      local = session->Install(FromProto(&payload));
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
  return SourceError(req, s);
}

absl::StatusOr<std::shared_ptr<TransferClient::PeerArena>>
TransferClient::MapPeer(const std::string& address, const std::string& handle,
                        uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(address);
    if (it != peers_.end() && it->second->handle == handle &&
        it->second->bytes == bytes) {
      return it->second;
    }
  }
  TRIAX_ASSIGN_OR_RETURN(const uint8_t* base,
                         device_->OpenPeerArena(handle, bytes));
  auto arena = std::make_shared<PeerArena>();
  arena->device = device_;
  arena->handle = handle;
  arena->base = base;
  arena->bytes = bytes;
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(address);
  if (it != peers_.end() && it->second->handle == handle &&
      it->second->bytes == bytes) {
    return it->second;  // another fetch mapped it meanwhile; ours unmaps
  }
  // A restarted source has a new arena: the old mapping goes when its last
  // fetch lets go.
  peers_[address] = arena;
  return arena;
}

absl::StatusOr<bool> TransferClient::FetchShared(const ImportRequest& req,
                                                 absl::Time deadline,
                                                 ImportSession* session,
                                                 std::string* why) {
  auto stub = v1::Worker::NewStub(ChannelFor(req.source_address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::SharePagesRequest, v1::PageBatch>>
      stream = stub->SharePages(&ctx);
  v1::SharePagesRequest first;
  *first.mutable_request() = ExportRequestFor(req);
  first.set_share_domain(share_domain_);
  stream->Write(first);  // a failure shows in Finish
  std::shared_ptr<PeerArena> arena;
  uint64_t installed = 0;
  absl::Status local;
  bool unmappable = false;
  v1::PageBatch batch;
  std::vector<TransferPage> pages;
  while (stream->Read(&batch)) {
    if (arena == nullptr) {
      if (!batch.has_arena()) {
        local = absl::InvalidArgumentError(absl::StrCat(
            SourceLabel(req),
            ": the first SharePages batch does not name the source's arena"));
        break;
      }
      absl::StatusOr<std::shared_ptr<PeerArena>> mapped = MapPeer(
          req.source_address, batch.arena().handle(), batch.arena().bytes());
      if (!mapped.ok()) {
        unmappable = true;
        *why = absl::StrCat(
            "its ", batch.arena().backend(),
            " arena cannot be mapped here: ", mapped.status().message());
        break;
      }
      arena = *std::move(mapped);
    }
    pages.clear();
    for (v1::PagePayload& payload : *batch.mutable_pages()) {
      pages.push_back(FromProto(&payload));
    }
    local = session->InstallShared(pages, arena->base, arena->bytes);
    if (!local.ok()) break;
    v1::SharePagesRequest ack;
    ack.set_installed_batches(++installed);
    stream->Write(ack);  // a source gone shows in Read / Finish
  }
  if (!local.ok() || unmappable) {
    ctx.TryCancel();
    stream->Finish();  // drains the cancelled call
    if (!local.ok()) return local;
    return false;
  }
  stream->WritesDone();
  const grpc::Status s = stream->Finish();
  if (s.ok()) return true;
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE && arena != nullptr) {
    // The source is gone: its arena is not mapped again (a restarted
    // source shares a new one).
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(req.source_address);
    if (it != peers_.end() && it->second == arena) peers_.erase(it);
  }
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED && installed == 0) {
    *why = s.error_message();
    return false;
  }
  return SourceError(req, s);
}

PageFetcher TransferClient::AsFetcher() {
  return
      [this](const ImportRequest& req, absl::Time deadline,
             ImportSession* session) { return Fetch(req, deadline, session); };
}

}  // namespace triax::worker
