// The destination's side of a worker-to-worker transfer over gRPC: pulls the
// pages of an ImportRequest from the source worker and installs them into
// the import session as they arrive (WorkerCore's PageFetcher).
//
// Data paths (TransferPath, the kvworker flag --transfer_path):
//   stream  the source's ExportPages stream: every page's bytes travel in
//           PageBatch messages and are copied host to device here;
//   ipc     the source's SharePages stream, for two workers on one host:
//           the source sends its arena's handle once (Device::ShareArena:
//           CUDA IPC, or a memfd on CPU workers) and then each page's
//           offset and CRC32C; this worker maps the arena (cached per
//           source address; a new handle from a restarted source replaces
//           the mapping) and installs each batch device to device with the
//           CRC32C taken during the copy (ImportSession::StartSharedRuns
//           for runs: a batch's copies run while the next batch is
//           received and checked, up to a batch flagged `flush`;
//           ImportSession::InstallShared for a source that sends refs),
//           then tells the source which batches it holds, so the source
//           unpins them;
//   link    a point-to-point link between the two devices (NCCL between
//           CUDA workers, TCP between CPU workers; worker/link_transfer.h):
//           made once per source (OpenLink) and kept while transfers over
//           it succeed; each transfer's page descriptors come on the
//           source's LinkPages stream and its bytes on the link, received
//           into a staging slot and installed with their CRC32Cs checked
//           (ImportSession::InstallShared);
//   auto    ipc when this worker's device shares (Device::ShareDomain is
//           not empty), else link when it has a link backend
//           (Device::LinkBackend), falling back — before any page is
//           installed — when the source cannot share with it (SharePages
//           answers UNIMPLEMENTED: another host or backend, a worker
//           without shared arenas) or its arena cannot be mapped here, or
//           when no link can be made (OpenLink UNIMPLEMENTED: another
//           backend or a worker on another path; NCCL failing to make the
//           communicator), to the next path and finally to stream.
// With --transfer_path=ipc or link there is no fallback: those cases fail
// the import with FAILED_PRECONDITION naming the reason.
//
// Channels are cached by address (one per source worker, reused by later
// transfers); their maximum receive message size is raised above the
// largest batch a source sends (kMaxReceiveBytes). The call's deadline is
// the import's; a stalled source (SIGSTOP) ends it DEADLINE_EXCEEDED, a
// dead or unreachable one UNAVAILABLE (no wait-for-ready: a source that is
// not there fails the call at once). The source's error keeps its
// canonical code; its message names the source ("source worker-a at
// 127.0.0.1:1234: ..."). An error of the session cancels the stream and is
// returned unchanged.
//
// Thread contract: thread-safe; fetches run concurrently.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/device.h"
#include "worker/link_transfer.h"
#include "worker/worker_core.h"

namespace triax::worker {

enum class TransferPath { kAuto, kStream, kIpc, kLink };

// "auto", "stream", "ipc" or "link"; INVALID_ARGUMENT naming the value
// otherwise.
absl::StatusOr<TransferPath> ParseTransferPath(absl::string_view name);
const char* TransferPathName(TransferPath path);

class TransferClient {
 public:
  static constexpr int kMaxReceiveBytes = 64 << 20;

  // `device` (the store's; may be null for the stream path only) must
  // outlive the client; it maps peers' arenas on the ipc path.
  // `link_batch_bytes`: the link path's batch (and staging slot) size,
  // clamped to kLinkBatchBytes (0: kLinkBatchBytes). `credentials`: of the
  // channels to sources (TLS, common/tls.h); null: insecure.
  // `server_name`: with TLS, the name sources' certificates are verified
  // against instead of their address (empty: the address).
  explicit TransferClient(
      Device* device = nullptr, TransferPath path = TransferPath::kStream,
      uint64_t link_batch_bytes = kLinkBatchBytes,
      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
      std::string server_name = "");
  ~TransferClient();

  // Pulls `req`'s pages into `session` (see the header comment); returns
  // the data path used.
  absl::StatusOr<std::string> Fetch(const ImportRequest& req,
                                    absl::Time deadline,
                                    ImportSession* session);

  // A PageFetcher bound to this client (which must outlive it).
  PageFetcher AsFetcher();

 private:
  // A peer's arena mapped here; unmapped when the last user lets go.
  struct PeerArena;
  // The link to one source, held by one transfer at a time.
  struct PeerLink;

  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);
  absl::Status FetchStream(const ImportRequest& req, absl::Time deadline,
                           ImportSession* session);
  // OK(true): every page came over the ipc path. OK(false): the source
  // cannot share with this worker, or its arena cannot be mapped here;
  // nothing was installed and `*why` says why. An error otherwise.
  absl::StatusOr<bool> FetchShared(const ImportRequest& req,
                                   absl::Time deadline, ImportSession* session,
                                   std::string* why);
  absl::StatusOr<std::shared_ptr<PeerArena>> MapPeer(const std::string& address,
                                                     const std::string& handle,
                                                     uint64_t bytes);
  absl::Status SourceError(const ImportRequest& req, const grpc::Status& s);
  // As FetchShared, over a link (made first when there is none).
  absl::StatusOr<bool> FetchLink(const ImportRequest& req, absl::Time deadline,
                                 ImportSession* session, std::string* why);
  // Makes a link to the source: OK(nullptr) with `*why` when the source has
  // no link for this worker or the link cannot be made (OpenLink answers
  // UNIMPLEMENTED or FAILED_PRECONDITION); the source's error when it is
  // gone or misses the deadline.
  absl::StatusOr<std::unique_ptr<LinkEnd>> OpenLinkTo(const ImportRequest& req,
                                                      absl::Time deadline,
                                                      std::string* key,
                                                      std::string* why);

  Device* const device_;
  const uint64_t link_batch_bytes_;
  const TransferPath path_;
  const std::string share_domain_;  // device_->ShareDomain(), or empty
  const std::string link_backend_;  // device_->LinkBackend(), or empty
  // Names this process to sources (OpenLinkRequest.owner).
  const std::string owner_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  const std::string server_name_;  // empty: verify the address

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
  // Source address -> its mapped arena.
  absl::flat_hash_map<std::string, std::shared_ptr<PeerArena>> peers_
      ABSL_GUARDED_BY(mu_);
  // Source address -> the link to it.
  absl::flat_hash_map<std::string, std::shared_ptr<PeerLink>> links_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_link_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace triax::worker
