// The "link" transfer path between two workers (no gRPC here; the service
// and TransferClient carry the control messages):
//
//   1. The destination makes a link to the source once and keeps it
//      (TransferClient, per source address): Device::NewLinkId as rank 0,
//      the id sent to the source in OpenLink, both ends ConnectLink at the
//      same time. The source keeps its end in a LinkRegistry under the key
//      the destination chose.
//   2. Each transfer (LinkPages) claims the link at both ends — one
//      transfer at a time per link, so the two ends post their operations
//      in the same order. The source exports the pages pinned in place
//      (a shared export), gathers each batch (at most the staging slot's
//      bytes) into one of its two staging slots with the CRC32C of every
//      page taken on the device as it is copied (Device::CopyPagesChecked),
//      sends the batch's page descriptors (offsets in the batch) over the
//      service stream and then the batch's bytes over the link, and reuses
//      a slot once its send completed — so gathering batch k+1 overlaps the
//      send of batch k. The destination receives each batch into its own
//      staging slot — posting batch k's receive before it installs batch
//      k-1 — and installs it with ImportSession::InstallShared
//      (scattered into its pages, every CRC32C checked on the way). When
//      every send completed the source writes an end marker (a batch with
//      no pages and no link bytes); the destination confirms by
//      half-closing the stream, and only then do both ends count the
//      transfer as done (a destination that failed cancels instead).
//   3. Any error at either end aborts the link at that end (the watchdog:
//      a missed deadline aborts it too) and drops it; the other end's next
//      operation fails, and it drops the link as well. The next transfer
//      makes a new one. A link is reused only after a transfer succeeded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/device.h"
#include "worker/link.h"
#include "worker/store_transfer.h"
#include "worker/worker_core.h"

namespace triax::worker {

// Staging slot size of a link (the largest batch), unless a transfer asks
// for less (ExportPagesRequest.max_batch_bytes).
inline constexpr uint64_t kLinkBatchBytes = uint64_t{64} << 20;

// One end of a link with its two staging slots (device memory, allocated
// on first use and kept with the link).
class LinkEnd {
 public:
  LinkEnd(Device* device, std::unique_ptr<DeviceLink> link);
  ~LinkEnd();  // aborts the link here and frees the slots
  LinkEnd(const LinkEnd&) = delete;
  LinkEnd& operator=(const LinkEnd&) = delete;

  DeviceLink* link() const { return link_.get(); }
  // Slot `i` (0 or 1) of at least `bytes` (slots are re-made when a
  // transfer needs larger ones). RESOURCE_EXHAUSTED when the device has no
  // room.
  absl::StatusOr<uint8_t*> Slot(int i, size_t bytes);

 private:
  Device* const device_;
  const std::unique_ptr<DeviceLink> link_;
  uint8_t* slots_[2] = {nullptr, nullptr};
  size_t slot_bytes_ = 0;
};

// The source's links, by the key the destination chose (OpenLink).
class LinkRegistry {
 public:
  // Adds a link; older links of the same owner (an earlier link of that
  // destination process, which it has dropped) are closed.
  void Add(const std::string& key, const std::string& owner,
           std::shared_ptr<LinkEnd> end);
  // Claims the link for one transfer. NOT_FOUND when no link has the key
  // (never made, dropped after an error, or this worker restarted);
  // ABORTED when another transfer holds it.
  absl::StatusOr<std::shared_ptr<LinkEnd>> Claim(const std::string& key);
  // Ends the claim; a link whose transfer failed is dropped.
  void Release(const std::string& key, bool ok);
  size_t size() const;

 private:
  struct Entry {
    std::string owner;
    std::shared_ptr<LinkEnd> end;
    bool busy = false;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> links_ ABSL_GUARDED_BY(mu_);
};

struct LinkSendOptions {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // polled; true ends the send CANCELLED
  uint64_t max_batch_bytes = kLinkBatchBytes;
  // Test hook: every page for which this returns true gets a wrong CRC32C.
  std::function<bool()> corrupt_next;
};

// Receives one batch's page descriptors (shared = true, arena_offset
// relative to the batch's bytes) before those bytes go over the link.
using LinkBatchSink = absl::FunctionRef<absl::Status(
    std::vector<TransferPage>* pages, uint64_t link_bytes)>;

// The source side of one transfer over `end` (see the header comment).
// Returns when every batch was sent and its send completed.
absl::Status SendOverLink(WorkerCore* core, const ExportRequest& req,
                          const LinkSendOptions& options, LinkEnd* end,
                          LinkBatchSink sink);

}  // namespace triax::worker
