#include "worker/transfer_client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/capability.h"
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
  if (name == "link") return TransferPath::kLink;
  return absl::InvalidArgumentError(absl::StrCat(
      "transfer_path=", Quote(name), " is not one of auto, stream, ipc, link"));
}

const char* TransferPathName(TransferPath path) {
  switch (path) {
    case TransferPath::kAuto:
      return "auto";
    case TransferPath::kStream:
      return "stream";
    case TransferPath::kIpc:
      return "ipc";
    case TransferPath::kLink:
      return "link";
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

struct TransferClient::PeerLink {
  absl::Mutex mu;
  bool busy ABSL_GUARDED_BY(mu) = false;
  // Touched only by the transfer that set busy.
  std::unique_ptr<LinkEnd> end;
  std::string key;
};

namespace {

// The manager's capability for the source's sequence, on a call pulling it.
void SignPull(grpc::ClientContext* ctx, const ImportRequest& req) {
  if (!req.source_capability.empty()) {
    ctx->AddMetadata(kCapabilityMetadata, req.source_capability);
  }
}

std::string ProcessOwner() {
  std::random_device rd;
  return absl::StrCat(HostBootId(), "/", getpid(), "/", rd());
}

// A SharePages stream's acknowledgements, written from their own thread so
// that an install never waits for one: a synchronous Write blocks until the
// transport takes the message, which on a busy host took milliseconds per
// batch. Each write carries the latest count (later ones supersede earlier
// ones not yet written). A failed write ends the thread; Read and Finish
// report why.
class AckSender {
 public:
  using Stream = grpc::ClientReaderWriter<v1::SharePagesRequest, v1::PageBatch>;
  explicit AckSender(Stream* stream)
      : stream_(stream), thread_([this] { Run(); }) {}
  ~AckSender() { Stop(); }
  AckSender(const AckSender&) = delete;
  AckSender& operator=(const AckSender&) = delete;

  void Installed(uint64_t batches) {
    absl::MutexLock lock(&mu_);
    want_ = batches;
  }
  // Writes what is still due (unless the call was cancelled) and joins;
  // afterwards the caller may half-close or finish the stream.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  bool Due() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return want_ > sent_ || stop_;
  }
  void Run() {
    for (;;) {
      uint64_t n = 0;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &AckSender::Due));
        if (want_ == sent_) return;  // stopped with nothing due
        n = want_;
      }
      v1::SharePagesRequest ack;
      ack.set_installed_batches(n);
      if (!stream_->Write(ack)) return;
      absl::MutexLock lock(&mu_);
      sent_ = n;
    }
  }

  Stream* const stream_;
  absl::Mutex mu_;
  uint64_t want_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the fields above exist
};

}  // namespace

TransferClient::TransferClient(
    Device* device, TransferPath path, uint64_t link_batch_bytes,
    std::shared_ptr<grpc::ChannelCredentials> credentials,
    std::string server_name)
    : device_(device),
      link_batch_bytes_(link_batch_bytes == 0
                            ? kLinkBatchBytes
                            : std::min(link_batch_bytes, kLinkBatchBytes)),
      path_(device == nullptr ? TransferPath::kStream : path),
      share_domain_(device == nullptr ? "" : device->ShareDomain()),
      link_backend_(device == nullptr ? "" : device->LinkBackend()),
      owner_(ProcessOwner()),
      credentials_(credentials != nullptr ? std::move(credentials)
                                          : grpc::InsecureChannelCredentials()),
      server_name_(std::move(server_name)) {}

TransferClient::~TransferClient() = default;

std::shared_ptr<grpc::Channel> TransferClient::ChannelFor(
    const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReceiveBytes);
  // Only TLS reads it; a plaintext channel ignores the override.
  if (!server_name_.empty()) args.SetSslTargetNameOverride(server_name_);
  auto channel = grpc::CreateCustomChannel(address, credentials_, args);
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
  const bool try_ipc =
      path_ == TransferPath::kAuto || path_ == TransferPath::kIpc;
  const bool try_link =
      path_ == TransferPath::kAuto || path_ == TransferPath::kLink;
  if (try_ipc && !share_domain_.empty()) {
    std::string why;
    TRIAX_ASSIGN_OR_RETURN(const bool shared,
                           FetchShared(req, deadline, session, &why));
    if (shared) return std::string("ipc");
    if (path_ == TransferPath::kIpc) {
      return absl::FailedPreconditionError(
          absl::StrCat("transfer_path=ipc: ", SourceLabel(req),
                       " cannot share its pages with this worker: ", why));
    }
    Log(LogLevel::kInfo, "worker", "ipc transfer path unavailable",
        absl::StrCat(Kv("sequence_id", req.sequence_id), " ",
                     Kv("source", req.source_address), " ", Kv("why", why)));
  }
  if (path_ == TransferPath::kLink && link_backend_.empty()) {
    return absl::FailedPreconditionError(
        "transfer_path=link: this worker's device has no links enabled");
  }
  if (try_link && !link_backend_.empty()) {
    std::string why;
    TRIAX_ASSIGN_OR_RETURN(const bool linked,
                           FetchLink(req, deadline, session, &why));
    if (linked) return link_backend_;
    if (path_ == TransferPath::kLink) {
      return absl::FailedPreconditionError(
          absl::StrCat("transfer_path=link: no ", link_backend_, " link to ",
                       SourceLabel(req), ": ", why));
    }
    Log(LogLevel::kInfo, "worker", "link transfer path unavailable; streaming",
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
  SignPull(&ctx, req);
  const v1::ExportPagesRequest request = ExportRequestFor(req);
  std::unique_ptr<grpc::ClientReader<v1::PageBatch>> reader =
      stub->ExportPages(&ctx, request);
  v1::PageBatch batch;
  absl::Status local;
  for (;;) {
    const absl::Time wait_start = absl::Now();
    const bool more = reader->Read(&batch);
    session->CountWait(absl::Now() - wait_start);
    if (!more) break;
    for (v1::PagePayload& payload : *batch.mutable_pages()) {
      local = session->Install(FromProto(&payload));
      if (!local.ok()) break;
    }
    if (!local.ok()) break;
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
  SignPull(&ctx, req);
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::SharePagesRequest, v1::PageBatch>>
      stream = stub->SharePages(&ctx);
  v1::SharePagesRequest first;
  *first.mutable_request() = ExportRequestFor(req);
  first.set_share_domain(share_domain_);
  first.set_accepts_runs(true);
  stream->Write(first);  // a failure shows in Finish
  AckSender acks(stream.get());
  std::shared_ptr<PeerArena> arena;
  uint64_t received = 0;
  uint64_t installed = 0;
  absl::Status local;
  bool unmappable = false;
  v1::PageBatch batch;
  std::vector<TransferPage> pages;
  std::vector<SharedRun> runs;
  for (;;) {
    const absl::Time wait_start = absl::Now();
    const bool more = stream->Read(&batch);
    session->CountWait(absl::Now() - wait_start);
    if (!more) break;
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
    runs.clear();
    local = PagesWithoutBytes(&batch, &pages);
    if (local.ok()) local = SharedRunsOf(batch, &runs);
    if (!local.ok()) {
      local = absl::Status(local.code(),
                           absl::StrCat(SourceLabel(req), ": SharePages batch ",
                                        received, ": ", local.message()));
      break;
    }
    // Runs go in a pipeline (the device copies a batch while the next is
    // received and checked) up to a batch flagged `flush`; pages (a source
    // that sends refs) install at once, after the batches in flight.
    received += 1;
    if (!pages.empty()) {
      local = session->InstallShared(pages, arena->base, arena->bytes);
      if (!local.ok()) break;
    }
    if (!runs.empty()) {
      local = session->StartSharedRuns(runs, arena->base, arena->bytes);
      if (!local.ok()) break;
    }
    if (batch.flush() || runs.empty()) {
      local = session->FinishShared();
      if (!local.ok()) break;
    }
    installed = received - session->SharedInFlight();
    acks.Installed(installed);  // a source gone shows in Read / Finish
  }
  if (!local.ok() || unmappable) {
    ctx.TryCancel();
    acks.Stop();
    stream->Finish();  // drains the cancelled call
    if (!local.ok()) return local;
    return false;
  }
  acks.Stop();
  stream->WritesDone();
  const grpc::Status s = stream->Finish();
  if (s.ok()) {
    // (The source ends only once every batch is acknowledged.)
    TRIAX_RETURN_IF_ERROR(session->FinishShared());
    return true;
  }
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE && arena != nullptr) {
    // The source is gone: its arena is not mapped again (a restarted
    // source shares a new one).
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(req.source_address);
    if (it != peers_.end() && it->second == arena) peers_.erase(it);
  }
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED && received == 0) {
    *why = s.error_message();
    return false;
  }
  return SourceError(req, s);
}

absl::StatusOr<std::unique_ptr<LinkEnd>> TransferClient::OpenLinkTo(
    const ImportRequest& req, absl::Time deadline, std::string* key,
    std::string* why) {
  absl::StatusOr<std::string> id = device_->NewLinkId();
  if (!id.ok()) {
    *why = std::string(id.status().message());
    return nullptr;
  }
  {
    absl::MutexLock lock(&mu_);
    *key = absl::StrCat(owner_, "#", ++next_link_);
  }
  // Both ranks join at once: ours on a thread, the source's in OpenLink.
  std::atomic<bool> stop{false};
  absl::StatusOr<std::unique_ptr<DeviceLink>> mine;
  std::thread joiner([&] {
    mine = device_->ConnectLink(*id, 0, deadline, [&] { return stop.load(); });
  });
  auto stub = v1::Worker::NewStub(ChannelFor(req.source_address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  SignPull(&ctx, req);
  v1::OpenLinkRequest open;
  open.set_backend(link_backend_);
  open.set_link_id(*id);
  open.set_link_key(*key);
  open.set_owner(owner_);
  open.set_timeout_ms(static_cast<uint32_t>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now()))));
  v1::OpenLinkResponse opened;
  const grpc::Status s = stub->OpenLink(&ctx, open, &opened);
  if (!s.ok()) stop = true;
  joiner.join();
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED ||
      s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    *why = absl::StrCat("OpenLink: ", s.error_message());
    return nullptr;  // the source has no such link, or could not join it
  }
  if (!s.ok()) return SourceError(req, s);  // gone, stalled past the deadline
  if (!mine.ok()) {
    *why = std::string(mine.status().message());
    return nullptr;
  }
  return std::make_unique<LinkEnd>(device_, *std::move(mine));
}

absl::StatusOr<bool> TransferClient::FetchLink(const ImportRequest& req,
                                               absl::Time deadline,
                                               ImportSession* session,
                                               std::string* why) {
  std::shared_ptr<PeerLink> peer;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<PeerLink>& slot = links_[req.source_address];
    if (slot == nullptr) slot = std::make_shared<PeerLink>();
    peer = slot;
  }
  // One transfer at a time per link: both ends post in the same order.
  {
    absl::MutexLock lock(&peer->mu);
    if (!peer->mu.AwaitWithDeadline(
            absl::Condition(
                +[](PeerLink* p)
                     ABSL_NO_THREAD_SAFETY_ANALYSIS { return !p->busy; },
                peer.get()),
            deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat(SourceLabel(req),
                       ": the link was held by another transfer from "
                       "this source until the import's deadline"));
    }
    peer->busy = true;
  }
  struct Unclaim {
    PeerLink* p;
    ~Unclaim() {
      absl::MutexLock lock(&p->mu);
      p->busy = false;
    }
  } unclaim{peer.get()};

  // A source that lost its end (restarted, dropped it after an error)
  // answers NOT_FOUND before sending anything: one new link, once.
  for (int attempt = 0;; ++attempt) {
    if (peer->end == nullptr) {
      TRIAX_ASSIGN_OR_RETURN(peer->end,
                             OpenLinkTo(req, deadline, &peer->key, why));
      if (peer->end == nullptr) return false;
    }
    LinkEnd* const end = peer->end.get();
    uint8_t* slots[2];
    for (int i = 0; i < 2; ++i) {
      TRIAX_ASSIGN_OR_RETURN(slots[i], end->Slot(i, link_batch_bytes_));
    }
    auto stub = v1::Worker::NewStub(ChannelFor(req.source_address));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    SignPull(&ctx, req);
    std::unique_ptr<
        grpc::ClientReaderWriter<v1::LinkPagesRequest, v1::PageBatch>>
        stream = stub->LinkPages(&ctx);
    v1::LinkPagesRequest first;
    *first.mutable_request() = ExportRequestFor(req);
    first.mutable_request()->set_max_batch_bytes(
        static_cast<uint32_t>(link_batch_bytes_));
    first.set_link_key(peer->key);
    stream->Write(first);  // a failure shows in Finish
    uint64_t batches = 0;
    bool ended = false;  // the source's end marker came
    absl::Status local;
    // Receives run one batch ahead of installs: batch k's bytes arrive on
    // the link while batch k-1 is scattered into its pages (its slot is
    // the other one).
    struct Pending {
      std::vector<TransferPage> pages;
      uint8_t* slot = nullptr;
      uint64_t bytes = 0;
      uint64_t ticket = 0;
      uint64_t index = 0;
    };
    std::optional<Pending> pending;
    auto install = [&](Pending& p) -> absl::Status {
      const absl::Time wait_start = absl::Now();
      absl::Status st = end->link()->Wait(p.ticket, deadline, nullptr);
      session->CountWait(absl::Now() - wait_start);
      if (!st.ok()) {
        return absl::Status(
            st.code(), absl::StrCat(SourceLabel(req), ": batch ", p.index, ": ",
                                    st.message()));
      }
      return session->InstallShared(p.pages, p.slot, p.bytes);
    };
    v1::PageBatch batch;
    for (;;) {
      const absl::Time wait_start = absl::Now();
      const bool more = local.ok() && stream->Read(&batch);
      session->CountWait(absl::Now() - wait_start);
      if (!more) break;
      const uint64_t bytes = batch.link_bytes();
      if (bytes == 0 && batch.pages_size() == 0) {
        ended = true;  // every batch sent; confirmed by half-closing
        break;
      }
      if (bytes == 0 || bytes > link_batch_bytes_) {
        local = absl::InvalidArgumentError(
            absl::StrCat(SourceLabel(req), ": link_bytes=", bytes, " of batch ",
                         batches, " is outside (0, ", link_batch_bytes_, "]"));
        break;
      }
      Pending next;
      next.slot = slots[batches % 2];
      next.bytes = bytes;
      next.index = batches++;
      absl::StatusOr<uint64_t> ticket =
          end->link()->PostRecv(next.slot, bytes, deadline);
      if (!ticket.ok()) {
        local = ticket.status();
        break;
      }
      next.ticket = *ticket;
      local = PagesWithoutBytes(&batch, &next.pages);
      if (!local.ok()) {
        local = absl::Status(
            local.code(), absl::StrCat(SourceLabel(req), ": LinkPages batch ",
                                       next.index, ": ", local.message()));
        break;
      }
      if (pending.has_value()) local = install(*pending);
      pending = std::move(next);
    }
    if (local.ok() && ended && pending.has_value()) local = install(*pending);
    if (!local.ok()) {
      peer->end.reset();  // aborts our end; the source's drops with it
      ctx.TryCancel();
      stream->Finish();  // drains the cancelled call
      return local;
    }
    if (ended) stream->WritesDone();
    const grpc::Status s = stream->Finish();
    if (s.ok() && ended) return true;
    if (s.ok()) {
      peer->end.reset();
      return absl::InternalError(absl::StrCat(
          SourceLabel(req), ": LinkPages ended without its end marker"));
    }
    peer->end.reset();
    if (s.error_code() == grpc::StatusCode::NOT_FOUND && batches == 0 &&
        attempt == 0) {
      continue;
    }
    if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED && batches == 0) {
      *why = s.error_message();
      return false;
    }
    return SourceError(req, s);
  }
}

PageFetcher TransferClient::AsFetcher() {
  return
      [this](const ImportRequest& req, absl::Time deadline,
             ImportSession* session) { return Fetch(req, deadline, session); };
}

}  // namespace triax::worker
